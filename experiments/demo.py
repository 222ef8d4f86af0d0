r"""The demo, end to end on the embedded synthetic corpus: base model -> k heads fine-tuned -> decode sweep.

  python -m experiments.demo --workdir=runs/demo

Stages (each one a `python -m bpd.main` run you could type yourself; each skipped when already done, so an
interrupted demo resumes):
  1. train a base Transformer (k = 1)                                       runs/demo/base
  2. add k-1 proposal heads and fine-tune all parameters (the recipe below)  runs/demo/k4
  3. decode the test split: the base model's greedy output (the quality reference), then greedy and blockwise
     for every k' and criterion of configs/demo.py with the fine-tuned model
Prints the table and the base-vs-fine-tuned BLEU on the same sentences; plots are in runs/demo/k4/decode/,
among them acceptance_vs_steps.png (agreement with greedy and the exact block size during stage 2).

The head-training recipe (measured on this corpus: docs/results/demo.md): fresh heads at a high peak rate
(train.head_learning_rate) and the trained base at a low one, with head 1 weighted in the loss
(train.head1_weight), so that the base learns to carry the next tokens for the heads without losing its own
next-token quality.
"""

import os
import sys

from absl import app
from absl import flags
from absl import logging

from bpd import checkpoint
from bpd import decoder as decoder_lib
from bpd import evaluate
from bpd import metrics
from bpd import report
from bpd import train
from bpd.errors import UserError
from configs import demo

_WORKDIR = flags.DEFINE_string('workdir', 'runs/demo', 'Where the stages write.')
_BASE_STEPS = flags.DEFINE_integer('base_steps', demo.BASE_STEPS, 'Training steps of the base model.')
_HEAD_STEPS = flags.DEFINE_integer('head_steps', demo.HEAD_STEPS, 'Fine-tuning steps with k heads.')
_K = flags.DEFINE_integer('k', 4, 'Heads of the fine-tuned model.')


def run(workdir: str, base_steps: int, head_steps: int, k: int) -> list[dict]:
  """Runs the stages that are not done yet; returns the decode records (the base's greedy row first)."""
  base_dir, heads_dir = os.path.join(workdir, 'base'), os.path.join(workdir, f'k{k}')
  base = demo.get_config(f'steps={base_steps}')
  if (checkpoint.latest_step(base_dir) or 0) < base_steps:
    logging.info('Stage 1/3: base model -> %s', base_dir)
    train.train_and_evaluate(base, base_dir)
  heads = demo.get_config(f'regime=finetune,k={k},steps={head_steps}')
  heads.train.init_from = base_dir
  if (checkpoint.latest_step(heads_dir) or 0) < head_steps:
    logging.info('Stage 2/3: %d heads, fine-tuned from the base -> %s', k, heads_dir)
    train.train_and_evaluate(heads, heads_dir)
  out_dir = os.path.join(heads_dir, decoder_lib.DECODE_DIR)
  logging.info('Stage 3/3: decode sweep -> %s', out_dir)
  # The base model decodes greedily (k = 1: the blockwise settings of the config do not apply).
  base_records = evaluate.decode_sweep(base, base_dir)
  heads.decode.ks = tuple(sorted({2, max(2, k // 2), k}))
  records = evaluate.decode_sweep(heads, heads_dir)
  report.plot_acceptance_vs_steps(metrics.read_scalars(heads_dir, 'eval'),
                                  os.path.join(out_dir, 'acceptance_vs_steps.png'),
                                  title=f'demo: {k} heads fine-tuned from the base (val, first 256 sentences)')
  return [{**base_records[0], 'model': 'base'}] + [{**r, 'model': f'k{k}'} for r in records]


def main(argv):
  del argv
  metrics.quiet_library_logs()
  try:
    records = run(_WORKDIR.value, _BASE_STEPS.value, _HEAD_STEPS.value, _K.value)
  except UserError as e:
    print(f'error: {e}', file=sys.stderr)
    sys.exit(2)
  out = os.path.join(_WORKDIR.value, f'k{_K.value}', decoder_lib.DECODE_DIR)
  base_bleu, tuned_bleu = records[0]['quality'], records[1]['quality']
  print(f'\nGreedy BLEU on the same {records[0]["examples"]} test sentences: base {base_bleu:.2f}, fine-tuned '
        f'{tuned_bleu:.2f} ({tuned_bleu - base_bleu:+.2f}).')
  print(f'Demo done. Table: {out}/results.md; plots: {out}/*.png; hypotheses: {out}/*.txt')


if __name__ == '__main__':
  app.run(main)
