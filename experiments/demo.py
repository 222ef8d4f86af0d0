r"""The demo, end to end on the embedded synthetic corpus: base model -> k heads fine-tuned -> decode sweep.

  python -m experiments.demo --workdir=runs/demo

Stages (each one a `python -m bpd.main` run you could type yourself; each skipped when already done, so an
interrupted demo resumes):
  1. train a base Transformer (k = 1)                        runs/demo/base
  2. add k-1 proposal heads and fine-tune all parameters      runs/demo/k4
  3. decode the test split: greedy, and blockwise for every k' and criterion of configs/demo.py
Prints the table; the plots are in runs/demo/k4/decode/.
"""

import os
import sys

from absl import app
from absl import flags
from absl import logging

from bpd import checkpoint
from bpd import evaluate
from bpd import metrics
from bpd import train
from bpd.errors import UserError
from configs import demo

_WORKDIR = flags.DEFINE_string('workdir', 'runs/demo', 'Where the stages write.')
_BASE_STEPS = flags.DEFINE_integer('base_steps', 800, 'Training steps of the base model.')
_HEAD_STEPS = flags.DEFINE_integer('head_steps', 500, 'Fine-tuning steps with k heads.')
_K = flags.DEFINE_integer('k', 4, 'Heads of the fine-tuned model.')


def run(workdir: str, base_steps: int, head_steps: int, k: int) -> list[dict]:
  """Runs the stages that are not done yet; returns the decode records."""
  base_dir, heads_dir = os.path.join(workdir, 'base'), os.path.join(workdir, f'k{k}')
  base = demo.get_config(f'steps={base_steps}')
  if (checkpoint.latest_step(base_dir) or 0) < base_steps:
    logging.info('Stage 1/3: base model -> %s', base_dir)
    train.train_and_evaluate(base, base_dir)
  heads = demo.get_config(f'regime=finetune,k={k},steps={head_steps}')
  heads.train.init_from = base_dir
  heads.train.learning_rate = 3e-4  # fine-tuning: a gentler peak than training from scratch
  if (checkpoint.latest_step(heads_dir) or 0) < head_steps:
    logging.info('Stage 2/3: %d heads, fine-tuned from the base -> %s', k, heads_dir)
    train.train_and_evaluate(heads, heads_dir)
  logging.info('Stage 3/3: decode sweep -> %s', os.path.join(heads_dir, evaluate.DECODE_DIR))
  heads.decode.ks = tuple(sorted({2, max(2, k // 2), k}))
  return evaluate.decode_sweep(heads, heads_dir)


def main(argv):
  del argv
  metrics.quiet_library_logs()
  try:
    run(_WORKDIR.value, _BASE_STEPS.value, _HEAD_STEPS.value, _K.value)
  except UserError as e:
    print(f'error: {e}', file=sys.stderr)
    sys.exit(2)
  out = os.path.join(_WORKDIR.value, f'k{_K.value}', evaluate.DECODE_DIR)
  print(f'\nDemo done. Table: {out}/results.md; plots: {out}/*.png; hypotheses: {out}/*.txt')


if __name__ == '__main__':
  app.run(main)
