"""2D image position encodings (model.image_positions; Image Transformer, Parmar et al. 2018, §3.2).

Input and output sub-pixels share one coordinate system (output-pixel units, input pixels at their centres),
so that the cross-attention of an output sub-pixel can find the input sub-pixel that covers it.
"""

import jax.numpy as jnp
import numpy as np
import pytest

from bpd import layers
from bpd import model as model_lib
from bpd import train
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
  assert train.image_sides(config) == dict(image_side=32, image_input_side=8)
  config.model.image_positions = False
  assert train.image_sides(config) == {}
  config.model.image_positions = True
  config.data.source = 'text'
  assert train.image_sides(config) == {}
