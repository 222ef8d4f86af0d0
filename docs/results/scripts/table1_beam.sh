#!/usr/bin/env bash
# Table 1 with the paper's teacher (§6.1): a second base of another seed translates the training sources with
# beam 4; the student heads are trained on that corpus; three ablations at equal steps say which part matters.
# Every stage is a `python -m bpd.main` command; independent stages run at once (an accelerator, or a machine of
# many cores, runs several small models side by side). Every stage resumes or is skipped when its output exists.
#
#   bash docs/results/scripts/table1_beam.sh ROOT [DATA_DIR]       then
#   python docs/results/scripts/table1_beam.py ROOT > table.md
#
# ROOT/base      the student's base (seed 0)             ROOT/teacher   a second base (seed 1)
# ROOT/corpus/{teacher,self}_{beam4,greedy}              the training sources translated by each
# ROOT/{both,distil}_{independent,sequential}            Both / Distillation on the teacher's beam-4 corpus
# ROOT/ablate_{self_greedy,self_beam4,teacher_greedy}_{independent,sequential}   Both on the other corpora
#
# Environment: PY (python), BASE_STEPS (2000), HEAD_STEPS (1200), K (10), DECODE_BATCH (1024; 32 on a CPU),
# TIMING_EXAMPLES (0: time the whole split; acceptance and BLEU do not depend on it), PHASES (1234),
# DISTILL_BATCH (128), ABLATE_TYPES (the head types of the ablations: "independent sequential"), SMOKE=1 (configs' runlocal: a tiny
# model for a few steps, to try the script), ONLY (stage names: run these alone, e.g. ONLY="distill_teacher_beam4" on
# a machine of few cores, where the stages of a phase are better run one after another). Logs: ROOT/logs/*.log.
set -uo pipefail
R=${1:?usage: table1_beam.sh ROOT [DATA_DIR]}
DATA=${2:-../shared/data/multi30k}
PY=${PY:-python}
BASE_STEPS=${BASE_STEPS:-2000}
HEAD_STEPS=${HEAD_STEPS:-1200}
K=${K:-10}
DECODE_BATCH=${DECODE_BATCH:-1024}
PHASES=${PHASES:-1234}
ABLATE_TYPES=${ABLATE_TYPES:-independent sequential}
C=configs/multi30k_ende.py
ARGS=""
[[ "${SMOKE:-0}" == 1 ]] && ARGS=",runlocal"
mkdir -p "$R/logs" "$R/corpus"
FAILED=0

run() {  # run NAME CMD...: one stage, its log in ROOT/logs/NAME.log; skipped when ONLY is set and does not name it
  local name=$1; shift
  [[ -z ${ONLY:-} || " $ONLY " == *" $name "* ]] || return 0
  echo "$(date -u +%T) start $name: $*"
  "$@" >"$R/logs/$name.log" 2>&1
  local rc=$?
  if [[ $rc == 0 ]]; then
    echo "$(date -u +%T) done $name"
  else
    echo "$(date -u +%T) FAILED $name (exit $rc): tail of $R/logs/$name.log"; tail -5 "$R/logs/$name.log"
  fi
  return $rc
}

wait_all() {  # waits for every background stage of a phase; a failed stage stops the script (later phases need it)
  local pid
  for pid in $(jobs -p); do wait "$pid" || FAILED=$((FAILED + 1)); done
  if [[ $FAILED != 0 ]]; then
    echo "$(date -u +%T) $FAILED stage(s) failed: stopping"; exit 1
  fi
}

HC="--config.train.head_learning_rate=3e-3 --config.train.warmup_steps=100 --config.model.dropout_rate=0.0 --config.train.eval_every=400 --config.train.num_steps=$HEAD_STEPS"
FC="--config.train.learning_rate=3e-4 --config.train.head1_weight=7.0 --config.train.eval_every=200"

if [[ $PHASES == *1* ]]; then  # two bases, seeds 0 and 1: the documented base command
  for who in base:0 teacher:1; do
    run "${who%%:*}" $PY -m bpd.main --config=$C:regime=base$ARGS --config.data.dir=$DATA --workdir=$R/${who%%:*} \
      --config.train.num_steps=$BASE_STEPS --config.seed=${who##*:} &
  done
  wait_all
fi

if [[ $PHASES == *2* ]]; then  # the training sources translated: beam 4 (flax wmt's length penalty) and greedy
  for teacher in teacher base; do
    name=$([[ $teacher == base ]] && echo self || echo teacher)
    for beam in 4 1; do
      what=$([[ $beam == 1 ]] && echo greedy || echo beam$beam)
      run "distill_${name}_$what" $PY -m bpd.main --config=$C:regime=base$ARGS --config.data.dir=$DATA --workdir=$R/$teacher \
        --mode=distill --config.distill.beam_size=$beam --config.distill.alpha=0.6 --config.distill.max_len=32 \
        --config.distill.batch_size=${DISTILL_BATCH:-128} --config.distill.out_dir=$R/corpus/${name}_$what &
    done
  done
  wait_all
fi

heads() {  # heads NAME REGIME HEAD_TYPE CORPUS: k heads trained from ROOT/base
  local extra=""
  [[ $2 == finetune ]] && extra=$FC
  run "$1" $PY -m bpd.main --config=$C:k=$K,regime=$2$ARGS --config.data.dir=$DATA --workdir=$R/$1 \
    --config.train.init_from=$R/base --config.data.distilled_from=$R/corpus/$4 \
    --config.model.head_type=$3 $HC $extra
}

if [[ $PHASES == *3* ]]; then
  for type in independent sequential; do
    heads both_$type finetune $type teacher_beam4 &
    heads distil_$type frozen $type teacher_beam4 &
  done
  for type in $ABLATE_TYPES; do
    for corpus in self_greedy self_beam4 teacher_greedy; do
      heads ablate_${corpus}_$type finetune $type $corpus &
    done
  done
  wait_all
fi

if [[ $PHASES == *4* ]]; then  # test and val: greedy, chains and context-aware trees at k' = 2, 4, 8, exact
  for model in "$R"/base "$R"/teacher "$R"/both_* "$R"/distil_* "$R"/ablate_*; do
    [[ -d $model/checkpoints ]] || continue
    name=$(basename "$model")
    [[ -f $model/decode/results.json ]] && continue
    if [[ $name == base || $name == teacher ]]; then
      sweep="--config.decode.ks=(1,) --config.decode.trees=()"
    else
      sweep="--config.decode.ks=(2,4,8) --config.decode.trees=('dynamic:16','dynamic:32')"
    fi
    run "decode_$name" $PY -m bpd.main --config=$C:k=$K$ARGS --config.data.dir=$DATA --workdir=$model --mode=decode \
      --config.decode.splits="('test_2016_flickr','val')" --config.decode.criteria="('exact',)" $sweep \
      --config.decode.batch_sizes="($DECODE_BATCH,)" --config.decode.timing_repeats=1 \
      --config.decode.timing_examples=${TIMING_EXAMPLES:-0} \
      --config.decode.matmul_precision=highest &
  done
  wait_all
fi

echo "$(date -u +%T) phases $PHASES done"
