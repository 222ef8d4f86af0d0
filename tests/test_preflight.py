"""bench_scale --mode=preflight: a config's train step and decode loop compiled for an abstract TPU topology."""

import pytest

pytest.importorskip('libtpu', reason="needs the optional TPU compiler: pip install -e '.[tpu]'")

from experiments import bench_scale  # pylint: disable=g-import-not-at-top
from tests.test_pipeline import tiny_config  # pylint: disable=g-import-not-at-top


def test_preflight_of_a_tiny_config_on_an_abstract_v5e_topology():
  config = tiny_config(**{'k': 3, 'train.regime': 'finetune', 'train.init_from': 'unused'})
  records = bench_scale.preflight(config, bench_scale.topology_devices('v5e:2x2'))
  assert [r['program'] for r in records] == ['train step', 'decode loop, k=3']
  assert all(0 < r['total'] < 2**30 for r in records)
  table = bench_scale.format_table(records, 16 * 2**30)
  assert table.count('| yes |') == 2
  assert '**no**' in bench_scale.format_table(records, 1)  # a chip of one byte holds nothing
