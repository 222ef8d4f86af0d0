"""experiments/study.py --plan=heads --curves: the equal-steps comparison of head types trained elsewhere."""

import json
import os

import pytest

from bpd import metrics
from bpd.errors import UserError
from experiments import study


def _write_curve(workdir, blocks):
  os.makedirs(workdir)
  with open(os.path.join(workdir, metrics.JSONL), 'w', encoding='utf-8') as f:
    f.write(json.dumps({'prefix': 'train', 'step': 100, 'loss': 1.0}) + '\n')
    for step, block in blocks.items():
      f.write(json.dumps({'prefix': 'eval', 'step': step, 'exact_block_size': block, 'agreement_head2': block / 4,
                          'agreement_head3': block / 8}) + '\n')


def test_curves_table_lines_up_steps_of_both_head_types(tmp_path):
  independent, sequential = str(tmp_path / 'ind'), str(tmp_path / 'seq')
  _write_curve(independent, {200: 1.5, 400: 2.0, 600: 2.25})
  _write_curve(sequential, {200: 1.75, 400: 2.5})
  dirs = study.parse_curves([f'independent={independent}', f'sequential={sequential}'])
  lines = study.curves_table(dirs, k=10).splitlines()
  assert 'independent: exact block k=10' in lines[0] and 'sequential: exact block k=10' in lines[0]
  assert lines[2] == '| 200 | 1.50 | 0.375 | 0.188 | 1.75 | 0.438 | 0.219 |'
  assert lines[3] == '| 400 | 2.00 | 0.500 | 0.250 | 2.50 | 0.625 | 0.312 |'
  assert lines[4] == '| 600 | 2.25 | 0.562 | 0.281 |  |  |  |'  # a step only one model reached
  path = str(tmp_path / 'fig.png')
  study.plot_curves(dirs, 10, path, 'title')
  assert os.path.getsize(path) > 1000


@pytest.mark.parametrize('item, message', [('independent', 'HEAD_TYPE=DIR'), ('medusa=x', 'HEAD_TYPE=DIR'),
                                           ('sequential={empty}', 'no eval rows')])
def test_bad_curves_are_clear_errors(tmp_path, item, message):
  empty = str(tmp_path / 'empty')
  _write_curve(empty, {})
  with pytest.raises(UserError, match=message):
    study.parse_curves([item.format(empty=empty)])


def test_imported_scripts_import_together():
  """The scripts the tests import define their absl flags only when run: imported into one process (as a test
  worker does with several test files) they must not define a flag twice."""
  import importlib
  for name in ('accelerator_run', 'bench_decode', 'bench_scale', 'diagnostics', 'study'):
    importlib.import_module(f'experiments.{name}')


def test_curves_read_a_kept_jsonl_file_and_its_heads(tmp_path):
  """A curve kept in docs/results/curves/ (the eval rows alone, the model gone) reads like its workdir, and its k is
  the highest head with an agreement column; the committed curves themselves parse."""
  workdir = str(tmp_path / 'seq')
  _write_curve(workdir, {200: 1.75, 400: 2.5})
  kept = str(tmp_path / 'seq.jsonl')
  with open(os.path.join(workdir, metrics.JSONL), encoding='utf-8') as f, open(kept, 'w', encoding='utf-8') as out:
    out.writelines(line for line in f if '"eval"' in line)
  assert study.curve(kept) == study.curve(workdir)
  assert study.curve_k(kept) == 3
  with pytest.raises(UserError, match='no eval rows'):
    study.parse_curves([f'sequential={tmp_path / "missing.jsonl"}'])
  curves = os.path.join(os.path.dirname(__file__), '..', 'docs', 'results', 'curves')
  for name in sorted(os.listdir(curves)):
    rows = study.curve(os.path.join(curves, name))
    assert rows and study.curve_k(os.path.join(curves, name)) == 10, name
