"""Local 1D block self-attention (Image Transformer, Parmar et al. 2018, §3.2) in the decoder.

With attention_block = W the query at position p sees the keys q <= p with q // W >= p // W - 1. Training
computes this block by block, decoding as a mask over the full-length per-row cache: both must give the
function of a naive T x T attention with that mask. Then the image task scaled down (2x2 -> 8x8 instead of
8x8 -> 32x32): a briefly trained model must decode with blockwise parallel decoding exactly as greedy.
"""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from bpd import decoding
from bpd import layers
from bpd import model as model_lib
from bpd.data import images
from bpd.errors import UserError
from tests.conftest import train_toy

BOS = 2
NO_EOS = -1  # Images have no EOS: an id the model never emits, so decoding runs to max_len.


def naive_local_mask(length, block):
  """[T, T] reference mask, straight from the definition."""
  p = np.arange(length)[:, None]
  q = np.arange(length)[None, :]
  return (q <= p) & (q // block >= p // block - 1)


@pytest.mark.parametrize('length, block', [(11, 4), (12, 4), (9, 1), (3, 4)])
def test_blockwise_layer_equals_naive_local_mask(length, block):
  """The O(T·2W) blockwise layer equals a full-attention layer given the local T x T mask (same params)."""
  B, S, D = 2, 5, 32
  rng = np.random.RandomState(length * 100 + block)
  x_BxTxD = jnp.asarray(rng.randn(B, length, D), jnp.float32)
  enc_BxSxD = jnp.asarray(rng.randn(B, S, D), jnp.float32)
  cross_BxTxS = jnp.ones((B, length, S), bool)
  naive_BxTxT = jnp.broadcast_to(naive_local_mask(length, block), (B, length, length))
  plain = layers.DecoderLayer(num_heads=4, d_model=D, d_ff=64)
  local = layers.DecoderLayer(num_heads=4, d_model=D, d_ff=64, attention_block=block)
  params = jax.jit(plain.init)(jax.random.PRNGKey(0), x_BxTxD, enc_BxSxD, naive_BxTxT, cross_BxTxS)
  expected = jax.jit(plain.apply)(params, x_BxTxD, enc_BxSxD, naive_BxTxT, cross_BxTxS)
  got = jax.jit(lambda p, x, e, c: local.apply(p, x, e, None, c))(params, x_BxTxD, enc_BxSxD, cross_BxTxS)
  np.testing.assert_allclose(np.asarray(got), np.asarray(expected), atol=1e-5)


def _random_model(block, vocab=40, k=3, image_sides=(0, 0)):
  """Small (1 + 2 layers, d = 32) to compile fast; two decoder layers so the cache feeds a second layer."""
  config = model_lib.model_config('image_tiny', vocab_size=vocab, k=k, dropout_rate=0.0, d_model=32, d_ff=64,
                                  attention_block=block, image_side=image_sides[0], image_input_side=image_sides[1])
  return model_lib.Transformer(config), jax.jit(model_lib.init_params, static_argnums=0)(
      config, jax.random.PRNGKey(1))


@pytest.mark.parametrize('block,image_sides', [(3, (0, 0)), (4, (0, 0)), (4, (4, 2))])
def test_cached_local_decoder_matches_blockwise_full_sequence(block, image_sides):
  """Per-row starts, stale entries of a rejected block, overwrites, and calls that straddle block boundaries;
  the sequence (11) is not a multiple of W. Every call writes 4 positions (one compiled shape). With image
  sides, positions are 2D image coordinates (model.image_positions), on the cached path as on the full one."""
  model, params = _random_model(block, image_sides=image_sides)
  rng = np.random.RandomState(block)
  B, S, T, NEW = 5, 6, 11, 4
  src = jnp.asarray(rng.randint(3, 40, size=(B, S)))
  tgt_in = rng.randint(3, 40, size=(B, T))
  full_BxTxKxV = np.asarray(jax.jit(model.apply)({'params': params}, src, jnp.asarray(tgt_in)))

  @jax.jit
  def score_and_propose(params, state, tokens_BxT, start_B):
    _, score_fn, propose_fn = model_lib.decode_fns(model, params)
    logits, hidden, state = score_fn(state, tokens_BxT, start_B)
    return logits, propose_fn(hidden[:, -1]), state

  init_state = jax.jit(lambda p, src: model_lib.decode_fns(model, p)[0](src, T + 3))
  state = init_state(params, src)

  def feed(start_B, tokens_BxT=None):
    """Feeds tgt_in (or the given tokens) at start_B[b] .. + 3; checks the outputs against the full pass."""
    nonlocal state
    right = tokens_BxT is None
    if right:
      tokens_BxT = np.stack([tgt_in[b, s:s + NEW] for b, s in enumerate(start_B)])
    logits, proposals, state = score_and_propose(params, state, jnp.asarray(tokens_BxT), jnp.asarray(start_B))
    for b, s in enumerate(start_B if right else []):
      np.testing.assert_allclose(np.asarray(logits[b]), full_BxTxKxV[b, s:s + NEW, 0], atol=1e-4)
      np.testing.assert_allclose(np.asarray(proposals[b]), full_BxTxKxV[b, s + NEW - 1, 1:], atol=1e-4)

  feed(np.zeros(B, np.int32))
  # Row b's prefix is right up to position start + 3 after each feed; resume each row inside it.
  feed(np.array([3, 2, 4, 1, 4], np.int32))
  # A rejected block: wrong tokens at 4 positions past each row's prefix, left in the cache as stale entries.
  feed(np.array([7, 6, 8, 5, 7], np.int32), rng.randint(3, 40, size=(B, NEW)))
  feed(np.array([5, 3, 6, 2, 7], np.int32))


def test_attention_block_zero_is_the_plain_path():
  """0 is the default and adds no parameters; W >= T is full causal attention again, on both paths."""
  assert model_lib.model_config('tiny', vocab_size=40).attention_block == 0
  with pytest.raises(UserError, match='attention_block=-1'):
    model_lib.model_config('tiny', vocab_size=40, attention_block=-1)
  plain_model, params = _random_model(0)
  local_model = model_lib.Transformer(dataclasses.replace(plain_model.config, attention_block=64))
  # Same parameter tree: a checkpoint of one loads into the other.
  local_shapes = jax.eval_shape(functools.partial(model_lib.init_params, local_model.config), jax.random.PRNGKey(1))
  assert jax.tree.map(lambda x: x.shape, local_shapes) == jax.tree.map(lambda x: x.shape, params)
  rng = np.random.RandomState(0)
  src = jnp.asarray(rng.randint(3, 40, size=(3, 7)))
  tgt = jnp.asarray(rng.randint(3, 40, size=(3, 9)))
  plain = jax.jit(plain_model.apply)({'params': params}, src, tgt)
  np.testing.assert_allclose(np.asarray(jax.jit(local_model.apply)({'params': params}, src, tgt)),
                             np.asarray(plain), atol=1e-5)

  @jax.jit
  def first_call(params, src, tgt):
    init_state, score_fn, _ = model_lib.decode_fns(local_model, params)
    return score_fn(init_state(src, 12), tgt, jnp.zeros((3,), jnp.int32))[0]
  np.testing.assert_allclose(np.asarray(first_call(params, src, tgt)), np.asarray(plain[:, :, 0]), atol=1e-4)


# -- the image task, scaled down: 2x2 -> 8x8 sub-pixel sequences (12 -> 192 tokens) ------------------------

LOW, HIGH, UP = 2, 8, 4
IMAGE_BLOCK = 24  # one 8-pixel row of sub-pixels: 8 blocks over the 192-token target
IMAGE_K = 4
TGT_LEN = HIGH * HIGH * 3


# An ordered-dither offset per pixel, by row and column parity: fine detail that head 1 can learn from the
# prefix and the far heads only roughly, so their proposals are often off by 1 to 3 (what distance:2 forgives).
DITHER_2x2 = np.array([[0, 2], [3, 1]]) - 1


def image_batch(rng, batch):
  """(src tokens [B, 12], tgt tokens [B, 192], high-res images): a random 2x2 image and its 8x8 version: each
  pixel a 4x4 patch, plus the dither. Intensities are posterized to 8 levels: with all 256, a couple of
  hundred steps give a model that repeats one intensity forever, a useless test subject.
  """
  low_Bx2x2x3 = rng.randint(0, 8, size=(batch, LOW, LOW, 3)) * 32 + 16
  dither_8x8x1 = np.tile(DITHER_2x2, (HIGH // 2, HIGH // 2))[:, :, None]
  high_Bx8x8x3 = low_Bx2x2x3.repeat(UP, axis=1).repeat(UP, axis=2) + dither_8x8x1
  high_Bx8x8x3 = np.clip(high_Bx8x8x3, 0, 255).astype(np.uint8)
  src = images.image_to_tokens(low_Bx2x2x3.astype(np.uint8))
  return src, images.image_to_tokens(high_Bx8x8x3), high_Bx8x8x3


@pytest.fixture(scope='module')
def image_model():
  """A tiny 4-head local-attention model trained 200 Adam steps on the toy super-resolution task."""
  config = model_lib.model_config('image_tiny', vocab_size=images.IMAGE_VOCAB_SIZE, k=IMAGE_K,
                                  dropout_rate=0.0, attention_block=IMAGE_BLOCK)
  return train_toy(config, lambda rng: image_batch(rng, 4)[:2], steps=200)


@functools.partial(jax.jit, static_argnames=('model',))
def _greedy_images(params, src, *, model):
  init_state, score_fn, _ = model_lib.decode_fns(model, params)
  state = init_state(src, TGT_LEN + 1)
  return decoding.greedy(score_fn, state, batch_size=src.shape[0], max_len=TGT_LEN, bos_id=BOS, eos_id=NO_EOS)


@functools.partial(jax.jit, static_argnames=('model', 'criterion'))
def _blockwise_images(params, src, *, model, criterion):
  init_state, score_fn, propose_fn = model_lib.decode_fns(model, params)
  state = init_state(src, TGT_LEN + IMAGE_K + 1)
  return decoding.blockwise(score_fn, propose_fn, state, batch_size=src.shape[0], k=IMAGE_K, max_len=TGT_LEN,
                            bos_id=BOS, eos_id=NO_EOS, criterion=criterion)


@pytest.fixture(scope='module')
def decoded_images(image_model):
  """Greedy and blockwise (exact, distance:2) decodes of 8 held-out images."""
  model, params = image_model
  src, tgt, _ = image_batch(np.random.RandomState(123), 8)
  src = jnp.asarray(src)
  greedy_tokens, greedy_length, _ = _greedy_images(params, src, model=model)
  exact = _blockwise_images(params, src, model=model, criterion=decoding.parse_criterion('exact'))
  distance = _blockwise_images(params, src, model=model, criterion=decoding.parse_criterion('distance:2'))
  return dict(src=src, tgt=tgt, greedy=np.asarray(greedy_tokens), greedy_length=np.asarray(greedy_length),
              exact=exact, distance=distance)


def test_image_model_is_a_fair_test_subject(decoded_images):
  """Partly trained: its outputs change along the image and between images, and its extra heads are right
  sometimes, not always (exact would otherwise be trivially equal to greedy)."""
  d = decoded_images
  assert np.mean([len(np.unique(row)) > 1 for row in d['greedy']]) >= 0.5
  assert len(np.unique(d['greedy'], axis=0)) > len(d['greedy']) // 2
  assert 1.1 < decoding.summarize(d['exact'])['mean_accepted_block_size'] < IMAGE_K - 0.5


def test_image_exact_blockwise_equals_greedy(decoded_images):
  d = decoded_images
  np.testing.assert_array_equal(d['greedy_length'], TGT_LEN)
  np.testing.assert_array_equal(np.asarray(d['exact'].tokens_BxL), d['greedy'])
  np.testing.assert_array_equal(np.asarray(d['exact'].length_B), TGT_LEN)


def test_image_distance_accepts_within_eps_with_larger_blocks(image_model, decoded_images):
  """Every token distance:2 accepted is within 2 of head 1's argmax given the decoded prefix (re-scored
  with the full, non-cached model), and the blocks are at least as long as with exact acceptance."""
  model, params = image_model
  d = decoded_images
  tokens = np.asarray(d['distance'].tokens_BxL)
  np.testing.assert_array_equal(np.asarray(d['distance'].length_B), TGT_LEN)
  tgt_in = np.concatenate([np.full((len(tokens), 1), BOS), tokens[:, :-1]], axis=1)
  logits = jax.jit(model.apply)({'params': params}, jnp.asarray(d['src']), jnp.asarray(tgt_in))
  best = np.asarray(jnp.argmax(logits[:, :, 0], axis=-1))
  assert np.abs(tokens - best).max() <= 2
  assert not np.array_equal(tokens, d['greedy'])  # distance:2 did accept something greedy would not
  exact_stats = decoding.summarize(d['exact'])
  distance_stats = decoding.summarize(d['distance'])
  assert distance_stats['mean_accepted_block_size'] >= exact_stats['mean_accepted_block_size']


def test_decoded_tokens_round_trip_through_images(decoded_images):
  tokens = np.asarray(decoded_images['distance'].tokens_BxL)
  assert tokens.min() >= images.PIXEL_OFFSET and tokens.max() < images.IMAGE_VOCAB_SIZE  # only pixel ids
  image_Bx8x8x3 = images.tokens_to_image(tokens, HIGH, HIGH)
  np.testing.assert_array_equal(images.image_to_tokens(image_Bx8x8x3), tokens)
  # Raster order, R, G, B per pixel: token (r * 8 + c) * 3 + channel is pixel (r, c)'s channel.
  b, r, c, ch = 3, 5, 2, 1
  assert image_Bx8x8x3[b, r, c, ch] == tokens[b, (r * HIGH + c) * 3 + ch] - images.PIXEL_OFFSET
