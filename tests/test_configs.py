"""Every config file loads, with and without its arguments, and its decode sweep fits its k."""

import importlib

import pytest

from bpd import decoding
from bpd import model as model_lib


@pytest.mark.parametrize('name, args', [
    ('demo', None), ('demo', 'k=2,regime=frozen,steps=5'),
    ('multi30k_ende', None), ('multi30k_ende', 'k=4,regime=finetune'), ('multi30k_ende', 'runlocal=1'),
    ('wmt14_ende', None), ('wmt14_ende', 'k=10,regime=frozen,size=big'),
    ('celeba_sr', None), ('celeba_sr', 'cpu'), ('celeba_sr', 'cpu=1,k=4,regime=finetune'), ('celeba_sr', 'runlocal'),
    ('celeba_sr', 'gpu'), ('celeba_sr', 'gpu,regime=frozen'),
])
def test_config_loads_and_is_consistent(name, args):
  c = importlib.import_module(f'configs.{name}').get_config(args)
  assert c.model.size in model_lib.SIZES
  assert all(1 <= k <= c.k for k in c.decode.ks)
  for spec in c.decode.criteria:
    decoding.parse_criterion(spec, k=c.k)
  assert c.data.bucket_lengths[-1] == c.data.max_len


@pytest.mark.parametrize('args', [None, 'cpu', 'gpu', 'runlocal'])
def test_celeba_sr_config_decodes_images_with_the_paper_criteria(args):
  c = importlib.import_module('configs.celeba_sr').get_config(args)
  assert c.data.source == 'images' and c.k == 10 and c.decode.max_len <= 3072
  assert set(c.decode.criteria) == {'exact', 'distance:2'} and 10 in c.decode.ks
  assert c.model.attention_block > 0
