"""The `--mode=decode` sweep, one for both tasks (bpd/tasks.py: translation, super-resolution).

The sweep decodes each evaluation split with greedy decoding (the baseline, always), with temperature sampling
if config.decode.temperature > 0 (seed config.decode.seed), and with blockwise parallel decoding for
every (k' heads, criterion) of the config, at every batch size, and writes into {workdir}/decode/:
results.json (one record per setting), results.md (the table), one output file per setting
(<split>.<setting>.b<batch>.txt: detokenized translations in source order; .npy for images), PNG plots
against k, and for images one grid per split (bpd/evaluate_images.py).

Definitions (DESIGN §2): mean accepted block size = tokens produced (EOS included, padding excluded) /
decoding iterations, summed over the split. invocations = model calls (iterations + 1 per row with the
combined scoring-and-proposal step); batch_invocations = the calls made for whole batches (a batch runs
until its slowest row is done, which is what batch > 1 wall-clock time follows).
speedup = median greedy seconds / median blockwise seconds: same model, inputs, batch size and device,
both compiled and warmed up, run alternately in the same process (config.decode.timing_examples /
timing_repeats choose how much is timed).
The criterion 'speculative' (bpd/speculative.py) samples at config.decode.temperature, exactly, with the heads
drafting; its rows carry temperature and seed, and their speedup is median ancestral-sampling seconds (the
sampled row's decoder, same temperature, timed alternately with it: sample_seconds) / median speculative seconds.

On several devices (bpd/sharding.py) each batch is split along 'data': decoding is per row, so the rows
simply divide among the devices; batch sizes are rounded up to a multiple of the data axis (padding rows,
dropped after). Every process decodes; process 0 alone writes files.
"""

import dataclasses
import os

from absl import logging
import jax
import numpy as np

from bpd import checkpoint
from bpd import checks
from bpd import decoder as decoder_lib
from bpd import decoding
from bpd import draft_vocab
from bpd import model as model_lib
from bpd import report
from bpd import sharding
from bpd import tasks

@dataclasses.dataclass(frozen=True)
class SplitData:
  """One evaluation split as decode_split reads it: the sources, and what the outputs are scored against."""
  name: str
  src_ids: list  # one id array per example, in source order (images: the 8x8 input's sub-pixels)
  references: list  # translations: reference sentences; images: the 32x32 originals
  inputs: list  # what the task's baselines start from (images: the 8x8 inputs; translation: unused)


@dataclasses.dataclass(frozen=True)
class SweepSettings:
  """What decode_split decodes a split with, and how it times it."""
  sweep: tuple  # decoder.Setting: chains, then trees (checks.check_decode)
  temperature: float = 0.0  # > 0: also a sampled row at this temperature
  seed: int = 0  # the sampled row's seed
  timing_examples: int = 0  # time on the first N examples (0: all)
  timing_repeats: int = 1  # alternate greedy / setting runs this many times; medians
  sample_top_k: int = 0  # truncation of the sampled and speculative rows (0 / 1.0: off; speculative.sampling_logits)
  sample_top_p: float = 1.0


def _decode_setting(fn, src_ids, batch_size, bucket, what):
  """fn(src_BxS) over every example: (outputs in source order, seconds), after compiling and running once on
  the first batch (`bucket`: the split's source buckets, decoder.source_buckets; the full decode compiles the
  others as it meets them)."""
  decoder_lib.run_batches(fn, src_ids[:batch_size], batch_size, bucket=bucket)
  return decoder_lib.run_batches(fn, src_ids, batch_size, what, bucket=bucket)


class SettingsFailed(RuntimeError):
  """Some settings of a sweep raised; the others' rows are written."""


def decode_split(task, decoder, params, tokenizer, data: SplitData, settings: SweepSettings, batch_size, out_dir,
                 model_k, step, failed=None, written=None):
  """Greedy, then sampling (if settings.temperature > 0), then every blockwise setting of settings.sweep (a
  decoder.Setting: rule and tree) on one split at one batch size. Returns (records, {setting name: outputs}); a
  record's 'tree' is its tree spec ('chain' for the sweep's chains) and 'tree_nodes' its number of nodes (k' for a
  chain).

  `task` (bpd/tasks.py) turns tokens into outputs (sentences or images), scores them against data.references
  (quality: BLEU or PSNR, plus its own fields), adds its baselines from data.inputs and writes one output file per
  setting. Quality and acceptance come from decoding every example. Speed comes from `time_side_by_side` on
  the first settings.timing_examples examples (0: all), settings.timing_repeats times each: greedy_seconds and
  seconds of a record are medians measured next to each other, and speedup is their ratio. Every batch is padded to
  the shortest of the split's source buckets that fits it (decoder.source_buckets); the timed batches are warmed
  up untimed first (decoder.time_side_by_side).

  failed: a list; a blockwise setting that raises is logged, named in it and skipped (None: the error propagates).
  written(records): called after each setting with this split's records so far, so that a process that dies in
  a later setting (a compiler crash) leaves them written.
  """
  split, src_ids, references, inputs = data.name, data.src_ids, data.references, data.inputs
  sweep, temperature, seed = settings.sweep, settings.temperature, settings.seed
  timing_examples, timing_repeats = settings.timing_examples, settings.timing_repeats
  bucket = decoder_lib.source_buckets(src_ids)
  timing_ids = src_ids[:timing_examples] if timing_examples else src_ids
  greedy_fn = lambda src: decoder.greedy(params, src)
  greedy_out, _ = _decode_setting(greedy_fn, src_ids, batch_size, bucket, f'{split} greedy b{batch_size}')
  greedy_tokens = [o.tokens_BxL for o in greedy_out]
  greedy_outputs = task.outputs(tokenizer, greedy_tokens)
  greedy_count = int(sum(int(o.length_B) for o in greedy_out))
  greedy_scores = task.scores(greedy_outputs, references, greedy_outputs)
  greedy_seconds, = decoder_lib.time_side_by_side([greedy_fn], timing_ids, batch_size, timing_repeats, bucket,
                                                  f'{split} greedy b{batch_size}')
  task.write_outputs(os.path.join(out_dir, f'{split}.greedy.b{batch_size}'), greedy_outputs)
  baselines = task.baselines(inputs, references)
  base = {'split': split, 'batch_size': batch_size, 'examples': len(src_ids), 'step': step, 'model_k': model_k,
          'draft_vocab': len(decoder.model.config.draft_ids),  # 0: the heads propose over the whole vocabulary
          'timing_examples': len(timing_ids), 'timing_repeats': max(timing_repeats, 1),
          'greedy_seconds': greedy_seconds, 'greedy_quality': greedy_scores['quality'],
          'quality_metric': task.quality_metric, **baselines}
  # Greedy and sampling emit one token per row per model call.
  one_per_call = {'k': 1, 'mean_accepted_block_size': 1.0, 'iterations': greedy_count, 'invocations': greedy_count,
                  'tokens': greedy_count}
  records = [{**base, **one_per_call, 'criterion': 'greedy', **greedy_scores, 'seconds': greedy_seconds,
              'speedup': 1.0, 'identical_to_greedy': 1.0}]
  outputs_by_name = {'greedy': greedy_outputs}
  logging.info('%s b%d greedy: %s, %.2fs (%s)', split, batch_size, _fields(greedy_scores), greedy_seconds,
               _fields(baselines) or 'no baselines')

  def measure(name, fn, baseline_fn=greedy_fn, baseline='greedy'):
    """Decodes every example with fn, times it next to the baseline (greedy; ancestral sampling for speculative
    sampling), scores and writes its outputs."""
    out, _ = _decode_setting(fn, src_ids, batch_size, bucket, f'{split} {name} b{batch_size}')
    g_seconds, seconds = decoder_lib.time_side_by_side([baseline_fn, fn], timing_ids, batch_size, timing_repeats,
                                                       bucket, f'{split} {name} b{batch_size}')
    tokens = [o.tokens_BxL for o in out]
    outputs = task.outputs(tokenizer, tokens)
    outputs_by_name[name] = outputs
    task.write_outputs(os.path.join(out_dir, f'{split}.{name}.b{batch_size}'), outputs)
    timing = {f'{baseline}_seconds': g_seconds, 'seconds': seconds, 'speedup': g_seconds / seconds,
              'identical_to_greedy': float(np.mean([np.array_equal(a, b) for a, b in zip(tokens, greedy_tokens)]))}
    return out, {**task.scores(outputs, references, greedy_outputs), **timing}

  truncation = {'top_k': settings.sample_top_k, 'top_p': settings.sample_top_p}
  sampling_fields = {'temperature': float(temperature), 'seed': seed, 'sample_top_k': settings.sample_top_k,
                     'sample_top_p': settings.sample_top_p}
  sample_fn = lambda src: decoder.sample(params, src, temperature, seed, **truncation)
  if temperature > 0:  # ancestral sampling: the baseline of the 'speculative' rows
    criterion = f'sample:{temperature:g}'
    out, fields = measure(decoder_lib.setting_name(1, criterion), sample_fn)
    count = int(sum(int(o.length_B) for o in out))
    records.append({**base, **one_per_call, 'iterations': count, 'invocations': count, 'tokens': count,
                    'criterion': criterion, **sampling_fields, **fields})
    logging.info('%s b%d %s: %s', split, batch_size, criterion, _fields(fields))

  for setting in sweep:
    name, rule = setting.name, setting.rule
    logging.info('%s b%d %s: decoding', split, batch_size, name)  # the last line of a log a crash cuts short
    try:
      records.append(_decode_blockwise(decoder, params, setting, seed, measure, sample_fn, sampling_fields, base,
                                       len(src_ids), batch_size, split))
    except Exception as e:  # pylint: disable=broad-except
      if failed is None:
        raise
      logging.exception('%s b%d %s failed', split, batch_size, name)
      failed.append(f'{split} b{batch_size} {name} ({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ""})')
    if written is not None:
      written(records)
  return records, outputs_by_name


def _decode_blockwise(decoder, params, setting, seed, measure, sample_fn, sampling_fields, base, num_examples,
                      batch_size, split):
  """One blockwise setting of decode_split: its record."""
  name, rule = setting.name, setting.rule
  batch_invocations = []  # model calls of each batch: its slowest row decides when the batch is done

  def blockwise_fn(src, setting=setting, calls=batch_invocations):
    result = decoder.blockwise(params, src, setting.rule, setting.tree, seed=seed, drafter=setting.drafter)
    calls.append(result.invocations)
    return result

  sampled = rule.draws
  # Speculative sampling's speedup is over ancestral sampling at the same temperature, timed side by side.
  out, fields = measure(name, blockwise_fn, *((sample_fn, 'sample') if sampled else ()))
  if sampled:
    fields.update(sampling_fields)
  # The rows back into one batch of the whole split, with the calls of its batches: decoding.summarize's
  # statistics (DESIGN §2). batch_invocations: the warm-up batch, the full decode's batches, then the timing's.
  num_batches = -(-num_examples // batch_size)
  calls = int(sum(int(c) for c in batch_invocations[1:1 + num_batches]))
  split_result = jax.tree.map(lambda *rows: np.stack(rows), *out).replace(invocations=np.int32(calls))
  stats = decoding.summarize(split_result)
  logging.info('%s b%d %s: %s, mean accepted block %.2f', split, batch_size, name,
               _fields(fields), stats['mean_accepted_block_size'])
  return {**base, 'k': setting.k, 'criterion': str(rule), 'tree': setting.spec,
          'drafter': str(setting.drafter),
          'tree_nodes': setting.tree.num_nodes, **fields,
          'mean_accepted_block_size': stats['mean_accepted_block_size'], 'iterations': stats['iterations'],
          'invocations': stats['row_invocations'], 'batch_invocations': stats['batch_invocations'],
          'tokens': stats['tokens'], 'block_size_histogram': stats['block_size_histogram'],
          'first_call_tokens': stats['first_call_tokens']}


def _fields(record) -> str:
  return ', '.join(f'{key} {value:.3f}' for key, value in record.items() if isinstance(value, (int, float)))


def load_for_decoding(config, workdir: str, task, mesh=None):
  """The newest checkpoint in `workdir` ready to decode as the sweep decodes it: (model_config, params, step,
  tokenizer, decoder), the decoder at config.decode.max_len with the task's EOS (images: none)."""
  model_config, params, step = checkpoint.load_params(workdir, mesh=mesh, step=config.checkpoint_step)
  tokenizer = task.tokenizer_for_decoding(workdir)
  # config.model.draft_vocab as set now: model.json's ids, counted ones, or none (bpd/draft_vocab.py)
  model_config = draft_vocab.for_decoding(config.model.draft_vocab, model_config,
                                         lambda: task.target_counts(config, tokenizer))
  decoder = decoder_lib.Decoder(model_lib.Transformer(model_config), config.decode.max_len, mesh,
                                eos_id=task.eos_id, matmul_kernel=checks.check_matmul_kernel(config),
                                head_weights=checks.check_head_weights(config),
                                fused_heads=checks.check_fused_heads(config))
  return model_config, params, step, tokenizer, decoder


def decode_sweep(config, workdir: str) -> list[dict]:
  """The `--mode=decode` sweep over the newest checkpoint in `workdir`; writes {workdir}/decode/*."""
  precision = checks.check_matmul_precision(config)
  checks.check_matmul_kernel(config)
  checks.check_head_weights(config)
  checks.check_fused_heads(config)
  # '' -> None: the backend's default. On GPUs and TPUs the default float32 matmul may round through TF32 /
  # bfloat16 passes; results then depend on the shapes of the call (batch size, tokens per call) by more than
  # float32 rounding, argmax near-ties flip, and `exact` rows stop matching greedy (docs/results/gpu.md).
  # 'highest' asks for full float32.
  with jax.default_matmul_precision(precision or None):
    return _decode_sweep(config, workdir)


def _decode_sweep(config, workdir: str) -> list[dict]:
  task = tasks.for_config(config)
  model_config = checkpoint.read_model_config(workdir)
  sweep = checks.check_decode(config, workdir, model_config)
  task.check_decode(config)
  settings = SweepSettings(tuple(sweep), config.decode.temperature, config.decode.seed, config.decode.timing_examples,
                           config.decode.timing_repeats, config.decode.sample_top_k, config.decode.sample_top_p)
  mesh = sharding.make_mesh(config.model_axis_size)
  _, params, step, tokenizer, decoder = load_for_decoding(config, workdir, task, mesh)
  out_dir = os.path.join(workdir, decoder_lib.DECODE_DIR)
  if jax.process_index() == 0:
    os.makedirs(out_dir, exist_ok=True)
  records, failed = [], []
  for split in config.decode.splits:
    src_ids, references, inputs = task.decode_examples(config, split, tokenizer)
    grid_written = False
    for i, batch_size in enumerate(config.decode.batch_sizes):
      # Batch 1 is where the speedup is measured, and one example at a time is slow (a 3072-step image): it
      # may decode only the first few examples (quality is then read at the larger batch sizes).
      n = config.decode.batch1_examples if batch_size == 1 else 0
      batch_size = sharding.decode_batch_size(batch_size, mesh)
      data = SplitData(split, src_ids[:n or None], references[:n or None], inputs[:n or None])
      written = (lambda split_records: report.write(records + split_records, out_dir, task.columns)) if (
          jax.process_index() == 0) else None
      split_records, outputs_by_name = decode_split(task, decoder, params, tokenizer, data, settings, batch_size,
                                                    out_dir, model_config.k, step, failed, written)
      records += split_records
      if jax.process_index() == 0:
        report.write(records, out_dir, task.columns)  # after every batch size: an interrupted sweep keeps it
        # One grid per split (outputs depend on the batch size only through float rounding): from the first
        # batch size that decoded every example, else (batch 1 alone, with batch1_examples) from what it decoded.
        if not grid_written and (not n or i == len(config.decode.batch_sizes) - 1):
          grid_written = True
          task.write_grid(os.path.join(out_dir, f'{split}.grid.png'), inputs[:n or None], references[:n or None],
                          outputs_by_name, config.decode.grid_examples)
  if jax.process_index() == 0:
    print(report.markdown_table(records, task.columns))
  if failed:  # after every other setting ran and was written: the sweep still fails
    raise SettingsFailed(f'{len(failed)} setting(s) of the sweep failed: {"; ".join(failed)}. The rows of the others '
                         f'are in {out_dir}/results.json; the log has each traceback.')
  return records
