"""Known errors planted into speculative sampling, for the tests that must catch them (tests/test_speculative.py).

They live here, not in production code: `Planted` is an acceptance rule (the four methods of bpd/decoding.py's
rules) that drafts as speculative.Sampling does and verifies with a walk carrying one of PLANTS.
"""

import jax.numpy as jnp
import numpy as np

from bpd import speculative

PLANTS = ('no_residual', 'no_bonus', 'q_temperature', 'stale_residual')


class Planted:
  """speculative.Sampling with one planted error in its verification."""
  draws = True

  def __init__(self, base: speculative.Sampling, plant: str):
    if plant not in PLANTS:
      raise ValueError(f'unknown plant {plant!r}; one of {PLANTS}')
    self.base, self.plant = base, plant

  def check(self, tree):
    self.base.check(tree)

  def ends_early(self, tree):
    return self.base.ends_early(tree)

  def target(self, logits_BxV):
    return self.base.target(logits_BxV)

  def draft(self, target, heads_BxDm1xV, tree, keys_B):
    return self.base.draft(target, heads_BxDm1xV, tree, keys_B)

  def accept(self, nodes_BxN, logits_BxNxV, memo, tree, keys_B):
    base = self.base
    if self.plant == 'q_temperature':  # drafts drawn at T, but min(1, p/q) and the residual use q at T = 1
      return base.accept(nodes_BxN, logits_BxNxV, memo * base.temperature, tree, keys_B)
    coins_BxN = speculative._uniforms(keys_B, tree.num_nodes)[:, 1]
    p_BxNxV = speculative._softmax(logits_BxNxV, base.temperature, base.top_k, base.top_p)
    q_BxDm1xV = speculative._softmax(memo, base.temperature, base.top_k, base.top_p)
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
