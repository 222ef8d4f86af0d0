"""CelebA 8x8 -> 32x32 super-resolution data (the paper's image experiment; t2t `img2img_celeba`).

The paper's image task: an Image Transformer reads an 8x8 face and writes the 32x32x3 face as a sequence of
3072 sub-pixel intensities in raster order (row by row, pixel by pixel, R, G, B), each a 256-way class.

Token convention (shared with text): ids 0, 1, 2 stay reserved for pad, eos and bos, as in the text
vocabulary, so the same model, masks and decode loop serve both tasks. Intensity v in 0..255 is token
v + PIXEL_OFFSET; the image vocabulary has IMAGE_VOCAB_SIZE = 259 ids. A constant offset keeps
`distance(eps)` acceptance meaningful: |token_a - token_b| is exactly the intensity difference. Images
have no EOS: every target is exactly 3072 tokens, and decoding runs for a fixed length.

Sources:
- `load_npy_split`: local `.npy` arrays (the team's real data is in ../shared/data/celeba32, see SOURCE.md).
- `load_tfds_split`: TFDS `celeb_a` read with `tfds.data_source` (no TensorFlow needed), preprocessed here.
  It fails fast when the dataset is not prepared: a TFDS download cannot reach the internet here and would
  hang for minutes.

Also: `save_image_grid` for sample sheets, per-image `psnr` / `ssim`, and `enlarge` (nearest-neighbour and
bicubic enlargement of the input: the baselines a super-resolution model has to beat).
"""

import os

import numpy as np
import scipy.ndimage
from PIL import Image
from PIL import ImageDraw
from PIL import ImageFont

from bpd.errors import UserError

# Ids 0..2 are pad, eos, bos in every vocabulary of this project (bpd.data.tokenizer PAD_ID, EOS_ID,
# BOS_ID); pixels start after them. Images need no UNK (id 3 in the text vocabulary): here 3 is intensity 0.
PIXEL_OFFSET = 3
IMAGE_VOCAB_SIZE = 256 + PIXEL_OFFSET
HIGHRES = 32  # Target side (paper: 32x32x3 outputs).
LOWRES = 8  # Input side (paper: 8x8 inputs).
# t2t img2img_celeba: tf.image.crop_to_bounding_box(image, 40, 20, 218 - 80, 178 - 40), i.e. the central
# 138x138 box, rows 40..177 and cols 20..157 of the 218x178 aligned CelebA image.
CELEBA_SHAPE = (218, 178, 3)
CROP_TOP, CROP_LEFT, CROP_SIZE = 40, 20, 138
TFDS_NAME = 'celeb_a'


# ---------------------------------------------------------------------------------------------------------
# Preprocessing.


def _box_resize(image_HxWx3, size):
  """Pillow Image.BOX resize of one uint8 image to [size, size, 3] uint8.

  Why Pillow: ../shared/data/celeba32 was made with it (SOURCE.md), so TFDS-path and .npy-path data match.
  t2t's `resize_by_area` is TF AREA, which also weighs the fractional pixels at the edge of each output
  pixel's span (and truncates to int); BOX keeps the whole input pixels whose centres fall in the span. With
  138 -> 32 not an integer ratio the two differ by about one level on smooth faces (more on pure noise).
  Pillow also rounds to uint8 after each of its two separable passes.
  """
  return np.asarray(Image.fromarray(image_HxWx3).resize((size, size), Image.BOX))


def preprocess_celeba(image_HxWx3):
  """One aligned CelebA image (218, 178, 3) uint8 -> (lowres_8x8x3, highres_32x32x3) uint8.

  As t2t `img2img_celeba`: crop the central 138x138 box, then area-downsample the crop to 32x32 (target)
  and, directly from the same crop, to 8x8 (input).
  """
  image_HxWx3 = np.asarray(image_HxWx3)
  if image_HxWx3.shape != CELEBA_SHAPE or image_HxWx3.dtype != np.uint8:
    raise UserError(f'preprocess_celeba expects an aligned CelebA image of shape {CELEBA_SHAPE} uint8 '
                    f'(img_align_celeba), got {image_HxWx3.shape} {image_HxWx3.dtype}.')
  crop_SxSx3 = np.ascontiguousarray(
      image_HxWx3[CROP_TOP:CROP_TOP + CROP_SIZE, CROP_LEFT:CROP_LEFT + CROP_SIZE])
  return _box_resize(crop_SxSx3, LOWRES), _box_resize(crop_SxSx3, HIGHRES)


def downsample_area(images_NxHxHx3, size=LOWRES):
  """Makes [N, size, size, 3] uint8 inputs from square images (e.g. 32x32): block means, rounded half up.

  `size` must divide the side (32 -> 8: 4x4 blocks), so this is exact area averaging (Pillow's BOX gives
  the same up to one level: it rounds after each of its two separable passes). It is not the same as an
  8x8 made directly from the 138x138 crop (as the provided `*_8x8.npy` are): going through 32x32 first
  resamples twice. On ../shared/data/celeba32 val the two differ by 0.9 levels on average (up to ~11), so
  prefer the provided 8x8 files when they exist.
  """
  images_NxHxHx3 = np.asarray(images_NxHxHx3)
  if images_NxHxHx3.ndim != 4 or images_NxHxHx3.shape[1] != images_NxHxHx3.shape[2]:
    raise ValueError(f'downsample_area expects square [N, H, H, C] images, got {images_NxHxHx3.shape}.')
  n, side, _, channels = images_NxHxHx3.shape
  if size <= 0 or side % size:
    raise ValueError(f'downsample_area: size {size} must divide the image side {side}.')
  f = side // size
  blocks = images_NxHxHx3.astype(np.float64).reshape(n, size, f, size, f, channels)
  # Round half up, like Pillow's fixed-point resamplers (np.rint would round half to even).
  return np.floor(blocks.mean(axis=(2, 4)) + 0.5).astype(np.uint8)


# ---------------------------------------------------------------------------------------------------------
# Tokens.


def image_to_tokens(images_NxHxWx3):
  """uint8 [N, H, W, 3] -> int32 [N, H*W*3] token ids: raster order, R, G, B per pixel, + PIXEL_OFFSET."""
  images_NxHxWx3 = np.asarray(images_NxHxWx3)
  if images_NxHxWx3.ndim != 4 or images_NxHxWx3.dtype != np.uint8:
    raise ValueError(f'image_to_tokens expects uint8 [N, H, W, C] images, got {images_NxHxWx3.shape} '
                     f'{images_NxHxWx3.dtype}.')
  # Row-major reshape of HWC is exactly the paper's order: rows, then pixels, then channels.
  return images_NxHxWx3.reshape(images_NxHxWx3.shape[0], -1).astype(np.int32) + PIXEL_OFFSET


def tokens_to_image(tokens_NxL, height=HIGHRES, width=HIGHRES):
  """int [N, L] token ids -> uint8 [N, height, width, 3]; inverse of `image_to_tokens`.

  Uses the first height*width*3 tokens (a decode buffer may be longer). A model may emit ids that are not
  pixels (pad/eos/bos are 0..2; nothing above 258 exists, but be safe): after removing the offset, the
  value is clipped into 0..255, so special ids become black (0) and any id past the top becomes 255. This
  keeps a sample viewable and its PSNR/SSIM defined; count invalid ids separately if they matter.
  """
  tokens_NxL = np.asarray(tokens_NxL)
  length = height * width * 3
  if tokens_NxL.ndim != 2 or tokens_NxL.shape[1] < length:
    raise ValueError(f'tokens_to_image needs [N, >= {length}] tokens for {height}x{width}x3 images, '
                     f'got shape {tokens_NxL.shape}.')
  values_NxL = np.clip(tokens_NxL[:, :length].astype(np.int64) - PIXEL_OFFSET, 0, 255)
  return values_NxL.astype(np.uint8).reshape(-1, height, width, 3)


# ---------------------------------------------------------------------------------------------------------
# Local .npy arrays.


def _load_array(path, what, shape_tail):
  """Loads one .npy and checks it is uint8 [N, *shape_tail]; UserError naming the file otherwise."""
  try:
    array = np.load(path, allow_pickle=False)
  except (OSError, ValueError) as e:
    raise UserError(f'Cannot read {what} file {path}: {e}. Expected a .npy array saved with numpy.save.')
  if array.ndim != 1 + len(shape_tail) or tuple(array.shape[1:]) != tuple(shape_tail):
    expected = ', '.join(str(d) for d in ('N',) + tuple(shape_tail))
    raise UserError(f'{what} file {path} has shape {array.shape}; expected ({expected}) RGB images, HWC.')
  if array.dtype != np.uint8:
    raise UserError(f'{what} file {path} has dtype {array.dtype}; expected uint8 intensities 0..255 '
                    '(convert with np.clip(x, 0, 255).astype(np.uint8) before saving).')
  return array


def load_npy_split(data_dir, split):
  """Reads `{data_dir}/{split}.npy` (N,32,32,3) and `{split}_8x8.npy` (N,8,8,3), both uint8.

  Returns (lowres_Nx8x8x3, highres_Nx32x32x3). When the 8x8 file is missing, the inputs are made from the
  32x32 images with `downsample_area`.
  """
  if not os.path.isdir(data_dir):
    raise UserError(f'Image data directory {data_dir!r} (config.data.dir) does not exist. Point it at a '
                    f'folder holding {split}.npy (N,32,32,3) uint8 and optionally {split}_8x8.npy, e.g. '
                    '../shared/data/celeba32.')
  highres_path = os.path.join(data_dir, f'{split}.npy')
  lowres_path = os.path.join(data_dir, f'{split}_8x8.npy')
  if not os.path.isfile(highres_path):
    present = sorted(f for f in os.listdir(data_dir) if f.endswith('.npy'))
    raise UserError(f'Missing {highres_path} for split {split!r}. .npy files in {data_dir}: '
                    f'{present or "none"}. Set the split name or config.data.dir to match.')
  highres_Nx32x32x3 = _load_array(highres_path, 'High-res', (HIGHRES, HIGHRES, 3))
  if os.path.isfile(lowres_path):
    lowres_Nx8x8x3 = _load_array(lowres_path, 'Low-res', (LOWRES, LOWRES, 3))
    if len(lowres_Nx8x8x3) != len(highres_Nx32x32x3):
      raise UserError(f'{lowres_path} has {len(lowres_Nx8x8x3)} images but {highres_path} has '
                      f'{len(highres_Nx32x32x3)}; row i of both must be the same face. Regenerate the 8x8 '
                      'file or delete it to have it made from the 32x32 images.')
  else:
    lowres_Nx8x8x3 = downsample_area(highres_Nx32x32x3, LOWRES)
  return lowres_Nx8x8x3, highres_Nx32x32x3


# ---------------------------------------------------------------------------------------------------------
# TFDS celeb_a.


def _prepared_celeba_builder(tfds_data_dir):
  """The TFDS celeb_a builder, or UserError at once if it is not prepared for `tfds.data_source`.

  Checks only the local files (dataset_info.json, features.json, file format): never downloads.
  """
  # Imported here: only this path needs TFDS, and importing it takes a second or two.
  import tensorflow_datasets as tfds  # pylint: disable=g-import-not-at-top

  builder = tfds.builder(TFDS_NAME, data_dir=tfds_data_dir)
  # data_dir_root is the folder given (or TFDS's default, e.g. ~/tensorflow_datasets); data_dir adds
  # celeb_a/<version>.
  root = builder.data_dir_root
  how = (f'Prepare it on a machine with internet: `tfds build {TFDS_NAME} --data_dir={root} '
         '--file_format=array_record` and copy that folder here (celeb_a\'s files come from Google Drive, '
         'which can refuse downloads over quota: retry later). Or use local arrays: '
         'config.data.image_source=npy with config.data.dir=../shared/data/celeba32.')
  if not builder.is_prepared():
    dataset_dir = os.path.join(root, TFDS_NAME)
    versions = sorted(os.listdir(dataset_dir)) if os.path.isdir(dataset_dir) else []
    raise UserError(f'TFDS {TFDS_NAME} {builder.version} is not prepared in TFDS data dir {root} '
                    f'(versions found in {dataset_dir}: {versions or "none"}). '
                    f'{how}')
  file_format = builder.info.file_format
  if file_format is None or file_format.value != 'array_record':
    raise UserError(f'TFDS {TFDS_NAME} in {builder.data_path} is stored as {file_format}, but '
                    'tfds.data_source needs random access (array_record). Rebuild it with '
                    f'--file_format=array_record. {how}')
  return builder


def load_tfds_split(split, tfds_data_dir, max_examples=None):
  """Reads TFDS celeb_a `split` ('train', 'validation', 'test', slices allowed) and preprocesses it.

  Uses `tfds.data_source` (random access, works without TensorFlow) with download=False after a local
  preparedness check, so a missing dataset is a UserError within a second rather than a hung download.
  Returns (lowres_Nx8x8x3, highres_Nx32x32x3) uint8 with N = min(len(split), max_examples).
  """
  import tensorflow_datasets as tfds  # pylint: disable=g-import-not-at-top

  builder = _prepared_celeba_builder(tfds_data_dir)
  split_names = [part.split('[')[0].strip() for part in split.split('+')]  # e.g. 'train[:90%]+validation'
  if any(name not in builder.info.splits for name in split_names):
    raise UserError(f'Unknown TFDS {TFDS_NAME} split {split!r}; available: {sorted(builder.info.splits)}.')
  source = tfds.data_source(TFDS_NAME, split=split, data_dir=tfds_data_dir, download=False)
  count = len(source) if max_examples is None else min(len(source), max_examples)
  lowres_Nx8x8x3 = np.zeros((count, LOWRES, LOWRES, 3), np.uint8)
  highres_Nx32x32x3 = np.zeros((count, HIGHRES, HIGHRES, 3), np.uint8)
  for i in range(count):
    lowres_Nx8x8x3[i], highres_Nx32x32x3[i] = preprocess_celeba(source[i]['image'])
  return lowres_Nx8x8x3, highres_Nx32x32x3


# ---------------------------------------------------------------------------------------------------------
# Sample sheets and metrics.

_GAP = 2  # Pixels of white between cells and around the sheet.


def save_image_grid(path_png, rows, row_labels=None, scale=4):
  """Writes a PNG sheet: one row per entry of `rows` (each uint8 [N, h, w, 3]), one column per example.

  Images smaller than the largest in the sheet (e.g. 8x8 inputs beside 32x32 outputs) are enlarged by
  nearest neighbour to its size (their side must divide it), then every cell is scaled by `scale`.
  `row_labels` (one string per row) are written in a column on the left. Cells are separated by 2 white
  pixels, so without labels the sheet is rows*(S+2)+2 high and N*(S+2)+2 wide, S = side*scale.
  Returns the sheet as a uint8 [height, width, 3] array.
  """
  rows = [np.asarray(r) for r in rows]
  if not rows or any(r.ndim != 4 or r.shape[-1] != 3 or r.dtype != np.uint8 for r in rows):
    raise ValueError('save_image_grid expects a non-empty list of uint8 [N, h, w, 3] arrays, got '
                     f'{[(r.shape, r.dtype) for r in rows]}.')
  if len({len(r) for r in rows}) != 1:
    raise ValueError('save_image_grid rows must hold the same number of images, got '
                     f'{[len(r) for r in rows]}.')
  if row_labels is not None and len(row_labels) != len(rows):
    raise ValueError(f'save_image_grid got {len(row_labels)} labels for {len(rows)} rows.')
  side = max(max(r.shape[1], r.shape[2]) for r in rows)
  cell = side * scale
  font = ImageFont.load_default()
  draw_probe = ImageDraw.Draw(Image.new('RGB', (1, 1)))
  label_width = 0
  if row_labels:
    label_width = int(max(draw_probe.textlength(label, font=font) for label in row_labels)) + 2 * _GAP
  num_cols = len(rows[0])
  height = len(rows) * (cell + _GAP) + _GAP
  width = label_width + num_cols * (cell + _GAP) + _GAP
  sheet = Image.new('RGB', (width, height), (255, 255, 255))
  draw = ImageDraw.Draw(sheet)
  for r, images_Nxhxwx3 in enumerate(rows):
    fy, fx = side // images_Nxhxwx3.shape[1], side // images_Nxhxwx3.shape[2]
    if fy * images_Nxhxwx3.shape[1] != side or fx * images_Nxhxwx3.shape[2] != side:
      raise ValueError(f'save_image_grid: row {r} images {images_Nxhxwx3.shape[1:3]} do not divide {side}.')
    top = _GAP + r * (cell + _GAP)
    if row_labels:
      # Centre the label vertically on its row (no `anchor`: bitmap fonts do not support it).
      _, text_top, _, text_bottom = draw.textbbox((0, 0), row_labels[r], font=font)
      text_y = top + (cell - (text_bottom - text_top)) // 2 - text_top
      draw.text((_GAP, text_y), row_labels[r], fill=(0, 0, 0), font=font)
    for c, image in enumerate(images_Nxhxwx3):
      big = np.repeat(np.repeat(image, fy * scale, axis=0), fx * scale, axis=1)
      sheet.paste(Image.fromarray(big), (label_width + _GAP + c * (cell + _GAP), top))
  os.makedirs(os.path.dirname(os.path.abspath(path_png)), exist_ok=True)
  sheet.save(path_png, format='PNG')
  return np.asarray(sheet)


def _check_pair(a, b, name):
  """Two image batches of one [N, H, W, C] shape, as float64."""
  a, b = np.asarray(a), np.asarray(b)
  if a.shape != b.shape or a.ndim != 4:
    raise ValueError(f'{name} expects two [N, H, W, C] image batches of one shape, got {a.shape} and '
                     f'{b.shape}.')
  return a.astype(np.float64), b.astype(np.float64)


def psnr(a, b):
  """Per-image PSNR in dB of uint8 [N, H, W, C] batches (peak 255, MSE over all sub-pixels); inf if equal."""
  a, b = _check_pair(a, b, 'psnr')
  mse_N = np.mean((a - b) ** 2, axis=(1, 2, 3))
  with np.errstate(divide='ignore'):
    return 10.0 * np.log10(255.0 ** 2 / mse_N)


ENLARGE_METHODS = ('nearest', 'bicubic')


def enlarge(lowres_NxhxWx3, side=HIGHRES, method='nearest'):
  """uint8 [N, h, h, 3] -> uint8 [N, side, side, 3]: the input enlarged without a model (a baseline).

  nearest repeats each input pixel over its (side / h)² output pixels. bicubic is jax.image.resize's (Keys'
  cubic, a = -0.5, pixel centres aligned), rounded and clipped to 0..255 (cubic kernels overshoot at edges).
  """
  lowres = np.asarray(lowres_NxhxWx3)
  if lowres.ndim != 4 or lowres.dtype != np.uint8 or lowres.shape[1] != lowres.shape[2] or side % lowres.shape[1]:
    raise ValueError(f'enlarge expects uint8 [N, h, h, C] images with h dividing {side}, got {lowres.shape} '
                     f'{lowres.dtype}.')
  if method not in ENLARGE_METHODS:
    raise ValueError(f'enlarge: unknown method {method!r}; choose one of {ENLARGE_METHODS}.')
  scale = side // lowres.shape[1]
  if method == 'nearest':
    return lowres.repeat(scale, axis=1).repeat(scale, axis=2)
  import jax  # pylint: disable=g-import-not-at-top  (data loading stays importable without initializing JAX)
  out = jax.image.resize(lowres.astype(np.float32), (lowres.shape[0], side, side, lowres.shape[3]), 'bicubic')
  return np.clip(np.round(np.asarray(out)), 0, 255).astype(np.uint8)


def _gaussian_valid(x_NxHxWxC, sigma=1.5, radius=5):
  """Gaussian-weighted local means over 11x11 windows fully inside the image: [N, H-10, W-10, C]."""
  taps = np.exp(-0.5 * (np.arange(-radius, radius + 1) / sigma) ** 2)
  taps /= taps.sum()
  x = scipy.ndimage.correlate1d(x_NxHxWxC, taps, axis=1, mode='reflect')
  x = scipy.ndimage.correlate1d(x, taps, axis=2, mode='reflect')
  # Crop the border, whose windows would reach past the image: as Wang et al.'s filter2(..., 'valid').
  return x[:, radius:-radius, radius:-radius]


def ssim(a, b):
  """Per-image SSIM (Wang et al. 2004) of uint8 [N, H, W, C] batches, H and W >= 11.

  The standard settings: 11x11 Gaussian window with sigma 1.5, K1=0.01, K2=0.03, L=255, population
  (co)variances, on each channel separately; the map over all valid windows and channels is averaged.
  Identical images give exactly 1.0.
  """
  a, b = _check_pair(a, b, 'ssim')
  if min(a.shape[1:3]) < 11:
    raise ValueError(f'ssim needs images of at least 11x11, got {a.shape[1:3]}.')
  c1, c2 = (0.01 * 255) ** 2, (0.03 * 255) ** 2
  mu_a, mu_b = _gaussian_valid(a), _gaussian_valid(b)
  var_a = _gaussian_valid(a * a) - mu_a * mu_a
  var_b = _gaussian_valid(b * b) - mu_b * mu_b
  cov_ab = _gaussian_valid(a * b) - mu_a * mu_b
  ssim_map = ((2 * mu_a * mu_b + c1) * (2 * cov_ab + c2) /
              ((mu_a * mu_a + mu_b * mu_b + c1) * (var_a + var_b + c2)))
  return ssim_map.mean(axis=(1, 2, 3))
