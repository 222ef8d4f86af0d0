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

Over a tree that is not a chain, blockwise calls score_fn with a fourth argument, the tree (depth_N,
ancestor_NxN): numpy arrays built once per topology, or per row (depth_BxN, ancestor_BxNxN) for a context-aware
tree (`Layout.mask`, `RowTree.mask`): token n goes to cache slot start_B[b] + n, at position start_B[b] +
depth[n], and attends to the slots before start_B[b] and to the slots of the nodes m with ancestor[n, m] (its
ancestors and itself) only.
Without it (None, or not passed) slots are positions and the block is causal, as above. And it takes a third
function:
  move_fn(state, start_B, source_BxD) -> new_state
      Copies what slot start_B[b] + source_BxD[b, d] holds to slot start_B[b] + d, for every d, as if the
      tokens had been fed there (the accepted path of a tree, made contiguous).
A context-aware tree (`Dynamic`) over heads whose choices depend on the token before them (sequential heads)
also takes a fourth:
  expand_fn(hidden_Bx..., depth, parents_BxW) -> logits_BxWxV
      Head depth + 1's logits at the row's last accepted position, fed each of W parent tokens (the nodes at depth
      depth - 1 it would continue): every parent gets its own children, as EAGLE-2 expands its draft tree.
The four travel together as a ModelFns.

All functions here are pure and traceable: jit the function that calls them (the model's parameters as
its argument), with the tree, the rule's static fields and the `Fixed` settings static. Every loop is a
`lax.while_loop`: no host round-trip per step. `blockwise` is the one blockwise loop (chains, static and
context-aware trees, greedy criteria and speculative sampling); greedy decoding and beam search have their own.

Output convention (every decoder): tokens [B, max_len], the n-th token at index n-1, EOS included,
0 (padding) after it.

Definitions (DESIGN §2; Stern et al. 2018, §3-§4):
  mean accepted block size = tokens produced (EOS included, padding excluded) / decoding iterations,
      both summed over rows (and over the evaluation set by the caller).
  An iteration produces its accepted block k̂ and, when the scoring model's next token ends the row (EOS, or
      the max_len-th token), that token too: the verification call already computed it (head 1 at the last
      accepted position), and it would be accepted unverified, so a further call to accept it alone would be
      wasted (unless another root of the tree could still pass: `Criterion.ends_early`). Block sizes then run
      1..k+1. A row whose first token ends it is produced by the initial call alone, with no iteration; it counts
      in the tokens and not in the block-size histogram (`summarize` reports it as first_call_tokens).
  model invocations = iterations + 1: the combined scoring-and-proposal step verifies block n and
      proposes block n + 1 in one call; one more call at the start proposes the first block.
"""

import dataclasses
import functools
from typing import Any, Callable, NamedTuple, Protocol

import jax
import jax.numpy as jnp
import flax
import numpy as np

from bpd import matmul
from bpd.errors import UserError

PAD_ID = 0

ScoreFn = Callable[[Any, jax.Array, jax.Array], tuple[jax.Array, Any, Any]]
ProposeFn = Callable[[Any], jax.Array]
MoveFn = Callable[[Any, jax.Array, jax.Array], Any]
ExpandFn = Callable[[Any, int, jax.Array], jax.Array]
InitFn = Callable[[jax.Array, int], Any]


# -- acceptance rules ----------------------------------------------------------------------------------------

class Rule(Protocol):
  """An acceptance rule: how the nodes get their tokens from the drafter's guesses and which are accepted. A small
  frozen object (a static argument of jit, or a pytree whose leaves are traced, as sampling's temperature); the loop
  calls nothing else of it. The greedy criteria are `Criterion` below, speculative sampling is bpd/speculative.py's
  `Sampling`. keys_B: one PRNG key per row for the block being drafted or verified (None unless `draws`)."""
  draws: bool  # the loop hands it a PRNG key per block

  def check(self, tree) -> None:
    """UserError if the rule cannot run on this tree (before anything is traced)."""

  def target(self, logits_BxV) -> Any:
    """What the first draft starts from, given head 1's logits after BOS."""

  def first(self, target, tree, keys_B) -> jax.Array:
    """Node 0's token [B], the next token itself (greedy: head 1's argmax; sampling: the free token, drawn from the
    target). Called on every tree (a chain, a Layout, a TreePolicy): the drafter gets it as DraftInputs.next_B, and a
    tree built per row grows from it as its root."""

  def draft(self, target, proposal, tree, keys_B) -> tuple[jax.Array, Any]:
    """(nodes_BxN, memo): the tokens of the next tree's nodes, from the target at the last accepted position
    (greedy rules: head 1's logits and argmax there; sampling: the distribution of the next token) and the
    drafter's guesses for depths 1..D-1 (a `Proposal`: heads 2..D's logits, or a drafter's one-hot rows, and where
    the drafter has them their argmaxes; or the tree's own tokens, `tree.token_BxN`, where it was built per row);
    memo: what accept will need (leaves [B, ...]). nodes_BxN[:, 0] must be the next token itself (the root of rank
    0)."""

  def accept(self, nodes_BxN, logits_BxNxV, memo, tree, keys_B) -> tuple[jax.Array, Any]:
    """(last_B, target) after the verification call: the deepest accepted node per row (k̂ = its depth + 1) and
    the target the next draft starts from."""

  def ends_early(self, tree) -> bool:
    """Whether the next token may be appended without an iteration when it ends the row (`end_with_next_token`):
    true when that iteration could only accept it alone."""


@flax.struct.dataclass
class Criterion:
  """Greedy acceptance (paper §5): when the scoring model accepts a proposed token ŷ, given head 1's logits at
  the position before it. Nodes take the heads' ranked choices (argmax for rank 0).

  kind 'exact': ŷ == argmax p_1 (output identical to greedy decoding).
  kind 'top_k': ŷ is among the `top_k` most likely tokens of p_1 (paper: top-2 on translation).
  kind 'distance': |ŷ - argmax p_1| <= `eps`, for ordinal outputs such as pixel intensities (paper: 2).
  min_block: accept at least this many tokens per iteration whatever the checks say (paper §5.3): k̂ is
    max(verified prefix, min_block), along the all-rank-0 path. (Not "accept min_block, then keep verifying the
    rest": a check that failed inside the forced prefix is not skipped over.)
  Hashable, and a pytree without leaves: a static argument of jit, or an ordinary one (as speculative.Sampling).
  """
  draws = False  # a rule that draws (sampling) needs the loop's PRNG key
  kind: str = flax.struct.field(pytree_node=False, default='exact')
  top_k: int = flax.struct.field(pytree_node=False, default=1)
  eps: int = flax.struct.field(pytree_node=False, default=0)
  min_block: int = flax.struct.field(pytree_node=False, default=1)

  def __post_init__(self):
    # A typed rule checks its own fields, as parse_criterion checks the command line's words.
    if self.kind not in ('exact', 'top_k', 'distance'):
      raise UserError(f'Criterion(kind={self.kind!r}): the kind is exact, top_k or distance; {CRITERION_HELP}.')
    if int(self.top_k) != self.top_k or self.top_k < 1 or int(self.eps) != self.eps or self.eps < 0 or (
        int(self.min_block) != self.min_block or self.min_block < 1):
      raise UserError(f'Criterion(top_k={self.top_k}, eps={self.eps}, min_block={self.min_block}): top_k and '
                      f'min_block are integers >= 1, eps an integer >= 0; {CRITERION_HELP}.')

  def __str__(self):
    name = {'exact': 'exact', 'top_k': f'top_k:{self.top_k}', 'distance': f'distance:{self.eps}'}[self.kind]
    if self.min_block == 1:
      return name
    return f'min_block:{self.min_block}' if self.kind == 'exact' else f'{name}+min_block:{self.min_block}'

  def check(self, tree) -> None:
    zero_path_D = tree.zero_path_D
    if zero_path_D is None:
      if self.min_block > 1:
        raise UserError(f'{self} forces the rank-0 path of {self.min_block} nodes, which a context-aware tree '
                        f'({tree}) need not hold: use min_block with a chain or a static tree.')
      return
    if self.min_block > 1 and (self.min_block > len(zero_path_D) or zero_path_D[self.min_block - 1] < 0):
      what = 'raise k' if tree.is_chain else 'add it or lower min_block'
      raise UserError(f'min_block={self.min_block} forces the path {(0,) * self.min_block} of rank-0 choices (the '
                      f'chain\'s first proposals), which the tree {tree.paths} lacks: {what}.')

  @property
  def exact_in_effect(self) -> bool:
    """The check accepts what exact accepts: top_k:1 and distance:0 are exact (accept_mask)."""
    return {'exact': True, 'top_k': self.top_k == 1, 'distance': self.eps == 0}[self.kind]

  def ends_early(self, tree) -> bool:
    # DESIGN §3, the last-token rule: with several roots, a check looser than exact (top_k:T >= 2, distance:EPS >= 1)
    # may pass another root whose path goes deeper than the next token alone: the row is then not decided by that
    # token, and an iteration must run. min_block changes nothing here: a forced block is cut at EOS and max_len.
    return tree.num_roots == 1 or self.exact_in_effect

  def target(self, logits_BxV):
    return {'logits_BxV': logits_BxV, 'best_B': argmax(logits_BxV)}

  def first(self, target, tree, keys_B):
    return target['best_B']

  def draft(self, target, proposal, tree, keys_B):
    logits_BxV, best_B = target['logits_BxV'], target['best_B']
    heads_BxDm1xV = proposal.heads_BxDm1xV
    if tree.is_chain:  # ŷ_{j+1} = head 1's argmax, ŷ_{j+2..j+k} heads 2..k's
      if tree.depth == 1:
        return best_B[:, None], ()
      if proposal.best_BxDm1 is not None:
        choices_BxDm1 = proposal.best_BxDm1[:, :tree.depth - 1]
      else:
        choices_BxDm1 = argmax(heads_BxDm1xV[:, :tree.depth - 1])
      return jnp.concatenate([best_B[:, None], choices_BxDm1], axis=1), ()
    if tree.token_BxN is not None:  # chosen as it was built (Dynamic.build, from `first`: node 0 is best_B)
      return tree.token_BxN, ()
    B = best_B.shape[0]
    t = tree.arrays(B)
    depth = t['path'].shape[2]
    ranks = tree.num_ranks
    heads_BxDxV = jnp.concatenate([logits_BxV[:, None], heads_BxDm1xV[:, :depth - 1].astype(logits_BxV.dtype)],
                                  axis=1) if depth > 1 else logits_BxV[:, None]
    choices_BxDxR = argmax(heads_BxDxV)[..., None] if ranks == 1 else jax.lax.top_k(heads_BxDxV, ranks)[1]
    # Node n gets rank r_n of head d_n + 1 (Medusa-style: a head's choices do not depend on the node's parent).
    nodes_BxN = choices_BxDxR[jnp.arange(B)[:, None], t['depth'], t['rank']].astype(jnp.int32)
    nodes_BxN = nodes_BxN.at[:, 0].set(best_B)  # node 0 is head 1's argmax (rank 0): the next token itself
    if tree.num_roots > 1:  # (a static Layout here: a RowTree returned above)
      # Depth-0 nodes are checked now, against head 1 at j; the verification call checks their children.
      roots = tree.roots
      logits_BxRxV = jnp.broadcast_to(logits_BxV[:, None], (B, len(roots), logits_BxV.shape[-1]))
      return nodes_BxN, jnp.ones(nodes_BxN.shape, bool).at[:, roots].set(
          accept_mask(self, nodes_BxN[:, roots], logits_BxRxV))
    return nodes_BxN, ()

  def accept(self, nodes_BxN, logits_BxNxV, memo, tree, keys_B):
    B = nodes_BxN.shape[0]
    rows = jnp.arange(B)
    # One argmax over every node: checks of the children, and the next token after the last accepted node.
    best_BxN = argmax(logits_BxNxV)
    if tree.is_chain:
      # Position j+i carries ŷ_{j+i}; its head-1 output scores ŷ_{j+i+1}.
      checks_BxKm1 = accept_mask(self, nodes_BxN[:, 1:], logits_BxNxV[:, :-1], best_BxN[:, :-1])
      k_hat_B = jnp.minimum(block_size(self, checks_BxKm1), tree.depth)
      last_B = k_hat_B - 1
    else:
      t = tree.arrays(B)
      parent_BxN = t['parent']
      if tree.is_static:  # numpy parents: static gathers, and several roots checked when drafted (memo)
        ok_BxN = memo if tree.num_roots > 1 else jnp.ones(nodes_BxN.shape, bool)
        inner = np.nonzero(tree.parent_N >= 0)[0]  # nodes checked in this call
        if len(inner):
          parents = tree.parent_N[inner]
          ok_BxN = ok_BxN.at[:, inner].set(
              accept_mask(self, nodes_BxN[:, inner], logits_BxNxV[:, parents], best_BxN[:, parents]))
      else:  # one root (head 1's choice, which passes); every other node against its parent's head 1
        ok_BxN = (parent_BxN < 0) | accept_mask(self, nodes_BxN, parent_rows(logits_BxNxV, tree),
                                                 parent_rows(best_BxN, tree))
      last_B = deepest_accepted(ok_BxN, tree)
      if self.min_block > 1:  # forced: the all-rank-0 path of min_block nodes (the chain's first L proposals)
        forced = int(tree.zero_path_D[self.min_block - 1])
        last_B = jnp.where(t['depth'][rows, last_B] + 1 < self.min_block, forced, last_B)
    return last_B, {'logits_BxV': logits_BxNxV[rows, last_B], 'best_B': best_BxN[rows, last_B]}


EXACT = Criterion()


def deepest_accepted(ok_BxN: jax.Array, tree) -> jax.Array:
  """The tree reduction of every rule that checks each node on its own (a chain, a static or a per-row tree):
  a node is accepted when it and all its ancestors pass, and the deepest accepted node wins (ties: the first in
  canonical order, the higher-ranked choices). ok_BxN [B, N] bool: node n passed its check (a root passes when it
  is the next token itself). Returns last_B [B] int32, the node whose depth + 1 is k̂."""
  t = tree.arrays(ok_BxN.shape[0])
  accepted_BxN = ~jnp.any(t['ancestor'] & ~ok_BxN[:, None, :], axis=-1)
  return jnp.argmax(jnp.where(accepted_BxN, t['depth'] + 1, 0), axis=1).astype(jnp.int32)


def parent_rows(x_BxNx___: jax.Array, tree) -> jax.Array:
  """x [B, N, ...] at each node's parent: what scores node n is its parent's head-1 output (paper §3: position
  j+i's output checks the proposal for j+i+1). A root has no parent in the call and gets node 0's row, which a
  rule must not read as its check (the next token passes; other roots are checked when drafted)."""
  parent_BxN = jnp.maximum(tree.arrays(x_BxNx___.shape[0])['parent'], 0)
  return jnp.take_along_axis(x_BxNx___, parent_BxN.reshape(parent_BxN.shape + (1,) * (x_BxNx___.ndim - 2)), axis=1)

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
  (experiments/bench_decode.py, --mode=profile and --mode=ratio). Not as max-then-first-index-equal: two reductions
  that XLA may fuse with two copies of the logits' computation, which can round differently (one contracts a
  multiply-add, the other not), so that no entry equals "the" maximum.
  """
  fast = matmul.argmax(logits_Bx___xV)  # the skinny-kernel library's, when a decoder traces under it
  if fast is not None:
    return fast
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


@dataclasses.dataclass(frozen=True)
class Fixed:
  """What stays fixed over one decode: the rows of the batch, the longest output, the special ids."""
  batch_size: int
  max_len: int
  bos_id: int
  eos_id: int


# -- greedy ------------------------------------------------------------------------------------------------

def take_rows(tree, index_B):
  """Row b of every leaf at index_B[b] along axis 1: [B, T, ...] -> [B, ...]."""
  return jax.tree.map(lambda x: x[jnp.arange(x.shape[0]), index_B], tree)


def _mask_after(tokens_BxL, length_B):
  """Padding at every index >= length_B[b]."""
  return jnp.where(jnp.arange(tokens_BxL.shape[1])[None, :] < length_B[:, None], tokens_BxL, PAD_ID)


@flax.struct.dataclass
class GreedyState:
  """The carry of greedy's loop: every row sits at the same position `step`."""
  step: jax.Array         # int32 []; model calls so far
  last_B: jax.Array       # int32 [B]; the token fed next
  tokens_BxL: jax.Array   # int32 [B, max_len]
  length_B: jax.Array     # int32 [B]; tokens produced, EOS included
  done_B: jax.Array       # bool [B]
  model_state: Any        # opaque decoder state (KV cache, encoder keys/values)


def greedy_init(state: Any, *, fixed: Fixed) -> GreedyState:
  """The initial carry of greedy's loop."""
  B = fixed.batch_size
  return GreedyState(step=jnp.int32(0), last_B=jnp.full((B,), fixed.bos_id, jnp.int32),
                     tokens_BxL=jnp.zeros((B, fixed.max_len), jnp.int32), length_B=jnp.zeros((B,), jnp.int32),
                     done_B=jnp.zeros((B,), bool), model_state=state)


def greedy_body(score_fn: ScoreFn, *, fixed: Fixed):
  """One greedy step, the body of `greedy`'s while_loop: GreedyState -> GreedyState. Public so that a benchmark
  can compile and cost-analyse exactly one step (XLA's cost analysis counts a while_loop's body once, not per
  iteration)."""
  def body(c: GreedyState) -> GreedyState:
    # Every row sits at position `step`: a scalar start, so the cache write is one slice, not a per-row scatter.
    logits_Bx1xV, _, state = score_fn(c.model_state, c.last_B[:, None], c.step)
    next_B = argmax(logits_Bx1xV[:, 0])
    return GreedyState(step=c.step + 1, last_B=next_B,
                       tokens_BxL=c.tokens_BxL.at[:, c.step].set(jnp.where(c.done_B, PAD_ID, next_B)),
                       length_B=c.length_B + (~c.done_B).astype(jnp.int32),
                       done_B=c.done_B | (next_B == fixed.eos_id), model_state=state)
  return body


def greedy(score_fn: ScoreFn, state: Any, *, fixed: Fixed) -> 'DecodeResult':
  """Greedy decoding with the cached decoder: one token per row per model call. Returns a DecodeResult in which
  every iteration produced one token (greedy's first call already emits one, so its iterations are its tokens;
  DESIGN §2 counts them alike) and `invocations` counts the model calls."""
  def cond(c: GreedyState):
    return (c.step < fixed.max_len) & ~jnp.all(c.done_B)

  c = jax.lax.while_loop(cond, greedy_body(score_fn, fixed=fixed), greedy_init(state, fixed=fixed))
  return DecodeResult(
      tokens_BxL=c.tokens_BxL, length_B=c.length_B, iterations_B=c.length_B,
      block_counts_BxK=jnp.stack([c.length_B, jnp.zeros_like(c.length_B)], axis=1),
      first_call_B=jnp.zeros_like(c.length_B), invocations=c.step)


# -- the one blockwise loop (paper §3-§4; trees and sampling beyond the paper) ----------------------------
#
# Every blockwise method is one loop over the same three parts (DESIGN §3):
#   a tree    N candidate nodes per row: the chain of k (the paper), a static tree (Medusa), or a tree built per
#             row and iteration from the heads' confidence (`Dynamic`, EAGLE-2). A static tree is a `Layout` of
#             numpy constants built once per topology; a per-row tree is a `RowTree` of [B, N] arrays.
#   a rule    how nodes get their tokens from the heads and which are accepted: the greedy criteria
#             (`Criterion`: exact, top_k, distance, min_block) here, speculative sampling in bpd/speculative.py.
#             A rule implements the `Rule` protocol above.
#   the loop  verify every node in one model call, accept the deepest passing path, cut it at EOS and max_len,
#             move it into place, and draft the next tree from the outputs at its last node (combined scoring
#             and proposal, paper §4): one model invocation per iteration plus one at the start.
# The chain is the one-path tree, specialised at trace time: no tree mask (slots are positions, the block is
# causal) and no cache move (the path is already contiguous), so it compiles to the paper's loop.
#
# A topology is a tuple of paths; a path (r_0, .., r_d) is the node at depth d whose token is the r_d-th choice
# (rank 0 = argmax) of head d + 1, under the parent node (r_0, .., r_{d-1}). So ((0,), (0, 0), (0, 1)) verifies
# "head 1's choice, then head 2's first or second choice". Every root-to-node path is a candidate block; the chain
# of k is ((0,), (0, 0), .., (0,) * k). One model call scores all N nodes: node n sits in cache slot start + n
# (start = j + 1) at position start + depth(n), and attends to the cached prefix and its own ancestors only (the
# ancestor mask). Node n's head-1 output checks its children, as position j + i checks ŷ_{j+i+1} in the chain. The
# deepest accepted path wins; its keys and values move to the contiguous slots start .. start + k̂ - 1 (move_fn),
# and the rest of the tree stays behind as stale slots, masked and overwritten like the chain's rejected tokens.

TreePaths = tuple  # tuple of paths, each a tuple of ranks; hashable, so a static jit argument


class ModelFns(NamedTuple):
  """The model as the loop sees it (module docstring): score_fn, propose_fn, move_fn for trees that are not
  chains (None is fine for a chain), and expand_fn for heads that are fed their parent's token (None: the heads'
  choices do not depend on the node they continue, and a context-aware tree reads propose_fn's). init(src_BxS,
  cache_len) -> state makes the state the loops start from; the loops themselves never call it.
  propose_choices(hidden) -> (propose's logits, their argmaxes int32 [B, k-1], ties to the lower id), for heads
  that take the argmaxes anyway (sequential heads feed each head the one before's; a draft vocabulary takes them
  over R, not V): the heads drafter then hands the rule both (Proposal.best_BxDm1). None: propose alone."""
  score: ScoreFn
  propose: ProposeFn
  move: MoveFn | None = None
  expand: ExpandFn | None = None
  init: InitFn | None = None
  propose_choices: Callable | None = None


def chain_tree(k: int) -> TreePaths:
  """The chain of k proposals as a tree: ((0,), (0, 0), .., (0,) * k)."""
  return tuple((0,) * depth for depth in range(1, k + 1))


def chain(k: int) -> 'Layout':
  """The paper's chain of k proposals as the loop's tree: the one-path tree of rank-0 nodes."""
  return layout(chain_tree(k))


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


@dataclasses.dataclass(frozen=True, eq=False)
class Layout:
  """A static tree (`check_tree`'s canonical paths) as numpy constants, built once per topology (`layout`).

  depth_N: depth of node n (0 = a candidate for y_{j+1}); rank_N: its rank among its head's choices; parent_N:
  index of its parent (-1 at depth 0); ancestor_NxN[n, m]: m is n or an ancestor of n (the attention mask among
  the new slots); path_NxD[n, d]: the node at depth d on the path to n (n itself past its depth, never read);
  zero_path_D: the node (0,) * (d + 1), or -1 where the tree lacks it.

  Every tree kind (Layout, RowTree, Dynamic) answers the same questions, so that rules and the loop never ask which
  kind it is: is_chain, is_static (numpy constants, one shape for every row), per_row (built on device per row and
  iteration: the policy is Dynamic and the loop carries its RowTree), num_roots, zero_path_D (None where a tree
  need not hold the rank-0 path), token_BxN (None where the rule drafts the nodes' tokens from the heads' choices),
  arrays(B) and mask().
  """
  is_static = True
  per_row = False
  token_BxN = None  # the rule drafts the tokens: rank r_n of head d_n + 1
  paths: TreePaths
  depth_N: np.ndarray
  rank_N: np.ndarray
  parent_N: np.ndarray
  ancestor_NxN: np.ndarray
  path_NxD: np.ndarray
  zero_path_D: np.ndarray

  @property
  def num_nodes(self) -> int:
    return len(self.paths)

  @property
  def depth(self) -> int:
    """The longest path: the most tokens an iteration accepts, and the heads the tree uses."""
    return self.path_NxD.shape[1]

  @property
  def is_chain(self) -> bool:
    """The paper's chain: one node per depth, each its head's first choice (rank 0). Decoded without a tree mask or
    a cache move (module comment), and drafted from the heads' argmax. A one-path tree with another rank, such as
    ((0,), (0, 1)), is decoded as a tree: its node asks for head 2's second choice."""
    return self.num_nodes == self.depth and not self.rank_N.any()

  @property
  def roots(self) -> np.ndarray:
    return np.nonzero(self.depth_N == 0)[0]

  @property
  def num_roots(self) -> int:
    return len(self.roots)

  def arrays(self, batch: int) -> dict:
    """depth, rank, parent [B, N], ancestor [B, N, N] and path [B, N, D]: the numpy constants broadcast (free),
    for code that serves every tree (RowTree.arrays)."""
    b = lambda x: jnp.broadcast_to(jnp.asarray(x), (batch,) + x.shape)
    return {'depth': b(self.depth_N), 'rank': b(self.rank_N), 'parent': b(self.parent_N),
            'ancestor': b(self.ancestor_NxN), 'path': b(self.path_NxD)}

  def mask(self):
    """What score_fn gets as its tree argument: (depth_N, ancestor_NxN), numpy constants."""
    return (self.depth_N, self.ancestor_NxN)

  @property
  def num_ranks(self) -> int:
    """Ranks are below this at every depth: how many of each head's choices the nodes read."""
    return int(self.rank_N.max()) + 1


@functools.lru_cache(maxsize=None)
def layout(paths: TreePaths) -> Layout:
  """The Layout of a canonical topology (`check_tree`), built once per topology and reused."""
  index = {path: n for n, path in enumerate(paths)}
  num, depth = len(paths), max(len(path) for path in paths)
  ancestor_NxN = np.zeros((num, num), bool)
  path_NxD = np.zeros((num, depth), np.int32)
  for n, path in enumerate(paths):
    for d in range(depth):
      path_NxD[n, d] = index[path[:d + 1]] if d < len(path) else n
    for d in range(len(path)):
      ancestor_NxN[n, index[path[:d + 1]]] = True
  return Layout(paths=paths, depth_N=np.array([len(p) - 1 for p in paths], np.int32),
                rank_N=np.array([p[-1] for p in paths], np.int32),
                parent_N=np.array([index[p[:-1]] if len(p) > 1 else -1 for p in paths], np.int32),
                ancestor_NxN=ancestor_NxN, path_NxD=path_NxD,
                zero_path_D=np.array([index.get((0,) * (d + 1), -1) for d in range(depth)], np.int32))


def tree_depth(paths: TreePaths) -> int:
  """The longest path of a topology: the most tokens an iteration can accept, and the heads the tree uses."""
  return max(len(path) for path in paths)


@flax.struct.dataclass
class RowTree:
  """A tree per row, all of N nodes in canonical order (a parent before its children, node 0 = head 1's choice),
  built on device each iteration (`Dynamic`). Fields as Layout's, per row."""
  depth_BxN: jax.Array         # int32 [B, N]
  rank_BxN: jax.Array          # int32 [B, N]; rank of the node's token among its parent's choices
  parent_BxN: jax.Array        # int32 [B, N]; -1 at the root
  ancestor_BxNxN: jax.Array    # bool [B, N, N]
  path_BxNxD: jax.Array        # int32 [B, N, D]
  token_BxN: jax.Array         # int32 [B, N]; the node's token (node 0: head 1's argmax)
  num_ranks: int = flax.struct.field(pytree_node=False, default=1)  # ranks are below this at every depth

  is_chain = False  # the chain is a static Layout
  is_static = False
  per_row = True
  num_roots = 1
  zero_path_D = None  # a built tree need not hold the rank-0 path

  @property
  def num_nodes(self) -> int:
    return self.token_BxN.shape[1]

  def arrays(self, batch: int) -> dict:
    """As Layout.arrays: this tree's own [B, ...] fields."""
    return {'depth': self.depth_BxN, 'rank': self.rank_BxN, 'parent': self.parent_BxN,
            'ancestor': self.ancestor_BxNxN, 'path': self.path_BxNxD}

  def mask(self):
    """What score_fn gets as its tree argument: (depth_BxN, ancestor_BxNxN), per row."""
    return (self.depth_BxN, self.ancestor_BxNxN)


def row_tree(depth_BxN, rank_BxN, parent_BxN, token_BxN, depth: int, num_ranks: int) -> RowTree:
  """A RowTree from each node's depth, rank, parent (parents before children) and token: the ancestor mask and
  the paths follow the parent pointers, D steps up, on device."""
  B, N = parent_BxN.shape
  node_BxN = jnp.broadcast_to(jnp.arange(N), (B, N))
  ancestor_BxNxN = jnp.zeros((B, N, N), bool)
  path_BxNxD = jnp.broadcast_to(node_BxN[..., None], (B, N, depth))
  up_BxN = node_BxN  # the ancestor of every node d steps up (-1 past the root)
  for _ in range(depth):
    live_BxN = up_BxN >= 0
    safe_BxN = jnp.maximum(up_BxN, 0)
    ancestor_BxNxN = ancestor_BxNxN | (jax.nn.one_hot(safe_BxN, N, dtype=bool) & live_BxN[..., None])
    d_BxN = jnp.take_along_axis(depth_BxN, safe_BxN, axis=1)
    path_BxNxD = jnp.where(live_BxN[..., None] & (jnp.arange(depth) == d_BxN[..., None]), safe_BxN[..., None],
                           path_BxNxD)
    up_BxN = jnp.where(live_BxN, jnp.take_along_axis(parent_BxN, safe_BxN, axis=1), -1)
  return RowTree(depth_BxN=depth_BxN, rank_BxN=rank_BxN, parent_BxN=parent_BxN, ancestor_BxNxN=ancestor_BxNxN,
                 path_BxNxD=path_BxNxD, token_BxN=token_BxN, num_ranks=num_ranks)


@dataclasses.dataclass(frozen=True)
class Dynamic:
  """A context-aware tree of `num_nodes` nodes per row and iteration (EAGLE-2, Li et al. 2024; DESIGN §8).

  A node's score is the product of the heads' probabilities along its path (head d + 1's probability of the
  node's token at depth d given its parent). Each depth keeps its `beam` best nodes, each expanded with the
  `ranks` most likely tokens of the next head; of all nodes seen the `num_nodes` best form the tree. A child never
  scores above its parent (probabilities are <= 1) and ties go to the shallower node, so the chosen set holds
  every chosen node's parent: it is a tree. The root is head 1's own choice (rank 0): under the greedy criteria
  it is the one first token that always passes. `depth` heads are used (k of the model).

  Independent heads (the paper's) give every parent at a depth the same choices, so one projection per head
  serves the whole beam. Sequential heads are fed the token before the one they predict: each beam node is
  expanded by running the next head from its own token (ModelFns.expand), W runs of a head per depth in one
  batched call.
  """
  num_nodes: int
  depth: int
  beam: int = 8
  ranks: int = 8
  # The questions every tree answers (Layout's docstring): the RowTree it builds, per row and iteration.
  is_chain = False
  is_static = False
  per_row = True
  num_roots = 1        # the root is the rule's `first` token
  zero_path_D = None   # the rank-0 path need not be chosen

  def __str__(self):
    return f'dynamic:{self.num_nodes}'

  def candidates(self, vocab_size: int) -> int:
    """How many nodes `build` chooses from: the root and beam x ranks per depth below it."""
    ranks, width, total = min(self.ranks, vocab_size), 1, 1
    for _ in range(1, self.depth):
      total += width * ranks
      width = min(self.beam, width * ranks)
    return total

  def check(self, vocab_size: int) -> None:
    """UserError unless the tree can be built: depth >= 2, 1 <= num_nodes <= the candidates."""
    if self.depth < 2:
      raise UserError(f'Tree spec {self} needs proposal heads: decode with k >= 2 heads.')
    most = self.candidates(vocab_size)
    if not 1 <= self.num_nodes <= most:
      raise UserError(f'Tree spec {self}: N must be between 1 and {most}, the candidate nodes of {self.depth} heads '
                      f'with beam {self.beam} and {min(self.ranks, vocab_size)} ranks per head.')

  def build(self, root_B, children) -> RowTree:
    """Every row's tree: `candidate_nodes`, then `choose`. root_B: node 0's token, the next token (the rule's
    `first`: head 1's argmax for the greedy criteria, the free token for sampling). children(d, parents_BxW) ->
    logits [B, W or 1, V]: head d + 1's, for the children of the W beam nodes at depth d - 1, whose tokens are
    parents_BxW; 1 in place of W where every parent gets the same (independent heads)."""
    def top_ranks(d, parents_BxW):
      logits = children(d, parents_BxW).astype(jnp.float32)
      return jax.lax.top_k(jax.nn.log_softmax(logits), min(self.ranks, logits.shape[-1]))
    return self.choose(self.candidate_nodes(root_B, top_ranks))

  def candidate_nodes(self, root_B, top_ranks) -> 'Candidates':
    """All the nodes `choose` picks from, in depth order: the root (token root_B), then per depth d = 1 .. depth - 1
    beam slot x rank. top_ranks(d, parents_BxW) -> (logp, token) [B, W or 1, R]: the R best log-probabilities of
    head d + 1 and their tokens (R the same at every depth), for the children of the W beam nodes at depth d - 1
    (tokens parents_BxW). A node's score is its parent's plus its own log-probability, summed in float32 in this
    order; each depth keeps the `beam` best (lax.top_k: the lower index first on ties) as the parents of the next."""
    B = root_B.shape[0]
    score, token, cand_depth, cand_rank = [jnp.zeros((B, 1))], [root_B[:, None].astype(jnp.int32)], [0], [0]
    cand_parent = [jnp.full((B, 1), -1, jnp.int32)]
    path = [jnp.full((B, 1, self.depth), -1, jnp.int32).at[:, :, 0].set(0)]
    in_beam = [jnp.ones((B, 1), bool)]
    beam_score_BxW, beam_index_BxW, beam_token_BxW = jnp.zeros((B, 1)), jnp.zeros((B, 1), jnp.int32), root_B[:, None]
    beam_path_BxWxD = path[0]
    offset = 1
    for d in range(1, self.depth):
      W = beam_score_BxW.shape[1]
      logp_BxWxR, token_BxWxR = top_ranks(d, beam_token_BxW)
      ranks = token_BxWxR.shape[-1]
      child_BxWxR = beam_score_BxW[:, :, None] + logp_BxWxR  # broadcasts a shared [B, 1, R] over the beam
      child_BxM = child_BxWxR.reshape(B, W * ranks)
      token_BxM = jnp.broadcast_to(token_BxWxR, (B, W, ranks)).reshape(B, W * ranks).astype(jnp.int32)
      child_path_BxMxD = jnp.repeat(beam_path_BxWxD, ranks, axis=1).at[:, :, d].set(
          jnp.tile(jnp.arange(ranks, dtype=jnp.int32), W))
      score.append(child_BxM)
      token.append(token_BxM)
      path.append(child_path_BxMxD)
      cand_depth += [d] * (W * ranks)
      cand_rank += list(range(ranks)) * W
      cand_parent.append(jnp.repeat(beam_index_BxW, ranks, axis=1))  # [B, W * R]
      beam_score_BxW, pick_BxW = jax.lax.top_k(child_BxM, min(self.beam, W * ranks))
      in_beam.append(jnp.zeros((B, W * ranks), bool).at[jnp.arange(B)[:, None], pick_BxW].set(True))
      beam_index_BxW = offset + pick_BxW.astype(jnp.int32)
      beam_token_BxW = jnp.take_along_axis(token_BxM, pick_BxW, axis=1)
      beam_path_BxWxD = jnp.take_along_axis(child_path_BxMxD, pick_BxW[:, :, None], axis=1)
      offset += W * ranks
    return Candidates(score_BxM=jnp.concatenate(score, axis=1), token_BxM=jnp.concatenate(token, axis=1),
                      parent_BxM=jnp.concatenate(cand_parent, axis=1), path_BxMxD=jnp.concatenate(path, axis=1),
                      in_beam_BxM=jnp.concatenate(in_beam, axis=1), depth_M=tuple(cand_depth),
                      rank_M=tuple(cand_rank), num_ranks=ranks)

  def choose(self, c: 'Candidates') -> RowTree:
    """The `num_nodes` best candidates of every row, as its tree."""
    B, M = c.score_BxM.shape
    # The N best; lax.top_k puts the lower index first on ties, and candidates are in depth order, so a child
    # that ties its parent comes after it. Sorted by index: depth order, so parents precede their children.
    chosen_BxN = jnp.sort(jax.lax.top_k(c.score_BxM, self.num_nodes)[1], axis=1).astype(jnp.int32)
    position_BxM = jnp.full((B, M), -1, jnp.int32).at[jnp.arange(B)[:, None], chosen_BxN].set(
        jnp.arange(self.num_nodes, dtype=jnp.int32))
    parent_cand_BxN = jnp.take_along_axis(c.parent_BxM, chosen_BxN, axis=1)
    parent_BxN = jnp.where(parent_cand_BxN < 0, -1,
                           jnp.take_along_axis(position_BxM, jnp.maximum(parent_cand_BxN, 0), axis=1))
    depth_BxN = jnp.asarray(np.array(c.depth_M, np.int32))[chosen_BxN]
    rank_BxN = jnp.asarray(np.array(c.rank_M, np.int32))[chosen_BxN]
    return row_tree(depth_BxN, rank_BxN, parent_BxN, jnp.take_along_axis(c.token_BxM, chosen_BxN, axis=1),
                    self.depth, c.num_ranks)


@flax.struct.dataclass
class Candidates:
  """The nodes a context-aware tree is chosen from (`Dynamic.candidate_nodes`), M per row, in depth order."""
  score_BxM: jax.Array     # float32; the sum of the log-probabilities along the node's path (the root's 0)
  token_BxM: jax.Array     # int32
  parent_BxM: jax.Array    # int32; the parent's candidate index, -1 for the root
  path_BxMxD: jax.Array    # int32; the ranks from the root (rank 0) to the node, -1 past its depth
  in_beam_BxM: jax.Array   # bool; kept in its depth's beam, so that its children are candidates
  depth_M: tuple = flax.struct.field(pytree_node=False)  # the same for every row (tuples: hashable static data)
  rank_M: tuple = flax.struct.field(pytree_node=False)
  num_ranks: int = flax.struct.field(pytree_node=False)


@flax.struct.dataclass
class Rows:
  """What the loop keeps per row: the output and its statistics. j = length_B[b] tokens accepted so far in row b;
  D = the most tokens an iteration accepts (the tree's depth; k for the chain)."""
  tokens_BxL: jax.Array        # int32 [B, max_len + D]; indices >= length_B[b] hold stale proposals
  length_B: jax.Array          # int32 [B]; tokens accepted (EOS included)
  done_B: jax.Array            # bool [B]; EOS accepted or max_len reached
  iterations_B: jax.Array      # int32 [B]; iterations in which row b was still decoding
  block_counts_BxD: jax.Array  # int32 [B, D + 1]; [b, n-1] = iterations of row b that produced n tokens
  first_call_B: jax.Array      # int32 [B]; 1 where the first call alone produced the row (its one token ends it)


@flax.struct.dataclass
class LoopState:
  """The carry of the loop. N nodes per tree."""
  model_state: Any            # opaque decoder state (KV cache, encoder keys/values); leaves [B, ...]
  rows: Rows
  nodes_BxN: jax.Array        # int32 [B, N]; the tokens of the next tree (node 0: the next token)
  tree: Any                   # the next tree: () for a static Layout (a trace-time constant), else a RowTree
  memo: Any                   # the rule's note from draft to accept (leaves [B, ...])
  draft_state: Any            # a drafter's own state (its init), () for the heads
  step: jax.Array             # int32 []; loop iterations (= model invocations - 1)


@flax.struct.dataclass
class DecodeResult:
  """What every decoder returns (greedy and sampling too: one token per iteration)."""
  tokens_BxL: jax.Array        # int32 [B, max_len]; EOS included, 0 after it
  length_B: jax.Array          # int32 [B]; tokens produced, EOS included
  iterations_B: jax.Array      # int32 [B]; iterations (model calls after the first) in which the row decoded
  block_counts_BxK: jax.Array  # int32 [B, D + 1]; histogram of the tokens produced per iteration, 1..D+1
  first_call_B: jax.Array      # int32 [B]; 1 where the first call alone produced the row (summarize)
  invocations: jax.Array       # int32 []; model calls for the whole batch (loop iterations + 1)


def end_with_next_token(rows: Rows, next_B, *, fixed: Fixed, enabled: bool = True) -> tuple[Rows, jax.Array]:
  """Appends the scoring model's next token next_B (head 1's choice after the accepted prefix) where it ends the
  row: it is EOS, or the max_len-th token. The next iteration would accept it unverified (ŷ_{j+1} always passes)
  and nothing else, a model call for nothing; `enabled` is the rule's ends_early (False where another root might
  go deeper). Returns (rows, ended_B).

  Writing next_B at length_B in the other rows too is harmless: the next iteration writes its proposals from there,
  the first of which is next_B; finished rows are masked past their length at the end.
  """
  ended_B = ~rows.done_B & ((next_B == fixed.eos_id) | (rows.length_B + 1 >= fixed.max_len))
  if not enabled:
    return rows, jnp.zeros_like(ended_B)
  tokens_BxL = rows.tokens_BxL.at[jnp.arange(next_B.shape[0]), rows.length_B].set(next_B)
  return rows.replace(tokens_BxL=tokens_BxL, length_B=rows.length_B + ended_B.astype(jnp.int32),
                      done_B=rows.done_B | ended_B), ended_B


def start_rows(first_B, *, depth: int, fixed: Fixed, ends_early: bool = True) -> Rows:
  """The rows after the first model call, which only proposes: empty, except that a row whose first token first_B
  ends it (EOS, or max_len = 1) is done with this call."""
  B = first_B.shape[0]
  rows = Rows(tokens_BxL=jnp.zeros((B, fixed.max_len + depth), jnp.int32), length_B=jnp.zeros((B,), jnp.int32),
              done_B=jnp.zeros((B,), bool), iterations_B=jnp.zeros((B,), jnp.int32),
              block_counts_BxD=jnp.zeros((B, depth + 1), jnp.int32), first_call_B=jnp.zeros((B,), jnp.int32))
  rows, ended_B = end_with_next_token(rows, first_B, fixed=fixed, enabled=ends_early)
  return rows.replace(first_call_B=ended_B.astype(jnp.int32))


def accept_block(rows: Rows, block_BxD, k_hat_B, *, fixed: Fixed) -> tuple[Rows, jax.Array]:
  """Accepts block_BxD[b, :k̂] in every row: k̂ is cut at the first EOS inside the accepted block and at max_len,
  and is 0 in finished rows. The whole block is written at j (the rejected tail is overwritten next time or masked
  at the end). Returns (rows, the cut k_hat_B int32 [B])."""
  eos_in_block_BxD = (block_BxD == fixed.eos_id) & (jnp.arange(block_BxD.shape[1])[None, :] < k_hat_B[:, None])
  has_eos_B = jnp.any(eos_in_block_BxD, axis=1)
  k_hat_B = jnp.where(has_eos_B, jnp.argmax(eos_in_block_BxD, axis=1) + 1, k_hat_B)
  k_hat_B = jnp.where(rows.done_B, 0, jnp.minimum(k_hat_B, fixed.max_len - rows.length_B)).astype(jnp.int32)
  tokens_BxL = jax.vmap(lambda row, new, j: jax.lax.dynamic_update_slice(row, new, (j,)))(
      rows.tokens_BxL, block_BxD, jnp.minimum(rows.length_B, fixed.max_len))
  length_B = rows.length_B + k_hat_B
  return rows.replace(tokens_BxL=tokens_BxL, length_B=length_B,
                      done_B=rows.done_B | has_eos_B | (length_B >= fixed.max_len)), k_hat_B


def close_iteration(before: Rows, rows: Rows, k_hat_B, next_B, *, fixed: Fixed, ends_early: bool = True) -> Rows:
  """Ends an iteration that started from `before` and accepted k_hat_B (`accept_block`): appends next_B where it
  ends the row (`end_with_next_token`) and counts the iteration and its produced tokens in the rows that were
  still decoding."""
  rows, ended_B = end_with_next_token(rows, next_B, fixed=fixed, enabled=ends_early)
  active_B = ~before.done_B
  produced_B = k_hat_B + ended_B.astype(jnp.int32)
  depth = rows.block_counts_BxD.shape[1] - 1
  return rows.replace(
      iterations_B=rows.iterations_B + active_B.astype(jnp.int32),
      block_counts_BxD=rows.block_counts_BxD + (
          active_B[:, None] & (jnp.arange(1, depth + 2)[None, :] == produced_B[:, None])).astype(jnp.int32))


def _row_keys(key, batch_size):
  """One PRNG stream per row, fold_in(key, row): a row's draws never depend on the other rows."""
  return None if key is None else jax.vmap(lambda b: jax.random.fold_in(key, b))(jnp.arange(batch_size))


def block_keys(row_keys_B, start_B):
  """The key of the block that starts at position start_B[b] in row b: fold_in(row key, start). A row's blocks
  start at strictly increasing positions (k̂ >= 1), so every block of a row gets fresh draws."""
  return None if row_keys_B is None else jax.vmap(jax.random.fold_in)(row_keys_B, start_B)


# -- drafters ---------------------------------------------------------------------------------------------
#
# What proposes the nodes' tokens: a `Drafter`. The paper's is the model's own heads (`Heads`, the default):
# propose_fn's logits for heads 2..D, or expand_fn's per parent in a context-aware tree. Another drafter hands its
# guesses in the same form (`Proposal`), so the rule drafts and accepts them as it does the heads' choices, and the
# tree is built from them as from the heads'. bpd/prompt_lookup.py is the example of a drafter that is not a head;
# bpd/drafters.py registers drafters by name. The loop calls a drafter's init once, its propose after every
# verification (and after the first call), and its move between the two.


class DraftInputs(NamedTuple):
  """What the loop knows at every row's last accepted node, for a drafter to propose the next tree from."""
  hidden_Bx___: Any        # the model's outputs there (what the heads read; leaves [B, ...])
  fns: 'ModelFns'          # the model as the loop sees it (propose, expand: the heads)
  tokens_BxL: jax.Array    # int32 [B, L]; the output accepted so far, tokens_BxL[b, :length_B[b]] (later: stale)
  length_B: jax.Array      # int32 [B]
  next_B: jax.Array        # int32 [B]; node 0's token, the next token itself (the rule's `first`)
  vocab_size: int          # V of the logits a proposal holds


class Proposal(NamedTuple):
  """A drafter's guesses for the next tree, in the heads' form. heads_BxDm1xV: logits of depths 1..D-1, one row
  each, shared by every node at that depth (what a chain and a static tree draft from; None where the drafter only
  answers per parent). children(d, parents_BxW) -> logits [B, W or 1, V]: the children of W nodes at depth d - 1
  whose tokens are parents_BxW (what a tree built per row, a `TreePolicy`, grows from: one row for all where the
  guesses ignore the parent). best_BxDm1: int32 [B, D-1], `argmax(heads_BxDm1xV)` (ties to the lower id) where the
  drafter has it already, else None. Why: a chain drafts the rank-0 choices alone; read from here, the logits are
  never read, and XLA drops them (a draft vocabulary's spread to V floats per head) and the argmax over V."""
  heads_BxDm1xV: Any
  children: Callable
  best_BxDm1: Any = None


def per_depth(heads_BxDm1xV: jax.Array, best_BxDm1: jax.Array | None = None) -> Proposal:
  """The Proposal of guesses that ignore the parent: depth d's one row serves every parent at depth d - 1.
  best_BxDm1: argmax(heads_BxDm1xV), where the caller has it (Proposal)."""
  return Proposal(heads_BxDm1xV, lambda d, parents_BxW: heads_BxDm1xV[:, d - 1, None], best_BxDm1)


def proposal_from_tokens(tokens_BxDm1: jax.Array, vocab_size: int) -> Proposal:
  """The Proposal of a drafter that guesses one token per depth: one-hot rows in the heads' place, so every greedy
  criterion drafts them (a rank-0 choice is the token) and checks them as the heads' choices."""
  return per_depth(jax.nn.one_hot(tokens_BxDm1, vocab_size, dtype=jnp.float32), tokens_BxDm1.astype(jnp.int32))


class Drafter(Protocol):
  """A drafter: a small frozen, hashable object (a static argument of jit) that the loop calls through these
  members, nothing else. Its state (init's) is carried in LoopState.draft_state. Its str() names it in file names
  and in the records' `drafter` column."""
  reads_heads: bool  # it reads the model's heads 2..D (the decoder then runs them; else head 1 alone)

  def check(self, tree, rule) -> None:
    """UserError if it cannot draft this tree for this rule (before anything is traced)."""

  def init(self, context_BxC) -> Any:
    """Its state for the whole decode (leaves [B, ...]); context_BxC: the conditioning input's ids (a
    translation's source), or None where the decode has none."""

  def propose(self, state, seen: DraftInputs, depth: int, per_row: bool) -> Proposal:
    """Guesses for depths 1..depth-1 of the next tree, from `seen` at the last accepted node. per_row: the tree is
    built per row (a TreePolicy reads `children`), else a chain or a static tree (the rule reads heads_BxDm1xV)."""

  def move(self, state, rows: 'Rows') -> Any:
    """Its state once `rows` holds the newly accepted tokens (before `propose`)."""


@dataclasses.dataclass(frozen=True)
class Heads:
  """The paper's drafter (§3): the model's proposal heads 2..D at the last accepted position (propose_fn). Where
  the model feeds a head its parent's token (sequential heads: expand_fn) and the tree is built per row, each
  parent's children come from that head run on its own token (EAGLE-2's expansion with our heads)."""
  reads_heads = True

  def __str__(self):
    return 'heads'

  def check(self, tree, rule) -> None:
    del tree, rule  # every tree and rule: the heads offer ranked choices at every depth and a distribution to draw

  def init(self, context_BxC) -> tuple:
    del context_BxC
    return ()

  def propose(self, state, seen: DraftInputs, depth: int, per_row: bool) -> Proposal:
    del state
    if per_row and seen.fns.expand is not None:  # each parent's children from its own token
      return Proposal(None, lambda d, parents_BxW: seen.fns.expand(seen.hidden_Bx___, d, parents_BxW))
    B = seen.length_B.shape[0]
    if depth == 1:
      return per_depth(jnp.zeros((B, 0, 1), jnp.float32), jnp.zeros((B, 0), jnp.int32))
    # One head's choices serve every parent at its depth. With the heads' own argmaxes where the model has them.
    if seen.fns.propose_choices is not None:
      logits_BxKm1xV, best_BxKm1 = seen.fns.propose_choices(seen.hidden_Bx___)
      return per_depth(logits_BxKm1xV[:, :depth - 1], best_BxKm1[:, :depth - 1])
    return per_depth(seen.fns.propose(seen.hidden_Bx___)[:, :depth - 1])

  def move(self, state, rows: 'Rows') -> tuple:
    del rows
    return state


HEADS = Heads()


class TreePolicy(Protocol):
  """A tree built per row and iteration (`Dynamic` is the one here). Besides the questions every tree answers
  (Layout's docstring: is_chain, is_static, per_row, num_roots, zero_path_D), the loop calls `build` only."""
  num_nodes: int
  depth: int

  def check(self, vocab_size: int) -> None:
    """UserError unless the tree can be built for this vocabulary (before anything is traced)."""

  def build(self, root_B, children) -> 'RowTree':
    """Every row's tree, node 0 holding root_B (the rule's `first`). children(d, parents_BxW) -> logits
    [B, W or 1, V]: head d + 1's for the children of W nodes at depth d - 1 whose tokens are parents_BxW."""


def _draft(rule, tree, target, hidden_Bx___, fns: 'ModelFns', keys_B, drafter, draft_state, rows: Rows,
           vocab_size: int):
  """The next tree and its tokens from the outputs at the last accepted position: (nodes_BxN, tree, memo); tree is
  () for a static Layout (a constant of the trace), a RowTree for a TreePolicy. The drafter guesses, the policy
  builds from the guesses, the rule picks the nodes' tokens: each knows only its own part."""
  # The rule's first token is node 0 (the root a policy grows from). Where no one reads it, XLA drops it.
  next_B = rule.first(target, tree, keys_B)
  seen = DraftInputs(hidden_Bx___=hidden_Bx___, fns=fns, tokens_BxL=rows.tokens_BxL, length_B=rows.length_B,
                     next_B=next_B, vocab_size=vocab_size)
  proposal = drafter.propose(draft_state, seen, tree.depth, tree.per_row)
  if not tree.per_row:
    nodes_BxN, memo = rule.draft(target, proposal, tree, keys_B)
    return nodes_BxN, (), memo
  row = tree.build(next_B, proposal.children)
  nodes_BxN, memo = rule.draft(target, proposal, row, keys_B)
  return nodes_BxN, row, memo


def blockwise_init(fns: ModelFns, state: Any, *, fixed: Fixed, tree, rule=EXACT, key=None, drafter=HEADS,
                   context_BxC=None) -> LoopState:
  """The first model invocation (BOS at position 0: it only proposes the first tree) and the loop's first state."""
  B = fixed.batch_size
  draft_state = drafter.init(context_BxC)  # first: a drafter that lacks its context says so before the model runs
  logits_Bx1xV, hidden, state = fns.score(state, jnp.full((B, 1), fixed.bos_id, jnp.int32), jnp.zeros((B,), jnp.int32))
  keys_B = block_keys(_row_keys(key, B), jnp.ones((B,), jnp.int32))
  empty = start_rows(jnp.zeros((B,), jnp.int32), depth=tree.depth, fixed=fixed, ends_early=False)  # no output yet
  nodes_BxN, row_tree_, memo = _draft(rule, tree, rule.target(logits_Bx1xV[:, 0]),
                                      take_rows(hidden, jnp.zeros((B,), jnp.int32)), fns, keys_B, drafter,
                                      draft_state, empty, logits_Bx1xV.shape[-1])
  rows = start_rows(nodes_BxN[:, 0], depth=tree.depth, fixed=fixed, ends_early=rule.ends_early(tree))
  return LoopState(model_state=state, rows=rows, nodes_BxN=nodes_BxN, tree=row_tree_, memo=memo,
                   draft_state=draft_state, step=jnp.int32(0))


def blockwise_body(fns: ModelFns, *, fixed: Fixed, tree, rule=EXACT, key=None, drafter=HEADS):
  """One iteration (verify every node, accept the deepest passing path, cut it, move it into place, draft the next
  tree), the body of `blockwise`'s while_loop: LoopState -> LoopState. Public so that a benchmark can compile and
  cost-analyse exactly one iteration."""
  depth, ends_early = tree.depth, rule.ends_early(tree)
  is_chain = tree.is_chain
  # A tree of N nodes is at most N deep, so no accepted path is longer than P = min(N, D). The move writes P slots
  # from start, within the N that the verification call wrote: a cache of max_len + N + 1 slots holds them even
  # where N < D (a small `dynamic:N`). Moving D slots there would run past its end, and a clamped write would
  # overwrite the accepted prefix (layers.write_rows).
  moved = min(tree.num_nodes, depth)

  def body(s: LoopState):
    B = s.rows.length_B.shape[0]
    start_B = s.rows.length_B + 1  # the first node's slot and position, j + 1
    verified = s.tree if tree.per_row else tree
    # Verify: node n in slot start + n at position start + depth(n), seeing the prefix and its ancestors (the
    # chain: positions start .. start + k - 1, causal, no mask needed).
    tree_arg = () if is_chain else (verified.mask(),)
    logits_BxNxV, hidden, model_state = fns.score(s.model_state, s.nodes_BxN, start_B, *tree_arg)
    row_keys_B = _row_keys(key, B)
    last_B, target = rule.accept(s.nodes_BxN, logits_BxNxV, s.memo, verified, block_keys(row_keys_B, start_B))
    if is_chain:  # the block is the proposals themselves, written at j
      k_hat_B, block_BxD = last_B + 1, s.nodes_BxN
    else:
      t = verified.arrays(B)
      k_hat_B = jnp.take_along_axis(t['depth'], last_B[:, None], axis=1)[:, 0] + 1
      path_BxD = jnp.take_along_axis(t['path'], last_B[:, None, None], axis=1)[:, 0]
      block_BxD = jnp.take_along_axis(s.nodes_BxN, path_BxD, axis=1)
    # Accept: cut at the first EOS inside the block and at max_len.
    rows, k_hat_B = accept_block(s.rows, block_BxD, k_hat_B, fixed=fixed)
    if not is_chain:  # the accepted path's keys and values to slots start .. start + P - 1 (past k̂: stale)
      model_state = fns.move(model_state, start_B, path_BxD[:, :moved])
    # Combined scoring and proposal (paper §4): the outputs at the last accepted node draft the next tree.
    draft_state = drafter.move(s.draft_state, rows)
    nodes_BxN, row_tree_, memo = _draft(rule, tree, target, take_rows(hidden, last_B), fns,
                                        block_keys(row_keys_B, rows.length_B + 1), drafter, draft_state, rows,
                                        logits_BxNxV.shape[-1])
    rows = close_iteration(s.rows, rows, k_hat_B, nodes_BxN[:, 0], fixed=fixed, ends_early=ends_early)
    return LoopState(model_state=model_state, rows=rows, nodes_BxN=nodes_BxN, tree=row_tree_, memo=memo,
                     draft_state=draft_state, step=s.step + 1)
  return body


def blockwise(fns: ModelFns, state: Any, *, fixed: Fixed, tree, rule=EXACT, key=None, drafter=HEADS,
              context_BxC=None) -> DecodeResult:
  """Blockwise parallel decoding (paper §3-§4) over a tree of candidates with an acceptance rule and a drafter: the
  one loop of every blockwise method (the section comment above).

  tree: a Layout (`layout(check_tree(paths, k))`; the paper's chain is chain(k)) or a Dynamic policy;
  rule: a Criterion (greedy acceptance) or another rule (speculative.Sampling); key: a jax.random key for rules
  that draw (row b uses fold_in(key, b)). One model invocation per iteration plus one at the start; each row
  accepts its own k̂. The state needs a cache of at least max_len + N + 1 slots (decoder.cache_len): a call writes
  N slots from start <= max_len + 1, and the move min(N, D) (`blockwise_body`).
  drafter: what proposes (the section above `_draft`): HEADS, the model's heads (propose_fn, expand_fn), or
  another drafter with the context it starts from, context_BxC (a translation's source ids for prompt lookup).
  """
  rule.check(tree)
  drafter.check(tree, rule)
  if rule.draws and key is None:
    raise ValueError(f'the rule {rule} draws: blockwise needs a key')
  if not tree.is_chain and fns.move is None:
    raise ValueError('a tree that is not a chain needs a move_fn (ModelFns.move)')
  first = blockwise_init(fns, state, fixed=fixed, tree=tree, rule=rule, key=key, drafter=drafter,
                         context_BxC=context_BxC)
  body = blockwise_body(fns, fixed=fixed, tree=tree, rule=rule, key=key, drafter=drafter)

  def cond(s):
    return (s.step < fixed.max_len) & ~jnp.all(s.rows.done_B)

  s = jax.lax.while_loop(cond, body, first)
  return DecodeResult(
      tokens_BxL=_mask_after(s.rows.tokens_BxL[:, :fixed.max_len], s.rows.length_B),
      length_B=s.rows.length_B,
      iterations_B=s.rows.iterations_B,
      block_counts_BxK=s.rows.block_counts_BxD,
      first_call_B=s.rows.first_call_B,
      invocations=s.step + 1)


def summarize(result: DecodeResult) -> dict:
  """Host-side statistics of one decoded batch (sum them over batches, then divide; DESIGN §2), defined here only.

  tokens: every token produced (EOS included); iterations: model calls after the first, per row;
  mean_accepted_block_size = tokens / iterations; block_size_histogram[n - 1]: iterations that produced n tokens;
  first_call_tokens: the rows the first call produced alone (their one token ends them: no iteration). So
  tokens = sum_n n * histogram[n - 1] + first_call_tokens, and both counts agree on what they leave out.
  """
  tokens = int(jnp.sum(result.length_B))
  iterations = int(jnp.sum(result.iterations_B))
  return {
      'tokens': tokens,
      'iterations': iterations,
      'row_invocations': iterations + int(result.length_B.shape[0]),
      'batch_invocations': int(result.invocations),
      'mean_accepted_block_size': tokens / max(iterations, 1),
      'block_size_histogram': [int(c) for c in jnp.sum(result.block_counts_BxK, axis=0)],
      'first_call_tokens': int(jnp.sum(result.first_call_B)),
  }


# -- beam search (teacher for distillation; style of flax examples/wmt decode.py) ---------------------------

def brevity_penalty(alpha: float, length) -> jax.Array:
  """Length penalty of Wu et al. 2016: ((5 + length) / 6) ** alpha."""
  return jnp.power((5.0 + jnp.asarray(length, jnp.float32)) / 6.0, alpha)


@flax.struct.dataclass
class BeamState:
  """The carry of beam search: W beams per row alive, W finished hypotheses kept (best first)."""
  step: jax.Array              # int32 []
  alive_logp_BxW: jax.Array    # float32 [B, W]; log-probability of each alive beam
  alive_seq_BxWxL: jax.Array   # int32 [B, W, max_len]
  fin_score_BxW: jax.Array     # float32 [B, W]; length-normalized score of each finished hypothesis
  fin_flag_BxW: jax.Array      # bool [B, W]; the slot holds a finished hypothesis
  fin_seq_BxWxL: jax.Array     # int32 [B, W, max_len]
  model_state: Any             # decoder state of the alive beams; leaves [B * W, ...]


def beam_search(score_fn: ScoreFn, state: Any, *, fixed: Fixed, beam_size: int, alpha: float = 0.6):
  """Beam search with a length penalty; `state` has fixed.batch_size rows and is tiled to batch_size * beam_size.

  Returns (tokens_BxWxL [B, beam, max_len], scores_BxW), best first; scores are log-probabilities divided by
  the brevity penalty. Beams that never emit EOS are returned if no beam finished.
  """
  B, W, max_len = fixed.batch_size, beam_size, fixed.max_len
  neg_inf = jnp.float32(-1e7)
  state = jax.tree.map(lambda x: jnp.repeat(x, W, axis=0), state)
  batch_pos_BxW = jnp.arange(B)[:, None] * W

  def gather_beams(x_BxWx___, beam_idx_BxN):
    return jnp.take_along_axis(x_BxWx___, beam_idx_BxN.reshape(beam_idx_BxN.shape + (1,) * (x_BxWx___.ndim - 2)),
                               axis=1)

  def cond(c: BeamState):
    # Stop once no alive beam can still beat the worst finished beam (its score can only fall with length).
    best_alive_B = c.alive_logp_BxW[:, 0] / brevity_penalty(alpha, max_len)
    worst_fin_B = jnp.min(jnp.where(c.fin_flag_BxW, c.fin_score_BxW, neg_inf), axis=1)
    all_settled = jnp.all(jnp.all(c.fin_flag_BxW, axis=1) & (worst_fin_B >= best_alive_B))
    return (c.step < max_len) & ~all_settled

  def body(c: BeamState):
    step = c.step
    last_BxW = jnp.where(step == 0, fixed.bos_id, c.alive_seq_BxWxL[:, :, jnp.maximum(step - 1, 0)])
    logits, _, model_state = score_fn(c.model_state, last_BxW.reshape(B * W, 1), jnp.full((B * W,), step, jnp.int32))
    logp_BxWxV = jax.nn.log_softmax(logits[:, 0].astype(jnp.float32)).reshape(B, W, -1)
    vocab = logp_BxWxV.shape[-1]
    cand_BxWV = (c.alive_logp_BxW[:, :, None] + logp_BxWxV).reshape(B, W * vocab)
    # 2W candidates: enough that W of them are not EOS.
    top_logp_Bx2W, top_idx_Bx2W = jax.lax.top_k(cand_BxWV, 2 * W)
    top_beam_Bx2W, top_tok_Bx2W = top_idx_Bx2W // vocab, top_idx_Bx2W % vocab
    top_seq = gather_beams(c.alive_seq_BxWxL, top_beam_Bx2W).at[:, :, step].set(top_tok_Bx2W)
    top_eos_Bx2W = top_tok_Bx2W == fixed.eos_id

    alive_cand_Bx2W = jnp.where(top_eos_Bx2W, neg_inf, top_logp_Bx2W)
    alive_logp_BxW, pick_BxW = jax.lax.top_k(alive_cand_Bx2W, W)
    alive_seq_BxWxL = gather_beams(top_seq, pick_BxW)
    origin_BxW = jnp.take_along_axis(top_beam_Bx2W, pick_BxW, axis=1)
    model_state = jax.tree.map(lambda x: x[(batch_pos_BxW + origin_BxW).reshape(-1)], model_state)

    # A hypothesis ends only where its EOS ranks among the W best candidates (as in fairseq): a runner-up
    # EOS that the beam did not choose is dropped. With W = 1 and alpha = 0 this makes beam search exactly
    # greedy; with alpha > 0 a longer hypothesis may still beat greedy's on length-normalized score.
    ends_Bx2W = top_eos_Bx2W & (jnp.arange(2 * W)[None, :] < W)
    new_fin_Bx2W = jnp.where(ends_Bx2W, top_logp_Bx2W / brevity_penalty(alpha, step + 1), neg_inf)
    all_score = jnp.concatenate([c.fin_score_BxW, new_fin_Bx2W], axis=1)
    all_flag = jnp.concatenate([c.fin_flag_BxW, ends_Bx2W], axis=1)
    all_seq = jnp.concatenate([c.fin_seq_BxWxL, top_seq], axis=1)
    fin_score_BxW, keep_BxW = jax.lax.top_k(jnp.where(all_flag, all_score, neg_inf), W)
    return BeamState(step=step + 1, alive_logp_BxW=alive_logp_BxW, alive_seq_BxWxL=alive_seq_BxWxL,
                     fin_score_BxW=fin_score_BxW, fin_flag_BxW=jnp.take_along_axis(all_flag, keep_BxW, axis=1),
                     fin_seq_BxWxL=gather_beams(all_seq, keep_BxW), model_state=model_state)

  init_logp = jnp.concatenate([jnp.zeros((B, 1)), jnp.full((B, W - 1), neg_inf)], axis=1)
  first = BeamState(step=jnp.int32(0), alive_logp_BxW=init_logp, alive_seq_BxWxL=jnp.zeros((B, W, max_len), jnp.int32),
                    fin_score_BxW=jnp.full((B, W), neg_inf), fin_flag_BxW=jnp.zeros((B, W), bool),
                    fin_seq_BxWxL=jnp.zeros((B, W, max_len), jnp.int32), model_state=state)
  c = jax.lax.while_loop(cond, body, first)
  any_fin_B = jnp.any(c.fin_flag_BxW, axis=1)
  tokens = jnp.where(any_fin_B[:, None, None], c.fin_seq_BxWxL, c.alive_seq_BxWxL)
  scores = jnp.where(any_fin_B[:, None], c.fin_score_BxW, c.alive_logp_BxW / brevity_penalty(alpha, max_len))
  return tokens, scores
