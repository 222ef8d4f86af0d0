"""Prompt lookup: a drafter that is not a head. It proposes what followed the latest earlier occurrence of the
last n tokens, looked up in the source and in the output so far.

Translation copies names, numbers and punctuation from its source, and an output repeats its own phrases: where
the last n tokens occurred before, the tokens after that occurrence are a cheap guess of what comes next
(Saxena 2023, "prompt lookup decoding"; Yang et al. 2023, "Inference with reference"). It needs no training and
no heads: a plain Transformer (k = 1) decodes blockwise with it. The verification call decides, as for the heads'
proposals, so the output under `exact` is greedy's (bpd/decoding.py's loop, DESIGN "Adding a drafter").

The source and the output share one SentencePiece vocabulary (bpd/data/tokenizer.py), so a source id found in
the output is the same piece.
"""

import dataclasses

import jax
import jax.numpy as jnp

from bpd import decoding
from bpd.errors import UserError

PAD_ID = 0
_NOT_A_TOKEN = -1  # padding of the source, the separator, the output past its end: never equal to a token

HELP = ("a drafter is 'heads' (the model's proposal heads, the default) or 'prompt_lookup' / 'prompt_lookup:N' "
        "(match the last N..1 tokens in the source and the output so far; N >= 1, default 3)")


@dataclasses.dataclass(frozen=True)
class PromptLookup:
  """Drafts by n-gram lookup. Hashable: a static argument of the decoder's jit.

  max_ngram: the longest suffix tried first; shorter ones down to 1 only when it has no earlier occurrence
  (the longest match is the most specific; among equal ones the latest, the nearest context).
  """
  max_ngram: int = 3

  def __post_init__(self):
    if int(self.max_ngram) != self.max_ngram or self.max_ngram < 1:
      raise UserError(f'PromptLookup(max_ngram={self.max_ngram!r}): the n-gram length is an integer >= 1; {HELP}.')

  def __str__(self):
    return 'prompt_lookup' if self.max_ngram == 3 else f'prompt_lookup:{self.max_ngram}'

  def check(self, tree, rule) -> None:
    """UserError unless this drafter can draft `tree` for `rule`: one path (a chain), a rule that does not draw."""
    if not tree.is_chain:
      raise UserError(f'{self} proposes one continuation, a chain: it cannot fill the tree {tree}. Decode chains '
                      '(config.decode.ks) with it and set config.decode.trees=().')
    if rule.draws:
      raise UserError(f'{self} looks up the greedy next token\'s context; the rule {rule} samples that token. Use '
                      'it with a greedy criterion (exact, top_k:T, distance:EPS, min_block:L).')

  reads_heads = False  # the decoder runs head 1 alone: a plain Transformer (k = 1) decodes with it

  def init(self, context_BxC: jax.Array) -> jax.Array:
    """The state the loop carries: the source ids int32 [B, C], padding (id 0) marked as no token."""
    if context_BxC is None:
      raise ValueError(f'the drafter {self} looks up the source: blockwise needs context_BxC (the source ids)')
    context_BxC = jnp.asarray(context_BxC, jnp.int32)
    return jnp.where(context_BxC == PAD_ID, _NOT_A_TOKEN, context_BxC)

  def move(self, context_BxC: jax.Array, rows) -> jax.Array:
    del rows  # the output so far is read from the loop's rows at each proposal: the state is the source alone
    return context_BxC

  def propose(self, context_BxC: jax.Array, seen: decoding.DraftInputs, depth: int,
              per_row: bool) -> decoding.Proposal:
    """The lookup's continuation as the chain's guesses (`check` refuses trees, so per_row is False)."""
    del per_row
    tokens_BxDm1 = self.draft(context_BxC, seen.tokens_BxL, seen.length_B, seen.next_B, depth - 1)
    return decoding.proposal_from_tokens(tokens_BxDm1, seen.vocab_size)

  def draft(self, context_BxC: jax.Array, out_BxL: jax.Array, length_B: jax.Array, next_B: jax.Array,
            num: int) -> jax.Array:
    """num proposals int32 [B, num] for the positions after next_B.

    out_BxL[b, :length_B[b]]: the output accepted so far (later entries are stale and never read); next_B [B]: the
    token that follows it (head 1's choice, the chain's first node). The query is the last n tokens of
    out + [next]; a match is an earlier occurrence of them in source + [separator] + out + [next] that ends before
    next; the proposals are the tokens after the latest match, as far as the sequence goes (then PAD, which no
    verification passes).
    """
    B, C = context_BxC.shape
    L = out_BxL.shape[1]
    if num == 0:
      return jnp.zeros((B, 0), jnp.int32)
    positions_L = jnp.arange(L)
    out_BxL = jnp.where(positions_L[None, :] < length_B[:, None], out_BxL, _NOT_A_TOKEN)
    # The whole sequence: source, a separator (no match runs across it), the output with next at its end.
    seq_BxH = jnp.concatenate([context_BxC, jnp.full((B, 1), _NOT_A_TOKEN, jnp.int32), out_BxL,
                               jnp.full((B, 1), _NOT_A_TOKEN, jnp.int32)], axis=1)
    end_B = C + 1 + length_B  # where next sits
    seq_BxH = seq_BxH.at[jnp.arange(B), end_B].set(next_B.astype(jnp.int32))
    H = seq_BxH.shape[1]
    ends_H = jnp.arange(H)
    found_B = jnp.zeros((B,), bool)
    match_end_B = jnp.zeros((B,), jnp.int32)
    for n in range(self.max_ngram, 0, -1):  # longest first: a shorter n-gram only where no longer one matched
      match_BxH = (ends_H[None, :] < end_B[:, None]) & (length_B[:, None] + 1 >= n)  # ends before next
      for i in range(n):  # query token n-1-i (= seq[end - i]) against seq[e - i]
        query_B = jnp.take_along_axis(seq_BxH, jnp.maximum(end_B - i, 0)[:, None], axis=1)
        shifted_BxH = jnp.pad(seq_BxH, ((0, 0), (i, 0)), constant_values=_NOT_A_TOKEN)[:, :H]  # [b, e] = seq[e - i]
        match_BxH &= shifted_BxH == query_B
      latest_B = jnp.max(jnp.where(match_BxH, ends_H[None, :], -1), axis=1)
      take_B = ~found_B & (latest_B >= 0)
      match_end_B = jnp.where(take_B, latest_B, match_end_B)
      found_B |= take_B
    after_BxN = match_end_B[:, None] + 1 + jnp.arange(num)[None, :]
    tokens_BxN = jnp.take_along_axis(seq_BxH, jnp.minimum(after_BxN, H - 1), axis=1)
    usable_BxN = found_B[:, None] & (after_BxN <= end_B[:, None]) & (tokens_BxN != _NOT_A_TOKEN)
    return jnp.where(usable_BxN, tokens_BxN, PAD_ID).astype(jnp.int32)
