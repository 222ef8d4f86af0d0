"""Speculative sampling (bpd/speculative.py) is exact in distribution, for chains and trees, at batch 1 and > 1.

The subject is tests/stubs.py SoftStub: soft logits over 6 tokens (EOS and three words can come) that depend on
the whole prefix, and proposal heads close to, but never equal to, the true distributions. Outputs are cut at
max_len = 3 or 4 tokens, so the exact distribution of whole outputs (40 or 121 of them) is enumerated by
ancestral sampling in numpy (SoftStub.exact_distribution). The rows of one batch are independent streams, so one
jitted call of 20000 rows is 20000 samples.

The bound: Pearson's chi-square statistic of the 20000 samples against the enumerated distribution, over the
outcomes expected at least 5 times (the rarer ones merged into one cell, Cochran's rule, so that the chi-square
approximation holds), compared with the chi-square quantile of false-alarm rate ALPHA = 1e-4 at cells - 1
degrees of freedom. A sample outside the support fails outright. Every comparison of a correct sampler therefore
fails by chance with probability about 1e-4 (the seeds are fixed, so a run is reproducible); the planted errors
(tests/planted.py) push the statistic far past the bound.
"""

import collections
import functools
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from scipy import stats

from bpd import decoder as decoder_lib
from bpd import decoding
from bpd import rules
from bpd import speculative
from bpd.errors import UserError
from tests import planted
from tests.stubs import BOS, EOS, SoftStub

ALPHA = 1e-4  # false-alarm rate of one comparison
SAMPLES = 20000
SEED = 5  # the stub's source: every row decodes the same source
TREE = ((0,), (0, 0), (0, 1), (0, 2), (0, 0, 0), (0, 0, 1), (0, 1, 0))  # siblings at depths 1 and 2


# A context-aware tree (decoding.Dynamic) of 6 nodes over the stub's 3 heads: 2 beam nodes per depth, 3 ranks each.
DYNAMIC = decoding.Dynamic(6, 3, beam=2, ranks=3)


@functools.partial(jax.jit, static_argnames=('stub', 'batch_size', 'max_len', 'paths', 'plant', 'top_k', 'top_p',
                                             'verify', 'sequential'))
def _sample(key, seed_B, temperature, *, stub, batch_size, max_len, paths=None, plant=None, top_k=0, top_p=1.0,
            verify='token', sequential=False):
  """paths: a topology (None: the chain of stub.k) or a decoding.Dynamic; sequential: the heads are fed their
  parent's token (SoftStub.expand_fn), as sequential heads are."""
  if isinstance(paths, decoding.Dynamic):
    tree = paths
  else:
    tree = decoding.layout(decoding.check_tree(paths or decoding.chain_tree(stub.k), stub.k))
  state = stub.init_state(seed_B, max_len + tree.num_nodes + 1)
  rule = speculative.Sampling(temperature=temperature, top_k=top_k, top_p=top_p, verify=verify)
  if plant:
    rule = planted.Planted(rule, plant)
  rule.check(tree)
  return decoding.blockwise(decoding.ModelFns(stub.score_fn, stub.propose_fn, stub.move_fn,
                                              expand=stub.expand_fn if sequential else None), state,
                            fixed=decoding.Fixed(batch_size=batch_size, max_len=max_len, bos_id=BOS, eos_id=EOS),
                            tree=tree, rule=rule, key=key)


@functools.partial(jax.jit, static_argnames=('stub', 'max_len', 'paths'))
def _sample_batch1(keys, temperature, *, stub, max_len, paths=None):
  """SAMPLES decodes at batch 1, one key each (vmap: each keeps its own loop condition and state)."""
  one = lambda key: _sample.__wrapped__(key, jnp.full((1,), SEED, jnp.uint32), temperature, stub=stub,
                                        batch_size=1, max_len=max_len, paths=paths)
  return jax.vmap(one)(keys)


def _outcomes(tokens_BxL, length_B):
  return [tuple(row[:n]) for row, n in zip(np.asarray(tokens_BxL).tolist(), np.asarray(length_B).tolist())]


def chi_square(outcomes, exact):
  """(Pearson's statistic, its false-alarm bound at ALPHA, outcomes outside the support), module docstring."""
  counts = collections.Counter(outcomes)
  n = len(outcomes)
  outside = sum(c for o, c in counts.items() if o not in exact)
  cells, rare_observed, rare_expected = [], 0, 0.0
  for outcome, prob in exact.items():
    if n * prob >= 5:
      cells.append((counts.get(outcome, 0), n * prob))
    else:
      rare_observed, rare_expected = rare_observed + counts.get(outcome, 0), rare_expected + n * prob
  if rare_expected > 0:
    cells.append((rare_observed, rare_expected))
  statistic = sum((o - e) ** 2 / e for o, e in cells)
  return statistic, stats.chi2.isf(ALPHA, len(cells) - 1), outside


def assert_matches_ancestral(result, stub, max_len, temperature, top_k=0, top_p=1.0):
  """The samples of `result` (a DecodeResult, or (tokens, lengths)) follow ancestral sampling of the stub."""
  tokens, lengths = (result.tokens_BxL, result.length_B) if hasattr(result, 'tokens_BxL') else result
  exact = stub.exact_distribution(SEED, max_len, temperature, top_k, top_p)
  statistic, bound, outside = chi_square(_outcomes(tokens, lengths), exact)
  assert outside == 0, f'{outside} samples the model cannot produce'
  assert statistic < bound, f'chi-square {statistic:.1f} >= {bound:.1f}: not the model\'s distribution'
  return statistic


def _batch(stub, max_len, temperature, paths=None, plant=None, key=0, top_k=0, top_p=1.0, sequential=False):
  return _sample(jax.random.PRNGKey(key), jnp.full((SAMPLES,), SEED, jnp.uint32), jnp.float32(temperature),
                 stub=stub, batch_size=SAMPLES, max_len=max_len, paths=paths, plant=plant, top_k=top_k, top_p=top_p,
                 sequential=sequential)


# -- the reference itself ----------------------------------------------------------------------------------

def test_the_enumerated_distribution_is_what_ancestral_sampling_draws():
  """The project's own ancestral sampler (greedy over sampling_score_fn) passes the test: the enumeration and
  the bound are right, so a failure below is the speculative sampler's."""
  stub = SoftStub(k=1)

  @jax.jit
  def ancestral(key):
    score_fn = decoder_lib.sampling_score_fn(stub.score_fn, key, jnp.float32(0.6))
    out = decoding.greedy(score_fn, stub.init_state(jnp.full((SAMPLES,), SEED, jnp.uint32), 4),
                          fixed=decoding.Fixed(batch_size=SAMPLES, max_len=3, bos_id=BOS, eos_id=EOS))
    return out.tokens_BxL, out.length_B

  assert_matches_ancestral(ancestral(jax.random.PRNGKey(1)), stub, 3, 0.6)


# -- exact in distribution ---------------------------------------------------------------------------------

# Outputs longer than one block (max_len > k) too, so that a wrong bonus token shows in what follows it.
@pytest.mark.parametrize('k, max_len, temperature', [(2, 3, 1.0), (3, 3, 0.6), (4, 4, 1.0), (3, 5, 0.7)])
def test_chain_samples_follow_the_model_at_batch_above_1(k, max_len, temperature):
  stub = SoftStub(k=k)
  result = _batch(stub, max_len, temperature)
  assert_matches_ancestral(result, stub, max_len, temperature)
  # The rows were ragged and every branch of the rule ran: rejections (blocks of 1), partial blocks and full
  # blocks (the bonus token), EOS inside a block (outputs shorter than max_len).
  counts = np.asarray(result.block_counts_BxK).sum(axis=0)  # sizes 1..k+1: a row's last token comes with its call
  assert counts.shape == (k + 1,) and (counts[:k] > SAMPLES // 50).all(), counts
  assert 0.1 < np.mean(np.asarray(result.length_B) < max_len) < 0.9
  np.testing.assert_array_equal(np.asarray(result.block_counts_BxK).sum(axis=1), np.asarray(result.iterations_B))


def test_tree_samples_follow_the_model_at_batch_above_1():
  stub = SoftStub(k=3)
  result = _batch(stub, 3, 0.8, paths=TREE)
  assert_matches_ancestral(result, stub, 3, 0.8)
  assert decoding.summarize(result)['mean_accepted_block_size'] > 1.4


@pytest.mark.parametrize('paths', [None, TREE], ids=['chain', 'tree'])
def test_samples_follow_the_model_at_batch_1(paths):
  stub = SoftStub(k=3)
  keys = jax.vmap(lambda n: jax.random.fold_in(jax.random.PRNGKey(2), n))(jnp.arange(SAMPLES))
  result = _sample_batch1(keys, jnp.float32(0.8), stub=stub, max_len=3, paths=paths)
  assert result.tokens_BxL.shape == (SAMPLES, 1, 3)
  assert_matches_ancestral((result.tokens_BxL[:, 0], result.length_B[:, 0]), stub, 3, 0.8)


# -- truncated sampling (top_k, top_p) ---------------------------------------------------------------------

TRUNCATIONS = [(2, 1.0), (0, 0.6), (3, 0.8)]


@pytest.mark.parametrize('top_k, top_p', TRUNCATIONS)
def test_truncated_ancestral_sampling_is_the_enumerated_truncated_distribution(top_k, top_p):
  """The reference for the truncated tests below: the ancestral sampler with the same truncation, and a
  truncation that really removes outcomes (the untruncated distribution is then far outside the bound)."""
  stub = SoftStub(k=1)

  @jax.jit
  def ancestral(key):
    score_fn = decoder_lib.sampling_score_fn(stub.score_fn, key, jnp.float32(0.8), top_k, top_p)
    out = decoding.greedy(score_fn, stub.init_state(jnp.full((SAMPLES,), SEED, jnp.uint32), 4),
                          fixed=decoding.Fixed(batch_size=SAMPLES, max_len=3, bos_id=BOS, eos_id=EOS))
    return out.tokens_BxL, out.length_B

  samples = ancestral(jax.random.PRNGKey(3))
  assert_matches_ancestral(samples, stub, 3, 0.8, top_k, top_p)
  full, truncated = stub.exact_distribution(SEED, 3, 0.8), stub.exact_distribution(SEED, 3, 0.8, top_k, top_p)
  assert len(truncated) < len(full) / 2, (len(truncated), len(full))
  with pytest.raises(AssertionError):
    assert_matches_ancestral(samples, stub, 3, 0.8)  # the untruncated distribution: not what was drawn


@pytest.mark.parametrize('top_k, top_p', TRUNCATIONS)
@pytest.mark.parametrize('paths', [None, TREE], ids=['chain', 'tree'])
def test_truncated_speculative_samples_follow_the_truncated_model(paths, top_k, top_p):
  stub = SoftStub(k=3)
  result = _batch(stub, 3, 0.8, paths=paths, top_k=top_k, top_p=top_p)
  assert_matches_ancestral(result, stub, 3, 0.8, top_k, top_p)
  assert decoding.summarize(result)['mean_accepted_block_size'] > 1.3  # the heads' drafts were accepted


def test_truncated_sampling_at_optimization_level_0():
  """The truncated distribution tests again under XLA_FLAGS=--xla_backend_optimization_level=0 (in a subprocess:
  XLA reads its flags once). There XLA computed the logits twice, into top_k's sort and into the comparison with
  its k-th value, and rounded the two differently: the k-th token was dropped and the sampler drew another
  distribution (docs/results/reliability.md). The kept set is now decided in the sort's own order."""
  repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  env = {**os.environ, 'PYTHONPATH': repo,
         'XLA_FLAGS': (os.environ.get('XLA_FLAGS', '') + ' --xla_backend_optimization_level=0').strip()}
  done = subprocess.run(
      [sys.executable, '-m', 'pytest', '-q', '-p', 'no:xdist', '-p', 'no:cacheprovider', 'tests/test_speculative.py',
       '-k', 'truncated_ancestral or (truncated_speculative and chain) or sampling_logits_keep_ties'],
      cwd=repo, env=env, stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=600)
  assert done.returncode == 0 and '7 passed' in done.stdout, done.stdout[-3000:] + done.stderr[-3000:]


def test_sampling_logits_keep_ties_and_at_least_one_token():
  logits = jnp.log(jnp.asarray([[0.4, 0.2, 0.2, 0.1, 0.1]]))
  kept = lambda **kw: np.isfinite(np.asarray(speculative.sampling_logits(logits, 1.0, **kw)))[0].tolist()
  assert kept(top_k=2) == [True, True, True, False, False]  # the token tied with the 2nd is kept too
  assert kept(top_p=0.5) == [True, True, True, False, False]  # 0.4 + 0.2 reaches 0.5; its tie stays
  assert kept(top_p=0.4) == [True, False, False, False, False]
  assert kept(top_p=1e-6) == [True, False, False, False, False]
  assert kept(top_k=1, top_p=0.9) == [True, False, False, False, False]
  assert kept() == [True] * 5


@pytest.mark.parametrize('top_k, top_p', [(-1, 1.0), (2.5, 1.0), (0, 0.0), (0, 1.5)])
def test_bad_truncation_is_a_user_error(top_k, top_p):
  with pytest.raises(UserError, match='sample_top'):
    speculative.check_truncation(top_k, top_p)


# -- the same test catches planted errors ------------------------------------------------------------------

@pytest.mark.parametrize('plant, paths, max_len', [
    ('no_residual', None, 3),     # a rejection resamples from p instead of norm(max(0, p - q))
    ('no_bonus', None, 3),        # the all-accepted case is taken for a rejection: no bonus token from p
    ('no_bonus', None, 5),        # ... and with outputs longer than one block
    ('q_temperature', None, 3),   # drafts drawn at T, but min(1, p/q) and the residual use q at T = 1
    ('no_residual', TREE, 3),
    ('stale_residual', TREE, 3),  # every sibling tested against p, not against what the earlier rejections left
])
def test_planted_errors_fail_the_distribution_test(plant, paths, max_len):
  stub = SoftStub(k=3)
  with pytest.raises(AssertionError, match='chi-square'):
    assert_matches_ancestral(_batch(stub, max_len, 0.6, paths=paths, plant=plant), stub, max_len, 0.6)


# -- context-aware trees: tokens chosen from the free token down, each node's q a point mass ------------------

@pytest.mark.parametrize('sequential', [False, True], ids=['independent', 'sequential'])
@pytest.mark.parametrize('max_len, temperature, top_p', [(3, 1.0, 1.0), (4, 0.6, 1.0), (3, 1.0, 0.8)])
def test_context_aware_tree_samples_follow_the_model(sequential, max_len, temperature, top_p):
  """dynamic:N trees, with independent heads (one choice list per depth) and with heads fed their parent's token
  (each node's children its own), sample the model exactly; the trees branch and accept more than the free token."""
  stub = SoftStub(k=3)
  result = _batch(stub, max_len, temperature, paths=DYNAMIC, top_p=top_p, sequential=sequential)
  assert_matches_ancestral(result, stub, max_len, temperature, top_p=top_p)
  tokens_per_iteration = float(np.sum(result.length_B) / np.maximum(np.sum(result.iterations_B), 1))
  assert tokens_per_iteration > 1.2, tokens_per_iteration


def test_a_context_aware_tree_of_parent_fed_heads_has_children_that_differ_by_parent():
  """The subject of the test above is a parent-conditioned tree: in the stub's sequential trees, siblings of
  different parents at one depth hold different tokens somewhere in the batch."""
  stub = SoftStub(k=3)
  hidden = {'h': jnp.arange(1, 65, dtype=jnp.uint32) * np.uint32(2654435761)}
  built = DYNAMIC.build(jnp.full((64,), 2, jnp.int32), lambda d, parents_BxW: stub.expand_fn(hidden, d, parents_BxW))
  token, parent, depth, rank = (np.asarray(x) for x in (built.token_BxN, built.parent_BxN, built.depth_BxN,
                                                        built.rank_BxN))
  differ = [b for b in range(64) if len({token[b, n] for n in range(DYNAMIC.num_nodes)
                                         if depth[b, n] == 2 and rank[b, n] == 0}) > 1]
  assert differ, 'every rank-0 child at depth 2 has the same token whatever its parent'


@pytest.mark.parametrize('plant, sequential', [
    ('depth_q', False),         # chosen tokens taken for draws of their depth's head: the static tree's one q
    ('stale_residual', True),   # a sibling tested against p, not against what the earlier rejections left
    ('no_residual', True),      # a rejected child left in the target: the free token may repeat it
])
def test_planted_errors_on_context_aware_trees_fail_the_distribution_test(plant, sequential):
  stub = SoftStub(k=3)
  with pytest.raises(AssertionError, match='chi-square'):
    assert_matches_ancestral(_batch(stub, 3, 1.0, paths=DYNAMIC, plant=plant, sequential=sequential), stub, 3, 1.0)


# -- streams, errors ---------------------------------------------------------------------------------------

def test_same_seed_same_samples_and_a_row_ignores_the_other_rows():
  stub = SoftStub(k=3)
  seeds = jnp.asarray([5, 9, 11, 5, 7, 3], jnp.uint32)
  others = jnp.asarray([5, 9, 11, 8, 2, 4], jnp.uint32)  # rows 3..5 decode other sources, for other lengths
  for paths in (None, TREE):
    run = lambda key, seed_B, paths=paths: _sample(jax.random.PRNGKey(key), seed_B, jnp.float32(1.0), stub=stub,
                                                   batch_size=len(seed_B), max_len=8, paths=paths)
    a, again, other_key, other_rows = run(0, seeds), run(0, seeds), run(1, seeds), run(0, others)
    for field in ('tokens_BxL', 'length_B', 'iterations_B', 'block_counts_BxK'):
      np.testing.assert_array_equal(np.asarray(getattr(a, field)), np.asarray(getattr(again, field)))
      # Rows 0..2 are the same samples whatever the other rows decode and however long they take.
      np.testing.assert_array_equal(np.asarray(getattr(a, field))[:3], np.asarray(getattr(other_rows, field))[:3])
    assert not np.array_equal(np.asarray(a.tokens_BxL), np.asarray(other_key.tokens_BxL))
    assert not np.array_equal(np.asarray(a.tokens_BxL)[3:], np.asarray(other_rows.tokens_BxL)[3:])
    # Rows 0 and 3 decode the same source but are different streams.
    assert not np.array_equal(np.asarray(a.tokens_BxL)[0], np.asarray(a.tokens_BxL)[3])


@pytest.mark.parametrize('spec', ['speculative+top_k:2', 'distance:2+speculative', 'speculative+min_block:2',
                                  'top_k:2+speculative+min_block:2'])
def test_approximate_criteria_are_a_user_error_with_sampling(spec):
  with pytest.raises(UserError, match='cannot be used with speculative sampling'):
    rules.parse(spec, k=3, temperature=1.0)
  assert rules.parse('speculative', k=3, temperature=0.5) == speculative.Sampling(temperature=0.5)
  assert str(rules.parse('speculative', temperature=0.5)) == 'speculative'


def test_a_tree_needs_the_single_root():
  with pytest.raises(UserError, match='single root'):
    speculative.check_sampling_tree(((0,), (1,), (0, 0)), k=2)


# -- the real model ----------------------------------------------------------------------------------------

@pytest.fixture(scope='module')
def real_model():
  """A tiny untrained 3-head Transformer (random weights: outputs depend on the prefix and the heads disagree)."""
  from bpd import model as model_lib  # pylint: disable=g-import-not-at-top
  config = model_lib.model_config('tiny', vocab_size=24, k=3, dropout_rate=0.0, d_model=32)
  return model_lib.Transformer(config), jax.jit(lambda rng: model_lib.init_params(config, rng))(jax.random.PRNGKey(0))


def test_near_zero_temperature_is_greedy_on_the_real_model(real_model):
  """At T = 1e-6 p and q are point masses at their argmax: a draft is accepted iff it is head 1's choice and a
  rejection's residual is head 1's choice, so speculative sampling must give greedy's output, token for token,
  through the model's cache, positions, tree mask and move_cache. At T = 1 it samples something else. (A tree:
  the chain's path through the sampler is the stub tests'.)"""
  model, params = real_model
  paths = ((0,), (0, 0), (0, 1), (0, 0, 0))
  decoder = decoder_lib.Decoder(model, max_len=10, eos_id=1)
  src = np.random.RandomState(0).randint(3, 24, size=(4, 6)).astype(np.int32)
  greedy = decoder.greedy(params, src)
  greedy_tokens, greedy_length = greedy.tokens_BxL, greedy.length_B
  tree = decoding.layout(paths)
  cold = decoder.blockwise(params, src, speculative.Sampling(temperature=1e-6), tree, seed=0)
  np.testing.assert_array_equal(np.asarray(cold.tokens_BxL), np.asarray(greedy_tokens))
  np.testing.assert_array_equal(np.asarray(cold.length_B), np.asarray(greedy_length))
  warm = decoder.blockwise(params, src, speculative.Sampling(temperature=1.0), tree, seed=0)
  assert not np.array_equal(np.asarray(warm.tokens_BxL), np.asarray(greedy_tokens))
  assert decoding.summarize(warm)['iterations'] < int(np.asarray(warm.length_B).sum())  # some blocks of 2+


@pytest.mark.parametrize('head_type', ['independent', 'sequential'])
def test_near_zero_temperature_on_a_context_aware_tree_is_greedy_on_the_real_model(head_type):
  """The same on `dynamic:8` trees, built from the sampled free token down (sequential heads: each node's children
  from the head fed its own token, ModelFns.expand), each node's q a point mass: at T = 1e-6 the walk accepts a
  child iff it is head 1's choice, so the output is greedy's through the model's per-row tree masks and moves."""
  from bpd import model as model_lib  # pylint: disable=g-import-not-at-top
  config = model_lib.model_config('tiny', vocab_size=24, k=3, dropout_rate=0.0, d_model=32, head_type=head_type)
  params = jax.jit(lambda rng: model_lib.init_params(config, rng))(jax.random.PRNGKey(0))
  decoder = decoder_lib.Decoder(model_lib.Transformer(config), max_len=10, eos_id=1)
  src = np.random.RandomState(0).randint(3, 24, size=(4, 6)).astype(np.int32)
  greedy = decoder.greedy(params, src)
  tree = decoding.Dynamic(8, 3)
  cold = decoder.blockwise(params, src, speculative.Sampling(temperature=1e-6), tree, seed=0)
  np.testing.assert_array_equal(np.asarray(cold.tokens_BxL), np.asarray(greedy.tokens_BxL))
  np.testing.assert_array_equal(np.asarray(cold.length_B), np.asarray(greedy.length_B))
  warm = decoder.blockwise(params, src, speculative.Sampling(temperature=1.0), tree, seed=0)
  assert not np.array_equal(np.asarray(warm.tokens_BxL), np.asarray(greedy.tokens_BxL))
