"""A stub model for testing the decode loops without a network.

The stub's next token is a hash of the whole prefix (source seed, then every token so far), so a decoder
that reads a wrong or stale prefix gets a different answer. Its state mirrors a KV cache: row b keeps the
running hash at every position, and a call writes T positions from start_B[b]. Like attention, a call reads
every cached slot before start_B[b]: the hash at position p mixes in a digest of all the cached hashes before p
(`_digest`), so a slot that a rollback or a tree's move left stale, or failed to fill, changes every later
token, not only when it is the slot right before the block.
Proposal head i (i = 2..k) predicts the true i-th next greedy token with probability `head_accuracy`
(drawn per position and head from the hash), otherwise a token that is certainly wrong.
"""

import dataclasses
import functools

import flax
import jax
import jax.numpy as jnp
import numpy as np

PAD, EOS, BOS = 0, 1, 2
FIRST_WORD = 3  # ids 0..2 are special


def _mix(h, x):
  """uint32 hash step (wraps mod 2^32 in both numpy and JAX)."""
  with np.errstate(over="ignore"):
    h = (h ^ (x.astype(np.uint32) + np.uint32(0x9E3779B9))) * np.uint32(0x85EBCA6B)
  return h ^ (h >> np.uint32(13))


def _weighted(h, pos):
  """One slot's share of the prefix digest: the hash at position pos, mixed with pos (uint32)."""
  return _mix(h, pos.astype(np.uint32) if hasattr(pos, 'astype') else np.uint32(pos))


def _step(h_prev, digest, token):
  """The hash at a position from the one before it, the digest of every position before it, and its token."""
  return _mix(_mix(h_prev, digest), token)


class CacheOverflow(ValueError):
  """A stub's cache write ran past the end of its cache (`write_rows`)."""


def _checked_starts(start_B, num_new, cache_len):
  """start_B itself, after checking that num_new slots from each start fit in cache_len (CacheOverflow if not).
  start_B may carry leading vmapped axes: one call sees a whole vmapped batch."""
  start_B = np.asarray(start_B)
  end_B = start_B + num_new
  if (end_B > cache_len).any():
    raise CacheOverflow(f'cache write past the end: slots up to {int(end_B.max())} of a {cache_len}-slot cache '
                        f'(starts {start_B.ravel().tolist()[:16]}, {num_new} slots each)')
  return start_B


def write_rows(h_BxL, start_B, new_BxT):
  """Row b's slots start_B[b] .. start_B[b] + T - 1 = new_BxT[b], as bpd.layers.write_rows writes the real cache.
  A write that would run past the end raises CacheOverflow (host callback): the real model's dynamic_update_slice
  clamps such a start and silently overwrites the last slots of the prefix, so no test may pass over one. The write
  itself clamps as the real one does.

  The check is a pure_callback whose result (the starts, unchanged) the write uses, so that it cannot be dropped,
  with vmap_method='broadcast_all': under vmap it is one call on the whole batch. (jax.debug.callback unrolls one
  call per vmapped element into the program: the speculative tests' 20000 vmapped decodes compiled for hours.)"""
  start_B = jax.pure_callback(functools.partial(_checked_starts, num_new=new_BxT.shape[1], cache_len=h_BxL.shape[1]),
                              jax.ShapeDtypeStruct(start_B.shape, start_B.dtype), start_B,
                              vmap_method='broadcast_all')
  return jax.vmap(lambda row, new, start: jax.lax.dynamic_update_slice(row, new, (start,)))(
      h_BxL, new_BxT.astype(h_BxL.dtype), start_B)


def _u32(x):
  """x as uint32: a traced or JAX value stays JAX, a Python or numpy one becomes numpy."""
  return x.astype(jnp.uint32) if isinstance(x, jax.Array) else np.uint32(x)


@flax.struct.dataclass
class Stub:
  """Shapes (vocab_size, k) are static; the rest are leaves: a jitted test may take the stub as an ordinary
  argument, so that examples that differ only in accuracy, EOS rate or ties share one compile."""
  vocab_size: int = flax.struct.field(pytree_node=False, default=20)
  k: int = flax.struct.field(pytree_node=False, default=4)
  head_accuracy: float = 0.7
  eos_rate: int = 0  # a prefix hash divisible by eos_rate ends the row (0: only at eos_at)
  # Where a proposal head is wrong, the true token is its second choice with this probability (tree decoding
  # can then find it); otherwise the true token's rank is a matter of noise.
  runner_up_accuracy: float = 0.0
  noise_levels: int = 1000  # the logits' spread below the first choice takes this many values (2: many ties)

  def next_token(self, h, pos, eos_at):
    """The scoring model's greedy choice after the prefix with hash h ending at position pos."""
    word = FIRST_WORD + (h >> np.uint32(7)) % np.uint32(self.vocab_size - FIRST_WORD)
    xp = np if isinstance(h, np.ndarray) else jnp
    rate = _u32(self.eos_rate)
    by_rate = (rate > 0) & ((h >> np.uint32(3)) % xp.maximum(rate, np.uint32(1)) == 0)  # eos_rate 0: never
    eos = (pos + 1 == eos_at) | by_rate
    return np.where(eos, EOS, word).astype(np.int32) if xp is np else jnp.where(eos, EOS, word.astype(jnp.int32))

  def _logits(self, best, h):
    """One-hot at `best` (margin 5) plus a hash-derived spread in [0, 1) so that ranks below 1 are defined."""
    vocab = jnp.arange(self.vocab_size, dtype=jnp.uint32)
    levels = _u32(self.noise_levels)
    noise = (_mix(h[..., None], vocab) % levels).astype(jnp.float32) / jnp.asarray(levels).astype(jnp.float32)
    return noise + 5.0 * jax.nn.one_hot(best, self.vocab_size)

  def init_state(self, seed_B, eos_at_B, cache_len):
    B = seed_B.shape[0]
    return {'h_BxL': jnp.zeros((B, cache_len), jnp.uint32), 'seed_B': seed_B.astype(jnp.uint32),
            'eos_at_B': eos_at_B.astype(jnp.int32)}

  def score_fn(self, state, tokens_BxT, start_B, tree=None):
    """tree = (depth_N, ancestor_NxN), or per row (depth_BxN, ancestor_BxNxN) (bpd.decoding.blockwise): token n
    hashes onto its parent node's hash (or the prefix's, at depth 0), sits at position start + depth[n] and is
    stored in slot start + n."""
    B, T = tokens_BxT.shape
    start_B = jnp.broadcast_to(start_B, (B,))  # a scalar start puts every row at the same position
    rows = jnp.arange(B)
    h_prefix = jnp.where(start_B == 0, state['seed_B'], state['h_BxL'][rows, jnp.maximum(start_B - 1, 0)])
    # The digest of the cached prefix: every slot before start (slot = position there), as attention reads them.
    slots_L = jnp.arange(state['h_BxL'].shape[1])
    cached_BxL = jnp.where(slots_L[None, :] < start_B[:, None], _weighted(state['h_BxL'], slots_L[None, :]),
                           np.uint32(0))
    digest_B = jnp.sum(cached_BxL, axis=1, dtype=jnp.uint32)
    depth_BxT, ancestor_BxTxT, parent_BxT = _tree_rows(tree, B, T)
    pos_BxT = start_B[:, None] + depth_BxT
    hs, digests = [], []
    for t in range(T):  # parents come before their children (canonical order)
      digest = digest_B
      for m in range(t):  # the new tokens on the path before t, as if they were cached
        digest = digest + jnp.where(ancestor_BxTxT[:, t, m], _weighted(hs[m], pos_BxT[:, m]), np.uint32(0))
      digests.append(digest)
      hs.append(_step(_parent_hash(h_prefix, hs, parent_BxT[:, t]), digest, tokens_BxT[:, t]))
    h_BxT = jnp.stack(hs, axis=1)
    h_BxL = write_rows(state['h_BxL'], start_B, h_BxT)
    eos_at_BxT = jnp.broadcast_to(state['eos_at_B'][:, None], (B, T))
    logits = self._logits(self.next_token(h_BxT, pos_BxT, eos_at_BxT), h_BxT)
    hidden = {'h': h_BxT, 'pos': pos_BxT, 'eos_at': eos_at_BxT, 'digest': jnp.stack(digests, axis=1)}
    return logits, hidden, dict(state, h_BxL=h_BxL)

  def move_fn(self, state, start_B, source_BxD):
    """Slot start + source[d] -> slot start + d (bpd.decoding.blockwise): the accepted path made contiguous."""
    rows = jnp.arange(source_BxD.shape[0])[:, None]
    h_BxD = state['h_BxL'][rows, start_B[:, None] + source_BxD]
    return dict(state, h_BxL=write_rows(state['h_BxL'], start_B, h_BxD))

  def propose_fn(self, hidden):
    return self._heads(hidden)[1]

  def expand_fn(self, hidden, depth, parents_BxW):
    """Heads fed their parent's token (bpd.decoding.ModelFns.expand; as sequential heads are): head depth + 1's
    logits for the children of each of W parents at depth - 1, [B, W, V]. Fed the true greedy token there, the head
    proposes as propose_fn's does; fed another token, its choice is a hash of (row, depth, parent), so a wrong
    parent's children are as good as noise and differ from parent to parent."""
    truth_BxK, heads_BxKm1xV = self._heads(hidden)
    h_BxW = _mix(_mix(hidden['h'][:, None], parents_BxW), jnp.full_like(parents_BxW, 104729 * depth))
    guess_BxW = FIRST_WORD + ((h_BxW >> np.uint32(5)) % np.uint32(self.vocab_size - FIRST_WORD)).astype(jnp.int32)
    right_BxW = parents_BxW == truth_BxK[:, depth - 1, None]
    return jnp.where(right_BxW[..., None], heads_BxKm1xV[:, depth - 1, None], self._logits(guess_BxW, h_BxW))

  def _heads(self, hidden):
    """(greedy's next k tokens from the hidden state's position [B, k], heads 2..k's logits [B, k - 1, V])."""
    h, pos, eos_at, digest = hidden['h'], hidden['pos'], hidden['eos_at'], hidden['digest']
    preds, seconds = [], []
    tok = self.next_token(h, pos, eos_at)
    truth = [tok]
    for i in range(2, self.k + 1):
      digest = digest + _weighted(h, pos)
      h = _step(h, digest, tok)
      pos = pos + 1
      tok = self.next_token(h, pos, eos_at)
      truth.append(tok)
      coin = (_mix(h, jnp.full_like(pos, 7919 * i)) % np.uint32(1000)).astype(jnp.float32) / 1000.0
      wrong = FIRST_WORD + (tok - FIRST_WORD + 1 + (h % np.uint32(self.vocab_size - FIRST_WORD - 1)).astype(
          jnp.int32)) % (self.vocab_size - FIRST_WORD)
      right = coin < self.head_accuracy
      # A wrong EOS guess never reaches EOS: `wrong` is always a word id different from tok.
      preds.append(jnp.where(right, tok, jnp.where(tok == EOS, FIRST_WORD, wrong)))
      runner_up = ~right & (coin >= 1.0 - self.runner_up_accuracy * (1.0 - self.head_accuracy))
      seconds.append(jnp.where(runner_up, tok, -1))
    preds_BxKm1 = jnp.stack(preds, axis=1)
    logits = self._logits(preds_BxKm1, hidden['h'][:, None])
    # A runner-up gets margin 4 (+ noise < 1): below the first choice's 5, above every other token. Without one
    # (-1; always so at runner_up_accuracy 0, as coin < 1) the one-hot is zero and nothing changes.
    logits = logits + 4.0 * jax.nn.one_hot(jnp.stack(seconds, axis=1), self.vocab_size)
    return jnp.stack(truth, axis=1), logits

  def reference_greedy(self, seed_B, eos_at_B, max_len):
    """Greedy decoding in plain numpy, one row at a time: the ground truth for the decoders."""
    out = np.zeros((len(seed_B), max_len), np.int32)
    for b, (seed, eos_at) in enumerate(zip(seed_B, eos_at_B)):
      h = np.uint32(seed)
      tok = np.int32(BOS)
      digest = np.uint32(0)
      for pos in range(max_len):
        if pos:
          with np.errstate(over='ignore'):
            digest = np.uint32(digest + _weighted(np.asarray(h, np.uint32), np.uint32(pos - 1)))
        h = _step(np.asarray(h, np.uint32), np.asarray(digest, np.uint32), np.asarray(tok))
        tok = self.next_token(np.asarray(h), pos, eos_at)
        out[b, pos] = tok
        if tok == EOS:
          break
    return out


def _tree_rows(tree, B, T):
  """(depth_BxT, ancestor_BxTxT, parent_BxT) of the T new tokens: a chain without a tree (parent t - 1), else the
  tree score_fn got: (depth_N, ancestor_NxN) numpy for a static tree, or (depth_BxN, ancestor_BxNxN) per row. A
  node's parent is its deepest ancestor other than itself (-1 at a root)."""
  if tree is None:
    depth_BxT = jnp.broadcast_to(jnp.arange(T), (B, T))
    ancestor_BxTxT = jnp.broadcast_to(jnp.tril(jnp.ones((T, T), bool)), (B, T, T))
  else:
    depth_BxT = jnp.broadcast_to(jnp.asarray(tree[0]), (B, T))
    ancestor_BxTxT = jnp.broadcast_to(jnp.asarray(tree[1]), (B, T, T))
  strict_BxTxT = ancestor_BxTxT & ~jnp.eye(T, dtype=bool)
  parent_BxT = jnp.where(jnp.any(strict_BxTxT, axis=-1),
                         jnp.argmax(jnp.where(strict_BxTxT, depth_BxT[:, None, :], -1), axis=-1), -1)
  return depth_BxT, ancestor_BxTxT, parent_BxT


def _parent_hash(h_prefix_B, hs, parent_B):
  """The hash each new token builds on: its parent node's (hs[parent]), or the prefix's at a root."""
  if not hs:
    return h_prefix_B
  stacked_BxT = jnp.stack(hs, axis=1)
  return jnp.where(parent_B < 0, h_prefix_B,
                   jnp.take_along_axis(stacked_BxT, jnp.clip(parent_B, 0, len(hs) - 1)[:, None], axis=1)[:, 0])


@dataclasses.dataclass(frozen=True)
class SoftStub:
  """Soft next-token distributions over a small vocabulary that depend on the whole prefix: the subject of the
  exactness-in-distribution tests of speculative sampling (tests/test_speculative.py), small enough that the
  distribution of whole outputs can be enumerated (`exact_distribution`).

  Head 1's logits after a prefix with hash h: spread * (u_v - 1/2) for EOS and the words, u_v a hash of (h, v)
  in [0, 1), plus eos_bias on EOS; PAD and BOS never come (-1e9). Proposal head i (predicting y_{j+i} from
  position j) gives the logits head 1 would give after the prefix extended by its own argmax path of i - 1
  tokens, times head_scale (> 1: overconfident heads), plus head_noise times hash noise: close to the true
  distribution of y_{j+i}, never equal to it.
  The state mirrors a KV cache, as Stub's: the running hash at every slot; trees as in Stub.score_fn.
  """
  vocab_size: int = 6
  k: int = 4
  spread: float = 3.0
  head_noise: float = 1.0
  eos_bias: float = 0.0
  head_scale: float = 1.0

  def logits(self, h):
    """Head 1's logits [..., V] after the prefix with hash h (numpy or JAX, uint32 [...])."""
    xp = np if isinstance(h, (np.ndarray, np.generic)) else jnp
    vocab = xp.arange(self.vocab_size, dtype=xp.uint32)
    u = (_mix(h[..., None], vocab) % np.uint32(1000)).astype(xp.float32) / 1000.0
    logits = self.spread * (u - 0.5) + self.eos_bias * (xp.arange(self.vocab_size) == EOS)
    return xp.where((vocab == PAD) | (vocab == BOS), -1e9, logits).astype(xp.float32)

  def init_state(self, seed_B, cache_len):
    B = seed_B.shape[0]
    return {'h_BxL': jnp.zeros((B, cache_len), jnp.uint32), 'seed_B': seed_B.astype(jnp.uint32)}

  def score_fn(self, state, tokens_BxT, start_B, tree=None):
    B, T = tokens_BxT.shape
    start_B = jnp.broadcast_to(start_B, (B,))
    rows = jnp.arange(B)
    h_prefix = jnp.where(start_B == 0, state['seed_B'], state['h_BxL'][rows, jnp.maximum(start_B - 1, 0)])
    parent_BxT = _tree_rows(tree, B, T)[2]
    hs = []
    for t in range(T):
      hs.append(_mix(_parent_hash(h_prefix, hs, parent_BxT[:, t]), tokens_BxT[:, t]))
    h_BxT = jnp.stack(hs, axis=1)
    h_BxL = write_rows(state['h_BxL'], start_B, h_BxT)
    return self.logits(h_BxT), {'h': h_BxT}, dict(state, h_BxL=h_BxL)

  move_fn = Stub.move_fn

  def propose_fn(self, hidden):
    h = hidden['h']
    out = []
    for i in range(2, self.k + 1):
      h = _mix(h, jnp.argmax(self.logits(h), axis=-1))  # one more token of head 1's argmax path
      noise = (_mix(_mix(hidden['h'], jnp.full_like(hidden['h'], 7919 * i))[..., None],
                    jnp.arange(self.vocab_size, dtype=jnp.uint32)) % np.uint32(1000)).astype(jnp.float32) / 1000.0
      out.append(self.head_scale * self.logits(h) + self.head_noise * (noise - 0.5))
    return jnp.stack(out, axis=1)

  def expand_fn(self, hidden, depth, parents_BxW):
    """Heads fed their parent's token (bpd.decoding.ModelFns.expand; as sequential heads are): for each of W
    parents at depth - 1, the logits head 1 would give after head 1's argmax path of depth - 1 tokens and then
    the parent's token, times head_scale, plus head_noise times hash noise of (that hash, depth): [B, W, V]. A
    parent's children depend on the parent, as a sequential head's do; close to the truth, never equal to it."""
    h = hidden['h']
    for _ in range(depth - 1):
      h = _mix(h, jnp.argmax(self.logits(h), axis=-1))
    h_BxW = _mix(h[:, None], parents_BxW)
    noise = (_mix(_mix(h_BxW, jnp.full_like(h_BxW, 7919 * (depth + 1)))[..., None],
                  jnp.arange(self.vocab_size, dtype=jnp.uint32)) % np.uint32(1000)).astype(jnp.float32) / 1000.0
    return self.head_scale * self.logits(h_BxW) + self.head_noise * (noise - 0.5)

  def exact_distribution(self, seed, max_len, temperature, top_k=0, top_p=1.0):
    """{output tokens (EOS included): probability} of ancestral sampling at `temperature`, enumerated in numpy;
    truncated to the top_k most likely tokens, then to the smallest set of most likely tokens whose probability
    reaches top_p (ties with the last token kept are kept; 0 / 1: off)."""
    out = {}

    def walk(h, prefix, prob):
      if len(prefix) == max_len or (prefix and prefix[-1] == EOS):
        out[tuple(prefix)] = prob
        return
      logits = self.logits(np.asarray(h, np.uint32)).astype(np.float64) / temperature
      if top_k:
        logits = np.where(logits >= np.sort(logits)[::-1][top_k - 1], logits, -np.inf)
      p = np.exp(logits - logits.max())
      p /= p.sum()
      if top_p < 1.0:
        kept, mass = [], 0.0
        for v in np.argsort(-p, kind='stable'):
          if mass >= top_p:
            break
          kept.append(p[v])
          mass += p[v]
        p = np.where(p >= min(kept), p, 0.0)
        p /= p.sum()
      for v in range(self.vocab_size):
        if p[v] > 0:
          walk(_mix(np.asarray(h, np.uint32), np.asarray(v)), prefix + [v], prob * p[v])

    walk(_mix(np.asarray(seed, np.uint32), np.asarray(BOS)), [], 1.0)
    return out
