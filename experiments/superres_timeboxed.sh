#!/usr/bin/env bash
# The super-resolution study (experiments/superres_study.py) with every training stage time-boxed, for a
# short lease of one accelerator. Each training stage runs under `timeout`: its SIGTERM makes the training
# loop save a checkpoint and stop (the preemption path, bpd/checkpoint.py PreemptionGuard), so a stage trains
# for a fixed wall time rather than a fixed number of steps; the logs give the steps reached. Then the head
# models are decoded, the fine-tuned one first (the paper's main row), and the tables and grid are written.
# Run it from the repository root:
#
#   experiments/superres_timeboxed.sh WORKDIR BASE_SECONDS FINETUNE_SECONDS FROZEN_SECONDS DECODE_SECONDS \
#       [more superres_study flags, e.g. --config.data.dir=... --ks=10 --batch_sizes=8,1]
#
# Each time box includes start-up and compiling (about 35 s for the base on an H200). A stage that fails
# stops the script with its exit status; one stopped at its time limit (124) lets the next stage go on.
# Rerunning resumes every stage from its checkpoint for another time box. The head models then go on from
# their own copies of the base they started from, not from the base's newer steps: delete WORKDIR/finetune
# and WORKDIR/frozen to retrain them from the newer base.
# PYTHON names the interpreter (default python). The config is configs/celeba_sr.py:gpu unless CONFIG is set.
set -u
if [ $# -lt 5 ]; then
  sed -n '2,17p' "$0" >&2
  exit 2
fi
workdir=$1 base_s=$2 finetune_s=$3 frozen_s=$4 decode_s=$5
shift 5
py=${PYTHON:-python}
config=${CONFIG:-configs/celeba_sr.py:gpu}
study() {
  local seconds=$1
  shift
  echo "== $(date -u +%H:%M:%S) superres_study $* (at most ${seconds}s)"
  # --foreground: Ctrl-C reaches Python. -k: SIGKILL only if saving the checkpoint hangs (it takes seconds).
  # The extra flags come first: this script's own --stages, --regimes and --decode_models win.
  timeout --foreground -s TERM -k 120 "$seconds" "$py" -m experiments.superres_study --config="$config" \
    --workdir="$workdir" "${extra[@]}" "$@"
  local status=$?
  if [ $status -eq 124 ]; then
    echo "== $(date -u +%H:%M:%S) stopped at the time limit (training saves a checkpoint first; decoding keeps" \
      "the batch sizes it finished in WORKDIR/<model>/decode/)"
  elif [ $status -ne 0 ]; then
    echo "== $(date -u +%H:%M:%S) failed with exit status $status" >&2
    exit $status
  fi
}
extra=("$@")
study "$base_s" --stages=base
study "$finetune_s" --stages=heads --regimes=finetune
study "$frozen_s" --stages=heads --regimes=frozen
study "$decode_s" --stages=decode,table --decode_models=finetune,frozen
