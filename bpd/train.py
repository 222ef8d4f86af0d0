"""Training: `train_and_evaluate(config, workdir)`. The ConfigDict stops here; below, plain arguments.

Regimes (paper §6):
  base      k = 1: an ordinary Transformer, trained from scratch.
  frozen    start from the base model in config.train.init_from, add k-1 proposal heads, and train only
            them (the optimizer zeroes every other update, so the base parameters stay bit for bit and
            the scoring model's greedy output stays that of the base model).
  finetune  the same start, all parameters train jointly: acceptance rises, quality may drop a little.
Loss: the mean of the k heads' cross-entropies (head 1 weighted by train.head1_weight), or (head_loss='random')
one head drawn per step, as the paper's code did (§6): then only the drawn head is projected onto the
vocabulary, one projection instead of k. The new heads can have their own peak rate (train.head_learning_rate).
Evaluation logs, besides loss and per-head accuracy, the diagnostic that predicts exact acceptance: per head,
agreement with the scoring model's own greedy output, and the exact mean accepted block size with all k heads.

Images (config.data.source=images, paper §7.2): the same loop on 8x8 -> 32x32 super-resolution (what differs
between the tasks is in bpd/tasks.py); the source is 192 and the target 3072 pixel ids of a fixed vocabulary
(no tokenizer), batches have fixed shapes, and the periodic evaluation reports loss and per-head accuracy
(plus, if config.train.eval_psnr_examples > 0, the greedy PSNR of that many images: 3072 decoder steps each,
slow on a CPU).

Runs resume from the newest checkpoint in the workdir. Batches and dropout depend only on (seed, step), so
a resumed run reproduces an uninterrupted one exactly.

Data parallel over every device of every process (bpd/sharding.py): the state sits on the mesh, each process
puts its rows of each global batch on its devices, and the jitted train step runs as one SPMD program.
Process 0 alone writes files (tokenizer, model.json, TensorBoard); checkpoints are saved by all processes
together (orbax).
"""

import functools

from absl import logging
import jax
import jax.numpy as jnp
import numpy as np
import optax

from bpd import checkpoint
from bpd import checks
from bpd import decoder as decoder_lib
from bpd import decoding
from bpd import draft_vocab
from bpd import losses
from bpd import metrics
from bpd import model as model_lib
from bpd import sharding
from bpd import tasks
from bpd.data import batching
from bpd.data import images
from bpd.data import tokenizer as tokenizer_lib
from bpd.errors import UserError


def learning_rate_schedule(peak: float, warmup_steps: int):
  """Linear warmup to `peak`, then decay with 1/sqrt(step) (Vaswani et al. 2017, §5.3)."""
  def schedule(step):
    step = jnp.maximum(step, 1).astype(jnp.float32)
    return peak * jnp.minimum(step / warmup_steps, jnp.sqrt(warmup_steps / step))
  return schedule


def make_optimizer(regime: str, params: dict, learning_rate: float, warmup_steps: int,
                   head_learning_rate: float = 0.0):
  """Adam (β2 = 0.98, as Vaswani et al.) with global-norm clipping.

  frozen: only 'multi_output' (the proposal heads) moves. finetune with head_learning_rate > 0: the new heads
  and the trained base get their own peak rates (optax.multi_transform): fresh heads need a large rate to learn
  in few steps, while the same rate on the base would wreck the scoring model's quality (the demo lost 24 BLEU
  that way); a small base rate lets the base adapt towards predictability without forgetting.
  """
  def scaled_adam(peak):
    return optax.adam(learning_rate_schedule(peak, warmup_steps), b1=0.9, b2=0.98, eps=1e-9)

  def adam(peak):
    return optax.chain(optax.clip_by_global_norm(1.0), scaled_adam(peak))

  # (The state layouts of base, frozen and single-rate finetune are those of earlier versions: old runs resume.)
  labels = {name: ('heads' if name == 'multi_output' else 'base') for name in params}
  if regime == 'frozen':
    return optax.multi_transform({'heads': adam(head_learning_rate or learning_rate), 'base': optax.set_to_zero()},
                                 labels)
  if regime == 'finetune' and head_learning_rate:
    return optax.chain(optax.clip_by_global_norm(1.0), optax.multi_transform(
        {'heads': scaled_adam(head_learning_rate), 'base': scaled_adam(learning_rate)}, labels))
  return adam(learning_rate)


def noisy_pixel_inputs(tgt_in_BxT, rng, std: float):
  """Decoder inputs with Gaussian noise of `std` intensity levels on every pixel id, rounded and clipped to
  0..255 (BOS and padding unchanged); the targets stay clean (config.train.input_noise).

  Not in the paper. Under teacher forcing the previous sub-pixel predicts the next one far better than the 8x8
  input does, so a small model learns to copy its input token; greedy decoding then follows its own outputs
  away from the input (one intensity over a whole face: docs/results/table2_celeba.md). Noisy inputs make the clean
  co-located input (model.colocated_input) and the input image worth reading: the model learns to correct its
  prefix towards them, which is what it must do on its own outputs at decoding time.
  """
  noise_BxT = jnp.round(std * jax.random.normal(rng, tgt_in_BxT.shape))
  noisy_BxT = jnp.clip(tgt_in_BxT + noise_BxT.astype(tgt_in_BxT.dtype), images.PIXEL_OFFSET,
                       images.IMAGE_VOCAB_SIZE - 1)
  return jnp.where(tgt_in_BxT >= images.PIXEL_OFFSET, noisy_BxT, tgt_in_BxT)


def loss_and_metrics(params, batch, dropout_rng, *, model, head_loss, label_smoothing, train, frozen=False,
                     head1_weight=1.0, input_noise=0.0):
  """Mean (or one random head's) cross-entropy, plus per-head loss, accuracy and target counts for the logs.

  head1_weight w weighs head 1 (the base model's next-token head) against the proposal heads:
  loss = (w L_1 + L_2 + ... + L_k) / (w + k - 1). w = 1 is the paper's plain mean (§6); fine-tuning with a
  larger w keeps more of the base model's quality, which exact decoding reproduces (paper Table 1 shows
  fine-tuning costing BLEU at w = 1).
  head_loss='random' (training only) draws one head per step, as the paper's code did (§6), and computes only
  that head's projection onto the vocabulary; the other heads' entries of loss_K / acc_K are NaN.
  frozen: the base runs without dropout, so the heads learn from the hidden states that decoding will feed them
  (the base does not train, so its dropout would only add noise to the heads' inputs).
  """
  src, tgt = batch['src_BxS'], batch['tgt_BxT']
  tgt_in = jnp.pad(tgt[:, :-1], ((0, 0), (1, 0)), constant_values=tokenizer_lib.BOS_ID)
  # Sequential heads (model.head_type) are fed the clean targets (teacher forcing), even when the decoder's
  # inputs are noisy: in decoding they are fed proposals, which verification checks against head 1, not noise.
  head_tokens = {'head_tokens_BxT': tgt_in} if model.config.head_type == 'sequential' else {}
  if train and input_noise > 0:  # images only (checks.check_train)
    tgt_in = noisy_pixel_inputs(tgt_in, jax.random.fold_in(dropout_rng, 2), input_noise)
  deterministic = not train or frozen
  rngs = {} if deterministic else {'dropout': dropout_rng}
  k = model.config.k
  if head_loss == 'random' and train:
    # Frozen: head 1 has no trainable parameters, so draw among heads 2..k only.
    first = 1 if frozen and k > 1 else 0
    head = jax.random.randint(jax.random.fold_in(dropout_rng, 1), (), first, k)
    logits_BxTxV = model.apply({'params': params}, src, tgt_in, head, deterministic=deterministic, rngs=rngs,
                               method=model_lib.Transformer.one_head_logits, **head_tokens)
    loss, acc, count = losses.one_head_cross_entropy(logits_BxTxV, tgt, k, head, label_smoothing)
    nan_K = jnp.full((k,), jnp.nan)
    return loss, {'loss_K': nan_K.at[head].set(loss), 'acc_K': nan_K.at[head].set(acc),
                  'count_K': jnp.zeros((k,)).at[head].set(count)}
  logits_BxTxKxV = model.apply({'params': params}, src, tgt_in, deterministic=deterministic, rngs=rngs,
                               **head_tokens)
  loss_K, acc_K, count_K = losses.heads_cross_entropy(logits_BxTxKxV, tgt, label_smoothing)
  weight_K = jnp.ones_like(loss_K).at[0].set(head1_weight)
  loss = jnp.sum(weight_K * loss_K) / jnp.sum(weight_K)
  return loss, {'loss_K': loss_K, 'acc_K': acc_K, 'count_K': count_K}


def make_train_step(model, optimizer, *, seed, head_loss, label_smoothing, state_sharding=None, frozen=False,
                    head1_weight=1.0, input_noise=0.0):
  """The jitted `train_step(state, batch, step) -> (state, metrics)`.

  With `state_sharding` (sharding.state_sharding: the state's layout on a mesh) the new state keeps that
  layout and the metrics come back replicated, so that every process can read them. The batch arrives
  split along 'data' (sharding.shard_batch); XLA inserts the gradient all-reduce.
  """
  out_shardings = None
  if state_sharding is not None:
    mesh = jax.tree.leaves(state_sharding)[0].mesh
    out_shardings = (state_sharding, sharding.replicated(mesh))

  @functools.partial(jax.jit, donate_argnums=(0,), out_shardings=out_shardings)
  def train_step(state, batch, step):
    dropout_rng = jax.random.fold_in(jax.random.PRNGKey(seed), step)
    loss_fn = functools.partial(loss_and_metrics, batch=batch, dropout_rng=dropout_rng, model=model,
                                head_loss=head_loss, label_smoothing=label_smoothing, frozen=frozen, train=True,
                                head1_weight=head1_weight, input_noise=input_noise)
    if frozen:
      # Differentiate with respect to the proposal heads only: no backward pass through the frozen base
      # (about half the cost of a step); the base's gradient is zero, as the optimizer would make it anyway.
      params = state['params']
      (loss, aux), head_grads = jax.value_and_grad(
          lambda heads: loss_fn({**params, 'multi_output': heads}), has_aux=True)(params['multi_output'])
      grads = {**jax.tree.map(jnp.zeros_like, params), 'multi_output': head_grads}
    else:
      (loss, aux), grads = jax.value_and_grad(loss_fn, has_aux=True)(state['params'])
    updates, opt_state = optimizer.update(grads, state['opt_state'], state['params'])
    params = optax.apply_updates(state['params'], updates)
    grad_norm = jnp.sqrt(sum(jnp.sum(jnp.square(g)) for g in jax.tree.leaves(grads)))
    out = {'loss': loss, 'grad_norm': grad_norm, **aux}
    return {'params': params, 'opt_state': opt_state}, out
  return train_step


def make_eval_step(model, *, label_smoothing, mesh=None):
  @functools.partial(jax.jit, out_shardings=None if mesh is None else sharding.replicated(mesh))
  def eval_step(params, batch):
    _, aux = loss_and_metrics(params, batch, None, model=model, head_loss='mean',
                              label_smoothing=label_smoothing, train=False)
    return aux
  return eval_step


def fresh_params(model_config, seed: int) -> dict:
  # Jitted: one compile instead of one per operation of the initializers (seconds at start-up).
  return jax.jit(model_lib.init_params, static_argnums=0)(model_config, jax.random.PRNGKey(seed))


def initial_params(model_config, regime: str, init_from: str, seed: int, mesh=None, init_step: int = 0) -> dict:
  """Fresh parameters (base), or the base model from init_from (its step init_step; 0: the newest) with new
  proposal heads (frozen, finetune)."""
  fresh = fresh_params(model_config, seed)
  if regime == 'base':
    return fresh
  _, base_params, step = checkpoint.load_params(init_from, 'config.train.init_from', mesh=mesh, step=init_step)
  logging.info('Starting from the base model in %s (step %d) with %d new heads.', init_from, step,
               model_config.k - 1)
  base_params = {name: p for name, p in base_params.items() if name != 'multi_output'}
  return model_lib.add_heads(base_params, fresh) if model_config.k > 1 else base_params


def evaluate_during_training(params, eval_step, eval_batches, quick_eval, mesh):
  """Loss and per-head accuracy over `eval_batches` [(indices_B, src_BxS, tgt_BxT)], plus `quick_eval(params)`
  (a dict: greedy BLEU and agreement with greedy on a few sentences, or greedy PSNR on a few images).

  Per target token, not per batch: each batch's per-head means are weighted by its number of targets.
  """
  loss_sum, acc_sum, count_sum = 0.0, 0.0, 0.0
  for _, src, tgt in eval_batches:
    batch = sharding.shard_global_batch({'src_BxS': src, 'tgt_BxT': tgt}, mesh)
    aux = jax.device_get(eval_step(params, batch))
    loss_sum += aux['loss_K'] * aux['count_K']
    acc_sum += aux['acc_K'] * aux['count_K']
    count_sum += aux['count_K']
  count_sum = np.maximum(count_sum, 1)
  out = {'loss': float(np.mean(loss_sum / count_sum))}
  out.update({f'accuracy_head{i + 1}': float(a) for i, a in enumerate(acc_sum / count_sum)})
  out.update(quick_eval(params))
  return out


def training_data(config, task, tokenizer, decoder):
  """(batch_for_step, eval_batches, quick_eval) of the task (bpd/tasks.py). quick_eval(params) greedy-decodes the
  first few evaluation examples for the task's quality (greedy_bleu / greedy_psnr; images: only if
  config.train.eval_psnr_examples > 0, 3072 decoder steps each, slow on a CPU) and, for translation with k > 1,
  adds the per-head agreement with greedy and the exact mean accepted block size."""
  batch_for_step, eval_batches, eval_src_ids, eval_references = task.training_data(config, tokenizer)
  batch_size = config.train.batch_size
  n = min(task.quick_eval_examples(config), len(eval_src_ids))
  k = decoder.model.config.k
  agreement = task.agreement_in_quick_eval and k > 1
  agreement_step = make_eval_step(decoder.model, label_smoothing=0.0, mesh=decoder.mesh) if agreement else None

  def quick_eval(params):
    if not n:
      return {}
    greedy_ids = decoder_lib.run_batches(lambda src: decoder.greedy(params, src).tokens_BxL, eval_src_ids[:n],
                                         batch_size)[0]
    outputs = task.outputs(tokenizer, greedy_ids)
    out = {f'greedy_{task.quality_metric}': task.scores(outputs, eval_references[:n], outputs)['quality']}
    if agreement:
      out.update(agreement_with_greedy(agreement_step, params, eval_src_ids[:n], greedy_ids, batch_size,
                                       decoder.mesh))
      out['exact_block_size'] = exact_block_size(decoder, params, eval_src_ids[:n], k, batch_size)
    return out
  return batch_for_step, eval_batches, quick_eval


def greedy_targets(greedy_ids) -> list[np.ndarray]:
  """Greedy outputs as the targets of a teacher-forced pass on them: each cut after its EOS (EOS included), or its
  non-padding tokens where it has none (it ran to max_len)."""
  tokens = [np.asarray(t) for t in greedy_ids]
  return [t[:int(np.argmax(t == tokenizer_lib.EOS_ID)) + 1] if np.any(t == tokenizer_lib.EOS_ID) else t[t > 0]
          for t in tokens]


def agreement_with_greedy(agreement_step, params, src_ids, greedy_ids, batch_size, mesh) -> dict:
  """The diagnostic that predicts exact acceptance: per head i, how often head i's argmax at decoder position t
  equals the token greedy decoding of the scoring model emits at t + i, on greedy's own prefixes.

  (Decoder position t holds input y_t, y_0 = BOS; head i there predicts y_{t+i}, target index t + i - 1.)
  Exact acceptance (paper §5) tests exactly this: ŷ_{j+i} from head i is kept iff it equals greedy's token there.
  Accuracy against references measures something else (a head can match the reference where greedy does not).
  Teacher-forces the model on its own greedy outputs (EOS included, nothing after it); head 1 agrees everywhere
  up to float rounding. Returns {'agreement_head{i}': fraction}.
  """
  if not src_ids:
    return {}
  tokens = greedy_targets(greedy_ids)
  # One padded length for every batch (one compiled shape): the source bucket or the longest output.
  length = max(decoder_lib.source_bucket(src_ids), max(len(t) for t in greedy_ids))
  batches = batching.eval_batches(src_ids, tokens, batch_size, (length,))
  # Per-token accuracy against greedy's tokens is the agreement: the same pooling as the eval loss and accuracy.
  pooled = evaluate_during_training(params, agreement_step, batches, lambda params: {}, mesh)
  return {key.replace('accuracy_', 'agreement_'): value for key, value in pooled.items() if key.startswith('accuracy_')}


def top_r_agreement(model, params, src_ids, greedy_ids, batch_size, ranks: int) -> np.ndarray:
  """The agreement diagnostic per rank, for choosing a tree (bpd/trees.py): [k, ranks], entry [i - 1, r] = how
  often head i's rank-r choice at decoder position t (rank 0 = argmax, ties to the lower id as in
  decoding.accept_mask) is the token greedy decoding emits at t + i, on greedy's own prefixes. Column 0 is
  `agreement_with_greedy`; a row's sum is how often the token is among the head's top `ranks` choices.
  """
  tokens = greedy_targets(greedy_ids)
  length = max(decoder_lib.source_bucket(src_ids), max(len(t) for t in tokens))

  @jax.jit
  def counts(params, src_BxS, tgt_BxT):
    tgt_in_BxT = jnp.pad(tgt_BxT[:, :-1], ((0, 0), (1, 0)), constant_values=tokenizer_lib.BOS_ID)
    logits_BxTxKxV = model.apply({'params': params}, src_BxS, tgt_in_BxT)
    targets_BxTxK = losses.head_targets(tgt_BxT, logits_BxTxKxV.shape[-2])
    target_logit_BxTxK = jnp.take_along_axis(logits_BxTxKxV, targets_BxTxK[..., None], axis=-1)[..., 0]
    ids_V = jnp.arange(logits_BxTxKxV.shape[-1])
    rank_BxTxK = jnp.sum((logits_BxTxKxV > target_logit_BxTxK[..., None]) | (
        (logits_BxTxKxV == target_logit_BxTxK[..., None]) & (ids_V < targets_BxTxK[..., None])), axis=-1)
    valid_BxTxK = targets_BxTxK > 0
    hits_KxR = jnp.sum((valid_BxTxK[..., None] & (rank_BxTxK[..., None] == jnp.arange(ranks))), axis=(0, 1))
    return hits_KxR, jnp.sum(valid_BxTxK, axis=(0, 1))

  hits_KxR, total_K = 0, 0
  for _, src, tgt in batching.eval_batches(src_ids, tokens, batch_size, (length,)):
    hits, total = jax.device_get(counts(params, jnp.asarray(src), jnp.asarray(tgt)))
    hits_KxR, total_K = hits_KxR + hits, total_K + total
  return np.asarray(hits_KxR, np.float64) / np.maximum(np.asarray(total_K, np.float64), 1)[:, None]


def exact_block_size(decoder, params, src_ids, k, batch_size) -> float:
  """Mean accepted block size of exact blockwise decoding with all k heads on `src_ids` (what acceptance is)."""
  chain = decoding.chain(k)
  results, _ = decoder_lib.run_batches(lambda src: decoder.blockwise(params, src, decoding.EXACT, chain), src_ids,
                                       batch_size)
  tokens = sum(int(r.length_B) for r in results)
  return tokens / max(sum(int(r.iterations_B) for r in results), 1)


def _stored_draft_ids(workdir: str) -> tuple[int, ...]:
  """The draft ids a resumed run's model.json holds; () when there is none or it cannot be read, and the ids are
  counted again (the count is deterministic, and training rewrites model.json: the advice of read_model_config)."""
  if checkpoint.latest_step(workdir) is None:
    return ()
  try:
    return tuple(checkpoint.read_model_config(workdir).draft_ids)
  except UserError as e:
    logging.warning('Counting the draft vocabulary again: %s', e)
    return ()


def train_and_evaluate(config, workdir: str) -> dict:
  """Trains (resuming if the workdir has a checkpoint); returns the last evaluation metrics."""
  checks.check_train(config, workdir)
  tc = config.train
  if config.checkpoint_step and tc.regime == 'base':
    raise UserError(f'config.checkpoint_step={config.checkpoint_step} picks the step that decode and distill read, '
                    'or that frozen/finetune training starts from (of config.train.init_from); a base run resumes '
                    'from its own newest readable step. Leave it at 0.')
  mesh = sharding.make_mesh(config.model_axis_size)
  sharding.check_batch_size(tc.batch_size, mesh)
  logging.info('Mesh %s over %d process(es).', dict(mesh.shape), jax.process_count())
  task = tasks.for_config(config)
  tokenizer = task.tokenizer_for_training(config, workdir)
  vocab_size = task.vocab_size(tokenizer)
  # Counted once, before anything compiles; a resumed run keeps the ids its model.json holds (bpd/draft_vocab.py).
  stored = _stored_draft_ids(workdir) if config.model.draft_vocab else ()
  draft_ids = draft_vocab.draft_ids(config.model.draft_vocab, lambda: task.target_counts(config, tokenizer),
                                   vocab_size, stored)
  model_config = model_lib.model_config(config.model.size, vocab_size=vocab_size,
                                        k=1 if tc.regime == 'base' else config.k,
                                        dropout_rate=config.model.dropout_rate, dtype=config.model.dtype,
                                        attention_block=config.model.attention_block,
                                        head_type=config.model.head_type, draft_ids=draft_ids,
                                        **task.model_options(config))
  checks.check_init_from(model_config, tc.init_from if tc.regime != 'base' else '', workdir)
  if jax.process_index() == 0:
    checkpoint.write_model_config(workdir, model_config)
  model = model_lib.Transformer(model_config)

  decoder = decoder_lib.Decoder(model, max_len=task.training_decode_len(config), mesh=mesh, eos_id=task.eos_id,
                                matmul_kernel=checks.check_matmul_kernel(config),
                                head_weights=checks.check_head_weights(config),
                                fused_heads=checks.check_fused_heads(config))
  batch_for_step, eval_batches, quick_eval = training_data(config, task, tokenizer, decoder)

  mngr = checkpoint.manager(workdir, tc.keep_checkpoints)
  start_step = checkpoint.newest_intact_step(mngr, workdir)  # newer damaged steps: one warning each, set aside
  if start_step is None:
    params = initial_params(model_config, tc.regime, tc.init_from, config.seed, mesh, config.checkpoint_step)
  else:  # only a template for the restore
    params = fresh_params(model_config, config.seed)
  optimizer = make_optimizer(tc.regime, params, tc.learning_rate, tc.warmup_steps,
                             tc.head_learning_rate)
  state = sharding.place_state({'params': params, 'opt_state': optimizer.init(params)}, mesh)
  state_sharding = jax.tree.map(lambda x: x.sharding, state)
  if start_step is not None:  # restored into the same layout: the template's shardings
    try:
      state, start_step = checkpoint.restore_newest_readable(mngr, workdir, state, start_step)
    except (ValueError, KeyError, TypeError) as e:  # orbax: the saved tree differs from this config's
      if isinstance(e, UserError):
        raise
      raise UserError(
          f'Cannot resume from step {start_step} in {mngr.directory}: the saved training state does not match this '
          f'config (optimizer settings such as config.train.regime or config.train.head_learning_rate, or the '
          f'model, differ from the run that saved it; {type(e).__name__}: {str(e)[:200]}). Rerun with the settings of '
          'that run, or use a new --workdir.') from None
    logging.info('Resumed from %s at step %d.', mngr.directory, start_step)
  start_step = start_step or 0

  train_step = make_train_step(model, optimizer, seed=config.seed, head_loss=tc.head_loss,
                               label_smoothing=tc.label_smoothing, state_sharding=state_sharding,
                               frozen=tc.regime == 'frozen', head1_weight=tc.head1_weight,
                               input_noise=tc.input_noise)
  eval_step = make_eval_step(model, label_smoothing=tc.label_smoothing, mesh=mesh)
  rows = sharding.local_rows(tc.batch_size, mesh)  # this process's rows of every global batch
  writer = metrics.Writer(workdir)
  progress = metrics.Progress(start_step, tc.num_steps, 'train')
  last_good_step = start_step
  eval_metrics = {}
  with checkpoint.PreemptionGuard() as guard:
    step = start_step
    finite = True
    while step < tc.num_steps:
      batch = sharding.shard_batch({name: x[rows] for name, x in batch_for_step(step).items()}, mesh)
      state, out = train_step(state, batch, step)
      finite = finite & jnp.isfinite(out['loss']) & jnp.isfinite(out['grad_norm'])
      step += 1
      stop = guard.requested is not None
      if jax.process_count() > 1:
        # A signal may reach the hosts at different steps, but all must save and stop at the same one.
        # Agreeing costs a host round trip, so they do it at log steps only.
        stop = step % tc.log_every == 0 and sharding.any_process(stop)
      save_now = step % tc.checkpoint_every == 0 or step == tc.num_steps or stop
      if step % tc.log_every == 0 or save_now:
        if not bool(finite):
          mngr.wait_until_finished()  # the last good checkpoint's asynchronous save completes before we stop
          raise UserError(
              f'Training diverged: the loss became NaN or infinite between steps {last_good_step} and {step}. '
              f'Nothing was saved after step {last_good_step}; the last good checkpoint is kept in '
              f'{mngr.directory}. Lower config.train.learning_rate (now {tc.learning_rate}) or raise '
              f'config.train.warmup_steps (now {tc.warmup_steps}), then rerun the same command to resume.')
        out = jax.device_get(out)
        scalars = {'loss': float(out['loss']), 'grad_norm': float(out['grad_norm']),
                   'learning_rate': float(learning_rate_schedule(tc.learning_rate, tc.warmup_steps)(step))}
        if tc.regime != 'base' and tc.head_learning_rate:
          scalars['head_learning_rate'] = float(learning_rate_schedule(tc.head_learning_rate, tc.warmup_steps)(step))
        # NaN: a head not drawn this step (head_loss=random).
        scalars.update({f'accuracy_head{i + 1}': float(a) for i, a in enumerate(out['acc_K']) if np.isfinite(a)})
        writer.scalars(step, scalars, prefix='train')
        logging.info('%s | loss %.4f | head accuracy %s', progress.line(step), scalars['loss'],
                     ' '.join(f'{a:.3f}' if np.isfinite(a) else '-' for a in out['acc_K']))
      if tc.eval_every and (step % tc.eval_every == 0 or step == tc.num_steps):
        eval_metrics = evaluate_during_training(state['params'], eval_step, eval_batches, quick_eval, mesh)
        writer.scalars(step, eval_metrics, prefix='eval')
        logging.info('eval at step %d: %s', step,
                     ', '.join(f'{k} {v:.4f}' for k, v in eval_metrics.items()))
      if save_now:
        checkpoint.save(mngr, step, state)
        last_good_step = step
      if stop:
        logging.warning('Stopped at step %d on signal %s; rerun the same command to resume.', step,
                        guard.requested or '(received by another process)')
        break
  mngr.wait_until_finished()
  writer.close()
  return {'step': step, **eval_metrics}
