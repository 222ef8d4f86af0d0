"""Tests for bpd.data.images: CelebA preprocessing, pixel tokens, .npy and TFDS loading, sheets, metrics."""

import os
import time

import numpy as np
import pytest
from PIL import Image

from bpd.data import images
from bpd.errors import UserError

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# CI keeps shared/ beside the checkout; skip the real-data tests where it is absent.
CELEBA32_DIR = os.path.join(os.path.dirname(REPO_ROOT), 'shared', 'data', 'celeba32')


def _random_images(shape, seed=0):
  return np.random.default_rng(seed).integers(0, 256, shape, dtype=np.uint8)


# --- Preprocessing -------------------------------------------------------------------------------------


def test_preprocess_celeba_crops_the_t2t_box():
  # Inside the 138x138 crop (rows 40..177, cols 20..157) random, outside white: no white may leak in.
  image = np.full(images.CELEBA_SHAPE, 255, np.uint8)
  crop = _random_images((138, 138, 3))
  crop[crop == 255] = 254
  image[40:178, 20:158] = crop
  lowres, highres = images.preprocess_celeba(image)
  assert lowres.shape == (8, 8, 3) and highres.shape == (32, 32, 3)
  assert lowres.dtype == np.uint8 and highres.dtype == np.uint8
  assert highres.max() < 255 and lowres.max() < 255
  # And the result depends only on the crop: change everything outside it.
  image[:40] = 0
  image[:, 158:] = 7
  np.testing.assert_array_equal(images.preprocess_celeba(image)[1], highres)


def test_preprocess_celeba_is_box_resampling_of_the_crop():
  image = _random_images(images.CELEBA_SHAPE, seed=1)
  lowres, highres = images.preprocess_celeba(image)
  crop = Image.fromarray(np.ascontiguousarray(image[40:178, 20:158]))
  np.testing.assert_array_equal(highres, np.asarray(crop.resize((32, 32), Image.BOX)))
  np.testing.assert_array_equal(lowres, np.asarray(crop.resize((8, 8), Image.BOX)))


def test_preprocess_celeba_is_close_to_exact_area_on_smooth_images():
  # t2t uses TF AREA (fractional edge pixels); BOX should agree within a level on smooth content.
  y, x = np.mgrid[0:218, 0:178]
  image = np.stack([x, y, (x + y) // 2], axis=-1).astype(np.uint8)
  _, highres = images.preprocess_celeba(image)
  crop = image[40:178, 20:158].astype(np.float64)
  edges = np.arange(33) * 138 / 32
  weights_32x138 = np.clip(np.minimum(edges[1:, None], np.arange(138) + 1) -
                           np.maximum(edges[:-1, None], np.arange(138)), 0, None) / (138 / 32)
  exact = np.einsum('oh,pw,hwc->opc', weights_32x138, weights_32x138, crop)
  assert np.abs(highres - exact).max() <= 1.5  # Pillow also rounds after each of its two passes.


def test_preprocess_celeba_rejects_wrong_shape():
  with pytest.raises(UserError, match=r'218, 178, 3'):
    images.preprocess_celeba(np.zeros((32, 32, 3), np.uint8))


def test_downsample_area_is_block_mean_and_close_to_pillow_box():
  batch = _random_images((3, 32, 32, 3), seed=2)
  small = images.downsample_area(batch, 8)
  assert small.shape == (3, 8, 8, 3) and small.dtype == np.uint8
  means = batch.astype(np.float64).reshape(3, 8, 4, 8, 4, 3).mean(axis=(2, 4))
  assert np.abs(small - means).max() <= 0.5
  # Pillow's BOX rounds after its horizontal and again after its vertical pass: off by one at most.
  for image, ours in zip(batch, small):
    pillow = np.asarray(Image.fromarray(image).resize((8, 8), Image.BOX)).astype(np.int64)
    assert np.abs(ours - pillow).max() <= 1
  with pytest.raises(ValueError, match='divide'):
    images.downsample_area(batch, 5)


# --- Tokens -----------------------------------------------------------------------------------------------


def test_tokens_round_trip_and_order():
  batch = _random_images((2, 32, 32, 3), seed=3)
  tokens = images.image_to_tokens(batch)
  assert tokens.shape == (2, 3072) and tokens.dtype == np.int32
  assert tokens.min() >= images.PIXEL_OFFSET and tokens.max() < images.IMAGE_VOCAB_SIZE
  # Raster order, R, G, B per pixel: token 3 * (row * 32 + col) + channel.
  assert tokens[1, 3 * (5 * 32 + 7) + 2] == batch[1, 5, 7, 2] + images.PIXEL_OFFSET
  np.testing.assert_array_equal(images.tokens_to_image(tokens, 32, 32), batch)
  # Every intensity survives, and token distance is intensity distance (for distance(eps) acceptance).
  all_values = np.arange(256, dtype=np.uint8).reshape(1, 16, 16, 1).repeat(3, axis=-1)
  all_tokens = images.image_to_tokens(all_values)
  np.testing.assert_array_equal(images.tokens_to_image(all_tokens, 16, 16), all_values)
  assert np.array_equal(np.diff(all_tokens[0, ::3]), np.ones(255))


def test_tokens_to_image_clips_specials_and_ignores_extra_tokens():
  tokens = np.full((1, 3072 + 5), images.PIXEL_OFFSET + 100, np.int32)
  tokens[0, :3] = [0, 1, 2]  # pad, eos, bos -> black.
  tokens[0, 3] = 10_000  # Past the vocabulary -> 255.
  image = images.tokens_to_image(tokens)
  assert image.shape == (1, 32, 32, 3)
  np.testing.assert_array_equal(image[0, 0, 0], [0, 0, 0])
  assert image[0, 0, 1, 0] == 255 and image[0, 0, 1, 1] == 100
  with pytest.raises(ValueError, match='3072'):
    images.tokens_to_image(tokens[:, :100])


# --- .npy loading -----------------------------------------------------------------------------------------


def test_load_npy_split_reads_both_files(tmp_path):
  highres = _random_images((5, 32, 32, 3), seed=4)
  lowres = _random_images((5, 8, 8, 3), seed=5)
  np.save(tmp_path / 'val.npy', highres)
  np.save(tmp_path / 'val_8x8.npy', lowres)
  got_low, got_high = images.load_npy_split(str(tmp_path), 'val')
  np.testing.assert_array_equal(got_low, lowres)
  np.testing.assert_array_equal(got_high, highres)


def test_load_npy_split_makes_missing_lowres(tmp_path):
  highres = _random_images((4, 32, 32, 3), seed=6)
  np.save(tmp_path / 'train.npy', highres)
  got_low, _ = images.load_npy_split(str(tmp_path), 'train')
  np.testing.assert_array_equal(got_low, images.downsample_area(highres, 8))


def test_load_npy_split_errors(tmp_path):
  with pytest.raises(UserError, match='does not exist'):
    images.load_npy_split(str(tmp_path / 'nope'), 'val')
  np.save(tmp_path / 'train.npy', np.zeros((2, 32, 32, 3), np.uint8))
  with pytest.raises(UserError, match=r"val\.npy.*\['train\.npy'\]"):
    images.load_npy_split(str(tmp_path), 'val')
  np.save(tmp_path / 'val.npy', np.zeros((2, 28, 28, 3), np.uint8))
  with pytest.raises(UserError, match=r'val\.npy has shape \(2, 28, 28, 3\)'):
    images.load_npy_split(str(tmp_path), 'val')
  np.save(tmp_path / 'val.npy', np.zeros((2, 32, 32, 3), np.float32))
  with pytest.raises(UserError, match='dtype float32; expected uint8'):
    images.load_npy_split(str(tmp_path), 'val')
  np.save(tmp_path / 'val.npy', np.zeros((2, 32, 32, 3), np.uint8))
  np.save(tmp_path / 'val_8x8.npy', np.zeros((3, 8, 8, 3), np.uint8))
  with pytest.raises(UserError, match='has 3 images but .* has 2'):
    images.load_npy_split(str(tmp_path), 'val')
  (tmp_path / 'val_8x8.npy').write_bytes(b'not numpy')
  with pytest.raises(UserError, match='Cannot read Low-res file'):
    images.load_npy_split(str(tmp_path), 'val')


@pytest.mark.skipif(not os.path.isdir(CELEBA32_DIR), reason='shared CelebA data not present')
def test_load_npy_split_real_val():
  lowres, highres = images.load_npy_split(CELEBA32_DIR, 'val')
  assert lowres.shape == (780, 8, 8, 3) and highres.shape == (780, 32, 32, 3)
  # The provided 8x8 come straight from the crop; through 32x32 they are close but not equal.
  remade = images.downsample_area(highres, 8).astype(np.int64)
  assert np.abs(remade - lowres).mean() < 2.0
  tokens = images.image_to_tokens(highres[:8])
  np.testing.assert_array_equal(images.tokens_to_image(tokens), highres[:8])


# --- TFDS celeb_a -----------------------------------------------------------------------------------------


def _write_prepared_celeba_metadata(data_dir, file_format='array_record'):
  """Writes the metadata of a prepared celeb_a (no records) so the preparedness check passes.

  tfds.testing.mock_data(policy=USE_CODE) works with tfds.data_source without TensorFlow, but it points
  every builder at a non-existent data_dir, so a builder is never "prepared" under it and our fail-fast check
  (rightly) refuses. USE_FILES reads the real metadata from data_dir and mocks only the records, which
  tests load_tfds_split end to end, check included.
  """
  import tensorflow_datasets as tfds  # pylint: disable=g-import-not-at-top
  builder = tfds.builder('celeb_a', data_dir=data_dir, file_format=file_format)
  os.makedirs(builder.data_path)
  splits = []
  for name in ('train', 'validation', 'test'):
    template = tfds.core.ShardedFileTemplate(data_dir=builder.data_path, dataset_name='celeb_a',
                                             split=name, filetype_suffix=file_format)
    splits.append(tfds.core.SplitInfo(name=name, shard_lengths=[10], num_bytes=0,
                                      filename_template=template))
  builder.info.set_splits(tfds.core.SplitDict(splits))
  builder.info.write_to_directory(builder.data_path)


def test_load_tfds_split_with_mock_data(tmp_path):
  tfds = pytest.importorskip('tensorflow_datasets')
  _write_prepared_celeba_metadata(str(tmp_path))
  with tfds.testing.mock_data(num_examples=6, policy=tfds.testing.MockPolicy.USE_FILES,
                              data_dir=str(tmp_path)):
    lowres, highres = images.load_tfds_split('validation', str(tmp_path), max_examples=4)
    source = tfds.data_source('celeb_a', split='validation', data_dir=str(tmp_path), download=False)
    expected_low, expected_high = images.preprocess_celeba(source[2]['image'])
    with pytest.raises(UserError, match="split 'valid'"):
      images.load_tfds_split('valid', str(tmp_path))
  assert lowres.shape == (4, 8, 8, 3) and highres.shape == (4, 32, 32, 3)
  np.testing.assert_array_equal(lowres[2], expected_low)
  np.testing.assert_array_equal(highres[2], expected_high)


def test_load_tfds_split_fails_fast_when_not_prepared(tmp_path):
  pytest.importorskip('tensorflow_datasets')
  start = time.time()
  with pytest.raises(UserError) as error:
    images.load_tfds_split('train', str(tmp_path / 'empty_tfds'))
  assert time.time() - start < 5.0
  message = str(error.value)
  assert 'not prepared' in message and 'tfds build celeb_a' in message
  assert 'config.data.image_source=npy' in message and 'config.data.dir' in message


def test_load_tfds_split_rejects_tfrecord_format(tmp_path):
  pytest.importorskip('tensorflow_datasets')
  _write_prepared_celeba_metadata(str(tmp_path), file_format='tfrecord')
  with pytest.raises(UserError, match='array_record'):
    images.load_tfds_split('train', str(tmp_path))


# --- Sheets and metrics -----------------------------------------------------------------------------------


def test_save_image_grid(tmp_path):
  inputs = _random_images((3, 8, 8, 3), seed=7)
  outputs = _random_images((3, 32, 32, 3), seed=8)
  path = str(tmp_path / 'sub' / 'grid.png')
  sheet = images.save_image_grid(path, [inputs, outputs], scale=2)
  written = np.asarray(Image.open(path).convert('RGB'))
  np.testing.assert_array_equal(written, sheet)
  cell = 32 * 2
  assert written.shape == (2 * (cell + 2) + 2, 3 * (cell + 2) + 2, 3)
  # Cell (row 1, column 2) holds outputs[2] scaled by 2; the 8x8 input is enlarged nearest to 64x64.
  top, left = 2 + cell + 2, 2 + 2 * (cell + 2)
  np.testing.assert_array_equal(written[top:top + cell:2, left:left + cell:2], outputs[2])
  np.testing.assert_array_equal(written[2:2 + cell:8, 2:2 + cell:8], inputs[0])

  labelled = images.save_image_grid(path, [inputs, outputs, outputs], ['input 8x8', 'greedy', 'truth'])
  cell = 32 * 4
  assert labelled.shape[0] == 3 * (cell + 2) + 2
  assert labelled.shape[1] > 3 * (cell + 2) + 2  # A label column on the left.
  assert Image.open(path).size == (labelled.shape[1], labelled.shape[0])


def test_psnr():
  a = _random_images((2, 32, 32, 3), seed=9)
  assert np.all(np.isinf(images.psnr(a, a)))
  b = a.astype(np.int64)
  b[1] = np.clip(b[1] + np.where(b[1] < 128, 10, -10), 0, 255)  # Every sub-pixel off by exactly 10.
  got = images.psnr(a, b.astype(np.uint8))
  assert got.shape == (2,) and np.isinf(got[0])
  np.testing.assert_allclose(got[1], 10 * np.log10(255 ** 2 / 100))


def test_ssim():
  a = _random_images((2, 32, 32, 3), seed=10)
  np.testing.assert_array_equal(images.ssim(a, a), [1.0, 1.0])
  # Constant images: zero variances, so SSIM is the luminance term only, (2xy + C1) / (x^2 + y^2 + c1).
  x = np.full((1, 16, 16, 3), 100, np.uint8)
  y = np.full((1, 16, 16, 3), 150, np.uint8)
  c1 = (0.01 * 255) ** 2
  np.testing.assert_allclose(images.ssim(x, y), [(2 * 100 * 150 + c1) / (100 ** 2 + 150 ** 2 + c1)])
  # Same means, structure destroyed: a pattern against its own flat mean scores well below 1.
  pattern = np.zeros((1, 16, 16, 3), np.uint8)
  pattern[:, ::2] = 200
  flat = np.full_like(pattern, 100)
  assert images.ssim(pattern, flat)[0] < 0.1
  assert images.ssim(a, 255 - a).mean() < 0.0  # Anti-correlated.


def test_enlarge_nearest_and_bicubic():
  lowres = _random_images((2, 8, 8, 3), seed=11)
  nearest = images.enlarge(lowres)
  assert nearest.shape == (2, 32, 32, 3) and nearest.dtype == np.uint8
  # Nearest: output pixel (r, c) is input pixel (r // 4, c // 4).
  np.testing.assert_array_equal(nearest[:, 13, 30], lowres[:, 3, 7])
  np.testing.assert_array_equal(images.enlarge(lowres, 16), lowres.repeat(2, 1).repeat(2, 2))
  bicubic = images.enlarge(lowres, method='bicubic')
  assert bicubic.shape == (2, 32, 32, 3) and bicubic.dtype == np.uint8
  # A flat image stays flat; extremes clip rather than wrap (cubic kernels overshoot at hard edges).
  flat = np.full((1, 8, 8, 3), 77, np.uint8)
  np.testing.assert_array_equal(images.enlarge(flat, method='bicubic'), np.full((1, 32, 32, 3), 77))
  edge = np.zeros((1, 8, 8, 3), np.uint8)
  edge[:, :, 4:] = 255
  out = images.enlarge(edge, method='bicubic').astype(int)
  assert out.min() == 0 and out.max() == 255 and len(np.unique(out)) > 2  # smooth ramp, clipped at both ends
  # Smooth inputs: bicubic is closer to the smooth truth than nearest.
  ramp = np.tile(np.linspace(0, 255, 32), (32, 1))[None, :, :, None].repeat(3, -1)
  truth = np.round(ramp).astype(np.uint8)
  small = images.downsample_area(truth, 8)
  assert images.psnr(images.enlarge(small, method='bicubic'), truth)[0] > images.psnr(images.enlarge(small),
                                                                                        truth)[0]
  with pytest.raises(ValueError, match='unknown method'):
    images.enlarge(lowres, method='lanczos')
  with pytest.raises(ValueError, match='h dividing 30'):
    images.enlarge(lowres, 30)
