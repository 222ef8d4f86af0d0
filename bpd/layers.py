"""Transformer building blocks whose decoder attention keeps an explicit, per-row KV cache.

Why not flax.linen's built-in decode cache: it takes one token per call and keeps one cache index for the
whole batch. Blockwise parallel decoding scores a block of k tokens per call, and every row of the batch
accepts a different number of them (DESIGN §3). So the cache here is a plain pytree passed in and out:
a call writes T new positions starting at `start_B[b]` for row b, and each query attends to the cached
positions <= its own. Positions after a row's accepted prefix hold stale keys of rejected tokens; they are
masked (they lie after the query) and overwritten by the next call, so rolling back costs nothing.

Local attention (for long targets such as the 3072 sub-pixels of a 32x32 image): with attention_block = W > 0
the decoder self-attention is local 1D block attention (Image Transformer, Parmar et al. 2018, §3.2): positions
are grouped in blocks of W, and the query at position p sees the keys q <= p in its own block and the previous
one (q // W >= p // W - 1). Training computes it block by block in O(T·2W) (`local_block_attend`); decoding keeps
the full-length cache and applies the same receptive field as a mask over it (`DecoderLayer.extend`).

Shape letters: B batch, T new target positions in this call, S source length, L cache length,
D d_model, H attention heads, K head dim (D // H), F feed-forward width, N blocks of W positions.
"""

import jax
import jax.numpy as jnp
import flax.linen as nn
import numpy as np

from bpd import matmul
from bpd.errors import UserError

NEG_INF = -1e9  # Masked attention logits; finite so that a fully masked row gives no NaN.


def sinusoidal_positions(positions_BxT: jax.Array, d_model: int) -> jax.Array:
  """Sinusoidal position encodings (Vaswani et al. 2017, §3.5) at arbitrary (integer or fractional) positions.

  Computed from the positions rather than looked up in a table so that every row can sit at a different
  position and the cache length (max_len + k) is not bounded by a table size.
  Returns [B, T, D] float32.
  """
  half = d_model // 2
  inv_freq_H = np.exp(-np.log(10000.0) * np.arange(half) / max(half - 1, 1)).astype(np.float32)
  angles_BxTxH = positions_BxT[..., None].astype(jnp.float32) * inv_freq_H
  enc = jnp.concatenate([jnp.sin(angles_BxTxH), jnp.cos(angles_BxTxH)], axis=-1)
  if d_model % 2:
    enc = jnp.pad(enc, [(0, 0)] * (enc.ndim - 1) + [(0, 1)])
  return enc


def image_positions(positions_BxT: jax.Array, side: int, scale: int, d_model: int) -> jax.Array:
  """2D position encodings of sub-pixels of a side x side x 3 image in raster order (R, G, B per pixel).

  Position p is pixel (row, col) = divmod(p // 3, side), channel p % 3. As in the Image Transformer (Parmar et
  al. 2018, §3.2), the first d/2 dimensions encode the row and the other d/2 the column and channel, as
  col * 3 + channel. `scale` is this image's pixel size in units of the output image's pixels (4 for the 8x8
  input of a 32x32 output, 1 for the output): coordinates are pixel centres in output units, so the input and
  output share one coordinate system. Returns [B, T, D] float32.
  """
  pixel_BxT, channel_BxT = positions_BxT // 3, positions_BxT % 3
  centre = (scale - 1) / 2
  row_BxT = (pixel_BxT // side) * scale + centre
  col_channel_BxT = ((pixel_BxT % side) * scale + centre) * 3 + channel_BxT
  half = d_model // 2
  return jnp.concatenate([sinusoidal_positions(row_BxT, half),
                          sinusoidal_positions(col_channel_BxT, d_model - half)], axis=-1)


def colocated_source_index(positions_BxT: jax.Array, side: int, input_side: int) -> jax.Array:
  """Source index of the input sub-pixel co-located with each target sub-pixel (config.colocated_input).

  Target position p is sub-pixel (row, col, channel) of the side x side x 3 output, p // 3 = row * side + col
  and channel = p % 3 (raster order, R, G, B per pixel); the input pixel covering it is (row // s, col // s)
  with s = side // input_side, so its same-channel sub-pixel is ((row // s) * input_side + col // s) * 3 +
  channel in the input_side x input_side x 3 source. For CelebA (32 from 8): ((row // 4) * 8 + col // 4) * 3
  + channel. Positions past the image map past the source; the caller clips them.
  """
  scale = side // input_side
  row_BxT, col_BxT = (positions_BxT // 3) // side, (positions_BxT // 3) % side
  return ((row_BxT // scale) * input_side + col_BxT // scale) * 3 + positions_BxT % 3


PIXEL_OFFSET, NUM_INTENSITIES = 3, 256  # as bpd/data/images.py: intensity v is id v + 3
ORDINAL_WIDTH = 8  # intensity levels: pixel embeddings closer than this start out similar


def ordinal_pixel_embedding_init(base_init, width: int = ORDINAL_WIDTH):
  """Embedding initializer (config.model.ordinal_pixel_init): the special ids' rows from `base_init`, and the
  256 intensity rows as sinusoids of the intensity, e_v = sqrt(2/D) [cos(v w_j), sin(v w_j)], w_j = pi (j + 1) /
  (width D/2), j < D/2. Then |e_v| = 1 (as the normal(D^-1/2) init on average) and e_u . e_v = mean_j cos((u - v)
  w_j), a sinc-like kernel of |u - v| with its first zero near `width` levels, periodic only beyond 255.

  Why (not in the paper): with the output projection tied to the embedding, an ordered embedding makes a
  hidden state near e_c score intensities near c highly, so the co-located input in the residual stream
  (config.model.colocated_input) is at once a smooth guess around c rather than a 1-of-256 class; randomly
  initialized classes must learn that 100 and 101 are alike from data, slowly on CPU.
  """
  def init(key, shape, dtype=jnp.float32):
    table_VxD = base_init(key, shape, dtype)
    vocab, d_model = shape
    if vocab < PIXEL_OFFSET + NUM_INTENSITIES or d_model % 2:
      raise UserError(f'ordinal_pixel_init needs the image vocabulary ({PIXEL_OFFSET + NUM_INTENSITIES} ids) and an '
                      f'even d_model, got a [{vocab}, {d_model}] embedding.')
    half = d_model // 2
    angle_VxH = jnp.arange(NUM_INTENSITIES)[:, None] * (jnp.pi * (jnp.arange(half) + 1) / (width * half))[None]
    pixels_VxD = jnp.sqrt(2.0 / d_model) * jnp.concatenate([jnp.cos(angle_VxH), jnp.sin(angle_VxH)], axis=-1)
    return table_VxD.at[PIXEL_OFFSET:PIXEL_OFFSET + NUM_INTENSITIES].set(pixels_VxD.astype(dtype))
  return init


def bicubic_guess(src_BxS: jax.Array, side: int, input_side: int) -> jax.Array:
  """Bicubic enlargement of the input image, as intensities: [B, side * side * 3] float32 in [0, 255].

  src_BxS holds the input_side x input_side x 3 image as sub-pixel ids (intensity + PIXEL_OFFSET, raster order);
  the result is in the target's raster order, so entry p is the guess for target position p
  (config.model.output_prior_sigma). The same resize as images.enlarge(method='bicubic'), not rounded.
  """
  pixels = (src_BxS - PIXEL_OFFSET).astype(jnp.float32).reshape(src_BxS.shape[0], input_side, input_side, 3)
  enlarged = jax.image.resize(pixels, (src_BxS.shape[0], side, side, 3), method='bicubic')
  return jnp.clip(enlarged, 0.0, NUM_INTENSITIES - 1.0).reshape(src_BxS.shape[0], -1)


def intensity_prior(guess_Bx___: jax.Array, sigma: float, vocab_size: int) -> jax.Array:
  """Log-prior added to the logits, [..., V]: -(v - g)² / (2 sigma²) for the intensity v of each pixel id,
  g = guess (config.model.output_prior_sigma). The special ids (padding, BOS, EOS: never an image's target) get
  the value of an intensity 255 levels away, below every intensity's."""
  value_V = jnp.arange(vocab_size) - PIXEL_OFFSET
  distance = jnp.where(value_V >= 0, value_V - guess_Bx___[..., None], NUM_INTENSITIES - 1.0)
  return -0.5 * jnp.square(distance / sigma)


def attend(q_BxTxHxK, k_BxSxHxK, v_BxSxHxK, mask_BxTxS, dtype, heads_major=False) -> jax.Array:
  """Scaled dot-product attention; softmax in float32. Returns [B, T, H, K].

  heads_major: the decoding caches' layout (`attend_cached`): keys come as [B, H, K, S], values as [B, H, S, K].
  """
  depth = q_BxTxHxK.shape[-1]
  if heads_major and matmul.active() == 'skinny':
    return _attend_skinny(q_BxTxHxK, k_BxSxHxK, v_BxSxHxK, mask_BxTxS, dtype)
  keys = 'bhks' if heads_major else 'bshk'
  logits_BxHxTxS = jnp.einsum(f'bthk,{keys}->bhts', q_BxTxHxK, k_BxSxHxK).astype(jnp.float32)
  logits_BxHxTxS = logits_BxHxTxS / np.sqrt(depth).astype(np.float32)
  logits_BxHxTxS = jnp.where(mask_BxTxS[:, None], logits_BxHxTxS, NEG_INF)
  weights_BxHxTxS = jax.nn.softmax(logits_BxHxTxS, axis=-1).astype(dtype)
  if heads_major:
    # Output heads-major, then transposed: written as one einsum to 'bthk', XLA's CPU backend computed the
    # product as V^T W^T with the cache as the transposed operand, several times slower than the transpose of the
    # small [B, H, T, K] result (experiments/bench_decode.py --mode=profile).
    return jnp.swapaxes(jnp.einsum('bhts,bhsk->bhtk', weights_BxHxTxS, v_BxSxHxK), 1, 2)
  return jnp.einsum('bhts,bshk->bthk', weights_BxHxTxS, v_BxSxHxK)


def _attend_skinny(q_BxTxHxK, k_BxHxKxS, v_BxHxSxK, mask_BxTxS, dtype) -> jax.Array:
  """`attend` on the decoding caches with both products on the skinny kernel (bpd/matmul.py), one [T, K] x [K, S]
  and one [T, S] x [S, K] per (b, h): each query row's logits and output are then summed in one order whatever T
  is, so that a T-token verification computes what T one-token steps compute, bit for bit (DESIGN §8)."""
  b, t, h, depth = q_BxTxHxK.shape
  q_NxTxK = jnp.swapaxes(q_BxTxHxK, 1, 2).reshape(b * h, t, depth)
  # The caches go to the kernel as they lie ([B, H, ...], read as [B * H, ...]): reshaped here, a cache just
  # written by this call was copied (twice per layer and call) by XLA's CPU backend before the kernel read it.
  logits_NxTxS = matmul.batched(q_NxTxK, k_BxHxKxS).astype(jnp.float32)
  logits_BxHxTxS = logits_NxTxS.reshape(b, h, t, -1) / np.sqrt(depth).astype(np.float32)
  logits_BxHxTxS = jnp.where(mask_BxTxS[:, None], logits_BxHxTxS, NEG_INF)
  weights_BxHxTxS = jax.nn.softmax(logits_BxHxTxS, axis=-1).astype(dtype)
  out_NxTxK = matmul.batched(weights_BxHxTxS.reshape(b * h, t, -1), v_BxHxSxK)
  return jnp.swapaxes(out_NxTxK.reshape(b, h, t, depth), 1, 2)


def attend_cached(q_BxTxHxK, k_BxHxKxS, v_BxHxSxK, mask_BxTxS, dtype) -> jax.Array:
  """`attend` with the decoding caches' layouts: keys [B, H, K, S], values [B, H, S, K]. Returns [B, T, H, K].

  Why other layouts than training's [B, S, H, K]: each (b, h) product should read its operand as a plain
  row-major matrix, q [T, K] @ keys [K, S] and weights [T, S] @ values [S, K]. With [B, S, H, K] caches XLA's
  CPU backend transposed every layer's whole key cache on every decoding call, and with keys [B, H, S, K] it
  still copied each layer's key cache to [B, H, K, S] after writing the new keys (bench_decode --mode=profile).
  """
  return attend(q_BxTxHxK, k_BxHxKxS, v_BxHxSxK, mask_BxTxS, dtype, heads_major=True)


def local_block_attend(q_BxTxHxK, k_BxTxHxK, v_BxTxHxK, block: int, dtype) -> jax.Array:
  """Causal local 1D block self-attention over a whole sequence (Image Transformer, Parmar et al. 2018, §3.2).

  The query at position p sees the keys q <= p with q // W >= p // W - 1 (W = `block`): its own block and the
  previous one. Computed per block, so memory and FLOPs grow as T·2W rather than T²: the queries of block n
  attend to a window of 2W keys, block n - 1 followed by block n. T is padded up to a multiple of W; padded
  keys lie after every real query (causally masked) and padded queries are dropped. Returns [B, T, H, K].
  """
  batch, length, heads, depth = q_BxTxHxK.shape
  num_blocks = -(-length // block)

  def to_blocks(x_BxTxHxK):
    x_BxTxHxK = jnp.pad(x_BxTxHxK, ((0, 0), (0, num_blocks * block - length), (0, 0), (0, 0)))
    return x_BxTxHxK.reshape(batch, num_blocks, block, heads, depth)

  def windows(x_BxTxHxK):
    """[B * N, 2W, H, K]: block n - 1 then block n; block 0's previous block is zeros (masked below)."""
    x_BxNxWxHxK = to_blocks(x_BxTxHxK)
    prev_BxNxWxHxK = jnp.pad(x_BxNxWxHxK, ((0, 0), (1, 0), (0, 0), (0, 0), (0, 0)))[:, :-1]
    window_BxNx2WxHxK = jnp.concatenate([prev_BxNxWxHxK, x_BxNxWxHxK], axis=2)
    return window_BxNx2WxHxK.reshape(batch * num_blocks, 2 * block, heads, depth)

  # Query i of block n sits at position n·W + i, key j of its window at n·W + j - W: causal is j <= i + W,
  # and the window already holds exactly the two allowed blocks, except that block 0 has no previous block.
  # (jnp, not np: built from iotas inside the program rather than a B·T·2W constant baked into it.)
  query_W1 = jnp.arange(block)[:, None]
  key_12W = jnp.arange(2 * block)[None, :]
  block_N11 = jnp.arange(num_blocks)[:, None, None]
  mask_NxWx2W = (key_12W <= query_W1 + block) & ((block_N11 > 0) | (key_12W >= block))
  mask_BNxWx2W = jnp.broadcast_to(mask_NxWx2W, (batch, num_blocks, block, 2 * block)).reshape(
      batch * num_blocks, block, 2 * block)
  q_BNxWxHxK = to_blocks(q_BxTxHxK).reshape(batch * num_blocks, block, heads, depth)
  out_BNxWxHxK = attend(q_BNxWxHxK, windows(k_BxTxHxK), windows(v_BxTxHxK), mask_BNxWx2W, dtype)
  return out_BNxWxHxK.reshape(batch, num_blocks * block, heads, depth)[:, :length]


def write_rows(cache: jax.Array, new: jax.Array, start_B: jax.Array, axis: int = 1) -> jax.Array:
  """cache[b, ..., start[b] : start[b] + T, ...] = new[b] along `axis` for every row b (rows start at different
  positions); `new` has the shape of `cache` with T at `axis`.

  A scalar start (every row at the same position, as in greedy decoding) is one dynamic_update_slice of the
  whole batch, and so is one row's start (batch 1: a blockwise call's rows at batch 1, written in place); per-row
  starts of several rows are a vmapped one, which XLA lowers to a scatter (on CPU, a pass over the whole cache).
  The caller guarantees start[b] + T <= L (dynamic_update_slice would otherwise clamp the start).
  """
  if jnp.ndim(start_B) == 0 or (cache.shape[0] == 1 and jnp.shape(start_B) == (1,)):
    start = start_B if jnp.ndim(start_B) == 0 else start_B[0]
    return jax.lax.dynamic_update_slice_in_dim(cache, new.astype(cache.dtype), start, axis)

  def one_row(cache_row, new_row, start):
    return jax.lax.dynamic_update_slice_in_dim(cache_row, new_row.astype(cache_row.dtype), start, axis - 1)
  return jax.vmap(one_row)(cache, new, start_B)


def query_positions(start_B: jax.Array, batch: int, num_new: int) -> jax.Array:
  """Positions start_B[b] .. start_B[b] + T - 1 of T new tokens: [B, T]. start_B is [B] or a scalar (all rows)."""
  return jnp.broadcast_to(jnp.asarray(start_B)[..., None] + jnp.arange(num_new), (batch, num_new))


def tree_positions(start_B: jax.Array, batch: int, depth_N) -> jax.Array:
  """Positions start_B[b] + depth[n] of the N nodes of a candidate tree (bpd/decoding.py, blockwise): [B, N].
  depth_N: [N] (a static tree, numpy) or [B, N] (a tree per row)."""
  return jnp.broadcast_to(jnp.asarray(start_B)[..., None] + jnp.asarray(depth_N), (batch, depth_N.shape[-1]))


def tree_self_mask(start_B: jax.Array, batch: int, slots_BxL: jax.Array, depth_N, ancestor_NxN):
  """Self-attention of the N nodes of a candidate tree written to slots start_B[b] .. start_B[b] + N - 1.

  Node n sees the slots before start_B[b] (the accepted prefix) and the slots of its ancestors and itself
  (ancestor_NxN[n, m]: a numpy constant, or [B, N, N] for a tree per row, with depth_N [B, N]); the other nodes of
  the tree and the stale slots after it are masked.
  slots_BxL: the cache slots attended ([1 or B, L]: the whole cache, or local attention's `key_window`).
  Returns (mask_BxNxL, key_positions_BxL): the positions of what each slot holds (slot l holds position l,
  except the tree's slots, which hold start + depth), for local attention's block mask.
  """
  num = depth_N.shape[-1]
  rel_BxL = slots_BxL - jnp.broadcast_to(jnp.asarray(start_B), (batch,))[:, None]
  in_tree_BxL = (rel_BxL >= 0) & (rel_BxL < num)
  node_BxL = jnp.clip(rel_BxL, 0, num - 1)
  if depth_N.ndim == 1:  # one static tree for every row
    ancestor_BxNxL = jnp.moveaxis(jnp.asarray(ancestor_NxN)[:, node_BxL], 0, 1)
    node_depth_BxL = jnp.asarray(depth_N)[node_BxL]
  else:  # a tree per row
    node_BxL = jnp.broadcast_to(node_BxL, (batch, node_BxL.shape[1]))
    ancestor_BxNxL = jnp.take_along_axis(ancestor_NxN, node_BxL[:, None, :], axis=2)
    node_depth_BxL = jnp.take_along_axis(depth_N, node_BxL, axis=1)
  mask_BxNxL = (rel_BxL < 0)[:, None, :] | (in_tree_BxL[:, None, :] & ancestor_BxNxL)
  key_positions_BxL = jnp.where(in_tree_BxL, slots_BxL - rel_BxL + node_depth_BxL, slots_BxL)
  return mask_BxNxL, key_positions_BxL


def key_window(start_B: jax.Array, cache_len: int, block: int, num_new: int):
  """The cache slots local attention can see from T new tokens written from start_B (chain: positions start ..
  start + T - 1; tree: T = N node slots, positions start + depth): S = min(cache_len, 2W + T) slots from
  first_B = (start // W - 1) * W, the first position of the block before the first new position's (clipped into
  the cache). Every key a new token may attend to (its own block and the one before, up to its own slot) is
  inside, so attending to the window equals attending to the whole masked cache; a step reads 2W + T slots of
  each layer's cache instead of all of them (3080 for a 32x32 image). Returns (first_B, slots_BxS); first_B is a
  scalar when start_B is (every row at the same position)."""
  size = min(cache_len, 2 * block + num_new)
  first_B = jnp.clip((jnp.asarray(start_B) // block - 1) * block, 0, cache_len - size)
  return first_B, jnp.atleast_1d(first_B)[:, None] + jnp.arange(size)[None, :]


def read_rows(cache: jax.Array, first_B: jax.Array, size: int, axis: int) -> jax.Array:
  """cache[b, ..., first_B[b] : first_B[b] + size, ...] along `axis`; first_B may be a scalar (every row)."""
  # Per row even for a scalar: one slice of the whole batch, read right after write_rows' update, made XLA's CPU
  # backend copy the whole cache on every greedy step (experiments/bench_decode.py on an image config).
  first_B = jnp.broadcast_to(first_B, cache.shape[:1])
  return jax.vmap(lambda row, first: jax.lax.dynamic_slice_in_dim(row, first, size, axis - 1))(cache, first_B)


def move_slots(cache: jax.Array, start_B: jax.Array, source_BxD: jax.Array, axis: int) -> jax.Array:
  """cache[b, ..., start_B[b] + d, ...] = cache[b, ..., start_B[b] + source_BxD[b, d], ...] along the slot axis
  `axis`, for every d (all read first): [B, H, L, K] values (axis 2) or [B, H, K, L] keys (axis 3).

  Tree decoding: the accepted path's keys and values, written at their node slots, move to contiguous slots.
  """
  index_BxD = start_B[:, None] + source_BxD
  shape = [1] * cache.ndim
  shape[0], shape[axis] = index_BxD.shape
  moved = jnp.take_along_axis(cache, index_BxD.reshape(shape), axis=axis)
  return write_rows(cache, moved, start_B, axis=axis)


def packed(module: nn.Module, name: str):
  """The packed copy of parameter `name` (matmul.pack) in the 'packed' collection, which a skinny-kernel decoder
  passes beside the parameters (model.packed_weights); None elsewhere (training, XLA decoding)."""
  return module.get_variable('packed', name) if module.has_variable('packed', name) else None


class Dense(nn.Module):
  """flax's Dense (in_axes=1, one feature axis) and DenseGeneral (several feature axes, or in_axes trailing input
  axes contracted) as this model uses them, with the same parameters: 'kernel' [*in, *features] drawn as flax
  draws it (lecun_normal on the flattened [prod(in), prod(features)] matrix) and 'bias' [*features], zeros.
  Of our own so that the matmul goes through bpd/matmul.py, which runs it on the skinny kernel (reading the packed
  kernel) when a decoder asks for it, and on lax.dot_general otherwise."""
  features: tuple[int, ...]
  in_axes: int = 1
  dtype: jnp.dtype = jnp.float32

  @nn.compact
  def __call__(self, x):
    in_shape = x.shape[x.ndim - self.in_axes:]
    k, n = int(np.prod(in_shape)), int(np.prod(self.features))
    kernel_init = lambda rng, shape, dtype=jnp.float32: nn.initializers.lecun_normal()(rng, (k, n), dtype).reshape(
        shape)
    kernel = self.param('kernel', kernel_init, in_shape + tuple(self.features), jnp.float32)
    bias = self.param('bias', nn.initializers.zeros, tuple(self.features), jnp.float32)
    x, kernel, bias = x.astype(self.dtype), kernel.astype(self.dtype), bias.astype(self.dtype)
    y = matmul.dense(x.reshape(x.shape[:x.ndim - self.in_axes] + (k,)), kernel.reshape(k, n), bias.reshape(n),
                     packed=packed(self, 'kernel'))
    return y.reshape(x.shape[:x.ndim - self.in_axes] + tuple(self.features))


class MultiHeadAttention(nn.Module):
  """Multi-head attention with separate query/key/value/output projections.

  `__call__` attends from x to y with a given mask (training, encoder, cross-attention).
  `project_kv` and `attend_kv` split the work so the decoder can cache keys and values.
  """
  num_heads: int
  d_model: int
  dropout_rate: float = 0.0
  dtype: jnp.dtype = jnp.float32

  def setup(self):
    head_dim = self.d_model // self.num_heads
    dense = lambda name: Dense((self.num_heads, head_dim), dtype=self.dtype, name=name)
    self.query = dense('query')
    self.key = dense('key')
    self.value = dense('value')
    self.out = Dense((self.d_model,), in_axes=2, dtype=self.dtype, name='out')
    self.dropout = nn.Dropout(self.dropout_rate)

  def project_kv(self, y_BxSxD):
    """Keys and values of y, each [B, S, H, K]."""
    return self.key(y_BxSxD), self.value(y_BxSxD)

  def attend_kv(self, x_BxTxD, k_BxSxHxK, v_BxSxHxK, mask_BxTxS, deterministic=True):
    """Attend from x to precomputed keys and values. Returns [B, T, D]."""
    out_BxTxHxK = attend(self.query(x_BxTxD), k_BxSxHxK, v_BxSxHxK, mask_BxTxS, self.dtype)
    return self.dropout(self.out(out_BxTxHxK), deterministic=deterministic)

  def attend_cache(self, x_BxTxD, k_BxHxKxS, v_BxHxSxK, mask_BxTxS):
    """Attend from x to cached keys [B, H, K, S] and values [B, H, S, K] (decoding; `attend_cached`). [B, T, D]."""
    return self.out(attend_cached(self.query(x_BxTxD), k_BxHxKxS, v_BxHxSxK, mask_BxTxS, self.dtype))

  def __call__(self, x_BxTxD, y_BxSxD, mask_BxTxS, deterministic=True):
    k_BxSxHxK, v_BxSxHxK = self.project_kv(y_BxSxD)
    return self.attend_kv(x_BxTxD, k_BxSxHxK, v_BxSxHxK, mask_BxTxS, deterministic)

  def local_self_attend(self, x_BxTxD, block: int, deterministic=True):
    """Causal local block self-attention of x (see `local_block_attend`). Returns [B, T, D]."""
    k_BxTxHxK, v_BxTxHxK = self.project_kv(x_BxTxD)
    out_BxTxHxK = local_block_attend(self.query(x_BxTxD), k_BxTxHxK, v_BxTxHxK, block, self.dtype)
    return self.dropout(self.out(out_BxTxHxK), deterministic=deterministic)


class FeedForward(nn.Module):
  """Position-wise dense-relu-dense."""
  d_model: int
  d_ff: int
  dropout_rate: float = 0.0
  dtype: jnp.dtype = jnp.float32

  @nn.compact
  def __call__(self, x_BxTxD, deterministic=True):
    h = nn.relu(Dense((self.d_ff,), dtype=self.dtype, name='wi')(x_BxTxD))
    h = nn.Dropout(self.dropout_rate)(h, deterministic=deterministic)
    return Dense((self.d_model,), dtype=self.dtype, name='wo')(h)


class LayerSizes(nn.Module):
  """The fields both Transformer layers take, in the order bpd/model.py passes them."""
  num_heads: int
  d_model: int
  d_ff: int
  dropout_rate: float = 0.0
  attention_dropout_rate: float = 0.0
  dtype: jnp.dtype = jnp.float32


class EncoderLayer(LayerSizes):
  """Pre-LayerNorm encoder layer: self-attention, then feed-forward, each with a residual."""

  @nn.compact
  def __call__(self, x_BxSxD, mask_BxSxS, deterministic=True):
    drop = nn.Dropout(self.dropout_rate)
    h = nn.LayerNorm(dtype=self.dtype, name='ln_attn')(x_BxSxD)
    h = MultiHeadAttention(self.num_heads, self.d_model, self.attention_dropout_rate, self.dtype,
                           name='self_attn')(h, h, mask_BxSxS, deterministic)
    x_BxSxD = x_BxSxD + drop(h, deterministic=deterministic)
    h = nn.LayerNorm(dtype=self.dtype, name='ln_ff')(x_BxSxD)
    h = FeedForward(self.d_model, self.d_ff, self.dropout_rate, self.dtype, name='ff')(h, deterministic)
    return x_BxSxD + drop(h, deterministic=deterministic)


class DecoderLayer(LayerSizes):
  """Pre-LayerNorm decoder layer: causal self-attention, cross-attention, feed-forward.

  `__call__` runs a whole target sequence at once (training, reference for the cache tests).
  `extend` runs T new positions per row against a per-row KV cache (decoding).
  With attention_block = W > 0 the self-attention is local: each position sees its own block of W positions
  and the previous one (module docstring); both methods compute the same function.
  """
  attention_block: int = 0  # 0: full causal self-attention; W > 0: local 1D blocks of W positions

  def setup(self):
    self.ln_self = nn.LayerNorm(dtype=self.dtype)
    self.self_attn = MultiHeadAttention(self.num_heads, self.d_model, self.attention_dropout_rate, self.dtype)
    self.ln_cross = nn.LayerNorm(dtype=self.dtype)
    self.cross_attn = MultiHeadAttention(self.num_heads, self.d_model, self.attention_dropout_rate, self.dtype)
    self.ln_ff = nn.LayerNorm(dtype=self.dtype)
    self.ff = FeedForward(self.d_model, self.d_ff, self.dropout_rate, self.dtype)
    self.drop = nn.Dropout(self.dropout_rate)

  def __call__(self, x_BxTxD, enc_BxSxD, causal_mask_BxTxT, cross_mask_BxTxS, deterministic=True):
    """causal_mask_BxTxT is unused (may be None) with local attention, which builds its own block masks."""
    h = self.ln_self(x_BxTxD)
    if self.attention_block:
      h = self.self_attn.local_self_attend(h, self.attention_block, deterministic)
    else:
      h = self.self_attn(h, h, causal_mask_BxTxT, deterministic)
    x_BxTxD = x_BxTxD + self.drop(h, deterministic=deterministic)
    h = self.ln_cross(x_BxTxD)
    h = self.cross_attn(h, enc_BxSxD, cross_mask_BxTxS, deterministic)
    x_BxTxD = x_BxTxD + self.drop(h, deterministic=deterministic)
    h = self.ff(self.ln_ff(x_BxTxD), deterministic)
    return x_BxTxD + self.drop(h, deterministic=deterministic)

  def cross_kv(self, enc_BxSxD):
    """Cross-attention keys and values, computed once per source (the encoder runs once)."""
    return self.cross_attn.project_kv(enc_BxSxD)

  def init_cache(self, enc_BxSxD, cache_len: int):
    """A zero self-attention cache of `cache_len` slots plus this layer's cross-attention keys/values, in the
    layouts `attend_cached` reads (keys [B, H, K, L or S], values [B, H, L or S, K]): the cross keys and values,
    which never change during a decode, are transposed once here."""
    batch = enc_BxSxD.shape[0]
    head_dim = self.d_model // self.num_heads
    cross_k_BxSxHxK, cross_v_BxSxHxK = self.cross_kv(enc_BxSxD)
    return {'k_BxHxKxL': jnp.zeros((batch, self.num_heads, head_dim, cache_len), self.dtype),
            'v_BxHxLxK': jnp.zeros((batch, self.num_heads, cache_len, head_dim), self.dtype),
            'cross_k_BxHxKxS': jnp.transpose(cross_k_BxSxHxK, (0, 2, 3, 1)),
            'cross_v_BxHxSxK': jnp.swapaxes(cross_v_BxSxHxK, 1, 2)}

  def extend(self, x_BxTxD, cache, start_B, cross_mask_BxTxS, tree=None):
    """Run T new positions per row, at positions start_B[b] .. start_B[b] + T - 1. Returns (y_BxTxD, cache).

    tree = (depth_N, ancestor_NxN) or per row (depth_BxN, ancestor_BxNxN) (bpd/decoding.py, Layout.mask / RowTree.mask): the T = N
    tokens are the nodes of a candidate tree, in slots start_B[b] + n at positions start_B[b] + depth[n], each seeing
    the prefix and its ancestors.
    """
    h = self.ln_self(x_BxTxD)
    k_new_BxTxHxK, v_new_BxTxHxK = self.self_attn.project_kv(h)
    k_BxHxKxL = write_rows(cache['k_BxHxKxL'], jnp.transpose(k_new_BxTxHxK, (0, 2, 3, 1)), start_B, axis=3)
    v_BxHxLxK = write_rows(cache['v_BxHxLxK'], jnp.swapaxes(v_new_BxTxHxK, 1, 2), start_B, axis=2)
    batch, num_new, cache_len = x_BxTxD.shape[0], x_BxTxD.shape[1], v_BxHxLxK.shape[2]
    if self.attention_block:  # local attention reads only the window of slots it can see (`key_window`)
      first_B, slots_BxL = key_window(start_B, cache_len, self.attention_block, num_new)
      keys_BxHxKxL = read_rows(k_BxHxKxL, first_B, slots_BxL.shape[1], axis=3)
      values_BxHxLxK = read_rows(v_BxHxLxK, first_B, slots_BxL.shape[1], axis=2)
    else:
      slots_BxL, keys_BxHxKxL, values_BxHxLxK = jnp.arange(cache_len)[None, :], k_BxHxKxL, v_BxHxLxK
    if tree is None:
      query_pos_BxT = query_positions(start_B, batch, num_new)
      # A query sees cached positions up to its own; later slots (stale or empty) are masked.
      self_mask_BxTxL = slots_BxL[:, None, :] <= query_pos_BxT[:, :, None]
      key_pos_BxL = slots_BxL
    else:
      query_pos_BxT = tree_positions(start_B, batch, tree[0])
      self_mask_BxTxL, key_pos_BxL = tree_self_mask(start_B, batch, slots_BxL, *tree)
    if self.attention_block:
      # Local attention: also mask keys before the previous block, the receptive field that
      # `local_block_attend` gives in training, so that the two paths are equal.
      key_block_BxL = key_pos_BxL // self.attention_block
      self_mask_BxTxL &= key_block_BxL[:, None, :] >= (query_pos_BxT // self.attention_block - 1)[:, :, None]
    x_BxTxD = x_BxTxD + self.self_attn.attend_cache(h, keys_BxHxKxL, values_BxHxLxK, self_mask_BxTxL)
    h = self.ln_cross(x_BxTxD)
    x_BxTxD = x_BxTxD + self.cross_attn.attend_cache(h, cache['cross_k_BxHxKxS'], cache['cross_v_BxHxSxK'],
                                                       cross_mask_BxTxS)
    x_BxTxD = x_BxTxD + self.ff(self.ln_ff(x_BxTxD))
    new_cache = dict(cache, k_BxHxKxL=k_BxHxKxL, v_BxHxLxK=v_BxHxLxK)
    return x_BxTxD, new_cache


class MultiOutput(nn.Module):
  """The paper's multi-output layer (§4; tensor2tensor transformer_parallel) for the proposal heads.

  A feed-forward layer of hidden size n·d_ff and output size n·d_model, split into n vectors; each is
  added to the decoder output (residual) and layer-normalized; the caller sends each through the shared
  vocabulary projection. n = k - 1: heads 2..k.

  Two choices differ from a literal reading of the paper, both deliberate:
  - Head 1 is the base model's own output, not routed through this layer, so that a frozen base keeps its
    greedy output exactly (paper §6.1, Table 1: frozen rows keep the base BLEU for every k) and "load base,
    add heads" only adds this subtree.
  - The output projection is block-diagonal: head i reads only its own d_ff slice of the hidden layer
    (same hidden and output sizes as the dense layer). The dense n·d_ff x n·d_model matrix is (k-1)² d·d_ff
    weights that decoding reads once per iteration: 51 MB at k=8, d=256, d_ff=1024, which measured 6.4 ms
    per call at batch 1 on our 2-core CPU against 1.3 ms for a whole greedy step. Block-diagonal, the
    layer costs 2(k-1)·d·d_ff, and the first k' heads of a k-head model are exactly a k'-head model.

  sequential (model.head_type='sequential'; not in the paper): sequentially dependent heads after Hydra (Ankner et
  al. 2024). Head n + 2 also sees the embedding e of the token proposed before it (the one head n + 1 proposes)
  through a [d, d] projection of its own, 'token_kernel': its input is x_n = hidden + e @ token_kernel[n] instead
  of hidden, and its residual is x_n. The paper's heads cannot know which token the head before them chose, so
  they hedge between continuations; a sequential head conditions on it. token_kernel starts at zero: an untrained
  sequential layer computes what the independent one does (up to rounding) with the same other weights (it is
  declared last, so those are drawn as the independent layer's are), and an independent checkpoint's tree has
  no 'token_kernel' at all.
  """
  num_heads: int  # n = k - 1 proposal heads
  d_model: int
  d_ff: int
  dtype: jnp.dtype = jnp.float32
  sequential: bool = False

  def setup(self):
    n, d, f = self.num_heads, self.d_model, self.d_ff
    init = nn.initializers.lecun_normal(batch_axis=(0,))
    self.wi_kernel = self.param('wi_kernel', init, (n, d, f))  # [N, D, F]
    self.wi_bias = self.param('wi_bias', nn.initializers.zeros, (n, f))  # [N, F]
    self.wo_kernel = self.param('wo_kernel', init, (n, f, d))  # [N, F, D]
    self.wo_bias = self.param('wo_bias', nn.initializers.zeros, (n, d))  # [N, D]
    self.ln = nn.LayerNorm(dtype=self.dtype)
    if self.sequential:  # after every other parameter: their initial values do not change (class docstring)
      self.token_kernel = self.param('token_kernel', nn.initializers.zeros, (n, d, d))  # [N, D, D]

  def __call__(self, hidden_Bx___xD, previous_Bx___xNxD=None):
    """The n heads' vectors: [..., n, D].

    previous_Bx___xNxD (sequential only, required there): the embedding of the token each head is fed, the one
    proposed for the position before the one it predicts (training: the target there, teacher-forced).
    """
    used = self.num_heads
    x = hidden_Bx___xD.astype(self.dtype)
    # Head axis first, as the batch axis of two batched matmuls ([n, M, d] @ [n, d, f], then @ [n, f, d]): written
    # as '...d,ndf->...nf' XLA's CPU backend transposed the whole [n, d, f] kernel to [d, n, f] on every call.
    # Broadcasting x costs n·M·d.
    x_Nx___xD = jnp.broadcast_to(x, (used,) + x.shape)
    if self.sequential:
      previous_Nx___xD = jnp.moveaxis(previous_Bx___xNxD.astype(self.dtype), -2, 0)
      x_Nx___xD = x_Nx___xD + matmul.batched(previous_Nx___xD, self.token_kernel.astype(self.dtype),
                                             packed=packed(self, 'token_kernel'))
    h_Nx___xF = nn.relu(matmul.batched(x_Nx___xD, self.wi_kernel.astype(self.dtype), self.wi_bias,
                                       packed=packed(self, 'wi_kernel')))
    out_Nx___xD = matmul.batched(h_Nx___xF, self.wo_kernel.astype(self.dtype), self.wo_bias,
                                 packed=packed(self, 'wo_kernel'))
    if self.sequential:  # each head's residual is its own input, token included
      return self.ln(jnp.moveaxis(out_Nx___xD + x_Nx___xD, 0, -2))
    out_Bx___xNxD = jnp.moveaxis(out_Nx___xD, 0, -2)
    return self.ln(out_Bx___xNxD + x[..., None, :])

  def one_head(self, hidden_Bx___xD, index, previous_Bx___xD=None, weights=None):
    """The vector of head `index` + 2 alone (index in 0..n-1, may be traced): [..., D].

    What the sampled-head loss needs (paper §6: one of the k sub-losses per minibatch): only the drawn head's
    slice of the layer is computed, so its vocabulary projection is one, not k - 1. Sequential heads also run
    one at a time in decoding (Transformer.propose), each fed the token the one before it chose:
    previous_Bx___xD is that token's embedding (sequential only, required there). weights: this head's slices
    of the parameters, cut once outside the decoding loop (bpd/model.py, split_sequential_heads), instead of
    here: cut inside the loop's body, XLA's CPU backend copied each head's kernels on every iteration (as it did
    for first_heads), most of the bytes that sequential heads added per iteration.
    """
    x = hidden_Bx___xD.astype(self.dtype)
    take = lambda w: jax.lax.dynamic_index_in_dim(w, index, axis=0, keepdims=False)
    names = ('wi_kernel', 'wi_bias', 'wo_kernel', 'wo_bias') + (('token_kernel',) if self.sequential else ())
    w = weights if weights is not None else {name: take(getattr(self, name)) for name in names}
    # With a skinny-kernel decoder, the kernel reads head `index` of the packed [n, ...] stack in place (no copy).
    pick = lambda name: dict(packed=packed(self, name), packed_index=index) if isinstance(index, int) else {}
    if self.sequential:
      x = x + matmul.dense(previous_Bx___xD.astype(self.dtype), w['token_kernel'].astype(self.dtype),
                           **pick('token_kernel'))
    h = nn.relu(matmul.dense(x, w['wi_kernel'].astype(self.dtype), w['wi_bias'], **pick('wi_kernel')))
    return self.ln(matmul.dense(h, w['wo_kernel'].astype(self.dtype), w['wo_bias'], **pick('wo_kernel')) + x)

  def fused_chain(self, hidden_BxD, first_B, embedding_VxD, draft_ids, projection, heads: int, embed_scale: float):
    """Sequential heads 2..heads + 1 in one library call (matmul.sequential_heads): (logits [B, heads, X], tokens
    [B, heads]), each head fed the token the one before chose, head 2 first_B; `one_head`'s products on this
    layer's packed weights, then the projection `projection` (a pack of [D, X]). None where the library does not
    run them: outside a skinny-kernel decoder, or without packed weights (then the caller runs `one_head`)."""
    stacks = [packed(self, name) for name in ('token_kernel', 'wi_kernel', 'wo_kernel')]
    if not self.sequential or projection is None or any(stack is None for stack in stacks):
      return None
    ln = self.ln.variables['params']
    return matmul.sequential_heads(hidden_BxD.astype(self.dtype), first_B, embedding_VxD, draft_ids, stacks[0],
                                   stacks[1], self.wi_bias, stacks[2], self.wo_bias, ln['scale'], ln['bias'],
                                   projection, heads, embed_scale, self.ln.epsilon)
