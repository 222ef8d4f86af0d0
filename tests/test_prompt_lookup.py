"""Prompt lookup (bpd/prompt_lookup.py), a drafter that is not a head: its lookup against a reference written from
its description, exactness in the loop on stub logits, full blocks where the output copies the source, and a clear
error for every setting it cannot draft."""

import functools

import hypothesis
from hypothesis import strategies as st
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from bpd import decoding
from bpd import drafters
from bpd import prompt_lookup
from bpd import speculative
from bpd.errors import UserError
from tests.stubs import BOS, EOS, FIRST_WORD, PAD, Stub

SETTINGS = hypothesis.settings(max_examples=40, deadline=None, derandomize=True, database=None)


def reference_lookup(context, out, next_token, max_ngram, num):
  """The docstring's rule, one row, in plain Python: the sequence is the source (padding is no token), a separator,
  the output so far and the next token. For n = max_ngram down to 1, the first n with an earlier occurrence of the
  sequence's last n tokens (all from the output and next) wins; of its occurrences, the one that ends last; the
  proposals are the num tokens after it, PAD where the sequence has no token there or ends."""
  seq = [None if c == PAD else int(c) for c in context] + [None] + [int(t) for t in out] + [int(next_token)]
  end = len(seq) - 1
  for n in range(max_ngram, 0, -1):
    if n > len(out) + 1:
      continue
    query = seq[end - n + 1:]
    ends = [e for e in range(n - 1, end) if seq[e - n + 1:e + 1] == query]
    if ends:
      after = seq[max(ends) + 1:max(ends) + 1 + num]
      after = [PAD if t is None else t for t in after]
      return after + [PAD] * (num - len(after))
  return [PAD] * num


@functools.partial(jax.jit, static_argnames=('drafter', 'num'))
def _draft(drafter, context_BxC, out_BxL, length_B, next_B, num):
  return drafter.draft(drafter.init(context_BxC), out_BxL, length_B, next_B, num)


@hypothesis.given(st.integers(0, 2**31 - 1), st.sampled_from([1, 2, 3, 5]), st.sampled_from([1, 3, 7]))
@SETTINGS
def test_lookup_matches_the_reference(seed, max_ngram, num):
  rng = np.random.RandomState(seed)
  B, C, L = 6, 10, 14
  words = rng.randint(2, 5)  # few distinct tokens: many matches, of every length
  context = rng.randint(FIRST_WORD, FIRST_WORD + words, size=(B, C))
  context[rng.rand(B, C) < 0.2] = PAD  # padding inside and at the end is no token
  out = rng.randint(FIRST_WORD, FIRST_WORD + words, size=(B, L))
  length = rng.randint(0, L - 1, size=B)
  nxt = rng.randint(FIRST_WORD, FIRST_WORD + words, size=B)
  drafter = prompt_lookup.PromptLookup(max_ngram=max_ngram)
  got = np.asarray(_draft(drafter, jnp.asarray(context), jnp.asarray(out), jnp.asarray(length), jnp.asarray(nxt), num))
  for b in range(B):
    assert got[b].tolist() == reference_lookup(context[b], out[b, :length[b]], nxt[b], max_ngram, num), b


def test_lookup_by_hand():
  drafter = prompt_lookup.PromptLookup()
  context = jnp.asarray([[5, 6, 7, 8, PAD, PAD]])
  out = jnp.asarray([[9, 5, 6, 0, 0, 0]])
  draft = lambda length, nxt, num=3: _draft(drafter, context, out, jnp.asarray([length]), jnp.asarray([nxt]),
                                            num)[0].tolist()
  assert draft(2, 6) == [7, 8, PAD]  # "5 6" in the source: what follows it, then the source's end
  assert draft(3, 7) == [8, PAD, PAD]  # "5 6 7"
  assert draft(0, 5) == [6, 7, 8]  # the first token: one token of query
  assert draft(1, 4) == [PAD] * 3  # 4 occurs nowhere before
  assert draft(3, 9) == [5, 6, 9]  # "9" in the output, the latest occurrence: its continuation runs up to next


@functools.partial(jax.jit, static_argnames=('batch_size', 'k', 'max_len', 'criterion', 'drafter'))
def _decode(seed_B, eos_at_B, context_BxC, stub, *, batch_size, k, max_len, criterion, drafter):
  state = stub.init_state(seed_B, eos_at_B, max_len + k + 1)
  fixed = decoding.Fixed(batch_size=batch_size, max_len=max_len, bos_id=BOS, eos_id=EOS)
  g = decoding.greedy(stub.score_fn, state, fixed=fixed)
  # No propose_fn: the heads are never read.
  block = decoding.blockwise(decoding.ModelFns(stub.score_fn, None), state, fixed=fixed, tree=decoding.chain(k),
                             rule=criterion, drafter=drafter, context_BxC=context_BxC)
  return g.tokens_BxL, block


cases = st.fixed_dictionaries({
    'batch': st.sampled_from([1, 8]),
    'k': st.sampled_from([1, 4, 8]),
    'max_len': st.sampled_from([1, 24]),
    'eos_rate': st.sampled_from([0, 7]),
    'max_ngram': st.sampled_from([3]),  # other lengths: test_lookup_matches_the_reference
    'criterion': st.sampled_from(['exact', 'exact', 'top_k:2', 'min_block:2']),
    'seed': st.integers(0, 2**31 - 1),
})


@hypothesis.given(cases)
@hypothesis.settings(SETTINGS, max_examples=20)  # each shape and criterion compiles
def test_exact_with_prompt_lookup_equals_greedy(case):
  """Two words (vocabulary 5): the stub's greedy output is a random binary string, so the lookup finds matches that
  are right and matches that are wrong. Exact rows equal greedy and the numpy reference; every criterion keeps the
  loop's bookkeeping; and the lookup's proposals are accepted somewhere (blocks longer than 1)."""
  stub = Stub(vocab_size=5, k=1, eos_rate=case['eos_rate'])
  rng = np.random.RandomState(case['seed'] % 2**31)
  B, k, max_len = case['batch'], case['k'], case['max_len']
  seed_B = rng.randint(0, 2**31, size=B)
  eos_at_B = rng.randint(1, max_len + 3, size=B)
  context_BxC = rng.randint(FIRST_WORD, 5, size=(B, 9))
  criterion = decoding.parse_criterion(case['criterion'])
  if criterion.min_block > k:
    return
  greedy, block = _decode(jnp.asarray(seed_B), jnp.asarray(eos_at_B), jnp.asarray(context_BxC), stub, batch_size=B,
                          k=k, max_len=max_len, criterion=criterion,
                          drafter=prompt_lookup.PromptLookup(max_ngram=case['max_ngram']))
  reference = stub.reference_greedy(seed_B, eos_at_B, max_len)
  np.testing.assert_array_equal(np.asarray(greedy), reference)
  length_B = np.asarray(block.length_B)
  counts = np.asarray(block.block_counts_BxK)
  np.testing.assert_array_equal(counts.sum(axis=1), np.asarray(block.iterations_B))
  first_call = np.asarray(block.first_call_B)
  np.testing.assert_array_equal((counts * np.arange(1, k + 2)).sum(axis=1), length_B - first_call)
  if criterion.exact_in_effect and criterion.min_block == 1:
    np.testing.assert_array_equal(np.asarray(block.tokens_BxL), reference)


def test_the_lookup_is_accepted_where_the_stub_repeats_itself():
  """By construction: a two-word greedy output of 24 tokens repeats its 3-grams, so a k = 4 chain accepts blocks of
  more than one token (the proposals reach the loop and pass), still identical to greedy."""
  stub = Stub(vocab_size=5, k=1)
  rng = np.random.RandomState(0)
  B, max_len = 8, 24
  seed_B, eos_at_B = rng.randint(0, 2**31, size=B), np.full(B, max_len + 5)
  _, block = _decode(jnp.asarray(seed_B), jnp.asarray(eos_at_B), jnp.asarray(rng.randint(3, 5, size=(B, 9))), stub,
                     batch_size=B, k=4, max_len=max_len, criterion=decoding.EXACT,
                     drafter=prompt_lookup.PromptLookup())
  np.testing.assert_array_equal(np.asarray(block.tokens_BxL), stub.reference_greedy(seed_B, eos_at_B, max_len))
  stats = decoding.summarize(block)
  assert stats['mean_accepted_block_size'] > 1.2, stats  # a two-letter string: right about half the time


class CopyStub:
  """A model that copies its source: after position p it predicts source token p (then EOS). Stateless, so a
  rolled-back block leaves nothing behind; it tests acceptance, the hashing Stub tests exactness."""

  def __init__(self, src_BxC, vocab_size):
    self.src, self.vocab_size = src_BxC, vocab_size

  def score_fn(self, state, tokens_BxT, start_B, tree=None):
    B, T = tokens_BxT.shape
    pos_BxT = jnp.broadcast_to(start_B, (B,))[:, None] + jnp.arange(T)[None, :]
    padded = jnp.concatenate([self.src, jnp.full((B, 1), EOS, jnp.int32)], axis=1)
    best_BxT = jnp.take_along_axis(padded, jnp.minimum(pos_BxT, padded.shape[1] - 1), axis=1)
    return jax.nn.one_hot(best_BxT, self.vocab_size) * 5.0, None, state


@pytest.mark.parametrize('k', [2, 4, 8])
def test_a_copy_is_drafted_whole(k):
  """The output is the source: after its first token every lookup finds the rest, so every iteration accepts k
  tokens (+1 for the verified next token) until the end."""
  src = jnp.asarray([[10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22, 23, 24, 25, 26]], jnp.int32)
  stub = CopyStub(src, vocab_size=30)
  fixed = decoding.Fixed(batch_size=1, max_len=40, bos_id=BOS, eos_id=EOS)
  block = jax.jit(lambda: decoding.blockwise(decoding.ModelFns(stub.score_fn, None), {}, fixed=fixed,
                                             tree=decoding.chain(k), rule=decoding.EXACT,
                                             drafter=prompt_lookup.PromptLookup(), context_BxC=src))()
  length = int(block.length_B[0])
  assert np.asarray(block.tokens_BxL[0, :length]).tolist() == np.asarray(src[0]).tolist() + [EOS]
  assert int(block.iterations_B[0]) <= -(-(length - 1) // k)  # the first token is the first call's; k per call


def test_settings_it_cannot_draft_are_refused():
  drafter = prompt_lookup.PromptLookup()
  with pytest.raises(UserError, match='cannot fill the tree'):
    drafter.check(decoding.layout(((0,), (1,), (0, 0))), decoding.EXACT)
  with pytest.raises(UserError, match='cannot fill the tree'):
    drafter.check(decoding.Dynamic(num_nodes=8, depth=4), decoding.EXACT)
  with pytest.raises(UserError, match='samples that token'):
    drafter.check(decoding.chain(4), speculative.Sampling(temperature=1.0))
  with pytest.raises(UserError, match='integer >= 1'):
    prompt_lookup.PromptLookup(max_ngram=0)
  fns = decoding.ModelFns(Stub().score_fn, None)
  fixed = decoding.Fixed(batch_size=1, max_len=4, bos_id=BOS, eos_id=EOS)
  with pytest.raises(ValueError, match='context_BxC'):
    decoding.blockwise(fns, {}, fixed=fixed, tree=decoding.chain(2), drafter=drafter)


@pytest.mark.parametrize('spec, expected', [('heads', decoding.HEADS), ('prompt_lookup', prompt_lookup.PromptLookup()),
                                            ('prompt_lookup:2', prompt_lookup.PromptLookup(max_ngram=2))])
def test_drafters_by_name(spec, expected):
  assert drafters.parse(spec) == expected
  if expected is not None:
    assert drafters.parse(str(expected)) == expected  # its name parses back


@pytest.mark.parametrize('spec, message', [('prompt', 'Unknown drafter'), ('heads:2', 'takes no argument'),
                                           ('prompt_lookup:x', 'not an integer'),
                                           ('prompt_lookup:0', 'integer >= 1')])
def test_bad_drafter_names_raise_clear_errors(spec, message):
  with pytest.raises(UserError, match=message):
    drafters.parse(spec)


def test_the_design_notes_example_drafter_runs_in_the_loop():
  """docs/DESIGN.md's worked example of a new drafter, executed as written, registered as written: on a model that
  copies its source it drafts every block whole, exactly, and the name resolves through config's word."""
  import dataclasses  # pylint: disable=g-import-not-at-top
  import os  # pylint: disable=g-import-not-at-top
  text = open(os.path.join(os.path.dirname(__file__), '..', 'docs', 'DESIGN.md')).read()
  section = text.split('### Adding a drafter')[1].split('\n### ')[0]
  code, registration = [block.split('```')[0] for block in section.split('```python')[1:3]]
  scope = {'dataclasses': dataclasses, 'jax': jax, 'jnp': jnp, 'UserError': UserError, 'drafters': drafters,
           'decoding': decoding}
  exec(code, scope)  # pylint: disable=exec-used
  saved = dict(drafters.REGISTRY)
  try:
    exec(registration, scope)  # pylint: disable=exec-used
    drafter = drafters.parse('copy_source')
  finally:
    drafters.REGISTRY.clear()
    drafters.REGISTRY.update(saved)
  assert str(drafter) == 'copy_source'
  src = jnp.asarray([[10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20]], jnp.int32)
  stub = CopyStub(src, vocab_size=30)
  fixed = decoding.Fixed(batch_size=1, max_len=20, bos_id=BOS, eos_id=EOS)
  block = jax.jit(lambda: decoding.blockwise(decoding.ModelFns(stub.score_fn, None), {}, fixed=fixed,
                                             tree=decoding.chain(4), rule=decoding.EXACT, drafter=drafter,
                                             context_BxC=src))()
  length = int(block.length_B[0])
  assert np.asarray(block.tokens_BxL[0, :length]).tolist() == np.asarray(src[0]).tolist() + [EOS]
  assert int(block.iterations_B[0]) <= -(-(length - 1) // 4)
  with pytest.raises(UserError, match='drafts chains'):
    drafter.check(decoding.Dynamic(num_nodes=8, depth=4), decoding.EXACT)
