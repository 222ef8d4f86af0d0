"""Every config file loads, with and without its arguments, its decode sweep fits its k, and it refuses typos."""

import importlib
import os
import subprocess
import sys

import pytest

from bpd import decoding
from bpd import model as model_lib
from bpd.errors import UserError
from configs import common


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


CONFIGS = ('demo', 'multi30k_ende', 'wmt14_ende', 'celeba_sr')


@pytest.mark.parametrize('name', CONFIGS)
def test_every_config_refuses_an_unknown_argument_naming_the_accepted_ones(name):
  module = importlib.import_module(f'configs.{name}')
  with pytest.raises(UserError, match="unknown argument 'regmie'") as raised:
    module.get_config('regmie=finetune')
  assert all(key in str(raised.value) for key in module.ARGS), str(raised.value)
  assert '\n' not in str(raised.value)


@pytest.mark.parametrize('name', CONFIGS)
@pytest.mark.parametrize('arg, complaint', [('k=abc', 'not an integer'), ('regime=finetun', 'not one of'),
                                            ('k', 'needs a value'), ('k=2,k=4', 'given twice')])
def test_every_config_refuses_a_bad_value(name, arg, complaint):
  with pytest.raises(UserError, match=complaint):
    importlib.import_module(f'configs.{name}').get_config(arg)


@pytest.mark.parametrize('name, arg, field, value', [
    ('celeba_sr', 'cpu,prior,colocated', 'model.output_prior_sigma', 26.0),
    ('celeba_sr', 'cpu,prior,colocated', 'model.colocated_input', True),
    ('celeba_sr', 'prior=13', 'model.output_prior_sigma', 13.0),
    ('celeba_sr', 'cpu=false', 'model.size', 'base'),
    ('celeba_sr', 'cpu=1', 'model.size', 'image_tiny'),
    ('multi30k_ende', 'runlocal', 'model.size', 'tiny'),  # the smoke run its docstring mentions
    ('demo', 'regime=finetune', 'train.head1_weight', 7.0),
])
def test_arguments_are_typed_and_booleans_may_be_bare(name, arg, field, value):
  c = importlib.import_module(f'configs.{name}').get_config(arg)
  section, key = field.split('.')
  assert c[section][key] == value and type(c[section][key]) is type(value)


def test_celeba_sr_refuses_a_typo_among_bare_booleans():
  with pytest.raises(UserError, match="unknown argument 'typo'"):
    importlib.import_module('configs.celeba_sr').get_config('cpu,prior,typo')
  with pytest.raises(UserError, match='not a boolean'):
    importlib.import_module('configs.celeba_sr').get_config('cpu=maybe')


def test_defaults_list_every_field_and_refuse_new_ones():
  c = common.defaults()
  assert c.model.output_prior_sigma == 0.0 and c.decode.grid_examples > 0
  with pytest.raises(AttributeError):
    c.train.num_stepz = 5  # a config file's typo fails where it is written


REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.parametrize('flags, complaint', [
    (['--config=configs/demo.py', '--config.train.num_stepz=5'],
     "--config.train.num_stepz: the config has no field 'num_stepz'. Did you mean \"num_steps\""),
    (['--config=configs/demo.py:k=abc'], 'configs/demo.py:k=abc: not an integer'),
    (['--config=configs/celeba_sr.py:cpu,prior,typo'], "unknown argument 'typo'"),
    (['--config=configs/demo.py', '--config.train.num_steps=abc'], '--config.train.num_steps=abc'),
    (['--config=configs/no_such_config.py'], 'cannot load the config file'),
])
def test_bad_command_lines_exit_with_one_line_and_status_2(tmp_path, flags, complaint):
  """Through the real entry point; fast: the flags are parsed before jax is imported or anything is built."""
  proc = subprocess.run([sys.executable, '-m', 'bpd.main', f'--workdir={tmp_path / "run"}', *flags], cwd=REPO,
                        capture_output=True, text=True, timeout=120, env={**os.environ, 'PYTHONPATH': REPO})
  assert proc.returncode == 2, proc.stderr[-2000:]
  assert proc.stderr.strip().count('\n') == 0 and 'Traceback' not in proc.stderr, proc.stderr[-2000:]
  assert proc.stderr.startswith('error: ') and complaint in proc.stderr, proc.stderr
  assert not (tmp_path / 'run').exists()
