r"""Throughput against the number of devices: training and decoding tokens per second, as a Markdown table.

  python -m experiments.bench_throughput                       # tiny model, 1 vs 8 devices
  python -m experiments.bench_throughput --size=small --batch_size=64 --steps=20 --devices=1,2,4,8

Each device count is measured in its own subprocess with XLA_FLAGS=--xla_force_host_platform_device_count=N
(without it a CPU host shows JAX one device), on a ('data', 'model') mesh over the first N devices
(bpd/sharding.py), so on an accelerator host the same command compares 1 chip with N. Random weights and
random token ids, everything compiled and warmed up before timing:
  train     the real jitted train step (Adam, all k heads' losses): target tokens per second.
  greedy    bpd.decoder.Decoder greedy decoding: tokens produced (EOS included) per second.
  blockwise bpd.decoder.Decoder blockwise decoding, k heads, exact criterion: tokens produced per second.
Random proposal heads are almost never right (mean accepted block about 1), so blockwise is not faster
than greedy here; this measures how each scales with devices, not the speedup (see bench_decode.py).
On a CPU host, N fake devices share the same cores: more devices only add communication, so expect them
to be slower there. The table is for real multi-chip hosts.
"""

import json
import os
import statistics
import subprocess
import sys
import time

from absl import app
from absl import flags
import numpy as np

_SIZE = flags.DEFINE_string('size', 'tiny', 'Model size (bpd/model.py SIZES).')
_VOCAB = flags.DEFINE_integer('vocab_size', 1000, 'Vocabulary size.')
_K = flags.DEFINE_integer('k', 4, 'Heads of the model; blockwise decoding uses all of them.')
_BATCH = flags.DEFINE_integer('batch_size', 64, 'Global batch size for training and decoding.')
_LENGTH = flags.DEFINE_integer('length', 32, 'Source and target length in tokens.')
_MAX_LEN = flags.DEFINE_integer('max_len', 32, 'Longest decoded output.')
_STEPS = flags.DEFINE_integer('steps', 10, 'Timed train steps; decoding is timed over --repeats runs.')
_REPEATS = flags.DEFINE_integer('repeats', 3, 'Timed decoding runs (median reported).')
_DEVICES = flags.DEFINE_list('devices', ['1', '8'], 'Device counts to compare.')
_MODEL_AXIS = flags.DEFINE_integer('model_axis_size', 1, "Size of the mesh's 'model' axis.")
_CHILD = flags.DEFINE_integer('child', 0, 'Internal: measure on this many devices and print one JSON line.')


def _median_seconds(fn, repeats):
  import jax  # pylint: disable=g-import-not-at-top
  times = []
  for _ in range(repeats):
    start = time.perf_counter()
    jax.block_until_ready(fn())
    times.append(time.perf_counter() - start)
  return statistics.median(times)


def measure(num_devices: int) -> dict:
  """Runs in the child process: tokens per second on a mesh over the first `num_devices` devices."""
  import jax  # pylint: disable=g-import-not-at-top
  from bpd import decoder as decoder_lib, decoding, sharding, train  # pylint: disable=g-import-not-at-top
  from bpd import model as model_lib  # pylint: disable=g-import-not-at-top

  if jax.device_count() < num_devices:
    raise SystemExit(f'{num_devices} devices asked for, but JAX sees {jax.device_count()}: {jax.devices()}')
  mesh = sharding.make_mesh(_MODEL_AXIS.value, devices=jax.devices()[:num_devices])
  sharding.check_batch_size(_BATCH.value, mesh, field='--batch_size')
  config = model_lib.model_config(_SIZE.value, vocab_size=_VOCAB.value, k=_K.value, dropout_rate=0.0)
  model = model_lib.Transformer(config)
  rng = np.random.RandomState(0)
  batch_size, length = _BATCH.value, _LENGTH.value
  src_BxS = rng.randint(4, config.vocab_size, (batch_size, length)).astype(np.int32)
  tgt_BxT = rng.randint(4, config.vocab_size, (batch_size, length)).astype(np.int32)

  params = train.fresh_params(config, seed=0)
  optimizer = train.make_optimizer('finetune', params, learning_rate=1e-4, warmup_steps=100)
  state = sharding.place_state({'params': params, 'opt_state': optimizer.init(params)}, mesh)
  train_step = train.make_train_step(model, optimizer, seed=0, head_loss='mean', label_smoothing=0.0,
                                     state_sharding=jax.tree.map(lambda x: x.sharding, state))
  batch = sharding.shard_global_batch({'src_BxS': src_BxS, 'tgt_BxT': tgt_BxT}, mesh)
  state, _ = jax.block_until_ready(train_step(state, batch, 0))  # compile and warm up
  start = time.perf_counter()
  for step in range(1, _STEPS.value + 1):
    state, out = train_step(state, batch, step)
  jax.block_until_ready(out)
  train_seconds = (time.perf_counter() - start) / _STEPS.value

  decoder = decoder_lib.Decoder(model, max_len=_MAX_LEN.value, mesh=mesh)
  params = state['params']
  greedy = lambda: decoder.greedy(params, src_BxS)
  block = lambda: decoder.blockwise(params, src_BxS, decoding.EXACT, decoder_lib.chain(config.k))
  greedy_tokens = int(np.sum(jax.device_get(greedy().length_B)))  # also compiles and warms up
  result = jax.device_get(block())
  block_tokens, block_iterations = int(np.sum(result.length_B)), int(np.sum(result.iterations_B))
  return {
      'devices': num_devices, 'mesh': dict(mesh.shape), 'platform': jax.devices()[0].platform,
      'train_tokens_per_s': batch_size * length / train_seconds,
      'greedy_tokens_per_s': greedy_tokens / _median_seconds(greedy, _REPEATS.value),
      'blockwise_tokens_per_s': block_tokens / _median_seconds(block, _REPEATS.value),
      'mean_accepted_block': block_tokens / max(block_iterations, 1),
  }


def run_child(num_devices: int) -> dict:
  """Measures in a fresh process that sees (at least) `num_devices` CPU devices."""
  xla_flags = f'{os.environ.get("XLA_FLAGS", "")} --xla_force_host_platform_device_count={num_devices}'.strip()
  args = [a for a in sys.argv[1:] if not a.startswith('--child')]
  proc = subprocess.run([sys.executable, '-m', 'experiments.bench_throughput', *args, f'--child={num_devices}'],
                        env=dict(os.environ, XLA_FLAGS=xla_flags), capture_output=True, text=True)
  if proc.returncode:
    raise SystemExit(f'The {num_devices}-device run failed:\n{proc.stderr[-3000:]}')
  return json.loads(proc.stdout.strip().splitlines()[-1])


def table(records, command: str) -> str:
  lines = [f'`{command}`', '',
           f'model {_SIZE.value} (k={_K.value}, vocab {_VOCAB.value}), batch {_BATCH.value}, length {_LENGTH.value}, '
           f'decode max_len {_MAX_LEN.value}, platform {records[0]["platform"]}', '',
           '| devices | mesh | train tokens/s | greedy decode tokens/s | blockwise k=%d exact tokens/s | '
           'mean accepted block |' % _K.value,
           '|---|---|---|---|---|---|']
  for r in records:
    mesh = ' x '.join(f'{name} {size}' for name, size in r['mesh'].items())
    lines.append(f"| {r['devices']} | {mesh} | {r['train_tokens_per_s']:,.0f} | {r['greedy_tokens_per_s']:,.0f} | "
                 f"{r['blockwise_tokens_per_s']:,.0f} | {r['mean_accepted_block']:.2f} |")
  return '\n'.join(lines)


def main(argv):
  del argv
  if _CHILD.value:
    print(json.dumps(measure(_CHILD.value)))
    return
  records = [run_child(int(n)) for n in _DEVICES.value]
  print(table(records, ' '.join(['python -m experiments.bench_throughput', *sys.argv[1:]])))


if __name__ == '__main__':
  app.run(main)
