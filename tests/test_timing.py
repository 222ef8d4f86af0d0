"""Fair timing: no compile inside a timed region, warm-up on the timed shapes, strong greedy baseline."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from bpd import decoder as decoder_lib
from bpd import decoding
from bpd import timing
from tests import stubs
from tests.conftest import BOS, EOS, toy_batch


def test_no_compiles_raises_on_a_compile_inside_the_region():
  f = jax.jit(lambda x: x * 2)
  f(jnp.ones(3))
  with timing.no_compiles('cached'):  # same shape: a cache hit, nothing traced or compiled
    f(jnp.ones(3))
  with pytest.raises(timing.RecompileError, match='new shape'):
    with timing.no_compiles('new shape'):
      f(jnp.ones(4))


def test_time_alternating_warms_up_on_the_timed_shapes():
  f = jax.jit(lambda x: jnp.sum(x * 2))
  medians = timing.time_alternating([lambda: f(jnp.ones(5)), lambda: f(jnp.ones(7))], repeats=3)
  assert len(medians) == 2 and all(m >= 0 for m in medians)


def test_time_side_by_side_on_a_subset_with_a_shorter_bucket_does_not_compile():
  """The timed subset (short sources) is padded to the split's bucket, the shape the full decode compiled."""
  f = jax.jit(lambda src: jnp.sum(src, axis=1))
  src_ids = [np.arange(1, 4)] * 3 + [np.arange(1, 20)]  # whole split: bucket 24; first 3 alone: bucket 8
  bucket = decoder_lib.source_bucket(src_ids)
  decoder_lib.run_batches(f, src_ids, 2)  # the full decode compiles at bucket 24
  with timing.count_compiles() as counts:
    seconds = decoder_lib.time_side_by_side([f], src_ids[:3], 2, repeats=2, bucket=bucket)
  assert counts['compiles'] == 0 and len(seconds) == 1


def test_scalar_start_greedy_equals_per_row_start_greedy_on_the_real_model(toy_model):
  """Greedy's one-slice cache write (scalar start) gives the same tokens as the per-row scatter."""
  model, params, _ = toy_model
  from bpd import model as model_lib  # pylint: disable=g-import-not-at-top
  src, _ = toy_batch(np.random.RandomState(3), 6)

  @jax.jit
  def both(params, src):
    fns = model_lib.decode_fns(model, params, num_heads=1)
    init_state, score_fn = fns.init, fns.score
    state = init_state(src, 15)
    per_row = lambda s, t, start: score_fn(s, t, jnp.broadcast_to(start, (src.shape[0],)))
    kwargs = dict(fixed=decoding.Fixed(batch_size=src.shape[0], max_len=14, bos_id=BOS, eos_id=EOS))
    return decoding.greedy(score_fn, state, **kwargs), decoding.greedy(per_row, state, **kwargs)

  scalar, row = both(params, jnp.asarray(src))
  scalar_tokens, scalar_length, row_tokens, row_length = scalar.tokens_BxL, scalar.length_B, row.tokens_BxL, row.length_B
  np.testing.assert_array_equal(np.asarray(scalar_tokens), np.asarray(row_tokens))
  np.testing.assert_array_equal(np.asarray(scalar_length), np.asarray(row_length))


def test_scalar_start_on_the_stub():
  stub = stubs.Stub(vocab_size=20, k=1)
  seeds, eos_at = np.arange(4) + 11, np.array([5, 9, 30, 2])
  state = stub.init_state(jnp.asarray(seeds), jnp.asarray(eos_at), 21)
  tokens = decoding.greedy(stub.score_fn, state, fixed=decoding.Fixed(batch_size=4, max_len=20, bos_id=BOS,
                                                                      eos_id=EOS)).tokens_BxL
  np.testing.assert_array_equal(np.asarray(tokens), stub.reference_greedy(seeds, eos_at, 20))


def test_decoding_with_fewer_heads_proposes_what_the_full_model_does(toy_model):
  """decode_fns slices the first k' heads' weights once (outside the loop); proposals are the model's heads 2..k'."""
  model, params, config = toy_model
  from bpd import model as model_lib  # pylint: disable=g-import-not-at-top
  src, tgt = toy_batch(np.random.RandomState(5), 3)
  tgt_in = np.concatenate([np.full((3, 1), BOS), tgt[:, :-1]], axis=1)
  full_BxTxKxV = np.asarray(jax.jit(model.apply)({'params': params}, jnp.asarray(src), jnp.asarray(tgt_in)))
  for heads in range(2, config.k + 1):
    fns = model_lib.decode_fns(model, params, num_heads=heads)
    init_state, score_fn, propose_fn = fns.init, fns.score, fns.propose
    _, hidden_BxTxD, _ = score_fn(init_state(jnp.asarray(src), 12), jnp.asarray(tgt_in), jnp.int32(0))
    proposals_BxHxV = np.asarray(propose_fn(hidden_BxTxD[:, 4]))
    np.testing.assert_allclose(proposals_BxHxV, full_BxTxKxV[:, 4, 1:heads], atol=1e-4)
