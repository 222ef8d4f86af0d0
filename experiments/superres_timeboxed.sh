#!/usr/bin/env bash
# The super-resolution study (experiments/superres_study.py) with every training stage time-boxed, for a
# short lease of one accelerator. Each training stage runs under `timeout`: its SIGTERM makes the training
# loop save a checkpoint and stop (the preemption path, bpd/checkpoint.py PreemptionGuard), so a stage trains
# for a fixed wall time rather than a fixed number of steps; the logs give the steps reached. Then the head
# models are decoded, the fine-tuned one first (the paper's main row), and the tables and grid are written.
#
#   experiments/superres_timeboxed.sh WORKDIR BASE_SECONDS FINETUNE_SECONDS FROZEN_SECONDS DECODE_SECONDS \
#       [more superres_study flags, e.g. --config.data.dir=...]
#
# Rerunning resumes: a stage whose time is up goes on from its checkpoint for another time box.
# PYTHON names the interpreter (default python). The config is configs/celeba_sr.py:gpu unless CONFIG is set.
set -u
if [ $# -lt 5 ]; then
  sed -n '2,13p' "$0" >&2
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
  timeout -s TERM -k 30 "$seconds" "$py" -m experiments.superres_study --config="$config" --workdir="$workdir" \
    "$@"
  local status=$?
  echo "== $(date -u +%H:%M:%S) exit status $status (124: stopped at the time limit, with a checkpoint)"
}
study "$base_s" --stages=base "$@"
study "$finetune_s" --stages=heads --regimes=finetune "$@"
study "$frozen_s" --stages=heads --regimes=frozen "$@"
study "$decode_s" --stages=decode,table --decode_models=finetune,frozen "$@"
