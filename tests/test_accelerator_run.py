"""experiments/accelerator_run.py: the accelerator run's own code, on CPU, before any accelerator is lent.

`--smoke` runs every path of the GPU run (the demo trained in-script and stopped by its time limit, its tree chosen
from measured agreement, every decoder side by side, a random-weight model, bench_decode's accounting, the record);
a spent budget skips settings and says so; bad input stops before anything is compiled.
"""

import dataclasses
import json
import os
import subprocess
import sys

import pytest

from bpd.errors import UserError
from experiments import accelerator_run

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.slow
def test_smoke_run_writes_every_table(tmp_path):
  out = tmp_path / 'accel'
  subprocess.run([sys.executable, '-m', 'experiments.accelerator_run', '--smoke', f'--out={out}'], cwd=REPO,
                 check=True, timeout=900, env={**os.environ, 'PYTHONPATH': REPO, 'JAX_PLATFORMS': 'cpu'})
  record = json.loads((out / 'accelerator_run.json').read_text())
  assert record['smoke'] and record['status'] == 'done' and not record['skipped'] and not record['failures']
  assert record['environment']['device_kind'] and record['environment']['versions']['jax']
  plan = accelerator_run.SMOKE
  demo, = [rows for name, rows in record['models'].items() if name == 'demo']
  random, = [rows for name, rows in record['models'].items() if name.startswith('tiny')]
  decoders = ['greedy'] + [name for name, *_ in accelerator_run.settings(plan, record['tree'], record['tree_paths'])]
  for rows in (demo, random):
    assert [r['decoder'] for r in rows] == decoders * len(plan.batch_sizes)
    for r in rows[1:]:
      assert r['call_price'] > 0 and r['calls'] >= 1 and r['baseline_calls'] >= 1
      # Exact chains and trees give greedy's output (float32 here; DESIGN §2); sampling is not compared.
      assert r['identical'] == (None if r['kind'] == 'speculative' else 1.0)
  # The trained model's table has acceptance and speedup; the random one's only the price of a call.
  assert all(r['tokens_per_iteration'] >= 1 and r['speedup'] > 0 for r in demo[1:])
  assert all(r['tokens_per_iteration'] is None and r['speedup'] is None for r in random[1:])
  assert list(record['accounting']) == ['tiny']
  text = (out / 'accelerator_run.md').read_text()
  assert '## demo' in text and '## tiny (random weights' in text and 'SMOKE' in text
  assert 'cpu' in text and record['command'] in text


def test_spent_budget_skips_every_setting_and_says_so(tmp_path):
  record = accelerator_run.run(str(tmp_path), accelerator_run.SMOKE, budget_s=1e-9, command='test')
  assert not record['models'] and 'training the demo model' in record['skipped']
  assert any(s.startswith('tiny') for s in record['skipped'])
  text = (tmp_path / 'accelerator_run.md').read_text()
  assert '**Skipped (budget spent)**: training the demo model' in text
  assert json.loads((tmp_path / 'accelerator_run.json').read_text())['status'].startswith('done, with skipped')


@pytest.mark.parametrize('fields, budget, match', [
    ({}, 0.0, '--budget_s=0'),
    ({'tree': 'nodes:x'}, 60.0, '--tree=nodes:x'),
    ({'tree': 'ring:2'}, 60.0, 'ring:2'),
    ({'sizes': ('huge',)}, 60.0, 'huge'),
    ({'batch_sizes': (0,)}, 60.0, '--batch_sizes'),
])
def test_bad_input_is_a_user_error_before_anything_runs(tmp_path, fields, budget, match):
  plan = dataclasses.replace(accelerator_run.SMOKE, **fields)
  with pytest.raises(UserError, match=match):
    accelerator_run.run(str(tmp_path), plan, budget_s=budget, command='test')
  assert not os.listdir(tmp_path)  # nothing written
