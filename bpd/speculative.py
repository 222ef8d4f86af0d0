"""Lossless speculative sampling with the proposal heads: blockwise speed for sampled outputs, chains and trees.

Blockwise parallel decoding (Stern et al. 2018, bpd/decoding.py) serves greedy decoding and its approximations.
This module samples from the scoring model p_1 at a temperature T > 0, exactly (the output has the distribution of
ancestral sampling, whatever the heads say), with the rejection rule of speculative sampling (Leviathan et al.
2023, "Fast inference from transformers via speculative decoding", Algorithm 1 and Theorem 3.5; Chen et al. 2023)
and, for trees, recursive rejection over siblings (SpecInfer, Miao et al. 2024, "multi-step speculative
sampling", its Algorithm 2 and Theorem 4.2). 'speculative:block' verifies a chain's drafts jointly instead
(block verification, Sun et al. 2025, `block_walk`): the same law, and at least as many tokens per call in
distribution. docs/speculative.md states the rules and why they are lossless.

Interface: `Sampling` is an acceptance rule of decoding.blockwise, the one blockwise loop (its `check`, `target`,
`draft` and `accept`; bpd/decoding.py): the loop, the trees, the EOS / max_len cut and the statistics are
decoding's, shared with the greedy criteria.

One iteration, j tokens accepted in a row (D = the tree's depth; the chain of k is the one-path tree,
decoding.chain_tree(k), D = k):
  - the block's root, y_{j+1}, is already drawn from the exact distribution (p_1 at position j, or the residual
    left by the previous iteration's rejection): the "free" token, always accepted, as ŷ_{j+1} in the chain;
  - a node at depth d >= 1 holds a draft x ~ q_{d+1} = softmax(head_{d+1} / T), head d + 1 read at position j
    (it predicts y_{j+1+d}); every node has its own independent draw;
  - ONE model call feeds every node (combined scoring and proposal, paper §4): head 1 at node c gives
    p_c = softmax(head_1 / T), the exact distribution of the token after c's path;
  - the walk starts at the root with target r = p_root; at each depth it tries the children of the current node
    in order: accept x with probability min(1, r(x) / q(x)); on rejection r <- norm(max(0, r - q)) and the next
    sibling is tried against the new r; on acceptance the walk descends to that child with r = p_child;
  - the walk stops when no child of the current node is accepted (r is then the residual) or when the current
    node has no children (all accepted: r = p there, the "bonus" token). The next free token is drawn from r.
  - the accepted path (k̂ = its depth + 1 tokens) is cut at the first EOS and at max_len, as the chain does;
    head 1 and heads 2..D read at its last node are the next iteration's p and q's.
For the chain this is Leviathan et al.'s rule exactly: drafts t_2..t_k, accept each with min(1, p/q), the first
rejection resamples from norm(max(0, p - q)), all accepted gives a bonus token from p (here: the next free token).

Every node has its own q, the distribution its token came from; the walk reads nothing else of the drafter. On a
static tree or a chain it is the head of the node's depth (each node an independent draw). On a context-aware tree
(decoding.Dynamic, `dynamic:N`) the tokens are not drawn: the tree is built from the free token down, of the
heads' most likely paths, and with sequential heads each node's children come from the head fed that node's own
token. Such a node's q is a point mass at its token: the walk accepts it with probability r(x), and a rejection
leaves r with x removed, renormalised. The walk over siblings is then the same as drawing y ~ r and descending if
y is one of the children: lossless whatever chose the tree, since the choice is a function of the context and the
free token only (docs/speculative.md).

Design choices:
  * Proposals are drawn from the heads' own softmax at T (not argmax). The chance that a draft is accepted is
    sum_v min(p(v), q(v)) = 1 - TV(p, q) (Leviathan et al. §3.2): heads trained with cross-entropy are
    distributions, and when q is close to p this is close to 1 at any T, while an argmax draft (q a point mass) is
    accepted with probability p(argmax q) <= max_v p(v), small whenever p is flat (high T, open-ended text,
    pixel noise). At T -> 0 both become greedy. The cost: with several children per node, iid drafts can repeat a
    token, and a repeated sibling is rarely accepted after its twin was rejected (its residual mass is gone).
  * One loop for chains and trees (decoding.blockwise): the chain is the one-path tree, decoded without a tree
    mask or a cache move. The walk over siblings is a static Python loop over the tree's nodes: for the chain it
    reads as "try the single child, stop at the first rejection".
  * Randomness: one PRNG stream per row, fold_in(key, row), and per block, fold_in(row stream, the block's start
    position j + 1). A row's blocks start at strictly increasing positions (k̂ >= 1), so every block draws fresh:
    2N uniforms, one per node to pick its token by inverse CDF (the root from r, a draft from its q) and one per
    node for its acceptance coin. A row's output is therefore a pure function of (key, its index in the batch, its
    source): it does not depend on the other rows of the batch. Inverse-CDF draws need one uniform per token where
    Gumbel-max (Decoder.sample's) needs V; their float32 cumulative sums are exact to ~1e-7 of the probabilities.
  * Acceptance criteria: sampling is exact; `top_k:`, `distance:` and `min_block:` would change the distribution,
    and are a UserError (bpd/rules.py) before anything is traced.
  * Truncated sampling (top_k, top_p; `sampling_logits`): the target is then the truncated, renormalised p, and the
    heads' q are truncated the same way. The rule above is exact for any target and any q, so the samples follow
    ancestral sampling of the truncated model (Decoder.sample with the same top_k, top_p), as before.
"""

from typing import Any

import jax
import jax.numpy as jnp
import flax

from bpd import decoding
from bpd.errors import UserError

CRITERION = 'speculative'  # the word of config.decode.criteria that selects this sampler
# How a drafted block is verified: 'token' (token by token, recursive rejection on trees; `walk`, the default) or
# 'block' (the chain's drafts jointly; `block_walk`).
VERIFICATIONS = ('token', 'block')


@flax.struct.dataclass
class Sampling:
  """Lossless speculative sampling as an acceptance rule of decoding.blockwise (module docstring).

  temperature: > 0, a pytree leaf (traced: a new temperature does not recompile); top_k, top_p: static truncation
  of the distribution sampled (`sampling_logits`; the heads' drafts are truncated alike); verify: VERIFICATIONS.
  Written on the command line and in records as 'speculative'.
  """
  temperature: Any = 1.0
  top_k: int = flax.struct.field(pytree_node=False, default=0)
  top_p: float = flax.struct.field(pytree_node=False, default=1.0)
  verify: str = flax.struct.field(pytree_node=False, default='token')
  draws = True  # the loop hands it a PRNG key per block

  def __post_init__(self):
    # A typed rule checks its own static fields, so that a rule built in Python fails as the command line does
    # (bpd/rules.py), instead of quietly running token verification. The temperature is a leaf (maybe traced).
    if self.verify not in VERIFICATIONS:
      raise UserError(f'Sampling(verify={self.verify!r}): verification is one of {VERIFICATIONS} (token: token by '
                      'token, recursive rejection on trees; block: the chain\'s drafts jointly).')
    check_truncation(self.top_k, self.top_p)

  def __str__(self):
    return CRITERION if self.verify == 'token' else f'{CRITERION}:{self.verify}'

  def check(self, tree) -> None:
    if tree.is_static:  # a context-aware tree always has the single root
      check_sampling_tree(tree.paths, tree.depth)
    if self.verify == 'block' and not tree.is_chain:
      raise UserError(f'{self} verifies a chain (the paths (0,), (0, 0), ..., one draft per depth); '
                      f'{tree.paths if tree.is_static else tree} is not one. Use {CRITERION!r} for trees (recursive '
                      'rejection), or decode the chain.')

  def ends_early(self, tree) -> bool:
    return True  # the free token is a sample of the next token: where it ends the row it is the row's end

  def target(self, logits_BxV):
    """The distribution of the first free token: p_1 after BOS."""
    return _softmax(logits_BxV, self.temperature, self.top_k, self.top_p)

  def first(self, target_BxV, tree, keys_B):
    """The free token, node 0, drawn from target_BxV with the block's first uniform."""
    return _inverse_cdf(target_BxV, _uniforms(keys_B, tree.num_nodes)[:, 0, 0])

  def draft(self, target_BxV, proposal, tree, keys_B):
    """Node 0 (the free token) drawn from target_BxV; on a static tree node n at depth d >= 1 a draft from
    q_{d+1} = softmax(head_{d+1} / T), each node with its own uniform; memo {'q_logits': the heads' logits}. A tree
    built per row (decoding.RowTree) holds its tokens already, chosen from the free token down: memo {} (each
    node's q a point mass at its token, module docstring)."""
    if tree.token_BxN is not None:  # built per row by decoding.Dynamic from `first`
      return tree.token_BxN, {}
    heads_BxDm1xV = proposal.heads_BxDm1xV.astype(jnp.float32)
    u_BxN = _uniforms(keys_B, tree.num_nodes)[:, 0]
    free_B = _inverse_cdf(target_BxV, u_BxN[:, 0])  # = first(...)
    if tree.num_nodes == 1:
      return free_B[:, None], {'q_logits': heads_BxDm1xV}
    q_BxDm1xV = _softmax(heads_BxDm1xV, self.temperature, self.top_k, self.top_p)
    drafts_BxM = _inverse_cdf(q_BxDm1xV[:, tree.depth_N[1:] - 1], u_BxN[:, 1:])
    return jnp.concatenate([free_B[:, None], drafts_BxM], axis=1), {'q_logits': heads_BxDm1xV}

  def accept(self, nodes_BxN, logits_BxNxV, memo, tree, keys_B):
    """The walk (module docstring): the last accepted node and the distribution of the next free token."""
    coins_BxN = _uniforms(keys_B, tree.num_nodes)[:, 1]
    # p and q truncated alike (top_k, top_p): the walk then samples the truncated model exactly.
    p_BxNxV = _softmax(logits_BxNxV, self.temperature, self.top_k, self.top_p)
    parent_BxN = tree.arrays(nodes_BxN.shape[0])['parent']
    if 'q_logits' not in memo:  # tokens chosen as the tree was built: a point mass at each
      return walk(p_BxNxV, point_masses(nodes_BxN, p_BxNxV.shape[-1]), nodes_BxN, coins_BxN, parent_BxN)
    q_BxDm1xV = _softmax(memo['q_logits'], self.temperature, self.top_k, self.top_p)
    if self.verify == 'block':
      return block_walk(p_BxNxV, q_BxDm1xV, nodes_BxN, coins_BxN)
    return walk(p_BxNxV, lambda n: q_BxDm1xV[:, tree.depth_N[n] - 1], nodes_BxN, coins_BxN, parent_BxN)


def parse(spec, temperature: float = 0.0, top_k: int = 0, top_p: float = 1.0) -> 'Sampling':
  """Sampling of a config.decode.criteria entry that names 'speculative' (bpd/rules.py), at the config's
  temperature and truncation. 'speculative' combined with anything ('speculative+top_k:2') is a UserError:
  approximate acceptance and forced blocks accept tokens the rejection rule would reject, so the samples would no
  longer follow the model's distribution."""
  parts = [part.strip() for part in str(spec).split('+')]
  words = [part for part in parts if part.partition(':')[0] == CRITERION]
  others = [part for part in parts if part not in words]
  if others or len(words) > 1:
    raise UserError(f'Criterion {spec!r} cannot be used with speculative sampling: sampling accepts a draft '
                    'with probability min(1, p/q), which keeps the output distribution exactly that of the model; '
                    'top_k:, distance: and min_block: would accept tokens that rule rejects and change it. Use '
                    f'{CRITERION!r} alone (config.decode.criteria=("{CRITERION}",) with '
                    'config.decode.temperature > 0).')
  verify = words[0].partition(':')[2] or 'token'
  if verify not in VERIFICATIONS or words[0] == f'{CRITERION}:token':
    choices = ', '.join([repr(CRITERION)] + [repr(f'{CRITERION}:{v}') for v in VERIFICATIONS if v != 'token'])
    raise UserError(f'Criterion {spec!r}: speculative sampling is one of {choices}.')
  return Sampling(temperature=temperature, top_k=top_k, top_p=top_p, verify=verify)


def check_sampling_tree(paths, k: int) -> decoding.TreePaths:
  """A canonical tree (decoding.check_tree) with the single root (0,), or UserError.

  The root is the free token, already drawn exactly; a second depth-0 node would be a draft for a position that
  needs none. A node's rank r is its place among its siblings (tried r-th), not a head's r-th choice.
  """
  paths = decoding.check_tree(paths, k)
  roots = [p for p in paths if len(p) == 1]
  if roots != [(0,)]:
    raise UserError(f'Tree {paths} has the roots {roots}; speculative sampling draws the first token of a block '
                    'from head 1 exactly, so a tree has the single root (0,) and branches below it.')
  return paths


def check_truncation(top_k: int, top_p: float) -> None:
  """UserError unless top_k >= 0 (0: off) and 0 < top_p <= 1 (1: off)."""
  if int(top_k) != top_k or top_k < 0:
    raise UserError(f'sample_top_k={top_k} must be an integer >= 0 (0: every token; 40: the 40 most likely).')
  if not 0.0 < top_p <= 1.0:
    raise UserError(f'sample_top_p={top_p} must be in (0, 1] (1: every token; 0.9: the most likely tokens that '
                    'hold 90% of the probability).')


def sampling_logits(logits_Bx___xV, temperature, top_k: int = 0, top_p: float = 1.0):
  """The logits both samplers draw from (ancestral: decoder.sampling_score_fn; speculative: here), float32:
  logits / T, then -inf outside the top_k most likely tokens (0: off) and outside the smallest set of most likely
  tokens whose probability reaches top_p (nucleus sampling, Holtzman et al. 2020; 1: off), in that order, as
  common samplers apply them. A token tied with the last one kept is kept too, so the set is a function of the
  values alone (not of how a sort orders ties) and is the same wherever it is computed. top_k and top_p are
  static; temperature may be traced.

  Which tokens are kept is decided in the sorted order of one sort (`_keep_sorted`), never by comparing the values
  again with a threshold read from the sort: XLA may compute the values twice, once into the sort and once into
  the comparison, in two fusions that round differently, and the k-th token itself then fails `x >= kth`
  (docs/results/reliability.md, the sampler at --xla_backend_optimization_level=0)."""
  x = logits_Bx___xV.astype(jnp.float32) / temperature
  vocab = x.shape[-1]
  if top_k and top_k < vocab:
    x = jnp.where(_keep_sorted(x, lambda sorted_x: sorted_x >= sorted_x[..., top_k - 1:top_k]), x, -jnp.inf)
  if top_p < 1.0:
    def nucleus(sorted_desc):
      mass_before = jnp.cumsum(sorted_desc, axis=-1) - sorted_desc
      threshold = jnp.min(jnp.where(mass_before < top_p, sorted_desc, jnp.inf), axis=-1, keepdims=True)
      return sorted_desc >= threshold
    x = jnp.where(_keep_sorted(jax.nn.softmax(x, axis=-1), nucleus), x, -jnp.inf)
  return x


def _keep_sorted(values_Bx___xV, keep_fn):
  """keep_fn(the values sorted in descending order) -> which to keep, bool in that order; returned in token order.
  The decision reads the sort's own output only, so it is consistent whatever XLA recomputes around it."""
  shape, vocab = values_Bx___xV.shape, values_Bx___xV.shape[-1]
  sorted_NxV, order_NxV = jax.lax.top_k(values_Bx___xV.reshape(-1, vocab), vocab)
  rows_Nx1 = jnp.arange(sorted_NxV.shape[0])[:, None]
  keep_NxV = jnp.zeros(sorted_NxV.shape, bool).at[rows_Nx1, order_NxV].set(keep_fn(sorted_NxV))
  return keep_NxV.reshape(shape)


def _softmax(logits, temperature, top_k=0, top_p=1.0):
  """The distribution a sampler draws from at this temperature and truncation (`sampling_logits`), float32."""
  return jax.nn.softmax(sampling_logits(logits, temperature, top_k, top_p), axis=-1)


def _residual(r_BxV, q_BxV):
  """norm(max(0, r - q)): what is left of the target r after a draft from q was rejected (Leviathan et al. §2.3).

  The rejection had probability sum max(0, r - q) = 1 - sum min(r, q); where that is (numerically) zero the
  rejection cannot happen, and r is kept so that the result stays a distribution.
  """
  left_BxV = jnp.maximum(r_BxV - q_BxV, 0.0)
  mass_B = jnp.sum(left_BxV, axis=-1, keepdims=True)
  return jnp.where(mass_B > 1e-12, left_BxV / jnp.maximum(mass_B, 1e-30), r_BxV)


def _uniforms(keys_B, num_nodes):
  """The block's draws, float32 [B, 2, N] in (0, 1]: [:, 0, n] picks node n's token (inverse CDF), [:, 1, n] is
  node n's acceptance coin. Drawn from the block's key both when the block is proposed and when it is verified."""
  return jax.vmap(lambda k: 1.0 - jax.random.uniform(k, (2, num_nodes), jnp.float32))(keys_B)


def _inverse_cdf(probs_Bx___xV, u_Bx___):
  """A token per distribution: the first v with cumsum(probs)[v] >= u * sum(probs), u in (0, 1] (so a token of
  probability 0 is never picked). One uniform per draw, where Gumbel-max would need V of them."""
  cdf_Bx___xV = jnp.cumsum(probs_Bx___xV, axis=-1)
  threshold_Bx___ = u_Bx___ * cdf_Bx___xV[..., -1]
  index = jnp.sum(cdf_Bx___xV < threshold_Bx___[..., None], axis=-1)
  return jnp.minimum(index, probs_Bx___xV.shape[-1] - 1).astype(jnp.int32)


def point_masses(nodes_BxN, vocab_size: int):
  """node_q for tokens that were chosen, not drawn: node n's q is one_hot(its token), float32 [B, V]."""
  return lambda n: jax.nn.one_hot(nodes_BxN[:, n], vocab_size, dtype=jnp.float32)


def walk(p_BxNxV, node_q, nodes_BxN, coins_BxN, parent_BxN):
  """Recursive rejection down the tree, token by token (module docstring; docs/speculative.md). Returns (last
  accepted node cur_B, distribution of the next free token r_BxV).

  p_BxNxV: head 1 at every node (the exact distribution of the token after the node's path); node_q(n) -> [B, V]:
  the distribution node n's token came from (q(x) > 0 at its token x); coins_BxN: uniform (0, 1] per node;
  parent_BxN: the tree's parents (a static tree's broadcast), nodes in canonical order: a parent before its
  children, siblings in the order they are tried.
  """
  B = p_BxNxV.shape[0]
  rows = jnp.arange(B)
  cur_B = jnp.zeros((B,), jnp.int32)  # the root: the free token, accepted by construction
  r_BxV = p_BxNxV[:, 0]               # the target the current node's children are tested against
  for n in range(1, nodes_BxN.shape[1]):
    # Only the current node's children are tried. After an acceptance the walk has moved to that child, so its
    # later siblings are not tried; after its last child was rejected no later node has it as parent: it stops.
    tried_B = parent_BxN[:, n] == cur_B
    x_B, q_BxV = nodes_BxN[:, n], node_q(n)
    # Accept x with probability min(1, r(x) / q(x)): u * q(x) < r(x) with u uniform in (0, 1].
    accept_B = tried_B & (coins_BxN[:, n] * q_BxV[rows, x_B] < r_BxV[rows, x_B])
    # Descend where accepted (the child's head-1 output is the target of its own children); SpecInfer: where
    # rejected, the next sibling is tested against what the rejection left.
    r_BxV = jnp.where(accept_B[:, None], p_BxNxV[:, n],
                      jnp.where((tried_B & ~accept_B)[:, None], _residual(r_BxV, q_BxV), r_BxV))
    cur_B = jnp.where(accept_B, n, cur_B)
  return cur_B, r_BxV


def block_walk(p_BxNxV, q_BxDm1xV, nodes_BxN, coins_BxN):
  """Block verification of a chain (Sun et al. 2025, "Block verification accelerates speculative decoding",
  Algorithm 2; docs/speculative.md), on our schedule: node 0 is the free token, already a sample of p, accepted
  unverified; nodes 1..g (g = N - 1) are the drafts X_i ~ q_{i+1}. Returns (last accepted node cur_B, distribution
  of the next free token r_BxV), the meaning `walk` gives them.

  p_BxNxV[:, i]: head 1 at node i, the exact distribution of the token after X^i (so of X_{i+1});
  q_BxDm1xV[:, i]: the distribution X_{i+1} was drawn from; coins_BxN[:, i]: eta_i, uniform in (0, 1], i >= 1.
  The rule: running weight w_0 = 1, w_i = min(1, w_{i-1} p(X_i) / q(X_i)); for i < g, with
  r_i = sum_x max(0, w_i p(x | X^i) - q_{i+1}(x)), accept-up-to-i probability h_i = r_i / (r_i + 1 - w_i)
  (0/0 = 1), and h_g = w_g; tau = the largest i with eta_i <= h_i (0 if none): a failure at i does not stop
  the walk, a later success accepts it too. The next free token comes from p after X^g when tau = g, else from
  norm(max(0, w_tau p(. | X^tau) - q_{tau+1})). g is the whole chain even where EOS or max_len cuts the block
  later: P(tau >= i, X^i = x^i) = q(x^i) w_i(x^i) whatever g >= i is, so the cut block has the law it would
  have had if verification had stopped at the cut (docs/speculative.md).
  """
  B, N, _ = p_BxNxV.shape
  rows = jnp.arange(B)
  if N == 1:
    return jnp.zeros((B,), jnp.int32), p_BxNxV[:, 0]
  g = N - 1
  w_B = jnp.ones((B,), jnp.float32)
  w_list, h_list = [w_B], []
  for i in range(1, g + 1):
    x_B = nodes_BxN[:, i]
    p_x_B, q_x_B = p_BxNxV[rows, i - 1, x_B], q_BxDm1xV[rows, i - 1, x_B]  # q(x) > 0: x was drawn from q
    w_B = jnp.minimum(1.0, w_B * p_x_B / jnp.maximum(q_x_B, 1e-30))
    w_list.append(w_B)
    if i < g:
      r_B = jnp.sum(jnp.maximum(w_B[:, None] * p_BxNxV[:, i] - q_BxDm1xV[:, i], 0.0), axis=-1)
      denominator_B = r_B + (1.0 - w_B)
      h_list.append(jnp.where(denominator_B > 0, r_B / jnp.maximum(denominator_B, 1e-30), 1.0))
    else:
      h_list.append(w_B)
  h_BxG = jnp.stack(h_list, axis=1)
  # eta in (0, 1] (`_uniforms`): P(eta <= h) = h, with h = 0 never and h = 1 always passing.
  passed_BxG = coins_BxN[:, 1:] <= h_BxG
  tau_B = jnp.max(jnp.where(passed_BxG, jnp.arange(1, g + 1)[None, :], 0), axis=1).astype(jnp.int32)
  w_tau_B = jnp.stack(w_list, axis=1)[rows, tau_B]
  p_tau_BxV = p_BxNxV[rows, tau_B]
  q_next_BxV = q_BxDm1xV[rows, jnp.minimum(tau_B, g - 1)]  # the draft distribution at the first unaccepted node
  left_BxV = jnp.maximum(w_tau_B[:, None] * p_tau_BxV - q_next_BxV, 0.0)
  mass_B = jnp.sum(left_BxV, axis=-1, keepdims=True)
  # Where the residual has (numerically) no mass, tau = i had probability r_i = 0: keep p, a distribution.
  residual_BxV = jnp.where(mass_B > 1e-12, left_BxV / jnp.maximum(mass_B, 1e-30), p_tau_BxV)
  r_BxV = jnp.where((tau_B == g)[:, None], p_tau_BxV, residual_BxV)
  return tau_B, r_BxV
