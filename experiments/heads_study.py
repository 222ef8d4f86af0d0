r"""Independent (the paper's) against sequential (Hydra-style) proposal heads at equal steps, on the demo.

  python -m experiments.heads_study --workdir=runs/heads --plot=docs/heads_demo_block_vs_steps.png
  python -m experiments.heads_study --curves=independent=DIR1,sequential=DIR2 --plot=FIG   # models trained elsewhere

A --curves entry is a k-head model workdir (its metrics.jsonl) or a .jsonl file of its eval rows, which outlives
the model: docs/results/curves/ keeps those of the documented runs, made with
  grep '"prefix": "eval"' WORKDIR/metrics.jsonl > docs/results/curves/NAME.jsonl

Stages (each skipped when done, so an interrupted study resumes; each one a `python -m bpd.main` run):
  1. the demo's base Transformer (k = 1), once                                        WORKDIR/base
  2. k heads fine-tuned from it with the demo's recipe, once per head type, same seed, same steps, same batches:
     model.head_type=independent -> WORKDIR/k4_independent, sequential -> WORKDIR/k4_sequential
     (configs/demo.py:regime=finetune,k=4,head_type=...). The sequential heads' token kernels start at zero, so
     at step 0 both models are the same function (layers.MultiOutput).
  3. the demo's decode sweep of each on the test split (greedy, exact and top_k:2 at k' = 2, 3, 4).
Then, per head type: per-head agreement with greedy on the test split (train.agreement_with_greedy, the
teacher-forced diagnostic), the exact mean accepted block at k' = 2..k and the BLEU (the sweep), and the
training-time curve (exact block and agreement on the first 256 val sentences at every evaluation) drawn for both
head types on one figure (--plot). Prints a markdown table; WORKDIR/heads_study.json holds the numbers.

Reading the agreement of sequential heads: teacher-forced on greedy's tokens, head i + 1 is fed greedy's y_{j+i},
which is what it is fed at decode time exactly when heads 2..i were accepted; so its agreement is the chance that
it is accepted given that the heads before it were. For independent heads it is the unconditional rate.
"""

import json
import os
import sys
import time

from absl import app
from absl import flags
from absl import logging
import matplotlib
matplotlib.use('Agg')
import matplotlib.pyplot as plt  # pylint: disable=g-import-not-at-top

from bpd import checkpoint
from bpd import decoder as decoder_lib
from bpd import evaluate
from bpd import metrics
from bpd import model as model_lib
from bpd import tasks
from bpd import train
from bpd.errors import UserError
from configs import demo

HEAD_TYPES = model_lib.HEAD_TYPES

# Flags exist only when this file runs as a script: importing it (tests, another script) defines none.
if __name__ == '__main__':
  _WORKDIR = flags.DEFINE_string('workdir', 'runs/heads', 'Where the stages write.')
  _BASE_STEPS = flags.DEFINE_integer('base_steps', demo.BASE_STEPS, 'Training steps of the base model.')
  _HEAD_STEPS = flags.DEFINE_integer('head_steps', demo.HEAD_STEPS, 'Fine-tuning steps with k heads, per head type.')
  _K = flags.DEFINE_integer('k', 4, 'Heads of the fine-tuned models.')
  _PLOT = flags.DEFINE_string('plot', '', 'Where to draw exact block and agreement against head-training steps.')
  _CURVES = flags.DEFINE_list(
      'curves', [], 'Only compare the training-time curves of models trained elsewhere, e.g. by the translation study: '
      'independent=DIR,sequential=DIR (each a k-head model workdir with the agreement diagnostic in its '
      'metrics.jsonl, or a .jsonl file of its eval rows, e.g. docs/results/curves/*.jsonl); prints the table of '
      'both curves and draws --plot; trains and decodes nothing.')
  _TITLE = flags.DEFINE_string('title', '', 'The figure title of a --curves comparison.')


def heads_config(head_type, k, steps, base_dir):
  config = demo.get_config(f'regime=finetune,k={k},steps={steps},head_type={head_type}')
  config.train.init_from = base_dir
  config.decode.ks = tuple(range(2, k + 1))
  config.decode.criteria = ('exact', 'top_k:2')
  config.decode.timing_examples = 128  # speed from the first 128 test sentences; acceptance and BLEU from all 500
  return config


def run_stages(workdir, base_steps, head_steps, k) -> dict:
  """Trains and decodes what is not done yet; returns {'base': [records], head_type: [records]} and wall times."""
  base_dir = os.path.join(workdir, 'base')
  base = demo.get_config(f'steps={base_steps}')
  wall = {}
  if (checkpoint.latest_step(base_dir) or 0) < base_steps:
    logging.info('Stage 1/3: base model -> %s', base_dir)
    start = time.time()
    train.train_and_evaluate(base, base_dir)
    wall['base_train_s'] = time.time() - start
  for head_type in HEAD_TYPES:
    heads_dir = os.path.join(workdir, f'k{k}_{head_type}')
    if (checkpoint.latest_step(heads_dir) or 0) < head_steps:
      logging.info('Stage 2/3: %d %s heads, fine-tuned from the base -> %s', k, head_type, heads_dir)
      start = time.time()
      train.train_and_evaluate(heads_config(head_type, k, head_steps, base_dir), heads_dir)
      wall[f'{head_type}_train_s'] = time.time() - start
  records = {}
  start = time.time()
  records['base'] = evaluate.decode_sweep(base, base_dir)[:1]
  for head_type in HEAD_TYPES:
    heads_dir = os.path.join(workdir, f'k{k}_{head_type}')
    logging.info('Stage 3/3: decode sweep -> %s', os.path.join(heads_dir, evaluate.DECODE_DIR))
    records[head_type] = evaluate.decode_sweep(heads_config(head_type, k, head_steps, base_dir), heads_dir)
  wall['decode_s'] = time.time() - start
  return records, wall


def test_agreement(workdir, k, head_steps) -> dict:
  """{head_type: {'agreement_head{i}': fraction}} on the test split, teacher-forced on each model's greedy output."""
  out = {}
  for head_type in HEAD_TYPES:
    heads_dir = os.path.join(workdir, f'k{k}_{head_type}')
    config = heads_config(head_type, k, head_steps, os.path.join(workdir, 'base'))
    task = tasks.for_config(config)
    _, params, _, tokenizer, decoder = evaluate.load_for_decoding(config, heads_dir, task,
                                                                  train.sharding.make_mesh(1))
    src_ids, _, _ = task.decode_examples(config, 'test', tokenizer)
    greedy_ids = decoder_lib.run_batches(lambda src: decoder.greedy(params, src).tokens_BxL, src_ids, 32)[0]
    out[head_type] = train.agreement_with_greedy(train.make_eval_step(decoder.model, label_smoothing=0.0,
                                                                      mesh=decoder.mesh),
                                                 params, src_ids, greedy_ids, 32, decoder.mesh)
  return out


def plot(dirs, k, path, title):
  """Exact block (left) and agreement of heads 2..5 (right) against head-training steps, one colour per head type.

  dirs: {head_type: model workdir}; the curves are the eval rows of each workdir's metrics.jsonl."""
  fig, axes = plt.subplots(1, 2, figsize=(10, 3.8))
  colours = {'independent': 'tab:blue', 'sequential': 'tab:red'}
  for head_type, workdir in dirs.items():
    rows = curve(workdir)
    steps = [r['step'] for r in rows]
    axes[0].plot(steps, [r['exact_block_size'] for r in rows], marker='o', color=colours[head_type],
                 label=head_type)
    for head, style in zip(range(2, k + 1), ('-', '--', ':', '-.')):
      axes[1].plot(steps, [r.get(f'agreement_head{head}', float('nan')) for r in rows], linestyle=style,
                   marker='.', color=colours[head_type], label=f'{head_type} head {head}')
  axes[0].set_ylabel(f'mean accepted block (exact, k={k})')
  axes[1].set_ylabel('agreement with greedy (teacher-forced)')
  axes[0].legend(fontsize=8)
  axes[1].legend(fontsize=7, ncol=2)
  for ax in axes:
    ax.set_xlabel('head-training steps (fine-tuning)')
    ax.grid(alpha=0.3)
  fig.suptitle(title)
  fig.tight_layout()
  fig.savefig(path, dpi=110)
  plt.close(fig)


def curve(workdir) -> list[dict]:
  """The training-time diagnostic of a k-head model: its eval rows that carry the exact block size.
  workdir: the model's workdir, or a .jsonl file of its eval rows (metrics.read_scalars)."""
  return [r for r in metrics.read_scalars(workdir, 'eval') if 'exact_block_size' in r]


def curve_k(workdir) -> int:
  """The heads of a curve's model: from its model.json, or for a .jsonl file the highest head with agreement."""
  if not workdir.endswith('.jsonl'):
    return checkpoint.read_model_config(workdir).k
  return max(int(key[len('agreement_head'):]) for row in curve(workdir) for key in row
             if key.startswith('agreement_head'))


def curves_table(dirs, k) -> str:
  """Exact block and agreement of heads 2 and 3 at every evaluated step, one column group per head type."""
  rows = {head_type: {r['step']: r for r in curve(workdir)} for head_type, workdir in dirs.items()}
  steps = sorted(set().union(*rows.values()))
  lines = ['| step | ' + ' | '.join(f'{t}: exact block k={k} | {t}: head 2 | {t}: head 3' for t in dirs) + ' |',
           '|---' * (1 + 3 * len(dirs)) + '|']
  for step in steps:
    cells = []
    for head_type in dirs:
      r = rows[head_type].get(step)
      cells += ([f"{r['exact_block_size']:.2f}", f"{r.get('agreement_head2', float('nan')):.3f}",
                 f"{r.get('agreement_head3', float('nan')):.3f}"] if r else ['', '', ''])
    lines.append(f'| {step} | ' + ' | '.join(cells) + ' |')
  return '\n'.join(lines)


def table(records, agreement, k) -> str:
  lines = ['| heads | greedy BLEU | ' + ' | '.join(f'exact block k={j}' for j in range(2, k + 1))
           + f' | top_k:2 block k={k} (BLEU) | speedup exact k={k} (b32) | '
           + ' | '.join(f'agreement head {i}' for i in range(2, k + 1)) + ' |',
           '|---' * (2 + (k - 1) + 2 + (k - 1)) + '|']
  base = records['base'][0]
  dashes = ' | '.join('–' for _ in range(2, k + 1))
  lines.append(f"| base (k=1) | {base['quality']:.2f} | {dashes} | – | – | {dashes} |")
  for head_type in HEAD_TYPES:
    rows = {(r['k'], r['criterion']): r for r in records[head_type]}
    greedy = rows[(1, 'greedy')]
    top2 = rows[(k, 'top_k:2')]
    lines.append(f"| {head_type} | {greedy['quality']:.2f} | "
                 + ' | '.join(f"{rows[(j, 'exact')]['mean_accepted_block_size']:.3f}" for j in range(2, k + 1))
                 + f" | {top2['mean_accepted_block_size']:.3f} ({top2['quality']:.2f}) | "
                 + f"{rows[(k, 'exact')]['speedup']:.2f}x | "
                 + ' | '.join(f"{agreement[head_type][f'agreement_head{i}']:.3f}" for i in range(2, k + 1)) + ' |')
  return '\n'.join(lines)


def parse_curves(items) -> dict:
  """['independent=DIR', 'sequential=DIR'] -> {head_type: DIR}, each checked."""
  dirs = {}
  for item in items:
    head_type, sep, workdir = item.partition('=')
    if not sep or head_type not in HEAD_TYPES:
      raise UserError(f'--curves: "{item}" is not HEAD_TYPE=DIR with HEAD_TYPE one of {HEAD_TYPES}; write e.g. '
                      '--curves=independent=runs/a/finetune_distilled,sequential=runs/b/finetune_distilled.')
    if not curve(workdir):
      raise UserError(f'--curves: {metrics.jsonl_path(workdir)} has no eval rows with exact_block_size: '
                      'train the model with a diagnostic (train.eval_every > 0, k > 1) first.')
    dirs[head_type] = workdir
  return dirs


def compare_curves(items, plot_path, title):
  dirs = parse_curves(items)
  k = max(curve_k(workdir) for workdir in dirs.values())
  print(curves_table(dirs, k))
  if plot_path:
    plot(dirs, k, plot_path, title or f'{k} heads: ' + ' vs '.join(dirs) + ' (eval split diagnostic)')


def main(argv):
  del argv
  metrics.quiet_library_logs()
  if _CURVES.value:
    try:
      compare_curves(_CURVES.value, _PLOT.value, _TITLE.value)
    except UserError as e:
      print(f'error: {e}', file=sys.stderr)
      sys.exit(2)
    return
  try:
    records, wall = run_stages(_WORKDIR.value, _BASE_STEPS.value, _HEAD_STEPS.value, _K.value)
    agreement = test_agreement(_WORKDIR.value, _K.value, _HEAD_STEPS.value)
  except UserError as e:
    print(f'error: {e}', file=sys.stderr)
    sys.exit(2)
  dirs = {head_type: os.path.join(_WORKDIR.value, f'k{_K.value}_{head_type}') for head_type in HEAD_TYPES}
  if _PLOT.value:
    plot(dirs, _K.value, _PLOT.value,
         f'demo: {_K.value} heads fine-tuned from one base, independent vs sequential (val, first 256 sentences)')
  curves = {head_type: metrics.read_scalars(heads_dir, 'eval') for head_type, heads_dir in dirs.items()}
  with open(os.path.join(_WORKDIR.value, 'heads_study.json'), 'w') as f:
    json.dump({'records': records, 'test_agreement': agreement, 'curves': curves, 'wall_s': wall}, f, indent=1)
  print(table(records, agreement, _K.value))
  print('wall seconds:', json.dumps(wall))


if __name__ == '__main__':
  app.run(main)
