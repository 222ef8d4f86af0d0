"""Choosing a tree of candidates for tree decoding (bpd/decoding.py, `blockwise`): named topologies, the sparse
tree built from measured agreement, and the config's tree specs. Plain numpy and JSON; imports no model.

A tree spec (config.decode.trees) is one of
  'chain'      the paper's chain of k proposals (decoded without a tree mask or a cache move: the fast path);
  'comb:R'     the chain plus, at every depth below the root, the R - 1 next choices of that depth's head;
  'dense:R'    every path of ranks < R below the root, k deep (1 + R + .. + R^(k-1) nodes: grows fast);
  'nodes:N'    the sparse tree of N nodes that maximizes the expected accepted length under the top-r agreement
               measured on the val split (`python -m experiments.diagnostics --mode=choose_tree`), read from
               WORKDIR/trees.json;
  'dynamic:N'  a tree of N nodes built per row and iteration from the heads' own confidence (decoding.Dynamic,
               EAGLE-2): the N paths of highest product of the heads' probabilities.
Head 1's own choice is the only root of the named trees: under exact acceptance no other first token passes.

The sparse tree (Medusa, Cai et al. 2024, its "sparse tree"): with a_d[r] the measured probability that head
d + 1's rank-r choice is greedy's token, a node's path (r_0, .., r_d) is accepted with probability prod_e
a_e[r_e] (treating heads as independent), and the expected number of tokens an iteration accepts is the sum of
these over the tree's nodes. Adding nodes greedily, always the one of largest path probability whose parent is
already in, maximizes that sum for every N, since a child is never more likely than its parent.
"""

import heapq
import json
import os

import numpy as np

from bpd import decoding
from bpd import files
from bpd.errors import UserError

# Trees built per row and iteration (decoding.TreePolicy), by spec name: POLICIES[name](N, k) is the policy of the spec
# 'name:N' for a model of k heads. A new policy is its own file (the class) and one line here.
POLICIES = {'dynamic': lambda num_nodes, k: decoding.Dynamic(num_nodes=num_nodes, depth=k)}
TREES_FILE = 'trees.json'  # in the model's workdir: the measured agreement and the trees built from it
TREE_SPEC_HELP = ("a tree spec is 'chain', 'comb:R' (R >= 1), 'dense:R' (R >= 1), 'nodes:N' (N >= 1, built from "
                  f"the model's {TREES_FILE}: python -m experiments.diagnostics --mode=choose_tree) or 'dynamic:N' "
                  '(N >= 1, per row)')


def sparse_tree(agreement_DxR, num_nodes: int) -> decoding.TreePaths:
  """The tree of `num_nodes` nodes (at most D deep, ranks < R) that greedily maximizes the expected accepted
  length sum over nodes of prod_d agreement_DxR[d, r_d] (module docstring). Ties go to the canonical order."""
  agreement_DxR = np.asarray(agreement_DxR, np.float64)
  depth, ranks = agreement_DxR.shape
  chosen = []
  # Max-heap on path probability; ties broken by the canonical order (shorter, then lower ranks).
  frontier = [(-agreement_DxR[0, r], (1, (r,)), (r,)) for r in range(ranks)]
  heapq.heapify(frontier)
  while frontier and len(chosen) < num_nodes:
    neg_prob, _, path = heapq.heappop(frontier)
    chosen.append(path)
    if len(path) < depth:
      for r in range(ranks):
        child = path + (r,)
        heapq.heappush(frontier, (neg_prob * agreement_DxR[len(path), r], (len(child), child), child))
  if (0,) not in chosen:  # head 1's own choice must be in every tree (decoding.check_tree)
    chosen = [(0,)] + [p for p in chosen if p != (0,)][:num_nodes - 1]
  return decoding.check_tree(chosen, depth)


def expected_length(paths, agreement_DxR) -> float:
  """Expected tokens accepted per iteration under independent heads: sum over nodes of the path probability."""
  agreement_DxR = np.asarray(agreement_DxR)
  return float(sum(np.prod([agreement_DxR[d, r] for d, r in enumerate(path)]) for path in paths))


def _spec_count(spec: str, arg: str, letter: str) -> int:
  """The integer R or N of a tree spec ('comb:R', 'dense:R', 'nodes:N'), at least 1, or a UserError."""
  try:
    count = int(arg)
  except ValueError:
    raise UserError(f'Tree spec {spec!r}: {TREE_SPEC_HELP}.') from None
  if count < 1:
    raise UserError(f'Tree spec {spec!r}: {letter} must be at least 1; {TREE_SPEC_HELP}.')
  return count


def named_tree(spec: str, k: int) -> decoding.TreePaths:
  """'chain', 'comb:R' or 'dense:R' with k heads (module docstring)."""
  name, _, arg = str(spec).partition(':')
  if name == 'chain' and not arg:
    return decoding.chain_tree(k)
  if name not in ('comb', 'dense'):
    raise UserError(f'Unknown tree spec {spec!r}: {TREE_SPEC_HELP}.')
  width = _spec_count(spec, arg, 'R')
  if name == 'comb':
    return decoding.check_tree([(0,) * d + (r,) for d in range(1, k) for r in range(width)] + [(0,)], k)
  if sum(width**d for d in range(k)) > 4096:
    raise UserError(f'Tree spec {spec!r}: a dense tree of width {width} and depth {k} has more than 4096 nodes; '
                    "use a smaller R, fewer heads, or a sparse tree ('nodes:N').")
  paths, level = [(0,)], [(0,)]
  for _ in range(k - 1):
    level = [p + (r,) for p in level for r in range(width)]
    paths += level
  return decoding.check_tree(paths, k)


def read_agreement(workdir: str) -> np.ndarray:
  """The measured top-r agreement [k, R] saved in WORKDIR/trees.json by experiments/diagnostics.py
  --mode=choose_tree."""
  path = os.path.join(workdir, TREES_FILE)
  if not os.path.exists(path):
    raise UserError(f"Tree spec 'nodes:N' needs {path}, the measured top-r agreement of the model's heads: run "
                    f'python -m experiments.diagnostics --mode=choose_tree --config=CONFIG --workdir={workdir} '
                    'first.')
  with open(path) as f:
    return np.asarray(json.load(f)['agreement_KxR'], np.float64)


def write_trees(workdir: str, agreement_KxR, trees: dict, meta: dict) -> str:
  """Saves the agreement and the trees built from it (name -> paths) as WORKDIR/trees.json; returns the path."""
  path = os.path.join(workdir, TREES_FILE)
  record = {**meta, 'agreement_KxR': np.asarray(agreement_KxR).tolist(),
            'trees': {name: [list(p) for p in paths] for name, paths in trees.items()},
            'expected_length': {name: expected_length(paths, agreement_KxR) for name, paths in trees.items()}}
  files.write_atomic(path, json.dumps(record, indent=1))
  return path


def parse_tree_spec(spec: str, k: int, workdir: str | None = None, vocab_size: int | None = None):
  """The tree of a spec for a model with k heads: a decoding.Layout ('chain' is the chain of k), or a
  decoding.TreePolicy for a name of POLICIES ('dynamic:N'). UserError for a bad spec or a missing trees.json, before anything compiles."""
  name, _, arg = str(spec).partition(':')
  if name == 'chain' and not arg:
    return decoding.chain(k)
  if name in POLICIES:
    tree = POLICIES[name](_spec_count(spec, arg, 'N'), k)
    tree.check(vocab_size or 1 << 30)
    return tree
  if name != 'nodes':
    return decoding.layout(named_tree(spec, k))
  num_nodes = _spec_count(spec, arg, 'N')
  agreement_KxR = read_agreement(workdir)
  if agreement_KxR.shape[0] < k:
    raise UserError(f'{os.path.join(workdir, TREES_FILE)} holds the agreement of {agreement_KxR.shape[0]} heads, '
                    f'the model has k={k}: rerun python -m experiments.diagnostics --mode=choose_tree on this '
                    'checkpoint.')
  return decoding.layout(sparse_tree(agreement_KxR[:k], num_nodes))


def tree_name(spec: str) -> str:
  """The spec as a setting name's part: 'nodes:32' -> 'tree-nodes32'."""
  return 'tree-' + str(spec).replace(':', '')
