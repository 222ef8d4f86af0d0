"""Where arrays live on the devices: the mesh and every sharding rule of the project, in this one file.

The mesh has two named axes over all devices of all processes:
  data   batch rows. Training, evaluation and decoding batches are split along it; each process holds only
         the rows of its own devices (it computes the same global batch plan from (seed, step) as every
         other process, and keeps its rows: `local_rows`, `shard_batch`).
  model  size `model_axis_size` (config.model_axis_size, default 1). When > 1, the biggest matrices are
         split along it (`param_spec`): the embedding's vocabulary rows (also the output projection) and
         the feed-forward hidden units. Everything else is replicated. With size 1 this is plain data
         parallelism: parameters and optimizer state on every device, gradients all-reduced by XLA.

jax.jit compiles one SPMD program from the shardings of its inputs (GSPMD, the modern replacement for
pmap): the model and the train step are written once, for one device, and run unchanged on 8 devices or a
multi-host pod. After `jax.distributed.initialize()` (bpd/main.py) `jax.devices()` lists every process's
devices; arrays placed here are global arrays that each process holds its shards of.
"""

from collections.abc import Callable

from absl import logging
import jax
from jax.experimental import multihost_utils
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec as P
import numpy as np

from bpd.errors import UserError

DATA, MODEL = 'data', 'model'

# Parameter rules: the trailing names of a parameter's path -> which of its axes goes along 'model'.
# Optimizer moments (Adam's mu and nu) have the same paths below them, so they follow the same rules.
_MODEL_AXIS_RULES = {
    ('embed', 'embedding'): 0,             # [V, D]: vocabulary rows
    ('ff', 'wi', 'kernel'): 1,             # [D, F]: hidden units
    ('ff', 'wi', 'bias'): 0,               # [F]
    ('ff', 'wo', 'kernel'): 0,             # [F, D]
    ('multi_output', 'wi_kernel'): 2,      # [N, D, F]
    ('multi_output', 'wi_bias'): 1,        # [N, F]
    ('multi_output', 'wo_kernel'): 1,      # [N, F, D]
}


def make_mesh(model_axis_size: int = 1, devices=None) -> Mesh:
  """A ('data', 'model') mesh over `devices` (default: every device of every process)."""
  devices = jax.devices() if devices is None else list(devices)
  if model_axis_size < 1 or len(devices) % model_axis_size:
    raise UserError(f'config.model_axis_size={model_axis_size} must be at least 1 and divide the number of '
                    f'devices ({len(devices)}).')
  # Auto axes: jit propagates shardings through the model by itself (explicit axes would need
  # sharding annotations on the model's operations).
  return jax.make_mesh((len(devices) // model_axis_size, model_axis_size), (DATA, MODEL),
                       axis_types=(AxisType.Auto, AxisType.Auto), devices=devices)


def data_size(mesh: Mesh) -> int:
  """Number of batch shards: batch sizes must be a multiple of it."""
  return mesh.shape[DATA]


def param_spec(path, array) -> P:
  """The PartitionSpec of one parameter (or optimizer moment), from its path in the tree (see the rules)."""
  names = tuple(getattr(key, 'key', getattr(key, 'name', None)) for key in path)
  for suffix, axis in _MODEL_AXIS_RULES.items():
    if names[-len(suffix):] == suffix and np.ndim(array) > axis:
      return P(*[MODEL if i == axis else None for i in range(np.ndim(array))])
  return P()


def state_sharding(tree, mesh: Mesh):
  """NamedShardings for a tree of parameters / optimizer state by `param_spec`.

  An axis that the 'model' axis does not divide (e.g. an odd vocabulary) stays replicated.
  """
  def sharding(path, x):
    spec = param_spec(path, x)
    if any(name == MODEL and np.shape(x)[i] % mesh.shape[MODEL] for i, name in enumerate(spec)):
      spec = P()
    return NamedSharding(mesh, spec)
  return jax.tree_util.tree_map_with_path(sharding, tree)


def replicated(mesh: Mesh) -> NamedSharding:
  return NamedSharding(mesh, P())


def put(tree, shardings):
  """Places values that are the same on every process (e.g. fresh parameters) as global arrays.

  Each process fills only its own devices' shards from its host copy, which works across processes, where
  jax.device_put of one host's value cannot reach other hosts' devices. Arrays already spread over
  several processes (e.g. restored ones) are resharded on the devices instead.
  """
  def one(x, sharding):
    if isinstance(x, jax.Array) and not x.is_fully_addressable:
      return jax.device_put(x, sharding)
    x = np.asarray(x)
    return jax.make_array_from_callback(x.shape, sharding, lambda index: x[index])
  return jax.tree.map(one, tree, shardings)


def replicate(tree, mesh: Mesh):
  """A full copy of `tree` (host values, the same on every process) on every device of the mesh."""
  return put(tree, jax.tree.map(lambda _: replicated(mesh), tree))


def place_state(tree, mesh: Mesh):
  """Parameters / optimizer state on the mesh by `param_spec` (replicated when the 'model' axis is 1)."""
  return put(tree, state_sharding(tree, mesh))


def check_batch_size(batch_size: int, mesh: Mesh, field: str = 'config.train.batch_size') -> None:
  if batch_size % data_size(mesh):
    raise UserError(
        f'{field}={batch_size} is not divisible by the number of batch shards ({data_size(mesh)}: '
        f'{mesh.devices.size} devices over {jax.process_count()} process(es), '
        f'config.model_axis_size={mesh.shape[MODEL]}). Every device takes an equal share of each batch: '
        f'choose a multiple of {data_size(mesh)}.')


def decode_batch_size(batch_size: int, mesh: Mesh) -> int:
  """`batch_size` rounded up to a multiple of the data axis (the extra rows are padding, dropped after)."""
  rounded = -(-batch_size // data_size(mesh)) * data_size(mesh)
  if rounded != batch_size:
    logging.info('Decode batch size %d rounded up to %d, a multiple of the %d batch shards.', batch_size,
                 rounded, data_size(mesh))
  return rounded


def local_rows(global_batch_size: int, mesh: Mesh) -> np.ndarray:
  """Indices of the rows of a global batch that this process's devices hold, in the order
  `shard_batch` expects them (its devices' row ranges, ascending)."""
  index_map = NamedSharding(mesh, P(DATA)).addressable_devices_indices_map((global_batch_size,))
  ranges = sorted({index[0].indices(global_batch_size)[:2] for index in index_map.values()})
  return np.concatenate([np.arange(start, stop) for start, stop in ranges])


def shard_batch(local_batch, mesh: Mesh):
  """This process's rows (a pytree of arrays, from `local_rows`) -> global arrays split along 'data'."""
  sharding = NamedSharding(mesh, P(DATA))
  return jax.tree.map(lambda x: jax.make_array_from_process_local_data(sharding, np.asarray(x)), local_batch)


def shard_global_batch(batch, mesh: Mesh):
  """A global batch that every process holds in full (eval and decode batches) -> global arrays."""
  batch_size = len(jax.tree.leaves(batch)[0])
  rows = local_rows(batch_size, mesh)
  return shard_batch(jax.tree.map(lambda x: np.asarray(x)[rows], batch), mesh)


def barrier(name: str) -> None:
  """Waits until every process gets here (nothing to wait for in a single process)."""
  if jax.process_count() > 1:
    multihost_utils.sync_global_devices(name)


def process_zero_first(fn: Callable, name: str):
  """Runs fn() on process 0, then on the others: e.g. process 0 trains the tokenizer, the others load it."""
  if jax.process_index() == 0:
    result = fn()
  barrier(name)
  if jax.process_index() != 0:
    result = fn()
  return result


def any_process(flag: bool) -> bool:
  """True on every process if `flag` is True on any (e.g. a stop signal that reached one host only)."""
  if jax.process_count() == 1:
    return bool(flag)
  return bool(np.any(multihost_utils.process_allgather(np.array(flag))))
