r"""Scale-out benchmarks, one --mode each: throughput against the number of devices, and a TPU pod's memory.

  python -m experiments.bench_scale --mode=throughput                       # tiny model, 1 vs 8 devices
  python -m experiments.bench_scale --mode=throughput --size=small --batch_size=64 --steps=20 --devices=1,2,4,8
  pip install -e '.[tpu]'   # for preflight: libtpu, the TPU compiler (~700 MB); nothing here needs a TPU attached
  python -m experiments.bench_scale --mode=preflight --config=configs/wmt14_ende.py:k=8,regime=finetune \
      --topology=v4:2x2x4

--mode=throughput (the default): training and decoding tokens per second, as a Markdown table. Each device count is
measured in its own subprocess with XLA_FLAGS=--xla_force_host_platform_device_count=N (without it a CPU host shows
JAX one device), on a ('data', 'model') mesh over the first N devices (bpd/sharding.py), so on an accelerator host
the same command compares 1 chip with N. Random weights and random token ids, everything compiled and warmed up
before timing:
  train     the real jitted train step (Adam, all k heads' losses): target tokens per second.
  greedy    bpd.decoder.Decoder greedy decoding: tokens produced (EOS included) per second.
  blockwise bpd.decoder.Decoder blockwise decoding, k heads, exact criterion: tokens produced per second.
Random proposal heads are almost never right (mean accepted block about 1), so blockwise is not faster
than greedy here; this measures how each scales with devices, not the speedup (see experiments/bench_decode.py).
On a CPU host, N fake devices share the same cores: more devices only add communication, so expect them
to be slower there. The table is for real multi-chip hosts.

--mode=preflight: pre-flight for a TPU pod, with no TPU: compile a config's train step and decode loop for a TPU
topology and report each chip's memory against its HBM, before anyone pays for the pod. --topology is a topology
name as jax.experimental.topologies takes it, GENERATION:SHAPE, e.g. v4:2x2x4 for the 16 chips of a v4-32 slice,
v5e:4x4 for a v5litepod-16. What is compiled is what `python -m bpd.main` would run with this config on that many
chips: the train step (model, optimizer state and one global batch of config.train.batch_size rows padded to
data.max_len, sharded as bpd/sharding.py shards them) and the blockwise decode loop (the largest k' of
config.decode.ks at the largest decode batch size, exact acceptance). Per chip, from the compiled program's memory
analysis: arguments + outputs − donated aliases + temporaries + code. Exit status 1 when something does not fit,
0 otherwise.
"""

import json
import os
import statistics
import subprocess
import sys
import time

from absl import app
from absl import flags
import jax
import jax.numpy as jnp
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec as P
import numpy as np

from bpd import decoder as decoder_lib
from bpd import decoding
from bpd import errors
from bpd import model as model_lib
from bpd import report
from bpd import sharding
from bpd import stack
from bpd import tasks
from bpd import train
from bpd.data import images
from bpd.errors import UserError
from bpd.tpu_estimate import topology_devices  # UserError naming the [tpu] extra if libtpu is absent

# Flags exist only when this file runs as a script: importing it (tests, another script) defines none, so
# scripts that share flag names (--config) can be imported together.
if __name__ == '__main__':
  _MODE = flags.DEFINE_enum('mode', 'throughput', ['throughput', 'preflight'], 'What to measure (module docstring).')
  # throughput
  _SIZE = flags.DEFINE_string('size', 'tiny', 'throughput: model size (bpd/model.py SIZES).')
  _VOCAB = flags.DEFINE_integer('vocab_size', 1000, 'throughput: vocabulary size.')
  _K = flags.DEFINE_integer('k', 4, 'throughput: heads of the model; blockwise decoding uses all of them.')
  _BATCH = flags.DEFINE_integer('batch_size', 64, 'throughput: global batch size for training and decoding.')
  _LENGTH = flags.DEFINE_integer('length', 32, 'throughput: source and target length in tokens.')
  _MAX_LEN = flags.DEFINE_integer('max_len', 32, 'throughput: longest decoded output.')
  _STEPS = flags.DEFINE_integer('steps', 10, 'throughput: timed train steps; decoding is timed over --repeats runs.')
  _REPEATS = flags.DEFINE_integer('repeats', 3, 'throughput: timed decoding runs (median reported).')
  _DEVICES = flags.DEFINE_list('devices', ['1', '8'], 'throughput: device counts to compare.')
  _MODEL_AXIS = flags.DEFINE_integer('model_axis_size', 1, "throughput: size of the mesh's 'model' axis.")
  _CHILD = flags.DEFINE_integer('child', 0, 'Internal: measure on this many devices and print one JSON line.')
  # preflight
  _CONFIG = errors.define_config_file('config', None, 'preflight: the config that would run on the pod (required).')
  _TOPOLOGY = flags.DEFINE_string('topology', 'v4:2x2x4', 'preflight: TPU topology, GENERATION:SHAPE '
                                  '(v4:2x2x4 = v4-32).')


# -- --mode=throughput: tokens per second against the number of devices ------------------------------------------

def _median_seconds(fn, repeats):
  times = []
  for _ in range(repeats):
    start = time.perf_counter()
    jax.block_until_ready(fn())
    times.append(time.perf_counter() - start)
  return statistics.median(times)


def measure(num_devices: int) -> dict:
  """Runs in the child process: tokens per second on a mesh over the first `num_devices` devices."""
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
  block = lambda: decoder.blockwise(params, src_BxS, decoding.EXACT, decoding.chain(config.k))
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
  proc = subprocess.run([sys.executable, '-m', 'experiments.bench_scale', *args, f'--child={num_devices}'],
                        env=dict(os.environ, XLA_FLAGS=xla_flags), capture_output=True, text=True)
  if proc.returncode:
    raise SystemExit(f'The {num_devices}-device run failed:\n{proc.stderr[-3000:]}')
  return json.loads(proc.stdout.strip().splitlines()[-1])


def throughput_table(records, command: str) -> str:
  mesh = lambda r: ' x '.join(f'{name} {size}' for name, size in r['mesh'].items())
  columns = [('devices', 'devices', '{}'), (None, 'mesh', mesh), ('train_tokens_per_s', 'train tokens/s', '{:,.0f}'),
             ('greedy_tokens_per_s', 'greedy decode tokens/s', '{:,.0f}'),
             ('blockwise_tokens_per_s', f'blockwise k={_K.value} exact tokens/s', '{:,.0f}'),
             ('mean_accepted_block', 'mean accepted block', '{:.2f}')]
  return (f'`{command}`\n\nmodel {_SIZE.value} (k={_K.value}, vocab {_VOCAB.value}), batch {_BATCH.value}, length '
          f'{_LENGTH.value}, decode max_len {_MAX_LEN.value}, platform {records[0]["platform"]}\n\n'
          + report.markdown_table(records, columns))


def run_throughput():
  if _CHILD.value:
    print(json.dumps(measure(_CHILD.value)))
    return
  records = [run_child(int(n)) for n in _DEVICES.value]
  print(throughput_table(records, ' '.join(['python -m experiments.bench_scale', *sys.argv[1:]])))


# -- --mode=preflight: a config's memory per TPU chip, compiled for the topology, nothing run ----------------------

# Published HBM per chip (Google Cloud TPU documentation, system architecture pages of v4 and v5e).
HBM_BYTES = {'v4': 32 * 2**30, 'v5e': 16 * 2**30, 'v5p': 95 * 2**30, 'v6e': 32 * 2**30}


def per_chip_bytes(compiled) -> dict:
  """Memory of one chip from XLA's memory analysis of a compiled program."""
  m = compiled.memory_analysis()
  parts = {'arguments': m.argument_size_in_bytes, 'outputs': m.output_size_in_bytes,
           'aliased': m.alias_size_in_bytes, 'temporaries': m.temp_size_in_bytes,
           'code': m.generated_code_size_in_bytes}
  parts['total'] = parts['arguments'] + parts['outputs'] - parts['aliased'] + parts['temporaries'] + parts['code']
  return parts


def model_config_of(config) -> model_lib.ModelConfig:
  """The ModelConfig that train.py builds from this config (the vocabulary from config.data.vocab_size)."""
  vocab = images.IMAGE_VOCAB_SIZE if config.data.source == 'images' else config.data.vocab_size
  return model_lib.model_config(config.model.size, vocab_size=vocab,
                                k=1 if config.train.regime == 'base' else config.k,
                                dropout_rate=config.model.dropout_rate, dtype=config.model.dtype,
                                attention_block=config.model.attention_block,
                                **tasks.for_config(config).model_options(config))


def preflight(config, devices) -> list[dict]:
  """[{'program', 'shape', 'arguments', ..., 'total'}] per-chip bytes of the train step and the decode loop."""
  model_axis = config.model_axis_size
  if len(devices) % model_axis:
    raise UserError(f'config.model_axis_size={model_axis} does not divide the {len(devices)} devices of the topology.')
  # A Mesh over the abstract devices as listed (jax.make_mesh insists on one device per v4 chip, megacore mode).
  mesh = Mesh(np.asarray(devices).reshape(len(devices) // model_axis, model_axis), (sharding.DATA, sharding.MODEL),
              axis_types=(AxisType.Auto, AxisType.Auto))
  tc, dc = config.train, config.data
  sharding.check_batch_size(tc.batch_size, mesh)
  model_config = model_config_of(config)
  model = model_lib.Transformer(model_config)
  params = jax.eval_shape(lambda: model_lib.init_params(model_config, jax.random.PRNGKey(0)))
  optimizer = train.make_optimizer(tc.regime, params, tc.learning_rate, tc.warmup_steps,
                                   tc.head_learning_rate)
  state = {'params': params, 'opt_state': jax.eval_shape(optimizer.init, params)}
  state_sharding = sharding.state_sharding(state, mesh)
  abstract = lambda tree, shardings: jax.tree.map(
      lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), tree, shardings)
  rows = NamedSharding(mesh, P(sharding.DATA))
  if dc.source == 'images':
    src_len, tgt_len = images.LOWRES**2 * 3, images.HIGHRES**2 * 3
  else:
    src_len = tgt_len = dc.max_len
  batch = {'src_BxS': jax.ShapeDtypeStruct((tc.batch_size, src_len), jnp.int32, sharding=rows),
           'tgt_BxT': jax.ShapeDtypeStruct((tc.batch_size, tgt_len), jnp.int32, sharding=rows)}
  train_step = train.make_train_step(model, optimizer, seed=config.seed, head_loss=tc.head_loss,
                                     label_smoothing=tc.label_smoothing, state_sharding=state_sharding,
                                     frozen=tc.regime == 'frozen', head1_weight=tc.head1_weight)
  compiled = train_step.lower(abstract(state, state_sharding), batch, jax.ShapeDtypeStruct((), jnp.int32)).compile()
  records = [{'program': 'train step', 'shape': f'batch {tc.batch_size} x {src_len} / {tgt_len}',
              **per_chip_bytes(compiled)}]

  k = max([k for k in config.decode.ks if k <= model_config.k] or [1])
  decode_batch = sharding.decode_batch_size(max(config.decode.batch_sizes), mesh)
  decode_src = dc.max_len if dc.source != 'images' else src_len
  decoder = decoder_lib.Decoder(model, config.decode.max_len, mesh)
  src = jax.ShapeDtypeStruct((decode_batch, decode_src), jnp.int32, sharding=rows)
  # The jitted loop takes the first k heads' parameters (Decoder._heads cuts them once, outside it).
  params_k = jax.eval_shape(lambda p: model_lib.first_heads(model, p, k)[1], params)
  compiled = decoder._blockwise_jit.lower(  # pylint: disable=protected-access  (the jitted loop itself)
      abstract(params_k, state_sharding['params']), src, decoding.EXACT, jax.random.PRNGKey(0),
      tree=decoding.chain(k)).compile()
  records.append({'program': f'decode loop, k={k}', 'shape': f'batch {decode_batch} x {decode_src}, '
                  f'max_len {config.decode.max_len}', **per_chip_bytes(compiled)})
  return records


def format_table(records, hbm_bytes: int, title: str = '') -> str:
  gib = lambda key: lambda r: f'{r[key] / 2**30:.2f}'
  fits = lambda r: 'yes' if r['total'] <= hbm_bytes else f'**no** (HBM {hbm_bytes / 2**30:.2f} GiB)'
  columns = [('program', 'program', '{}'), ('shape', 'shape', '{}')]
  columns += [(None, part, gib(part)) for part in ('arguments', 'outputs', 'aliased', 'temporaries', 'code')]
  columns += [(None, 'total per device (GiB)', gib('total')), (None, 'fits', fits)]
  return (title + '\n' if title else '') + report.markdown_table(records, columns)


def run_preflight():
  if _CONFIG.value is None:
    raise UserError('--mode=preflight needs --config: the config that would run on the pod.')
  generation = _TOPOLOGY.value.split(':')[0]
  if generation not in HBM_BYTES:
    raise app.UsageError(f'--topology={_TOPOLOGY.value}: HBM per chip known for {sorted(HBM_BYTES)} only.')
  devices = topology_devices(_TOPOLOGY.value)
  records = preflight(_CONFIG.value, devices)
  chips = int(np.prod([int(n) for n in _TOPOLOGY.value.split(':')[1].split('x')]))
  # Some generations list each chip's TensorCores as separate devices (v4 without megacore): they share its HBM.
  hbm = HBM_BYTES[generation] * chips // len(devices)
  print(format_table(records, hbm, (
      f'Compiled for {_TOPOLOGY.value} ({chips} chips, {len(devices)} devices, nothing run); memory per device in '
      f'GiB from XLA\'s memory analysis; HBM {hbm / 2**30:.0f} GiB per device ({generation}: '
      f'{HBM_BYTES[generation] / 2**30:.0f} GiB per chip, published).')))
  sys.exit(0 if all(r['total'] <= hbm for r in records) else 1)


def main(argv):
  del argv
  {'throughput': run_throughput, 'preflight': run_preflight}[_MODE.value]()


if __name__ == '__main__':
  stack.raise_stack_limit()  # before anything compiles (bpd/stack.py)
  app.run(lambda argv: errors.exit_on_user_error(main, argv), flags_parser=errors.parse_flags)
