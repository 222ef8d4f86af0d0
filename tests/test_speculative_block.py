"""Block verification (criterion 'speculative:block', bpd/speculative.py `block_walk`) is exact in distribution
and accepts at least as much as token-by-token verification ('speculative').

The reference and the bound are tests/test_speculative.py's (tests/stubs.py SoftStub, its enumerated distribution
of whole outputs, Pearson's chi-square at false-alarm rate 1e-4 per comparison). The settings make every output
span several blocks (max_len L > k >= 3) at T != 1, cut both by EOS and by max_len. One setting has
overconfident heads (head_scale 3: drafts often more likely under q than under p, so the running weight falls
below 1 and the weighted residual max(0, w p - q) differs from the plain one); the planted errors
(tests/planted.py BLOCK_PLANTS) are checked there, on 60000 samples, where each pushes the statistic past the bound by a wide margin (the closest,
the unweighted residual, by several standard deviations of the statistic's own spread; docs/speculative.md).
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from bpd import checks
from bpd import decoder as decoder_lib
from bpd import decoding
from bpd import model as model_lib
from bpd import rules
from bpd import speculative
from bpd.errors import UserError
from configs import common, demo
from tests.stubs import BOS, EOS, SoftStub
from tests.test_speculative import SEED, TREE, _sample, assert_matches_ancestral, real_model  # noqa: F401

BLOCK = 'speculative:block'
OVERCONFIDENT = dict(k=4, max_len=5, temperature=0.8, samples=60000, head_noise=0.5, head_scale=3.0)
SETTINGS = {
    'overconfident_heads': OVERCONFIDENT,
    'default_heads_hot': dict(k=3, max_len=5, temperature=1.3, samples=20000),
    'top_k': dict(k=3, max_len=5, temperature=0.7, samples=20000, top_k=3),
}


def _stub(setting):
  return SoftStub(k=setting['k'], head_noise=setting.get('head_noise', 1.0),
                  head_scale=setting.get('head_scale', 1.0), eos_bias=setting.get('eos_bias', 0.0))


def _run(setting, verify='block', key=0, plant=None):
  """`setting`'s samples, one jitted batch; plant: one of tests/planted.py's BLOCK_PLANTS."""
  samples = setting['samples']
  return _sample(jax.random.PRNGKey(key), jnp.full((samples,), SEED, jnp.uint32), jnp.float32(setting['temperature']),
                 stub=_stub(setting), batch_size=samples, max_len=setting['max_len'], top_k=setting.get('top_k', 0),
                 verify=verify, plant=plant)


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
  run = lambda verify: _sample(jax.random.PRNGKey(4), jnp.full((4000,), SEED, jnp.uint32), jnp.float32(0.9),
                               stub=stub, batch_size=4000, max_len=8, verify=verify)
  block, token = run('block'), run('token')
  same_B = np.all(np.asarray(block.tokens_BxL) == np.asarray(token.tokens_BxL), axis=1)
  assert np.mean(same_B) > 0.999
  np.testing.assert_array_equal(np.asarray(block.iterations_B)[same_B], np.asarray(token.iterations_B)[same_B])


# -- planted errors (tests/planted.py) ---------------------------------------------------------------------

@pytest.mark.parametrize('plant', ['first_failure', 'unweighted_residual', 'memoryless_weight',
                                   'residual_q_off_by_one'])
def test_planted_errors_fail_the_block_distribution_test(plant):
  with pytest.raises(AssertionError, match='chi-square'):
    _check(_run(OVERCONFIDENT, plant=plant), OVERCONFIDENT)


def test_the_planted_copy_without_a_plant_passes():
  """The copy the plants are written into is the rule itself: the failures above are the plants'."""
  _check(_run(OVERCONFIDENT, plant='none', key=1), OVERCONFIDENT)


# -- never fewer tokens per call than token-by-token ---------------------------------------------------------

def test_block_verification_accepts_more_per_call_than_token_verification():
  """The same stub, keys and rows (paired): decent, imperfect heads, k = 6, long outputs. Block verification's
  mean accepted block must exceed token-by-token's by more than 4 standard errors of the paired difference (the
  delta method on tokens / iterations per row); with these settings the gap is far wider."""
  stub, samples, max_len = SoftStub(k=6, eos_bias=-3.0), 20000, 16
  run = lambda verify: _sample(jax.random.PRNGKey(7), jnp.full((samples,), SEED, jnp.uint32),
                               jnp.float32(1.0), stub=stub, batch_size=samples, max_len=max_len, verify=verify)
  block, token = run('block'), run('token')
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
                                    batch_size=len(seed_B), max_len=8, verify='block')
  a, again, other_rows = run(0, seeds), run(0, seeds), run(0, others)
  for field in ('tokens_BxL', 'length_B', 'iterations_B', 'block_counts_BxK'):
    np.testing.assert_array_equal(np.asarray(getattr(a, field)), np.asarray(getattr(again, field)))
    np.testing.assert_array_equal(np.asarray(getattr(a, field))[:3], np.asarray(getattr(other_rows, field))[:3])


def test_parse_and_refusals():
  for spec in ('speculative:block', ' speculative:block '):
    assert rules.parse(spec, temperature=1.0) == speculative.Sampling(temperature=1.0, verify='block')
  assert str(rules.parse('speculative:block', temperature=1.0)) == BLOCK
  assert rules.parse('speculative', temperature=1.0).verify == 'token'
  with pytest.raises(UserError, match='cannot be used with speculative sampling'):
    rules.parse('speculative:block+top_k:2')
  with pytest.raises(UserError, match='cannot be used with speculative sampling'):
    rules.parse('speculative+speculative:block')
  with pytest.raises(UserError, match='speculative sampling is one of'):
    rules.parse('speculative:blocks')

  def never_called(*args):
    raise AssertionError('score_fn called before the tree was refused')

  with pytest.raises(UserError, match='verifies a chain'):
    decoding.blockwise(decoding.ModelFns(never_called, never_called, never_called), {},
                       fixed=decoding.Fixed(batch_size=2, max_len=4, bos_id=BOS, eos_id=EOS),
                       tree=decoding.layout(TREE), rule=speculative.Sampling(verify='block'),
                       key=jax.random.PRNGKey(0))


def test_the_sweep_leaves_block_verification_out_on_a_tree(tmp_path):
  config = common.override(demo.get_config(), **{'decode.trees': ('chain', 'comb:2'), 'decode.ks': (3,),
                                                 'decode.criteria': ('speculative', BLOCK),
                                                 'decode.temperature': 1.0})
  model_config = model_lib.model_config('tiny', vocab_size=24, k=3)
  settings = checks.check_decode(config, str(tmp_path), model_config)
  named = [(s.spec, str(s.rule)) for s in settings]
  assert ('chain', BLOCK) in named and ('comb:2', 'speculative') in named and ('comb:2', BLOCK) not in named


def test_near_zero_temperature_block_verification_is_greedy_on_the_real_model(real_model):  # noqa: F811
  """Decoder.blockwise with Sampling(verify='block') through the model's cache and positions: at T = 1e-6, p
  and q are point masses, w_i is 1 while the drafts are head 1's choices and 0 after, so tau is the matching
  prefix and the residual head 1's choice: greedy's output, token for token."""
  model, params = real_model
  decoder = decoder_lib.Decoder(model, max_len=10, eos_id=1)
  src = np.random.RandomState(1).randint(3, 24, size=(4, 6)).astype(np.int32)
  greedy = decoder.greedy(params, src)
  chain = decoding.chain(3)
  cold = decoder.blockwise(params, src, speculative.Sampling(temperature=1e-6, verify='block'), chain, seed=0)
  np.testing.assert_array_equal(np.asarray(cold.tokens_BxL), np.asarray(greedy.tokens_BxL))
  np.testing.assert_array_equal(np.asarray(cold.length_B), np.asarray(greedy.length_B))
  warm = decoder.blockwise(params, src, speculative.Sampling(temperature=1.0, verify='block'), chain, seed=0)
  assert not np.array_equal(np.asarray(warm.tokens_BxL), np.asarray(greedy.tokens_BxL))
