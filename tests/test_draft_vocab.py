"""A truncated draft vocabulary (config.model.draft_vocab; bpd/draft_vocab.py, ModelConfig.draft_ids).

The proposal heads project onto R draft rows of the embedding and propose_fn still returns [B, k-1, V] logits,
-inf outside the draft ids. What must hold, by construction:
- exact blockwise decoding with a draft vocabulary is greedy decoding, token for token, with both head types;
- proposals never leave the draft set, and the draft logits are the full projection's at the draft ids;
- speculative sampling with drafts from the truncated q still samples the model exactly;
- the ids are the R most frequent ids of the training targets, ascending; bad sizes are a UserError.
"""

import dataclasses
import functools
import json

import hypothesis
from hypothesis import strategies as st
import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import pytest

from bpd import checks
from bpd import decoding
from bpd import draft_vocab
from bpd import model as model_lib
from bpd import tasks
from bpd.data import images
from bpd.errors import UserError
from tests import test_heads_sequential as sequential_subject
from tests.stubs import SoftStub
from tests.test_speculative import _batch, assert_matches_ancestral
from configs import demo

VOCAB, K, BOS, EOS = sequential_subject.VOCAB, sequential_subject.K, sequential_subject.BOS, sequential_subject.EOS
MAX_LEN, BATCH, DRAFT = sequential_subject.MAX_LEN, 8, 10
SETTINGS = hypothesis.settings(max_examples=12, deadline=None, derandomize=True, database=None)


def _subjects():
  """{head type: (model, params)}: tests/test_heads_sequential.py's built subject, and the same weights without the
  token kernels as independent heads (head 2 there proposes from LayerNorm(hidden) alone)."""
  model, params = sequential_subject.build_subject()
  independent = {**params, 'multi_output': {n: v for n, v in params['multi_output'].items() if n != 'token_kernel'}}
  return {'sequential': (model, params),
          'independent': (model_lib.Transformer(dataclasses.replace(model.config, head_type='independent')),
                          independent)}


def _fixed(src):
  return decoding.Fixed(batch_size=src.shape[0], max_len=MAX_LEN, bos_id=BOS, eos_id=EOS)


@functools.partial(jax.jit, static_argnames='model')
def _greedy(params, src, *, model):
  fns = model_lib.decode_fns(model, params, num_heads=1)
  init_state, score_fn = fns.init, fns.score
  g = decoding.greedy(score_fn, init_state(src, MAX_LEN + 1), fixed=_fixed(src))
  return g.tokens_BxL, g.length_B, g.invocations


CHAIN = decoding.layout(decoding.chain_tree(K))


@functools.partial(jax.jit, static_argnames=('model', 'tree', 'choices'))
def _blockwise(params, src, *, model, tree=CHAIN, choices=True):
  """choices=False: the loop drafts from propose's logits alone (ModelFns without propose_choices)."""
  fns = model_lib.decode_fns(model, params)
  if not choices:
    fns = fns._replace(propose_choices=None)
  return decoding.blockwise(fns, fns.init(src, MAX_LEN + tree.num_nodes + 1), fixed=_fixed(src), tree=tree,
                            rule=decoding.EXACT)


def _plain(model):
  """The one-head model without a draft vocabulary: greedy's, the same compile for every subject."""
  return model_lib.Transformer(dataclasses.replace(model.config, k=1, head_type='independent', draft_ids=()))


@pytest.fixture(scope='module')
def subjects():
  """{head type: (draft model, params)}, the draft ids counted on greedy's outputs of 32 sources (their 'training
  targets'): the DRAFT most frequent of the outputs' tokens, so that proposals are often right, and leaving some of
  the tokens greedy emits outside (test_exact_..._equals_greedy asserts both)."""
  built = _subjects()
  model, params = built['sequential']
  src = jnp.asarray(sequential_subject._sources(np.random.RandomState(7), 32))
  tokens, _, _ = _greedy(params, src, model=_plain(model))
  ids = draft_vocab.most_frequent(np.bincount(np.asarray(tokens).reshape(-1), minlength=VOCAB), DRAFT)
  return {head_type: (model_lib.Transformer(dataclasses.replace(m.config, draft_ids=ids)), p)
          for head_type, (m, p) in built.items()}


@pytest.mark.parametrize('tree', [CHAIN, decoding.Dynamic(8, K, beam=3, ranks=3)], ids=['chain', 'dynamic'])
@pytest.mark.parametrize('head_type', ['independent', 'sequential'])
@hypothesis.given(seed=st.integers(0, 2**31 - 1))
@SETTINGS
def test_exact_blockwise_with_a_draft_vocabulary_equals_greedy(subjects, head_type, tree, seed):
  """Chains and context-aware trees (sequential heads: each parent expanded over the draft ids)."""
  model, params = subjects[head_type]
  src = jnp.asarray(sequential_subject._sources(np.random.RandomState(seed % 2**31), BATCH))
  greedy_tokens, greedy_length, _ = _greedy(params, src, model=_plain(model))
  block = _blockwise(params, src, model=model, tree=tree)
  np.testing.assert_array_equal(np.asarray(block.tokens_BxL), np.asarray(greedy_tokens))
  np.testing.assert_array_equal(np.asarray(block.length_B), np.asarray(greedy_length))


@pytest.mark.parametrize('head_type', ['independent', 'sequential'])
def test_the_draft_subject_is_fair(subjects, head_type):
  """The test above is a real one: proposals are accepted (the draft vocabulary holds greedy's frequent tokens), and
  greedy emits tokens outside the draft set, which no proposal can match."""
  model, params = subjects[head_type]
  src = jnp.asarray(sequential_subject._sources(np.random.RandomState(1), BATCH))
  greedy_tokens, _, _ = _greedy(params, src, model=_plain(model))
  emitted = set(np.asarray(greedy_tokens).reshape(-1).tolist()) - {0}
  assert emitted - set(model.config.draft_ids), 'every emitted token is a draft token'
  assert decoding.summarize(_blockwise(params, src, model=model))['mean_accepted_block_size'] > 1.2


@pytest.mark.parametrize('head_type', ['independent', 'sequential'])
def test_proposals_never_leave_the_draft_set(subjects, head_type):
  """propose_fn (the rows gathered once in decode_fns) and propose applied alone (gathered inside) give finite
  logits at the draft ids only; head 2's are the full projection's at those ids (for sequential heads, fed the same
  token; later sequential heads are fed their draft argmax, so their inputs differ from the full model's)."""
  model, params = subjects[head_type]
  full = model_lib.Transformer(dataclasses.replace(model.config, draft_ids=()))
  rng = np.random.RandomState(3)
  hidden = jnp.asarray(rng.normal(size=(16, model.config.d_model)), jnp.float32)
  if head_type == 'sequential':
    hidden = {'hidden_BxTxD': hidden, 'first_BxT': jnp.asarray(rng.randint(0, VOCAB, size=16), jnp.int32)}
  through_fns = jax.jit(lambda p, h: model_lib.decode_fns(model, p).propose(h))(params, hidden)
  apply = functools.partial(jax.jit(model.apply, static_argnames='method'), method=model_lib.Transformer.propose)
  alone = apply({'params': params}, hidden)
  reference = jax.jit(full.apply, static_argnames='method')({'params': params}, hidden,
                                                           method=model_lib.Transformer.propose)
  ids = np.asarray(model.config.draft_ids)
  outside = np.setdiff1d(np.arange(VOCAB), ids)
  for logits in (np.asarray(through_fns), np.asarray(alone)):
    assert logits.shape == (16, K - 1, VOCAB)
    assert np.isfinite(logits[..., ids]).all() and np.all(logits[..., outside] == -np.inf)
    assert np.isin(np.argmax(logits, axis=-1), ids).all()
    np.testing.assert_allclose(logits[:, 0, ids], np.asarray(reference)[:, 0, ids], atol=1e-5)
  np.testing.assert_allclose(np.asarray(through_fns)[..., ids], np.asarray(alone)[..., ids], atol=1e-5)
  if head_type == 'independent':
    np.testing.assert_allclose(np.asarray(through_fns)[..., ids], np.asarray(reference)[..., ids], atol=1e-5)


@pytest.mark.parametrize('head_type', ['independent', 'sequential'])
def test_the_heads_choices_are_the_argmaxes_of_their_logits(subjects, head_type):
  """propose_choices (which a chain drafts from, and whose logits XLA then drops) returns propose's logits and, as
  the second output, what the loop's argmax takes from them: the first id of the maximum, a draft id. A chain
  drafted from the choices decodes what one drafted from the logits decodes."""
  model, params = subjects[head_type]
  rng = np.random.RandomState(5)
  hidden = jnp.asarray(rng.normal(size=(16, model.config.d_model)), jnp.float32)
  if head_type == 'sequential':
    hidden = {'hidden_BxTxD': hidden, 'first_BxT': jnp.asarray(rng.randint(0, VOCAB, size=16), jnp.int32)}
  fns = jax.jit(lambda p, h: model_lib.decode_fns(model, p).propose_choices(h))
  logits, choices = (np.asarray(a) for a in fns(params, hidden))
  np.testing.assert_array_equal(logits, np.asarray(jax.jit(lambda p, h: model_lib.decode_fns(model, p).propose(h))(
      params, hidden)))
  assert choices.dtype == np.int32 and choices.shape == (16, K - 1)
  np.testing.assert_array_equal(choices, np.argmax(logits, axis=-1))  # numpy: the first index of the maximum
  src = jnp.asarray(sequential_subject._sources(np.random.RandomState(11), BATCH))
  with_choices, from_logits = (_blockwise(params, src, model=model, choices=c) for c in (True, False))
  for a, b in zip(jax.tree.leaves(with_choices), jax.tree.leaves(from_logits)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


# -- speculative sampling with drafts from the truncated q ------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class DraftSoftStub(SoftStub):
  """SoftStub whose heads draft from `draft_ids` only, spread as the model spreads them (spread_draft_logits). The
  set leaves out word 5, which head 1 can emit: it can only come from the rejection rule's residual."""
  draft_ids: tuple = (1, 3, 4)

  def propose_fn(self, hidden):
    logits_BxKm1xV = SoftStub.propose_fn(self, hidden)
    return model_lib.spread_draft_logits(logits_BxKm1xV[..., np.asarray(self.draft_ids)], self.draft_ids,
                                         self.vocab_size)


@pytest.mark.parametrize('paths', [None, ((0,), (0, 0), (0, 1), (0, 0, 0))], ids=['chain', 'tree'])
def test_speculative_samples_with_a_draft_vocabulary_follow_the_model(paths):
  stub = DraftSoftStub(k=3)
  result = _batch(stub, 3, 0.8, paths=paths)
  assert_matches_ancestral(result, stub, 3, 0.8)
  tokens = np.asarray(result.tokens_BxL)
  assert np.mean(tokens == 5) > 0.02  # the left-out word is sampled, from the residual
  assert decoding.summarize(result)['mean_accepted_block_size'] > 1.2


# -- the ids, and bad sizes --------------------------------------------------------------------------------------

def test_most_frequent_takes_the_largest_counts_ties_to_the_lower_id_ascending():
  counts = np.array([0, 9, 2, 5, 5, 1, 5, 0])
  assert draft_vocab.most_frequent(counts, 1) == (1,)
  assert draft_vocab.most_frequent(counts, 3) == (1, 3, 4)  # 3, 4 and 6 tie at 5: the lower ids
  assert draft_vocab.most_frequent(counts, 5) == (1, 2, 3, 4, 6)
  assert draft_vocab.most_frequent(counts, 7) == (0, 1, 2, 3, 4, 5, 6)  # zero counts: ties, lower id first


class _WordTokenizer:
  """Whitespace words to fixed ids (what encode_pairs needs of a tokenizer)."""
  ids = {'a': 3, 'b': 4, 'c': 5, 'd': 6}
  vocab_size = 8

  def encode_batch(self, texts):
    return [[self.ids[w] for w in t.split()] for t in texts]


def _config(**fields):
  c = ml_collections.ConfigDict({
      'seed': 0, 'model': {'draft_vocab': 0},
      'data': {'source': 'text', 'dir': '', 'train_split': 'train', 'src_lang': 'en', 'tgt_lang': 'de', 'max_len': 4,
               'distilled_from': '', 'image_source': 'npy', 'vocab_size': 8}})
  for key, value in fields.items():
    section, name = key.split('.')
    c[section][name] = value
  return c


def test_text_counts_are_the_training_targets_as_training_reads_them(tmp_path):
  """Target ids with their EOS; the pair whose target is too long (5 tokens with EOS > max_len 4) is dropped, as
  training drops it, and the sources are not counted."""
  (tmp_path / 'train.en').write_text('d d d\nd\nd\n')
  (tmp_path / 'train.de').write_text('a b b\nb c\na a a a\n')
  config = _config(**{'data.dir': str(tmp_path), 'model.draft_vocab': 2})
  counts = tasks.TRANSLATION.target_counts(config, _WordTokenizer())
  np.testing.assert_array_equal(counts, [0, 2, 0, 1, 3, 1, 0, 0])  # EOS twice, a once, b three times, c once
  count = lambda: tasks.TRANSLATION.target_counts(config, _WordTokenizer())
  assert draft_vocab.draft_ids(2, count, 8) == (1, 4)
  # Stored ids of that size are kept (a resumed run, a decode of a trained workdir); 0 turns the vocabulary off.
  assert draft_vocab.draft_ids(2, count, 8, stored=(3, 5)) == (3, 5)
  assert draft_vocab.draft_ids(2, count, 8, stored=(3, 5, 6)) == (1, 4)
  assert draft_vocab.draft_ids(0, count, 8, stored=(3, 5)) == ()


def test_image_counts_are_the_intensities_of_the_training_images(tmp_path):
  highres = np.zeros((2, 32, 32, 3), np.uint8)
  highres[0, :2] = 200
  highres[1, 0, 0, 0] = 7
  np.save(tmp_path / 'train.npy', highres)
  config = _config(**{'data.source': 'images', 'data.dir': str(tmp_path)})
  counts = tasks.SUPERRES.target_counts(config, None)
  assert counts.shape == (images.IMAGE_VOCAB_SIZE,) and counts[:images.PIXEL_OFFSET].sum() == 0
  offset = images.PIXEL_OFFSET
  assert (counts[offset + 200], counts[offset + 7], counts.sum()) == (2 * 32 * 3, 1, 2 * 32 * 32 * 3)


@pytest.mark.parametrize('size', [-1, 8, 9])
def test_bad_draft_sizes_are_a_user_error_before_anything_is_counted(size, tmp_path):
  config = _config(**{'data.dir': str(tmp_path / 'nothing'), 'model.draft_vocab': size})
  with pytest.raises(UserError, match=r'config\.model\.draft_vocab=.*0 \(off'):
    draft_vocab.draft_ids(size, lambda: tasks.TRANSLATION.target_counts(config, _WordTokenizer()), 8)


def test_a_too_large_draft_vocabulary_fails_the_config_checks():
  config = demo.get_config()
  config.model.draft_vocab = config.data.vocab_size
  with pytest.raises(UserError, match='draft_vocab'):
    checks.check_model(config)
  config.model.draft_vocab = config.data.vocab_size // 4
  checks.check_model(config)


def test_model_json_round_trip_and_bad_ids():
  config = model_lib.model_config('tiny', vocab_size=10, k=2, draft_ids=[1, 4, 6])
  assert config.draft_ids == (1, 4, 6) and hash(config)
  assert model_lib.ModelConfig(**json.loads(json.dumps(dataclasses.asdict(config)))) == config  # model.json
  for ids in ([4, 1], [1, 1], [1, 10], list(range(10))):
    with pytest.raises(UserError, match='draft_ids'):
      model_lib.model_config('tiny', vocab_size=10, k=2, draft_ids=ids)

