"""Data parallelism (bpd/sharding.py): the same numbers on 1 device, 8 devices and two processes.

The pytest process has already started JAX with one CPU device, so the multi-device checks run in
subprocesses with XLA_FLAGS=--xla_force_host_platform_device_count=N. The eight-device checks are
functions of this module (`_worker_*`) that a subprocess runs; the two-process check runs the real entry
point, `python -m bpd.main`, in two processes joined by jax.distributed on 127.0.0.1 (gloo collectives).
"""

import json
import os
import re
import socket
import subprocess
import sys
import tempfile

import jax
import numpy as np
import optax
import pytest

from bpd import checkpoint
from bpd import decoder as decoder_lib
from bpd import decoding
from bpd import model as model_lib
from bpd import sharding
from bpd import train
from bpd.errors import UserError
from configs import demo

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope='module')
def cache_dir(tmp_path_factory):
  """A compilation cache shared by this module's subprocesses: a resumed run does not compile again."""
  return str(tmp_path_factory.mktemp('jax_compilation_cache'))


def _env(devices, cache_dir, **extra):
  # Optimization level 0 compiles 2-3x faster here; every pair of runs compared uses the same flags.
  flags = f'--xla_force_host_platform_device_count={devices} --xla_backend_optimization_level=0'
  return dict(os.environ, JAX_PLATFORMS='cpu', XLA_FLAGS=flags, JAX_COMPILATION_CACHE_DIR=cache_dir, **extra)


def _run_worker(name, cache_dir, devices=8, timeout=240):
  proc = subprocess.run([sys.executable, '-c', f'from tests import test_sharding as t; t.{name}()'], cwd=REPO,
                        env=_env(devices, cache_dir), capture_output=True, text=True, timeout=timeout)
  assert proc.returncode == 0, proc.stderr[-3000:]


# -- rules, in this process --------------------------------------------------------------------------------

def test_param_spec_splits_vocabulary_and_feed_forward_hidden_units_only():
  key = jax.tree_util.DictKey
  P = jax.sharding.PartitionSpec
  path = lambda *names: tuple(key(n) for n in names)
  assert sharding.param_spec(path('embed', 'embedding'), np.zeros((200, 64))) == P('model', None)
  assert sharding.param_spec(path('encoder_layers_0', 'ff', 'wi', 'kernel'), np.zeros((64, 256))) == P(None, 'model')
  assert sharding.param_spec(path('decoder_layers_1', 'ff', 'wo', 'kernel'), np.zeros((256, 64))) == P('model', None)
  assert sharding.param_spec(path('multi_output', 'wi_kernel'), np.zeros((3, 64, 256))) == P(None, None, 'model')
  assert sharding.param_spec(path('decoder_layers_0', 'self_attn', 'query', 'kernel'), np.zeros((64, 4, 16))) == P()
  assert sharding.param_spec(path('decoder_norm', 'scale'), np.zeros(64)) == P()
  assert sharding.param_spec((), np.zeros(())) == P()  # e.g. Adam's step count


# -- eight devices, in a subprocess ------------------------------------------------------------------------

def _tiny_model(k=3, vocab=64):
  config = model_lib.model_config('tiny', vocab_size=vocab, k=k, dropout_rate=0.1, d_model=32, d_ff=64,
                                  num_encoder_layers=1, num_decoder_layers=1)
  return model_lib.Transformer(config), config


def _meshes():
  """One device; eight along 'data'; four along 'data' x two along 'model' (parameters split)."""
  return {'1': sharding.make_mesh(devices=jax.devices()[:1]), '8': sharding.make_mesh(),
          '4x2': sharding.make_mesh(model_axis_size=2)}


def _worker_train_steps_agree():
  assert jax.device_count() == 8
  model, config = _tiny_model()
  rng = np.random.RandomState(0)
  batches = [{'src_BxS': rng.randint(3, config.vocab_size, (16, 12)).astype(np.int32),
              'tgt_BxT': rng.randint(1, config.vocab_size, (16, 12)).astype(np.int32)} for _ in range(3)]
  results = {}
  for name, mesh in _meshes().items():
    params = train.fresh_params(config, seed=0)
    # Plain SGD, not Adam: Adam divides by sqrt(v), so a parameter whose true gradient is zero (attention
    # key biases: softmax ignores a constant shift) moves by +-lr on rounding noise, and rounding differs
    # with the order in which devices' gradients are summed.
    optimizer = optax.sgd(0.5)
    state = sharding.place_state({'params': params, 'opt_state': optimizer.init(params)}, mesh)
    step_fn = train.make_train_step(model, optimizer, seed=0, head_loss='mean', label_smoothing=0.1,
                                    state_sharding=jax.tree.map(lambda x: x.sharding, state))
    rows = sharding.local_rows(16, mesh)
    losses = []
    for step, batch in enumerate(batches):
      state, out = step_fn(state, sharding.shard_batch({n: x[rows] for n, x in batch.items()}, mesh), step)
      losses.append(float(out['loss']))
    if name == '4x2':  # the rules did split the big matrices, and the layout survived the steps
      spec = state['params']['embed']['embedding'].sharding.spec
      assert spec == jax.sharding.PartitionSpec('model', None), spec
    results[name] = (losses, jax.device_get(state['params']))
  for name in ('8', '4x2'):
    np.testing.assert_allclose(results[name][0], results['1'][0], rtol=1e-5, err_msg=name)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5, err_msg=name),
                 results[name][1], results['1'][1])
  assert results['1'][0][0] != results['1'][0][2]  # the steps did train


@pytest.mark.slow
def test_train_steps_on_one_and_eight_devices_agree(cache_dir):
  _run_worker('_worker_train_steps_agree', cache_dir)


def _worker_decoding_agrees():
  model, config = _tiny_model(k=3)
  params = train.fresh_params(config, seed=1)
  rng = np.random.RandomState(1)
  src_ids = [rng.randint(3, config.vocab_size, rng.randint(3, 12)).astype(np.int32) for _ in range(21)]
  outputs = {}
  meshes = _meshes()
  # Not '4x2': split matrices are summed in another order, equal only within float tolerance, so a near
  # tie between two tokens may go the other way.
  for name in ('1', '8'):
    mesh = meshes[name]
    decoder = decoder_lib.Decoder(model, max_len=16, mesh=mesh)
    placed = sharding.place_state(params, mesh)
    batch_size = sharding.decode_batch_size(12, mesh)  # 16 on 8 devices: 21 rows -> 2 batches, 11 padding
    assert batch_size == (12 if name == '1' else 16)
    greedy, _ = decoder_lib.run_batches(lambda src: decoder.greedy(placed, src).tokens_BxL, src_ids, batch_size)
    block, _ = decoder_lib.run_batches(
        lambda src: decoder.blockwise(placed, src, decoding.EXACT, decoding.chain(3)), src_ids, batch_size)
    outputs[name] = (np.stack(greedy), np.stack([o.tokens_BxL for o in block]))
  np.testing.assert_array_equal(outputs['8'][0], outputs['1'][0])
  np.testing.assert_array_equal(outputs['8'][1], outputs['1'][1])
  np.testing.assert_array_equal(outputs['8'][1], outputs['8'][0])  # exact blockwise == greedy
  assert len({tuple(row) for row in outputs['1'][0]}) > 1  # not one output for every source


@pytest.mark.slow
def test_greedy_and_blockwise_decoding_on_eight_devices_match_one(cache_dir):
  _run_worker('_worker_decoding_agrees', cache_dir)


def _worker_batch_size_error():
  config = demo.get_config()
  config.train.batch_size = 12
  with tempfile.TemporaryDirectory() as workdir:
    with pytest.raises(UserError, match=r'config\.train\.batch_size=12 is not divisible .*8 devices'):
      train.train_and_evaluate(config, workdir)


@pytest.mark.slow
def test_batch_size_not_divisible_by_devices_is_a_clear_error(cache_dir):
  _run_worker('_worker_batch_size_error', cache_dir)


# -- two processes through the real entry point ------------------------------------------------------------

FLAGS = ['--config=configs/demo.py', '--config.model.size=tiny', '--config.data.synthetic_train_size=2000',
         '--config.data.vocab_size=200', '--config.data.bucket_lengths=(40,)', '--config.train.batch_size=16',
         '--config.train.eval_every=0', '--config.train.checkpoint_every=3', '--config.train.log_every=1',
         '--config.decode.ks=(1,)', '--config.decode.criteria=("exact",)', '--config.decode.batch_sizes=(8,)',
         '--config.decode.max_examples=12', '--config.decode.max_len=24']


def _free_port():
  with socket.socket() as s:
    s.bind(('127.0.0.1', 0))
    return s.getsockname()[1]


def _main(workdirs, cache_dir, *flags, timeout=240):
  """Runs bpd.main in one process per workdir (joined by jax.distributed if more than one); their logs."""
  port = _free_port()
  multihost = {'BPD_COORDINATOR': f'127.0.0.1:{port}', 'BPD_NUM_PROCESSES': str(len(workdirs))}
  procs = [subprocess.Popen([sys.executable, '-m', 'bpd.main', f'--workdir={workdir}', *FLAGS, *flags], cwd=REPO,
                            # Processes that run at once never share a persistent cache folder: jax writes an
                            # entry in place, and a process reading it meanwhile would load a cut executable.
                            env=(_env(2, os.path.join(cache_dir, f'process{i}'), **multihost, BPD_PROCESS_ID=str(i))
                                 if len(workdirs) > 1 else _env(1, cache_dir)),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
           for i, workdir in enumerate(workdirs)]
  logs = []
  try:
    for proc in procs:
      logs.append(proc.communicate(timeout=timeout)[1])
  finally:
    for proc in procs:
      proc.kill()
  for proc, log in zip(procs, logs):
    assert proc.returncode == 0, log[-3000:]
  return logs


def _assert_same_params(a, b):
  """Equal within float tolerance, except that Adam moves attention key biases on rounding noise alone.

  Their true gradient is zero (softmax ignores a constant shift of its inputs), so the Adam update
  m / sqrt(v) is noise / noise: a step of up to +-learning rate that depends on the order in which the
  devices' gradients were summed. They only stay within the summed learning rates (< 2e-3 here).
  """
  for (path, x), y in zip(jax.tree_util.tree_flatten_with_path(a)[0], jax.tree.leaves(b)):
    key_bias = jax.tree_util.keystr(path).endswith("['key']['bias']")
    np.testing.assert_allclose(x, y, rtol=0, atol=2e-3 if key_bias else 2e-4, err_msg=jax.tree_util.keystr(path))


def _losses(log):
  """{step: training loss} from the progress lines of a log."""
  return {int(step): float(loss) for step, loss in re.findall(r'train (\d+)/\d+ .*\| loss ([0-9.]+)', log)}


@pytest.mark.slow
def test_two_processes_train_resume_and_decode_like_one(tmp_path, cache_dir):
  # Process 1 gets its own workdir that holds only links to process 0's checkpoints, tokenizer and
  # model.json (what a shared file system would show it), so anything process 1 writes shows up there.
  main, other = tmp_path / 'p0', tmp_path / 'p1'
  main.mkdir()
  other.mkdir()
  for name in ('checkpoints', 'spm.model', 'spm.vocab', 'model.json'):
    os.symlink(main / name, other / name)

  first = _main([main, other], cache_dir, '--config.train.num_steps=6')[0]
  assert checkpoint.latest_step(str(main)) == 6
  resumed = _main([main, other], cache_dir, '--config.train.num_steps=9')[0]
  assert 'Resumed from' in resumed and 'at step 6' in resumed
  _main([main, other], cache_dir, '--mode=decode')
  assert sorted(p.name for p in other.iterdir()) == ['checkpoints', 'model.json', 'spm.model', 'spm.vocab']
  assert all(p.is_symlink() for p in other.iterdir())

  single = tmp_path / 'single'  # the same commands in one process, on one device
  single_log = _main([single], cache_dir, '--config.train.num_steps=9')[0]
  _main([single], cache_dir, '--mode=decode')
  losses, single_losses = {**_losses(first), **_losses(resumed)}, _losses(single_log)
  assert sorted(losses) == sorted(single_losses) == list(range(1, 10))
  np.testing.assert_allclose([losses[s] for s in range(1, 10)], [single_losses[s] for s in range(1, 10)], atol=2e-4)
  _assert_same_params(*(jax.device_get(checkpoint.load_params(str(d))[1]) for d in (main, single)))
  for name in ('test.greedy.b8.txt', 'test.k1.exact.b8.txt'):
    assert (main / 'decode' / name).read_text() == (single / 'decode' / name).read_text(), name
  records = [json.loads((d / 'decode' / 'results.json').read_text()) for d in (main, single)]
  assert [(r['criterion'], r['tokens'], r['iterations']) for r in records[0]] == [
      (r['criterion'], r['tokens'], r['iterations']) for r in records[1]]
