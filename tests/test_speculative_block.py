"""Block verification (criterion 'speculative:block', bpd/speculative.py `_block_walk`) is exact in distribution
and accepts at least as much as token-by-token verification ('speculative').

The reference and the bound are tests/test_speculative.py's (tests/stubs.py SoftStub, its enumerated distribution
of whole outputs, Pearson's chi-square at false-alarm rate 1e-4 per comparison). The settings make every output
span several blocks (max_len L > k >= 3) at T != 1, cut both by EOS and by max_len. One setting has
overconfident heads (head_scale 3: drafts often more likely under q than under p, so the running weight falls
below 1 and the weighted residual max(0, w p - q) differs from the plain one); the planted errors below are
checked there, on 60000 samples, where each pushes the statistic past the bound by a wide margin (the closest,
the unweighted residual, by several standard deviations of the statistic's own spread; docs/speculative.md).
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from bpd import checks
from bpd import decoder as decoder_lib
from bpd import decoding
from bpd import speculative
from bpd.errors import UserError
from configs import common, demo
from tests.stubs import BOS, EOS, SoftStub
from tests.test_speculative import SEED, TREE, _sample, assert_matches_ancestral, real_model  # noqa: F401

BLOCK = speculative.BLOCK_CRITERION
OVERCONFIDENT = dict(k=4, max_len=5, temperature=0.8, samples=60000, head_noise=0.5, head_scale=3.0)
SETTINGS = {
    'overconfident_heads': OVERCONFIDENT,
    'default_heads_hot': dict(k=3, max_len=5, temperature=1.3, samples=20000),
    'top_k': dict(k=3, max_len=5, temperature=0.7, samples=20000, top_k=3),
}


def _stub(setting):
  return SoftStub(k=setting['k'], head_noise=setting.get('head_noise', 1.0),
                  head_scale=setting.get('head_scale', 1.0), eos_bias=setting.get('eos_bias', 0.0))


def _run(setting, criterion=BLOCK, key=0, fresh=False):
  """`setting`'s samples, one jitted batch. fresh: trace again (a plant swapped into speculative._block_walk is
  read at trace time, so a cached compile of the real one must not be reused)."""
  stub, samples = _stub(setting), setting['samples']
  kwargs = dict(stub=stub, batch_size=samples, max_len=setting['max_len'], top_k=setting.get('top_k', 0),
                criterion=criterion)
  fn = jax.jit(lambda key, seed_B, t: _sample.__wrapped__(key, seed_B, t, **kwargs)) if fresh else (
      functools.partial(_sample, **kwargs))
  return fn(jax.random.PRNGKey(key), jnp.full((samples,), SEED, jnp.uint32), jnp.float32(setting['temperature']))


def _check(result, setting):
  return assert_matches_ancestral(result, _stub(setting), setting['max_len'], setting['temperature'],
                                  setting.get('top_k', 0))


# -- exact in distribution ---------------------------------------------------------------------------------

@pytest.mark.parametrize('name', list(SETTINGS))
def test_block_verified_samples_follow_the_model(name):
  setting = SETTINGS[name]
  result = _run(setting)
  _check(result, setting)
  k, max_len = setting['k'], setting['max_len']
  # Every branch of the rule ran: blocks of 1 (tau = 0), partial and full blocks, and both cuts.
  counts = np.asarray(result.block_counts_BxK).sum(axis=0)
  assert counts.shape == (k + 1,) and (counts[:k] > setting['samples'] // 100).all(), counts
  length_B = np.asarray(result.length_B)
  assert 0.1 < np.mean(length_B < max_len) < 0.9  # EOS ends some rows, max_len the others
  assert np.mean(np.asarray(result.iterations_B) >= 2) > 0.3  # outputs longer than one block


def test_one_draft_block_verification_is_token_verification():
  """With g = 1 draft (k = 2) the rule is h_1 = w_1 = min(1, p/q) and the residual norm(max(0, p - q)), which is
  speculative sampling's: the same keys give the same samples. (Accept tests u <= p/q here and u q < p there;
  the two differ only where float rounding puts u on the boundary, so a handful of rows in a million could.)"""
  stub = SoftStub(k=2)
  run = lambda criterion: _sample(jax.random.PRNGKey(4), jnp.full((4000,), SEED, jnp.uint32), jnp.float32(0.9),
                                  stub=stub, batch_size=4000, max_len=8, criterion=criterion)
  block, token = run(BLOCK), run(speculative.CRITERION)
  same_B = np.all(np.asarray(block.tokens_BxL) == np.asarray(token.tokens_BxL), axis=1)
  assert np.mean(same_B) > 0.999
  np.testing.assert_array_equal(np.asarray(block.iterations_B)[same_B], np.asarray(token.iterations_B)[same_B])


# -- planted errors: test-local buggy copies of _block_walk, swapped in ------------------------------------

def _planted_block_walk(plant):
  """speculative._block_walk written again with one known error (kept here, not in production code)."""

  def walk(p_BxNxV, q_BxDm1xV, nodes_BxN, coins_BxN):
    B, N, _ = p_BxNxV.shape
    rows, g = jnp.arange(B), N - 1
    w_B = jnp.ones((B,), jnp.float32)
    w_list, h_list = [w_B], []
    for i in range(1, g + 1):
      x_B = nodes_BxN[:, i]
      ratio_B = p_BxNxV[rows, i - 1, x_B] / q_BxDm1xV[rows, i - 1, x_B]
      # 'memoryless_weight': w_i = min(1, p/q) of the i-th draft alone, the running product not carried.
      w_B = jnp.minimum(1.0, (1.0 if plant == 'memoryless_weight' else w_B) * ratio_B)
      w_list.append(w_B)
      if i < g:
        r_B = jnp.sum(jnp.maximum(w_B[:, None] * p_BxNxV[:, i] - q_BxDm1xV[:, i], 0.0), axis=-1)
        denominator_B = r_B + 1.0 - w_B
        h_list.append(jnp.where(denominator_B > 0, r_B / jnp.maximum(denominator_B, 1e-30), 1.0))
      else:
        h_list.append(w_B)
    passed_BxG = coins_BxN[:, 1:] <= jnp.stack(h_list, axis=1)
    if plant == 'first_failure':  # stop at the first failed test instead of taking the longest passing prefix
      passed_BxG = jnp.cumprod(passed_BxG, axis=1).astype(bool)
    tau_B = jnp.max(jnp.where(passed_BxG, jnp.arange(1, g + 1)[None, :], 0), axis=1)
    w_tau_B = jnp.stack(w_list, axis=1)[rows, tau_B]
    if plant == 'unweighted_residual':  # norm(max(0, p - q)) instead of norm(max(0, w_tau p - q))
      w_tau_B = jnp.ones_like(w_tau_B)
    p_tau_BxV = p_BxNxV[rows, tau_B]
    # 'residual_q_off_by_one': the residual subtracts the accepted draft's q, not the next draft's.
    q_index_B = jnp.maximum(tau_B - 1, 0) if plant == 'residual_q_off_by_one' else jnp.minimum(tau_B, g - 1)
    left_BxV = jnp.maximum(w_tau_B[:, None] * p_tau_BxV - q_BxDm1xV[rows, q_index_B], 0.0)
    mass_B = jnp.sum(left_BxV, axis=-1, keepdims=True)
    residual_BxV = jnp.where(mass_B > 1e-12, left_BxV / jnp.maximum(mass_B, 1e-30), p_tau_BxV)
    return tau_B, jnp.where((tau_B == g)[:, None], p_tau_BxV, residual_BxV)

  return walk


@pytest.mark.parametrize('plant', ['first_failure', 'unweighted_residual', 'memoryless_weight',
                                   'residual_q_off_by_one'])
def test_planted_errors_fail_the_block_distribution_test(plant, monkeypatch):
  monkeypatch.setattr(speculative, '_block_walk', _planted_block_walk(plant))
  with pytest.raises(AssertionError, match='chi-square'):
    _check(_run(OVERCONFIDENT, fresh=True), OVERCONFIDENT)


def test_the_planted_copy_without_a_plant_passes(monkeypatch):
  """The copy the plants are written into is the rule itself: the failures above are the plants'."""
  monkeypatch.setattr(speculative, '_block_walk', _planted_block_walk(None))
  _check(_run(OVERCONFIDENT, fresh=True, key=1), OVERCONFIDENT)


# -- never fewer tokens per call than token-by-token ---------------------------------------------------------

def test_block_verification_accepts_more_per_call_than_token_verification():
  """The same stub, keys and rows (paired): decent, imperfect heads, k = 6, long outputs. Block verification's
  mean accepted block must exceed token-by-token's by more than 4 standard errors of the paired difference (the
  delta method on tokens / iterations per row); with these settings the gap is far wider."""
  stub, samples, max_len = SoftStub(k=6, eos_bias=-3.0), 20000, 16
  run = lambda criterion: _sample(jax.random.PRNGKey(7), jnp.full((samples,), SEED, jnp.uint32),
                                  jnp.float32(1.0), stub=stub, batch_size=samples, max_len=max_len,
                                  criterion=criterion)
  block, token = run(BLOCK), run(speculative.CRITERION)
  tokens = lambda r: np.asarray(r.length_B, np.float64)
  calls = lambda r: np.asarray(r.iterations_B, np.float64)
  mean_block, mean_token = (decoding.summarize(r)['mean_accepted_block_size'] for r in (block, token))
  np.testing.assert_allclose(mean_block, tokens(block).sum() / calls(block).sum(), rtol=1e-6)
  z_B = ((tokens(block) - mean_block * calls(block)) / calls(block).mean()
         - (tokens(token) - mean_token * calls(token)) / calls(token).mean())
  standard_error = z_B.std() / np.sqrt(samples)
  assert mean_block - mean_token > 4 * standard_error, (mean_block, mean_token, standard_error)


# -- wiring and errors -------------------------------------------------------------------------------------

def test_same_seed_same_samples_and_a_row_ignores_the_other_rows():
  stub = SoftStub(k=3)
  seeds, others = jnp.asarray([5, 9, 11, 5], jnp.uint32), jnp.asarray([5, 9, 11, 8], jnp.uint32)
  run = lambda key, seed_B: _sample(jax.random.PRNGKey(key), seed_B, jnp.float32(1.0), stub=stub,
                                    batch_size=len(seed_B), max_len=8, criterion=BLOCK)
  a, again, other_rows = run(0, seeds), run(0, seeds), run(0, others)
  for field in ('tokens_BxL', 'length_B', 'iterations_B', 'block_counts_BxK'):
    np.testing.assert_array_equal(np.asarray(getattr(a, field)), np.asarray(getattr(again, field)))
    np.testing.assert_array_equal(np.asarray(getattr(a, field))[:3], np.asarray(getattr(other_rows, field))[:3])


def test_parse_and_refusals():
  assert speculative.parse_decode_criterion('speculative:block') == BLOCK
  assert speculative.parse_decode_criterion(' speculative:block ') == BLOCK
  assert speculative.parse_decode_criterion('speculative') == speculative.CRITERION
  with pytest.raises(UserError, match='cannot be used with speculative sampling'):
    speculative.parse_decode_criterion('speculative:block+top_k:2')
  with pytest.raises(UserError, match='two verification rules'):
    speculative.parse_decode_criterion('speculative+speculative:block')

  def never_called(*args):
    raise AssertionError('score_fn called before the tree was refused')

  with pytest.raises(UserError, match='verifies a chain'):
    speculative.speculative(never_called, never_called, {}, key=jax.random.PRNGKey(0), temperature=1.0,
                            batch_size=2, k=3, max_len=4, bos_id=BOS, eos_id=EOS, paths=TREE, criterion=BLOCK)


def test_the_sweep_refuses_a_tree_with_block_verification(tmp_path):
  config = common.override(demo.get_config(), **{'decode.trees': ('chain', 'comb:2'),
                                                 'decode.criteria': ('speculative', BLOCK)})
  with pytest.raises(UserError, match='block verification verifies a chain'):
    checks.check_trees(config, str(tmp_path), 3)
  chain = common.override(config, **{'decode.trees': ('chain',)})
  assert [str(c) for _, _, c in checks.check_trees(chain, str(tmp_path), 3)] == ['speculative', BLOCK]


def test_near_zero_temperature_block_verification_is_greedy_on_the_real_model(real_model):  # noqa: F811
  """Decoder.speculative(criterion='speculative:block') through the model's cache and positions: at T = 1e-6, p
  and q are point masses, w_i is 1 while the drafts are head 1's choices and 0 after, so tau is the matching
  prefix and the residual head 1's choice: greedy's output, token for token."""
  model, params = real_model
  decoder = decoder_lib.Decoder(model, max_len=10, eos_id=1)
  src = np.random.RandomState(1).randint(3, 24, size=(4, 6)).astype(np.int32)
  greedy_tokens, greedy_length = decoder.greedy(params, src)
  cold = decoder.speculative(params, src, k=3, temperature=1e-6, seed=0, criterion=BLOCK)
  np.testing.assert_array_equal(np.asarray(cold.tokens_BxL), np.asarray(greedy_tokens))
  np.testing.assert_array_equal(np.asarray(cold.length_B), np.asarray(greedy_length))
  warm = decoder.speculative(params, src, k=3, temperature=1.0, seed=0, criterion=BLOCK)
  assert not np.array_equal(np.asarray(warm.tokens_BxL), np.asarray(greedy_tokens))
