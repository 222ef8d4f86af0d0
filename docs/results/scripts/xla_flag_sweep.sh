#!/usr/bin/env bash
# The batch-1 iteration / greedy-step ratio under XLA's CPU options and under bpd's skinny kernel
# (docs/results/benchmark.md, "XLA's CPU options and the skinny kernel"). One process per setting, since XLA reads
# XLA_FLAGS once; random weights; `small` (k = 4, 8 and dynamic:16 at k = 8) and `base` (k = 4, 8).
# Usage: bash docs/results/scripts/xla_flag_sweep.sh OUT_DIR
set -uo pipefail
out=${1:?output folder}
mkdir -p "$out"
settings=(
  "xla-default|xla||"
  "xla-xnnpack|xla|--xla_cpu_use_xnnpack=true --xla_cpu_experimental_ynn_fusion_type=|"
  "xla-onednn|xla|--xla_cpu_use_onednn=true|"
  "xla-xnn-graph-greedy|xla|--xla_cpu_experimental_xnn_graph_fusion_mode=XNN_GRAPH_FUSION_MODE_GREEDY|"
  "xla-eigen-1-thread|xla|--xla_cpu_multi_thread_eigen=false|"
  "xla-no-tiled-emitter|xla|--xla_cpu_disable_tiled_emitter=true|"
  "xla-1-core|xla||taskset -c 0"
  "skinny|skinny||"
  "skinny-1-core|skinny||taskset -c 0 env BPD_SKINNY_THREADS=1"
)
for setting in "${settings[@]}"; do
  IFS='|' read -r name kernel flags prefix <<< "$setting"
  for size in small base; do
    trees=(); ks=4,8
    [[ $size == small ]] && trees=(--trees=dynamic:16)
    echo "== $name $size XLA_FLAGS='$flags' ${prefix}" | tee "$out/$name.$size.txt"
    XLA_FLAGS="$flags" $prefix python -m experiments.bench_decode --config=configs/multi30k_ende.py \
      --config.model.size=$size --config.decode.matmul_kernel=$kernel --ks=$ks --batch_sizes=1 --repeats=5 \
      "${trees[@]}" >> "$out/$name.$size.txt" 2>&1
    echo "rc=$?" >> "$out/$name.$size.txt"
  done
done
