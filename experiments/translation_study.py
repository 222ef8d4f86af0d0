r"""The paper's translation study (Tables 1-2, §6-§7), stage by stage, each stage skipped when its output exists.

  python -m experiments.translation_study --config=configs/multi30k_ende.py --workdir=runs/m30k_study

Stages (an interrupted study resumes at the stage it was in; training resumes from its checkpoint):
  1. base        a plain Transformer (k = 1)                                    W/base
  2. distill     the base model's beam-search translations of the training set  W/base/distill
  3. heads       k-head models from the base: {frozen, finetune} x {original, distilled}   W/<regime>_<data>
                 (the largest k is trained once; smaller k' decode with its first k' heads, which is exactly
                 a k'-head model with this multi-output layer)
  4. decode      every model on every evaluation split: greedy, and blockwise for k' in --ks and each criterion,
                 at each batch size                                               W/<model>/decode_<split>_b<B>
  5. table       every row: W/study.md, .csv, .json; paper-style pivots (model x criterion by k) W/study_paper.md;
                 plots per model and of acceptance / speedup across models, W/study_<split>_b<B>_*.png
--stages picks a subset; --grid_regimes / --grid_data cut the grid to fit a time budget.
Evaluation splits come as NAME or NAME@DIR (a split of parallel text in another folder, e.g. the out-of-domain
newstest2013@../shared/data/wmt14).
"""

import dataclasses
import json
import os

from absl import app
from absl import flags
from absl import logging
from ml_collections import config_flags

from bpd import checkpoint
from bpd import distill
from bpd import errors
from bpd import evaluate
from bpd import metrics
from bpd import report
from bpd import train
from bpd.data import pipeline
from bpd.errors import UserError
from configs import common

# Flags exist only when this file runs as a script: importing it (tests, another study script) defines none,
# so two study scripts can be imported together.
if __name__ == '__main__':
  _CONFIG = config_flags.DEFINE_config_file('config', 'configs/multi30k_ende.py', 'The study config.')
  _WORKDIR = flags.DEFINE_string('workdir', 'runs/m30k_study', 'Root folder of the study.')
  _STAGES = flags.DEFINE_list('stages', ['base', 'distill', 'heads', 'decode', 'table'], 'Stages to run.')
  _REGIMES = flags.DEFINE_list('grid_regimes', ['frozen', 'finetune'], 'Training regimes of the k-head models.')
  _DATA = flags.DEFINE_list('grid_data', ['original', 'distilled'], 'Training data of the k-head models.')
  _MODELS = flags.DEFINE_list('models', [], 'k-head models as REGIME_DATA (e.g. finetune_distilled,frozen_original); '
                              'empty: every grid_regimes x grid_data pair.')
  _SPLITS = flags.DEFINE_list('splits', ['test_2016_flickr', 'newstest2013@../shared/data/wmt14'],
                              'Evaluation splits: NAME (in config.data.dir) or NAME@DIR.')
  _KS = flags.DEFINE_list('ks', ['1', '2', '4', '6', '8', '10'], "Heads k' to decode with (<= config.k).")
  _CRITERIA = flags.DEFINE_list('criteria', ['exact', 'top_k:2', 'min_block:2', 'min_block:3'], 'Criteria.')
  _BATCH_SIZES = flags.DEFINE_list('batch_sizes', ['1', '32'], 'Decode batch sizes.')
  _MAX_EXAMPLES = flags.DEFINE_integer('max_examples', 0, 'Decode at most this many examples per split (0: all).')
  _BATCH1_EXAMPLES = flags.DEFINE_integer(
      'batch1_examples', 200, 'Batch size 1 decodes only the first N examples (0: all): batch-1 rows measure '
      'latency; quality on the whole split comes from the larger batch sizes.')
  _TIMING_EXAMPLES = flags.DEFINE_integer('timing_examples', 256, 'Time greedy vs blockwise on the first N (0: all).')
  _TIMING_REPEATS = flags.DEFINE_integer('timing_repeats', 3, 'Alternating greedy/blockwise timing runs (medians).')
  _OOD = flags.DEFINE_string('ood', 'examples=500,max_len=128,criteria=exact',
                             'Out-of-domain splits (NAME@DIR): examples, longest output and criteria (+-joined).')
  _BASE_STEPS = flags.DEFINE_integer('base_steps', 0, 'Override config.train.num_steps for the base (0: keep).')
  _HEAD_STEPS = flags.DEFINE_integer('head_steps', 0, 'Override config.train.num_steps for k-head models.')
  _HEAD_LR = flags.DEFINE_float('head_learning_rate', 0.0, 'Peak learning rate of k-head models (0: the config).')
  _HEAD_WARMUP = flags.DEFINE_integer('head_warmup_steps', 0, 'Warmup of k-head models (0: the config).')
  _HEAD1_WEIGHT = flags.DEFINE_float('finetune_head1_weight', 1.0,
                                     'config.train.head1_weight of fine-tuned models (1: the paper\'s plain mean).')


@dataclasses.dataclass(frozen=True)
class Plan:
  """What the study runs: the flags above, as one value the stage functions take."""
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
  head_learning_rate: float = 0.0
  head_warmup_steps: int = 0
  finetune_head1_weight: float = 1.0
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
    return cls(stages=tuple(_STAGES.value), regimes=tuple(_REGIMES.value), data=tuple(_DATA.value),
               splits=tuple(_SPLITS.value), ks=tuple(int(k) for k in _KS.value), criteria=tuple(_CRITERIA.value),
               batch_sizes=tuple(int(b) for b in _BATCH_SIZES.value), max_examples=_MAX_EXAMPLES.value,
               batch1_examples=_BATCH1_EXAMPLES.value, timing_examples=_TIMING_EXAMPLES.value,
               timing_repeats=_TIMING_REPEATS.value, ood=_OOD.value, base_steps=_BASE_STEPS.value,
               head_steps=_HEAD_STEPS.value, head_learning_rate=_HEAD_LR.value,
               head_warmup_steps=_HEAD_WARMUP.value, finetune_head1_weight=_HEAD1_WEIGHT.value,
               models=tuple(_MODELS.value))


def _done_training(workdir, steps):
  return (checkpoint.latest_step(workdir) or 0) >= steps


def _config(base, **fields):
  return common.override(base, **fields)


def model_dirs(root, plan):
  return {'base': os.path.join(root, 'base'),
          **{f'{r}_{d}': os.path.join(root, f'{r}_{d}') for r, d in plan.head_models()}}


def run_stages(config, root, plan: Plan):
  plan.head_models()  # a bad --models fails here, before anything trains
  base_dir = os.path.join(root, 'base')
  base_cfg = _config(config, **{'train.regime': 'base', 'train.init_from': '', 'data.distilled_from': ''})
  if plan.base_steps:
    base_cfg.train.num_steps = plan.base_steps
  stages = set(plan.stages)
  if 'base' in stages and not _done_training(base_dir, base_cfg.train.num_steps):
    logging.info('Stage base -> %s', base_dir)
    train.train_and_evaluate(base_cfg, base_dir)
  if 'distill' in stages and any(d == 'distilled' for _, d in plan.head_models()) and not os.path.exists(
      os.path.join(base_dir, pipeline.DISTILL_DIR, f'train.{config.data.tgt_lang}')):
    logging.info('Stage distill -> %s', os.path.join(base_dir, pipeline.DISTILL_DIR))
    distill.distill(base_cfg, base_dir)
  if 'heads' in stages:
    for regime, data in plan.head_models():
      workdir = os.path.join(root, f'{regime}_{data}')
      cfg = _config(config, **{'train.regime': regime, 'train.init_from': base_dir,
                               'data.distilled_from': base_dir if data == 'distilled' else ''})
      if plan.head_steps:
        cfg.train.num_steps = plan.head_steps
      if plan.head_learning_rate:
        cfg.train.learning_rate = plan.head_learning_rate
      if plan.head_warmup_steps:
        cfg.train.warmup_steps = plan.head_warmup_steps
      if regime == 'finetune':
        cfg.train.head1_weight = plan.finetune_head1_weight
      if not _done_training(workdir, cfg.train.num_steps):
        logging.info('Stage heads: %s on %s data -> %s', regime, data, workdir)
        train.train_and_evaluate(cfg, workdir)
  if 'decode' in stages:
    for name, workdir in model_dirs(root, plan).items():
      for split in plan.splits:
        decode_one(config, name, workdir, split, plan)
  if 'table' in stages:
    write_table(root, plan)


def decode_one(config, name, workdir, split, plan):
  """One model on one split, one decode sweep per batch size, into W/<model>/decode_<split>_b<B>/."""
  split_name, _, split_dir = split.partition('@')
  model_k = checkpoint.read_model_config(workdir).k
  ks = tuple(k for k in plan.ks if k <= model_k)
  criteria = plan.criteria
  max_examples, max_len = plan.max_examples, config.decode.max_len
  if split_dir:  # out of domain: longer sentences, so a longer output limit; a subset and fewer criteria
    ood = dict(item.split('=', 1) for item in plan.ood.split(','))
    max_examples, max_len = int(ood['examples']), int(ood['max_len'])
    criteria = tuple(ood['criteria'].split('+'))
  if name == 'base':
    ks, criteria = (1,), ('exact',)  # the base model has one head: its row is the greedy baseline of the study
  for batch_size in plan.batch_sizes:
    examples = plan.batch1_examples if batch_size == 1 and plan.batch1_examples else max_examples
    cfg = _config(config, **{'data.distilled_from': '', 'decode.splits': (split_name,), 'decode.ks': ks,
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
    evaluate.decode_sweep(cfg, workdir)
    os.replace(os.path.join(workdir, evaluate.DECODE_DIR), out)


def write_table(root, plan):
  """study.md / .csv / .json and plots from every decode result of the study."""
  rows = []
  for name, workdir in model_dirs(root, plan).items():
    if not os.path.isdir(workdir):
      continue
    for folder in sorted(os.listdir(workdir)):
      path = os.path.join(workdir, folder, 'results.json')
      if folder.startswith('decode_') and os.path.exists(path):
        for r in json.load(open(path)):
          regime, _, data = name.partition('_')
          rows.append({'model': name, 'regime': regime, 'data': data or 'original', **r})
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
  print(report.markdown_table(rows, columns))


def main(argv):
  del argv
  metrics.quiet_library_logs()
  errors.exit_on_user_error(lambda: run_stages(_CONFIG.value, _WORKDIR.value, Plan.from_flags()))


if __name__ == '__main__':
  app.run(main)
