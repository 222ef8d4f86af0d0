"""bench_decode --tpu: a greedy step and an iteration compiled for TPU chips (no TPU); a clear error without libtpu."""

import importlib.util
import os
import subprocess
import sys

import jax
import pytest

from bpd import model as model_lib
from bpd import tpu_estimate
from bpd.errors import UserError
from experiments import bench_decode

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
needs_libtpu = pytest.mark.skipif(importlib.util.find_spec('libtpu') is None,
                                  reason="needs the optional TPU compiler: pip install -e '.[tpu]'")


@needs_libtpu
def test_bench_rows_get_a_tpu_estimate_per_chip_and_size():
  config = model_lib.model_config('tiny', vocab_size=300, k=4, dropout_rate=0.0)
  model = model_lib.Transformer(config)
  params = model_lib.init_params(config, jax.random.PRNGKey(0))
  chip_devices, configs = bench_decode.tpu_setup(['v5e', 'v4'], ['tiny'], vocab_size=300, k=4, head_hidden=0)
  assert {chip: n for chip, (_, n) in chip_devices.items()} == {'v5e': 1, 'v4': 2}  # v4: two TensorCores per chip
  peaks = {'peak_gflop_s': 100.0, 'peak_gbyte_s': 10.0, 'cached_gbyte_s': 40.0}  # not measured: nothing is timed here
  records = bench_decode.bench(model, params, [4], [1], max_len=8, src_len=6, repeats=1, peaks=peaks)
  bench_decode.add_tpu_estimates(records, chip_devices, configs)
  (r,) = records
  assert {'k', 'batch_size', 'greedy_step_s', 'block_step_s', 'ratio'} <= set(r)  # the CPU fields stay
  for chip in ('v5e', 'v4'):
    # A 4-token iteration scores 4 positions and proposes 3 tokens: more FLOPs than a 1-token greedy step.
    assert r[f'tpu_{chip}_tiny_block_flops'] > r[f'tpu_{chip}_tiny_greedy_flops'] > 0
    assert r[f'tpu_{chip}_tiny_ratio'] == (r[f'tpu_{chip}_tiny_block_roofline_s'] /
                                           r[f'tpu_{chip}_tiny_greedy_roofline_s'])
  table = bench_decode.format_table(records, tpu_chips=['v5e', 'v4'], tpu_sizes=['tiny'])
  assert 'TPU v5e ESTIMATE: ratio (tiny)' in table and f"| {r['tpu_v4_tiny_ratio']:.2f} |" in table
  assert all(line.count('|') == 13 for line in table.splitlines())  # 12 columns in every line


def test_tpu_without_libtpu_is_a_user_error_naming_the_extra(monkeypatch):
  monkeypatch.setitem(sys.modules, 'libtpu', None)  # `import libtpu` raises ImportError
  with pytest.raises(UserError, match=r"pip install -e '\.\[tpu\]'"):
    bench_decode.tpu_setup(['v5e'], [], vocab_size=300, k=4, head_hidden=0)
  with pytest.raises(UserError, match='--tpu=v6e'):
    bench_decode.tpu_setup(['v6e'], [], vocab_size=300, k=4, head_hidden=0)


def test_bench_decode_stops_before_measuring_when_libtpu_is_missing(tmp_path):
  # A libtpu that cannot be imported, ahead of any installed one on the path.
  (tmp_path / 'libtpu.py').write_text("raise ImportError('hidden by a test')\n")
  env = {**os.environ, 'PYTHONPATH': os.pathsep.join([str(tmp_path), REPO])}
  result = subprocess.run([sys.executable, '-m', 'experiments.bench_decode', '--config=configs/multi30k_ende.py',
                           '--tpu=v5e'], cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
  assert result.returncode == 2, result.stderr
  assert "pip install -e '.[tpu]'" in result.stderr and 'Traceback' not in result.stderr
  assert result.stdout == ''  # nothing measured


@needs_libtpu
def test_tree_rows_get_a_tpu_estimate():
  """bench_decode --mode=trees --tpu: a tree iteration compiled for a TPU chip costs more FLOPs than the chain's,
  both more than a greedy step, and the estimated speedup is the row's accepted block over its estimated ratio."""
  config = model_lib.model_config('tiny', vocab_size=300, k=3, dropout_rate=0.0)
  paths = ((0,), (1,), (0, 0), (0, 1), (1, 0), (0, 0, 0))
  rows = [{'batch': 2, 'nodes': 3, 'paths': None, 'mean_accepted_block': 2.0, 'tree': 'chain (k=3)',
           'iterations': 9, 'identical_to_greedy': 1.0},
          {'batch': 2, 'nodes': len(paths), 'paths': paths, 'mean_accepted_block': 2.5, 'tree': 'nodes:6',
           'iterations': 7, 'identical_to_greedy': 1.0}]
  bench_decode.add_tree_tpu_estimates(rows, config, ['v5e'], k=3, max_len=12, src_len=8)
  for r in rows:
    assert r['tpu_v5e_ratio'] > 0 and r['tpu_v5e_speedup'] == r['mean_accepted_block'] / r['tpu_v5e_ratio']
  device, _ = tpu_estimate.chip_device('v5e')
  shapes = dict(batch=2, max_len=12, src_len=8, cache_len=12 + len(paths) + 1)
  tree = tpu_estimate.step_cost(config, device, 'tree', k=3, paths=paths, **shapes)
  greedy = tpu_estimate.step_cost(config, device, 'greedy', k=1, **shapes)
  assert tree['flops'] > greedy['flops'] > 0
  table = bench_decode.trees_table(rows, {2: 2.0}, ['v5e'])
  assert 'TPU v5e ESTIMATE' in table and f"{rows[1]['tpu_v5e_speedup']:.2f}x |" in table
