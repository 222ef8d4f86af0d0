"""2D image position encodings (model.image_positions; Image Transformer, Parmar et al. 2018, §3.2).

Input and output sub-pixels share one coordinate system (output-pixel units, input pixels at their centres),
so that the cross-attention of an output sub-pixel can find the input sub-pixel that covers it.
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from bpd import layers
from bpd import model as model_lib
from bpd import tasks
from bpd.data import images
from bpd.errors import UserError
from configs import celeba_sr


@pytest.mark.parametrize('d_model', [64, 128, 256])  # the image_* sizes
def test_nearest_input_subpixel_of_the_same_channel_is_the_colocated_one(d_model):
  target_TxD = np.asarray(layers.image_positions(jnp.arange(3072)[None], 32, 1, d_model))[0]
  source_SxD = np.asarray(layers.image_positions(jnp.arange(192)[None], 8, 4, d_model))[0]
  distance_TxS = ((target_TxD[:, None] - source_SxD[None]) ** 2).sum(-1)
  t = np.arange(3072)
  row, col, channel = t // 96, (t // 3) % 32, t % 3
  colocated_T = (row // 4) * 24 + (col // 4) * 3 + channel
  # Channels are one unit apart on the column axis, closer than neighbouring pixels (3 units): among all input
  # sub-pixels the nearest is often another channel of the right pixel; the model learns to tell them apart.
  same_channel_TxS = (np.arange(192) % 3)[None] == channel[:, None]
  nearest_T = np.where(same_channel_TxS, distance_TxS, np.inf).argmin(axis=1)
  np.testing.assert_array_equal(nearest_T, colocated_T)


def test_every_output_subpixel_has_its_own_encoding():
  target_TxD = np.asarray(layers.image_positions(jnp.arange(3072)[None], 32, 1, 64))[0]
  assert len(np.unique(target_TxD.round(5), axis=0)) == 3072


def test_image_sides_come_together():
  for sides in (dict(image_side=32), dict(image_input_side=8), dict(image_side=32, image_input_side=6)):
    with pytest.raises(UserError, match='set together'):
      model_lib.model_config('image_tiny', vocab_size=259, **sides)
  config = model_lib.model_config('image_tiny', vocab_size=259, image_side=32, image_input_side=8)
  assert (config.image_side, config.image_input_side) == (32, 8)


def test_celeba_config_turns_image_positions_on_and_text_ignores_the_flag():
  config = celeba_sr.get_config('runlocal')
  assert tasks.for_config(config).model_options(config) == dict(image_side=32, image_input_side=8,
                                                                colocated_input=False)
  config.model.image_positions = False
  assert tasks.for_config(config).model_options(config) == {}
  config.model.image_positions = True
  config.data.source = 'text'
  assert tasks.for_config(config).model_options(config) == {}


# -- model.colocated_input: the input sub-pixel under each output sub-pixel (a deviation from the paper) ----


@pytest.mark.parametrize('side, input_side', [(32, 8), (8, 2), (4, 2)])
def test_colocated_index_is_the_covering_input_subpixel_of_the_same_channel(side, input_side):
  """Straight from the definition, one sub-pixel at a time: output (row, col, channel) lies in input pixel
  (row // s, col // s), s = side // input_side, and takes that pixel's sub-pixel of the same channel."""
  s = side // input_side
  expected = [((row // s) * input_side + col // s) * 3 + channel
              for row in range(side) for col in range(side) for channel in range(3)]
  got = np.asarray(layers.colocated_source_index(jnp.arange(side * side * 3)[None], side, input_side))[0]
  np.testing.assert_array_equal(got, expected)


def test_colocated_input_tokens_are_the_nearest_neighbour_enlargement():
  """By construction: gathering a source image's ids at the co-located indices gives the ids of the same image
  enlarged by nearest neighbour (the baseline the co-located model starts from), in the target's raster order."""
  lowres_Nx8x8x3 = np.random.default_rng(0).integers(0, 256, (3, 8, 8, 3)).astype(np.uint8)
  src_NxS = images.image_to_tokens(lowres_Nx8x8x3)
  index_T = np.asarray(layers.colocated_source_index(jnp.arange(3072)[None], 32, 8))[0]
  np.testing.assert_array_equal(src_NxS[:, index_T], images.image_to_tokens(images.enlarge(lowres_Nx8x8x3)))


def test_colocated_model_adds_exactly_the_colocated_embedding():
  """The decoder input embedding at position p differs from the faithful model's (same parameters) by exactly
  the shared embedding of the co-located input id of target index p, scaled like a token embedding."""
  config = model_lib.model_config('image_tiny', vocab_size=259, dropout_rate=0.0, image_side=8, image_input_side=2,
                                  colocated_input=True)
  params = model_lib.init_params(config, jax.random.PRNGKey(0))
  assert jax.tree.map(jnp.shape, params) == jax.tree.map(
      jnp.shape, model_lib.init_params(dataclasses.replace(config, colocated_input=False), jax.random.PRNGKey(0)))
  rng = np.random.default_rng(1)
  src_BxS = jnp.asarray(rng.integers(3, 259, (2, 12)))
  tgt_BxT = jnp.asarray(rng.integers(3, 259, (2, 192)))
  positions_BxT = jnp.broadcast_to(jnp.arange(192), (2, 192))

  def embedded(colocated):
    model = model_lib.Transformer(dataclasses.replace(config, colocated_input=colocated))
    return model.apply({'params': params}, tgt_BxT, positions_BxT, True, False, src_BxS,
                       method=model_lib.Transformer._embed)  # pylint: disable=protected-access
  index_T = np.asarray(layers.colocated_source_index(jnp.arange(192)[None], 8, 2))[0]
  expected = params['embed']['embedding'][np.asarray(src_BxS)[:, index_T]] * np.sqrt(config.d_model)
  np.testing.assert_allclose(np.asarray(embedded(True) - embedded(False)), np.asarray(expected), atol=1e-5)


def test_colocated_input_errors_and_defaults():
  with pytest.raises(UserError, match='colocated_input=True needs image_side'):
    model_lib.model_config('image_tiny', vocab_size=259, colocated_input=True)
  # Off by default; a model.json written before the field existed loads as the faithful model.
  assert not model_lib.model_config('image_tiny', vocab_size=259).colocated_input
  assert not model_lib.ModelConfig(vocab_size=259, image_side=32, image_input_side=8).colocated_input
  config = model_lib.model_config('image_tiny', vocab_size=259, image_side=8, image_input_side=2,
                                  colocated_input=True)
  model = model_lib.Transformer(config)
  params = model_lib.init_params(config, jax.random.PRNGKey(0))
  with pytest.raises(UserError, match='the source must be the 2x2x3 input image as 12 sub-pixel ids'):
    model.apply({'params': params}, jnp.ones((1, 8), jnp.int32), jnp.ones((1, 4), jnp.int32))


def test_celeba_config_colocated_switch():
  """configs/celeba_sr.py: off (the faithful model) unless the `colocated` argument is given; it needs 2D
  positions and images."""
  assert not celeba_sr.get_config('cpu').model.colocated_input
  config = celeba_sr.get_config('cpu,colocated')
  assert tasks.for_config(config).model_options(config) == dict(image_side=32, image_input_side=8, colocated_input=True)
  config.model.image_positions = False
  with pytest.raises(UserError, match='colocated_input=True needs'):
    tasks.for_config(config).model_options(config)
  config.model.image_positions = True
  config.data.source = 'text'
  with pytest.raises(UserError, match='colocated_input=True needs'):
    tasks.for_config(config).model_options(config)


def test_ordinal_pixel_init_orders_the_intensity_embeddings():
  """config.model.ordinal_pixel_init: unit-norm intensity rows whose similarity falls with the intensity gap
  (near 0 from ORDINAL_WIDTH levels on); special ids' rows as the plain init; same parameter shapes."""
  config = model_lib.model_config('image_tiny', vocab_size=259, image_side=32, image_input_side=8,
                                  colocated_input=True, ordinal_pixel_init=True)
  table_VxD = np.asarray(model_lib.init_params(config, jax.random.PRNGKey(0))['embed']['embedding'])
  plain_VxD = np.asarray(model_lib.init_params(dataclasses.replace(config, ordinal_pixel_init=False),
                                               jax.random.PRNGKey(0))['embed']['embedding'])
  assert table_VxD.shape == plain_VxD.shape
  np.testing.assert_array_equal(table_VxD[:images.PIXEL_OFFSET], plain_VxD[:images.PIXEL_OFFSET])
  pixels_VxD = table_VxD[images.PIXEL_OFFSET:]
  np.testing.assert_allclose(np.linalg.norm(pixels_VxD, axis=1), 1.0, atol=1e-5)
  similarity_to_100 = pixels_VxD @ pixels_VxD[100]
  assert np.all(np.diff(similarity_to_100[100:100 + layers.ORDINAL_WIDTH]) < 0)  # falls with the gap
  assert np.abs(similarity_to_100[100 + 2 * layers.ORDINAL_WIDTH:]).max() < 0.25  # far intensities: unrelated
  assert pixels_VxD.argmax(axis=0).shape == (64,) and (pixels_VxD @ pixels_VxD.T).argmax(axis=1).tolist() == list(
      range(256))  # each intensity is still its own nearest embedding: the tied projection can emit every one
  with pytest.raises(UserError, match='ordinal_pixel_init needs the image vocabulary'):
    model_lib.init_params(dataclasses.replace(config, vocab_size=100), jax.random.PRNGKey(0))
  config = celeba_sr.get_config('cpu')
  config.model.ordinal_pixel_init = True
  assert tasks.for_config(config).model_options(config)['ordinal_pixel_init']
  config.data.source = 'text'
  with pytest.raises(UserError, match='ordinal_pixel_init=True initializes'):
    tasks.for_config(config).model_options(config)


def test_celeba_config_output_prior_switch():
  """configs/celeba_sr.py: no prior (the faithful model) unless `prior` (sigma 26, the bicubic enlargement's RMS
  error on the train faces) or `prior=S` is given; it needs 2D positions and images."""
  assert celeba_sr.get_config('cpu').model.output_prior_sigma == 0.0
  assert 'output_prior_sigma' not in tasks.for_config(celeba_sr.get_config('cpu')).model_options(
      celeba_sr.get_config('cpu'))
  config = celeba_sr.get_config('cpu,prior')
  assert tasks.for_config(config).model_options(config)['output_prior_sigma'] == 26.0
  assert celeba_sr.get_config('cpu,prior=8').model.output_prior_sigma == 8.0
  config.model.image_positions = False
  with pytest.raises(UserError, match='output_prior_sigma=26.0 centres each output'):
    tasks.for_config(config).model_options(config)
  config.model.image_positions = True
  config.data.source = 'text'
  with pytest.raises(UserError, match='output_prior_sigma=26.0 centres each output'):
    tasks.for_config(config).model_options(config)
