"""experiments/tpu_estimate.py compiles one greedy step and one iteration for an abstract TPU topology (no TPU)."""

import pytest

pytest.importorskip('libtpu', reason="needs the optional TPU compiler: pip install -e '.[tpu]'")

from bpd import model as model_lib  # pylint: disable=g-import-not-at-top
from experiments import tpu_estimate  # pylint: disable=g-import-not-at-top


def test_estimate_on_an_abstract_v5e_topology():
  config = model_lib.model_config('tiny', vocab_size=300, k=4, dropout_rate=0.0, dtype='bfloat16')
  mesh = tpu_estimate.tpu_mesh('v5e:2x2')
  records = tpu_estimate.estimate(model_lib.Transformer(config), mesh, [4], [1], max_len=8, src_len=6,
                                  peak_flop_s=197e12, peak_byte_s=819e9)
  (r,) = records
  assert r['chips'] == 4 and r['block_flops'] > r['greedy_flops'] > 0 and r['ratio_roofline'] > 1
  assert '| 4 | 1 |' in tpu_estimate.format_table(records)
