"""Decoding a checkpoint: BLEU and the `--mode=decode` sweep (the jitted decoders: bpd/decoder.py).

The sweep decodes each evaluation split with greedy decoding (the baseline, always) and with blockwise
parallel decoding for every (k' heads, criterion) of the config, at every batch size, and writes into
{workdir}/decode/: results.json (one record per setting), results.md (the table), one hypothesis file per
setting (<split>.<setting>.b<batch>.txt, detokenized, in source order) and PNG plots against k.

Definitions (DESIGN §2): mean accepted block size = tokens produced (EOS included, padding excluded) /
decoding iterations, summed over the split. invocations = model calls (iterations + 1 per row with the
combined scoring-and-proposal step); batch_invocations = the calls made for whole batches (a batch runs
until its slowest row is done, which is what batch > 1 wall-clock time follows).
speedup = median greedy seconds / median blockwise seconds: same model, inputs, batch size and device,
both compiled and warmed up, run alternately in the same process (config.decode.timing_examples /
timing_repeats choose how much is timed).

On several devices (bpd/sharding.py) each batch is split along 'data': decoding is per row, so the rows
simply divide among the devices; batch sizes are rounded up to a multiple of the data axis (padding rows,
dropped after). Every process decodes; process 0 alone writes files.
"""

import os

from absl import logging
import jax
import numpy as np
import sacrebleu

from bpd import checkpoint
from bpd import checks
from bpd import decoder as decoder_lib
from bpd import decoding
from bpd import evaluate_images
from bpd import model as model_lib
from bpd import report
from bpd import sharding
from bpd.data import batching
from bpd.data import pipeline
from bpd.data import tokenizer as tokenizer_lib

# Moved to bpd/decoder.py (shared with bpd/evaluate_images.py, which this module imports); the names stay here
# for the callers that use them as evaluate.Decoder, evaluate.run_batches, ... .
DECODE_DIR = decoder_lib.DECODE_DIR
Decoder = decoder_lib.Decoder
source_bucket = decoder_lib.source_bucket
run_batches = decoder_lib.run_batches
setting_name = decoder_lib.setting_name
time_side_by_side = decoder_lib.time_side_by_side


def bleu(hypotheses, references) -> float:
  """Corpus BLEU with sacrebleu's defaults (13a tokenization) on detokenized text."""
  return sacrebleu.corpus_bleu(list(hypotheses), [list(references)]).score


def greedy_translate(decoder, params, tokenizer, src_ids, batch_size, bucket_lengths=None):
  """Detokenized greedy translations, in source order."""
  del bucket_lengths  # one bucket per split, see source_bucket
  outputs, _ = run_batches(lambda src: decoder.greedy(params, src)[0], src_ids, batch_size)
  return [tokenizer.decode(o) for o in outputs]


def _warm_up(fn, src_ids, batch_size):
  """Compile and run once on the first batch, so that timings exclude compilation."""
  indices, src = batching.eval_batches(src_ids[:batch_size], None, batch_size, (source_bucket(src_ids),))[0]
  del indices
  jax.block_until_ready(fn(src))


def _decode_setting(fn, src_ids, batch_size, what):
  _warm_up(fn, src_ids, batch_size)
  return run_batches(fn, src_ids, batch_size, what)


def decode_split(decoder, params, tokenizer, split, src_ids, references, sweep, batch_size, out_dir,
                 model_k, step, timing_examples=0, timing_repeats=1, tree_sweep=()):
  """Greedy plus every (k', criterion) of the sweep and every (tree spec, topology, criterion) of tree_sweep
  (checks.check_trees) on one split at one batch size. Returns records; a record's 'tree' is the tree spec
  ('chain' for the sweep's chains) and 'tree_nodes' its number of nodes (k' for a chain).

  Quality and acceptance come from decoding every example. Speed comes from `time_side_by_side` on the
  first `timing_examples` examples (0: all), `timing_repeats` times each: greedy_seconds and seconds of a
  record are medians measured next to each other, and speedup is their ratio. The timed batches are padded
  to the whole split's source bucket, the shape that was compiled and warmed up for the full decode
  (a subset's own, shorter bucket would compile inside the first timed run).
  """
  greedy_fn = lambda src: decoder.greedy(params, src)
  greedy_out, _ = _decode_setting(greedy_fn, src_ids, batch_size, f'{split} greedy b{batch_size}')
  timing_ids = src_ids[:timing_examples] if timing_examples else src_ids
  bucket = source_bucket(src_ids)
  greedy_tokens = [o[0] for o in greedy_out]
  greedy_hyps = [tokenizer.decode(t) for t in greedy_tokens]
  greedy_tokens_count = int(sum(int(o[1]) for o in greedy_out))
  greedy_bleu = bleu(greedy_hyps, references)
  greedy_seconds, = time_side_by_side([greedy_fn], timing_ids, batch_size, timing_repeats, bucket,
                                      f'{split} greedy b{batch_size}')
  write_lines(os.path.join(out_dir, f'{split}.greedy.b{batch_size}.txt'), greedy_hyps)
  base = {'split': split, 'batch_size': batch_size, 'examples': len(src_ids), 'step': step, 'model_k': model_k,
          'timing_examples': len(timing_ids), 'timing_repeats': max(timing_repeats, 1),
          'greedy_quality': greedy_bleu, 'quality_metric': 'bleu'}
  records = [{**base, 'k': 1, 'criterion': 'greedy', 'quality': greedy_bleu, 'mean_accepted_block_size': 1.0,
              'iterations': greedy_tokens_count, 'invocations': greedy_tokens_count, 'tokens': greedy_tokens_count,
              'greedy_seconds': greedy_seconds, 'seconds': greedy_seconds, 'speedup': 1.0,
              'identical_to_greedy': 1.0}]
  logging.info('%s b%d greedy: BLEU %.2f, %.2fs', split, batch_size, greedy_bleu, greedy_seconds)

  settings = [(k, criterion, None, None) for k, criterion in sweep]
  settings += [(decoding.tree_depth(paths) if paths else model_k, criterion, spec, paths)
               for spec, paths, criterion in tree_sweep]
  for k, criterion, tree_spec, paths in settings:
    name = setting_name(k, criterion, tree_spec)
    batch_invocations = []  # model calls of each batch: its slowest row decides when the batch is done

    def blockwise_fn(src, k=k, criterion=criterion, paths=paths, calls=batch_invocations):
      if paths is None:  # a chain ('chain' in config.decode.trees too): the paper's loop
        result = decoder.blockwise(params, src, k=k, criterion=criterion)
      else:
        result = decoder.tree(params, src, paths=paths, criterion=criterion)
      calls.append(result.invocations)
      return result

    outputs, _ = _decode_setting(blockwise_fn, src_ids, batch_size, f'{split} {name} b{batch_size}')
    batch_calls = int(sum(int(c) for c in batch_invocations[1:]))  # [0] is the warm-up batch
    g_seconds, seconds = time_side_by_side([greedy_fn, blockwise_fn], timing_ids, batch_size, timing_repeats, bucket,
                                           f'{split} {name} b{batch_size}')
    tokens = [o.tokens_BxL for o in outputs]
    hyps = [tokenizer.decode(t) for t in tokens]
    write_lines(os.path.join(out_dir, f'{split}.{name}.b{batch_size}.txt'), hyps)
    produced = int(sum(int(o.length_B) for o in outputs))
    iterations = int(sum(int(o.iterations_B) for o in outputs))
    histogram = np.sum([np.asarray(o.block_counts_BxK) for o in outputs], axis=0)
    identical = float(np.mean([np.array_equal(a, b) for a, b in zip(tokens, greedy_tokens)]))
    record = {**base, 'k': k, 'criterion': str(criterion), 'tree': tree_spec or 'chain',
              'tree_nodes': len(paths) if paths else k, 'quality': bleu(hyps, references),
              'mean_accepted_block_size': produced / max(iterations, 1), 'iterations': iterations,
              'invocations': iterations + len(src_ids), 'batch_invocations': batch_calls, 'tokens': produced,
              'greedy_seconds': g_seconds, 'seconds': seconds, 'speedup': g_seconds / seconds,
              'identical_to_greedy': identical, 'block_size_histogram': [int(c) for c in histogram]}
    records.append(record)
    logging.info('%s b%d %s: BLEU %.2f, mean accepted block %.2f, speedup %.2fx, identical %.3f', split,
                 batch_size, name, record['quality'], record['mean_accepted_block_size'], record['speedup'],
                 identical)
  return records


def write_lines(path, lines):
  """Writes one line per item, atomically; on process 0 only (the others hold the same lines)."""
  if jax.process_index() != 0:
    return
  tmp = path + '.tmp'
  with open(tmp, 'w', encoding='utf-8') as f:
    for line in lines:
      f.write(line.replace('\n', ' ') + '\n')
  os.replace(tmp, path)


def decode_sweep(config, workdir: str) -> list[dict]:
  """The `--mode=decode` sweep over the newest checkpoint in `workdir`; writes {workdir}/decode/*."""
  precision = checks.check_matmul_precision(config)
  # '' -> None: the backend's default. On GPUs and TPUs the default float32 matmul may round through TF32 /
  # bfloat16 passes; results then depend on the shapes of the call (batch size, tokens per call) by more than
  # float32 rounding, argmax near-ties flip, and `exact` rows stop matching greedy (README, Super-resolution).
  # 'highest' asks for full float32.
  with jax.default_matmul_precision(precision or None):
    return _decode_sweep(config, workdir)


def _decode_sweep(config, workdir: str) -> list[dict]:
  if config.data.source == 'images':  # super-resolution: PSNR/SSIM and image grids (bpd/evaluate_images.py)
    return evaluate_images.decode_sweep(config, workdir)
  model_config = checkpoint.read_model_config(workdir)
  sweep = checks.check_decode(config, workdir, model_config.k)
  tree_sweep = checks.check_trees(config, workdir, model_config.k)
  mesh = sharding.make_mesh(config.get('model_axis_size', 1))
  _, params, step = checkpoint.load_params(workdir, mesh=mesh)
  tokenizer = tokenizer_lib.load(os.path.join(workdir, tokenizer_lib.MODEL_NAME))
  decoder = Decoder(model_lib.Transformer(model_config), config.decode.max_len, mesh)
  out_dir = os.path.join(workdir, DECODE_DIR)
  if jax.process_index() == 0:
    os.makedirs(out_dir, exist_ok=True)
  records = []
  for split in config.decode.splits:
    src, references = pipeline.load_split(config.data, split, config.seed)
    if config.decode.max_examples:
      src, references = src[:config.decode.max_examples], references[:config.decode.max_examples]
    # Sources get their own length limit: out-of-domain splits (newstest) are longer than training data.
    src_ids, _, _ = batching.encode_pairs(tokenizer, src, references, config.decode.max_src_len, truncate=True)
    for batch_size in config.decode.batch_sizes:
      batch_size = sharding.decode_batch_size(batch_size, mesh)
      records += decode_split(decoder, params, tokenizer, split, src_ids, references, sweep, batch_size, out_dir,
                              model_config.k, step, config.decode.timing_examples, config.decode.timing_repeats,
                              tree_sweep)
      if jax.process_index() == 0:
        report.write(records, out_dir)  # after every batch size: an interrupted sweep keeps what it measured
  if jax.process_index() == 0:
    print(report.markdown_table(records))
  return records
