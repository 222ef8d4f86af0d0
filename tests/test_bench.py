"""experiments/bench_decode.py: the FLOP count from the shapes agrees with XLA's cost analysis (no timed asserts)."""

import jax
import pytest

from bpd import model as model_lib
from experiments import bench_decode


def test_shape_count_matches_xla_cost_analysis_and_records_keep_their_fields():
  config = model_lib.model_config('tiny', vocab_size=300, k=4, dropout_rate=0.0)
  model = model_lib.Transformer(config)
  params = model_lib.init_params(config, jax.random.PRNGKey(0))
  # Not measured here: the test checks counts, not speed.
  peaks = {'peak_gflop_s': 100.0, 'peak_gbyte_s': 10.0, 'cached_gbyte_s': 40.0}
  records = bench_decode.bench(model, params, [2, 4], [1, 3], max_len=8, src_len=6, repeats=1, peaks=peaks)
  assert [(r['k'], r['batch_size']) for r in records] == [(2, 1), (4, 1), (2, 3), (4, 3)]
  for r in records:
    assert {'k', 'batch_size', 'greedy_step_s', 'block_step_s', 'ratio'} <= set(r)
    # The count leaves out layer norms, softmaxes and argmaxes: a few percent of the FLOPs of these shapes.
    assert 0.8 < r['greedy_flops_xla'] / r['greedy_flops_count'] < 1.25, r
    assert 0.8 < r['block_flops_xla'] / r['block_flops_count'] < 1.25, r
    assert r['block_flops_count'] > r['greedy_flops_count']
  assert bench_decode.format_table(records).count('\n') == len(records) + 1


def test_draft_vocabulary_rows_are_timed_beside_the_full_heads_and_counted():
  """--draft_vocab: each (k, batch) gets a row per draft size beside the full-vocabulary one, and the shape count of
  an iteration whose proposals read R rows instead of V still agrees with XLA's."""
  config = model_lib.model_config('tiny', vocab_size=300, k=3, dropout_rate=0.0)
  model = model_lib.Transformer(config)
  params = model_lib.init_params(config, jax.random.PRNGKey(0))
  peaks = {'peak_gflop_s': 100.0, 'peak_gbyte_s': 10.0, 'cached_gbyte_s': 40.0}
  records = bench_decode.bench(model, params, [3], [1], max_len=6, src_len=6, repeats=1, peaks=peaks,
                               draft_sizes=[30])
  assert [(r['k'], r['draft_vocab']) for r in records] == [(3, 0), (3, 30)]
  full, draft = records
  assert full['greedy_step_s'] == draft['greedy_step_s']  # one greedy timing, alternated with both
  assert 0.8 < draft['block_flops_xla'] / draft['block_flops_count'] < 1.25, draft
  assert draft['block_flops_count'] < full['block_flops_count']
  assert '| 3 | 1 | 30 |' in bench_decode.format_table(records)


def test_latency_alternates_sentence_by_sentence_or_pass_by_pass():
  """--mode=latency's order: every decoder on each sentence in turn, or each decoder over every sentence in a row
  (a test set's decode: its weights stay warm); both run every (sentence, decoder) exactly once per pass."""
  names = ['greedy, skinny', 'chain, skinny', 'chain, xla']
  by_sentence = bench_decode.latency_order(names, 3, 'sentence')
  by_pass = bench_decode.latency_order(names, 3, 'pass')
  assert by_sentence[:3] == [(0, name) for name in names] and by_sentence[3] == (1, names[0])
  assert by_pass[:3] == [(i, names[0]) for i in range(3)] and by_pass[3] == (0, names[1])
  assert sorted(by_sentence) == sorted(by_pass) and len(set(by_pass)) == 9
  with pytest.raises(ValueError, match='alternate'):
    bench_decode.latency_order(names, 3, 'decoder')
