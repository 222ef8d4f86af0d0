"""Greedy, beam-search and blockwise parallel decoding over a step function. Never imports the model.

The model enters as two plain functions over an opaque per-row state (every leaf has leading dim B):

  score_fn(state, tokens_BxT, start_B) -> (logits_BxTxV, hidden_BxTx..., new_state)
      Feeds T tokens per row at positions start_B[b] .. start_B[b] + T - 1 and returns head 1's logits
      (the scoring model p_1) at each of them. Position 0 holds BOS; the n-th output token sits at
      position n. A call may overwrite positions a previous call wrote: that is how rejected tokens are
      rolled back. start_B may also be a scalar int32 [] (every row at the same position: greedy and beam
      search), which lets the model write its cache with one slice for the whole batch instead of a
      per-row scatter; the outputs are the same as with jnp.full((B,), start).
  propose_fn(hidden_Bx...) -> logits_Bx(k-1)xV
      Heads 2..k at one position per row (the hidden state that score_fn returned for it).

Tree decoding (`tree`) calls score_fn with a fourth argument, the tree (depth_N, ancestor_NxN), numpy arrays
built at trace time: token n goes to cache slot start_B[b] + n, at position start_B[b] + depth_N[n], and
attends to the slots before start_B[b] and to the slots of the nodes m with ancestor_NxN[n, m] (its ancestors
and itself) only. Without it (None, or not passed) slots are positions and the block is causal, as above. And it
takes a third function:
  move_fn(state, start_B, source_BxD) -> new_state
      Copies what slot start_B[b] + source_BxD[b, d] holds to slot start_B[b] + d, for every d, as if the
      tokens had been fed there (the accepted path of a tree, made contiguous).

All functions here are pure and traceable: jit the function that calls them (the model's parameters as
its argument), with k, max_len, the criterion and the special ids static. Every loop is a
`lax.while_loop`: no host round-trip per step.

Output convention (all three decoders): tokens [B, max_len], the n-th token at index n-1, EOS included,
0 (padding) after it.

Definitions (DESIGN §2; Stern et al. 2018, §3-§4):
  mean accepted block size = tokens produced (EOS included, padding excluded) / decoding iterations,
      both summed over rows (and over the evaluation set by the caller).
  An iteration produces its accepted block k̂ and, when the scoring model's next token ends the row (EOS, or
      the max_len-th token), that token too: the verification call already computed it (head 1 at the last
      accepted position), and it would be accepted unverified, so a further call to accept it alone would be
      wasted. Block sizes then run 1..k+1. A row whose first token ends it is produced by the initial call
      alone, with no iteration.
  model invocations = iterations + 1: the combined scoring-and-proposal step verifies block n and
      proposes block n + 1 in one call; one more call at the start proposes the first block.
"""

import dataclasses
from typing import Any, Callable

import jax
import jax.numpy as jnp
import flax
import numpy as np

from bpd.errors import UserError

PAD_ID = 0

ScoreFn = Callable[[Any, jax.Array, jax.Array], tuple[jax.Array, Any, Any]]
ProposeFn = Callable[[Any], jax.Array]
MoveFn = Callable[[Any, jax.Array, jax.Array], Any]


# -- acceptance criteria (paper §5) ------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class Criterion:
  """When the scoring model accepts a proposed token ŷ, given head 1's logits at the position before it.

  kind 'exact': ŷ == argmax p_1 (output identical to greedy decoding).
  kind 'top_k': ŷ is among the `top_k` most likely tokens of p_1 (paper: top-2 on translation).
  kind 'distance': |ŷ - argmax p_1| <= `eps`, for ordinal outputs such as pixel intensities (paper: 2).
  min_block: accept at least this many tokens per iteration whatever the checks say (paper §5.3): k̂ is
    max(verified prefix, min_block). (Not "accept min_block, then keep verifying the rest": a check that
    failed inside the forced prefix is not skipped over.)
  Hashable, so it can be a static argument of jit.
  """
  kind: str = 'exact'
  top_k: int = 1
  eps: int = 0
  min_block: int = 1

  def __str__(self):
    name = {'exact': 'exact', 'top_k': f'top_k:{self.top_k}', 'distance': f'distance:{self.eps}'}[self.kind]
    if self.min_block == 1:
      return name
    return f'min_block:{self.min_block}' if self.kind == 'exact' else f'{name}+min_block:{self.min_block}'


CRITERION_HELP = ("a criterion is 'exact', 'top_k:T' (T >= 1), 'distance:EPS' (EPS >= 0) or 'min_block:L' "
                  "(1 <= L <= k), or a check and a minimum block joined by '+', e.g. 'top_k:2+min_block:2'")


def parse_criterion(spec: str, k: int | None = None) -> Criterion:
  """Parses 'exact', 'top_k:2', 'distance:2', 'min_block:3', 'top_k:2+min_block:2', ... .

  Raises UserError naming the bad part and the accepted forms. With k given, checks min_block <= k.
  """
  kind, top_k, eps, min_block = 'exact', 1, 0, 1
  seen_check = False
  for part in [p.strip() for p in str(spec).split('+')]:
    name, _, arg = part.partition(':')
    if name == 'exact' and not arg:
      value = None
    elif name in ('top_k', 'distance', 'min_block') and arg:
      try:
        value = int(arg)
      except ValueError:
        raise UserError(f'Criterion {spec!r}: {arg!r} in {part!r} is not an integer; {CRITERION_HELP}.') from None
    else:
      raise UserError(f'Unknown criterion {part!r} in {spec!r}: {CRITERION_HELP}.')
    if name == 'min_block':
      if value < 1 or (k is not None and value > k):
        bound = f' and at most k={k}' if k is not None else ''
        raise UserError(f'Criterion {spec!r}: min_block must be at least 1{bound}, got {value}; '
                        'a block cannot be longer than the number of heads.')
      min_block = value
      continue
    if seen_check:
      raise UserError(f'Criterion {spec!r} combines two checks; {CRITERION_HELP}.')
    seen_check = True
    if name == 'top_k':
      if value < 1:
        raise UserError(f'Criterion {spec!r}: top_k needs T >= 1, got {value} (top_k:1 is exact).')
      kind, top_k = 'top_k', value
    elif name == 'distance':
      if value < 0:
        raise UserError(f'Criterion {spec!r}: distance needs EPS >= 0, got {value} (distance:0 is exact).')
      kind, eps = 'distance', value
  return Criterion(kind=kind, top_k=top_k, eps=eps, min_block=min_block)


def argmax(logits_Bx___xV: jax.Array) -> jax.Array:
  """jnp.argmax over the last axis (the first index of the maximum: ties go to the lower id), int32 [B, ...].

  With several rows per batch element ([B, k, V]: verification, proposals) it is taken as the top 1 of lax.top_k,
  which XLA's CPU backend ran faster than argmax's (value, index) pair reduction there; with one row per element
  ([B, V], greedy's step) as jnp.argmax, which was faster than top_k there: each loop gets the faster one
  (experiments/profile_decode.py, experiments/bench_decode.py). Not as max-then-first-index-equal: two reductions
  that XLA may fuse with two copies of the logits' computation, which can round differently (one contracts a
  multiply-add, the other not), so that no entry equals "the" maximum.
  """
  if logits_Bx___xV.ndim == 2:
    return jnp.argmax(logits_Bx___xV, axis=-1).astype(jnp.int32)
  return jax.lax.top_k(logits_Bx___xV, 1)[1][..., 0].astype(jnp.int32)


def accept_mask(criterion: Criterion, proposals_BxN: jax.Array, logits_BxNxV: jax.Array,
                best_BxN: jax.Array | None = None) -> jax.Array:
  """Whether each proposed token passes the check against head 1's logits at the position before it. [B, N].

  best_BxN: argmax(logits_BxNxV) when the caller has it already (exact and distance need nothing else)."""
  best_BxN = argmax(logits_BxNxV) if best_BxN is None else best_BxN
  if criterion.kind == 'exact':
    return proposals_BxN == best_BxN
  if criterion.kind == 'distance':
    return jnp.abs(proposals_BxN - best_BxN) <= criterion.eps
  if criterion.kind == 'top_k':
    # Rank of the proposal with ties broken by index, as argmax breaks them: rank 0 <=> it is the argmax,
    # so top_k:1 accepts exactly what exact accepts.
    proposed_BxNx1 = jnp.take_along_axis(logits_BxNxV, proposals_BxN[..., None], axis=-1)
    vocab_ids = jnp.arange(logits_BxNxV.shape[-1])
    ahead_BxNxV = (logits_BxNxV > proposed_BxNx1) | (
        (logits_BxNxV == proposed_BxNx1) & (vocab_ids < proposals_BxN[..., None]))
    return jnp.sum(ahead_BxNxV, axis=-1) < criterion.top_k
  raise ValueError(f'unknown criterion kind {criterion.kind!r}')


def block_size(criterion: Criterion, checks_BxN: jax.Array) -> jax.Array:
  """k̂ = 1 + the number of leading passed checks (ŷ_{j+1} always passes: head 1 proposed it), at least
  criterion.min_block. checks_BxN are the checks of proposals 2..k (N = k - 1). Returns [B] int32."""
  leading_B = jnp.sum(jnp.cumprod(checks_BxN.astype(jnp.int32), axis=-1), axis=-1)
  return jnp.maximum(1 + leading_B, criterion.min_block).astype(jnp.int32)


# -- greedy ------------------------------------------------------------------------------------------------

def take_rows(tree, index_B):
  """Row b of every leaf at index_B[b] along axis 1: [B, T, ...] -> [B, ...]."""
  return jax.tree.map(lambda x: x[jnp.arange(x.shape[0]), index_B], tree)


def _mask_after(tokens_BxL, length_B):
  """Padding at every index >= length_B[b]."""
  return jnp.where(jnp.arange(tokens_BxL.shape[1])[None, :] < length_B[:, None], tokens_BxL, PAD_ID)


def greedy_init(state: Any, *, batch_size: int, max_len: int, bos_id: int) -> tuple:
  """The initial carry of greedy's loop: (step [], last_B, tokens_BxL [B, max_len], length_B, done_B, state)."""
  B = batch_size
  return (jnp.int32(0), jnp.full((B,), bos_id, jnp.int32), jnp.zeros((B, max_len), jnp.int32),
          jnp.zeros((B,), jnp.int32), jnp.zeros((B,), bool), state)


def greedy_body(score_fn: ScoreFn, *, eos_id: int):
  """One greedy step, the body of `greedy`'s while_loop: carry -> carry.

  carry = (step [], last_B, tokens_BxL, length_B, done_B, state). Public so that a benchmark can compile and
  cost-analyse exactly one step (XLA's cost analysis counts a while_loop's body once, not per iteration).
  """
  def body(carry):
    step, last_B, tokens_BxL, length_B, done_B, state = carry
    # Every row sits at position `step`: a scalar start, so the cache write is one slice, not a per-row scatter.
    logits_Bx1xV, _, state = score_fn(state, last_B[:, None], step)
    next_B = argmax(logits_Bx1xV[:, 0])
    tokens_BxL = tokens_BxL.at[:, step].set(jnp.where(done_B, PAD_ID, next_B))
    length_B = length_B + (~done_B).astype(jnp.int32)
    done_B = done_B | (next_B == eos_id)
    return step + 1, next_B, tokens_BxL, length_B, done_B, state
  return body


def greedy(score_fn: ScoreFn, state: Any, *, batch_size: int, max_len: int, bos_id: int, eos_id: int):
  """Greedy decoding with the cached decoder: one token per row per model call.

  Returns (tokens_BxL [B, max_len], length_B [B] tokens produced with EOS, steps: model invocations).
  """
  def cond(carry):
    step, _, _, _, done_B, _ = carry
    return (step < max_len) & ~jnp.all(done_B)

  carry = greedy_init(state, batch_size=batch_size, max_len=max_len, bos_id=bos_id)
  steps, _, tokens_BxL, length_B, _, _ = jax.lax.while_loop(cond, greedy_body(score_fn, eos_id=eos_id), carry)
  return tokens_BxL, length_B, steps


# -- blockwise parallel decoding (paper §3-§4) -------------------------------------------------------------

@flax.struct.dataclass
class Rows:
  """What every blockwise loop (chain, tree, speculative sampling) keeps per row: the output and its statistics.
  j = length_B[b] tokens accepted so far in row b; D = the most tokens an iteration accepts (k for the chain)."""
  tokens_BxL: jax.Array        # int32 [B, max_len + D]; indices >= length_B[b] hold stale proposals
  length_B: jax.Array          # int32 [B]; tokens accepted (EOS included)
  done_B: jax.Array            # bool [B]; EOS accepted or max_len reached
  iterations_B: jax.Array      # int32 [B]; iterations in which row b was still decoding
  block_counts_BxD: jax.Array  # int32 [B, D + 1]; [b, n-1] = iterations of row b that produced n tokens


@flax.struct.dataclass
class DecodeState:
  """The carry of the blockwise loop."""
  model_state: Any            # opaque decoder state (KV cache, encoder keys/values); leaves [B, ...]
  rows: Rows                  # D = k
  proposals_BxK: jax.Array    # int32 [B, k]; ŷ_{j+1} .. ŷ_{j+k} for the next iteration
  step: jax.Array             # int32 []; loop iterations (= model invocations - 1)


@flax.struct.dataclass
class BlockwiseResult:
  tokens_BxL: jax.Array        # int32 [B, max_len]
  length_B: jax.Array          # int32 [B]; tokens produced, EOS included
  iterations_B: jax.Array      # int32 [B]
  block_counts_BxK: jax.Array  # int32 [B, k + 1]; histogram of the tokens produced per iteration, 1..k+1
  invocations: jax.Array       # int32 []; model calls for the whole batch (loop iterations + 1)


def end_with_next_token(rows: Rows, next_B, *, eos_id: int, max_len: int) -> tuple[Rows, jax.Array]:
  """Appends the scoring model's next token next_B (head 1's choice after the accepted prefix) where it ends the
  row: it is EOS, or the max_len-th token. The next iteration would accept it unverified (ŷ_{j+1} always passes)
  and nothing else, a model call for nothing. Returns (rows, ended_B).

  Writing next_B at length_B in the other rows too is harmless: the next iteration writes its proposals from there,
  the first of which is next_B; finished rows are masked past their length at the end.
  """
  ended_B = ~rows.done_B & ((next_B == eos_id) | (rows.length_B + 1 >= max_len))
  tokens_BxL = rows.tokens_BxL.at[jnp.arange(next_B.shape[0]), rows.length_B].set(next_B)
  return rows.replace(tokens_BxL=tokens_BxL, length_B=rows.length_B + ended_B.astype(jnp.int32),
                      done_B=rows.done_B | ended_B), ended_B


def start_rows(first_B, *, depth: int, max_len: int, eos_id: int) -> Rows:
  """The rows after the first model call, which only proposes: empty, except that a row whose first token first_B
  ends it (EOS, or max_len = 1) is done with this call."""
  B = first_B.shape[0]
  rows = Rows(tokens_BxL=jnp.zeros((B, max_len + depth), jnp.int32), length_B=jnp.zeros((B,), jnp.int32),
              done_B=jnp.zeros((B,), bool), iterations_B=jnp.zeros((B,), jnp.int32),
              block_counts_BxD=jnp.zeros((B, depth + 1), jnp.int32))
  return end_with_next_token(rows, first_B, eos_id=eos_id, max_len=max_len)[0]


def accept_block(rows: Rows, block_BxD, k_hat_B, *, eos_id: int, max_len: int) -> tuple[Rows, jax.Array]:
  """Accepts block_BxD[b, :k̂] in every row, the one rule of every loop: k̂ is cut at the first EOS inside the
  accepted block and at max_len, and is 0 in finished rows. The whole block is written at j (the rejected tail is
  overwritten next time or masked at the end). Returns (rows, the cut k_hat_B int32 [B])."""
  eos_in_block_BxD = (block_BxD == eos_id) & (jnp.arange(block_BxD.shape[1])[None, :] < k_hat_B[:, None])
  has_eos_B = jnp.any(eos_in_block_BxD, axis=1)
  k_hat_B = jnp.where(has_eos_B, jnp.argmax(eos_in_block_BxD, axis=1) + 1, k_hat_B)
  k_hat_B = jnp.where(rows.done_B, 0, jnp.minimum(k_hat_B, max_len - rows.length_B)).astype(jnp.int32)
  tokens_BxL = jax.vmap(lambda row, new, j: jax.lax.dynamic_update_slice(row, new, (j,)))(
      rows.tokens_BxL, block_BxD, jnp.minimum(rows.length_B, max_len))
  length_B = rows.length_B + k_hat_B
  return rows.replace(tokens_BxL=tokens_BxL, length_B=length_B,
                      done_B=rows.done_B | has_eos_B | (length_B >= max_len)), k_hat_B


def close_iteration(before: Rows, rows: Rows, k_hat_B, next_B, *, eos_id: int, max_len: int) -> Rows:
  """Ends an iteration that started from `before` and accepted k_hat_B (`accept_block`): appends next_B where it
  ends the row (`end_with_next_token`) and counts the iteration and its produced tokens in the rows that were
  still decoding."""
  rows, ended_B = end_with_next_token(rows, next_B, eos_id=eos_id, max_len=max_len)
  active_B = ~before.done_B
  produced_B = k_hat_B + ended_B.astype(jnp.int32)
  depth = rows.block_counts_BxD.shape[1] - 1
  return rows.replace(
      iterations_B=rows.iterations_B + active_B.astype(jnp.int32),
      block_counts_BxD=rows.block_counts_BxD + (
          active_B[:, None] & (jnp.arange(1, depth + 2)[None, :] == produced_B[:, None])).astype(jnp.int32))


def run_loop(first, body, *, max_len: int) -> BlockwiseResult:
  """Runs body (state -> state; every loop's state has .rows and .step) from `first` until every row is done."""
  def cond(s):
    return (s.step < max_len) & ~jnp.all(s.rows.done_B)

  s = jax.lax.while_loop(cond, body, first)
  return BlockwiseResult(
      tokens_BxL=_mask_after(s.rows.tokens_BxL[:, :max_len], s.rows.length_B),
      length_B=s.rows.length_B,
      iterations_B=s.rows.iterations_B,
      block_counts_BxK=s.rows.block_counts_BxD,
      invocations=s.step + 1)


def _proposals(head1_B, hidden_Bx___, propose_fn, k):
  """ŷ_{j+1} = head1_B (head 1's argmax), ŷ_{j+2..j+k} from heads 2..k, all at the last accepted position. [B, k]."""
  head1_Bx1 = head1_B[:, None].astype(jnp.int32)
  if k == 1:
    return head1_Bx1
  rest_BxKm1 = argmax(propose_fn(hidden_Bx___))
  return jnp.concatenate([head1_Bx1, rest_BxKm1], axis=1)


def blockwise_init(score_fn: ScoreFn, propose_fn: ProposeFn, state: Any, *, batch_size: int, k: int, max_len: int,
                   bos_id: int, eos_id: int) -> DecodeState:
  """The first model invocation (it only proposes ŷ_1..ŷ_k from BOS) and the loop's initial DecodeState."""
  B = batch_size
  logits_Bx1xV, hidden, state = score_fn(state, jnp.full((B, 1), bos_id, jnp.int32), jnp.zeros((B,), jnp.int32))
  proposals_BxK = _proposals(argmax(logits_Bx1xV[:, 0]), take_rows(hidden, jnp.zeros((B,), jnp.int32)),
                             propose_fn, k)
  return DecodeState(model_state=state, rows=start_rows(proposals_BxK[:, 0], depth=k, max_len=max_len, eos_id=eos_id),
                     proposals_BxK=proposals_BxK, step=jnp.int32(0))


def blockwise_body(score_fn: ScoreFn, propose_fn: ProposeFn, *, k: int, max_len: int, eos_id: int,
                   criterion: Criterion = Criterion()):
  """One blockwise iteration (verify k, accept k̂, propose the next k), the body of `blockwise`'s while_loop:
  DecodeState -> DecodeState. Public so that a benchmark can compile and cost-analyse exactly one iteration."""
  def body(s: DecodeState):
    B = s.rows.length_B.shape[0]
    proposals_BxK = s.proposals_BxK
    # Verify: position j+i carries ŷ_{j+i}; its head-1 output scores ŷ_{j+i+1}.
    logits_BxKxV, hidden, model_state = score_fn(s.model_state, proposals_BxK, s.rows.length_B + 1)
    # One argmax over all k positions: the first k - 1 check proposals 2..k, the last accepted one is ŷ_{j+k̂+1}.
    best_BxK = argmax(logits_BxKxV)
    checks_BxKm1 = accept_mask(criterion, proposals_BxK[:, 1:], logits_BxKxV[:, :-1], best_BxK[:, :-1])
    k_hat_B = jnp.minimum(block_size(criterion, checks_BxKm1), k)
    # Accept: cut at the first EOS inside the block and at max_len; write all k proposals at j.
    rows, k_hat_B = accept_block(s.rows, proposals_BxK, k_hat_B, eos_id=eos_id, max_len=max_len)
    last_B = jnp.maximum(k_hat_B - 1, 0)  # index in this block of the last accepted position, j + k̂
    next_BxK = _proposals(best_BxK[jnp.arange(B), last_B], take_rows(hidden, last_B), propose_fn, k)
    rows = close_iteration(s.rows, rows, k_hat_B, next_BxK[:, 0], eos_id=eos_id, max_len=max_len)
    return DecodeState(model_state=model_state, rows=rows, proposals_BxK=next_BxK, step=s.step + 1)
  return body


def blockwise(score_fn: ScoreFn, propose_fn: ProposeFn, state: Any, *, batch_size: int, k: int, max_len: int,
              bos_id: int, eos_id: int, criterion: Criterion = Criterion()) -> BlockwiseResult:
  """Blockwise parallel decoding with combined scoring and proposal (paper §4).

  One model invocation per iteration: feed ŷ_{j+1..j+k} at positions j+1..j+k; head 1's outputs at
  positions j+1..j+k-1 verify ŷ_{j+2..j+k}; accept the longest verified prefix (k̂ tokens); the outputs
  at position j+k̂ (head 1 from this call, heads 2..k projected only there) are the next proposals.
  Each row accepts its own k̂. The model state needs a cache of at least max_len + k + 1 positions.
  """
  if criterion.min_block > k:
    raise UserError(f'min_block={criterion.min_block} is larger than k={k}: lower min_block or raise k.')

  first = blockwise_init(score_fn, propose_fn, state, batch_size=batch_size, k=k, max_len=max_len, bos_id=bos_id,
                         eos_id=eos_id)
  body = blockwise_body(score_fn, propose_fn, k=k, max_len=max_len, eos_id=eos_id, criterion=criterion)
  return run_loop(first, body, max_len=max_len)


# -- tree-structured candidates (beyond the paper: Medusa, Cai et al. 2024; DESIGN §3) ---------------------
#
# The chain above verifies one candidate block per iteration: if head 2's top choice is wrong, the iteration
# accepts one token however good heads 3..k are. A tree verifies several candidate blocks in the same call. A
# topology is a tuple of paths; a path (r_0, .., r_d) is the node at depth d whose token is the r_d-th most
# likely choice (rank 0 = argmax) of head d + 1, under the parent node (r_0, .., r_{d-1}). So ((0,), (0, 0),
# (0, 1)) verifies "head 1's choice, then head 2's first or second choice". Every root-to-node path is a
# candidate block; the chain of k is the one-path tree ((0,), (0, 0), .., (0,) * k).
#
# One model call scores all N nodes: node n sits in cache slot start + n (start = j + 1) at position start +
# depth(n), and attends to the cached prefix and its own ancestors only (the ancestor mask). Node n's head-1
# output checks its children, as position j + i checks ŷ_{j+i+1} in the chain. The longest accepted path wins;
# its keys and values are moved to the contiguous slots start .. start + k̂ - 1 (`move_fn`), and the rest of the
# tree stays behind as stale slots, masked and overwritten like the chain's rejected tokens.

TreePaths = tuple  # tuple of paths, each a tuple of ranks; hashable, so a static jit argument


def chain_tree(k: int) -> TreePaths:
  """The chain of k proposals as a tree: ((0,), (0, 0), .., (0,) * k)."""
  return tuple((0,) * depth for depth in range(1, k + 1))


def check_tree(paths, k: int, max_rank: int | None = None) -> TreePaths:
  """A validated tree topology in canonical order (by depth, then by ranks), or UserError.

  k: the heads available (a path may be at most k long: depth k - 1 uses head k). max_rank: the choices each
  head offers (the vocabulary size), ranks must be below it. The tree must contain (0,), head 1's own choice,
  which every criterion accepts: every iteration then makes progress.
  """
  what = 'a tree is a tuple of paths, each a non-empty tuple of ranks >= 0, e.g. ((0,), (1,), (0, 0), (0, 1))'
  try:
    paths = [tuple(int(r) for r in path) for path in paths]
  except (TypeError, ValueError):
    raise UserError(f'Tree {paths!r}: {what}.') from None
  seen = set()
  for path in paths:
    if not path or min(path) < 0:
      raise UserError(f'Tree path {path!r}: {what}.')
    if path in seen:
      raise UserError(f'Tree path {path!r} appears twice: each node once.')
    seen.add(path)
    if len(path) > k:
      raise UserError(f'Tree path {path!r} has depth {len(path) - 1}, but with k={k} heads the deepest node is at '
                      f'depth {k - 1} (head d + 1 proposes depth d): shorten the path or decode with more heads.')
    if max_rank is not None and max(path) >= max_rank:
      raise UserError(f'Tree path {path!r} asks for rank {max(path)}, but a head offers only the top {max_rank} '
                      f'choices (ranks 0..{max_rank - 1}).')
  for path in paths:
    if len(path) > 1 and path[:-1] not in seen:
      raise UserError(f'Tree path {path!r}: its parent {path[:-1]!r} is missing; a tree holds every prefix of '
                      'every path.')
  if (0,) not in seen:
    raise UserError('A tree must contain the path (0,): head 1\'s own choice, which every criterion accepts '
                    '(without it an iteration could accept nothing).')
  return tuple(sorted(paths, key=lambda path: (len(path), path)))


def tree_depth(paths: TreePaths) -> int:
  """The longest path: the most tokens an iteration can accept, and the heads the tree uses."""
  return max(len(path) for path in paths)


def tree_layout(paths: TreePaths) -> dict:
  """Numpy arrays describing a canonical tree (`check_tree`), built once at trace time.

  depth_N: depth of node n (0 = a candidate for y_{j+1}); rank_N: its rank among its head's choices;
  parent_N: index of its parent (-1 at depth 0); ancestor_NxN[n, m]: m is n or an ancestor of n (the
  attention mask among the new slots); path_NxD[n, d]: the node at depth d on the path to n (n itself past
  its depth, never read); zero_path_D: the node (0,) * (d + 1), or -1 where the tree lacks it.
  """
  index = {path: n for n, path in enumerate(paths)}
  num, depth = len(paths), tree_depth(paths)
  ancestor_NxN = np.zeros((num, num), bool)
  path_NxD = np.zeros((num, depth), np.int32)
  for n, path in enumerate(paths):
    for d in range(depth):
      path_NxD[n, d] = index[path[:d + 1]] if d < len(path) else n
    for d in range(len(path)):
      ancestor_NxN[n, index[path[:d + 1]]] = True
  return {
      'depth_N': np.array([len(p) - 1 for p in paths], np.int32),
      'rank_N': np.array([p[-1] for p in paths], np.int32),
      'parent_N': np.array([index[p[:-1]] if len(p) > 1 else -1 for p in paths], np.int32),
      'ancestor_NxN': ancestor_NxN,
      'path_NxD': path_NxD,
      'zero_path_D': np.array([index.get((0,) * (d + 1), -1) for d in range(depth)], np.int32),
  }


@flax.struct.dataclass
class TreeState:
  """The carry of the tree loop. N nodes, D = tree depth."""
  model_state: Any            # opaque decoder state; leaves [B, ...]
  rows: Rows                  # D = tree depth
  nodes_BxN: jax.Array        # int32 [B, N]; the token at every node of the next tree
  root_ok_BxN: jax.Array      # bool [B, N]; depth-0 nodes: passed the check against head 1 at j; others True
  step: jax.Array             # int32 []


def _tree_nodes(logits_BxV, hidden_Bx___, propose_fn, layout, criterion):
  """The next tree from the outputs at the last accepted position: (nodes_BxN, root_ok_BxN).

  Node n gets rank_N[n] of head depth_N[n] + 1 (heads 2..D from propose_fn, Medusa-style: a head's choices do
  not depend on the node's parent). Depth-0 nodes are checked here against head 1 (rank 0 always passes).
  """
  depth = layout['path_NxD'].shape[1]
  heads_BxDxV = logits_BxV[:, None]
  if depth > 1:
    heads_BxDxV = jnp.concatenate([heads_BxDxV, propose_fn(hidden_Bx___)[:, :depth - 1]], axis=1)
  ranks = int(layout['rank_N'].max()) + 1
  if ranks == 1:
    choices_BxDxR = argmax(heads_BxDxV)[..., None]
  else:
    choices_BxDxR = jax.lax.top_k(heads_BxDxV, ranks)[1]  # ties: the lower id first, as argmax breaks them
  nodes_BxN = choices_BxDxR[:, layout['depth_N'], layout['rank_N']].astype(jnp.int32)
  roots = np.nonzero(layout['depth_N'] == 0)[0]
  roots_logits_BxRxV = jnp.broadcast_to(logits_BxV[:, None], (logits_BxV.shape[0], len(roots), logits_BxV.shape[-1]))
  root_ok_BxN = jnp.ones(nodes_BxN.shape, bool).at[:, roots].set(
      accept_mask(criterion, nodes_BxN[:, roots], roots_logits_BxRxV))
  return nodes_BxN, root_ok_BxN


def tree_init(score_fn: ScoreFn, propose_fn: ProposeFn, state: Any, *, batch_size: int, paths: TreePaths,
              max_len: int, bos_id: int, eos_id: int, criterion: Criterion = Criterion()) -> TreeState:
  """The first model invocation (it only proposes the first tree from BOS) and the loop's initial TreeState."""
  B, layout = batch_size, tree_layout(paths)
  depth = tree_depth(paths)
  logits_Bx1xV, hidden, state = score_fn(state, jnp.full((B, 1), bos_id, jnp.int32), jnp.zeros((B,), jnp.int32))
  nodes_BxN, root_ok_BxN = _tree_nodes(logits_Bx1xV[:, 0], take_rows(hidden, jnp.zeros((B,), jnp.int32)),
                                       propose_fn, layout, criterion)
  rows = start_rows(argmax(logits_Bx1xV[:, 0]), depth=depth, max_len=max_len, eos_id=eos_id)
  return TreeState(model_state=state, rows=rows, nodes_BxN=nodes_BxN, root_ok_BxN=root_ok_BxN, step=jnp.int32(0))


def tree_body(score_fn: ScoreFn, propose_fn: ProposeFn, move_fn: MoveFn, *, paths: TreePaths, max_len: int,
              eos_id: int, criterion: Criterion = Criterion()):
  """One tree iteration (verify N nodes, accept the longest passing path, move it into place, propose the next
  tree), the body of `tree`'s while_loop: TreeState -> TreeState."""
  layout = tree_layout(paths)
  depth = tree_depth(paths)
  depth_N, parent_N, path_NxD = layout['depth_N'], layout['parent_N'], layout['path_NxD']
  inner = np.nonzero(parent_N >= 0)[0]  # nodes checked in this call (depth-0 nodes were checked at proposal)

  def body(s: TreeState):
    B = s.rows.length_B.shape[0]
    start_B = s.rows.length_B + 1
    # Verify: node n in slot start + n at position start + depth(n), seeing the prefix and its ancestors.
    logits_BxNxV, hidden, model_state = score_fn(s.model_state, s.nodes_BxN, start_B,
                                                 (depth_N, layout['ancestor_NxN']))
    ok_BxN = s.root_ok_BxN
    if len(inner):  # a node passes against its parent's head-1 output (the chain's position j+i checks ŷ_{j+i+1})
      ok_BxN = ok_BxN.at[:, inner].set(
          accept_mask(criterion, s.nodes_BxN[:, inner], logits_BxNxV[:, parent_N[inner]]))
    # A node is accepted when it and all its ancestors pass; the deepest accepted node wins (ties: the first
    # in canonical order, i.e. the higher-ranked choices).
    accepted_BxN = ~jnp.any(layout['ancestor_NxN'][None] & ~ok_BxN[:, None, :], axis=-1)
    best_B = jnp.argmax(jnp.where(accepted_BxN, depth_N[None] + 1, 0), axis=1)
    k_hat_B = jnp.asarray(depth_N)[best_B] + 1
    if criterion.min_block > 1:  # forced: the all-rank-0 path of min_block nodes (the chain's first L proposals)
      forced = int(layout['zero_path_D'][criterion.min_block - 1])
      best_B = jnp.where(k_hat_B < criterion.min_block, forced, best_B)
      k_hat_B = jnp.maximum(k_hat_B, criterion.min_block)
    path_BxD = jnp.asarray(path_NxD)[best_B]
    block_BxD = jnp.take_along_axis(s.nodes_BxN, path_BxD, axis=1)
    # Stop at the first EOS inside the accepted block, and at max_len (as the chain does).
    rows, k_hat_B = accept_block(s.rows, block_BxD, k_hat_B, eos_id=eos_id, max_len=max_len)
    # The accepted path's keys and values go to slots start .. start + D - 1 (past k̂: stale, masked later).
    model_state = move_fn(model_state, start_B, path_BxD)
    last_B = jnp.take_along_axis(path_BxD, jnp.maximum(k_hat_B - 1, 0)[:, None], axis=1)[:, 0]  # node of j + k̂
    logits_BxV = logits_BxNxV[jnp.arange(B), last_B]
    nodes_BxN, root_ok_BxN = _tree_nodes(logits_BxV, take_rows(hidden, last_B), propose_fn, layout, criterion)
    rows = close_iteration(s.rows, rows, k_hat_B, argmax(logits_BxV), eos_id=eos_id, max_len=max_len)
    return TreeState(model_state=model_state, rows=rows, nodes_BxN=nodes_BxN, root_ok_BxN=root_ok_BxN,
                     step=s.step + 1)
  return body


def tree(score_fn: ScoreFn, propose_fn: ProposeFn, move_fn: MoveFn, state: Any, *, batch_size: int,
         paths: TreePaths, k: int, max_len: int, bos_id: int, eos_id: int,
         criterion: Criterion = Criterion()) -> BlockwiseResult:
  """Blockwise parallel decoding that verifies a tree of candidate blocks per iteration (section comment above).

  paths: a topology (`check_tree`), static; k: the heads propose_fn offers (the tree uses the first D =
  tree_depth(paths)). One model invocation per iteration, as the chain: score_fn is called with the tree
  (depth_N, ancestor_NxN) as a fourth argument. The state needs a cache of at least max_len + N + 1 slots.
  With the one-path tree chain_tree(k) the result equals `blockwise` with k heads exactly. The result's
  block_counts_BxK has D + 1 columns.
  """
  paths = check_tree(paths, k)
  zero_path_D = tree_layout(paths)['zero_path_D']
  if criterion.min_block > 1 and (criterion.min_block > len(zero_path_D) or zero_path_D[criterion.min_block - 1] < 0):
    raise UserError(f'min_block={criterion.min_block} forces the path {(0,) * criterion.min_block} of rank-0 '
                    f'choices (the chain\'s first proposals), which the tree {paths} lacks: add it or lower min_block.')

  first = tree_init(score_fn, propose_fn, state, batch_size=batch_size, paths=paths, max_len=max_len, bos_id=bos_id,
                    eos_id=eos_id, criterion=criterion)
  body = tree_body(score_fn, propose_fn, move_fn, paths=paths, max_len=max_len, eos_id=eos_id, criterion=criterion)
  return run_loop(first, body, max_len=max_len)


def summarize(result: BlockwiseResult) -> dict:
  """Host-side statistics of one decoded batch (sum them over batches, then divide; DESIGN §2)."""
  tokens = int(jnp.sum(result.length_B))
  iterations = int(jnp.sum(result.iterations_B))
  return {
      'tokens': tokens,
      'iterations': iterations,
      'row_invocations': iterations + int(result.length_B.shape[0]),
      'batch_invocations': int(result.invocations),
      'mean_accepted_block_size': tokens / max(iterations, 1),
      'block_size_histogram': [int(c) for c in jnp.sum(result.block_counts_BxK, axis=0)],
  }


# -- beam search (teacher for distillation; style of flax examples/wmt decode.py) ---------------------------

def brevity_penalty(alpha: float, length) -> jax.Array:
  """Length penalty of Wu et al. 2016: ((5 + length) / 6) ** alpha."""
  return jnp.power((5.0 + jnp.asarray(length, jnp.float32)) / 6.0, alpha)


def beam_search(score_fn: ScoreFn, state: Any, *, batch_size: int, beam_size: int, max_len: int, bos_id: int,
                eos_id: int, alpha: float = 0.6):
  """Beam search with a length penalty; `state` has batch_size rows and is tiled to batch_size * beam_size.

  Returns (tokens_BxWxL [B, beam, max_len], scores_BxW), best first; scores are log-probabilities divided by
  the brevity penalty. Beams that never emit EOS are returned if no beam finished.
  """
  B, W = batch_size, beam_size
  neg_inf = jnp.float32(-1e7)
  state = jax.tree.map(lambda x: jnp.repeat(x, W, axis=0), state)
  batch_pos_BxW = jnp.arange(B)[:, None] * W

  def gather_beams(x_BxWx___, beam_idx_BxN):
    return jnp.take_along_axis(x_BxWx___, beam_idx_BxN.reshape(beam_idx_BxN.shape + (1,) * (x_BxWx___.ndim - 2)),
                               axis=1)

  def cond(c):
    step, alive_logp_BxW, _, fin_score_BxW, fin_flag_BxW, _, _ = c
    # Stop once no alive beam can still beat the worst finished beam (its score can only fall with length).
    best_alive_B = alive_logp_BxW[:, 0] / brevity_penalty(alpha, max_len)
    worst_fin_B = jnp.min(jnp.where(fin_flag_BxW, fin_score_BxW, neg_inf), axis=1)
    all_settled = jnp.all(jnp.all(fin_flag_BxW, axis=1) & (worst_fin_B >= best_alive_B))
    return (step < max_len) & ~all_settled

  def body(c):
    step, alive_logp_BxW, alive_seq_BxWxL, fin_score_BxW, fin_flag_BxW, fin_seq_BxWxL, state = c
    last_BxW = jnp.where(step == 0, bos_id, alive_seq_BxWxL[:, :, jnp.maximum(step - 1, 0)])
    logits, _, state = score_fn(state, last_BxW.reshape(B * W, 1), jnp.full((B * W,), step, jnp.int32))
    logp_BxWxV = jax.nn.log_softmax(logits[:, 0].astype(jnp.float32)).reshape(B, W, -1)
    vocab = logp_BxWxV.shape[-1]
    cand_BxWV = (alive_logp_BxW[:, :, None] + logp_BxWxV).reshape(B, W * vocab)
    # 2W candidates: enough that W of them are not EOS.
    top_logp_Bx2W, top_idx_Bx2W = jax.lax.top_k(cand_BxWV, 2 * W)
    top_beam_Bx2W, top_tok_Bx2W = top_idx_Bx2W // vocab, top_idx_Bx2W % vocab
    top_seq = gather_beams(alive_seq_BxWxL, top_beam_Bx2W).at[:, :, step].set(top_tok_Bx2W)
    top_eos_Bx2W = top_tok_Bx2W == eos_id

    alive_cand_Bx2W = jnp.where(top_eos_Bx2W, neg_inf, top_logp_Bx2W)
    alive_logp_BxW, pick_BxW = jax.lax.top_k(alive_cand_Bx2W, W)
    alive_seq_BxWxL = gather_beams(top_seq, pick_BxW)
    origin_BxW = jnp.take_along_axis(top_beam_Bx2W, pick_BxW, axis=1)
    state = jax.tree.map(lambda x: x[(batch_pos_BxW + origin_BxW).reshape(-1)], state)

    # A hypothesis ends only where its EOS ranks among the W best candidates (as in fairseq): a runner-up
    # EOS that the beam did not choose is dropped. With W = 1 and alpha = 0 this makes beam search exactly
    # greedy; with alpha > 0 a longer hypothesis may still beat greedy's on length-normalized score.
    ends_Bx2W = top_eos_Bx2W & (jnp.arange(2 * W)[None, :] < W)
    new_fin_Bx2W = jnp.where(ends_Bx2W, top_logp_Bx2W / brevity_penalty(alpha, step + 1), neg_inf)
    all_score = jnp.concatenate([fin_score_BxW, new_fin_Bx2W], axis=1)
    all_flag = jnp.concatenate([fin_flag_BxW, ends_Bx2W], axis=1)
    all_seq = jnp.concatenate([fin_seq_BxWxL, top_seq], axis=1)
    fin_score_BxW, keep_BxW = jax.lax.top_k(jnp.where(all_flag, all_score, neg_inf), W)
    fin_flag_BxW = jnp.take_along_axis(all_flag, keep_BxW, axis=1)
    fin_seq_BxWxL = gather_beams(all_seq, keep_BxW)
    return step + 1, alive_logp_BxW, alive_seq_BxWxL, fin_score_BxW, fin_flag_BxW, fin_seq_BxWxL, state

  init_logp = jnp.concatenate([jnp.zeros((B, 1)), jnp.full((B, W - 1), neg_inf)], axis=1)
  carry = (jnp.int32(0), init_logp, jnp.zeros((B, W, max_len), jnp.int32), jnp.full((B, W), neg_inf),
           jnp.zeros((B, W), bool), jnp.zeros((B, W, max_len), jnp.int32), state)
  _, alive_logp, alive_seq, fin_score, fin_flag, fin_seq, _ = jax.lax.while_loop(cond, body, carry)
  any_fin_B = jnp.any(fin_flag, axis=1)
  tokens = jnp.where(any_fin_B[:, None, None], fin_seq, alive_seq)
  scores = jnp.where(any_fin_B[:, None], fin_score, alive_logp / brevity_penalty(alpha, max_len))
  return tokens, scores
