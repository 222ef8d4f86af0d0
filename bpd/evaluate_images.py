"""Super-resolution's side of the decode sweep (CelebA 8x8 -> 32x32, paper §7.2): PSNR/SSIM, image grids.

The sweep itself is translation's (bpd/evaluate.py `decode_split`, one for both tasks); bpd/tasks.py's SUPERRES
task hands it these functions to turn pixel ids into images, score them and draw the grid.

Images have no EOS: every output is max_len = 3072 sub-pixels (config.decode.max_len; a smaller value decodes
only the first max_len sub-pixels, for tests and smoke runs: the rest of each image is left black, 0, in the
grids, the saved arrays and the metrics). The Decoder runs with eos_id = NO_EOS, which no token equals: with
the text EOS id (1), `distance:EPS` acceptance could accept an EOS proposal next to intensity 0 (id 3) and
stop an image early.

Records (results.json) have the keys of translation's (bpd/evaluate.py `decode_split`), with
  quality          mean per-image PSNR in dB against the ground-truth 32x32 image (quality_metric 'psnr');
  ssim             mean per-image SSIM against the ground truth;
  psnr_vs_greedy   PSNR of all outputs against greedy's (the MSE pooled over the split): inf when identical;
  distinct_intensities  mean number of distinct values per output image: a collapse detector (see `scores`);
  nearest_psnr, nearest_ssim, bicubic_psnr, bicubic_ssim  the baselines: the same inputs enlarged without a model
                   (images.enlarge), against the same ground truth.
Also {split}.{setting}.b{batch}.npy (uint8 [N, 32, 32, 3], the outputs in source order) and, per split,
{split}.grid.png: one row per setting (labelled: input 8x8 enlarged by nearest neighbour, greedy, the sampled
row if config.decode.temperature > 0, each blockwise setting, ground truth), one column per example (the first
config.decode.grid_examples, default 8).
"""

import numpy as np

from bpd import report
from bpd.data import images
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


def scores(outputs_Nx32x32x3, highres_Nx32x32x3, greedy_Nx32x32x3) -> dict:
  """The quality fields of one setting's record (see the module doc): PSNR (as 'quality'), SSIM, PSNR against
  greedy's outputs, distinct intensities."""
  return {'quality': float(np.mean(images.psnr(outputs_Nx32x32x3, highres_Nx32x32x3))),
          'ssim': float(np.mean(images.ssim(outputs_Nx32x32x3, highres_Nx32x32x3))),
          # Mean number of distinct intensities per image (CelebA val faces: ~234). An undertrained model's greedy
          # output collapses into repeating one value (a handful here), and its long accepted blocks then mean
          # nothing.
          'distinct_intensities': float(np.mean([len(np.unique(o)) for o in outputs_Nx32x32x3])),
          'psnr_vs_greedy': pooled_psnr(outputs_Nx32x32x3, greedy_Nx32x32x3)}


def baselines(lowres_Nx8x8x3, highres_Nx32x32x3) -> dict:
  """The baselines every record carries: the same images enlarged without a model, against the ground truth."""
  out = {}
  for method in images.ENLARGE_METHODS:
    enlarged_Nx32x32x3 = images.enlarge(lowres_Nx8x8x3, method=method)
    out[f'{method}_psnr'] = float(np.mean(images.psnr(enlarged_Nx32x32x3, highres_Nx32x32x3)))
    out[f'{method}_ssim'] = float(np.mean(images.ssim(enlarged_Nx32x32x3, highres_Nx32x32x3)))
  return out


def save_grid(path_png, lowres_Nx8x8x3, highres_Nx32x32x3, outputs_by_name, num_examples):
  """Rows: input (8x8, enlarged), each setting in the order given (greedy first), ground truth; one column per
  example."""
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
