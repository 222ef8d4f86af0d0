"""Tables and plots of decode sweeps: results.json, results.md (paper style) and PNG plots against k."""

import collections
import csv
import json
import os

import matplotlib

matplotlib.use('Agg')  # files only; no display on TPU VMs or CI
import matplotlib.pyplot as plt  # pylint: disable=g-import-not-at-top

from bpd import files  # pylint: disable=g-import-not-at-top

COLUMNS = [
    ('split', 'split', '{}'), ('batch_size', 'batch', '{}'), ('k', 'k', '{}'), ('criterion', 'criterion', '{}'),
    ('tree', 'tree', '{}'), ('drafter', 'drafter', '{}'), ('quality', 'quality', '{:.2f}'),
    ('mean_accepted_block_size', 'mean accepted block', '{:.2f}'),
    ('iterations', 'iterations', '{}'), ('invocations', 'invocations', '{}'), ('tokens', 'tokens', '{}'),
    ('seconds', 'seconds', '{:.2f}'), ('speedup', 'speedup', '{:.2f}x'),
    ('identical_to_greedy', 'identical to greedy', '{:.3f}'),
]


def markdown_table(records, columns=COLUMNS, header=True) -> str:
  """The one markdown table of the project: one row per record (a dict), one column per (key, title, fmt).

  A cell is fmt.format(record[key]), empty where the record lacks key; or, where fmt is a function, fmt(record): a
  cell drawn from several keys. 'quality' in a title becomes the records' quality metric (BLEU, PSNR).
  header=False gives the rows alone and markdown_table([], columns) the header alone, for a table printed row by row
  as it is measured.
  """
  metric = records[0].get('quality_metric', 'quality') if records else 'quality'
  row = lambda cells: '| ' + ' | '.join(cells) + ' |'
  lines = [row([title.replace('quality', metric) for _, title, _ in columns]), '|' + '---|' * len(columns)]
  lines = lines if header else []
  for r in records:
    lines.append(row([fmt(r) if callable(fmt) else fmt.format(r[key]) if key in r else '' for key, _, fmt in columns]))
  return '\n'.join(lines)


def save_figure(fig, path, title=''):
  """The figure under `title`, laid out, written to path (PNG) and closed: pyplot holds every figure until closed."""
  fig.suptitle(title)
  fig.tight_layout()
  fig.savefig(path, dpi=110)
  plt.close(fig)


def plot(records, path, title=''):
  """Mean accepted block size, speedup and quality against k; one line per criterion; greedy dashed."""
  by_criterion = collections.defaultdict(list)
  greedy = [r for r in records if r['criterion'] == 'greedy']
  for r in records:
    if r['criterion'] != 'greedy' and r.get('tree', 'chain') == 'chain':  # against k: chains only
      by_criterion[r['criterion']].append(r)
  metric = records[0].get('quality_metric', 'quality')
  fig, axes = plt.subplots(1, 3, figsize=(13, 3.8))
  for ax, key, label in zip(axes, ('mean_accepted_block_size', 'speedup', 'quality'),
                            ('mean accepted block size', 'wall-clock speedup over greedy', metric)):
    for criterion, rows in sorted(by_criterion.items()):
      rows = sorted(rows, key=lambda r: r['k'])
      ax.plot([r['k'] for r in rows], [r[key] for r in rows], marker='o', label=criterion)
    if greedy:
      ax.axhline(greedy[0][key], color='gray', linestyle='--', label='greedy')
    ax.set_xlabel('k (heads used)')
    ax.set_ylabel(label)
    ax.grid(alpha=0.3)
  axes[0].legend(fontsize=8)
  save_figure(fig, path, title)


def plot_acceptance_vs_steps(eval_rows, path, title=''):
  """The agreement diagnostic against training steps (from metrics.read_scalars(workdir, 'eval')): per head,
  agreement with greedy (left), and the exact mean accepted block size with all k heads (right), so a
  researcher can see what more head-training steps would buy."""
  rows = [r for r in eval_rows if 'exact_block_size' in r]
  if not rows:
    return
  steps = [r['step'] for r in rows]
  heads = sorted(int(key[len('agreement_head'):]) for key in rows[-1] if key.startswith('agreement_head'))
  fig, axes = plt.subplots(1, 2, figsize=(10, 3.8))
  for head in heads[1:]:
    axes[0].plot(steps, [r.get(f'agreement_head{head}', float('nan')) for r in rows], marker='o',
                 label=f'head {head}')
  axes[0].set_ylabel('agreement with greedy')
  axes[0].legend(fontsize=8)
  axes[1].plot(steps, [r['exact_block_size'] for r in rows], marker='o', color='black')
  axes[1].set_ylabel(f'mean accepted block size (exact, k={heads[-1]})')
  for ax in axes:
    ax.set_xlabel('head-training steps')
    ax.grid(alpha=0.3)
  save_figure(fig, path, title)


def write(records, out_dir: str, columns=COLUMNS) -> None:
  """results.json, results.md (`columns` of the table) and one plot per (split, batch size), atomically."""
  files.write_atomic(os.path.join(out_dir, 'results.json'), json.dumps(records, indent=1))
  files.write_atomic(os.path.join(out_dir, 'results.md'), markdown_table(records, columns) + '\n')
  groups = collections.defaultdict(list)
  for r in records:
    groups[(r['split'], r['batch_size'])].append(r)
  for (split, batch_size), rows in groups.items():
    plot(rows, os.path.join(out_dir, f'{split}.b{batch_size}.png'), f'{split}, batch size {batch_size}')


def paper_table(records, row_keys=('model', 'criterion')) -> str:
  """Paper-style pivot (Stern et al. Tables 1-3): one row per (model, criterion), one column per k.

  Each cell is "quality / mean accepted block / speedup" of one setting. `records` should hold one split and
  one batch size; the greedy rows (k = 1) form the first column.
  """
  ks = sorted({r['k'] for r in records})
  metric = records[0].get('quality_metric', 'quality') if records else 'quality'
  groups = collections.OrderedDict()
  for r in records:
    groups.setdefault(tuple(r[key] for key in row_keys), {})[r['k']] = r

  def cell(by_k, k):
    r = by_k.get(k)
    return f"{r['quality']:.2f} / {r['mean_accepted_block_size']:.2f} / {r['speedup']:.2f}x" if r else ''

  columns = [(i, key, '{}') for i, key in enumerate(row_keys)]
  columns += [(None, f'k={k}', lambda g, k=k: cell(g['by_k'], k)) for k in ks]
  rows = [{**dict(enumerate(key)), 'by_k': by_k} for key, by_k in groups.items()]
  return f'cells: {metric} / mean accepted block size / wall-clock speedup\n\n' + markdown_table(rows, columns)


def plot_models(records, path, key='mean_accepted_block_size', title=''):
  """One line per (model, criterion) against k: how training choices move acceptance (or speedup, quality)."""
  lines = collections.defaultdict(list)
  for r in records:
    if r['criterion'] != 'greedy':
      lines[f"{r.get('model', '')} {r['criterion']}".strip()].append(r)
  fig, ax = plt.subplots(figsize=(6.5, 4.2))
  for label, rows in sorted(lines.items()):
    rows = sorted(rows, key=lambda r: r['k'])
    ax.plot([r['k'] for r in rows], [r[key] for r in rows], marker='o', label=label)
  ax.set_xlabel('k (heads used)')
  ax.set_ylabel(key.replace('_', ' '))
  ax.grid(alpha=0.3)
  ax.legend(fontsize=7)
  ax.set_title(title)
  fig.tight_layout()
  fig.savefig(path, dpi=110)
  plt.close(fig)


def write_study(rows, root: str, columns, preface: str = '') -> None:
  """The files of a study (experiments/study.py --plan=translation|superres) from the records of all its models
  (each with 'model').

  root/study.md (every row, `columns`), study.json, study.csv, study_paper.md (`preface`, then one paper_table per
  split and batch size) and study_<split>_b<batch>_<model>.png (one plot per k-head model).
  """
  with open(os.path.join(root, 'study.md'), 'w') as f:
    f.write(markdown_table(rows, columns) + '\n')
  with open(os.path.join(root, 'study.json'), 'w') as f:
    json.dump(rows, f, indent=1)
  with open(os.path.join(root, 'study.csv'), 'w', newline='') as f:
    writer = csv.DictWriter(f, fieldnames=sorted({k for r in rows for k in r}))
    writer.writeheader()
    writer.writerows(rows)
  sections = []
  for split in sorted({r['split'] for r in rows}):
    for batch_size in sorted({r['batch_size'] for r in rows}):
      subset = [r for r in rows if r['split'] == split and r['batch_size'] == batch_size]
      if not subset:
        continue
      examples = sorted({r['examples'] for r in subset})
      sections.append(f'### {split}, batch size {batch_size} ({"/".join(map(str, examples))} examples)\n\n'
                      + paper_table(subset))
      for name in sorted({r['model'] for r in subset if r['model'] != 'base'}):
        plot([r for r in subset if r['model'] == name], os.path.join(root, f'study_{split}_b{batch_size}_{name}.png'),
             f'{name}: {split}, batch {batch_size}')
  with open(os.path.join(root, 'study_paper.md'), 'w') as f:
    f.write((preface + '\n\n' if preface else '') + '\n\n'.join(sections) + '\n')

