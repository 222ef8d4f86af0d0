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
                 the paper's Table 1 layout beside its numbers W/study_table1.md; the agreement diagnostic of each
                 k-head model against its training steps W/study_acceptance_vs_steps_<model>.png;
                 plots per model and of acceptance / speedup across models, W/study_<split>_b<B>_*.png
--stages picks a subset; --grid_regimes / --grid_data cut the grid to fit a time budget.
Evaluation splits come as NAME or NAME@DIR (a split of parallel text in another folder, e.g. the out-of-domain
newstest2013@../shared/data/wmt14).
"""

import ast
import dataclasses
import json
import os

from absl import app
from absl import flags
from absl import logging

from bpd import checkpoint
from bpd import decoder as decoder_lib
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
  _CONFIG = errors.define_config_file('config', 'configs/multi30k_ende.py', 'The study config.')
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
  _HEAD_CONFIG = flags.DEFINE_list(
      'head_config', [], 'Config overrides KEY=VALUE for every k-head model (the head-training recipe), e.g. '
      'train.head_learning_rate=3e-3,model.dropout_rate=0.')
  _FINETUNE_CONFIG = flags.DEFINE_list(
      'finetune_config', [], 'Config overrides KEY=VALUE for fine-tuned models only, after --head_config, e.g. '
      'train.learning_rate=3e-4,train.head1_weight=7.')
  _OTHER_HEAD_STEPS = flags.DEFINE_integer(
      'other_head_steps', 0, 'Training steps of k-head models other than finetune_distilled ("Both", the model of the '
      'acceptance target; 0: as --head_steps), to fit a time box. Compare them with Both at the same step through '
      'the agreement diagnostic in their metrics.jsonl.')
  _OTHER_CRITERIA = flags.DEFINE_list(
      'other_criteria', [], 'Criteria for models other than finetune_distilled ("Both"; empty: --criteria): the '
      'paper reports the top-2 row on "Both" only.')


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
    return cls(stages=tuple(_STAGES.value), regimes=tuple(_REGIMES.value), data=tuple(_DATA.value),
               splits=tuple(_SPLITS.value), ks=tuple(int(k) for k in _KS.value), criteria=tuple(_CRITERIA.value),
               batch_sizes=tuple(int(b) for b in _BATCH_SIZES.value), max_examples=_MAX_EXAMPLES.value,
               batch1_examples=_BATCH1_EXAMPLES.value, timing_examples=_TIMING_EXAMPLES.value,
               timing_repeats=_TIMING_REPEATS.value, ood=_OOD.value, base_steps=_BASE_STEPS.value,
               head_steps=_HEAD_STEPS.value, other_head_steps=_OTHER_HEAD_STEPS.value, head_config=tuple(_HEAD_CONFIG.value),
               finetune_config=tuple(_FINETUNE_CONFIG.value), other_criteria=tuple(_OTHER_CRITERIA.value),
               models=tuple(_MODELS.value))


def _done_training(workdir, steps):
  return (checkpoint.latest_step(workdir) or 0) >= steps


def _stopped(stage, workdir):
  """Training stopped early (preemption, Ctrl-C): the later stages must not run on a half-trained model."""
  logging.warning('Stage %s stopped before its last step (%s); rerun the same command to resume it.', stage, workdir)


def _config(base, **fields):
  return common.override(base, **fields)


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
    return _config(cfg, **fields)
  except (KeyError, AttributeError, TypeError) as e:
    raise UserError(f'--head_config/--finetune_config {fields}: {e}. Keys are dotted config fields '
                    '(configs/common.py), values of their type.') from e


def model_dirs(root, plan):
  return {'base': os.path.join(root, 'base'),
          **{f'{r}_{d}': os.path.join(root, f'{r}_{d}') for r, d in plan.head_models()}}


def run_stages(config, root, plan: Plan):
  plan.head_models()  # a bad --models or override fails here, before anything trains
  for regime in ('frozen', 'finetune'):
    head_model_config(config, plan, regime)
  base_dir = os.path.join(root, 'base')
  base_cfg = _config(config, **{'train.regime': 'base', 'train.init_from': '', 'data.distilled_from': ''})
  if plan.base_steps:
    base_cfg.train.num_steps = plan.base_steps
  stages = set(plan.stages)
  if 'base' in stages and not _done_training(base_dir, base_cfg.train.num_steps):
    logging.info('Stage base -> %s', base_dir)
    train.train_and_evaluate(base_cfg, base_dir)
    if not _done_training(base_dir, base_cfg.train.num_steps):
      return _stopped('base', base_dir)
  if 'distill' in stages and any(d == 'distilled' for _, d in plan.head_models()) and not os.path.exists(
      os.path.join(base_dir, pipeline.DISTILL_DIR, f'train.{config.data.tgt_lang}')):
    logging.info('Stage distill -> %s', os.path.join(base_dir, pipeline.DISTILL_DIR))
    distill.distill(base_cfg, base_dir)
  if 'heads' in stages:
    for regime, data in plan.head_models():
      workdir = os.path.join(root, f'{regime}_{data}')
      cfg = _config(config, **{'train.regime': regime, 'train.init_from': base_dir,
                               'data.distilled_from': base_dir if data == 'distilled' else ''})
      cfg = head_model_config(cfg, plan, regime, data)
      if not _done_training(workdir, cfg.train.num_steps):
        logging.info('Stage heads: %s on %s data -> %s', regime, data, workdir)
        train.train_and_evaluate(cfg, workdir)
        if not _done_training(workdir, cfg.train.num_steps):
          return _stopped(f'{regime}_{data}', workdir)
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
    os.replace(os.path.join(workdir, decoder_lib.DECODE_DIR), out)


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
  columns = [c for c, (model, _) in TABLE1_COLUMNS.items() if any(r['model'] == model for r in rows)]
  ks = sorted({r['k'] for r in rows})
  lines = ['| k | ' + ' | '.join(f'{c} | {c} (paper)' for c in columns) + ' |', '|---|' + '---|---|' * len(columns)]
  for k in ks:
    cells = []
    for c in columns:
      model, criterion = TABLE1_COLUMNS[c]
      r = by_key.get((model, 'greedy' if k == 1 else criterion, k))
      ours = f"{r['quality']:.2f} / {r['mean_accepted_block_size']:.2f}" if r else ''
      paper = PAPER_TABLE1[c].get(k)
      cells += [ours, f'{paper[0]:.2f} / {paper[1]:.2f}' if paper else '']
    lines.append(f'| {k} | ' + ' | '.join(cells) + ' |')
  base = [r for r in rows if r['model'] == 'base' and r['criterion'] == 'greedy']
  head = f"Base model greedy BLEU: {base[0]['quality']:.2f}. " if base else ''
  return (head + 'Cells: BLEU / mean accepted block size; the paper: WMT14 newstest2013, Transformer base, '
          'distilled with beam 4 from a second base model.\n\n' + '\n'.join(lines))


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
  for name, workdir in model_dirs(root, plan).items():  # the agreement diagnostic against head-training steps
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


def main(argv):
  del argv
  metrics.quiet_library_logs()
  errors.exit_on_user_error(lambda: run_stages(_CONFIG.value, _WORKDIR.value, Plan.from_flags()))


if __name__ == '__main__':
  app.run(main, flags_parser=errors.parse_flags)
