"""Jitted decoders of a checkpoint and the helpers every decoding path shares: batching, timing, names.

Used by the decode sweep (bpd/evaluate.py, both tasks), distillation and training's quick evaluations. It
imports none of them, so each can import it without an import circle (tests/test_imports.py).
"""

import dataclasses
import functools
import time
from typing import Any

from absl import logging
import jax
import jax.numpy as jnp
import numpy as np

from bpd import decoding
from bpd import matmul
from bpd import metrics
from bpd import model as model_lib
from bpd import sharding
from bpd import speculative as speculative_lib
from bpd import timing
from bpd.data import batching
from bpd.data import tokenizer as tokenizer_lib
from bpd.errors import UserError

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


@dataclasses.dataclass(frozen=True)
class Setting:
  """One blockwise setting of a decode sweep: an acceptance rule over a tree (bpd/decoding.py's one loop).

  rule: a decoding.Criterion or a speculative.Sampling; tree: a decoding.Layout (the chain of k: `chain(k)`) or a
  decoding.Dynamic; spec: the tree spec as config.decode.trees writes it ('chain' for the paper's); drafter: what
  proposes, decoding.HEADS (the model's heads) or another drafter of bpd/drafters.py.
  """
  rule: Any
  tree: Any
  spec: str = 'chain'
  drafter: Any = decoding.HEADS

  @property
  def k(self) -> int:
    """The heads the setting uses: the tree's depth."""
    return self.tree.depth

  @property
  def name(self) -> str:
    """The setting in file names (`setting_name`)."""
    name = setting_name(self.k, self.rule, None if self.spec == 'chain' else self.spec)
    return name if self.drafter == decoding.HEADS else f'{name}.{self.drafter}'.replace(':', '')


class Decoder:
  """Jitted greedy, blockwise (chains, trees, speculative sampling: one entry), beam and sampled decoding of one model
  at one maximum output length. Every method but `beam` returns a decoding.DecodeResult.

  Each method takes the whole batch as a host array (the same on every process). With a `mesh`, the batch
  is split along 'data' and the outputs come back replicated, so that every process can read them all.
  """

  def __init__(self, model: model_lib.Transformer, max_len: int, mesh=None, eos_id: int = tokenizer_lib.EOS_ID,
               matmul_kernel: str = 'auto', head_weights: str = 'int8', fused_heads: bool = True):
    # eos_id=-1 (images) never matches a token: decoding always runs for max_len tokens.
    self.model, self.max_len, self.mesh, self.eos_id = model, max_len, mesh, eos_id
    # 'xla' or 'skinny' (bpd/matmul.py): every program of this decoder is traced with it, so each jitted method
    # below compiles under one setting.
    self.matmul_kernel = matmul.resolve(matmul_kernel, mesh)
    # fused_heads (config.decode.fused_heads; skinny only): sequential heads 2..k' in one library call per iteration.
    traced = functools.partial(matmul.traced, kernel=self.matmul_kernel, fused_heads=fused_heads)
    if head_weights not in model_lib.HEAD_WEIGHTS:
      raise UserError(f'head_weights={head_weights!r}: choose one of {tuple(model_lib.HEAD_WEIGHTS)} '
                      '(config.decode.head_weights).')
    out = None if mesh is None else sharding.replicated(mesh)
    self._greedy_jit = jax.jit(traced(self._greedy), out_shardings=out)
    # The rule is an argument (a pytree: a Criterion has no leaves, Sampling's temperature is traced); its static
    # fields and the tree are part of what is compiled.
    self._blockwise_jit = jax.jit(traced(self._blockwise),
                                  static_argnames=('tree', 'drafter'), out_shardings=out)
    self._beam_jit = jax.jit(traced(self._beam), static_argnames=('beam_size', 'alpha'),
                             out_shardings=out)
    self._sample_jit = jax.jit(traced(self._sample), static_argnames=('top_k', 'top_p'),
                               out_shardings=out)
    self._first_heads_jit = jax.jit(lambda params, k: model_lib.first_heads(self.model, params, k)[1],
                                    static_argnames='k')
    self._heads_cache = {}  # k -> (the params it was cut from, their first k heads)
    # head_weights: the dtype of heads 2..k's packed weights (model.packed_weights; the skinny kernel only).
    self._pack_jit = jax.jit(functools.partial(model_lib.packed_weights, head_weights=head_weights,
                                               draft_ids=model.config.draft_ids))
    self._packed_cache = {}  # id of a parameter tree -> (that tree, its packed weights)
    self._keys = {}  # seed -> its PRNGKey (_key)

  def _heads(self, params, k):
    """The first k heads' parameters of `params` (model.first_heads), cut once per params and k, outside the
    jitted decoders: cut inside, every decode call (every sentence at batch 1) copied the kept slices of the
    multi-output layer, megabytes, before its loop began (experiments/bench_decode.py --mode=profile)."""
    if k in (1, self.model.config.k):
      return params
    cached = self._heads_cache.get(k)
    if cached is None or cached[0] is not params:
      cached = self._heads_cache[k] = (params, self._first_heads_jit(params, k=k))
    return cached[1]

  def _packed(self, params):
    """The packed weights the skinny kernel reads (model.packed_weights), made once per parameter tree (one pass
    over the weights: made per call, it would cost about a greedy step per sentence at batch 1); None with XLA."""
    if self.matmul_kernel != 'skinny' or jnp.dtype(self.model.config.dtype) != jnp.float32:
      return None
    cached = self._packed_cache.get(id(params))
    if cached is None or cached[0] is not params:
      if len(self._packed_cache) >= 2:  # a training loop's evaluations: keep the newest few
        self._packed_cache.pop(next(iter(self._packed_cache)))
      cached = self._packed_cache[id(params)] = (params, self._pack_jit(params))
    return cached[1]

  def _key(self, seed: int):
    """jax.random.PRNGKey(seed), made once per seed: making it is a device dispatch of its own, which every
    batch-1 sentence would otherwise pay on top of its decode, even with a rule that never draws."""
    key = self._keys.get(seed)
    if key is None:
      key = self._keys[seed] = jax.random.PRNGKey(seed)
    return key

  def _model(self, k):
    """The k-head model whose parameters `_heads` cut (the model itself for k = 1 or all its heads)."""
    return self.model if k in (1, self.model.config.k) else model_lib.Transformer(
        dataclasses.replace(self.model.config, k=k))

  def _put(self, src_BxS):
    # On one device the host array goes to the jitted call as it is: jit's own transfer of a numpy argument is
    # cheaper than building a device array first (jnp.asarray dispatches a program of its own, and
    # shard_global_batch a sharded array), a fixed cost of every call at batch 1 (bench_decode --mode=fixed_cost).
    if self.mesh is None or self.mesh.size == 1:
      return np.asarray(src_BxS)
    return sharding.shard_global_batch(src_BxS, self.mesh)

  def greedy(self, params, src_BxS):
    """Greedy decoding: one token per row per call."""
    return self._greedy_jit(params, self._packed(params), self._put(src_BxS))

  def blockwise(self, params, src_BxS, rule, tree, seed: int = 0, drafter=decoding.HEADS):
    """decoding.blockwise with an acceptance rule (a decoding.Criterion, or speculative.Sampling, whose samples
    follow softmax(head 1 / temperature) exactly, as `sample`'s do) over a tree (a decoding.Layout, e.g.
    `chain(k)`, or a decoding.Dynamic) with a drafter (bpd/drafters.py): decoding.HEADS by default, the model's first
    tree.depth heads; one that reads no heads proposes from the source ids and head 1 alone runs. Compiled once per
    (batch shape, rule's static fields, tree, drafter); a temperature and the seed are traced. A rule that draws
    uses row b's stream fold_in(PRNGKey(seed), b): the same seed and batch give the same samples, and a row's
    samples do not depend on the other rows."""
    params_k = self._heads(params, tree.depth if drafter.reads_heads else 1)
    return self._blockwise_jit(params_k, self._packed(params_k), self._put(src_BxS), rule, self._key(seed),
                               tree=tree, drafter=drafter)

  def sample(self, params, src_BxS, temperature: float, seed: int, top_k: int = 0, top_p: float = 1.0):
    """Ancestral sampling at `temperature`, truncated to top_k / top_p (see sampling_score_fn; 0 and 1: off). The
    same seed and batch give the same samples; a row's sample depends on the seed and on its place in the batch."""
    return self._sample_jit(params, self._packed(params), self._put(src_BxS), np.float32(temperature),
                            self._key(seed), top_k=top_k, top_p=top_p)

  def beam(self, params, src_BxS, beam_size, alpha):
    """The best beam's tokens_BxL."""
    return self._beam_jit(params, self._packed(params), self._put(src_BxS), beam_size=beam_size, alpha=alpha)

  def _init(self, init_state, src_BxS, block=0):
    state = init_state(src_BxS, cache_len(self.max_len, block))
    check_cache_len(state, self.max_len, block)
    return state

  def _fixed(self, src_BxS):
    return decoding.Fixed(batch_size=src_BxS.shape[0], max_len=self.max_len, bos_id=tokenizer_lib.BOS_ID,
                          eos_id=self.eos_id)

  def _greedy(self, params, packed, src_BxS):
    fns = model_lib.decode_fns(self.model, params, num_heads=1, packed=packed)
    return decoding.greedy(fns.score, self._init(fns.init, src_BxS), fixed=self._fixed(src_BxS))

  def _blockwise(self, params_k, packed, src_BxS, rule, key, tree, drafter=decoding.HEADS):
    # params_k: the first tree.depth heads (`_heads`); for a drafter that reads no heads, the whole model, of which
    # head 1 runs.
    if drafter.reads_heads:
      fns = model_lib.decode_fns(self._model(tree.depth), params_k, packed=packed)
    else:
      fns = model_lib.decode_fns(self.model, params_k, num_heads=1, packed=packed)
    return decoding.blockwise(fns, self._init(fns.init, src_BxS, block=tree.num_nodes), fixed=self._fixed(src_BxS),
                              tree=tree, rule=rule, key=key if rule.draws else None, drafter=drafter,
                              context_BxC=src_BxS)

  def _sample(self, params, packed, src_BxS, temperature, key, top_k, top_p):
    fns = model_lib.decode_fns(self.model, params, num_heads=1, packed=packed)
    return decoding.greedy(sampling_score_fn(fns.score, key, temperature, top_k, top_p),
                           self._init(fns.init, src_BxS), fixed=self._fixed(src_BxS))

  def _beam(self, params, packed, src_BxS, beam_size, alpha):
    fns = model_lib.decode_fns(self.model, params, num_heads=1, packed=packed)
    tokens, _ = decoding.beam_search(fns.score, self._init(fns.init, src_BxS), fixed=self._fixed(src_BxS),
                                     beam_size=beam_size, alpha=alpha)
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


def source_buckets(src_ids) -> tuple:
  """The padded source lengths of a split's batches: every multiple of 8 up to source_bucket(src_ids); a batch is
  padded to the shortest that fits it (batching.eval_batches). At batch 1 a sentence padded to the split's longest
  source ran the encoder over up to 3x its positions (a Multi30k test sentence: median 16 tokens, longest 43), a
  fixed cost of every sentence that greedy and blockwise both pay (experiments/bench_decode.py --mode=fixed_cost);
  the price is a compile per bucket and setting."""
  return tuple(range(8, source_bucket(src_ids) + 1, 8))


def run_batches(fn, src_ids, batch_size, what='', bucket=None):
  """Applies fn(src_BxS) -> pytree with leading B to every batch; returns (outputs in source order, seconds).

  Every batch is padded to `bucket` source positions, or with a tuple of lengths to the shortest of them that fits
  it (default: source_buckets(src_ids), the batch's own longest source rounded up to a multiple of 8); pass the
  bucket(s) of the examples a function was compiled for to reuse those compiled shapes. Padding rows of the last
  batch are dropped. Logs progress with an ETA for long decodes.
  """
  buckets = source_buckets(src_ids) if bucket is None else tuple(np.atleast_1d(bucket).tolist())
  batches = batching.eval_batches(src_ids, None, batch_size, buckets)
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
  """A setting in file names: 'greedy', 'k4.distance2' (a rule or its string), 'sample0.8' for the sampled setting
  (criterion 'sample:0.8' in records), or with a tree spec (bpd/trees.py) 'tree-nodes32.k4.exact'."""
  if criterion is None:
    return 'greedy'
  if str(criterion).startswith('sample:'):
    return str(criterion).replace(':', '')
  name = f'k{k}.{criterion}'.replace(':', '')
  return name if tree is None else f'tree-{tree}.{name}'.replace(':', '')


def time_side_by_side(fns, src_ids, batch_size, repeats, bucket=None, what='timing'):
  """Median seconds of each fn(src_BxS) decoding the same examples, run alternately (bpd/timing.py).

  Every batch is padded as run_batches pads it (`bucket`: a length or a tuple of lengths; default
  source_buckets(src_ids)); each fn first runs once, untimed, over exactly the timed batches, and a trace or compile
  inside the timed runs raises timing.RecompileError. Alternating the functions and taking medians keeps a
  changing machine load out of their ratio.
  """
  bucket = source_buckets(src_ids) if bucket is None else bucket
  runs = [lambda fn=fn: run_batches(fn, src_ids, batch_size, bucket=bucket)[0] for fn in fns]
  return [float(s) for s in timing.time_alternating(runs, repeats, what)]