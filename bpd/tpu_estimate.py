r"""An estimate, without a TPU, of the price of verification on one: compile for a TPU chip, read XLA's costs.

  pip install -e '.[tpu]'   # libtpu, the TPU compiler (~700 MB); nothing here needs a TPU attached
  python -m experiments.bench_decode --config=configs/multi30k_ende.py --tpu=v5e,v4 --tpu_sizes=small,base

bench_decode calls these functions for each (k, batch) row it measures on CPU. One greedy step and one blockwise
iteration (the loop bodies that bench_decode times: decoding.greedy_body / blockwise_body) are lowered with abstract
inputs (jax.ShapeDtypeStruct on one device of a one-chip topology) and compiled by libtpu. Nothing runs. From the
compiled program's cost analysis: FLOPs and bytes accessed. The roofline estimate of each step is
max(FLOPs / peak FLOP/s, bytes / HBM bandwidth) with the published per-chip peaks below; ratio = iteration / greedy
step, the number bench_decode measures on CPU. (The compiler's own 'optimal_seconds' is not used: it came back
negative or zero for some of these steps.)

This is an ESTIMATE: real steps also pay fixed per-op and per-loop-iteration latencies that a roofline ignores, and
which dominate at batch 1 for a model this small, so the real ratio sits between the estimate and 1. XLA's bytes
count every op's operands and outputs: an upper bound on the memory traffic.
"""

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.sharding import SingleDeviceSharding

from bpd import decoding
from bpd import model as model_lib
from bpd.errors import UserError

# Per chip: a topology of that one chip (as jax.experimental.topologies names it) and the published peaks, bf16
# FLOP/s and HBM bytes/s (Google Cloud TPU documentation, "TPU v5e" and "TPU v4" system architecture pages). A v4 chip
# has two TensorCores, which the abstract topology lists as two devices: a step is compiled for one of them, with
# half the chip's peaks (ratios do not depend on that halving; absolute times are those of one TensorCore).
CHIPS = {'v5e': {'topology': 'v5e:1x1', 'flop_s': 197e12, 'byte_s': 819e9},
         'v4': {'topology': 'v4:1x1x1', 'flop_s': 275e12, 'byte_s': 1228e9}}
DTYPE = 'bfloat16'  # what a TPU decodes in: activations and (cast once before the loop) parameters
BOS, NEVER = 2, -1  # as bench_decode: an EOS id that argmax never returns

LIBTPU_MISSING = ("libtpu is not installed: install the optional extra with `pip install -e '.[tpu]'` "
                  '(the TPU compiler; no TPU needed).')


def topology_devices(topology: str, **kwargs) -> list:
  """The devices of an abstract TPU topology (GENERATION:SHAPE); UserError naming the extra if libtpu is absent."""
  try:
    import libtpu  # pylint: disable=g-import-not-at-top,unused-import
  except ImportError as e:
    raise UserError(LIBTPU_MISSING) from e
  from jax.experimental import topologies  # pylint: disable=g-import-not-at-top
  return topologies.get_topology_desc(topology_name=topology, platform='tpu', **kwargs).devices


def chip_device(chip: str):
  """(one device of a one-chip topology of `chip`, devices on that chip); UserError for an unknown chip or no libtpu."""
  if chip not in CHIPS:
    raise UserError(f'--tpu={chip}: published peaks are known for {sorted(CHIPS)} only; name one of those.')
  # The default host bounds (2x2x1 chips) refuse a one-chip topology: say that the host has one chip.
  devices = topology_devices(CHIPS[chip]['topology'], chips_per_host_bounds=(1, 1, 1))
  return devices[0], len(devices)


def cost(jitted, *args, **kwargs) -> dict:
  """{'flops', 'bytes'} of one device from the compiled program's cost analysis (compiled, not run)."""
  analysis = jitted.lower(*args, **kwargs).compile().cost_analysis()
  analysis = analysis[0] if isinstance(analysis, (list, tuple)) else analysis  # older JAX: one dict per device
  return {'flops': float(analysis.get('flops', 0.0)), 'bytes': float(analysis.get('bytes accessed', 0.0))}


def roofline_s(step_cost: dict, chip: str, devices_per_chip: int) -> float:
  """max(FLOPs / peak, bytes / bandwidth) of one step on one device, each peak the chip's / devices_per_chip."""
  peaks = CHIPS[chip]
  return max(step_cost['flops'] * devices_per_chip / peaks['flop_s'],
             step_cost['bytes'] * devices_per_chip / peaks['byte_s'])


def step_cost(config: model_lib.ModelConfig, device, step: str, *, k: int, batch: int, max_len: int, src_len: int,
              cache_len: int, param_dtype: str = 'compute', paths=None) -> dict:
  """cost() of one greedy step (step='greedy'), one k-token blockwise iteration (step='block') or one tree
  iteration (step='tree', the topology `paths` over k heads; cache_len >= max_len + len(paths) + 1) on `device`.

  The model is `config` with DTYPE activations and k heads for an iteration (so that it reads the k - 1 proposal
  heads it uses, as bench_decode's pre-sliced parameters do; 1 head for a greedy step). param_dtype='compute': the
  parameters the loop reads are already in DTYPE, as decode_fns casts them once before the loop; 'float32': the
  training parameters, cast inside every step (what the decoders once did).
  """
  k = 1 if step == 'greedy' else k
  model = model_lib.Transformer(dataclasses.replace(config, k=k, dtype=DTYPE))
  on_device = SingleDeviceSharding(device)
  abstract = lambda tree: jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=on_device), tree)
  params = jax.eval_shape(functools.partial(model_lib.init_params, model.config), jax.random.PRNGKey(0))
  if param_dtype == 'compute':
    params = jax.eval_shape(lambda p: model_lib.params_in_compute_dtype(p, DTYPE), params)
  params = abstract(params)
  fixed = decoding.Fixed(batch_size=batch, max_len=max_len, bos_id=BOS, eos_id=NEVER)
  # One iteration: of the chain with a forced full block (the price of verifying k), or of the tree `paths`.
  tree = decoding.layout(decoding.check_tree(paths, k)) if step == 'tree' else decoding.chain(k)
  rule = decoding.Criterion(min_block=k) if step != 'tree' else decoding.EXACT

  def encode(params, src_BxS):
    return model_lib.decode_fns(model, params).init(src_BxS, cache_len)

  def greedy_step(params, carry):
    score_fn = model_lib.decode_fns(model, params).score
    return decoding.greedy_body(score_fn, fixed=fixed)(carry)

  def block_init(params, state):
    return decoding.blockwise_init(model_lib.decode_fns(model, params), state, fixed=fixed, tree=tree,
                                   rule=rule)

  def block_step(params, s):
    return decoding.blockwise_body(model_lib.decode_fns(model, params), fixed=fixed,
                                   tree=tree, rule=rule)(s)

  state = abstract(jax.eval_shape(encode, params, jax.ShapeDtypeStruct((batch, src_len), jnp.int32)))
  if step == 'greedy':
    carry = jax.eval_shape(lambda s: decoding.greedy_init(s, fixed=fixed), state)
    body = greedy_step
  else:
    carry, body = jax.eval_shape(block_init, params, state), block_step
  # The carry is donated, as a while_loop's is updated in place: otherwise the step copies the KV caches.
  return cost(jax.jit(body, donate_argnums=1), params, abstract(carry))
