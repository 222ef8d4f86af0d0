"""Jitted decoders of a checkpoint and the helpers every decoding path shares: batching, timing, names.

Used by the decode sweep (bpd/evaluate.py, both tasks), distillation and training's quick evaluations. It
imports none of them, so each can import it without an import circle (tests/test_imports.py).
"""

import dataclasses
import time

from absl import logging
import jax
import jax.numpy as jnp
import numpy as np

from bpd import decoding
from bpd import metrics
from bpd import model as model_lib
from bpd import sharding
from bpd import speculative as speculative_lib
from bpd import timing
from bpd.data import batching
from bpd.data import tokenizer as tokenizer_lib

DECODE_DIR = 'decode'
PROGRESS_EVERY_S = 30  # a progress line (with ETA) at most this often during long decodes


def cache_len(max_len: int, block: int = 0) -> int:
  """Slots of the self-attention cache for outputs of up to max_len tokens (BOS in slot 0).

  One token at a time (greedy, sampling, beam search: block = 0), a call feeds the newest token into its own slot,
  below max_len. Blockwise (block = k) and tree decoding (block = N nodes) feed a whole block after the accepted
  prefix (from slot length + 1), and a row that is done, at length max_len, is still scored with the batch: up to
  max_len + block + 1 slots (bpd/decoding.py asks for as many). Every decoder takes its cache length from here:
  too short a cache corrupts outputs silently (dynamic_update_slice clamps a start that would run past the end),
  see check_cache_len.
  """
  return max_len + block + 1


def check_cache_len(state, max_len: int, block: int = 0) -> None:
  """Raises ValueError if the decoder state's self-attention cache is shorter than decoding max_len tokens with
  blocks of `block` needs (cache_len). Reads static shapes only: free inside jit."""
  slots, needed = min(layer['v_BxHxLxK'].shape[2] for layer in state['layers']), cache_len(max_len, block)
  if slots < needed:
    raise ValueError(f'The decoder cache has {slots} slots; decoding max_len={max_len} tokens in blocks of {block} '
                     f'needs {needed} (decoder.cache_len(max_len, block)).')


class Decoder:
  """Jitted greedy, blockwise, tree, beam, sampled and speculatively sampled decoding of one model at one maximum
  output length.

  Each method takes the whole batch as a host array (the same on every process). With a `mesh`, the batch
  is split along 'data' and the outputs come back replicated, so that every process can read them all.
  """

  def __init__(self, model: model_lib.Transformer, max_len: int, mesh=None, eos_id: int = tokenizer_lib.EOS_ID):
    # eos_id=-1 (images) never matches a token: decoding always runs for max_len tokens.
    self.model, self.max_len, self.mesh, self.eos_id = model, max_len, mesh, eos_id
    out = None if mesh is None else sharding.replicated(mesh)
    self._greedy_jit = jax.jit(self._greedy, out_shardings=out)
    self._blockwise_jit = jax.jit(self._blockwise, static_argnames=('k', 'criterion'), out_shardings=out)
    self._beam_jit = jax.jit(self._beam, static_argnames=('beam_size', 'alpha'), out_shardings=out)
    self._sample_jit = jax.jit(self._sample, static_argnames=('top_k', 'top_p'), out_shardings=out)
    self._tree_jit = jax.jit(self._tree, static_argnames=('paths', 'criterion'), out_shardings=out)
    self._speculative_jit = jax.jit(self._speculative, static_argnames=('k', 'paths', 'top_k', 'top_p',
                                                                        'criterion'), out_shardings=out)
    self._first_heads_jit = jax.jit(lambda params, k: model_lib.first_heads(self.model, params, k)[1],
                                    static_argnames='k')
    self._heads_cache = {}  # k -> (the params it was cut from, their first k heads)

  def _heads(self, params, k):
    """The first k heads' parameters of `params` (model.first_heads), cut once per params and k, outside the
    jitted decoders: cut inside, every decode call (every sentence at batch 1) copied the kept slices of the
    multi-output layer, megabytes, before its loop began (experiments/profile_decode.py)."""
    if k in (1, self.model.config.k):
      return params
    cached = self._heads_cache.get(k)
    if cached is None or cached[0] is not params:
      cached = self._heads_cache[k] = (params, self._first_heads_jit(params, k=k))
    return cached[1]

  def _model(self, k):
    """The k-head model whose parameters `_heads` cut (the model itself for k = 1 or all its heads)."""
    return self.model if k in (1, self.model.config.k) else model_lib.Transformer(
        dataclasses.replace(self.model.config, k=k))

  def _put(self, src_BxS):
    return jnp.asarray(src_BxS) if self.mesh is None else sharding.shard_global_batch(src_BxS, self.mesh)

  def greedy(self, params, src_BxS):
    """(tokens_BxL, length_B)."""
    return self._greedy_jit(params, self._put(src_BxS))

  def blockwise(self, params, src_BxS, k, criterion):
    """A decoding.BlockwiseResult."""
    return self._blockwise_jit(self._heads(params, k), self._put(src_BxS), k=k, criterion=criterion)

  def sample(self, params, src_BxS, temperature: float, seed: int, top_k: int = 0, top_p: float = 1.0):
    """(tokens_BxL, length_B) drawn from the model at `temperature`, truncated to top_k / top_p (see
    sampling_score_fn; 0 and 1: off). The same seed and batch give the same samples; a row's sample depends on the
    seed and on its place in the batch."""
    return self._sample_jit(params, self._put(src_BxS), jnp.float32(temperature), jax.random.PRNGKey(seed),
                            top_k=top_k, top_p=top_p)

  def tree(self, params, src_BxS, paths, criterion):
    """A decoding.BlockwiseResult of tree decoding with the topology `paths` (decoding.check_tree), using the
    first tree_depth(paths) heads."""
    return self._tree_jit(self._heads(params, decoding.tree_depth(paths)), self._put(src_BxS), paths=paths,
                          criterion=criterion)

  def speculative(self, params, src_BxS, k: int, temperature: float, seed: int, paths=None, top_k: int = 0,
                  top_p: float = 1.0, criterion=None):
    """A decoding.BlockwiseResult of lossless speculative sampling at `temperature` (bpd/speculative.py): the
    samples follow softmax(head 1 / temperature) exactly, as `sample`'s do, with k heads drafting (paths: a tree
    with the single root (0,), speculative.check_sampling_tree; None: the chain of k). Compiled once per
    (batch shape, k, paths); temperature and seed are traced. Row b draws from fold_in(PRNGKey(seed), b): the
    same seed and batch give the same samples, and a row's samples do not depend on the other rows. top_k, top_p:
    the truncation `sample` takes, applied alike (speculative.sampling_logits). criterion: None / 'speculative'
    (token-by-token verification) or 'speculative:block' (block verification, chains only)."""
    depth = k if paths is None else decoding.tree_depth(paths)
    return self._speculative_jit(self._heads(params, depth), self._put(src_BxS), jnp.float32(temperature),
                                 jax.random.PRNGKey(seed), k=k, paths=paths, top_k=top_k, top_p=top_p,
                                 criterion=criterion)

  def beam(self, params, src_BxS, beam_size, alpha):
    """The best beam's tokens_BxL."""
    return self._beam_jit(params, self._put(src_BxS), beam_size=beam_size, alpha=alpha)

  def _init(self, init_state, src_BxS, block=0):
    state = init_state(src_BxS, cache_len(self.max_len, block))
    check_cache_len(state, self.max_len, block)
    return state

  def _greedy(self, params, src_BxS):
    init_state, score_fn, _ = model_lib.decode_fns(self.model, params, num_heads=1)
    state = self._init(init_state, src_BxS)
    tokens, length, _ = decoding.greedy(score_fn, state, batch_size=src_BxS.shape[0], max_len=self.max_len,
                                        bos_id=tokenizer_lib.BOS_ID, eos_id=self.eos_id)
    return tokens, length

  def _blockwise(self, params_k, src_BxS, k, criterion):
    init_state, score_fn, propose_fn = model_lib.decode_fns(self._model(k), params_k)
    state = self._init(init_state, src_BxS, block=k)
    return decoding.blockwise(score_fn, propose_fn, state, batch_size=src_BxS.shape[0], k=k,
                              max_len=self.max_len, bos_id=tokenizer_lib.BOS_ID, eos_id=self.eos_id,
                              criterion=criterion)

  def _sample(self, params, src_BxS, temperature, key, top_k, top_p):
    init_state, score_fn, _ = model_lib.decode_fns(self.model, params, num_heads=1)
    state = self._init(init_state, src_BxS)
    tokens, length, _ = decoding.greedy(sampling_score_fn(score_fn, key, temperature, top_k, top_p), state,
                                        batch_size=src_BxS.shape[0], max_len=self.max_len,
                                        bos_id=tokenizer_lib.BOS_ID, eos_id=self.eos_id)
    return tokens, length

  def _tree(self, params, src_BxS, paths, criterion):  # params: the first tree_depth(paths) heads (`_heads`)
    k = decoding.tree_depth(paths)
    init_state, score_fn, propose_fn = model_lib.decode_fns(self._model(k), params)
    state = self._init(init_state, src_BxS, block=len(paths))
    return decoding.tree(score_fn, propose_fn, model_lib.move_cache, state, batch_size=src_BxS.shape[0],
                         paths=paths, k=k, max_len=self.max_len, bos_id=tokenizer_lib.BOS_ID, eos_id=self.eos_id,
                         criterion=criterion)

  def _speculative(self, params, src_BxS, temperature, key, k, paths, top_k, top_p, criterion):
    depth = k if paths is None else decoding.tree_depth(paths)
    init_state, score_fn, propose_fn = model_lib.decode_fns(self._model(depth), params)  # params: `_heads`
    state = self._init(init_state, src_BxS, block=depth if paths is None else len(paths))
    return speculative_lib.speculative(score_fn, propose_fn, state, key=key, temperature=temperature,
                                       batch_size=src_BxS.shape[0], k=depth, max_len=self.max_len,
                                       bos_id=tokenizer_lib.BOS_ID, eos_id=self.eos_id, paths=paths,
                                       move_fn=model_lib.move_cache, top_k=top_k, top_p=top_p,
                                       criterion=criterion)

  def _beam(self, params, src_BxS, beam_size, alpha):
    init_state, score_fn, _ = model_lib.decode_fns(self.model, params, num_heads=1)
    state = self._init(init_state, src_BxS)
    tokens, _ = decoding.beam_search(score_fn, state, batch_size=src_BxS.shape[0], beam_size=beam_size,
                                     max_len=self.max_len, bos_id=tokenizer_lib.BOS_ID,
                                     eos_id=self.eos_id, alpha=alpha)
    return tokens[:, 0]


def sampling_score_fn(score_fn, key, temperature, top_k: int = 0, top_p: float = 1.0):
  """score_fn whose logits' argmax is a sample from softmax(logits / temperature), truncated to the top_k most
  likely tokens and to the top_p nucleus when set (speculative.sampling_logits): greedy decoding over it is
  ancestral sampling, as the Image Transformer samples its super-resolution outputs (Parmar et al. 2018, at
  temperatures 0.8 to 1.0).

  The Gumbel-max trick: argmax_v (logits_v / T + g_v), with g_v independent standard Gumbel noise, is drawn
  with probability softmax(logits / T)_v, exactly. The noise of position p is drawn from fold_in(key, p), so a
  decode is a pure function of (key, batch). For greedy's loop: one token per row per call, every row at the
  same (scalar) position.
  """
  def sampled(state, tokens_BxT, start):
    logits_BxTxV, hidden, state = score_fn(state, tokens_BxT, start)
    gumbel_BxTxV = jax.random.gumbel(jax.random.fold_in(key, start), logits_BxTxV.shape, jnp.float32)
    return speculative_lib.sampling_logits(logits_BxTxV, temperature, top_k, top_p) + gumbel_BxTxV, hidden, state
  return sampled


def source_bucket(src_ids) -> int:
  """One padded source length for a whole split (a multiple of 8): one compiled shape per setting."""
  longest = max((len(s) for s in src_ids), default=1)
  return int(-(-longest // 8) * 8)


def run_batches(fn, src_ids, batch_size, what='', bucket=None):
  """Applies fn(src_BxS) -> pytree with leading B to every batch; returns (outputs in source order, seconds).

  Every batch is padded to `bucket` source positions (default: source_bucket(src_ids)); pass the bucket of the
  examples a function was compiled for to reuse that compiled shape. Padding rows of the last batch are
  dropped. Logs progress with an ETA for long decodes.
  """
  batches = batching.eval_batches(src_ids, None, batch_size, (bucket or source_bucket(src_ids),))
  outputs = [None] * len(src_ids)
  progress = metrics.Progress(0, len(batches), what)
  start = last_report = time.perf_counter()
  for n, (indices, src) in enumerate(batches):
    out = jax.device_get(fn(src))
    for row, index in enumerate(indices):
      if index >= 0:
        outputs[index] = jax.tree.map(lambda x, row=row: x[row] if x.ndim else x, out)
    if what and time.perf_counter() - last_report > PROGRESS_EVERY_S:
      last_report = time.perf_counter()
      logging.info('%s', progress.line(n + 1))
  return outputs, time.perf_counter() - start


def setting_name(k: int, criterion, tree: str | None = None) -> str:
  """A setting in file names: 'greedy', 'k4.distance2' (a decoding.Criterion or its string), 'sample0.8' for
  the sampled setting (criterion 'sample:0.8' in records), or with a tree spec (bpd/trees.py)
  'tree-nodes32.k4.exact'."""
  if criterion is None:
    return 'greedy'
  if str(criterion).startswith('sample:'):
    return str(criterion).replace(':', '')
  name = f'k{k}.{criterion}'.replace(':', '')
  return name if tree is None else f'tree-{tree}.{name}'.replace(':', '')


def time_side_by_side(fns, src_ids, batch_size, repeats, bucket=None, what='timing'):
  """Median seconds of each fn(src_BxS) decoding the same examples, run alternately (bpd/timing.py).

  Every batch is padded to `bucket` (default: source_bucket(src_ids)); each fn first runs once, untimed, over
  exactly the timed batches, and a trace or compile inside the timed runs raises timing.RecompileError.
  Alternating the functions and taking medians keeps a changing machine load out of their ratio.
  """
  bucket = bucket or source_bucket(src_ids)
  runs = [lambda fn=fn: run_batches(fn, src_ids, batch_size, bucket=bucket)[0] for fn in fns]
  return [float(s) for s in timing.time_alternating(runs, repeats, what)]