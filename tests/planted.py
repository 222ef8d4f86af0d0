"""Known errors planted into speculative sampling, for the tests that must catch them (tests/test_speculative.py).

They live here, not in production code: `Planted` is an acceptance rule (the methods of bpd/decoding.py's
rules) that drafts as speculative.Sampling does and verifies with a walk carrying one of PLANTS (token-by-token
verification, speculative.walk) or of BLOCK_PLANTS (block verification, speculative.block_walk).
"""

import jax.numpy as jnp
import numpy as np

from bpd import speculative

PLANTS = ('no_residual', 'no_bonus', 'q_temperature', 'stale_residual')
# On a tree built per row (decoding.Dynamic), whose tokens are chosen, not drawn: 'depth_q' takes each node's token
# for a draft of its depth's head (the one q per depth a static tree has) instead of a point mass at it;
# 'stale_residual' and 'no_residual' as above.
ROW_TREE_PLANTS = ('depth_q', 'stale_residual', 'no_residual')
BLOCK_PLANTS = ('first_failure', 'unweighted_residual', 'memoryless_weight', 'residual_q_off_by_one', 'none')


class Planted:
  """speculative.Sampling with one planted error in its verification."""
  draws = True

  def __init__(self, base: speculative.Sampling, plant: str):
    if plant not in PLANTS + BLOCK_PLANTS + ROW_TREE_PLANTS:
      raise ValueError(f'unknown plant {plant!r}; one of {PLANTS + BLOCK_PLANTS + ROW_TREE_PLANTS}')
    self.base, self.plant = base, plant

  def check(self, tree):
    self.base.check(tree)

  def first(self, target, tree, keys_B):
    return self.base.first(target, tree, keys_B)

  def ends_early(self, tree):
    return self.base.ends_early(tree)

  def target(self, logits_BxV):
    return self.base.target(logits_BxV)

  def draft(self, target, proposal, tree, keys_B):
    nodes_BxN, memo = self.base.draft(target, proposal, tree, keys_B)
    if tree.per_row and self.plant == 'depth_q':
      memo = {'depth_q_logits': proposal.heads_BxDm1xV.astype(jnp.float32)}  # (independent heads: propose_fn's)
    return nodes_BxN, memo

  def accept(self, nodes_BxN, logits_BxNxV, memo, tree, keys_B):
    base = self.base
    if self.plant == 'q_temperature':  # drafts drawn at T, but min(1, p/q) and the residual use q at T = 1
      return base.accept(nodes_BxN, logits_BxNxV, {'q_logits': memo['q_logits'] * base.temperature}, tree, keys_B)
    coins_BxN = speculative._uniforms(keys_B, tree.num_nodes)[:, 1]
    p_BxNxV = speculative._softmax(logits_BxNxV, base.temperature, base.top_k, base.top_p)
    if tree.per_row:
      return _planted_row_tree_walk(p_BxNxV, memo, nodes_BxN, coins_BxN, tree, self.plant, base)
    q_BxDm1xV = speculative._softmax(memo['q_logits'], base.temperature, base.top_k, base.top_p)
    if self.plant in BLOCK_PLANTS:
      return _planted_block_walk(p_BxNxV, q_BxDm1xV, nodes_BxN, coins_BxN, self.plant)
    return _planted_walk(p_BxNxV, q_BxDm1xV, nodes_BxN, coins_BxN, tree, self.plant)


def _planted_walk(p_BxNxV, q_BxDm1xV, nodes_BxN, coins_BxN, tree, plant):
  """speculative.walk with a planted error (see PLANTS in the test's parametrisation)."""
  depth_N, parent_N = tree.depth_N, tree.parent_N
  B, N, _ = p_BxNxV.shape
  rows = jnp.arange(B)
  cur_B = jnp.zeros((B,), jnp.int32)
  p_cur_BxV = p_BxNxV[:, 0]
  r_BxV = p_cur_BxV
  going_B = jnp.ones((B,), bool)
  first_residual_BxV = None
  for depth in range(1, tree.depth):
    q_BxV = q_BxDm1xV[:, depth - 1]
    found_B, next_B = jnp.zeros((B,), bool), cur_B
    for n in np.nonzero(depth_N == depth)[0]:
      tried_B = going_B & ~found_B & (cur_B == parent_N[n])
      x_B = nodes_BxN[:, n]
      target_BxV = p_cur_BxV if plant == 'stale_residual' else r_BxV  # every sibling against p, not the residual
      accept_B = tried_B & (coins_BxN[:, n] * q_BxV[rows, x_B] < target_BxV[rows, x_B])
      found_B, next_B = found_B | accept_B, jnp.where(accept_B, n, next_B)
      if plant != 'no_residual':  # a rejection resamples from p instead of norm(max(0, p - q))
        r_BxV = jnp.where((tried_B & ~accept_B)[:, None], speculative._residual(target_BxV, q_BxV), r_BxV)
      if depth == 1 and first_residual_BxV is None:
        first_residual_BxV = speculative._residual(p_BxNxV[:, 0], q_BxV)
    p_next_BxV = p_BxNxV[rows, next_B]
    r_BxV = jnp.where(found_B[:, None], p_next_BxV, r_BxV)
    p_cur_BxV = jnp.where(found_B[:, None], p_next_BxV, p_cur_BxV)
    cur_B = next_B
    going_B = going_B & found_B
  if plant == 'no_bonus' and first_residual_BxV is not None:
    # The all-accepted case forgotten, as when the first rejection is found by argmax over an all-False mask (0):
    # a walk that reached a leaf is taken for a rejection of the root's first child.
    has_child_N = np.zeros(N, bool)
    has_child_N[parent_N[parent_N >= 0]] = True
    leaf_B = ~jnp.asarray(has_child_N)[cur_B]
    cur_B = jnp.where(leaf_B, 0, cur_B)
    r_BxV = jnp.where(leaf_B[:, None], first_residual_BxV, r_BxV)
  return cur_B, r_BxV


def _planted_row_tree_walk(p_BxNxV, memo, nodes_BxN, coins_BxN, tree, plant, base):
  """speculative.walk on a tree built per row, with a planted error (ROW_TREE_PLANTS)."""
  B, N, V = p_BxNxV.shape
  rows = jnp.arange(B)
  if plant == 'depth_q':
    q_BxDm1xV = speculative._softmax(memo['depth_q_logits'], base.temperature, base.top_k, base.top_p)
    node_q = lambda n: q_BxDm1xV[rows, tree.depth_BxN[:, n] - 1]
  else:
    node_q = speculative.point_masses(nodes_BxN, V)
  cur_B = jnp.zeros((B,), jnp.int32)
  p_cur_BxV = r_BxV = p_BxNxV[:, 0]
  for n in range(1, N):
    tried_B = tree.parent_BxN[:, n] == cur_B
    x_B, q_BxV = nodes_BxN[:, n], node_q(n)
    target_BxV = p_cur_BxV if plant == 'stale_residual' else r_BxV  # every sibling against p, not the residual
    accept_B = tried_B & (coins_BxN[:, n] * q_BxV[rows, x_B] < target_BxV[rows, x_B])
    rejected_BxV = target_BxV if plant == 'no_residual' else speculative._residual(target_BxV, q_BxV)
    r_BxV = jnp.where(accept_B[:, None], p_BxNxV[:, n], jnp.where((tried_B & ~accept_B)[:, None], rejected_BxV, r_BxV))
    p_cur_BxV = jnp.where(accept_B[:, None], p_BxNxV[:, n], p_cur_BxV)
    cur_B = jnp.where(accept_B, n, cur_B)
  return cur_B, r_BxV


def _planted_block_walk(p_BxNxV, q_BxDm1xV, nodes_BxN, coins_BxN, plant):
  """speculative.block_walk written again with one known error ('none': the rule itself, so that the failures
  of the others are their plants')."""
  B, N, _ = p_BxNxV.shape
  rows, g = jnp.arange(B), N - 1
  w_B = jnp.ones((B,), jnp.float32)
  w_list, h_list = [w_B], []
  for i in range(1, g + 1):
    x_B = nodes_BxN[:, i]
    ratio_B = p_BxNxV[rows, i - 1, x_B] / q_BxDm1xV[rows, i - 1, x_B]
    # 'memoryless_weight': w_i = min(1, p/q) of the i-th draft alone, the running product not carried.
    w_B = jnp.minimum(1.0, (1.0 if plant == 'memoryless_weight' else w_B) * ratio_B)
    w_list.append(w_B)
    if i < g:
      r_B = jnp.sum(jnp.maximum(w_B[:, None] * p_BxNxV[:, i] - q_BxDm1xV[:, i], 0.0), axis=-1)
      denominator_B = r_B + 1.0 - w_B
      h_list.append(jnp.where(denominator_B > 0, r_B / jnp.maximum(denominator_B, 1e-30), 1.0))
    else:
      h_list.append(w_B)
  passed_BxG = coins_BxN[:, 1:] <= jnp.stack(h_list, axis=1)
  if plant == 'first_failure':  # stop at the first failed test instead of taking the longest passing prefix
    passed_BxG = jnp.cumprod(passed_BxG, axis=1).astype(bool)
  tau_B = jnp.max(jnp.where(passed_BxG, jnp.arange(1, g + 1)[None, :], 0), axis=1)
  w_tau_B = jnp.stack(w_list, axis=1)[rows, tau_B]
  if plant == 'unweighted_residual':  # norm(max(0, p - q)) instead of norm(max(0, w_tau p - q))
    w_tau_B = jnp.ones_like(w_tau_B)
  p_tau_BxV = p_BxNxV[rows, tau_B]
  # 'residual_q_off_by_one': the residual subtracts the accepted draft's q, not the next draft's.
  q_index_B = jnp.maximum(tau_B - 1, 0) if plant == 'residual_q_off_by_one' else jnp.minimum(tau_B, g - 1)
  left_BxV = jnp.maximum(w_tau_B[:, None] * p_tau_BxV - q_BxDm1xV[rows, q_index_B], 0.0)
  mass_B = jnp.sum(left_BxV, axis=-1, keepdims=True)
  residual_BxV = jnp.where(mass_B > 1e-12, left_BxV / jnp.maximum(mass_B, 1e-30), p_tau_BxV)
  return tau_B.astype(jnp.int32), jnp.where((tau_B == g)[:, None], p_tau_BxV, residual_BxV)
