"""Encoder-decoder Transformer with k prediction heads (Stern et al. 2018, §4).

Used purely functionally: `model.apply({'params': params}, ..., method=...)`. The parameter tree of a
k-head model is the base model's tree plus one subtree, 'multi_output', so a trained base (k = 1) becomes a
k-head model with `add_heads(base_params, new_params)`.

Methods:
  __call__(src, tgt_in)        -> logits of all k heads at every position (training).
  one_head_logits(src, tgt_in, head) -> logits of one (drawn) head at every position (sampled-head loss).
  encode / decode_hidden / head_hidden / logits: the pieces of __call__, for losses that save memory.
  init_decode_state(src, ...)  -> per-row decoder state (KV cache + encoder keys/values), leaves [B, ...].
  score(state, tokens, start)  -> head-1 logits at T new positions, their hidden states, new state.
  score(state, tokens, start, tree) -> the same for the N nodes of a candidate tree (bpd/decoding.py, blockwise);
                                  `move_cache` then moves the accepted path's keys and values into place.
  propose(hidden)              -> logits of heads 2..k at one position per row (with head_type='sequential' one
                                  head after the other, each fed the previous one's argmax); with a draft
                                  vocabulary (ModelConfig.draft_ids) projected onto its R rows, -inf elsewhere.
`decode_fns` wraps the last three as the plain functions that `bpd.decoding` takes; decoding never sees
this module.
"""

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import flax.linen as nn
import numpy as np

from bpd import decoding
from bpd import layers
from bpd import matmul
from bpd.errors import UserError

# Model sizes. base and big as in Vaswani et al. 2017 (Table 3); small and tiny for CPU runs and tests.
# image_tiny / image_small: CPU sizes for 8x8 -> 32x32 super-resolution (3072-token targets, 192-token sources):
# a deeper decoder than encoder, as the decoder does the work; pair them with attention_block (e.g. 256).
SIZES = {
    'tiny': dict(d_model=64, num_heads=4, num_encoder_layers=2, num_decoder_layers=2, d_ff=256),
    # The demo's size: at d = 64 the decoder state had no room to carry the next tokens for the heads as well as
    # the next one for head 1 (fine-tuning for acceptance cost 18 BLEU); d = 128 holds both.
    'mini': dict(d_model=128, num_heads=4, num_encoder_layers=2, num_decoder_layers=2, d_ff=512),
    'small': dict(d_model=256, num_heads=4, num_encoder_layers=3, num_decoder_layers=3, d_ff=1024),
    'image_tiny': dict(d_model=64, num_heads=4, num_encoder_layers=1, num_decoder_layers=2, d_ff=256),
    'image_small': dict(d_model=128, num_heads=4, num_encoder_layers=2, num_decoder_layers=3, d_ff=512),
    # One accelerator, minutes of training (configs/celeba_sr.py:gpu): wide but shallow, since decoding
    # 3072 sub-pixels one step at a time costs per layer, not per unit of width.
    'image_medium': dict(d_model=256, num_heads=4, num_encoder_layers=2, num_decoder_layers=4, d_ff=1024),
    'base': dict(d_model=512, num_heads=8, num_encoder_layers=6, num_decoder_layers=6, d_ff=2048),
    'big': dict(d_model=1024, num_heads=16, num_encoder_layers=6, num_decoder_layers=6, d_ff=4096,
                dropout_rate=0.3),
}


@dataclasses.dataclass(frozen=True)
class ModelConfig:
  """Everything that fixes the parameter shapes and the computation. Hashable (a static jit argument)."""
  vocab_size: int
  k: int = 1  # number of heads; head 1 is the ordinary next-token model, k = 1 is a plain Transformer
  d_model: int = 512
  num_heads: int = 8
  num_encoder_layers: int = 6
  num_decoder_layers: int = 6
  d_ff: int = 2048
  dropout_rate: float = 0.1
  attention_dropout_rate: float = 0.0
  dtype: str = 'float32'  # activations; parameters stay float32
  # Decoder self-attention: 0 = full causal; W > 0 = local 1D block attention (Image Transformer, Parmar et al.
  # 2018, §3.2), each position sees its own block of W positions and the previous one. Adds no parameters.
  attention_block: int = 0
  # Images (super-resolution): side of the square target image (0 = text: 1D sequence positions) and of the
  # input image. With image_side > 0, positions are encoded as 2D coordinates (see layers.image_positions).
  image_side: int = 0
  image_input_side: int = 0
  # Hidden width of each proposal head in the multi-output layer (paper §4: d_ff); 0 = d_ff, so model.json files
  # written before this field load unchanged. Decoding reads all (k-1)·2·d·head_hidden of these weights every
  # iteration: at head_hidden = d_ff about as much as the rest of the decoder (docs/results/benchmark.md).
  head_hidden: int = 0
  # Images: add the embedding of the co-located input sub-pixel to each decoder position's input (see
  # layers.colocated_source_index and Transformer._colocated). A DEVIATION from the paper and from the Image
  # Transformer (Parmar et al. 2018), whose decoder sees the input only through cross-attention. Default off, so
  # model.json files written before this field existed load as the faithful model.
  colocated_input: bool = False
  # Images: initialize the pixel ids' embedding rows so that nearby intensities have nearby embeddings
  # (layers.ordinal_pixel_embedding_init). Initialization only: the same parameters and computation. Not in the
  # paper (a random init; the 256 intensities are unordered classes there as in the Image Transformer).
  ordinal_pixel_init: bool = False
  # Images: add to every head's logits a Gaussian log-prior centred on the bicubic enlargement of the input at
  # the sub-pixel that head predicts, -(v - g)² / (2 sigma²) over intensities v (layers.bicubic_guess,
  # layers.intensity_prior); 0 = off. A DEVIATION from the paper and the Image Transformer: the output starts
  # as bicubic enlargement and the network learns a correction, which keeps greedy decoding anchored to the
  # input instead of drifting with its own prefix (README, Super-resolution, "Output prior").
  output_prior_sigma: float = 0.0
  # 'independent': the paper's heads, each predicts y_{j+i} from the decoder state at j alone. 'sequential' (not
  # in the paper; Hydra, Ankner et al. 2024): head i + 1 (i >= 1) also sees the embedding of the token proposed
  # for j + i: in training the target y_{j+i} (teacher-forced), in decoding the argmax of head i (head 1's for head
  # 2), so the heads run one after another at the last accepted position (propose). Adds (k-1)·d² parameters
  # (layers.MultiOutput, 'token_kernel'). The default keeps model.json files and checkpoints written before this
  # field: independent heads, the same parameter tree. Chains only: tree decoding refuses it (score).
  head_type: str = 'independent'
  # A truncated draft vocabulary (not in the paper; EAGLE-3, Li et al. 2025, arXiv 2503.01840; FR-Spec, Zhao et al.
  # 2025): the ids of the config.model.draft_vocab = R most frequent tokens of the training targets, ascending
  # (bpd/draft_vocab.py counts them). Heads 2..k propose among these only: their projection reads these R rows of the
  # embedding, not all V (decode_fns gathers them once per decode), and propose still returns [B, k-1, V] logits,
  # -inf outside the set.
  # Head 1, which verifies, keeps the whole vocabulary: exact decoding stays greedy's, and speculative sampling stays
  # exact (q is renormalised over the set, 0 outside it). Decoding only: no parameters, training unchanged.
  # () = off, so model.json files written before this field load unchanged.
  draft_ids: tuple[int, ...] = ()

  def __post_init__(self):
    # model.json stores a list; a tuple keeps the config hashable (a static jit argument)
    object.__setattr__(self, 'draft_ids', tuple(int(i) for i in self.draft_ids))


HEAD_TYPES = ('independent', 'sequential')
# config.decode.head_weights: the dtype in which a skinny-kernel decoder reads heads 2..k (packed_weights)
HEAD_WEIGHTS = {'float32': jnp.float32, 'float16': jnp.float16, 'int8': jnp.int8}


def model_config(size: str, vocab_size: int, k: int = 1, **overrides) -> ModelConfig:
  """A ModelConfig from a named size in SIZES, with field overrides."""
  if size not in SIZES:
    raise UserError(f'Unknown model size {size!r}: choose one of {sorted(SIZES)} (config.model.size).')
  if k < 1:
    raise UserError(f'k={k}: the number of heads must be >= 1 (config.k).')
  side, input_side = overrides.get('image_side', 0), overrides.get('image_input_side', 0)
  if (side or input_side) and not (side > 0 and input_side > 0 and side % input_side == 0):
    raise UserError(f'image_side={side}, image_input_side={input_side}: set together (both 0 for text), both > 0, '
                    'and the output side a multiple of the input side (32 and 8 for CelebA 8x8 -> 32x32).')
  if overrides.get('colocated_input', False) and not side:
    raise UserError('colocated_input=True needs image_side and image_input_side (the co-located input sub-pixel of '
                    'an output sub-pixel is defined by the two image sides): set config.model.image_positions=True '
                    'as well (configs/celeba_sr.py does), images only.')
  if overrides.get('output_prior_sigma', 0.0) < 0 or (overrides.get('output_prior_sigma', 0.0) and not side):
    raise UserError(f'output_prior_sigma={overrides["output_prior_sigma"]}: the prior is a width in intensity '
                    'levels around the bicubic enlargement of the input, images only: use 0 (off) or a value > 0 '
                    'with image_side and image_input_side set (config.model.image_positions=True).')
  if overrides.get('head_type', 'independent') not in HEAD_TYPES:
    raise UserError(f'head_type={overrides["head_type"]!r}: choose one of {HEAD_TYPES} (config.model.head_type).')
  draft_ids = tuple(overrides.get('draft_ids', ()))
  if draft_ids and not (len(draft_ids) < vocab_size and list(draft_ids) == sorted(set(draft_ids))
                        and 0 <= draft_ids[0] and draft_ids[-1] < vocab_size):
    raise UserError(f'draft_ids: {len(draft_ids)} ids must be distinct, ascending, fewer than vocab_size={vocab_size} '
                    'and inside it (bpd/draft_vocab.py counts them; set config.model.draft_vocab, not the ids).')
  if overrides.get('attention_block', 0) < 0:
    raise UserError(f'attention_block={overrides["attention_block"]}: use 0 (full causal self-attention) or a '
                    'block size W > 0 (local attention) (config.model.attention_block).')
  return ModelConfig(vocab_size=vocab_size, k=k, **{**SIZES[size], **overrides})


class Transformer(nn.Module):
  """Pre-LayerNorm encoder-decoder with one shared embedding for source, target and output projection."""
  config: ModelConfig

  def setup(self):
    c = self.config
    dtype = jnp.dtype(c.dtype)
    init = nn.initializers.normal(c.d_model**-0.5)
    if c.ordinal_pixel_init:
      init = layers.ordinal_pixel_embedding_init(init)
    self.embed = nn.Embed(c.vocab_size, c.d_model, embedding_init=init)
    self.encoder_layers = [
        layers.EncoderLayer(c.num_heads, c.d_model, c.d_ff, c.dropout_rate, c.attention_dropout_rate, dtype)
        for _ in range(c.num_encoder_layers)]
    self.encoder_norm = nn.LayerNorm(dtype=dtype)
    self.decoder_layers = [
        layers.DecoderLayer(c.num_heads, c.d_model, c.d_ff, c.dropout_rate, c.attention_dropout_rate, dtype,
                            attention_block=c.attention_block)
        for _ in range(c.num_decoder_layers)]
    self.decoder_norm = nn.LayerNorm(dtype=dtype)
    self.dropout = nn.Dropout(c.dropout_rate)
    if c.k > 1:
      self.multi_output = layers.MultiOutput(c.k - 1, c.d_model, c.head_hidden or c.d_ff, dtype,
                                             sequential=c.head_type == 'sequential')

  # -- pieces shared by training and decoding --------------------------------------------------------------

  def _embed(self, tokens_BxT, positions_BxT, deterministic, is_source=False, src_BxS=None):
    c = self.config
    # Decoding under the skinny kernel takes the rows with the library's gather (matmul.take_rows): XLA's CPU
    # backend fused the gather of a few decoding rows with the ops below and split it over threads. Elsewhere the
    # barrier is meant to keep it out of that fusion. Both are identities: values and gradients are unchanged.
    rows_BxTxD = matmul.take_rows(self.embed.embedding, tokens_BxT) if not self.is_initializing() else None
    if rows_BxTxD is None:
      rows_BxTxD = jax.lax.optimization_barrier(self.embed(tokens_BxT))
    x = rows_BxTxD * jnp.sqrt(float(c.d_model))
    if c.colocated_input and not is_source:
      x = x + self._colocated(src_BxS, positions_BxT)
    if c.image_side:
      # Image Transformer (Parmar et al. 2018, §3.2): half the dimensions encode the row, half the column and
      # channel. Input pixels sit at their centres in target-pixel units, so the encoder position of an input
      # sub-pixel is close to those of the 4x4 target sub-pixels it covers: cross-attention to the co-located
      # input starts out easy. (At equal CPU settings, 2D positions lowered the val loss a little, 4.57 -> 4.47,
      # and both tiny models still collapsed: README, Super-resolution.)
      side = c.image_input_side if is_source else c.image_side
      x = x + layers.image_positions(positions_BxT, side, c.image_side // side, c.d_model)
    else:
      x = x + layers.sinusoidal_positions(positions_BxT, c.d_model)
    return self.dropout(x.astype(jnp.dtype(self.config.dtype)), deterministic=deterministic)

  def _colocated(self, src_BxS, positions_BxT):
    """The shared embedding of the input sub-pixel co-located with each target position: [B, T, D].

    Deviation from the paper (config.colocated_input): the Image Transformer (Parmar et al. 2018) feeds the
    decoder only the previous output sub-pixel and reaches the input through cross-attention. A tiny model
    trained for minutes on CPU never found the co-located input that way and collapsed to one intensity
    (README, Super-resolution). Here the input sub-pixel that covers the output sub-pixel is in the residual
    stream from the start, and with the output projection tied to the embedding the decoder starts out close
    to nearest-neighbour enlargement: it only has to learn a correction. (On CPU that was not enough: greedy
    decoding still followed its own prefix and collapsed, README, Super-resolution, "Co-located input".)

    Which sub-pixel: the decoder input at position p is the PREVIOUS target token y_{p-1} (BOS at p = 0), and
    head 1's output at p predicts y_p. The useful conditioning is the input under y_p, the sub-pixel being
    predicted, so position p gets the co-located input of target index p (not p - 1). It depends only on the
    source and on p, never on the outputs, so it leaves causality and blockwise verification intact.
    """
    c = self.config
    num_src = c.image_input_side * c.image_input_side * 3
    if src_BxS is None or src_BxS.shape[1] != num_src:
      raise UserError(f'colocated_input: the source must be the {c.image_input_side}x{c.image_input_side}x3 input '
                      f'image as {num_src} sub-pixel ids, got shape '
                      f'{None if src_BxS is None else tuple(src_BxS.shape)}.')
    index_BxT = layers.colocated_source_index(positions_BxT, c.image_side, c.image_input_side)
    # Positions past the image (blockwise decoding scores up to k positions beyond max_len, outputs discarded)
    # would map below the input image: clip them to a valid id instead of reading out of bounds.
    index_BxT = jnp.clip(index_BxT, 0, num_src - 1)
    colocated_BxT = jnp.take_along_axis(src_BxS, index_BxT, axis=1)
    return self.embed(colocated_BxT) * jnp.sqrt(float(c.d_model))

  def logits(self, hidden_Bx___xD):
    """The shared vocabulary projection (tied to the embedding). Returns [..., V] float32, accumulated in float32
    from the embedding's own dtype: a bfloat16 decode (params_in_compute_dtype) reads its bfloat16 embedding, not a
    float32 copy of it, as the vocabulary projections are a large share of a decoding step's bytes."""
    embedding_VxD = self.embed.embedding
    # A skinny-kernel decoder reads the packed transpose (packed_weights): greedy and verification alike, so that
    # both sum each logit in the same order.
    return matmul.dense_nt(hidden_Bx___xD, embedding_VxD, packed=layers.packed(self, 'logits_DxV'))

  def encode(self, src_BxS, deterministic=True):
    """Encoder output [B, S, D]. Source id 0 is padding."""
    positions = jnp.broadcast_to(jnp.arange(src_BxS.shape[1]), src_BxS.shape)
    x = self._embed(src_BxS, positions, deterministic, is_source=True)
    mask_BxSxS = jnp.broadcast_to((src_BxS > 0)[:, None, :], src_BxS.shape + src_BxS.shape[1:])
    for layer in self.encoder_layers:
      x = layer(x, mask_BxSxS, deterministic)
    return self.encoder_norm(x)

  def decode_hidden(self, enc_BxSxD, src_BxS, tgt_in_BxT, deterministic=True):
    """Decoder output [B, T, D] for a whole (BOS-shifted) target at once, causally masked (locally with
    config.attention_block > 0)."""
    length = tgt_in_BxT.shape[1]
    positions = jnp.broadcast_to(jnp.arange(length), tgt_in_BxT.shape)
    x = self._embed(tgt_in_BxT, positions, deterministic, src_BxS=src_BxS)
    if self.config.attention_block:
      causal_BxTxT = None  # Local attention masks block by block: no T x T array (3072² for an image).
    else:
      causal_BxTxT = jnp.broadcast_to(jnp.tril(jnp.ones((length, length), bool)), (x.shape[0], length, length))
    cross_BxTxS = jnp.broadcast_to((src_BxS > 0)[:, None, :], (x.shape[0], length, src_BxS.shape[1]))
    for layer in self.decoder_layers:
      x = layer(x, enc_BxSxD, causal_BxTxT, cross_BxTxS, deterministic)
    return self.decoder_norm(x)

  def head_hidden(self, hidden_Bx___xD, previous_Bx___xKm1=None):
    """The pre-projection vectors of all k heads: [..., k, D]; head 1 is the decoder output itself.

    previous_Bx___xKm1 (head_type='sequential' only): the token ids fed to heads 2..k (`previous_tokens`).
    """
    heads = hidden_Bx___xD[..., None, :]
    if self.config.k > 1:
      previous = None if previous_Bx___xKm1 is None else self.token_embedding(previous_Bx___xKm1)
      heads = jnp.concatenate([heads, self.multi_output(hidden_Bx___xD, previous)], axis=-2)
    return heads

  def token_embedding(self, tokens_Bx___):
    """The shared embedding of tokens fed to sequential heads, at the decoder input's scale, no position: [..., D].
    A skinny-kernel decoder takes the rows with the library's gather, as `_embed` does (the same values)."""
    rows = None if self.is_initializing() else matmul.take_rows(self.embed.embedding, tokens_Bx___)
    return (self.embed(tokens_Bx___) if rows is None else rows) * jnp.sqrt(float(self.config.d_model))

  def _sequential(self):
    return self.config.k > 1 and self.config.head_type == 'sequential'

  def __call__(self, src_BxS, tgt_in_BxT, deterministic=True, head_tokens_BxT=None):
    """Logits of every head at every target position: [B, T, k, V]. Head i at position t predicts y_{t+i}.

    head_type='sequential': head i + 1 at t is fed y_{t+i} (teacher forcing), read from head_tokens_BxT, the
    target in tgt_in's layout (BOS first); default tgt_in itself (pass the clean one when tgt_in is noisy).
    """
    enc = self.encode(src_BxS, deterministic)
    hidden = self.decode_hidden(enc, src_BxS, tgt_in_BxT, deterministic)
    previous = None
    if self._sequential():
      previous = previous_tokens(tgt_in_BxT if head_tokens_BxT is None else head_tokens_BxT, self.config.k - 1)
    logits_BxTxKxV = self.logits(self.head_hidden(hidden, previous))
    if self.config.output_prior_sigma:
      positions_BxT = jnp.broadcast_to(jnp.arange(tgt_in_BxT.shape[1]), tgt_in_BxT.shape)
      offsets_K = jnp.arange(self.config.k)
      logits_BxTxKxV += self._prior(self._guess(src_BxS), positions_BxT[..., None] + offsets_K)
    return logits_BxTxKxV

  def one_head_logits(self, src_BxS, tgt_in_BxT, head, deterministic=True, head_tokens_BxT=None):
    """Logits of head `head` + 1 alone at every target position: [B, T, V] (head 0-based, may be traced).

    The sampled-head loss (head_loss='random', paper §6) trains one head per step: this projects that head
    onto the vocabulary once instead of projecting all k heads and keeping one. head_tokens_BxT: as __call__.
    """
    enc = self.encode(src_BxS, deterministic)
    hidden_BxTxD = self.decode_hidden(enc, src_BxS, tgt_in_BxT, deterministic)
    positions_BxT = jnp.broadcast_to(jnp.arange(tgt_in_BxT.shape[1]), tgt_in_BxT.shape)
    prior = self._prior(self._guess(src_BxS), positions_BxT + head) if self.config.output_prior_sigma else 0.0
    if self.config.k == 1:
      return self.logits(hidden_BxTxD) + prior
    # Head 1 is the decoder output itself; heads 2..k pass through their slice of the multi-output layer. The
    # drawn head's slice is computed either way (d·d_ff work, small) and selected: one vocabulary projection.
    previous = None
    if self._sequential():  # head + 1 (0-based head >= 1) at t is fed y_{t+head} = tgt_in[t + head]
      tokens_BxT = tgt_in_BxT if head_tokens_BxT is None else head_tokens_BxT
      padded_BxT = jnp.pad(tokens_BxT, ((0, 0), (0, self.config.k - 1)))
      previous = self.token_embedding(jax.lax.dynamic_slice_in_dim(padded_BxT, jnp.maximum(head, 1),
                                                                   tokens_BxT.shape[1], axis=1))
    proposal_BxTxD = self.multi_output.one_head(hidden_BxTxD, jnp.maximum(head - 1, 0), previous)
    return self.logits(jnp.where(head == 0, hidden_BxTxD, proposal_BxTxD.astype(hidden_BxTxD.dtype))) + prior

  def _prior(self, guess_BxP, positions_Bx___):
    """The output prior (config.output_prior_sigma) of the sub-pixels at target positions [B, ...]: [B, ..., V].

    guess_BxP: the bicubic enlargement of each row's input, [B, side * side * 3] (layers.bicubic_guess; decoding
    computes it once per image, in init_decode_state). Target position p is the sub-pixel head 1 predicts at p
    (head i at p predicts p + i - 1). The guess depends only on the source and the position, never on the outputs, so
    blockwise verification stays exact. Positions past the image (blockwise scoring beyond max_len) are clipped
    to its last sub-pixel.
    """
    c = self.config
    index = jnp.clip(positions_Bx___, 0, guess_BxP.shape[1] - 1).reshape(positions_Bx___.shape[0], -1)
    guess_Bx___ = jnp.take_along_axis(guess_BxP, index, axis=1).reshape(positions_Bx___.shape)
    return layers.intensity_prior(guess_Bx___, c.output_prior_sigma, c.vocab_size)

  def _guess(self, src_BxS):
    c = self.config
    return layers.bicubic_guess(src_BxS, c.image_side, c.image_input_side)

  # -- decoding with the per-row cache ---------------------------------------------------------------------

  def init_decode_state(self, src_BxS, cache_len: int):
    """Runs the encoder once; returns the decoder state pytree (every leaf has leading dim B)."""
    enc = self.encode(src_BxS)
    state = {
        'src_mask_BxS': src_BxS > 0,
        'layers': tuple(layer.init_cache(enc, cache_len) for layer in self.decoder_layers),
    }
    if self.config.colocated_input:
      state['src_BxS'] = src_BxS  # score looks up the co-located input sub-pixel of each new position
    if self.config.output_prior_sigma:
      state['guess_BxP'] = self._guess(src_BxS)  # once per image, not per call: the prior's centres
    return state

  def score(self, state, tokens_BxT, start_B, tree=None):
    """Feeds T tokens per row at positions start_B[b] .. start_B[b] + T - 1 (start_B [B], or [] for all rows).

    Returns (head-1 logits [B, T, V], decoder output [B, T, D], new state). Only head 1 is projected
    onto the vocabulary here: verification needs nothing else (DESIGN §3, no k² projections).
    tree = (depth_N, ancestor_NxN) numpy, or per row (depth_BxN, ancestor_BxNxN) (bpd/decoding.py, Layout.mask / RowTree.mask): the
    T = N tokens are the nodes of a candidate tree, in slots start_B[b] + n at positions start_B[b] + depth[n], each
    attending to the prefix and its own ancestors only (layers.tree_self_mask). A separate branch: without a tree
    nothing changes.
    """
    # A static tree is one depth vector [N] for every row, a per-row tree [B, N] (the shapes layers.tree_* read).
    if tree is not None and self._sequential() and tree[0].ndim == 1:
      raise UserError(SEQUENTIAL_TREES)  # a static tree's nodes come from propose (one path); per-row: `expand`
    num_new = tokens_BxT.shape[1]
    if tree is None:
      positions_BxT = layers.query_positions(start_B, tokens_BxT.shape[0], num_new)
    else:
      positions_BxT = layers.tree_positions(start_B, tokens_BxT.shape[0], tree[0])
    x = self._embed(tokens_BxT, positions_BxT, deterministic=True, src_BxS=state.get('src_BxS'))
    src_mask = state['src_mask_BxS']
    cross_BxTxS = jnp.broadcast_to(src_mask[:, None, :], (x.shape[0], num_new, src_mask.shape[1]))
    new_layers = []
    for layer, cache in zip(self.decoder_layers, state['layers']):
      x, cache = layer.extend(x, cache, start_B, cross_BxTxS, tree)
      new_layers.append(cache)
    hidden_BxTxD = self.decoder_norm(x)
    new_state = dict(state, layers=tuple(new_layers))
    if not self.config.output_prior_sigma:
      return self._with_first(self.logits(hidden_BxTxD), hidden_BxTxD, new_state)
    # The output prior: head 1 at position p predicts p; heads 2..k from there predict p + 1 .. p + k - 1, whose
    # priors travel with the hidden state to `propose` (the decode loop treats `hidden` as an opaque pytree).
    prior_BxTxKxV = self._prior(state['guess_BxP'], positions_BxT[..., None] + jnp.arange(self.config.k))
    hidden = {'hidden_BxTxD': hidden_BxTxD, 'prior_BxTxKm1xV': prior_BxTxKxV[:, :, 1:]}
    return self._with_first(self.logits(hidden_BxTxD) + prior_BxTxKxV[:, :, 0], hidden, new_state)

  def _with_first(self, logits_BxTxV, hidden, new_state):
    """score's outputs; with sequential heads `hidden` also carries head 1's argmax at every new position.

    Why here: head 2 is fed the token head 1 proposes at the last accepted position, and the decode loop hands
    propose only the hidden state of that position (bpd/decoding.py `_proposals`; its interface stays
    propose_fn(hidden)). It is the decode loop's own ŷ_{j+1}: the loop's argmax (`decoding.argmax`, ties to the
    lower id) of the same logits, so XLA computes it once for both. jnp.argmax here was a second, multi-threaded
    (value, index) reduction over [B, T, V] that XLA's CPU backend ran slower than the library's argmax.
    """
    if not self._sequential():
      return logits_BxTxV, hidden, new_state
    hidden = hidden if isinstance(hidden, dict) else {'hidden_BxTxD': hidden}
    return logits_BxTxV, dict(hidden, first_BxT=decoding.argmax(logits_BxTxV)), new_state

  def propose(self, hidden_BxD, split=None, draft_RxD=None):
    """Logits of heads 2..k at one position per row: [B, k-1, V]. (To decode with fewer heads, `first_heads`.)

    split: sequential heads' weights cut once per decode (`split_sequential_heads`; decode_fns passes them).
    draft_RxD: with a draft vocabulary (config.draft_ids), its R rows of the embedding, gathered once per decode
    (`draft_rows`; decode_fns passes them). Without it they are gathered here.
    """
    return self.propose_choices(hidden_BxD, split, draft_RxD)[0]

  def propose_choices(self, hidden_BxD, split=None, draft_RxD=None):
    """`propose`'s logits [B, k-1, V] and their argmaxes [B, k-1] (int32, ties to the lower id), where the heads
    take them anyway: sequential heads feed each head the one before's; with a draft vocabulary the argmax is taken
    over the R logits and mapped to its id. A chain drafts the argmaxes alone (decoding.Proposal), and XLA then
    drops the spread of R logits to V and an argmax over V per head. Elsewhere the argmaxes are of the logits."""
    if self._sequential():
      return self._propose_sequential(hidden_BxD, self.config.k, split, draft_RxD)
    prior_BxKm1xV = None
    if isinstance(hidden_BxD, dict):  # with config.output_prior_sigma (score)
      hidden_BxD, prior_BxKm1xV = hidden_BxD['hidden_BxTxD'], hidden_BxD['prior_BxTxKm1xV']
    vectors_BxKm1xD = self.multi_output(hidden_BxD)
    if not self.config.draft_ids:
      logits_BxKm1xV = self._heads_logits(vectors_BxKm1xD, prior_Bx___xV=prior_BxKm1xV)
      return logits_BxKm1xV, decoding.argmax(logits_BxKm1xV)
    draft_RxD = self._draft_rows() if draft_RxD is None else draft_RxD
    logits_BxKm1xR = self._heads_logits(vectors_BxKm1xD, draft_RxD, prior_BxKm1xV)
    return (spread_draft_logits(logits_BxKm1xR, self.config.draft_ids, self.config.vocab_size),
            _draft_ids(self.config.draft_ids)[decoding.argmax(logits_BxKm1xR)])

  def _draft_rows(self):
    """The draft vocabulary's rows of the shared embedding [R, D] (`draft_rows`, from inside the module)."""
    return jnp.take(self.embed.embedding, np.asarray(self.config.draft_ids, np.int32), axis=0)

  def _heads_logits(self, vector_Bx___xD, draft_RxD=None, prior_Bx___xV=None):
    """Independent heads' projection, float32 as `logits`: [..., V], or [..., R] onto the draft vocabulary (config.
    draft_ids; draft_RxD its embedding rows, R rows read, not V). A skinny-kernel decoder reads the heads' own
    packed projection (packed_weights: in decode.head_weights), as the sequential heads do; elsewhere the tied
    embedding. The output prior (images) is read at the draft ids."""
    draft = self.config.draft_ids
    packed = layers.packed(self, f'heads_projection_{len(draft) if draft else self.config.vocab_size}')
    if packed is not None:
      rows_XxD = draft_RxD if draft else self.embed.embedding
      logits_Bx___xX = matmul.dense(vector_Bx___xD, rows_XxD.T, preferred_element_type=jnp.float32, packed=packed)
    else:
      logits_Bx___xX = matmul.dense_nt(vector_Bx___xD, draft_RxD) if draft else self.logits(vector_Bx___xD)
    if prior_Bx___xV is not None:
      logits_Bx___xX = logits_Bx___xX + (jnp.take(prior_Bx___xV, np.asarray(draft), axis=-1) if draft
                                         else prior_Bx___xV)
    return logits_Bx___xX

  def expand(self, hidden, depth: int, parents_BxW, split=None, draft_RxD=None):
    """Sequential head depth + 1 (depth >= 1, static) at one position per row, fed each of W parent tokens (the
    tokens a context-aware tree holds at depth - 1; bpd/decoding.py, Dynamic): logits [B, W, V] of the children of
    each parent, every parent with its own (EAGLE-2's expansion, with our heads in place of EAGLE's drafter).
    The W runs are one batched step: a [B·W, d] x [d, d_ff] head and one [B·W, d] x [d, V] (or [d, R]) projection.
    split, draft_RxD: as propose's."""
    if not self._sequential():
      raise ValueError('expand runs sequential heads; independent heads give every parent the same choices (propose)')
    hidden_BxD = hidden['hidden_BxTxD']
    prior_BxKm1xV = hidden.get('prior_BxTxKm1xV')
    prior_Bx1xV = None if prior_BxKm1xV is None else prior_BxKm1xV[:, depth - 1, None]
    logits_BxWxX = self._sequential_head(hidden_BxD[:, None], depth - 1, parents_BxW, split, draft_RxD, prior_Bx1xV)
    if self.config.draft_ids:
      return spread_draft_logits(logits_BxWxX, self.config.draft_ids, self.config.vocab_size)
    return logits_BxWxX

  def _sequential_head(self, hidden_Bx___xD, n: int, token_Bx___, split, draft_RxD, prior_Bx___xV):
    """Head n + 2's logits fed token_Bx___ (an id per row, or per row and parent): [..., X], X = R with a draft
    vocabulary (config.draft_ids; the prior read at its ids), else V. The tied projection reads the transposed
    embedding that `split` holds when decode_fns passes it (cut once per decode)."""
    weights = None if split is None else split['heads'][n]
    vector_Bx___xD = self.multi_output.one_head(hidden_Bx___xD, n, self.token_embedding(token_Bx___), weights)
    draft = self.config.draft_ids
    # A skinny-kernel decoder's packed projection (packed_weights), named by its columns: V, or R with a draft
    # vocabulary made for this model's draft_ids. None elsewhere: the kernel reads the unpacked [D, X] matrix.
    columns = len(draft) if draft else self.config.vocab_size
    packed = layers.packed(self, f'heads_projection_{columns}')
    if draft:  # the [d, R] projection, cut once per decode when split comes from decode_fns
      draft_DxR = split['draft_DxR'] if split is not None else (
          self._draft_rows() if draft_RxD is None else draft_RxD).T
      logits = matmul.dense(vector_Bx___xD.astype(draft_DxR.dtype), draft_DxR, preferred_element_type=jnp.float32,
                            packed=packed)
      prior_Bx___xV = None if prior_Bx___xV is None else jnp.take(prior_Bx___xV, np.asarray(draft, np.int32), axis=-1)
    elif split is None:
      logits = self.logits(vector_Bx___xD)
    else:  # the tied projection, with the [D, V] transpose made once per decode rather than once per head
      embedding_DxV = split['embedding_DxV']
      logits = matmul.dense(vector_Bx___xD.astype(embedding_DxV.dtype), embedding_DxV,
                            preferred_element_type=jnp.float32, packed=packed)
    return logits if prior_Bx___xV is None else logits + prior_Bx___xV

  def _propose_sequential(self, hidden, heads, split=None, draft_RxD=None):
    """Sequential heads (head_type='sequential'; Hydra, Ankner et al. 2024) at one position per row: head 2 is fed
    head 1's argmax (hidden['first_BxT'], from score), head n + 2 the argmax of head n + 1. [B, k'-1, V].

    k' - 1 small steps in sequence (a Python loop, unrolled at trace time: k' is static), each a [B, d] x [d, d_ff]
    head and a [B, d] x [d, V] projection; the independent heads do the same work as one batched step. A
    skinny-kernel decoder runs the k' - 1 steps in one library call instead (decode.fused_heads;
    MultiOutput.fused_chain), where no output prior is added: the same products, one kernel launch. All of
    it runs inside the one model invocation of the iteration, after verification (paper §4's combined step).
    The proposals are argmaxes, as the decode loop's (ties to the lower id). split: the per-head weights and the
    transposed embedding, cut outside the decoding loop (`split_sequential_heads`; decode_fns passes them).
    With a draft vocabulary (config.draft_ids) each step's projection is [d, R] instead, and its argmax is taken
    over the R logits: the ids ascend, so ties still go to the lower id.
    """
    hidden_BxD, token_B = hidden['hidden_BxTxD'], hidden['first_BxT']
    prior_BxKm1xV = hidden.get('prior_BxTxKm1xV')
    draft = self.config.draft_ids
    if prior_BxKm1xV is None:  # a skinny-kernel decoder runs the k' - 1 heads in one library call
      columns = len(draft) if draft else self.config.vocab_size
      fused = self.multi_output.fused_chain(
          hidden_BxD, token_B, self.embed.embedding, draft, layers.packed(self, f'heads_projection_{columns}'),
          heads - 1, float(np.sqrt(np.float32(self.config.d_model))))
      if fused is not None:
        logits_BxKm1xX, tokens_BxKm1 = fused
        if draft:
          return spread_draft_logits(logits_BxKm1xX, draft, self.config.vocab_size), tokens_BxKm1
        return logits_BxKm1xX, tokens_BxKm1
    logits, tokens = [], []
    for n in range(heads - 1):
      prior_BxV = None if prior_BxKm1xV is None else prior_BxKm1xV[:, n]
      logits_BxX = self._sequential_head(hidden_BxD, n, token_B, split, draft_RxD, prior_BxV)  # X: R or V
      choice_B = decoding.argmax(logits_BxX)  # the loop's own argmax: the choice it would take from these logits
      token_B = _draft_ids(draft)[choice_B] if draft else choice_B
      logits.append(logits_BxX)
      tokens.append(token_B)
    logits_BxKm1xX, tokens_BxKm1 = jnp.stack(logits, axis=1), jnp.stack(tokens, axis=1)
    if draft:  # one spread of all k' - 1 heads' logits: a V-float write per head (where anything reads them)
      return spread_draft_logits(logits_BxKm1xX, draft, self.config.vocab_size), tokens_BxKm1
    return logits_BxKm1xX, tokens_BxKm1


def _draft_ids(draft_ids) -> jax.Array:
  """The draft vocabulary's ids [R] (ascending: an argmax over R, ties to the lower index, is the lower id)."""
  return jnp.asarray(np.asarray(draft_ids, np.int32))


def spread_draft_logits(logits_Bx___xR, draft_ids, vocab_size: int) -> jax.Array:
  """Full-vocabulary logits [..., V] from a draft vocabulary's (config.draft_ids): each draft logit at its id, -inf
  at every other id, so that the decode loops read propose_fn's [B, k-1, V] as before: an argmax or top-r is a
  draft id, and q = softmax(logits / T) is renormalised over the draft ids, 0 elsewhere (bpd/draft_vocab.py). One
  gather of V floats per vector from the R logits and a -inf slot (the ids are static), no weights read."""
  slot_V = np.full(vocab_size, len(draft_ids), np.int32)  # the -inf slot ...
  slot_V[np.asarray(draft_ids, np.int32)] = np.arange(len(draft_ids), dtype=np.int32)  # ... except at draft ids
  padded = jnp.concatenate([logits_Bx___xR, jnp.full(logits_Bx___xR.shape[:-1] + (1,), -jnp.inf,
                                                     logits_Bx___xR.dtype)], axis=-1)
  return jnp.take(padded, slot_V, axis=-1)


def draft_rows(params: Any, config: ModelConfig) -> jax.Array | None:
  """The draft vocabulary's rows of the shared embedding, [R, D] in its own dtype (None without one): gathered once
  per decode, outside its loop (decode_fns), so that an iteration reads R rows, not V, and no gather."""
  if not config.draft_ids:
    return None
  return jnp.take(params['embed']['embedding'], np.asarray(config.draft_ids, np.int32), axis=0)


SEQUENTIAL_TREES = (
    'Static trees (config.decode.trees such as comb:2, dense:2, nodes:N or a path list) are not available with '
    'model.head_type=sequential. A static tree gives every node at depth d the ranked choices of head d + 1, shared '
    'by all its parents, but a sequential head\'s choices depend on the token of the node it continues. Use '
    '\'dynamic:N\' (a context-aware tree: each parent is expanded by running the next head from its own token), '
    '\'chain\', or a model with independent heads.')


def split_sequential_heads(params: Any, num_heads: int, draft_RxD=None) -> dict:
  """What sequential proposal heads read in decoding, cut once per decode, outside its loop (decode_fns): each
  head's slices of the multi-output layer's [N, ...] parameters, and the embedding transposed to [D, V] for the
  tied projection (with a draft vocabulary, its rows `draft_rows` transposed to [D, R] instead). Inside the loop
  XLA's CPU backend copied these on every iteration (layers.MultiOutput.one_head).
  """
  heads = params['multi_output']
  names = ('wi_kernel', 'wi_bias', 'wo_kernel', 'wo_bias', 'token_kernel')
  split = {'heads': [{name: heads[name][n] for name in names} for n in range(num_heads - 1)]}
  if draft_RxD is not None:
    return dict(split, draft_DxR=draft_RxD.T)
  return dict(split, embedding_DxV=params['embed']['embedding'].T)  # in its own dtype, as Transformer.logits reads it


def packed_weights(params: Any, head_weights: str = 'float32', draft_ids: tuple[int, ...] = ()) -> dict:
  """The weights the skinny kernel reads in its packed layout (matmul.pack), in the 'packed' collection's tree
  (the same paths as params, weights only): every Dense kernel as the [K, N] matrix it multiplies by (attention's
  query, key and value [D, H, K] as [D, H·K], 'out' [H, K, D] as [H·K, D]) and the multi-output layer's per-head
  kernels [n, K, N]; with heads, also 'heads_projection_X', the [D, X] projection of heads 2..k (the embedding's
  rows transposed: X = V, or the draft vocabulary's R with draft_ids); and 'logits_DxV', head 1's
  projection (`logits`), the float32 embedding transposed. Made once per decoder and parameters, outside the
  jitted decoders (bpd/decoder.py).

  head_weights='float16' (config.decode.head_weights) packs the multi-output layer's kernels and the heads'
  projection in half precision: heads 2..k only propose, and verification (head 1, float32) decides what is
  accepted, so exact decoding stays identical to greedy while the heads read half the bytes. Not the paper's.
  head_weights='int8' packs them as int8 with a float32 scale per column (matmul.pack): a quarter of the bytes, the
  proposals a little further from the float32 heads', exact decoding still identical to greedy.
  """
  head_dtype = HEAD_WEIGHTS[head_weights]
  def walk(tree, name):
    if not isinstance(tree, dict):
      return None
    out = {}
    for key, value in tree.items():
      if isinstance(value, dict):
        sub = walk(value, key)
        if sub:
          out[key] = sub
      elif key == 'kernel':
        matrix = value.reshape(-1, value.shape[-1]) if name == 'out' else value.reshape(value.shape[0], -1)
        out[key] = matmul.pack(matrix)
      elif name == 'multi_output' and key in ('wi_kernel', 'wo_kernel', 'token_kernel'):
        out[key] = matmul.pack(value, head_dtype)
    return out
  out = walk(params, '')
  embedding_VxD = params['embed']['embedding']
  if embedding_VxD.dtype == jnp.float32:
    out['logits_DxV'] = matmul.pack(embedding_VxD.T)
  if 'multi_output' in params:  # heads 2..k's projection, after the multi-output layer
    rows_XxD = embedding_VxD
    if draft_ids:
      rows_XxD = jnp.take(rows_XxD, np.asarray(draft_ids, np.int32), axis=0)
    same = not draft_ids and head_dtype == jnp.float32 and 'logits_DxV' in out
    out[f'heads_projection_{rows_XxD.shape[0]}'] = out['logits_DxV'] if same else matmul.pack(rows_XxD.T, head_dtype)
  return out


def previous_tokens(tgt_in_BxT: jax.Array, num: int) -> jax.Array:
  """The tokens sequential heads are fed in training (teacher forcing): [B, T, num], [:, t, n] = tgt_in[:, t + n + 1].

  tgt_in[:, p] = y_p (y_0 = BOS). Head n + 2 at position t predicts y_{t+n+2} and is fed the token proposed for
  the position before, y_{t+n+1}; 0 (padding) past the end, where that head has no target either.
  """
  length = tgt_in_BxT.shape[1]
  padded = jnp.pad(tgt_in_BxT, ((0, 0), (0, num)))
  return jnp.stack([padded[:, n + 1:n + 1 + length] for n in range(num)], axis=-1)


def init_params(config: ModelConfig, rng: jax.Array, src_len: int = 8, tgt_len: int = 8) -> dict:
  """Random parameters for `config` (the 'params' collection)."""
  model = Transformer(config)
  if config.colocated_input or config.output_prior_sigma:
    src_len = config.image_input_side * config.image_input_side * 3  # the only source length it accepts
  src = jnp.ones((1, src_len), jnp.int32)
  tgt = jnp.ones((1, tgt_len), jnp.int32)
  return model.init(rng, src, tgt)['params']


def add_heads(base_params: dict, k_head_params: dict) -> dict:
  """A k-head parameter tree from a trained base: the base's parameters plus the new 'multi_output'."""
  return {**base_params, 'multi_output': k_head_params['multi_output']}


def first_heads(model: Transformer, params: Any, num_heads: int) -> tuple[Transformer, Any]:
  """(model, params) of the k'-head model made of the first k' = num_heads heads of a k-head model.

  The first k' heads of a k-head model are a k'-head model (layers.MultiOutput). decode_fns slices their weights
  here, once per decode (inside the jitted function, outside its loop): sliced inside the layer, XLA's CPU backend
  copied the kept [k'-1, d, d_ff] kernels on every iteration.
  """
  if not 1 <= num_heads <= model.config.k:
    raise UserError(f'Cannot decode with {num_heads} heads: the model has k={model.config.k}; '
                    f'choose k between 1 and {model.config.k}.')
  if num_heads in (1, model.config.k):  # k' = 1 never proposes: the multi-output layer is not called
    return model, params
  # leading axis = head; 'ln' is shared by the heads
  per_head = ('wi_kernel', 'wi_bias', 'wo_kernel', 'wo_bias', 'token_kernel')
  heads = {name: value[:num_heads - 1] if name in per_head else value
           for name, value in params['multi_output'].items()}
  return Transformer(dataclasses.replace(model.config, k=num_heads)), {**params, 'multi_output': heads}


def params_in_compute_dtype(params: Any, dtype: str) -> Any:
  """The floating parameters cast to the activation dtype (bfloat16 models), once, before a decoding loop.

  Training keeps float32 parameters and each layer casts its weights to `dtype` when it runs. Inside a decoding
  loop that cast runs on every step, and the step reads the float32 weights: compiled for TPU v5e, a `base` model
  in bfloat16 read several times its bfloat16 weights per greedy step at batch 1. Cast
  here, outside the loop, the loop reads the weights in the compute dtype. float32 models are returned unchanged.
  """
  if jnp.dtype(dtype) == jnp.float32:
    return params
  return jax.tree.map(lambda x: x.astype(dtype) if jnp.issubdtype(x.dtype, jnp.floating) else x, params)


def move_cache(state, start_B, source_BxD):
  """Tree decoding's move_fn (bpd/decoding.py): in every decoder layer's self-attention cache, slot start_B[b] +
  source_BxD[b, d] moves to slot start_B[b] + d: the accepted path of the tree, made contiguous. The keys and
  values move unchanged: each node was computed at its path position (start + depth) seeing only its
  ancestors, exactly what the chain would have computed there. Needs no parameters."""
  moved = tuple(dict(cache, k_BxHxKxL=layers.move_slots(cache['k_BxHxKxL'], start_B, source_BxD, axis=3),
                     v_BxHxLxK=layers.move_slots(cache['v_BxHxLxK'], start_B, source_BxD, axis=2))
                for cache in state['layers'])
  return dict(state, layers=moved)


def decode_fns(model: Transformer, params: Any, num_heads: int | None = None,
               packed: Any = None) -> decoding.ModelFns:
  """The model as the plain functions `bpd.decoding` takes (`decoding.ModelFns`), proposing with its first
  `num_heads` heads.

  Call inside the jitted function that decodes (with `params` a traced argument), so the parameters are
  not baked into the compiled program as constants; for bfloat16 models they are cast once here, outside the
  decoding loop (`params_in_compute_dtype`).
  Fields: init(src_BxS, cache_len), score(state, tokens_BxT, start_B, tree=None), propose(hidden_BxD),
  move (`move_cache`), and expand(hidden, depth, parents_BxW) for context-aware trees with sequential heads
  (`Transformer.expand`); None for independent heads, whose choices do not depend on the parent. A function that
  is never called is never traced, so greedy's program holds no proposal heads.
  packed: `packed_weights(params)`, for decoders traced under matmul.use('skinny') (their matmuls read it).
  """
  heads = model.config.k if num_heads is None else num_heads
  full_model = model
  model, params = first_heads(full_model, params, heads)
  variables = {'params': params_in_compute_dtype(params, model.config.dtype)}
  if packed is not None:  # its multi-output stacks are cut to the first heads as the parameters are
    variables['packed'] = first_heads(full_model, packed, heads)[1] if 'multi_output' in packed else packed

  def init_state(src_BxS, cache_len):
    return model.apply(variables, src_BxS, cache_len, method=Transformer.init_decode_state)

  def score_fn(state, tokens_BxT, start_B, tree=None):
    return model.apply(variables, state, tokens_BxT, start_B, tree, method=Transformer.score)

  # Sequential heads: their per-head weights cut here, once, not in every iteration (split_sequential_heads). A draft
  # vocabulary's embedding rows are gathered here, once, too (draft_rows).
  draft_RxD = draft_rows(variables['params'], model.config) if model.config.k > 1 else None
  sequential = model.config.k > 1 and model.config.head_type == 'sequential'
  split = split_sequential_heads(variables['params'], heads, draft_RxD) if sequential else None

  def propose_fn(hidden_BxD):
    return model.apply(variables, hidden_BxD, split, draft_RxD, method=Transformer.propose)

  def propose_choices_fn(hidden_BxD):
    return model.apply(variables, hidden_BxD, split, draft_RxD, method=Transformer.propose_choices)

  def expand_fn(hidden, depth, parents_BxW):
    return model.apply(variables, hidden, depth, parents_BxW, split, draft_RxD, method=Transformer.expand)

  # propose_choices where the heads take their argmaxes anyway (below V wide): sequential heads, a draft vocabulary.
  choices = sequential or bool(model.config.draft_ids)
  return decoding.ModelFns(score=score_fn, propose=propose_fn, move=move_cache,
                           expand=expand_fn if sequential else None, init=init_state,
                           propose_choices=propose_choices_fn if choices else None)
