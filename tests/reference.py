"""The slow, obvious references the decode loops are tested against (one copy, shared by the test files).

Every score recomputes the whole prefix from scratch with a fresh stub state (no cache, no tree mask), and a tree is
decoded path by path as plain sequences. They share only `decoding.accept_mask` (tested on hand-made logits) with
the code under test.
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


def reference_blockwise(stub, seed, eos_at, max_len, paths, criterion):
  """Blockwise decoding of one row over the tree `paths` (decoding.chain_tree(k) for the paper's chain): every
  candidate path is scored from scratch as a plain sequence. Returns (tokens, iterations).

  The last-token rule: when head 1's next token ends the row (EOS, or the max_len-th token) no iteration runs to
  accept it alone, unless another root could pass (several roots under a check looser than exact): then the
  iteration runs, and may take that root's deeper path.
  """
  paths = decoding.check_tree(paths, stub.k)
  roots = [p for p in paths if len(p) == 1]
  ends_early = len(roots) == 1 or criterion.kind == 'exact'
  out, iterations = [], 0
  while True:
    j = len(out)
    logits, hidden = score_from_scratch(stub, seed, eos_at, out)
    if ends_early and (int(np.argmax(logits[j])) == EOS or j + 1 >= max_len):
      return out + [int(np.argmax(logits[j]))], iterations
    heads = [logits[j]]
    if stub.k > 1:
      heads += list(np.asarray(stub.propose_fn(jax.tree.map(lambda x: x[:, j], hidden)))[0])
    # Rank r of a head: the r-th token by score, ties to the lower id.
    token = {p: int(np.argsort(-heads[len(p) - 1], kind='stable')[p[-1]]) for p in paths}
    passed = {}
    for p in paths:
      before, _ = score_from_scratch(stub, seed, eos_at, out + [token[p[:d + 1]] for d in range(len(p) - 1)])
      ok = decoding.accept_mask(criterion, jnp.asarray([[token[p]]]), jnp.asarray(before[None, j + len(p) - 1:][:, :1]))
      passed[p] = p == (0,) or (bool(np.asarray(ok)[0, 0]) and (len(p) == 1 or passed[p[:-1]]))
    best = max((p for p in paths if passed[p]), key=len)  # max keeps the first of equal length: canonical order
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
  """A real model decoded greedily (decoding.greedy's (tokens, length, steps)) and blockwise over `tree` (a
  decoding.Layout such as the chain, or a Dynamic) with its first tree.depth heads, from one cache length."""
  init_state, score_fn, propose_fn, expand_fn = model_lib.decode_fns(model, params, num_heads=tree.depth,
                                                                     with_expand=True)
  state = init_state(src, fixed.max_len + tree.num_nodes + 1)
  greedy = decoding.greedy(score_fn, state, fixed=fixed)
  block = decoding.blockwise(decoding.ModelFns(score_fn, propose_fn, model_lib.move_cache, expand_fn), state,
                             fixed=fixed, tree=tree, rule=rule)
  return greedy, block


def chain(k):
  return decoding.layout(decoding.chain_tree(k))
