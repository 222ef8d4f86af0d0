"""Training the proposal heads (paper §6): the sampled-head loss, separate rates for heads and base, the
frozen regime's deterministic base, per-token evaluation, the agreement-with-greedy diagnostic, and a k = 1
model decoded with a blockwise sweep config.

Every property here holds by construction (equal computations compared with a float tolerance, optimizer
updates that are zero or not by design, counts), not by how a tiny model's training happened to go.
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from bpd import checkpoint
from bpd import decoder as decoder_lib
from bpd import evaluate
from bpd import losses
from bpd import model as model_lib
from bpd import sharding
from bpd import train
from tests.test_pipeline import tiny_config

VOCAB, K = 50, 4


@pytest.fixture(scope='module')
def random_model():
  config = model_lib.model_config('tiny', vocab_size=VOCAB, k=K, dropout_rate=0.0)
  params = jax.jit(model_lib.init_params, static_argnums=0)(config, jax.random.PRNGKey(0))
  rng = np.random.default_rng(0)
  tgt = rng.integers(3, VOCAB, (3, 7))
  tgt[0, 5:] = 0  # padding: counts differ per head
  batch = {'src_BxS': rng.integers(3, VOCAB, (3, 6)), 'tgt_BxT': tgt}
  return model_lib.Transformer(config), params, batch


@pytest.mark.parametrize('head', range(K))
def test_one_head_logits_equal_that_head_of_the_full_output(random_model, head):
  model, params, batch = random_model
  tgt_in = jnp.pad(batch['tgt_BxT'][:, :-1], ((0, 0), (1, 0)), constant_values=2)
  full_BxTxKxV = jax.jit(model.apply)({'params': params}, batch['src_BxS'], tgt_in)
  one_BxTxV = jax.jit(lambda p, s, t, h: model.apply({'params': p}, s, t, h,
                                                     method=model_lib.Transformer.one_head_logits))(
                                                         params, batch['src_BxS'], tgt_in, head)
  np.testing.assert_allclose(one_BxTxV, full_BxTxKxV[:, :, head], rtol=1e-5, atol=1e-5)


def test_sampled_head_loss_is_that_heads_loss_of_the_mean_path(random_model):
  """head_loss='random' computes one head; its loss, accuracy and count equal that head's in the full path."""
  model, params, batch = random_model
  kwargs = dict(model=model, label_smoothing=0.1)
  _, full = train.loss_and_metrics(params, batch, None, head_loss='mean', train=False, **kwargs)
  drawn = set()
  for seed in range(12):
    loss, aux = train.loss_and_metrics(params, batch, jax.random.PRNGKey(seed), head_loss='random', train=True,
                                       **kwargs)
    head = int(np.flatnonzero(np.isfinite(aux['acc_K']))[0])
    drawn.add(head)
    np.testing.assert_allclose(loss, full['loss_K'][head], rtol=1e-5)
    np.testing.assert_allclose(aux['acc_K'][head], full['acc_K'][head], rtol=1e-6)
    assert aux['count_K'][head] == full['count_K'][head]
    assert np.isnan(np.delete(np.asarray(aux['loss_K']), head)).all()
  assert len(drawn) > 1
  # Counts are real target counts per head (head i has i - 1 fewer targets per row than head 1, but padding).
  assert list(full['count_K']) == [int(np.sum(losses.head_targets(batch['tgt_BxT'], K)[:, :, i] > 0))
                                   for i in range(K)]


def test_frozen_base_runs_without_dropout(random_model):
  """In the frozen regime the loss does not depend on the dropout rng (the base is deterministic there)."""
  _, params, batch = random_model
  config = model_lib.model_config('tiny', vocab_size=VOCAB, k=K, dropout_rate=0.3)
  model = model_lib.Transformer(config)
  kwargs = dict(model=model, head_loss='mean', label_smoothing=0.0, train=True)
  frozen = [train.loss_and_metrics(params, batch, jax.random.PRNGKey(s), frozen=True, **kwargs)[0] for s in (0, 1)]
  finetune = [train.loss_and_metrics(params, batch, jax.random.PRNGKey(s), **kwargs)[0] for s in (0, 1)]
  assert frozen[0] == frozen[1]
  assert finetune[0] != finetune[1]


def test_head_learning_rate_gives_heads_and_base_their_own_rates(random_model):
  """finetune with head_learning_rate: the same gradient moves the heads by the head rate, the base by its own."""
  _, params, _ = random_model
  grads = jax.tree.map(jnp.ones_like, params)
  for regime, head_rate, base_moves in (('finetune', 1e-2, True), ('frozen', 1e-2, False)):
    opt = train.make_optimizer(regime, params, learning_rate=1e-4, warmup_steps=1, head_learning_rate=head_rate)
    updates, _ = opt.update(grads, opt.init(params), params)
    head_step = np.abs(np.asarray(updates['multi_output']['wi_kernel'])).max()
    base_step = np.abs(np.asarray(updates['decoder_norm']['scale'])).max()
    # Adam's first step moves every coordinate by about its peak rate (here at warmup's end), whatever the grad.
    np.testing.assert_allclose(head_step, head_rate, rtol=1e-3)
    if base_moves:
      np.testing.assert_allclose(base_step, 1e-4, rtol=1e-3)
    else:
      assert base_step == 0


def test_eval_loss_and_accuracy_are_per_token_not_per_batch():
  """Two batches with 1 and 3 targets: the per-token mean weighs the second three times."""
  auxes = iter([{'loss_K': np.array([1.0]), 'acc_K': np.array([0.0]), 'count_K': np.array([1.0])},
                {'loss_K': np.array([3.0]), 'acc_K': np.array([1.0]), 'count_K': np.array([3.0])}])
  batches = [(None, np.zeros((1, 2), np.int32), np.zeros((1, 2), np.int32))] * 2
  out = train.evaluate_during_training(None, lambda params, batch: next(auxes), batches, lambda params: {},
                                      sharding.make_mesh(1))
  assert out['loss'] == pytest.approx((1 * 1 + 3 * 3) / 4)
  assert out['accuracy_head1'] == pytest.approx(3 / 4)


@pytest.fixture(scope='module')
def heads_run(tmp_path_factory):
  root = tmp_path_factory.mktemp('heads')
  base_dir, heads_dir = str(root / 'base'), str(root / 'k3')
  train.train_and_evaluate(tiny_config(), base_dir)
  config = tiny_config(**{'k': 3, 'train.regime': 'frozen', 'train.init_from': base_dir, 'train.num_steps': 30,
                          'train.eval_every': 30, 'train.head_learning_rate': 3e-3, 'train.warmup_steps': 5})
  before = train.fresh_params(model_lib.model_config('tiny', vocab_size=200, k=3, dropout_rate=0.0), config.seed)
  eval_metrics = train.train_and_evaluate(config, heads_dir)
  return base_dir, heads_dir, before, eval_metrics


def test_frozen_heads_move_and_learn(heads_run):
  """The new heads leave their initialization, and training lowers their loss on the training batches."""
  base_dir, heads_dir, fresh, _ = heads_run
  params = jax.device_get(checkpoint.load_params(heads_dir)[1])
  moved = jax.tree.map(lambda a, b: float(np.abs(a - b).max()), params['multi_output'], fresh['multi_output'])
  assert min(jax.tree.leaves(moved)) > 0
  config = tiny_config(k=3)
  model = model_lib.Transformer(model_lib.model_config('tiny', vocab_size=200, k=3, dropout_rate=0.0))
  start = {**jax.device_get(checkpoint.load_params(base_dir)[1]), 'multi_output': fresh['multi_output']}
  batch = train.batching.make_train_batch_fn(*_train_ids(config, heads_dir), 16, (40,), 0)(0)
  loss = lambda p: train.loss_and_metrics(p, batch, None, model=model, head_loss='mean', label_smoothing=0.0,
                                          train=False)[1]['loss_K']
  before, after = np.asarray(loss(start)), np.asarray(loss(params))
  assert after[0] == pytest.approx(before[0], rel=1e-6)  # head 1 is the frozen base
  assert np.all(after[1:] < before[1:])  # 30 Adam steps on the heads alone from a random init


def _train_ids(config, workdir):
  from bpd.data import batching, pipeline, tokenizer as tokenizer_lib  # pylint: disable=g-import-not-at-top
  tokenizer = tokenizer_lib.load(f'{workdir}/{tokenizer_lib.MODEL_NAME}')
  src, tgt = pipeline.load_split(config.data, config.data.train_split, config.seed)
  src_ids, tgt_ids, _ = batching.encode_pairs(tokenizer, src[:64], tgt[:64], 40)
  return src_ids, tgt_ids


def test_training_logs_agreement_with_greedy_and_the_exact_block_size(heads_run):
  """Head 1 agrees with greedy (it is greedy, up to float rounding near ties); the block size is within [1, k + 1]
  (k = 3: a row's last token comes with the iteration whose call computed it, bpd/decoding.py)."""
  _, _, _, eval_metrics = heads_run
  assert eval_metrics['agreement_head1'] >= 0.9
  for i in (2, 3):
    assert 0.0 <= eval_metrics[f'agreement_head{i}'] <= 1.0
  assert 1.0 <= eval_metrics['exact_block_size'] <= 4.0


def test_agreement_with_greedy_equals_a_reference_count(heads_run):
  """Against a direct count: teacher-force greedy's own output, and compare head i's argmax at position t with
  greedy's token at target index t + i - 1 wherever greedy produced one (EOS included)."""
  _, heads_dir, _, _ = heads_run
  model_config, params, _ = checkpoint.load_params(heads_dir)
  model = model_lib.Transformer(model_config)
  decoder = decoder_lib.Decoder(model, max_len=24, mesh=sharding.make_mesh(1))
  src_ids = _train_ids(tiny_config(k=3), heads_dir)[0][:20]
  greedy_ids = decoder_lib.run_batches(lambda src: decoder.greedy(params, src).tokens_BxL, src_ids, 8)[0]
  got = train.agreement_with_greedy(train.make_eval_step(model, label_smoothing=0.0, mesh=decoder.mesh), params,
                                    src_ids, greedy_ids, 8, decoder.mesh)
  # Teacher-force every greedy output in one call: each right-padded to the same length (causal attention, so the
  # padding after a row's tokens does not change its outputs), one compile instead of one per output length.
  rows = []
  for out in greedy_ids:
    out = np.asarray(out)
    rows.append(out[:int(np.argmax(out == 1)) + 1] if np.any(out == 1) else out[out > 0])  # EOS id 1, then padding
  tgt_in_NxT = np.zeros((len(rows), max(len(r) for r in rows)), np.int32)
  for n, tokens in enumerate(rows):
    tgt_in_NxT[n, :len(tokens)] = np.concatenate([[2], tokens[:-1]])  # BOS id 2
  src_NxS = np.zeros((len(src_ids), max(len(src) for src in src_ids)), np.int32)  # padding is masked, as in decoding
  for n, src in enumerate(src_ids):
    src_NxS[n, :len(src)] = src
  best_NxTxK = np.asarray(jnp.argmax(jax.jit(model.apply)({'params': params}, src_NxS, tgt_in_NxT), -1))
  correct, total = np.zeros(3), np.zeros(3)
  for n, tokens in enumerate(rows):
    for i in range(3):
      for t in range(len(tokens) - i):
        correct[i] += best_NxTxK[n, t, i] == tokens[t + i]
        total[i] += 1
  for i in range(3):
    assert got[f'agreement_head{i + 1}'] == pytest.approx(correct[i] / total[i], abs=1.5 / total[i])


def test_optimizer_state_layouts_of_earlier_versions_are_kept(random_model):
  """Runs saved before head_learning_rate existed resume: base, single-rate finetune and frozen (with or without
  a head rate) keep their optimizer state's tree structure."""
  _, params, _ = random_model
  adam = optax.chain(optax.clip_by_global_norm(1.0), optax.adam(lambda step: 1e-3))  # a schedule, as train's
  labels = {name: ('heads' if name == 'multi_output' else 'base') for name in params}
  frozen = optax.multi_transform({'heads': adam, 'base': optax.set_to_zero()}, labels)
  structure = lambda opt: jax.tree.structure(opt.init(params))
  assert structure(train.make_optimizer('base', params, 1e-3, 10)) == structure(adam)
  assert structure(train.make_optimizer('finetune', params, 1e-3, 10)) == structure(adam)
  for head_rate in (0.0, 3e-3):
    assert structure(train.make_optimizer('frozen', params, 1e-3, 10, head_rate)) == structure(frozen)


def test_a_k1_model_decodes_greedily_under_a_blockwise_sweep_config(heads_run):
  """The demo config sweeps k' = 2, 3 with min_block:2; a base model (k = 1) has no heads: greedy only."""
  base_dir, _, _, _ = heads_run
  records = evaluate.decode_sweep(tiny_config(**{'decode.criteria': ('exact', 'min_block:2')}), base_dir)
  assert [(r['k'], r['criterion']) for r in records] == [(1, 'greedy')]
