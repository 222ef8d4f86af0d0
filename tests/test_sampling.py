"""Temperature sampling (bpd/decoder.py sampling_score_fn) on stub logits: it draws from softmax(logits / T),
is a pure function of its key, reads the prefix as greedy does, and differs from greedy where it must."""

import functools

import jax
import jax.numpy as jnp
import numpy as np

from bpd import decoder as decoder_lib
from bpd import decoding
from tests import stubs

PROBS = np.array([0.7, 0.2, 0.1])  # over the word ids 3, 4, 5; every other id has probability 0
ROWS, STEPS = 2000, 8


def fixed_score_fn(state, tokens_BxT, start):
  """The same next-token distribution PROBS at every position of every row, whatever the prefix."""
  del start
  logits_V = jnp.full((stubs.FIRST_WORD + len(PROBS),), -jnp.inf).at[stubs.FIRST_WORD:].set(jnp.log(PROBS))
  return jnp.broadcast_to(logits_V, tokens_BxT.shape + logits_V.shape), None, state


@functools.partial(jax.jit, static_argnames=('rows', 'steps'))
def sample_fixed(key, temperature, rows=ROWS, steps=STEPS):
  fixed = decoding.Fixed(batch_size=rows, max_len=steps, bos_id=stubs.BOS, eos_id=stubs.EOS)
  return decoding.greedy(decoder_lib.sampling_score_fn(fixed_score_fn, key, temperature), {}, fixed=fixed).tokens_BxL


def test_samples_follow_softmax_of_logits_over_temperature():
  for temperature in (1.0, 0.5):
    tokens = np.asarray(sample_fixed(jax.random.PRNGKey(0), temperature))
    expected = PROBS ** (1 / temperature) / np.sum(PROBS ** (1 / temperature))
    frequencies = np.array([np.mean(tokens == stubs.FIRST_WORD + i) for i in range(len(PROBS))])
    # 16000 draws: the standard error of each frequency is below 0.004; the margin is 5 of them.
    np.testing.assert_allclose(frequencies, expected, atol=0.02)


def test_sampling_is_reproducible_for_a_seed_and_differs_from_greedy_where_it_must():
  a = np.asarray(sample_fixed(jax.random.PRNGKey(3), 1.0))
  np.testing.assert_array_equal(a, np.asarray(sample_fixed(jax.random.PRNGKey(3), 1.0)))
  assert not np.array_equal(a, np.asarray(sample_fixed(jax.random.PRNGKey(4), 1.0)))
  # Greedy takes the most likely word (probability 0.7) everywhere; a sampled row of 8 equals that with
  # probability 0.7**8 < 0.06, so among 2000 rows some (by the law of large numbers, about 94%) differ.
  greedy = decoding.greedy(fixed_score_fn, {}, fixed=decoding.Fixed(batch_size=ROWS, max_len=STEPS, bos_id=stubs.BOS,
                                                                     eos_id=stubs.EOS)).tokens_BxL
  assert (np.asarray(greedy) == stubs.FIRST_WORD).all()
  differs = np.mean(np.any(a != np.asarray(greedy), axis=1))
  assert abs(differs - (1 - 0.7 ** STEPS)) < 0.03


def test_sampling_near_zero_temperature_is_greedy_on_the_prefix_hashing_stub():
  """The stub's next token hashes the whole prefix, so a loop that fed the sampler a wrong or stale prefix would
  drift. Its best logit leads by more than 4; divided by T = 1e-6 no Gumbel noise in float32 can overturn that."""
  stub = stubs.Stub(vocab_size=20, eos_rate=9)
  seed_B, eos_at_B = jnp.arange(16), jnp.full((16,), 30)

  def run(score_fn):
    fixed = decoding.Fixed(batch_size=16, max_len=40, bos_id=stubs.BOS, eos_id=stubs.EOS)
    out = decoding.greedy(score_fn, stub.init_state(seed_B, eos_at_B, 41), fixed=fixed)
    return np.asarray(out.tokens_BxL), np.asarray(out.length_B)

  greedy_tokens, greedy_length = run(stub.score_fn)
  sampled_tokens, sampled_length = run(decoder_lib.sampling_score_fn(stub.score_fn, jax.random.PRNGKey(0), 1e-6))
  np.testing.assert_array_equal(sampled_tokens, greedy_tokens)
  np.testing.assert_array_equal(sampled_length, greedy_length)
  assert (greedy_length < 40).any()  # some rows ended at an EOS: the stop condition is exercised too
