r"""The studies, one --plan each, stage by stage; each stage is skipped when its output exists, so an interrupted
study resumes at the stage it was in (training resumes from its checkpoint).

  python -m experiments.study --plan=demo --workdir=runs/demo
  python -m experiments.study --plan=heads --workdir=runs/heads --plot=docs/heads_demo_block_vs_steps.png
  python -m experiments.study --plan=translation --config=configs/multi30k_ende.py --workdir=runs/m30k_study
  python -m experiments.study --plan=superres --config=configs/celeba_sr.py:cpu --workdir=runs/sr_study \
      --base_steps=600 --head_steps=150
  python -m experiments.study --plan=superres --timebox=BASE_S,FINETUNE_S,FROZEN_S,DECODE_S --workdir=W \
      [more superres flags, e.g. --config.data.dir=... --ks=10 --batch_sizes=8,1]

  demo         the demo, end to end on the embedded synthetic corpus: base -> k heads fine-tuned -> decode sweep
  heads        independent (the paper's) against sequential (Hydra-style) proposal heads at equal steps, on the demo
  translation  the paper's translation study (Tables 1-2, §6-§7)
  superres     the paper's super-resolution study (§7.2, CelebA 8x8 -> 32x32, k = 10; Table 2); --timebox runs it
               with every stage time-boxed, for a short lease of one accelerator
Flags that several plans share (--workdir, --config, --stages, --splits, --ks, --criteria, --batch_sizes,
--max_examples, --batch1_examples, --base_steps, --head_steps) take the default of the plan run (PLAN_DEFAULTS).
The plans, in this file's order:

--plan=demo. Stages (each one a `python -m bpd.main` run you could type yourself):
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

--plan=heads.
  python -m experiments.study --plan=heads --curves=independent=DIR1,sequential=DIR2 --plot=FIG   # trained elsewhere
A --curves entry is a k-head model workdir (its metrics.jsonl) or a .jsonl file of its eval rows, which outlives
the model: docs/results/curves/ keeps those of the documented runs, made with
  grep '"prefix": "eval"' WORKDIR/metrics.jsonl > docs/results/curves/NAME.jsonl
Stages (each one a `python -m bpd.main` run):
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

--plan=translation. Stages:
  1. base        a plain Transformer (k = 1)                                    W/base
  2. distill     the base model's beam-search translations of the training set  W/base/distill
  3. heads       k-head models from the base: {frozen, finetune} x {original, distilled}   W/<regime>_<data>
                 (the largest k is trained once; smaller k' decode with its first k' heads, which is exactly
                 a k'-head model with this multi-output layer)
  4. decode      every model on every evaluation split: greedy, and blockwise for k' in --ks and each criterion,
                 at each batch size                                               W/<model>/decode_<split>_b<B>
  5. table       every row: W/study.md, .csv, .json; paper-style pivots (model x criterion by k) W/study_paper.md;
                 the paper's Table 1 layout beside its numbers W/study_table1.md; the agreement diagnostic of each
                 k-head model against its training steps W/study_acceptance_vs_steps_<model>.png;
                 plots per model and of acceptance / speedup across models, W/study_<split>_b<B>_*.png
--stages picks a subset; --grid_regimes / --grid_data cut the grid to fit a time budget.
Evaluation splits come as NAME or NAME@DIR (a split of parallel text in another folder, e.g. the out-of-domain
newstest2013@../shared/data/wmt14).

--plan=superres. Stages:
  1. base    a plain image Transformer (k = 1)                                         W/base
  2. heads   k-head models from the base, one per regime in --regimes (frozen, finetune)   W/<regime>
  3. decode  every model (or those in --decode_models, in that order) on every split: greedy, and blockwise
             for k' in --ks and each criterion (exact, distance:2), at each batch size; PSNR/SSIM against the
             ground truth                                                          W/<model>/decode_<split>
  4. table   W/study.md, W/study.csv, W/study.json, W/study_paper.md (model x criterion by k),
             W/study_table2_<split>_b<batch>.md (the paper's Table 2 layout beside its numbers), plots
             W/study_<split>_b<batch>_<model>.png, and one image
             grid W/study_<split>_grid.png: input, ground truth, and greedy and every setting of each model.
The paper's numbers to compare with (DESIGN §2; k = 10): mean accepted block size 1.10 (frozen, exact),
1.40 (frozen, distance:2), 2.04 (fine-tuned, exact), 6.79 (fine-tuned, distance:2).
--timebox=BASE_S,FINETUNE_S,FROZEN_S,DECODE_S runs the plan as four commands, each under `timeout` for its seconds:
--stages=base, --stages=heads --regimes=finetune, --stages=heads --regimes=frozen, then --stages=decode,table
--decode_models=finetune,frozen (the fine-tuned model first, the paper's main row); the other flags pass on to
each, before these. A training stage's SIGTERM makes the training loop save a checkpoint and stop (the preemption
path, bpd/checkpoint.py PreemptionGuard), so a stage trains for a fixed wall time rather than a fixed number of
steps; the logs give the steps reached. Each time box includes start-up and compiling (about 35 s for the base on
an H200). A stage that fails stops the run with its exit status; one stopped at its time limit (124) lets the next
stage go on. Rerunning resumes every stage from its checkpoint for another time box. The head models then go on from
their own copies of the base they started from, not from the base's newer steps: delete WORKDIR/finetune and
WORKDIR/frozen to retrain them from the newer base. The config is configs/celeba_sr.py:gpu unless --config is given.
"""

import ast
import dataclasses
import datetime
import functools
import json
import os
import subprocess
import sys
import time

from absl import app
from absl import flags
from absl import logging
import matplotlib
matplotlib.use('Agg')
import matplotlib.pyplot as plt  # pylint: disable=g-import-not-at-top
import numpy as np

from bpd import checkpoint
from bpd import decoder as decoder_lib
from bpd import distill
from bpd import errors
from bpd import evaluate
from bpd import evaluate_images
from bpd import metrics
from bpd import model as model_lib
from bpd import report
from bpd import stack
from bpd import tasks
from bpd import train
from bpd.data import images
from bpd.data import pipeline
from bpd.errors import UserError
from configs import common
from configs import demo

PLANS = ('demo', 'heads', 'translation', 'superres')
_DEMO_STEPS = {'base_steps': str(demo.BASE_STEPS), 'head_steps': str(demo.HEAD_STEPS)}
# The flags that several plans share under one name, each plan with its own default (command-line text).
PLAN_DEFAULTS = {
    'demo': {'workdir': 'runs/demo', **_DEMO_STEPS},
    'heads': {'workdir': 'runs/heads', **_DEMO_STEPS},
    'translation': {
        'config': 'configs/multi30k_ende.py', 'workdir': 'runs/m30k_study', 'stages': 'base,distill,heads,decode,table',
        'splits': 'test_2016_flickr,newstest2013@../shared/data/wmt14', 'ks': '1,2,4,6,8,10',
        'criteria': 'exact,top_k:2,min_block:2,min_block:3', 'batch_sizes': '1,32', 'max_examples': '0',
        'batch1_examples': '200', 'base_steps': '0', 'head_steps': '0'},
    'superres': {
        'config': 'configs/celeba_sr.py:cpu', 'workdir': 'runs/sr_study', 'stages': 'base,heads,decode,table',
        'splits': 'val', 'ks': '2,4,10', 'criteria': 'exact,distance:2', 'batch_sizes': '1', 'max_examples': '32',
        'batch1_examples': '0', 'base_steps': '0', 'head_steps': '0'},
}
TIMEBOX_CONFIG = 'configs/celeba_sr.py:gpu'  # --plan=superres --timebox without --config
_defaults = functools.partial(errors.per_mode_help, PLAN_DEFAULTS, option='plan')

# Flags exist only when this file runs as a script: importing it (tests, another script) defines none.
if __name__ == '__main__':
  _PLAN = flags.DEFINE_enum('plan', None, PLANS, 'The study to run (see the module docstring).', required=True)
  _CONFIG = errors.define_config_file('config', None, 'translation, superres: the study config. '
                                      + _defaults('config'))
  _WORKDIR = flags.DEFINE_string('workdir', None, 'Root folder of the study (where the stages write). '
                                 + _defaults('workdir'))
  _BASE_STEPS = flags.DEFINE_integer('base_steps', None, 'Training steps of the base model (translation, superres: '
                                     'override config.train.num_steps, 0 keeps it). ' + _defaults('base_steps'))
  _HEAD_STEPS = flags.DEFINE_integer('head_steps', None, 'Training steps of the k-head models (demo, heads: '
                                     'fine-tuning steps, per head type; translation, superres: override '
                                     'config.train.num_steps, 0 keeps it). ' + _defaults('head_steps'))
  # translation, superres
  _STAGES = flags.DEFINE_list('stages', None, 'Stages to run. ' + _defaults('stages'))
  _SPLITS = flags.DEFINE_list('splits', None, 'Evaluation splits: NAME (in config.data.dir; superres: '
                              'config.data.dir/<split>.npy, or TFDS) or, translation, NAME@DIR. ' + _defaults('splits'))
  _KS = flags.DEFINE_list('ks', None, "Heads k' to decode with (<= config.k). " + _defaults('ks'))
  _CRITERIA = flags.DEFINE_list('criteria', None, 'Acceptance criteria. ' + _defaults('criteria'))
  _BATCH_SIZES = flags.DEFINE_list('batch_sizes', None, 'Decode batch sizes. ' + _defaults('batch_sizes'))
  _MAX_EXAMPLES = flags.DEFINE_integer('max_examples', None, 'Decode at most this many examples (images) per split '
                                       '(0: all). ' + _defaults('max_examples'))
  _BATCH1_EXAMPLES = flags.DEFINE_integer(
      'batch1_examples', None, 'Batch size 1 decodes only the first N examples (0: all): batch-1 rows measure '
      'latency; quality on the whole split comes from the larger batch sizes. ' + _defaults('batch1_examples'))
  # translation
  _GRID_REGIMES = flags.DEFINE_list('grid_regimes', ['frozen', 'finetune'], 'translation: training regimes of the '
                                    'k-head models.')
  _GRID_DATA = flags.DEFINE_list('grid_data', ['original', 'distilled'], 'translation: training data of the k-head '
                                 'models.')
  _MODELS = flags.DEFINE_list('models', [], 'translation: k-head models as REGIME_DATA (e.g. '
                              'finetune_distilled,frozen_original); empty: every grid_regimes x grid_data pair.')
  _TIMING_EXAMPLES = flags.DEFINE_integer('timing_examples', 256, 'translation: time greedy vs blockwise on the '
                                          'first N (0: all).')
  _TIMING_REPEATS = flags.DEFINE_integer('timing_repeats', 3, 'translation: alternating greedy/blockwise timing '
                                         'runs (medians).')
  _OOD = flags.DEFINE_string('ood', 'examples=500,max_len=128,criteria=exact', 'translation: out-of-domain splits '
                             '(NAME@DIR): examples, longest output and criteria (+-joined).')
  _HEAD_CONFIG = flags.DEFINE_list(
      'head_config', [], 'translation: config overrides KEY=VALUE for every k-head model (the head-training '
      'recipe), e.g. train.head_learning_rate=3e-3,model.dropout_rate=0.')
  _FINETUNE_CONFIG = flags.DEFINE_list(
      'finetune_config', [], 'translation: config overrides KEY=VALUE for fine-tuned models only, after '
      '--head_config, e.g. train.learning_rate=3e-4,train.head1_weight=7.')
  _OTHER_HEAD_STEPS = flags.DEFINE_integer(
      'other_head_steps', 0, 'translation: training steps of k-head models other than finetune_distilled ("Both", '
      'the model of the acceptance target; 0: as --head_steps), to fit a time box. Compare them with Both at the '
      'same step through the agreement diagnostic in their metrics.jsonl.')
  _OTHER_CRITERIA = flags.DEFINE_list(
      'other_criteria', [], 'translation: criteria for models other than finetune_distilled ("Both"; empty: '
      '--criteria): the paper reports the top-2 row on "Both" only.')
  # superres
  _REGIMES = flags.DEFINE_list('regimes', ['frozen', 'finetune'], 'superres: training regimes of the k-head models.')
  _DECODE_MODELS = flags.DEFINE_list('decode_models', [], 'superres: models to decode, in this order (default: '
                                     'base, then --regimes). A frozen model decodes greedily exactly as its base '
                                     'does.')
  _TIMEBOX = flags.DEFINE_list('timebox', [], 'superres: BASE_S,FINETUNE_S,FROZEN_S,DECODE_S: run the stages as '
                               'four commands, each time-boxed (module docstring). Empty: no time box.')
  # demo, heads
  _K = flags.DEFINE_integer('k', 4, 'demo, heads: heads of the fine-tuned model(s).')
  _PLOT = flags.DEFINE_string('plot', '', 'heads: where to draw exact block and agreement against head-training '
                              'steps.')
  _CURVES = flags.DEFINE_list(
      'curves', [], 'heads: only compare the training-time curves of models trained elsewhere, e.g. by the '
      'translation study: independent=DIR,sequential=DIR (each a k-head model workdir with the agreement diagnostic '
      'in its metrics.jsonl, or a .jsonl file of its eval rows, e.g. docs/results/curves/*.jsonl); prints the table '
      'of both curves and draws --plot; trains and decodes nothing.')
  _TITLE = flags.DEFINE_string('title', '', 'heads: the figure title of a --curves comparison.')


# -- the stages every plan shares --------------------------------------------------------------------------------------

def done_training(workdir, steps):
  return (checkpoint.latest_step(workdir) or 0) >= steps


def train_stage(stage: str, config, workdir) -> bool:
  """Trains `config` in workdir unless it is done; False when training stopped before its last step (preemption,
  Ctrl-C, a time box's SIGTERM): the later stages must not run on a half-trained model."""
  if done_training(workdir, config.train.num_steps):
    return True
  logging.info('Stage %s -> %s', stage, workdir)
  train.train_and_evaluate(config, workdir)
  if done_training(workdir, config.train.num_steps):
    return True
  logging.warning('Stage %s stopped before its last step (%s); rerun the same command to resume it.', stage, workdir)
  return False


def decode_into(config, workdir, out) -> None:
  """The decode sweep of the model in workdir, moved to `out` (a study keeps one folder per split and batch)."""
  evaluate.decode_sweep(config, workdir)
  os.replace(os.path.join(workdir, decoder_lib.DECODE_DIR), out)


def decode_rows(dirs: dict, folders) -> list[dict]:
  """The records of every W/<model>/<folder>/results.json there is, each with its 'model'; folders(workdir) names
  the folders of one model."""
  rows = []
  for name, workdir in dirs.items():
    for folder in folders(workdir):
      path = os.path.join(workdir, folder, 'results.json')
      if os.path.exists(path):
        with open(path) as f:
          rows += [{'model': name, **r} for r in json.load(f)]
  return rows


# -- --plan=demo: base -> k heads fine-tuned -> decode sweep on the synthetic corpus -----------------------------------

def run_demo(workdir: str, base_steps: int, head_steps: int, k: int) -> list[dict]:
  """Runs the stages that are not done yet; returns the decode records (the base's greedy row first)."""
  base_dir, heads_dir = os.path.join(workdir, 'base'), os.path.join(workdir, f'k{k}')
  base = demo.get_config(f'steps={base_steps}')
  train_stage('1/3: base model', base, base_dir)
  heads = demo.get_config(f'regime=finetune,k={k},steps={head_steps}')
  heads.train.init_from = base_dir
  train_stage(f'2/3: {k} heads, fine-tuned from the base', heads, heads_dir)
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


def main_demo():
  records = run_demo(_WORKDIR.value, _BASE_STEPS.value, _HEAD_STEPS.value, _K.value)
  out = os.path.join(_WORKDIR.value, f'k{_K.value}', decoder_lib.DECODE_DIR)
  base_bleu, tuned_bleu = records[0]['quality'], records[1]['quality']
  print(f'\nGreedy BLEU on the same {records[0]["examples"]} test sentences: base {base_bleu:.2f}, fine-tuned '
        f'{tuned_bleu:.2f} ({tuned_bleu - base_bleu:+.2f}).')
  print(f'Demo done. Table: {out}/results.md; plots: {out}/*.png; hypotheses: {out}/*.txt')


# -- --plan=heads: independent against sequential heads at equal steps -------------------------------------------------

HEAD_TYPES = model_lib.HEAD_TYPES


def heads_config(head_type, k, steps, base_dir):
  config = demo.get_config(f'regime=finetune,k={k},steps={steps},head_type={head_type}')
  config.train.init_from = base_dir
  config.decode.ks = tuple(range(2, k + 1))
  config.decode.criteria = ('exact', 'top_k:2')
  config.decode.timing_examples = 128  # speed from the first 128 test sentences; acceptance and BLEU from all 500
  return config


def run_heads(workdir, base_steps, head_steps, k) -> dict:
  """Trains and decodes what is not done yet; returns {'base': [records], head_type: [records]} and wall times."""
  base_dir = os.path.join(workdir, 'base')
  base = demo.get_config(f'steps={base_steps}')
  wall = {}
  stages = [('base', '1/3: base model', base, base_dir)] + [
      (head_type, f'2/3: {k} {head_type} heads, fine-tuned from the base', heads_config(head_type, k, head_steps,
                                                                                       base_dir),
       os.path.join(workdir, f'k{k}_{head_type}')) for head_type in HEAD_TYPES]
  for name, stage, config, directory in stages:
    if not done_training(directory, config.train.num_steps):
      start = time.time()
      train_stage(stage, config, directory)
      wall[f'{name}_train_s'] = time.time() - start
  records = {}
  start = time.time()
  records['base'] = evaluate.decode_sweep(base, base_dir)[:1]
  for head_type in HEAD_TYPES:
    heads_dir = os.path.join(workdir, f'k{k}_{head_type}')
    logging.info('Stage 3/3: decode sweep -> %s', os.path.join(heads_dir, evaluate.DECODE_DIR))
    records[head_type] = evaluate.decode_sweep(heads_config(head_type, k, head_steps, base_dir), heads_dir)
  wall['decode_s'] = time.time() - start
  return records, wall


def agreement_on_test(workdir, k, head_steps) -> dict:
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


def plot_curves(dirs, k, path, title):
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
  report.save_figure(fig, path, title)


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
  table = []
  for step in steps:
    cells = {'step': step}
    for t in dirs:
      r = rows[t].get(step)
      if r:  # else empty cells: a step only the other model reached
        cells.update({f'{t} block': f"{r['exact_block_size']:.2f}",
                      **{f'{t} head{i}': f"{r.get(f'agreement_head{i}', float('nan')):.3f}" for i in (2, 3)}})
    table.append(cells)
  columns = [('step', 'step', '{}')]
  for t in dirs:
    columns += [(f'{t} block', f'{t}: exact block k={k}', '{}'), (f'{t} head2', f'{t}: head 2', '{}'),
                (f'{t} head3', f'{t}: head 3', '{}')]
  return report.markdown_table(table, columns)


def heads_table(records, agreement, k) -> str:
  """Per head type: greedy BLEU, the exact block at k' = 2..k, top_k:2 at k, the speedup and each head's agreement;
  the base's greedy BLEU first."""
  rows = [{'heads': 'base (k=1)', 'greedy': records['base'][0]['quality']}]
  for head_type in HEAD_TYPES:
    by_setting = {(r['k'], r['criterion']): r for r in records[head_type]}
    top2 = by_setting[(k, 'top_k:2')]
    rows.append({'heads': head_type, 'greedy': by_setting[(1, 'greedy')]['quality'],
                 **{f'exact{j}': by_setting[(j, 'exact')]['mean_accepted_block_size'] for j in range(2, k + 1)},
                 'top2': f"{top2['mean_accepted_block_size']:.3f} ({top2['quality']:.2f})",
                 'speedup': by_setting[(k, 'exact')]['speedup'],
                 **{f'agreement{i}': agreement[head_type][f'agreement_head{i}'] for i in range(2, k + 1)}})
  dash = lambda key, spec: lambda r: format(r[key], spec) if key in r else '–'  # the base has no heads
  columns = [('heads', 'heads', '{}'), ('greedy', 'greedy BLEU', '{:.2f}')]
  columns += [(None, f'exact block k={j}', dash(f'exact{j}', '.3f')) for j in range(2, k + 1)]
  columns += [(None, f'top_k:2 block k={k} (BLEU)', dash('top2', '')),
              (None, f'speedup exact k={k} (b32)', lambda r: f"{r['speedup']:.2f}x" if 'speedup' in r else '–')]
  columns += [(None, f'agreement head {i}', dash(f'agreement{i}', '.3f')) for i in range(2, k + 1)]
  return report.markdown_table(rows, columns)


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
    plot_curves(dirs, k, plot_path, title or f'{k} heads: ' + ' vs '.join(dirs) + ' (eval split diagnostic)')


def main_heads():
  if _CURVES.value:
    compare_curves(_CURVES.value, _PLOT.value, _TITLE.value)
    return
  workdir, k = _WORKDIR.value, _K.value
  records, wall = run_heads(workdir, _BASE_STEPS.value, _HEAD_STEPS.value, k)
  agreement = agreement_on_test(workdir, k, _HEAD_STEPS.value)
  dirs = {head_type: os.path.join(workdir, f'k{k}_{head_type}') for head_type in HEAD_TYPES}
  if _PLOT.value:
    plot_curves(dirs, k, _PLOT.value,
                f'demo: {k} heads fine-tuned from one base, independent vs sequential (val, first 256 sentences)')
  curves = {head_type: metrics.read_scalars(heads_dir, 'eval') for head_type, heads_dir in dirs.items()}
  with open(os.path.join(workdir, 'heads_study.json'), 'w') as f:
    json.dump({'records': records, 'test_agreement': agreement, 'curves': curves, 'wall_s': wall}, f, indent=1)
  print(heads_table(records, agreement, k))
  print('wall seconds:', json.dumps(wall))


# -- --plan=translation: the paper's Tables 1-2 on translation ---------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class TranslationPlan:
  """What --plan=translation runs: its flags, as one value the stage functions take."""
  stages: tuple = ('base', 'distill', 'heads', 'decode', 'table')
  regimes: tuple = ('frozen', 'finetune')
  data: tuple = ('original', 'distilled')
  splits: tuple = ('test_2016_flickr',)
  ks: tuple = (1, 2, 4, 6, 8, 10)
  criteria: tuple = ('exact', 'top_k:2')
  batch_sizes: tuple = (1, 32)
  max_examples: int = 0
  batch1_examples: int = 0
  timing_examples: int = 0
  timing_repeats: int = 3
  ood: str = 'examples=500,max_len=128,criteria=exact'
  base_steps: int = 0
  head_steps: int = 0
  other_head_steps: int = 0  # steps of k-head models other than finetune_distilled; 0: head_steps
  head_config: tuple = ()  # KEY=VALUE overrides of every k-head model
  finetune_config: tuple = ()  # KEY=VALUE overrides of fine-tuned models, after head_config
  other_criteria: tuple = ()  # criteria of models other than finetune_distilled; empty: criteria
  models: tuple = ()  # REGIME_DATA names; empty: every regime x data pair

  def head_models(self) -> list[tuple[str, str]]:
    """(regime, data) of every k-head model of the study, in training order."""
    if self.models:
      pairs = [tuple(m.split('_', 1)) for m in self.models]
      bad = [m for m, p in zip(self.models, pairs) if len(p) != 2 or p[0] not in ('frozen', 'finetune')
             or p[1] not in ('original', 'distilled')]
      if bad:
        raise UserError(f'--models={",".join(bad)}: each model is REGIME_DATA with REGIME frozen|finetune and '
                        'DATA original|distilled, e.g. --models=finetune_distilled,frozen_original.')
      return pairs
    return [(r, d) for r in self.regimes for d in self.data]

  @classmethod
  def from_flags(cls):
    return cls(stages=tuple(_STAGES.value), regimes=tuple(_GRID_REGIMES.value), data=tuple(_GRID_DATA.value),
               splits=tuple(_SPLITS.value), ks=tuple(int(k) for k in _KS.value), criteria=tuple(_CRITERIA.value),
               batch_sizes=tuple(int(b) for b in _BATCH_SIZES.value), max_examples=_MAX_EXAMPLES.value,
               batch1_examples=_BATCH1_EXAMPLES.value, timing_examples=_TIMING_EXAMPLES.value,
               timing_repeats=_TIMING_REPEATS.value, ood=_OOD.value, base_steps=_BASE_STEPS.value,
               head_steps=_HEAD_STEPS.value, other_head_steps=_OTHER_HEAD_STEPS.value,
               head_config=tuple(_HEAD_CONFIG.value), finetune_config=tuple(_FINETUNE_CONFIG.value),
               other_criteria=tuple(_OTHER_CRITERIA.value), models=tuple(_MODELS.value))


def parse_overrides(items, flag) -> dict:
  """KEY=VALUE strings -> {dotted key: value}; values are Python literals where they parse, else strings."""
  fields = {}
  for item in items:
    key, sep, text = item.partition('=')
    if not sep or not key:
      raise UserError(f'--{flag}: "{item}" is not KEY=VALUE; write e.g. --{flag}=train.learning_rate=3e-4.')
    try:
      fields[key] = ast.literal_eval(text)
    except (ValueError, SyntaxError):
      fields[key] = text
  return fields


def head_model_config(cfg, plan, regime, data='distilled'):
  """A k-head model's config: --head_steps (--other_head_steps), then --head_config, then (fine-tuning)
  --finetune_config."""
  steps = plan.head_steps
  if plan.other_head_steps and (regime, data) != ('finetune', 'distilled'):
    steps = plan.other_head_steps
  fields = {'train.num_steps': steps} if steps else {}
  fields.update(parse_overrides(plan.head_config, 'head_config'))
  if regime == 'finetune':
    fields.update(parse_overrides(plan.finetune_config, 'finetune_config'))
  for key in fields:  # a ConfigDict would silently add a misspelt field
    *path, last = key.split('.')
    node = cfg
    for part in path:
      node = node.get(part) if hasattr(node, 'get') else None
    if not hasattr(node, 'get') or last not in node:
      raise UserError(f'--head_config/--finetune_config: {key} is not a config field; keys are dotted fields of '
                      'configs/common.py, e.g. train.learning_rate.')
  try:
    return common.override(cfg, **fields)
  except (KeyError, AttributeError, TypeError) as e:
    raise UserError(f'--head_config/--finetune_config {fields}: {e}. Keys are dotted config fields '
                    '(configs/common.py), values of their type.') from e


def translation_dirs(root, plan):
  return {'base': os.path.join(root, 'base'),
          **{f'{r}_{d}': os.path.join(root, f'{r}_{d}') for r, d in plan.head_models()}}


def run_translation(config, root, plan: TranslationPlan):
  plan.head_models()  # a bad --models or override fails here, before anything trains
  for regime in ('frozen', 'finetune'):
    head_model_config(config, plan, regime)
  base_dir = os.path.join(root, 'base')
  base_cfg = common.override(config, **{'train.regime': 'base', 'train.init_from': '', 'data.distilled_from': ''})
  if plan.base_steps:
    base_cfg.train.num_steps = plan.base_steps
  stages = set(plan.stages)
  if 'base' in stages and not train_stage('base', base_cfg, base_dir):
    return
  if 'distill' in stages and any(d == 'distilled' for _, d in plan.head_models()) and not os.path.exists(
      os.path.join(base_dir, pipeline.DISTILL_DIR, f'train.{config.data.tgt_lang}')):
    logging.info('Stage distill -> %s', os.path.join(base_dir, pipeline.DISTILL_DIR))
    distill.distill(base_cfg, base_dir)
  if 'heads' in stages:
    for regime, data in plan.head_models():
      cfg = common.override(config, **{'train.regime': regime, 'train.init_from': base_dir,
                                       'data.distilled_from': base_dir if data == 'distilled' else ''})
      if not train_stage(f'heads: {regime} on {data} data', head_model_config(cfg, plan, regime, data),
                         os.path.join(root, f'{regime}_{data}')):
        return
  if 'decode' in stages:
    for name, workdir in translation_dirs(root, plan).items():
      for split in plan.splits:
        decode_translation(config, name, workdir, split, plan)
  if 'table' in stages:
    write_translation_table(root, plan)


def decode_translation(config, name, workdir, split, plan):
  """One model on one split, one decode sweep per batch size, into W/<model>/decode_<split>_b<B>/."""
  split_name, _, split_dir = split.partition('@')
  model_k = checkpoint.read_model_config(workdir).k
  ks = tuple(k for k in plan.ks if k <= model_k)
  criteria = plan.criteria if name == 'finetune_distilled' or not plan.other_criteria else plan.other_criteria
  max_examples, max_len = plan.max_examples, config.decode.max_len
  if split_dir:  # out of domain: longer sentences, so a longer output limit; a subset and fewer criteria
    ood = dict(item.split('=', 1) for item in plan.ood.split(','))
    max_examples, max_len = int(ood['examples']), int(ood['max_len'])
    criteria = tuple(ood['criteria'].split('+'))
  if name == 'base':
    ks, criteria = (1,), ('exact',)  # the base model has one head: its row is the greedy baseline of the study
  for batch_size in plan.batch_sizes:
    examples = plan.batch1_examples if batch_size == 1 and plan.batch1_examples else max_examples
    cfg = common.override(config, **{'data.distilled_from': '', 'decode.splits': (split_name,), 'decode.ks': ks,
                                     'decode.criteria': criteria, 'decode.batch_sizes': (batch_size,),
                                     'decode.max_examples': examples, 'decode.max_len': max_len,
                                     'decode.timing_examples': plan.timing_examples,
                                     'decode.timing_repeats': plan.timing_repeats})
    if split_dir:
      cfg.data.dir = split_dir
    out = os.path.join(workdir, f'decode_{split_name}_b{batch_size}')
    if os.path.exists(os.path.join(out, 'results.json')):
      continue
    logging.info('Stage decode: %s on %s at batch %d', name, split_name, batch_size)
    decode_into(cfg, workdir, out)


# Stern et al. 2018, Table 1 (WMT14 En->De newstest2013, BLEU / mean accepted block; DESIGN §2), by column and k.
PAPER_TABLE1 = {
    'Regular': {1: (26.00, 1.00), 2: (25.81, 1.51), 4: (25.84, 1.73), 6: (26.08, 1.76), 8: (25.82, 1.76),
                10: (25.69, 1.74)},
    'Distillation': {1: (26.41, 1.00), 2: (26.52, 1.55), 4: (26.31, 1.85), 6: (26.26, 1.90), 8: (26.25, 1.91),
                     10: (26.34, 1.90)},
    'Fine-tuning': {2: (25.74, 1.78), 4: (25.05, 2.69), 6: (24.69, 2.98), 8: (24.27, 3.01), 10: (23.51, 2.87)},
    'Both': {2: (26.58, 1.88), 4: (26.36, 3.27), 6: (26.18, 4.18), 8: (26.11, 4.69), 10: (25.60, 4.95)},
    'Both, top-2': {2: (26.49, 1.92), 4: (26.22, 3.47), 6: (25.90, 4.59), 8: (25.71, 5.34), 10: (25.04, 5.67)},
}
# The paper's columns as (model of this study, criterion).
TABLE1_COLUMNS = {'Regular': ('frozen_original', 'exact'), 'Distillation': ('frozen_distilled', 'exact'),
                  'Fine-tuning': ('finetune_original', 'exact'), 'Both': ('finetune_distilled', 'exact'),
                  'Both, top-2': ('finetune_distilled', 'top_k:2')}


def table1_markdown(rows) -> str:
  """The paper's Table 1 layout for one split and batch size: per column, ours and the paper's BLEU / block.

  k = 1 is each model's own greedy decoding (for frozen models, the base's)."""
  by_key = {(r['model'], r['criterion'], r['k']): r for r in rows}

  def ours(column):
    model, criterion = TABLE1_COLUMNS[column]

    def cell(row):
      r = by_key.get((model, 'greedy' if row['k'] == 1 else criterion, row['k']))
      return f"{r['quality']:.2f} / {r['mean_accepted_block_size']:.2f}" if r else ''
    return cell

  def paper(column):
    def cell(row):
      numbers = PAPER_TABLE1[column].get(row['k'])
      return f'{numbers[0]:.2f} / {numbers[1]:.2f}' if numbers else ''
    return cell

  columns = [('k', 'k', '{}')]
  for c in [c for c, (model, _) in TABLE1_COLUMNS.items() if any(r['model'] == model for r in rows)]:
    columns += [(None, c, ours(c)), (None, f'{c} (paper)', paper(c))]
  base = [r for r in rows if r['model'] == 'base' and r['criterion'] == 'greedy']
  head = f"Base model greedy BLEU: {base[0]['quality']:.2f}. " if base else ''
  return (head + 'Cells: BLEU / mean accepted block size; the paper: WMT14 newstest2013, Transformer base, '
          'distilled with beam 4 from a second base model.\n\n'
          + report.markdown_table([{'k': k} for k in sorted({r['k'] for r in rows})], columns))


def write_translation_table(root, plan):
  """study.md / .csv / .json and plots from every decode result of the study."""
  def folders(workdir):
    return sorted(f for f in os.listdir(workdir) if f.startswith('decode_')) if os.path.isdir(workdir) else []

  rows = []
  for r in decode_rows(translation_dirs(root, plan), folders):
    regime, _, data = r['model'].partition('_')
    rows.append({'model': r['model'], 'regime': regime, 'data': data or 'original', **r})
  if not rows:
    logging.warning('No decode results under %s yet.', root)
    return
  columns = [('model', 'model', '{}')] + report.COLUMNS[:2] + [('examples', 'examples', '{}')] + report.COLUMNS[2:]
  model_ks = sorted({r['model_k'] for r in rows if r['model'] != 'base'})
  note = (f'Each k-head model was trained once with k = {"/".join(map(str, model_ks))} heads; a column k\' < k decodes '
          f'with its first k\' heads (exactly a k\'-head model with this multi-output layer), not a separately '
          'trained model.')
  report.write_study(rows, root, columns, preface=note)
  # Across models: how the training choices move acceptance and speedup (exact criterion).
  for split in sorted({r['split'] for r in rows}):
    for batch_size in sorted({r['batch_size'] for r in rows}):
      exact = [r for r in rows if r['split'] == split and r['batch_size'] == batch_size and r['criterion'] == 'exact']
      for key in ('mean_accepted_block_size', 'speedup'):
        report.plot_models(exact, os.path.join(root, f'study_{split}_b{batch_size}_{key}.png'), key,
                           f'exact acceptance: {split}, batch {batch_size}')
  for name, workdir in translation_dirs(root, plan).items():  # the agreement diagnostic against head-training steps
    if name != 'base' and os.path.isdir(workdir):
      report.plot_acceptance_vs_steps(metrics.read_scalars(workdir, 'eval'),
                                      os.path.join(root, f'study_acceptance_vs_steps_{name}.png'),
                                      f'{name}: agreement with greedy on the first val sentences')
  with open(os.path.join(root, 'study_table1.md'), 'w') as f:
    for split in sorted({r['split'] for r in rows}):
      for batch_size in sorted({r['batch_size'] for r in rows}):
        subset = [r for r in rows if r['split'] == split and r['batch_size'] == batch_size]
        f.write(f'## {split}, batch {batch_size}\n\n{table1_markdown(subset)}\n\n')
  print(report.markdown_table(rows, columns))


# -- --plan=superres: the paper's super-resolution study (Table 2) -----------------------------------------------------


@dataclasses.dataclass(frozen=True)
class SuperresPlan:
  """What --plan=superres runs: its flags, as one value the stage functions take."""
  stages: tuple = ('base', 'heads', 'decode', 'table')
  regimes: tuple = ('frozen', 'finetune')
  splits: tuple = ('val',)
  ks: tuple = (2, 4, 10)
  criteria: tuple = ('exact', 'distance:2')
  batch_sizes: tuple = (1,)
  max_examples: int = 32
  batch1_examples: int = 0
  base_steps: int = 0
  head_steps: int = 0
  decode_models: tuple = ()  # () = base and every regime

  @classmethod
  def from_flags(cls):
    return cls(stages=tuple(_STAGES.value), regimes=tuple(_REGIMES.value), splits=tuple(_SPLITS.value),
               ks=tuple(int(k) for k in _KS.value), criteria=tuple(_CRITERIA.value),
               batch_sizes=tuple(int(b) for b in _BATCH_SIZES.value), max_examples=_MAX_EXAMPLES.value,
               batch1_examples=_BATCH1_EXAMPLES.value,
               base_steps=_BASE_STEPS.value, head_steps=_HEAD_STEPS.value,
               decode_models=tuple(_DECODE_MODELS.value))


def superres_dirs(root, plan):
  return {'base': os.path.join(root, 'base'), **{r: os.path.join(root, r) for r in plan.regimes}}


def run_superres(config, root, plan: SuperresPlan):
  base_dir = os.path.join(root, 'base')
  stages = set(plan.stages)
  dirs = superres_dirs(root, plan)
  unknown = set(plan.decode_models) - set(dirs)
  if unknown:  # before any training
    raise errors.UserError(f'--decode_models={",".join(plan.decode_models)}: no model {sorted(unknown)} in this '
                           f'study; choose from {sorted(dirs)} (base and --regimes).')
  if 'base' in stages:
    cfg = common.override(config, **{'train.regime': 'base', 'train.init_from': ''})
    if plan.base_steps:
      cfg.train.num_steps = plan.base_steps
    if not train_stage('base', cfg, base_dir):
      return
  if 'heads' in stages:
    for regime in plan.regimes:
      cfg = common.override(config, **{'train.regime': regime, 'train.init_from': base_dir})
      if plan.head_steps:
        cfg.train.num_steps = plan.head_steps
      if not train_stage(f'heads: {regime}', cfg, os.path.join(root, regime)):
        return
  if 'decode' in stages:
    for name in plan.decode_models or dirs:
      for split in plan.splits:
        decode_superres(config, name, dirs[name], split, plan)
  if 'table' in stages:
    write_superres_table(config, root, plan)


def decode_superres(config, name, workdir, split, plan):
  """The decode sweep of one model on one split, into W/<model>/decode_<split>/."""
  out = os.path.join(workdir, f'decode_{split}')
  if os.path.exists(os.path.join(out, 'results.json')):
    return
  model_k = checkpoint.read_model_config(workdir).k
  ks = (1,) if name == 'base' else tuple(k for k in plan.ks if k <= model_k)  # base: the greedy baseline
  cfg = common.override(config, **{'decode.splits': (split,), 'decode.ks': ks,
                                   'decode.criteria': plan.criteria if name != 'base' else ('exact',),
                                   'decode.batch_sizes': plan.batch_sizes, 'decode.max_examples': plan.max_examples,
                                   'decode.batch1_examples': plan.batch1_examples})
  logging.info('Stage decode: %s on %s', name, split)
  decode_into(cfg, workdir, out)


def write_superres_table(config, root, plan):
  """study.md / .csv / .json, plots, and one image grid per split from every decode result of the study."""
  rows = decode_rows(superres_dirs(root, plan), lambda _: [f'decode_{split}' for split in plan.splits])
  if not rows:
    logging.warning('No decode results under %s yet.', root)
    return
  columns = [('model', 'model', '{}')] + evaluate_images.COLUMNS
  report.write_study(rows, root, columns)  # the paper-style view is Stern et al. Table 4's layout
  for split in sorted({r['split'] for r in rows}):
    for batch_size in sorted({r['batch_size'] for r in rows}):
      chosen = [r for r in rows if r['split'] == split and r['batch_size'] == batch_size]
      with open(os.path.join(root, f'study_table2_{split}_b{batch_size}.md'), 'w') as f:
        f.write(table2_markdown(chosen) + '\n')
  for split in sorted({r['split'] for r in rows}):
    # The grid shows the batch size that decoded the most images (batch 1 may have decoded only a few).
    examples, batch_size = max((r['examples'], -r['batch_size']) for r in rows if r['split'] == split)
    write_grid(config, root, plan, split, batch_size=-batch_size, examples=examples)
  print(report.markdown_table(rows, columns))


# Stern et al. 2018, Table 2 (DESIGN §2): mean accepted block size on CelebA 8x8 -> 32x32, by k.
PAPER_TABLE2 = {
    'Regular': {2: 1.07, 4: 1.08, 6: 1.09, 8: 1.09, 10: 1.10},
    'Approximate': {2: 1.24, 4: 1.36, 6: 1.38, 8: 1.49, 10: 1.40},
    'Fine-tuning': {2: 1.59, 4: 2.11, 6: 2.23, 8: 2.17, 10: 2.04},
    'Both': {2: 1.96, 4: 3.75, 6: 5.25, 8: 6.36, 10: 6.79},
}
# The paper's rows as (model of this study, criterion).
TABLE2_ROWS = {'Regular': ('frozen', 'exact'), 'Approximate': ('frozen', 'distance:2'),
               'Fine-tuning': ('finetune', 'exact'), 'Both': ('finetune', 'distance:2')}


def table2_markdown(rows) -> str:
  """The paper's Table 2 layout for one split and batch size: per row and k, our mean accepted block size and
  PSNR (dB), beside the paper's block size (the paper gives no PSNR per cell), and each model's greedy PSNR."""
  by_key = {(r['model'], r['criterion'], r['k']): r for r in rows}
  ks = sorted({r['k'] for r in rows if r['criterion'] != 'greedy' and r['model'] != 'base'})  # the base has k = 1

  def greedy(row):
    r = by_key.get((row['model'], 'greedy', 1))
    return f"{r['quality']:.2f} dB" if r else ''

  def ours(k):
    def cell(row):
      r = by_key.get((row['model'], row['criterion'], k))
      return f"{r['mean_accepted_block_size']:.2f} / {r['quality']:.2f} dB" if r else ''
    return cell

  def paper(k):
    return lambda row: f"{PAPER_TABLE2[row['name']][k]:.2f}" if k in PAPER_TABLE2[row['name']] else ''

  columns = [('row', 'row', '{}'), (None, 'model greedy PSNR', greedy)]
  for k in ks:
    columns += [(None, f'k = {k}', ours(k)), (None, 'paper', paper(k))]
  table = [{'row': f'{name} ({model}, {criterion})', 'name': name, 'model': model, 'criterion': criterion}
           for name, (model, criterion) in TABLE2_ROWS.items()]
  example = rows[0]
  baselines = ', '.join(f"{m} enlargement {example[f'{m}_psnr']:.2f} dB" for m in ('nearest', 'bicubic')
                        if f'{m}_psnr' in example)
  return (f"Split {example['split']}, batch {example['batch_size']}, {example['examples']} images. Cells: mean "
          'accepted block size / PSNR against the ground truth; paper: its mean accepted block size (Stern et al. '
          f'2018, Table 2; no PSNR given). Baselines: {baselines}.\n\n' + report.markdown_table(table, columns))


def write_grid(config, root, plan, split, batch_size, examples):
  """W/study_<split>_grid.png: input 8x8, ground truth, then every model's greedy and blockwise outputs on
  the first images that were decoded at `batch_size` (`examples` of them)."""
  n = min(config.decode.grid_examples, examples)
  lowres_Nx8x8x3, highres_Nx32x32x3 = pipeline.load_image_split(config.data, split, n)
  n = len(highres_Nx32x32x3)
  rows, labels = [lowres_Nx8x8x3, highres_Nx32x32x3], ['input 8x8', 'ground truth']
  decoded = {name: os.path.join(workdir, f'decode_{split}') for name, workdir in superres_dirs(root, plan).items()
             if os.path.exists(os.path.join(workdir, f'decode_{split}', 'results.json'))}
  for name, folder in decoded.items():
    for r in json.load(open(os.path.join(folder, 'results.json'))):
      # The base's greedy row; every head model's greedy and blockwise rows, except a frozen model's greedy
      # row when the base's is there (a frozen model decodes greedily exactly as its base).
      greedy = r['criterion'] == 'greedy'
      if (r['batch_size'] != batch_size or (name == 'base' and not greedy)
          or (greedy and name == 'frozen' and 'base' in decoded)):
        continue
      setting = 'greedy' if greedy else decoder_lib.setting_name(r['k'], r['criterion'])
      outputs = np.load(os.path.join(folder, f'{split}.{setting}.b{batch_size}.npy'))[:n]
      if len(outputs) == n:
        rows.append(outputs)
        labels.append(f'{name} {setting}')
  images.save_image_grid(os.path.join(root, f'study_{split}_grid.png'), rows, row_labels=labels)


def run_timeboxed(seconds: list[str], argv: list[str]) -> None:
  """--plan=superres --timebox=BASE_S,FINETUNE_S,FROZEN_S,DECODE_S: the stages as four commands of this script,
  each under `timeout` (module docstring); argv: the command line, whose other flags pass on to each."""
  try:
    base_s, finetune_s, frozen_s, decode_s = (float(s) for s in seconds)
  except ValueError:
    raise UserError(f'--timebox={",".join(seconds)}: give four seconds, BASE_S,FINETUNE_S,FROZEN_S,DECODE_S, e.g. '
                    '--timebox=150,120,60,90.') from None
  extra, skip = [], False
  for arg in argv[1:]:  # every flag but --timebox (and its value, when apart)
    if not skip and not arg.startswith('--timebox'):
      extra.append(arg)
    skip = arg == '--timebox'
  if not flags.FLAGS['config'].present:
    extra.insert(0, f'--config={TIMEBOX_CONFIG}')
  # The extra flags come first: the stage's own --stages, --regimes and --decode_models win.
  for stage_s, own in ((base_s, ['--stages=base']), (finetune_s, ['--stages=heads', '--regimes=finetune']),
                       (frozen_s, ['--stages=heads', '--regimes=frozen']),
                       (decode_s, ['--stages=decode,table', '--decode_models=finetune,frozen'])):
    now = lambda: datetime.datetime.now(datetime.timezone.utc).strftime('%H:%M:%S')
    print(f'== {now()} study --plan=superres {" ".join(own)} (at most {stage_s:g}s)', flush=True)
    # --foreground: Ctrl-C reaches Python. -k: SIGKILL only if saving the checkpoint hangs (it takes seconds).
    status = subprocess.run(['timeout', '--foreground', '-s', 'TERM', '-k', '120', f'{stage_s:g}', sys.executable,
                             '-m', 'experiments.study', *extra, *own], check=False).returncode
    if status == 124:
      print(f'== {now()} stopped at the time limit (training saves a checkpoint first; decoding keeps the batch sizes '
            'it finished in WORKDIR/<model>/decode/)', flush=True)
    elif status:
      print(f'== {now()} failed with exit status {status}', file=sys.stderr)
      sys.exit(status)


# -- the command line --------------------------------------------------------------------------------------------------

def main(argv):
  del argv  # the time box reads sys.argv: absl's argv holds no flags
  metrics.quiet_library_logs()
  plan = _PLAN.value
  if _TIMEBOX.value:
    if plan != 'superres':
      raise UserError(f'--timebox times the stages of --plan=superres, not --plan={plan}.')
    return run_timeboxed(_TIMEBOX.value, sys.argv)
  errors.set_defaults(PLAN_DEFAULTS[plan])
  if plan == 'demo':
    main_demo()
  elif plan == 'heads':
    main_heads()
  elif plan == 'translation':
    run_translation(_CONFIG.value, _WORKDIR.value, TranslationPlan.from_flags())
  else:
    run_superres(_CONFIG.value, _WORKDIR.value, SuperresPlan.from_flags())


if __name__ == '__main__':
  stack.raise_stack_limit()  # before anything compiles (bpd/stack.py)
  app.run(lambda argv: errors.exit_on_user_error(main, argv), flags_parser=errors.parse_flags)
