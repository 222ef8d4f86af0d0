"""Lossless speculative sampling with the proposal heads: blockwise speed for sampled outputs, chains and trees.

Blockwise parallel decoding (Stern et al. 2018, bpd/decoding.py) serves greedy decoding and its approximations.
This module samples from the scoring model p_1 at a temperature T > 0, exactly (the output has the distribution of
ancestral sampling, whatever the heads say), with the rejection rule of speculative sampling (Leviathan et al.
2023, "Fast inference from transformers via speculative decoding", Algorithm 1 and Theorem 3.5; Chen et al. 2023)
and, for trees, recursive rejection over siblings (SpecInfer, Miao et al. 2024, "multi-step speculative
sampling", its Algorithm 2 and Theorem 4.2). The criterion 'speculative:block' verifies a chain's drafts jointly
instead (block verification, Sun et al. 2025, `_block_walk`): the same law, and at least as many tokens per call
in distribution. docs/speculative.md states the rules and why they are lossless.

Interface: the same score_fn / propose_fn / move_fn as bpd/decoding.py (see its docstring), and the same
BlockwiseResult, so decoding.summarize works on the result.

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

Design choices:
  * Proposals are drawn from the heads' own softmax at T (not argmax). The chance that a draft is accepted is
    sum_v min(p(v), q(v)) = 1 - TV(p, q) (Leviathan et al. §3.2): heads trained with cross-entropy are
    distributions, and when q is close to p this is close to 1 at any T, while an argmax draft (q a point mass) is
    accepted with probability p(argmax q) <= max_v p(v), small whenever p is flat (high T, open-ended text,
    pixel noise). At T -> 0 both become greedy. The cost: with several children per node, iid drafts can repeat a
    token, and a repeated sibling is rarely accepted after its twin was rejected (its residual mass is gone).
  * One loop for chains and trees: the chain is the one-path tree. The rows' state, the EOS / max_len cut, the
    token writes and the statistics are decoding's (decoding.Rows, accept_block, close_iteration), shared with the
    greedy-acceptance chain and tree loops. What a chain needs less is decided at trace time:
    for a one-path topology score_fn is called without the tree mask (slots are positions, the block is causal)
    and move_fn is skipped (the path is already contiguous), so the chain keeps the blockwise chain's calls. The
    walk over siblings is a static Python loop over the tree's nodes: for the chain it reads as "try the single
    child, stop at the first rejection".
  * Randomness: one PRNG stream per row, fold_in(key, row), and per block, fold_in(row stream, the block's start
    position j + 1). A row's blocks start at strictly increasing positions (k̂ >= 1), so every block draws fresh:
    2N uniforms, one per node to pick its token by inverse CDF (the root from r, a draft from its q) and one per
    node for its acceptance coin. A row's output is therefore a pure function of (key, its index in the batch, its
    source): it does not depend on the other rows of the batch. Inverse-CDF draws need one uniform per token where
    Gumbel-max (Decoder.sample's) needs V; their float32 cumulative sums are exact to ~1e-7 of the probabilities.
  * Acceptance criteria: sampling is exact; `top_k:`, `distance:` and `min_block:` would change the distribution,
    and are a UserError (check_criterion) before anything is traced.
  * Truncated sampling (top_k, top_p; `sampling_logits`): the target is then the truncated, renormalised p, and the
    heads' q are truncated the same way. The rule above is exact for any target and any q, so the samples follow
    ancestral sampling of the truncated model (Decoder.sample with the same top_k, top_p), as before.
"""

from typing import Any

import jax
import jax.numpy as jnp
import flax
import numpy as np

from bpd import decoding
from bpd.errors import UserError

CRITERION = 'speculative'  # the decode criterion (config.decode.criteria) that selects this sampler
BLOCK_CRITERION = 'speculative:block'  # the same sampler with block verification of the chain (`_block_walk`)
CRITERIA = (CRITERION, BLOCK_CRITERION)
PLANTS = (None, 'no_residual', 'no_bonus', 'q_temperature', 'stale_residual')  # tests only (_plant)


def check_criterion(criterion) -> None:
  """UserError unless `criterion` is lossless sampling: None, 'speculative', 'speculative:block', 'exact' or
  decoding.Criterion().

  Approximate acceptance (top_k:, distance:) and forced blocks (min_block:) accept tokens the rejection rule would
  reject, so the samples would no longer follow the model's distribution.
  """
  if criterion is None or str(criterion) in CRITERIA + ('exact',):
    return
  raise UserError(f'Criterion {str(criterion)!r} cannot be used with speculative sampling: sampling accepts a draft '
                  'with probability min(1, p/q), which keeps the output distribution exactly that of the model; '
                  'top_k:, distance: and min_block: would accept tokens that rule rejects and change it. Use '
                  f'{CRITERION!r} alone (config.decode.criteria=("{CRITERION}",) with config.decode.temperature > 0).')


def parse_decode_criterion(spec, k: int | None = None):
  """A criterion of config.decode.criteria: CRITERION ('speculative', token-by-token verification) or
  BLOCK_CRITERION ('speculative:block', block verification) for speculative sampling, else
  decoding.parse_criterion(spec, k). Either combined with anything ('speculative+top_k:2') is a UserError."""
  parts = [part.strip() for part in str(spec).split('+')]
  sampling = [part for part in parts if part in CRITERIA]
  if not sampling:
    return decoding.parse_criterion(spec, k)
  if len(sampling) > 1:
    raise UserError(f'Criterion {spec!r} names two verification rules; use {CRITERION!r} (token by token) or '
                    f'{BLOCK_CRITERION!r} (block verification), one per entry of config.decode.criteria.')
  if len(parts) > 1:
    check_criterion('+'.join(part for part in parts if part not in CRITERIA))
  return sampling[0]


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


@flax.struct.dataclass
class SamplerState:
  """The carry of the speculative loop. N nodes, D = tree depth."""
  model_state: Any              # opaque decoder state; leaves [B, ...]
  rows: decoding.Rows           # D = tree depth
  nodes_BxN: jax.Array          # int32 [B, N]; node 0: the free token y_{j+1}; node n >= 1: a draft
  heads_BxDm1xV: jax.Array      # float32 [B, D - 1, V]; logits of heads 2..D at position j (the drafts' q)
  step: jax.Array               # int32 []


def _row_streams(key, batch_size):
  """One PRNG key per row: fold_in(key, row)."""
  return jax.vmap(lambda b: jax.random.fold_in(key, b))(jnp.arange(batch_size))


def _block_keys(row_keys_B, start_B):
  """The key of every draw of the block that starts at position start_B[b] (its free token's position) in row b:
  fold_in(row key, start). A row's blocks start at strictly increasing positions (k̂ >= 1), so every block of a
  row gets fresh draws, and no row reads another row's."""
  return jax.vmap(jax.random.fold_in)(row_keys_B, start_B)


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
  static; temperature may be traced."""
  x = logits_Bx___xV.astype(jnp.float32) / temperature
  vocab = x.shape[-1]
  if top_k and top_k < vocab:
    kth_Bx___x1 = jax.lax.top_k(x, top_k)[0][..., -1:]
    x = jnp.where(x >= kth_Bx___x1, x, -jnp.inf)
  if top_p < 1.0:
    probs = jax.nn.softmax(x, axis=-1)
    sorted_desc = jax.lax.top_k(probs, vocab)[0]
    mass_before = jnp.cumsum(sorted_desc, axis=-1) - sorted_desc
    threshold = jnp.min(jnp.where(mass_before < top_p, sorted_desc, jnp.inf), axis=-1, keepdims=True)
    x = jnp.where(probs >= threshold, x, -jnp.inf)
  return x


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


def _next_nodes(free_dist_BxV, q_BxDm1xV, keys_B, depth_N):
  """The next tree, from the block's keys: node 0 (the free token) drawn from free_dist_BxV; node n at depth d >= 1
  a draft from q_BxDm1xV[:, d - 1] = softmax(head_{d+1} / T), each node with its own uniform. Returns nodes_BxN."""
  u_BxN = _uniforms(keys_B, len(depth_N))[:, 0]
  free_B = _inverse_cdf(free_dist_BxV, u_BxN[:, 0])
  if len(depth_N) == 1:
    return free_B[:, None]
  drafts_BxM = _inverse_cdf(q_BxDm1xV[:, depth_N[1:] - 1], u_BxN[:, 1:])
  return jnp.concatenate([free_B[:, None], drafts_BxM], axis=1)


def _heads(propose_fn, hidden_Bx___, depth):
  """Logits of heads 2..D at one position per row, float32 [B, D - 1, V] (propose_fn may offer more heads)."""
  return propose_fn(hidden_Bx___)[:, :depth - 1].astype(jnp.float32)


def sampler_init(score_fn, propose_fn, state, *, key, temperature, batch_size: int, paths, max_len: int,
                 bos_id: int, eos_id: int, top_k: int = 0, top_p: float = 1.0) -> SamplerState:
  """The first model invocation (BOS at position 0: p and the heads there) and the loop's initial state."""
  B, layout, depth = batch_size, decoding.tree_layout(paths), decoding.tree_depth(paths)
  logits_Bx1xV, hidden, state = score_fn(state, jnp.full((B, 1), bos_id, jnp.int32), jnp.zeros((B,), jnp.int32))
  V = logits_Bx1xV.shape[-1]
  hidden_Bx___ = decoding.take_rows(hidden, jnp.zeros((B,), jnp.int32))
  heads_BxDm1xV = _heads(propose_fn, hidden_Bx___, depth) if depth > 1 else jnp.zeros((B, 0, V), jnp.float32)
  nodes_BxN = _next_nodes(_softmax(logits_Bx1xV[:, 0], temperature, top_k, top_p),
                          _softmax(heads_BxDm1xV, temperature, top_k, top_p),
                          _block_keys(_row_streams(key, B), jnp.ones((B,), jnp.int32)), layout['depth_N'])
  # A row whose first token (drawn from p at BOS) ends it is done with this call.
  rows = decoding.start_rows(nodes_BxN[:, 0], depth=depth, max_len=max_len, eos_id=eos_id)
  return SamplerState(model_state=state, rows=rows, nodes_BxN=nodes_BxN, heads_BxDm1xV=heads_BxDm1xV,
                      step=jnp.int32(0))


def _walk(p_BxNxV, q_BxDm1xV, nodes_BxN, coins_BxN, layout, plant):
  """Recursive rejection down the tree (module docstring; docs/speculative.md). Returns (last accepted node
  cur_B, distribution of the next free token r_BxV).

  p_BxNxV: head 1 at every node (the exact distribution of the token after the node's path); q_BxDm1xV[:, d-1]: the
  distribution every depth-d draft was drawn from; coins_BxN: uniform [0, 1) per node.
  """
  depth_N, parent_N = layout['depth_N'], layout['parent_N']
  B, N, _ = p_BxNxV.shape
  rows = jnp.arange(B)
  cur_B = jnp.zeros((B,), jnp.int32)        # the root: the free token, accepted by construction
  p_cur_BxV = p_BxNxV[:, 0]
  r_BxV = p_cur_BxV                          # the target the current node's children are tested against
  going_B = jnp.ones((B,), bool)             # every node so far accepted and the walk not stopped
  first_residual_BxV = None                  # plant 'no_bonus' only
  for depth in range(1, int(depth_N.max()) + 1):
    q_BxV = q_BxDm1xV[:, depth - 1]
    found_B, next_B = jnp.zeros((B,), bool), cur_B
    for n in np.nonzero(depth_N == depth)[0]:  # canonical order: siblings by rank, the order they are tried in
      tried_B = going_B & ~found_B & (cur_B == parent_N[n])
      x_B = nodes_BxN[:, n]
      target_BxV = p_cur_BxV if plant == 'stale_residual' else r_BxV
      # Accept x with probability min(1, r(x) / q(x)): u * q(x) < r(x) with u uniform in (0, 1] (q(x) > 0: x ~ q).
      accept_B = tried_B & (coins_BxN[:, n] * q_BxV[rows, x_B] < target_BxV[rows, x_B])
      found_B, next_B = found_B | accept_B, jnp.where(accept_B, n, next_B)
      if plant != 'no_residual':  # SpecInfer: the next sibling is tested against what the rejection left
        r_BxV = jnp.where((tried_B & ~accept_B)[:, None], _residual(target_BxV, q_BxV), r_BxV)
      if depth == 1 and first_residual_BxV is None:
        first_residual_BxV = _residual(p_BxNxV[:, 0], q_BxV)
    # Descend where a child was accepted: its head-1 output is the target of its own children.
    p_next_BxV = p_BxNxV[rows, next_B]
    r_BxV = jnp.where(found_B[:, None], p_next_BxV, r_BxV)
    p_cur_BxV = jnp.where(found_B[:, None], p_next_BxV, p_cur_BxV)
    cur_B = next_B
    going_B = going_B & found_B
  if plant == 'no_bonus' and first_residual_BxV is not None:
    # Planted error: the all-accepted case forgotten, as when the first rejection is found by argmax over an
    # all-False mask (0): a walk that reached a leaf is taken for a rejection of the root's first child.
    has_child_N = np.zeros(N, bool)
    has_child_N[parent_N[parent_N >= 0]] = True
    leaf_B = ~jnp.asarray(has_child_N)[cur_B]
    cur_B = jnp.where(leaf_B, 0, cur_B)
    r_BxV = jnp.where(leaf_B[:, None], first_residual_BxV, r_BxV)
  return cur_B, r_BxV


def _block_walk(p_BxNxV, q_BxDm1xV, nodes_BxN, coins_BxN):
  """Block verification of a chain (Sun et al. 2025, "Block verification accelerates speculative decoding",
  Algorithm 2; docs/speculative.md), on our schedule: node 0 is the free token, already a sample of p, accepted
  unverified; nodes 1..g (g = N - 1) are the drafts X_i ~ q_{i+1}. Returns (last accepted node cur_B, distribution
  of the next free token r_BxV), the meaning `_walk` gives them.

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


def sampler_body(score_fn, propose_fn, move_fn, *, key, temperature, paths, max_len: int, eos_id: int,
                 top_k: int = 0, top_p: float = 1.0, plant=None, block: bool = False):
  """One iteration (verify every node, walk, cut, move, draw the next tree): SamplerState -> SamplerState.
  block: block verification (`_block_walk`, chains only) instead of token-by-token (`_walk`)."""
  layout, depth = decoding.tree_layout(paths), decoding.tree_depth(paths)
  depth_N, path_NxD = layout['depth_N'], layout['path_NxD']
  is_chain = len(paths) == depth  # one node per depth: slots are positions, no tree mask, nothing to move
  q_temperature = 1.0 if plant == 'q_temperature' else temperature  # planted: q at the wrong temperature

  def body(s: SamplerState):
    B = s.rows.length_B.shape[0]
    row_keys_B = _row_streams(key, B)
    start_B = s.rows.length_B + 1  # the free token's position, j + 1
    tree_arg = () if is_chain else ((depth_N, layout['ancestor_NxN']),)
    logits_BxNxV, hidden, model_state = score_fn(s.model_state, s.nodes_BxN, start_B, *tree_arg)
    coins_BxN = _uniforms(_block_keys(row_keys_B, start_B), len(paths))[:, 1]
    # p and q truncated alike (top_k, top_p): the walk then samples the truncated model exactly.
    p_BxNxV = _softmax(logits_BxNxV, temperature, top_k, top_p)
    q_BxDm1xV = _softmax(s.heads_BxDm1xV, q_temperature, top_k, top_p)
    if block:
      cur_B, r_BxV = _block_walk(p_BxNxV, q_BxDm1xV, s.nodes_BxN, coins_BxN)
    else:
      cur_B, r_BxV = _walk(p_BxNxV, q_BxDm1xV, s.nodes_BxN, coins_BxN, layout, plant)
    k_hat_B = jnp.asarray(depth_N)[cur_B] + 1
    path_BxD = jnp.asarray(path_NxD)[cur_B]
    block_BxD = jnp.take_along_axis(s.nodes_BxN, path_BxD, axis=1)
    # Stop at the first EOS inside the accepted block, and at max_len (decoding.blockwise's rule).
    rows, k_hat_B = decoding.accept_block(s.rows, block_BxD, k_hat_B, eos_id=eos_id, max_len=max_len)
    if not is_chain:  # the accepted path's keys and values to slots start .. start + D - 1
      model_state = move_fn(model_state, start_B, path_BxD)
    # Combined scoring and proposal (paper §4): heads 2..D at the last accepted node draft the next tree; the free
    # token comes from r (the residual of the first rejection, or p at a leaf: the bonus token).
    hidden_Bx___ = decoding.take_rows(hidden, cur_B)
    heads_BxDm1xV = _heads(propose_fn, hidden_Bx___, depth) if depth > 1 else s.heads_BxDm1xV
    nodes_BxN = _next_nodes(r_BxV, _softmax(heads_BxDm1xV, temperature, top_k, top_p),
                            _block_keys(row_keys_B, rows.length_B + 1), depth_N)
    # The free token is already a sample of the next token: where it ends the row (EOS, or the max_len-th token) it
    # is appended now rather than by an iteration that would accept it alone (decoding.end_with_next_token).
    rows = decoding.close_iteration(s.rows, rows, k_hat_B, nodes_BxN[:, 0], eos_id=eos_id, max_len=max_len)
    return SamplerState(model_state=model_state, rows=rows, nodes_BxN=nodes_BxN, heads_BxDm1xV=heads_BxDm1xV,
                        step=s.step + 1)
  return body


def speculative(score_fn, propose_fn, state: Any, *, key, temperature, batch_size: int, k: int, max_len: int,
                bos_id: int, eos_id: int, paths=None, move_fn=None, criterion=None, top_k: int = 0,
                top_p: float = 1.0, _plant=None) -> decoding.BlockwiseResult:
  """Samples from softmax(head_1 / temperature), exactly, verifying the heads' drafts (module docstring).

  key: a jax.random key (row b uses fold_in(key, b)); temperature: > 0, may be traced. top_k, top_p: static
  truncation of the distribution sampled (`sampling_logits`; the heads' drafts are truncated alike). k: the heads propose_fn
  offers; paths: a tree topology with the single root (0,) (check_sampling_tree; default the chain
  decoding.chain_tree(k)), using its first D = tree_depth(paths) heads; move_fn: needed for a tree that is not a
  chain. One model invocation per iteration plus one at the start. The state needs a cache of at least
  max_len + N + 1 slots (N = len(paths); k for the chain). Returns a decoding.BlockwiseResult (D + 1 columns of
  block counts). criterion: None or 'speculative' verifies token by token (recursive rejection on a tree);
  'speculative:block' verifies the chain's drafts jointly (`_block_walk`; a tree is a UserError). `_plant` plants
  a known error, for the tests that must catch it (PLANTS).
  """
  check_criterion(criterion)
  block = str(criterion) == BLOCK_CRITERION
  check_truncation(top_k, top_p)
  if _plant not in PLANTS:
    raise ValueError(f'unknown plant {_plant!r}; one of {PLANTS}')
  paths = check_sampling_tree(decoding.chain_tree(k) if paths is None else paths, k)
  if block and len(paths) != decoding.tree_depth(paths):
    raise UserError(f'{BLOCK_CRITERION!r} verifies a chain; tree {paths} has several nodes at one depth. Use '
                    f'{CRITERION!r} for trees (recursive rejection), or decode the chain.')
  if len(paths) != decoding.tree_depth(paths) and move_fn is None:
    raise ValueError('a tree that is not a chain needs move_fn (bpd/decoding.py)')

  first = sampler_init(score_fn, propose_fn, state, key=key, temperature=temperature, batch_size=batch_size,
                       paths=paths, max_len=max_len, bos_id=bos_id, eos_id=eos_id, top_k=top_k, top_p=top_p)
  body = sampler_body(score_fn, propose_fn, move_fn, key=key, temperature=temperature, paths=paths,
                      max_len=max_len, eos_id=eos_id, top_k=top_k, top_p=top_p, plant=_plant, block=block)
  return decoding.run_loop(first, body, max_len=max_len)
