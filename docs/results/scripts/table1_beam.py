"""The tables of table1_beam.sh's models: python docs/results/scripts/table1_beam.py ROOT > table.md

Reads ROOT/<model>/decode/results.json (the decode sweeps) and prints, in markdown:
  1. BLEU of each model's greedy output on test_2016_flickr and val, against the student's base;
  2. the mean accepted block (exact) at k' = 2 / 4 / 8 for the chain, dynamic:16 and dynamic:32, with the fraction of
     rows identical to greedy, and the paper's cell beside it (Table 1, WMT14 newstest2013).
"""

import json
import os
import sys

# Stern et al. 2018, Table 1 (BLEU / mean accepted block; DESIGN §2): Distillation and Both at k = 2, 4, 8.
PAPER = {'Distillation': {2: (26.52, 1.55), 4: (26.31, 1.85), 8: (26.25, 1.91)},
         'Both': {2: (26.58, 1.88), 4: (26.36, 3.27), 8: (26.11, 4.69)}}
PAPER_BASE_BLEU = 26.00  # the paper's k = 1 Regular row (its base through the multi-output layer)

MODELS = [  # (folder, column, corpus)
    ('both_sequential', 'Both', 'teacher (seed 1), beam 4'),
    ('both_independent', 'Both', 'teacher (seed 1), beam 4'),
    ('distil_sequential', 'Distillation', 'teacher (seed 1), beam 4'),
    ('distil_independent', 'Distillation', 'teacher (seed 1), beam 4'),
    ('ablate_self_greedy_sequential', 'Both', 'self (seed 0), greedy'),
    ('ablate_self_greedy_independent', 'Both', 'self (seed 0), greedy'),
    ('ablate_self_beam4_sequential', 'Both', 'self (seed 0), beam 4'),
    ('ablate_self_beam4_independent', 'Both', 'self (seed 0), beam 4'),
    ('ablate_teacher_greedy_sequential', 'Both', 'teacher (seed 1), greedy'),
    ('ablate_teacher_greedy_independent', 'Both', 'teacher (seed 1), greedy'),
]
SPLITS = ('test_2016_flickr', 'val')
TREES = ('chain', 'dynamic:16', 'dynamic:32')
KS = (2, 4, 8)


def load(root, model):
  """The rows of ROOT/<model>/decode/results.json, and of ROOT/val_<model>/ (a later sweep of a split the first
  one did not decode, in a folder of links to the model so that the first results stay as they are)."""
  rows = []
  for folder in (model, f'val_{model}'):
    path = os.path.join(root, folder, 'decode', 'results.json')
    if os.path.exists(path):
      with open(path, encoding='utf-8') as f:
        data = json.load(f)
      rows += data['results'] if isinstance(data, dict) and 'results' in data else data
  return rows or None


def greedy_bleu(rows, split):
  row = next((r for r in rows if r['split'] == split and r['criterion'] == 'greedy'), None)
  return row and row['quality']


def block(rows, split, tree, k):
  row = next((r for r in rows if r['split'] == split and r['criterion'] == 'exact' and r.get('tree') == tree
              and r['k'] == k), None)
  return row and (row['mean_accepted_block_size'], row['identical_to_greedy'])


def bleu_cell(ours, ref=None):
  """A BLEU cell: '–' where the split was not decoded, with the difference to the base where it was."""
  if ours is None:
    return '–'
  return f'{ours:.2f}' if ref is None else f'{ours:.2f} ({ours - ref:+.2f})'


def main(root):
  base, teacher = load(root, 'base'), load(root, 'teacher')
  signature = next((r.get('bleu_signature') for r in base or [] if r.get('bleu_signature')), 'not recorded')
  print(f'BLEU: sacreBLEU `{signature}`, greedy output of each model (for a k-head model, its head 1).\n')
  print('| model | heads | trained on | ' + ' | '.join(f'BLEU {s} (vs base)' for s in SPLITS) + ' |')
  print('|---|---|---|' + '---|' * len(SPLITS))
  for name, rows in (('base (seed 0, the student\'s)', base), ('teacher (seed 1)', teacher)):
    if rows:
      print(f'| {name} | – | original data | ' + ' | '.join(bleu_cell(greedy_bleu(rows, s)) for s in SPLITS) + ' |')
  for folder, column, corpus in MODELS:
    rows = load(root, folder)
    if not rows or not base:
      continue
    cells = [bleu_cell(greedy_bleu(rows, s), greedy_bleu(base, s)) for s in SPLITS]
    print(f'| {column} | {folder.rsplit("_", 1)[1]} | {corpus} | ' + ' | '.join(cells) + ' |')
  print(f'\nThe paper (newstest2013): base {PAPER_BASE_BLEU:.2f}; Distillation k = 8 {PAPER["Distillation"][8][0]:.2f}; '
        f'Both k = 8 {PAPER["Both"][8][0]:.2f}.\n')
  for split in SPLITS:
    if not any(block(load(root, folder) or [], split, 'chain', k) for folder, _, _ in MODELS for k in KS):
      continue  # not decoded
    print(f'Mean accepted block, exact, {split} (identical to greedy: the fraction of rows; paper: its Table 1 '
          'cell at that k).\n')
    header = ' | '.join(f'{tree} k\'={k}' for tree in TREES for k in KS)
    print(f'| model | heads | trained on | {header} | identical | paper k\'=2 / 4 / 8 |')
    print('|---|---|---|' + '---|' * (len(TREES) * len(KS) + 2))
    for folder, column, corpus in MODELS:
      rows = load(root, folder)
      if not rows or not any(block(rows, split, tree, k) for tree in TREES for k in KS):
        continue
      cells, identical = [], []
      for tree in TREES:
        for k in KS:
          got = block(rows, split, tree, k)
          cells.append(f'{got[0]:.2f}' if got else '–')  # dynamic:N at k' = 2 has too few candidates
          if got:
            identical.append(got[1])
      paper = ' / '.join(f'{PAPER[column][k][1]:.2f}' for k in KS)
      print(f'| {column} | {folder.rsplit("_", 1)[1]} | {corpus} | ' + ' | '.join(cells) +
            f' | {min(identical):.3f} | {paper} |')
    print()


if __name__ == '__main__':
  main(sys.argv[1])
