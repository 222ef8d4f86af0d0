r"""Pre-flight for a TPU pod, with no TPU: compile a config's train step and decode loop for a TPU topology and
report each chip's memory against its HBM, before anyone pays for the pod.

  pip install -e '.[tpu]'   # libtpu, the TPU compiler (~700 MB); nothing here needs a TPU attached
  python -m experiments.preflight --config=configs/wmt14_ende.py:k=8,regime=finetune --topology=v4:2x2x4

--topology is a topology name as jax.experimental.topologies takes it, GENERATION:SHAPE, e.g. v4:2x2x4 for the 16
chips of a v4-32 slice, v5e:4x4 for a v5litepod-16. What is compiled is what `python -m bpd.main` would run with
this config on that many chips: the train step (model, optimizer state and one global batch of config.train.batch_size
rows padded to data.max_len, sharded as bpd/sharding.py shards them) and the blockwise decode loop (the largest k'
of config.decode.ks at the largest decode batch size, exact acceptance). Per chip, from the compiled program's
memory analysis: arguments + outputs − donated aliases + temporaries + code. Exit status 1 when something does not
fit, 0 otherwise.
"""

import sys

from absl import app
from absl import flags
import jax
import jax.numpy as jnp
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec as P
from ml_collections import config_flags
import numpy as np

from bpd import decoder as decoder_lib
from bpd import decoding
from bpd import errors
from bpd import model as model_lib
from bpd import sharding
from bpd import tasks
from bpd import train
from bpd.data import images
from bpd.errors import UserError
from experiments.tpu_estimate import topology_devices  # UserError naming the [tpu] extra if libtpu is absent

# Flags exist only when this file runs as a script: importing it (tests, another script) defines none, so
# scripts that share flag names (--config) can be imported together.
if __name__ == '__main__':
  _CONFIG = config_flags.DEFINE_config_file('config', None, 'The config that would run on the pod.')
  _TOPOLOGY = flags.DEFINE_string('topology', 'v4:2x2x4', 'TPU topology, GENERATION:SHAPE (v4:2x2x4 = v4-32).')

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
      tree=decoder_lib.chain(k)).compile()
  records.append({'program': f'decode loop, k={k}', 'shape': f'batch {decode_batch} x {decode_src}, '
                  f'max_len {config.decode.max_len}', **per_chip_bytes(compiled)})
  return records


def format_table(records, hbm_bytes: int, title: str = '') -> str:
  gib = lambda b: f'{b / 2**30:.2f}'
  lines = [title] if title else []
  lines += ['| program | shape | arguments | outputs | aliased | temporaries | code | total per device (GiB) | fits |',
            '|---|---|---|---|---|---|---|---|---|']
  for r in records:
    fits = 'yes' if r['total'] <= hbm_bytes else f'**no** (HBM {gib(hbm_bytes)} GiB)'
    lines.append(f"| {r['program']} | {r['shape']} | {gib(r['arguments'])} | {gib(r['outputs'])} | "
                 f"{gib(r['aliased'])} | {gib(r['temporaries'])} | {gib(r['code'])} | {gib(r['total'])} | {fits} |")
  return '\n'.join(lines)


def main(argv):
  del argv
  generation = _TOPOLOGY.value.split(':')[0]
  if generation not in HBM_BYTES:
    raise app.UsageError(f'--topology={_TOPOLOGY.value}: HBM per chip known for {sorted(HBM_BYTES)} only.')
  try:
    devices = topology_devices(_TOPOLOGY.value)
    records = preflight(_CONFIG.value, devices)
  except UserError as e:
    print(f'error: {e}', file=sys.stderr)
    sys.exit(2)
  chips = int(np.prod([int(n) for n in _TOPOLOGY.value.split(':')[1].split('x')]))
  # Some generations list each chip's TensorCores as separate devices (v4 without megacore): they share its HBM.
  hbm = HBM_BYTES[generation] * chips // len(devices)
  print(format_table(records, hbm, (
      f'Compiled for {_TOPOLOGY.value} ({chips} chips, {len(devices)} devices, nothing run); memory per device in '
      f'GiB from XLA\'s memory analysis; HBM {hbm / 2**30:.0f} GiB per device ({generation}: '
      f'{HBM_BYTES[generation] / 2**30:.0f} GiB per chip, published).')))
  sys.exit(0 if all(r['total'] <= hbm for r in records) else 1)


if __name__ == '__main__':
  flags.mark_flags_as_required(['config'])
  app.run(main, flags_parser=errors.parse_flags)
