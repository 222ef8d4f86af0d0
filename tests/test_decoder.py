"""bpd/decoder.py's cache length: one rule for every decoder, and a loud error for a cache too short for it."""

import jax
import numpy as np
import pytest

from bpd import decoder as decoder_lib
from bpd import decoding
from bpd import model as model_lib
from bpd import prompt_lookup


@pytest.fixture(scope='module')
def tiny():
  config = model_lib.model_config('tiny', vocab_size=24, k=4, dropout_rate=0.0, d_model=32)
  return model_lib.Transformer(config), model_lib.init_params(config, jax.random.PRNGKey(0))


def test_cache_len_leaves_room_for_the_last_block():
  assert decoder_lib.cache_len(10) == 11  # one token at a time: slots 0..9, one spare
  assert decoder_lib.cache_len(10, block=4) == 15  # blockwise: a done row's block starts at slot 11


def test_a_cache_too_short_for_the_blocks_is_refused_naming_the_lengths(tiny):
  model, params = tiny
  init_state = model_lib.decode_fns(model, params).init
  src_BxS = np.array([[5, 6, 7, 0]], np.int32)
  decoder_lib.check_cache_len(init_state(src_BxS, decoder_lib.cache_len(8, block=4)), 8, block=4)
  short = init_state(src_BxS, decoder_lib.cache_len(8))  # a greedy cache used for blocks of 4
  with pytest.raises(ValueError, match=r'9 slots; decoding max_len=8 tokens in blocks of 4 needs 13'):
    decoder_lib.check_cache_len(short, 8, block=4)
  with pytest.raises(ValueError, match='12 slots'):  # one short: a done row's block would be clamped
    decoder_lib.check_cache_len(init_state(src_BxS, decoder_lib.cache_len(8, block=4) - 1), 8, block=4)


def test_every_decoder_method_gets_a_long_enough_cache(tiny):
  """The Decoder's own paths pass the check (it runs at trace time) and decode."""
  model, params = tiny
  decoder = decoder_lib.Decoder(model, max_len=6)
  src_BxS = np.array([[5, 6, 7, 0], [8, 9, 0, 0]], np.int32)
  assert decoder.greedy(params, src_BxS).tokens_BxL.shape == (2, 6)
  for tree in (decoding.chain(4), decoding.layout(((0,), (1,), (0, 0))), decoding.Dynamic(5, 4)):
    result = decoder.blockwise(params, src_BxS, decoding.EXACT, tree)
    assert result.tokens_BxL.shape == (2, 6)
  # A drafter that needs no heads: chains longer than the model's k, head 1 alone, output greedy's.
  greedy = decoder.greedy(params, src_BxS).tokens_BxL
  for k in (2, 6):
    result = decoder.blockwise(params, src_BxS, decoding.EXACT, decoding.chain(k), drafter=prompt_lookup.PromptLookup())
    np.testing.assert_array_equal(np.asarray(result.tokens_BxL), np.asarray(greedy))
