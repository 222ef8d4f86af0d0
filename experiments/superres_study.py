r"""The paper's super-resolution study (§7.2, CelebA 8x8 -> 32x32, k = 10), stage by stage; each stage is
skipped when its output exists.

  python -m experiments.superres_study --config=configs/celeba_sr.py:cpu --workdir=runs/sr_study \
      --base_steps=600 --head_steps=150

Stages (an interrupted study resumes at the stage it was in; training resumes from its checkpoint):
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
"""

import dataclasses
import json
import os

from absl import app
from absl import flags
from absl import logging
import numpy as np

from bpd import checkpoint
from bpd import decoder as decoder_lib
from bpd import errors
from bpd import evaluate
from bpd import evaluate_images
from bpd import metrics
from bpd import report
from bpd import train
from bpd.data import images
from bpd.data import pipeline
from configs import common

# Flags exist only when this file runs as a script: importing it (tests, another study script) defines none,
# so two study scripts can be imported together.
if __name__ == '__main__':
  _CONFIG = errors.define_config_file('config', 'configs/celeba_sr.py:cpu', 'The study config.')
  _WORKDIR = flags.DEFINE_string('workdir', 'runs/sr_study', 'Root folder of the study.')
  _STAGES = flags.DEFINE_list('stages', ['base', 'heads', 'decode', 'table'], 'Stages to run.')
  _REGIMES = flags.DEFINE_list('regimes', ['frozen', 'finetune'], 'Training regimes of the k-head models.')
  _SPLITS = flags.DEFINE_list('splits', ['val'], 'Evaluation splits (config.data.dir/<split>.npy, or TFDS).')
  _KS = flags.DEFINE_list('ks', ['2', '4', '10'], "Heads k' to decode with (<= config.k).")
  _CRITERIA = flags.DEFINE_list('criteria', ['exact', 'distance:2'], 'Acceptance criteria.')
  _BATCH_SIZES = flags.DEFINE_list('batch_sizes', ['1'], 'Decode batch sizes.')
  _BATCH1_EXAMPLES = flags.DEFINE_integer('batch1_examples', 0, 'Batch size 1 decodes only the first N images '
                                          '(0: all); quality is then read at the other batch sizes.')
  _MAX_EXAMPLES = flags.DEFINE_integer('max_examples', 32, 'Decode at most this many images per split (0: all).')
  _BASE_STEPS = flags.DEFINE_integer('base_steps', 0, 'Override config.train.num_steps for the base (0: keep).')
  _HEAD_STEPS = flags.DEFINE_integer('head_steps', 0, 'Override config.train.num_steps for k-head models.')
  _DECODE_MODELS = flags.DEFINE_list('decode_models', [], 'Models to decode, in this order (default: base, then '
                                     '--regimes). A frozen model decodes greedily exactly as its base does.')


@dataclasses.dataclass(frozen=True)
class Plan:
  """What the study runs: the flags above, as one value the stage functions take."""
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


def _done_training(workdir, steps):
  return (checkpoint.latest_step(workdir) or 0) >= steps


def _stopped(stage, workdir):
  """Training stopped early (preemption, Ctrl-C, a time box's SIGTERM): the later stages must not run on a
  half-trained model."""
  logging.warning('Stage %s stopped before its last step (%s); rerun the same command to resume it.', stage, workdir)


def model_dirs(root, plan):
  return {'base': os.path.join(root, 'base'), **{r: os.path.join(root, r) for r in plan.regimes}}


def run_stages(config, root, plan: Plan):
  base_dir = os.path.join(root, 'base')
  stages = set(plan.stages)
  dirs = model_dirs(root, plan)
  unknown = set(plan.decode_models) - set(dirs)
  if unknown:  # before any training
    raise errors.UserError(f'--decode_models={",".join(plan.decode_models)}: no model {sorted(unknown)} in this '
                           f'study; choose from {sorted(dirs)} (base and --regimes).')
  if 'base' in stages:
    cfg = common.override(config, **{'train.regime': 'base', 'train.init_from': ''})
    if plan.base_steps:
      cfg.train.num_steps = plan.base_steps
    if not _done_training(base_dir, cfg.train.num_steps):
      logging.info('Stage base -> %s', base_dir)
      train.train_and_evaluate(cfg, base_dir)
      if not _done_training(base_dir, cfg.train.num_steps):
        return _stopped('base', base_dir)
  if 'heads' in stages:
    for regime in plan.regimes:
      workdir = os.path.join(root, regime)
      cfg = common.override(config, **{'train.regime': regime, 'train.init_from': base_dir})
      if plan.head_steps:
        cfg.train.num_steps = plan.head_steps
      if not _done_training(workdir, cfg.train.num_steps):
        logging.info('Stage heads: %s -> %s', regime, workdir)
        train.train_and_evaluate(cfg, workdir)
        if not _done_training(workdir, cfg.train.num_steps):
          return _stopped(regime, workdir)
  if 'decode' in stages:
    for name in plan.decode_models or dirs:
      for split in plan.splits:
        decode_one(config, name, dirs[name], split, plan)
  if 'table' in stages:
    write_table(config, root, plan)


def decode_one(config, name, workdir, split, plan):
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
  evaluate.decode_sweep(cfg, workdir)
  os.replace(os.path.join(workdir, decoder_lib.DECODE_DIR), out)


def write_table(config, root, plan):
  """study.md / .csv / .json, plots, and one image grid per split from every decode result of the study."""
  rows = []
  for name, workdir in model_dirs(root, plan).items():
    for split in plan.splits:
      path = os.path.join(workdir, f'decode_{split}', 'results.json')
      if os.path.exists(path):
        rows += [{'model': name, **r} for r in json.load(open(path))]
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
  lines = ['| row | model greedy PSNR | ' + ' | '.join(f'k = {k} | paper' for k in ks) + ' |',
           '|---|---|' + '---|---|' * len(ks)]
  for name, (model, criterion) in TABLE2_ROWS.items():
    greedy = by_key.get((model, 'greedy', 1))
    cells = [f"{greedy['quality']:.2f} dB" if greedy else '']
    for k in ks:
      r = by_key.get((model, criterion, k))
      cells += [f"{r['mean_accepted_block_size']:.2f} / {r['quality']:.2f} dB" if r else '',
                f'{PAPER_TABLE2[name][k]:.2f}' if k in PAPER_TABLE2[name] else '']
    lines.append(f'| {name} ({model}, {criterion}) | ' + ' | '.join(cells) + ' |')
  example = rows[0]
  baselines = ', '.join(f"{m} enlargement {example[f'{m}_psnr']:.2f} dB" for m in ('nearest', 'bicubic')
                        if f'{m}_psnr' in example)
  return (f"Split {example['split']}, batch {example['batch_size']}, {example['examples']} images. Cells: mean "
          'accepted block size / PSNR against the ground truth; paper: its mean accepted block size (Stern et al. '
          f'2018, Table 2; no PSNR given). Baselines: {baselines}.\n\n' + '\n'.join(lines))


def write_grid(config, root, plan, split, batch_size, examples):
  """W/study_<split>_grid.png: input 8x8, ground truth, then every model's greedy and blockwise outputs on
  the first images that were decoded at `batch_size` (`examples` of them)."""
  n = min(config.decode.grid_examples, examples)
  lowres_Nx8x8x3, highres_Nx32x32x3 = pipeline.load_image_split(config.data, split, n)
  n = len(highres_Nx32x32x3)
  rows, labels = [lowres_Nx8x8x3, highres_Nx32x32x3], ['input 8x8', 'ground truth']
  decoded = {name: os.path.join(workdir, f'decode_{split}') for name, workdir in model_dirs(root, plan).items()
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


def main(argv):
  del argv
  metrics.quiet_library_logs()
  errors.exit_on_user_error(lambda: run_stages(_CONFIG.value, _WORKDIR.value, Plan.from_flags()))


if __name__ == '__main__':
  app.run(main, flags_parser=errors.parse_flags)
