"""The slow, obvious references the decode loops are tested against (one copy, shared by the test files).

Every score recomputes the whole prefix from scratch with a fresh stub state (no cache, no tree mask), and a tree is
decoded path by path as plain sequences. `reference_blockwise` is written from the documented rule (DESIGN §1-§3)
in numpy and shares no code with the loop under test.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np

from bpd import decoding
from bpd import model as model_lib
from tests.stubs import BOS, EOS


def score_from_scratch(stub, seed, eos_at, tokens):
  """Head-1 logits [T, V] and hidden states at every position of [BOS] + tokens, with a fresh state (no cache)."""
  state = stub.init_state(jnp.asarray([seed]), jnp.asarray([eos_at]), len(tokens) + 2)
  logits, hidden, _ = stub.score_fn(state, jnp.asarray([[BOS] + list(tokens)], jnp.int32),
                                    jnp.zeros((1,), jnp.int32))
  return np.asarray(logits[0]), hidden


def _rank(logits_V, token):
  """The place of `token` in head 1's order: tokens of higher score, and of equal score with a lower id, come
  first (argmax breaks ties to the lower id: rank 0 is the argmax)."""
  return int(np.sum(logits_V > logits_V[token]) + np.sum((logits_V == logits_V[token]) &
                                                         (np.arange(len(logits_V)) < token)))


def passes(criterion, token, logits_V):
  """DESIGN §1, the acceptance criteria: whether a proposed token passes against head 1's logits at the position
  before it. exact: it is the argmax; top_k:T: among the T most probable; distance:EPS: within EPS of the argmax."""
  best = int(np.argmax(logits_V))
  if criterion.kind == 'exact':
    return token == best
  if criterion.kind == 'top_k':
    return _rank(logits_V, token) < criterion.top_k
  if criterion.kind == 'distance':
    return abs(token - best) <= criterion.eps
  raise ValueError(criterion.kind)


def reference_blockwise(stub, seed, eos_at, max_len, paths, criterion):
  """Blockwise decoding of one row over the tree `paths` (decoding.chain_tree(k) for the paper's chain), written
  from the documented rule (DESIGN §1-§3, README "Definitions"), not from the loop: every candidate path is scored
  from scratch as a plain sequence, in numpy. Returns (tokens, iterations); iterations == 0 means the first call
  produced the row alone. Shares no decoding code with the loop (only the stub, the model under test).

  - Node (r_0, .., r_d) holds the r_d-th choice of head d + 1 read at the last accepted position j (rank 0 = the
    argmax, ties to the lower id), under its parent (r_0, .., r_{d-1}).
  - A root (depth 0) is checked against head 1 at j, a deeper node against head 1 after its parent's path. The root
    (0,), head 1's own choice, always passes. The deepest path whose every node passes is accepted (equal depths:
    the first in canonical order, by depth then ranks); with min_block:L, at least the rank-0 path of L nodes.
  - The accepted tokens are cut at the first EOS and at max_len; a row stops there.
  - The last-token rule: when head 1's next token ends the row (it is EOS, or the max_len-th token), the call
    that computed it appends it, with no iteration to accept it alone; except with several roots under a check
    looser than exact (top_k:T, T >= 2, or distance:EPS, EPS >= 1), where another root's deeper path may pass:
    there the iteration runs. top_k:1 and distance:0 accept what exact accepts.
  """
  paths = sorted({tuple(p) for p in paths}, key=lambda p: (len(p), p))
  roots = [p for p in paths if len(p) == 1]
  looser = (criterion.kind == 'top_k' and criterion.top_k >= 2) or (criterion.kind == 'distance' and criterion.eps >= 1)
  ends_early = len(roots) == 1 or not looser
  out, iterations = [], 0
  while True:
    j = len(out)
    logits_TxV, hidden = score_from_scratch(stub, seed, eos_at, out)
    next_token = int(np.argmax(logits_TxV[j]))
    if ends_early and (next_token == EOS or j + 1 >= max_len):
      return out + [next_token], iterations
    heads_DxV = [logits_TxV[j]]
    if stub.k > 1:
      heads_DxV += list(np.asarray(stub.propose_fn(jax.tree.map(lambda x: x[:, j], hidden)))[0])
    order = [np.argsort(-np.asarray(h), kind='stable') for h in heads_DxV]  # stable: ties to the lower id
    token = {p: int(order[len(p) - 1][p[-1]]) for p in paths}
    passed = {}
    for p in paths:  # parents before children (canonical order)
      before = score_from_scratch(stub, seed, eos_at, out + [token[p[:d + 1]] for d in range(len(p) - 1)])[0]
      ok = p == (0,) or passes(criterion, token[p], before[j + len(p) - 1])
      passed[p] = ok and (len(p) == 1 or passed[p[:-1]])
    best = max((p for p in paths if passed[p]), key=len)  # max keeps the first of equal length
    if len(best) < criterion.min_block:
      best = (0,) * criterion.min_block
    accepted = [token[best[:d + 1]] for d in range(len(best))]
    if EOS in accepted:
      accepted = accepted[:accepted.index(EOS) + 1]
    out += accepted[:max_len - j]
    iterations += 1
    if out[-1] == EOS or len(out) >= max_len:
      return out, iterations


@functools.partial(jax.jit, static_argnames=('model', 'tree', 'fixed', 'rule'))
def greedy_and_blockwise(params, src, *, model, tree, fixed, rule=decoding.EXACT):
  """A real model decoded greedily (greedy as (tokens, length, model calls)) and blockwise over `tree` (a
  decoding.Layout such as the chain, or a Dynamic) with its first tree.depth heads, from one cache length."""
  fns = model_lib.decode_fns(model, params, num_heads=tree.depth)
  init_state, score_fn, propose_fn, expand_fn = fns.init, fns.score, fns.propose, fns.expand
  state = init_state(src, fixed.max_len + tree.num_nodes + 1)
  g = decoding.greedy(score_fn, state, fixed=fixed)
  greedy = (g.tokens_BxL, g.length_B, g.invocations)
  block = decoding.blockwise(decoding.ModelFns(score_fn, propose_fn, model_lib.move_cache, expand_fn), state,
                             fixed=fixed, tree=tree, rule=rule)
  return greedy, block


def chain(k):
  return decoding.chain(k)
