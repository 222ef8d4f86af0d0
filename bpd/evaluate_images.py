"""Decoding sweep for super-resolution (CelebA 8x8 -> 32x32, paper §7.2): PSNR/SSIM, image grids.

`bpd.evaluate.decode_sweep` hands over here when config.data.source == 'images'. The decoding itself is
bpd/decoder.py's `Decoder` over bpd/decoding.py (one decode loop for text and images); this module only
feeds it pixel ids and scores the outputs as images.

Images have no EOS: every output is max_len = 3072 sub-pixels (config.decode.max_len; a smaller value decodes
only the first max_len sub-pixels, for tests and smoke runs: the rest of each image is left black, 0, in the
grids, the saved arrays and the metrics). The Decoder runs with eos_id = NO_EOS, which no token equals: with
the text EOS id (1), `distance:EPS` acceptance could accept an EOS proposal next to intensity 0 (id 3) and
stop an image early.

Records (results.json) have the keys of translation's (bpd/evaluate.py `decode_split`), with
  quality          mean per-image PSNR in dB against the ground-truth 32x32 image (quality_metric 'psnr');
  ssim             mean per-image SSIM against the ground truth;
  psnr_vs_greedy   PSNR of all outputs against greedy's (the MSE pooled over the split): inf when identical;
  distinct_intensities  mean number of distinct values per output image: a collapse detector (see decode_split);
  nearest_psnr, nearest_ssim, bicubic_psnr, bicubic_ssim  the baselines: the same inputs enlarged without a model
                   (images.enlarge), against the same ground truth.
Also {split}.{setting}.b{batch}.npy (uint8 [N, 32, 32, 3], the outputs in source order) and, per split,
{split}.grid.png: one row per setting (labelled: input 8x8 enlarged by nearest neighbour, greedy, each
blockwise setting, ground truth), one column per example (the first config.decode.grid_examples, default 8).
"""

import os

from absl import logging
import jax
import numpy as np

from bpd import checkpoint
from bpd import checks
from bpd import decoder as decoder_lib
from bpd import model as model_lib
from bpd import report
from bpd import sharding
from bpd.data import images
from bpd.data import pipeline
from bpd.errors import UserError

NO_EOS = -1  # no token id equals it: image decoding never stops early
TARGET_LEN = images.HIGHRES * images.HIGHRES * 3  # 3072 sub-pixels
GRID_EXAMPLES = 8
# results.md: translation's columns (quality = PSNR) plus these.
COLUMNS = report.COLUMNS + [('ssim', 'SSIM', '{:.3f}'), ('psnr_vs_greedy', 'PSNR vs greedy', '{:.2f}'),
                            ('distinct_intensities', 'distinct intensities', '{:.0f}')]


def outputs_to_images(tokens_NxL) -> np.ndarray:
  """Decoded ids [N, L <= 3072] -> uint8 [N, 32, 32, 3]; sub-pixels past L are black (see module doc)."""
  tokens_NxL = np.asarray(tokens_NxL)
  full_NxT = np.zeros((tokens_NxL.shape[0], TARGET_LEN), np.int64)  # id 0 -> intensity 0 in tokens_to_image
  full_NxT[:, :tokens_NxL.shape[1]] = tokens_NxL[:, :TARGET_LEN]
  return images.tokens_to_image(full_NxT)


def pooled_psnr(a_NxHxWx3, b_NxHxWx3) -> float:
  """PSNR in dB of the mean squared error over all sub-pixels of all images; inf if identical."""
  mse = np.mean((np.asarray(a_NxHxWx3, np.float64) - np.asarray(b_NxHxWx3, np.float64)) ** 2)
  return float('inf') if mse == 0 else float(10.0 * np.log10(255.0 ** 2 / mse))


def _decode_all(fn, src_NxS, batch_size, what):
  """fn(src_BxS) over every example: (outputs in source order, seconds), compile and warm-up excluded."""
  rows = list(src_NxS)
  decoder_lib.run_batches(fn, rows[:batch_size], batch_size)  # compile + one run on the timed shapes
  return decoder_lib.run_batches(fn, rows, batch_size, what)


def greedy_psnr(decoder, params, lowres_Nx8x8x3, highres_Nx32x32x3, batch_size) -> float:
  """Mean PSNR of greedy outputs on a few images (the optional quick evaluation during training)."""
  src_NxS = images.image_to_tokens(lowres_Nx8x8x3)
  outputs, _ = decoder_lib.run_batches(lambda src: decoder.greedy(params, src)[0], list(src_NxS), batch_size)
  return float(np.mean(images.psnr(outputs_to_images(np.stack(outputs)), highres_Nx32x32x3)))


def decode_split(decoder, params, split, lowres_Nx8x8x3, highres_Nx32x32x3, sweep, batch_size, out_dir,
                 model_k, step, timing_examples=0, timing_repeats=1):
  """Greedy plus every (k', criterion) of the sweep on one split at one batch size.

  Speed as in translation (bpd/decoder.py time_side_by_side, shared): greedy and blockwise alternate on the first
  `timing_examples` images (0: all), `timing_repeats` times, after a warm-up on exactly the timed batches and
  with no compile allowed while timing; seconds are medians, speedup their ratio. (Every image source has the
  same length, 192 sub-pixels, so the timed subset and the whole split share one padded shape.)
  Returns (records, {setting name: uint8 [N, 32, 32, 3] outputs}).
  """
  src_NxS = images.image_to_tokens(lowres_Nx8x8x3)
  n = len(src_NxS)
  timing_rows = list(src_NxS[:timing_examples] if timing_examples else src_NxS)
  greedy_fn = lambda src: decoder.greedy(params, src)

  def distinct(outputs_Nx32x32x3):
    # Mean number of distinct intensities per image (CelebA val faces: ~234). An undertrained model's greedy output
    # collapses into repeating one value (a handful here), and its long accepted blocks then mean nothing.
    return float(np.mean([len(np.unique(o)) for o in outputs_Nx32x32x3]))

  def scores(outputs_Nx32x32x3):
    return (float(np.mean(images.psnr(outputs_Nx32x32x3, highres_Nx32x32x3))),
            float(np.mean(images.ssim(outputs_Nx32x32x3, highres_Nx32x32x3))))

  greedy_out, _ = _decode_all(greedy_fn, src_NxS, batch_size, f'{split} greedy b{batch_size}')
  greedy_seconds, = decoder_lib.time_side_by_side([greedy_fn], timing_rows, batch_size, timing_repeats,
                                               what=f'{split} greedy b{batch_size}')
  greedy_tokens_NxL = np.stack([o[0] for o in greedy_out])
  greedy_images = outputs_to_images(greedy_tokens_NxL)
  greedy_tokens_count = int(sum(int(o[1]) for o in greedy_out))
  greedy_psnr_db, greedy_ssim = scores(greedy_images)
  # The baselines every record carries: the same images enlarged without a model.
  baselines = {}
  for method in images.ENLARGE_METHODS:
    baselines[f'{method}_psnr'], baselines[f'{method}_ssim'] = scores(images.enlarge(lowres_Nx8x8x3, method=method))
  base = {'split': split, 'batch_size': batch_size, 'examples': n, 'step': step, 'model_k': model_k,
          'timing_examples': len(timing_rows), 'timing_repeats': max(timing_repeats, 1),
          'greedy_seconds': greedy_seconds, 'greedy_quality': greedy_psnr_db, 'quality_metric': 'psnr',
          **baselines}
  records = [{**base, 'k': 1, 'criterion': 'greedy', 'quality': greedy_psnr_db, 'ssim': greedy_ssim,
              'distinct_intensities': distinct(greedy_images),
              'psnr_vs_greedy': float('inf'), 'mean_accepted_block_size': 1.0, 'iterations': greedy_tokens_count,
              'invocations': greedy_tokens_count, 'tokens': greedy_tokens_count, 'seconds': greedy_seconds,
              'speedup': 1.0, 'identical_to_greedy': 1.0}]
  outputs_by_name = {'greedy': greedy_images}
  logging.info('%s b%d greedy: PSNR %.2f dB, SSIM %.3f, %.2fs (nearest-neighbour enlargement %.2f dB / %.3f, '
               'bicubic %.2f dB / %.3f)', split, batch_size, greedy_psnr_db, greedy_ssim, greedy_seconds,
               baselines['nearest_psnr'], baselines['nearest_ssim'], baselines['bicubic_psnr'],
               baselines['bicubic_ssim'])

  for k, criterion in sweep:
    name = decoder_lib.setting_name(k, criterion)
    blockwise_fn = lambda src, k=k, criterion=criterion: decoder.blockwise(params, src, k=k, criterion=criterion)
    outputs, _ = _decode_all(blockwise_fn, src_NxS, batch_size, f'{split} {name} b{batch_size}')
    g_seconds, seconds = decoder_lib.time_side_by_side([greedy_fn, blockwise_fn], timing_rows, batch_size,
                                                    timing_repeats, what=f'{split} {name} b{batch_size}')
    tokens_NxL = np.stack([o.tokens_BxL for o in outputs])
    out_images = outputs_to_images(tokens_NxL)
    outputs_by_name[name] = out_images
    psnr_db, ssim_value = scores(out_images)
    produced = int(sum(int(o.length_B) for o in outputs))
    iterations = int(sum(int(o.iterations_B) for o in outputs))
    histogram = np.sum([np.asarray(o.block_counts_BxK) for o in outputs], axis=0)
    record = {**base, 'k': k, 'criterion': str(criterion), 'quality': psnr_db, 'ssim': ssim_value,
              'distinct_intensities': distinct(out_images),
              'psnr_vs_greedy': pooled_psnr(out_images, greedy_images),
              'mean_accepted_block_size': produced / max(iterations, 1), 'iterations': iterations,
              'invocations': iterations + n, 'tokens': produced, 'greedy_seconds': g_seconds, 'seconds': seconds,
              'speedup': g_seconds / seconds,
              'identical_to_greedy': float(np.mean(np.all(tokens_NxL == greedy_tokens_NxL, axis=1))),
              'block_size_histogram': [int(c) for c in histogram]}
    records.append(record)
    logging.info('%s b%d %s: PSNR %.2f dB (greedy %.2f, vs greedy %.2f), mean accepted block %.2f, '
                 'speedup %.2fx, identical %.3f', split, batch_size, name, psnr_db, greedy_psnr_db,
                 record['psnr_vs_greedy'], record['mean_accepted_block_size'], record['speedup'],
                 record['identical_to_greedy'])
  if jax.process_index() == 0:
    for name, out_images in outputs_by_name.items():
      np.save(os.path.join(out_dir, f'{split}.{name}.b{batch_size}.npy'), out_images)
  return records, outputs_by_name


def save_grid(path_png, lowres_Nx8x8x3, highres_Nx32x32x3, outputs_by_name, num_examples):
  """Rows: input (8x8, enlarged), greedy, each blockwise setting, ground truth; one column per example."""
  n = min(num_examples, len(highres_Nx32x32x3))
  names = list(outputs_by_name)
  rows = [lowres_Nx8x8x3[:n]] + [outputs_by_name[name][:n] for name in names] + [highres_Nx32x32x3[:n]]
  labels = ['input 8x8'] + names + ['ground truth']
  return images.save_image_grid(path_png, rows, row_labels=labels)


def check_image_decode(config) -> None:
  """Image-only decode settings, before anything is compiled."""
  if config.decode.max_len > TARGET_LEN:
    raise UserError(f'config.decode.max_len={config.decode.max_len}: a 32x32x3 image has {TARGET_LEN} '
                    f'sub-pixels; use {TARGET_LEN} (the whole image) or less (its first sub-pixels only).')


def decode_sweep(config, workdir: str) -> list[dict]:
  """`--mode=decode` for images: writes {workdir}/decode/ results.json, results.md, plots, grids, arrays."""
  model_config = checkpoint.read_model_config(workdir)
  sweep = checks.check_decode(config, workdir, model_config.k)
  checks.check_trees(config, workdir, model_config.k)  # tree decoding is translation only: a clear error
  check_image_decode(config)
  mesh = sharding.make_mesh(config.get('model_axis_size', 1))
  _, params, step = checkpoint.load_params(workdir, mesh=mesh)
  decoder = decoder_lib.Decoder(model_lib.Transformer(model_config), config.decode.max_len, mesh, eos_id=NO_EOS)
  out_dir = os.path.join(workdir, decoder_lib.DECODE_DIR)
  if jax.process_index() == 0:
    os.makedirs(out_dir, exist_ok=True)
  records = []
  for split in config.decode.splits:
    lowres_Nx8x8x3, highres_Nx32x32x3 = pipeline.load_image_split(config.data, split,
                                                                  config.decode.max_examples or None)
    grid_written = False
    for i, batch_size in enumerate(config.decode.batch_sizes):
      # Batch 1 is where the speedup is measured, and one 3072-step image at a time is slow: it may decode
      # only the first few images (quality is then read at the larger batch sizes).
      n = config.decode.get('batch1_examples', 0) if batch_size == 1 else 0
      lowres_nx8x8x3, highres_nx32x32x3 = lowres_Nx8x8x3[:n or None], highres_Nx32x32x3[:n or None]
      batch_size = sharding.decode_batch_size(batch_size, mesh)
      split_records, outputs_by_name = decode_split(decoder, params, split, lowres_nx8x8x3, highres_nx32x32x3,
                                                    sweep, batch_size, out_dir, model_config.k, step,
                                                    config.decode.timing_examples, config.decode.timing_repeats)
      records += split_records
      if jax.process_index() == 0:
        report.write(records, out_dir, COLUMNS)  # after every batch size: an interrupted sweep keeps what it measured
        # One grid per split (outputs depend on the batch size only through float rounding): from the first
        # batch size that decoded every image, else (batch 1 alone, with batch1_examples) from what it decoded.
        if not grid_written and (not n or i == len(config.decode.batch_sizes) - 1):
          grid_written = True
          save_grid(os.path.join(out_dir, f'{split}.grid.png'), lowres_nx8x8x3, highres_nx32x32x3, outputs_by_name,
                    config.decode.get('grid_examples', GRID_EXAMPLES))
  if jax.process_index() == 0:
    print(report.markdown_table(records, COLUMNS))
  return records

