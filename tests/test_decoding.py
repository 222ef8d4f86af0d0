"""The decode loops on stub step functions: exactness, acceptance, criteria, beam search."""

import functools

import hypothesis
from hypothesis import strategies as st
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from bpd import decoding
from bpd.errors import UserError
from tests import reference
from tests.stubs import BOS, EOS, Stub

SETTINGS = hypothesis.settings(max_examples=25, deadline=None, derandomize=True, database=None)


@functools.partial(jax.jit, static_argnames=('batch_size', 'k', 'max_len', 'criterion'))
def _decode(seed_B, eos_at_B, stub, *, batch_size, k, max_len, criterion):
  """stub: a traced argument (its accuracy and EOS rate are leaves), so examples share compiles."""
  state = stub.init_state(seed_B, eos_at_B, max_len + k + 1)
  fixed = decoding.Fixed(batch_size=batch_size, max_len=max_len, bos_id=BOS, eos_id=EOS)
  g = decoding.greedy(stub.score_fn, state, fixed=fixed)
  greedy = (g.tokens_BxL, g.length_B, g.invocations)
  block = decoding.blockwise(decoding.ModelFns(stub.score_fn, stub.propose_fn), state, fixed=fixed,
                             tree=decoding.layout(decoding.chain_tree(k)), rule=criterion)
  return greedy, block


def run(stub, seed_B, eos_at_B, max_len, criterion=decoding.Criterion()):
  seed_B, eos_at_B = np.asarray(seed_B), np.asarray(eos_at_B)
  return _decode(jnp.asarray(seed_B), jnp.asarray(eos_at_B), stub, batch_size=len(seed_B), k=stub.k,
                 max_len=max_len, criterion=criterion)


# Shapes come from small sets so that jit's cache is reused across examples.
cases = st.fixed_dictionaries({
    'batch': st.sampled_from([1, 8]),
    'k': st.integers(1, 10),
    'max_len': st.sampled_from([1, 20]),
    'accuracy': st.sampled_from([0.0, 0.5, 0.9, 1.0]),
    'eos_rate': st.sampled_from([0, 5, 11]),
    'seed': st.integers(0, 2**31 - 1),
})


@hypothesis.given(cases)
@SETTINGS
def test_exact_blockwise_equals_greedy_equals_reference(case):
  stub = Stub(vocab_size=16, k=case['k'], head_accuracy=case['accuracy'], eos_rate=case['eos_rate'])
  rng = np.random.RandomState(case['seed'] % 2**31)
  seed_B = rng.randint(0, 2**31, size=case['batch'])
  eos_at_B = rng.randint(1, case['max_len'] + 3, size=case['batch'])  # some rows never reach EOS
  reference = stub.reference_greedy(seed_B, eos_at_B, case['max_len'])
  (greedy_tokens, greedy_length, _), block = run(stub, seed_B, eos_at_B, case['max_len'])

  np.testing.assert_array_equal(np.asarray(greedy_tokens), reference)
  np.testing.assert_array_equal(np.asarray(block.tokens_BxL), reference)
  np.testing.assert_array_equal(np.asarray(block.length_B), np.asarray(greedy_length))
  ref_length = (reference != 0).sum(axis=1)
  np.testing.assert_array_equal(np.asarray(block.length_B), ref_length)
  # Bookkeeping: the histogram counts every iteration once and adds up to the tokens produced, except for a row
  # whose first token ends it: the initial call produced it, with no iteration.
  counts = np.asarray(block.block_counts_BxK)
  assert counts.shape[1] == case['k'] + 1
  np.testing.assert_array_equal(counts.sum(axis=1), np.asarray(block.iterations_B))
  first_call_only = np.asarray(block.iterations_B) == 0
  np.testing.assert_array_equal(first_call_only, ref_length == 1)
  np.testing.assert_array_equal(np.asarray(block.first_call_B), first_call_only)
  np.testing.assert_array_equal((counts * np.arange(1, case['k'] + 2)).sum(axis=1), ref_length - first_call_only)
  assert int(block.invocations) == int(np.asarray(block.iterations_B).max()) + 1


@hypothesis.given(st.sampled_from([1, 2, 5, 10]), st.sampled_from([1, 4]), st.integers(0, 1000))
@SETTINGS
def test_heads_always_right_accept_min_k_remaining(k, batch, seed):
  stub = Stub(vocab_size=16, k=k, head_accuracy=1.0)
  rng = np.random.RandomState(seed)
  max_len = 23
  eos_at_B = rng.randint(1, max_len + 3, size=batch)
  _, block = run(stub, rng.randint(0, 2**31, size=batch), eos_at_B, max_len)
  for b in range(batch):
    length = int(block.length_B[b])
    # Every iteration accepts min(k, remaining): full blocks, then the remainder. The last token (EOS or the
    # max_len-th) is head 1's next choice after the previous block: when it is all that remains, that block's
    # call produced it (k + 1 tokens), and the first call alone produces a one-token row.
    expected = [0] * (k + 1)
    full, rest = divmod(length - 1, k)
    if length > 1 and rest == 0:
      expected[k - 1] += full - 1
      expected[k] += 1
    elif length > 1:
      expected[k - 1] += full
      expected[rest] += 1
    assert list(np.asarray(block.block_counts_BxK[b])) == expected
    assert int(block.iterations_B[b]) == -(-(length - 1) // k)


@hypothesis.given(st.sampled_from([1, 2, 6, 10]), st.integers(0, 1000))
@SETTINGS
def test_heads_always_wrong_accept_one_and_still_equal_greedy(k, seed):
  stub = Stub(vocab_size=16, k=k, head_accuracy=0.0)
  rng = np.random.RandomState(seed)
  seed_B, eos_at_B = rng.randint(0, 2**31, size=4), rng.randint(1, 20, size=4)
  (greedy_tokens, _, _), block = run(stub, seed_B, eos_at_B, 18)
  np.testing.assert_array_equal(np.asarray(block.tokens_BxL), np.asarray(greedy_tokens))
  # One token per iteration, but the last: the call that accepted the one before it produced it too.
  length_B = np.asarray(block.length_B)
  np.testing.assert_array_equal(np.asarray(block.iterations_B), length_B - 1)
  counts = np.asarray(block.block_counts_BxK)
  np.testing.assert_array_equal(counts[:, 1], (length_B > 1).astype(int))
  assert counts[:, 2:].sum() == 0


@pytest.mark.parametrize('spec', ['top_k:1', 'distance:0', 'min_block:1', 'top_k:1+min_block:1'])
def test_trivial_approximations_behave_exactly_like_exact(spec):
  stub = Stub(vocab_size=16, k=6, head_accuracy=0.6, eos_rate=13)
  rng = np.random.RandomState(3)
  seed_B, eos_at_B = rng.randint(0, 2**31, size=8), rng.randint(1, 40, size=8)
  _, exact = run(stub, seed_B, eos_at_B, 30)
  _, other = run(stub, seed_B, eos_at_B, 30, decoding.parse_criterion(spec, k=6))
  for field in ('tokens_BxL', 'length_B', 'iterations_B', 'block_counts_BxK'):
    np.testing.assert_array_equal(np.asarray(getattr(other, field)), np.asarray(getattr(exact, field)))


def _logits(rows):
  """Hand-made logits [B, N, V] from lists of per-position score lists."""
  return jnp.asarray(np.array(rows, np.float32))


def test_exact_and_top_k_accept_what_they_should():
  # Position scores over 5 tokens; token 4 is best, then 2, then 0 and 3 tied, then 1.
  scores = [1.0, -1.0, 3.0, 1.0, 5.0]
  logits = _logits([[scores] * 5])
  proposals = jnp.asarray([[4, 2, 0, 3, 1]])
  exact = decoding.accept_mask(decoding.Criterion('exact'), proposals, logits)
  assert exact.tolist() == [[True, False, False, False, False]]
  top2 = decoding.accept_mask(decoding.parse_criterion('top_k:2'), proposals, logits)
  assert top2.tolist() == [[True, True, False, False, False]]
  # Ties rank by index, as argmax breaks them: token 0 ranks 3rd, token 3 4th.
  top3 = decoding.accept_mask(decoding.parse_criterion('top_k:3'), proposals, logits)
  assert top3.tolist() == [[True, True, True, False, False]]
  top5 = decoding.accept_mask(decoding.parse_criterion('top_k:5'), proposals, logits)
  assert top5.tolist() == [[True] * 5]


def test_distance_accepts_within_eps_of_argmax():
  logits = _logits([[[0, 0, 0, 0, 0, 0, 0, 0, 9, 0, 0, 0, 0]] * 6])  # argmax 8
  proposals = jnp.asarray([[8, 10, 6, 11, 5, 9]])
  ok = decoding.accept_mask(decoding.parse_criterion('distance:2'), proposals, logits)
  assert ok.tolist() == [[True, True, True, False, False, True]]


def test_block_size_takes_leading_run_and_min_block():
  checks = jnp.asarray([[True, True, False, True], [False, True, True, True], [True] * 4, [False] * 4])
  assert decoding.block_size(decoding.Criterion(), checks).tolist() == [3, 1, 5, 1]
  assert decoding.block_size(decoding.parse_criterion('min_block:3', k=5), checks).tolist() == [3, 3, 5, 3]


def test_min_block_accepts_wrong_tokens_and_counts_them():
  stub = Stub(vocab_size=16, k=4, head_accuracy=0.0)
  rng = np.random.RandomState(0)
  seed_B, eos_at_B = rng.randint(0, 2**31, size=3), np.array([100, 100, 100])
  (greedy_tokens, _, _), block = run(stub, seed_B, eos_at_B, 20, decoding.parse_criterion('min_block:3', k=4))
  counts = np.asarray(block.block_counts_BxK)
  # Heads are always wrong, so every block is exactly the forced 3 tokens (the last one capped by max_len).
  assert counts[:, 2].tolist() == [6, 6, 6] and counts[:, 1].tolist() == [1, 1, 1]
  assert not np.array_equal(np.asarray(block.tokens_BxL), np.asarray(greedy_tokens))
  # The forced tokens are what head 2 and 3 proposed, and head 1 still chose the first of each block.
  np.testing.assert_array_equal(np.asarray(block.tokens_BxL)[:, 0], np.asarray(greedy_tokens)[:, 0])


@pytest.mark.parametrize('spec, message', [
    ('nope', 'Unknown criterion'),
    ('top_k:0', 'top_k needs T >= 1'),
    ('top_k:x', 'not an integer'),
    ('distance:-1', 'distance needs EPS >= 0'),
    ('min_block:5', 'at most k=4'),
    ('min_block:0', 'at least 1'),
    ('top_k:2+distance:1', 'combines two checks'),
])
def test_bad_criteria_raise_clear_errors(spec, message):
  with pytest.raises(UserError, match=message):
    decoding.parse_criterion(spec, k=4)


def test_criteria_round_trip_through_strings():
  for spec in ['exact', 'top_k:2', 'distance:2', 'min_block:3', 'top_k:2+min_block:2']:
    assert str(decoding.parse_criterion(spec, k=8)) == spec
  assert decoding.parse_criterion('min_block:2') == decoding.Criterion('exact', min_block=2)


# -- beam search -------------------------------------------------------------------------------------------

class MarkovStub:
  """Logits that depend only on the previous token: a table [V, V] of log-probabilities."""

  def __init__(self, table_VxV):
    self.table = jnp.asarray(table_VxV, jnp.float32)  # may be a tracer inside jit

  def score_fn(self, state, tokens_BxT, start_B):
    return self.table[tokens_BxT], None, state


def _greedy_is_suboptimal_table():
  """After BOS: A (p .55) or B (p .45). After A: six words at p 1/6 each. After B: EOS at p .99.

  Greedy takes A and then pays log(1/6); beam search finds B, EOS with a far higher total probability.
  """
  V, A, B, W = 12, 3, 4, 5
  table = np.full((V, V), -30.0)
  table[BOS, A], table[BOS, B] = np.log(0.55), np.log(0.45)
  table[A, W:W + 6] = np.log(1 / 6)
  table[B, EOS], table[B, W] = np.log(0.99), np.log(0.01)
  for w in range(W, W + 6):
    table[w, EOS] = 0.0
  table[EOS, EOS] = 0.0
  return table, A, B


def test_beam_search_beats_greedy_where_greedy_is_suboptimal():
  table, A, B = _greedy_is_suboptimal_table()
  stub = MarkovStub(table)
  state = {'dummy_B': jnp.zeros((2,))}
  fixed = decoding.Fixed(batch_size=2, max_len=5, bos_id=BOS, eos_id=EOS)
  greedy_tokens = decoding.greedy(stub.score_fn, state, fixed=fixed).tokens_BxL
  beam_tokens, scores = decoding.beam_search(stub.score_fn, state, fixed=fixed, beam_size=3, alpha=0.0)
  assert greedy_tokens[0].tolist()[:3] == [A, 5, EOS]
  assert beam_tokens[0, 0].tolist() == [B, EOS, 0, 0, 0]
  np.testing.assert_allclose(float(scores[0, 0]), np.log(0.45) + np.log(0.99), rtol=1e-5)
  greedy_logp = np.log(0.55) + np.log(1 / 6)
  assert float(scores[0, 0]) > greedy_logp
  assert np.all(np.diff(np.asarray(scores[0])) <= 0)  # best first


@functools.partial(jax.jit, static_argnames=('batch', 'max_len'))
def _markov_greedy_and_beam1(table, *, batch, max_len):
  stub = MarkovStub(table)
  state = {'dummy_B': jnp.zeros((batch,))}
  fixed = decoding.Fixed(batch_size=batch, max_len=max_len, bos_id=BOS, eos_id=EOS)
  greedy_tokens = decoding.greedy(stub.score_fn, state, fixed=fixed).tokens_BxL
  beam_tokens, _ = decoding.beam_search(stub.score_fn, state, fixed=fixed, beam_size=1, alpha=0.0)
  return greedy_tokens, beam_tokens


@hypothesis.given(st.sampled_from([1, 3]), st.sampled_from([4, 9]), st.integers(0, 10_000))
@SETTINGS
def test_beam_one_equals_greedy(batch, max_len, seed):
  rng = np.random.RandomState(seed)
  table = rng.randn(10, 10).astype(np.float32) * 2
  table[:, EOS] += rng.rand() * 2  # sometimes EOS comes early, sometimes never
  greedy_tokens, beam_tokens = _markov_greedy_and_beam1(jnp.asarray(table), batch=batch, max_len=max_len)
  np.testing.assert_array_equal(np.asarray(beam_tokens[:, 0]), np.asarray(greedy_tokens))


def test_summarize_defines_mean_block_size_over_rows():
  result = decoding.DecodeResult(
      tokens_BxL=jnp.zeros((3, 8), jnp.int32), length_B=jnp.asarray([6, 2, 1]), iterations_B=jnp.asarray([2, 2, 0]),
      block_counts_BxK=jnp.asarray([[0, 0, 2], [2, 0, 0], [0, 0, 0]]), first_call_B=jnp.asarray([0, 0, 1]),
      invocations=jnp.asarray(3))
  stats = decoding.summarize(result)
  assert stats['mean_accepted_block_size'] == 2.25  # (6 + 2 + 1) tokens / (2 + 2 + 0) iterations
  assert stats['row_invocations'] == 7 and stats['batch_invocations'] == 3
  assert stats['block_size_histogram'] == [2, 0, 2]
  # The histogram and the token count agree on what they leave out: the row the first call produced alone.
  assert stats['tokens'] == sum(n * c for n, c in enumerate(stats['block_size_histogram'], 1)) + stats[
      'first_call_tokens']


# -- approximate criteria against an uncached reference ------------------------------------------------------

@pytest.mark.parametrize('spec', ['top_k:2', 'top_k:3', 'distance:2', 'min_block:2', 'top_k:2+min_block:3',
                                  'distance:1+min_block:2', 'exact'])
def test_every_criterion_matches_an_uncached_reference(spec):
  stub = Stub(vocab_size=16, k=4, head_accuracy=0.5, eos_rate=9)
  rng = np.random.RandomState(sum(map(ord, spec)))
  seed_B, eos_at_B = rng.randint(0, 2**31, size=4), rng.randint(1, 16, size=4)
  _, block = run(stub, seed_B, eos_at_B, 13, decoding.parse_criterion(spec, k=4))
  for b in range(4):
    tokens, iterations = reference.reference_blockwise(stub, int(seed_B[b]), int(eos_at_B[b]), 13,
                                                       decoding.chain_tree(4), decoding.parse_criterion(spec, k=4))
    length = int(block.length_B[b])
    assert list(np.asarray(block.tokens_BxL[b])[:length]) == tokens
    assert int(block.iterations_B[b]) == iterations
