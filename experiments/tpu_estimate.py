r"""An estimate, without a TPU, of the price of verification on one: compile for a TPU topology, read XLA's costs.

  pip install -e '.[tpu]'   # libtpu, the TPU compiler (~700 MB); nothing here needs a TPU attached
  python -m experiments.tpu_estimate --config=configs/multi30k_ende.py

One greedy step and one blockwise iteration (the same loop bodies that experiments/bench_decode.py times:
decoding.greedy_body / blockwise_body) are lowered with abstract inputs (jax.ShapeDtypeStruct, parameters
replicated, the batch split over the chips of --topology) and compiled by libtpu for that topology. Nothing runs.
From the compiled program's cost analysis (per chip): FLOPs, bytes accessed, and the TPU compiler's own
'optimal_seconds'. The roofline estimate of each step is max(FLOPs / peak FLOP/s, bytes / HBM bandwidth) with the
published per-chip peaks below; ratio = iteration / greedy step, the number bench_decode measures on CPU.

This is an ESTIMATE: real steps also pay fixed per-op and per-loop-iteration latencies that a roofline ignores, and
which dominate at batch 1 for a model this small, so the real ratio sits between the estimate and 1.
"""

import functools

from absl import app
from absl import flags
import jax
import jax.numpy as jnp
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
from ml_collections import config_flags

from bpd import decoding
from bpd import model as model_lib

_CONFIG = config_flags.DEFINE_config_file('config', None, 'Config file; its model size and vocabulary are used.')
_TOPOLOGY = flags.DEFINE_string('topology', 'v5e:2x2', 'TPU topology to compile for (a key of PEAKS, then :shape).')
_KS = flags.DEFINE_list('ks', ['2', '4', '8'], 'Block sizes k.')
_BATCH_PER_CHIP = flags.DEFINE_list('batch_per_chip', ['1', '8', '32'], 'Rows per chip.')
_DTYPE = flags.DEFINE_string('dtype', 'bfloat16', 'Activation dtype.')
_PARAM_DTYPE = flags.DEFINE_enum('param_dtype', 'compute', ['compute', 'float32'],
                                 "Parameters the loop reads: 'compute' (cast to --dtype once before decoding, as the "
                                 "decoders do) or 'float32' (the training parameters, cast inside every step).")
_MAX_LEN = flags.DEFINE_integer('max_len', 120, 'Cache length is max_len + max(k) + 1.')
_SRC_LEN = flags.DEFINE_integer('src_len', 24, 'Source length.')

# Published per-chip peaks (Google Cloud TPU documentation, "TPU v5e" and "TPU v4" system architecture pages):
# bf16 FLOP/s and HBM bytes/s. A v5e chip is one device (one TensorCore). A v4 chip has two TensorCores, which the
# abstract topology may list as two devices: then each device has about half these peaks, and the absolute times
# below are half what they should be (ratios are unaffected).
PEAKS = {'v5e': (197e12, 819e9), 'v4': (275e12, 1228e9)}
BOS, NEVER = 2, -1

LIBTPU_MISSING = ("libtpu is not installed: install the optional extra with `pip install -e '.[tpu]'` "
                  '(the TPU compiler; no TPU needed).')


def tpu_mesh(topology: str) -> Mesh:
  """A 1-axis ('data') mesh over the chips of an abstract TPU topology; RuntimeError naming the extra if absent."""
  from jax.experimental import topologies  # pylint: disable=g-import-not-at-top
  try:
    devices = topologies.get_topology_desc(topology_name=topology, platform='tpu').devices
  except Exception as e:  # pylint: disable=broad-except  (jax raises several kinds when libtpu is absent)
    raise RuntimeError(f'{LIBTPU_MISSING} ({type(e).__name__}: {e})') from e
  return Mesh(devices, ('data',))


def cost(jitted, *args, **kwargs):
  """{'flops', 'bytes', 'optimal_s'} per chip from the compiled program's cost analysis."""
  analysis = jitted.lower(*args, **kwargs).compile().cost_analysis()
  analysis = analysis[0] if isinstance(analysis, (list, tuple)) else analysis
  return {'flops': float(analysis.get('flops', 0.0)), 'bytes': float(analysis.get('bytes accessed', 0.0)),
          'optimal_s': float(analysis.get('optimal_seconds', float('nan')))}


def estimate(model, mesh, k_values, batches_per_chip, max_len, src_len, peak_flop_s, peak_byte_s):
  """Records {k, batch_per_chip, greedy_*, block_*, ratio_roofline, ratio_optimal} for an abstract TPU mesh."""
  cache_len = max_len + max(k_values) + 1
  replicated = NamedSharding(mesh, P())
  by_row = NamedSharding(mesh, P('data'))
  chips = mesh.devices.size
  params = jax.eval_shape(functools.partial(model_lib.init_params, model.config), jax.random.PRNGKey(0))
  if _PARAM_DTYPE.value == 'compute':  # what the decoders do: cast once, outside the loop (model.decode_fns)
    params = jax.eval_shape(lambda p: model_lib.params_in_compute_dtype(p, model.config.dtype), params)
  params = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=replicated), params)

  def abstract(tree):  # leading dim = rows: split over the chips; scalars replicated
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=by_row if x.ndim else replicated),
                        tree)

  def encode(params, src):
    return model_lib.decode_fns(model, params)[0](src, cache_len)

  def greedy_step(params, carry):
    _, score_fn, _ = model_lib.decode_fns(model, params)
    return decoding.greedy_body(score_fn, eos_id=NEVER)(carry)

  def block_init(params, state, k):
    _, score_fn, propose_fn = model_lib.decode_fns(model, params, num_heads=k)
    return decoding.blockwise_init(score_fn, propose_fn, state, batch_size=state['src_mask_BxS'].shape[0], k=k,
                                   max_len=max_len, bos_id=BOS)

  def block_step(params, s, k):
    _, score_fn, propose_fn = model_lib.decode_fns(model, params, num_heads=k)
    return decoding.blockwise_body(score_fn, propose_fn, k=k, max_len=max_len, eos_id=NEVER,
                                   criterion=decoding.Criterion(min_block=k))(s)

  roof = lambda c: max(c['flops'] / peak_flop_s, c['bytes'] / peak_byte_s)
  records = []
  for per_chip in batches_per_chip:
    batch = per_chip * chips
    src = jax.ShapeDtypeStruct((batch, src_len), jnp.int32, sharding=by_row)
    state = abstract(jax.eval_shape(encode, params, src))
    carry = abstract(jax.eval_shape(lambda s: decoding.greedy_init(s, batch_size=batch, max_len=max_len, bos_id=BOS),
                                    state))
    # The carry is donated, as a while_loop's is updated in place: otherwise the step copies the KV caches.
    greedy = cost(jax.jit(greedy_step, donate_argnums=1), params, carry)
    for k in k_values:
      s = abstract(jax.eval_shape(functools.partial(block_init, k=k), params, state))
      block = cost(jax.jit(block_step, static_argnames='k', donate_argnums=1), params, s, k=k)
      records.append({'k': k, 'batch_per_chip': per_chip, 'chips': chips,
                      **{f'greedy_{n}': v for n, v in greedy.items()}, **{f'block_{n}': v for n, v in block.items()},
                      'greedy_roofline_s': roof(greedy), 'block_roofline_s': roof(block),
                      'ratio_roofline': roof(block) / roof(greedy),
                      'ratio_optimal': block['optimal_s'] / greedy['optimal_s']})
  return records


def format_table(records, title=''):
  lines = [title] if title else []
  lines += ['| k | batch per chip | greedy step est. (µs) | iteration est. (µs) | ratio est. (roofline) | '
            'ratio (XLA optimal_seconds) | GFLOP greedy / iter | MB greedy / iter |',
            '|---|---|---|---|---|---|---|---|']
  for r in records:
    lines.append(f"| {r['k']} | {r['batch_per_chip']} | {1e6 * r['greedy_roofline_s']:.1f} | "
                 f"{1e6 * r['block_roofline_s']:.1f} | {r['ratio_roofline']:.2f} | {r['ratio_optimal']:.2f} | "
                 f"{r['greedy_flops'] / 1e9:.4f} / {r['block_flops'] / 1e9:.4f} | "
                 f"{r['greedy_bytes'] / 1e6:.1f} / {r['block_bytes'] / 1e6:.1f} |")
  return '\n'.join(lines)


def main(argv):
  del argv
  config = _CONFIG.value
  k_values = [int(k) for k in _KS.value]
  generation = _TOPOLOGY.value.split(':')[0]
  if generation not in PEAKS:
    raise app.UsageError(f'--topology={_TOPOLOGY.value}: published peaks known for {sorted(PEAKS)} only.')
  model_config = model_lib.model_config(config.model.size, vocab_size=config.data.vocab_size, k=max(k_values),
                                        dropout_rate=0.0, dtype=_DTYPE.value)
  mesh = tpu_mesh(_TOPOLOGY.value)
  peak_flop_s, peak_byte_s = PEAKS[generation]
  records = estimate(model_lib.Transformer(model_config), mesh, k_values, [int(b) for b in _BATCH_PER_CHIP.value],
                     _MAX_LEN.value, _SRC_LEN.value, peak_flop_s, peak_byte_s)
  c = model_config
  print(format_table(records, (
      f'ESTIMATE (compiled for {_TOPOLOGY.value}, {mesh.devices.size} devices, nothing run): model '
      f'{config.model.size}, d={c.d_model}, {c.num_decoder_layers} decoder layers, vocab {c.vocab_size}, '
      f'{c.dtype} activations; per device {peak_flop_s / 1e12:.0f} TFLOP/s bf16, {peak_byte_s / 1e9:.0f} GB/s HBM '
      '(published peaks)')))


if __name__ == '__main__':
  flags.mark_flags_as_required(['config'])
  app.run(main)
