"""Sequentially dependent proposal heads (model.head_type='sequential'; Hydra, Ankner et al. 2024).

Head i + 1 also sees the embedding of the token proposed for the position before the one it predicts: teacher-
forced on the target in training, the previous head's argmax in decoding (head 1's for head 2, carried from
score to propose in the hidden pytree). What must hold, each by construction rather than by how training went:
- exact blockwise decoding with sequential heads is greedy decoding, token for token;
- the cached decode-time proposals are the full-sequence training-time heads fed the same tokens;
- the sampled-head loss is that head's loss of the mean path; the frozen regime moves only the heads;
- 'independent' stays the paper's model: default everywhere, the same parameter tree, old model.json files load;
- context-aware trees (dynamic:N) expand each parent from its own token and stay exact; static trees are refused
  with a UserError before anything compiles.
"""

import dataclasses
import functools
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from bpd import checks
from bpd import decoding
from bpd import model as model_lib
from bpd import trees
from bpd import train
from bpd.errors import UserError
from tests import reference
from configs import common
from configs import demo

VOCAB, K, D, BOS, EOS = 40, 4, 32, 2, 1
MAX_LEN = 20
SRC_LEN = 10


def _sources(rng, batch):
  """3..8 random words, then padding (per-row source lengths differ)."""
  src = np.zeros((batch, SRC_LEN), np.int32)
  for b in range(batch):
    n = rng.randint(3, 9)
    src[b, :n] = rng.randint(3, VOCAB, size=n)
  return src


@pytest.fixture(scope='module')
def subject():
  return build_subject()


def build_subject():
  """(model, params): a tiny untrained 4-head sequential model with three edits; the same on every CPU.

  Why built, not trained: as the image subject of tests/test_local_attention.py, so that what the tests rely on
  does not depend on a CPU's float rounding amplified by training. From jax.random parameters (threefry: the same
  bits everywhere):
  - The decoder layers' output kernels (self-attention, cross-attention, feed-forward) scaled by 10. At init the
    input token's embedding dominates the residual stream and, the output projection being tied to it, a random
    model repeats its input token forever; scaled up, the layers' outputs (prefix, source, position) decide.
  - Head 2 (the first proposal head) made a copier of the token it is fed: output weights zero and token_kernel
    3·I, so its vector is LayerNorm(hidden + 3·e(ŷ)) and it proposes ŷ, head 1's choice, once more: right exactly
    where greedy repeats a token, wrong where it changes. Right sometimes, not always, and only if it was fed
    the right token.
  - Heads 3 and 4 get random token kernels: their choices depend on the token the head before chose.
  test_subject_is_fair asserts the resulting properties with wide margins (measured: mean accepted block 1.96
  at k = 4 with blocks of 1 / 2 / 3 / 4 in 21 / 131 / 7 / 4 iterations, 13 distinct rows of 16, 12 of them
  changing token along the row, smallest top-2 gap of head 1 1.0e-3, some 1000x float32 rounding here).
  """
  config = model_lib.model_config('tiny', vocab_size=VOCAB, k=K, dropout_rate=0.0, d_model=D, d_ff=64,
                                  head_type='sequential')
  params = dict(jax.jit(model_lib.init_params, static_argnums=0)(config, jax.random.PRNGKey(0)))
  for name in ('decoder_layers_0', 'decoder_layers_1'):
    layer = params[name]
    def scaled(sub, inner, layer=layer):
      return dict(layer[sub], **{inner: dict(layer[sub][inner], kernel=layer[sub][inner]['kernel'] * 10)})
    params[name] = dict(layer, self_attn=scaled('self_attn', 'out'), cross_attn=scaled('cross_attn', 'out'),
                        ff=scaled('ff', 'wo'))
  heads = params['multi_output']
  token_kernel = jax.random.normal(jax.random.PRNGKey(5), (K - 1, D, D)) / np.sqrt(D)
  params['multi_output'] = dict(heads, wo_kernel=heads['wo_kernel'].at[0].set(0.0),
                                wo_bias=heads['wo_bias'].at[0].set(0.0),
                                token_kernel=token_kernel.at[0].set(3.0 * jnp.eye(D)))
  return model_lib.Transformer(config), params


def _greedy_and_blockwise(params, src, *, model, k, criterion=decoding.Criterion()):
  fixed = decoding.Fixed(batch_size=src.shape[0], max_len=MAX_LEN, bos_id=BOS, eos_id=EOS)
  return reference.greedy_and_blockwise(params, src, model=model, tree=reference.chain(k), fixed=fixed,
                                        rule=criterion)


@pytest.fixture(scope='module')
def decoded(subject):
  model, params = subject
  src = jnp.asarray(_sources(np.random.RandomState(1), 16))
  return src, {k: _greedy_and_blockwise(params, src, model=model, k=k) for k in (2, 4)}


def test_subject_is_fair(subject, decoded):
  """Exact == greedy is a real test on it: outputs differ between rows and change along a row, some proposals are
  accepted and some not (at k = 4: blocks of 1, 2 and 3 all occur), and head 1's choice wins by a margin far above
  float rounding everywhere (the cached k-token path and greedy's 1-token path may round differently)."""
  model, params = subject
  src, runs = decoded
  (greedy_tokens, _, _), block = runs[4]
  greedy_tokens = np.asarray(greedy_tokens)
  assert len(np.unique(greedy_tokens, axis=0)) >= 8
  assert np.mean([len(np.unique(row)) > 1 for row in greedy_tokens]) >= 0.4
  stats = decoding.summarize(block)
  assert 1.4 < stats['mean_accepted_block_size'] < 3.0
  assert all(count > 0 for count in stats['block_size_histogram'][:3])
  tgt_in = np.concatenate([np.full((len(greedy_tokens), 1), BOS), greedy_tokens[:, :-1]], axis=1)
  logits = jax.jit(model.apply)({'params': params}, src, jnp.asarray(tgt_in))
  top2 = np.sort(np.asarray(logits[:, :, 0]), axis=-1)[..., -2:]
  assert (top2[..., 1] - top2[..., 0]).min() > 1e-4


@pytest.mark.parametrize('k', [2, 4])
def test_exact_blockwise_with_sequential_heads_equals_greedy(decoded, k):
  """The chain's guarantee (paper §5) with the first k' heads of the sequential model (first_heads slices the
  token kernels too)."""
  _, runs = decoded
  (greedy_tokens, greedy_length, _), block = runs[k]
  np.testing.assert_array_equal(np.asarray(block.tokens_BxL), np.asarray(greedy_tokens))
  np.testing.assert_array_equal(np.asarray(block.length_B), np.asarray(greedy_length))
  counts = np.asarray(block.block_counts_BxK)  # sizes 1..k+1: the row's last token comes with the call before it
  first_call_only = np.asarray(block.iterations_B) == 0
  np.testing.assert_array_equal((counts * np.arange(1, k + 2)).sum(axis=1),
                                np.asarray(block.length_B) - first_call_only)


def test_sequential_heads_need_the_right_token(subject, decoded):
  """Head 2 copies the token it is fed, so it is accepted where greedy repeats a token. Were it fed anything but
  head 1's choice (ŷ_{j+1}), k = 2 would accept less than this count of repeats predicts: the accepted blocks of
  2 are exactly the iterations whose two tokens are equal, and then the block must be 2 unless max_len cuts it."""
  _, runs = decoded
  (greedy_tokens, _, _), block = runs[2]
  stats = decoding.summarize(block)
  assert stats['block_size_histogram'][1] > 0
  # Replay the chain on greedy's tokens: from j, the block is 2 iff y_{j+2} == y_{j+1} (head 2 proposes y_{j+1}).
  expected_iterations = 0
  for row in np.asarray(greedy_tokens):
    j = 0
    while j < MAX_LEN - 1:  # the max_len-th token, left alone, comes with the iteration before it
      j += 2 if j + 1 < MAX_LEN and row[j + 1] == row[j] else 1
      expected_iterations += 1
  assert stats['iterations'] == expected_iterations


def test_decode_time_proposals_equal_the_teacher_forced_heads(subject, decoded):
  """The cached path (score in two calls, then propose: k - 1 heads in sequence, each fed the argmax before it)
  equals the full-sequence training path (Transformer.__call__) when the latter's heads are fed the same tokens
  (head_tokens_BxT). Fed greedy's own tokens instead, head 2 is the same too: the token it is fed at decode time is
  head 1's argmax, which is greedy's next token (the agreement diagnostic's teacher forcing)."""
  model, params = subject
  src, runs = decoded
  greedy_tokens = np.asarray(runs[4][0][0])
  B, T = 4, MAX_LEN
  src = src[:B]
  tgt_in = np.concatenate([np.full((B, 1), BOS), greedy_tokens[:B, :-1]], axis=1)

  @jax.jit
  def cached(params, src, tgt_in):
    fns = model_lib.decode_fns(model, params)
    init_state, score_fn, propose_fn = fns.init, fns.score, fns.propose
    state = init_state(src, T + K + 1)
    first_logits, first_hidden, state = score_fn(state, tgt_in[:, :8], jnp.zeros((B,), jnp.int32))
    rest_logits, rest_hidden, _ = score_fn(state, tgt_in[:, 8:], jnp.full((B,), 8, jnp.int32))
    hidden = jax.tree.map(lambda a, b: jnp.concatenate([a, b], axis=1), first_hidden, rest_hidden)
    rows = jax.tree.map(lambda x: x.reshape((B * T,) + x.shape[2:]), hidden)  # propose takes one position per row
    proposals_BTxKm1xV = propose_fn(rows)
    return jnp.concatenate([first_logits, rest_logits], axis=1), hidden['first_BxT'], proposals_BTxKm1xV

  logits_BxTxV, first_BxT, proposals = cached(params, jnp.asarray(src), jnp.asarray(tgt_in))
  proposals_BxTxKm1xV = np.asarray(proposals).reshape(B, T, K - 1, VOCAB)
  np.testing.assert_array_equal(np.asarray(first_BxT), np.argmax(np.asarray(logits_BxTxV), -1))
  # The token each head was fed at decode time: head 1's argmax, then each head's own argmax.
  chosen_BxTxKm1 = np.concatenate([np.asarray(first_BxT)[..., None], np.argmax(proposals_BxTxKm1xV, -1)[..., :-1]], -1)

  # Reference: one full pass per (row, position t), its heads fed head_tokens[t + 1 + n] = the decode-time token.
  filler = np.full((B, K), 3, np.int32)  # positions past T only feed heads at t >= T - K + 1 (causal: t unaffected)
  padded_tgt_in = np.concatenate([tgt_in, filler], axis=1)
  head_tokens = np.repeat(padded_tgt_in[:, None], T, axis=1)  # [B, T, T + K]
  for t in range(T):
    head_tokens[:, t, t + 1:t + K] = chosen_BxTxKm1[:, t]
  full = jax.jit(model.apply)({'params': params}, jnp.repeat(jnp.asarray(src), T, axis=0),
                              jnp.asarray(np.repeat(padded_tgt_in, T, axis=0)),
                              head_tokens_BxT=jnp.asarray(head_tokens.reshape(B * T, T + K)))
  full_BxTxTxKxV = np.asarray(full).reshape(B, T, T + K, K, VOCAB)
  at_t = full_BxTxTxKxV[:, np.arange(T), np.arange(T)]  # [B, T, K, V]: pass t, position t
  np.testing.assert_allclose(proposals_BxTxKm1xV, at_t[:, :, 1:], atol=1e-4)
  np.testing.assert_allclose(np.asarray(logits_BxTxV), at_t[:, :, 0], atol=1e-4)

  plain = np.asarray(jax.jit(model.apply)({'params': params}, jnp.asarray(src), jnp.asarray(tgt_in)))
  np.testing.assert_allclose(proposals_BxTxKm1xV[:, :T - 1, 0], plain[:, :T - 1, 1], atol=1e-4)


def test_previous_tokens_layout():
  """Head n + 2 at position t is fed tgt_in[t + n + 1] = y_{t+n+1}, padding past the end."""
  tgt_in = jnp.asarray([[2, 11, 12, 13, 14]])
  got = np.asarray(model_lib.previous_tokens(tgt_in, 3))
  assert got.shape == (1, 5, 3)
  assert got[0, 0].tolist() == [11, 12, 13]
  assert got[0, 3].tolist() == [14, 0, 0]


@pytest.fixture(scope='module')
def random_batch():
  rng = np.random.default_rng(0)
  tgt = rng.integers(3, VOCAB, (3, 7))
  tgt[0, 5:] = 0
  return {'src_BxS': rng.integers(3, VOCAB, (3, 6)), 'tgt_BxT': tgt}


def test_sampled_head_loss_is_that_heads_loss_of_the_mean_path(subject, random_batch):
  """head_loss='random' with sequential heads: one_head_logits feeds the drawn head its teacher-forced token as the
  full path does, so its loss and accuracy are that head's of the mean path (token kernels nonzero here)."""
  model, params = subject
  kwargs = dict(model=model, label_smoothing=0.1)
  _, full = jax.jit(functools.partial(train.loss_and_metrics, head_loss='mean', train=False, **kwargs))(
      params, random_batch, None)
  sampled = jax.jit(functools.partial(train.loss_and_metrics, head_loss='random', train=True, **kwargs))
  drawn = set()
  for seed in range(10):
    loss, aux = sampled(params, random_batch, jax.random.PRNGKey(seed))
    head = int(np.flatnonzero(np.isfinite(aux['acc_K']))[0])
    drawn.add(head)
    np.testing.assert_allclose(loss, full['loss_K'][head], rtol=1e-5)
    np.testing.assert_allclose(aux['acc_K'][head], full['acc_K'][head], rtol=1e-6)
  assert len(drawn & {1, 2, 3}) >= 2


def test_frozen_regime_trains_only_the_heads_token_kernels_included(subject, random_batch):
  """frozen: one step leaves every base parameter bit for bit and moves the heads, the new token kernels (which
  start at zero in a fresh model) among them."""
  model, _ = subject
  params = train.fresh_params(model.config, 0)
  assert not np.any(np.asarray(params['multi_output']['token_kernel']))
  optimizer = train.make_optimizer('frozen', params, 1e-3, 1, head_learning_rate=1e-3)
  step = train.make_train_step(model, optimizer, seed=0, head_loss='mean', label_smoothing=0.0, frozen=True)
  state = {'params': params, 'opt_state': optimizer.init(params)}
  before = jax.device_get(params)
  state, _ = step(state, {name: jnp.asarray(x) for name, x in random_batch.items()}, 0)
  after = jax.device_get(state['params'])
  for name in before:
    if name != 'multi_output':
      assert all(jax.tree.leaves(jax.tree.map(lambda a, b: bool(np.array_equal(a, b)), before[name], after[name])))
  assert np.abs(after['multi_output']['token_kernel']).max() > 0


def test_independent_is_the_default_and_keeps_its_parameter_tree():
  """The paper's heads by default (config, ModelConfig, model.json files written before the field); an independent
  model's tree has no token kernel; a fresh sequential model is that tree plus 'token_kernel' (zero), the other
  parameters drawn alike, so at initialization the two head types compute the same function."""
  assert common.defaults().model.head_type == 'independent'
  assert demo.get_config('regime=finetune').model.head_type == 'independent'
  independent = model_lib.model_config('tiny', vocab_size=VOCAB, k=K, d_model=16, d_ff=32, num_encoder_layers=1,
                                       num_decoder_layers=1, dropout_rate=0.0)  # small: compiles fast
  assert independent.head_type == 'independent'
  old_json = {key: value for key, value in dataclasses.asdict(independent).items() if key != 'head_type'}
  assert model_lib.ModelConfig(**old_json) == independent
  sequential = dataclasses.replace(independent, head_type='sequential')
  assert model_lib.ModelConfig(**json.loads(json.dumps(dataclasses.asdict(sequential)))) == sequential

  init = jax.jit(model_lib.init_params, static_argnums=0)
  p_ind, p_seq = init(independent, jax.random.PRNGKey(3)), init(sequential, jax.random.PRNGKey(3))
  assert sorted(p_ind['multi_output']) == ['ln', 'wi_bias', 'wi_kernel', 'wo_bias', 'wo_kernel']
  assert set(p_seq['multi_output']) == set(p_ind['multi_output']) | {'token_kernel'}
  without = {**p_seq, 'multi_output': {n: v for n, v in p_seq['multi_output'].items() if n != 'token_kernel'}}
  assert jax.tree.all(jax.tree.map(lambda a, b: bool(np.array_equal(a, b)), without, p_ind))
  src, tgt = jnp.asarray(_sources(np.random.RandomState(0), 2)), jnp.asarray([[5, 6, 7, 8], [9, 10, 11, 12]])
  # Equal up to float rounding (XLA may order the heads' sums differently once the zero token term is added).
  np.testing.assert_allclose(np.asarray(jax.jit(model_lib.Transformer(sequential).apply)({'params': p_seq}, src, tgt)),
                             np.asarray(jax.jit(model_lib.Transformer(independent).apply)({'params': p_ind}, src, tgt)),
                             atol=1e-5)


def test_bad_head_type_is_refused():
  with pytest.raises(UserError, match='head_type'):
    model_lib.model_config('tiny', vocab_size=VOCAB, head_type='hydra')
  config = common.override(demo.get_config(), **{'model.head_type': 'hydra'})
  with pytest.raises(UserError, match='config.model.head_type'):
    checks.check_model(config)
  checks.check_model(common.override(demo.get_config(), **{'model.head_type': 'sequential'}))


def test_static_trees_are_refused_with_sequential_heads(subject, tmp_path):
  """Before the sweep compiles (checks.tree_runs_on: 'chain' is a one-path tree and passes, and so does a
  context-aware tree), and at trace time for a direct call of the tree decoder (score refuses a static tree)."""
  assert checks.tree_runs_on(trees.parse_tree_spec('chain', K), 'sequential')
  assert checks.tree_runs_on(trees.parse_tree_spec('dynamic:8', K), 'sequential')
  assert not checks.tree_runs_on(trees.parse_tree_spec('comb:2', K), 'sequential')
  assert checks.tree_runs_on(trees.parse_tree_spec('comb:2', K), 'independent')

  model, params = subject

  @jax.jit
  def tree_decode(params, src):
    fns = model_lib.decode_fns(model, params, num_heads=2)
    init_state, score_fn, propose_fn = fns.init, fns.score, fns.propose
    return decoding.blockwise(decoding.ModelFns(score_fn, propose_fn, model_lib.move_cache), init_state(src, 16),
                              fixed=decoding.Fixed(batch_size=2, max_len=8, bos_id=BOS, eos_id=EOS),
                              tree=decoding.layout(((0,), (1,), (0, 0))))
  with pytest.raises(UserError, match='head_type=sequential'):  # raised while tracing: nothing compiles
    tree_decode(params, jnp.asarray(_sources(np.random.RandomState(0), 2)))


@pytest.mark.parametrize('tree', [decoding.Dynamic(6, 3, beam=2, ranks=3), decoding.Dynamic(16, 4)])
def test_exact_dynamic_tree_with_sequential_heads_equals_greedy(subject, tree):
  """Each parent expanded from its own token (Transformer.expand), a tree per row through the real mask,
  positions and cache move: greedy's output, token for token."""
  model, params = subject
  src = jnp.asarray(_sources(np.random.RandomState(1), 16))
  fixed = decoding.Fixed(batch_size=16, max_len=MAX_LEN, bos_id=BOS, eos_id=EOS)
  (greedy_tokens, greedy_length, _), block = reference.greedy_and_blockwise(params, src, model=model, tree=tree,
                                                                            fixed=fixed)
  np.testing.assert_array_equal(np.asarray(block.tokens_BxL), np.asarray(greedy_tokens))
  np.testing.assert_array_equal(np.asarray(block.length_B), np.asarray(greedy_length))
  assert decoding.summarize(block)['mean_accepted_block_size'] > 1.0


def test_expand_runs_the_head_from_each_parents_token(subject):
  """expand(hidden, d, parents)[:, w] is head d + 1 fed parents[:, w]: fed the tokens the chain feeds (head 1's
  argmax for head 2, head 2's argmax for head 3), it gives propose's logits; fed other tokens, other logits."""
  model, params = subject
  src = jnp.asarray(_sources(np.random.RandomState(2), 4))

  @jax.jit
  def heads(params, src):
    fns = model_lib.decode_fns(model, params)
    init_state, score_fn, propose_fn, expand_fn = fns.init, fns.score, fns.propose, fns.expand
    _, hidden, _ = score_fn(init_state(src, 8), jnp.full((4, 1), BOS, jnp.int32), jnp.zeros((4,), jnp.int32))
    hidden = jax.tree.map(lambda x: x[:, 0], hidden)
    proposed_BxKm1xV = propose_fn(hidden)
    first_B, second_B = hidden['first_BxT'], jnp.argmax(proposed_BxKm1xV[:, 0], axis=-1).astype(jnp.int32)
    others_B = (first_B + 1) % VOCAB
    return (proposed_BxKm1xV, expand_fn(hidden, 1, jnp.stack([first_B, others_B], axis=1)),
            expand_fn(hidden, 2, second_B[:, None]))

  proposed, depth1_Bx2xV, depth2_Bx1xV = (np.asarray(x) for x in heads(params, src))
  np.testing.assert_allclose(depth1_Bx2xV[:, 0], proposed[:, 0], atol=1e-5)
  np.testing.assert_allclose(depth2_Bx1xV[:, 0], proposed[:, 1], atol=1e-5)
  assert np.abs(depth1_Bx2xV[:, 1] - depth1_Bx2xV[:, 0]).max() > 0.1  # head 2 copies its token: a different one
