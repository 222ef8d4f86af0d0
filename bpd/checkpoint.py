"""Checkpoints with orbax: periodic saves, keep the newest N, resume from the latest, save on preemption.

A checkpoint is two items, 'params' and 'opt_state', under {workdir}/checkpoints/{step}. orbax writes
each one into a temporary folder and renames it when complete, so a run killed mid-save (kill -9, a
preempted TPU VM) leaves the previous checkpoints intact and the next run resumes from the newest complete
one. The model's shape (model.json) and the tokenizer (spm.model) sit beside them in the workdir.

Multi-process runs: every process calls save and restore (orbax coordinates them; each process writes and
reads the shards of its own devices); arrays come back laid out like the template's shardings.
"""

import dataclasses
import json
import os
import signal

from absl import logging
from etils import epath
import jax
import orbax.checkpoint as ocp

from bpd import model as model_lib
from bpd import sharding
from bpd.errors import UserError

CHECKPOINT_DIR = 'checkpoints'
ITEMS = ('params', 'opt_state')
MODEL_CONFIG_FILE = 'model.json'


def _absolute(path: str) -> str:
  """orbax wants absolute paths; a gs:// (or other URL) path is left as it is."""
  return path if '://' in path else os.path.abspath(path)


def manager(workdir: str, keep: int = 3) -> ocp.CheckpointManager:
  return ocp.CheckpointManager(_absolute(os.path.join(workdir, CHECKPOINT_DIR)),
                               options=ocp.CheckpointManagerOptions(max_to_keep=keep, create=True))


def save(mngr: ocp.CheckpointManager, step: int, state: dict) -> None:
  """Saves {'params', 'opt_state'} as two items, so that decoding can restore the parameters alone."""
  mngr.save(step, args=ocp.args.Composite(**{name: ocp.args.StandardSave(state[name]) for name in ITEMS}))


def restore(mngr: ocp.CheckpointManager, template: dict, step: int | None = None) -> dict:
  """Restores the newest (or the given) step into arrays shaped like `template` (a dict of some of ITEMS)."""
  step = mngr.latest_step() if step is None else step
  args = {name: ocp.args.StandardRestore(jax.tree.map(ocp.utils.to_shape_dtype_struct, value))
          for name, value in template.items()}
  restored = mngr.restore(step, args=ocp.args.Composite(**args))
  return {name: restored[name] for name in template}


def latest_step(workdir: str) -> int | None:
  path = os.path.join(workdir, CHECKPOINT_DIR)
  if not epath.Path(path).is_dir():
    return None
  return ocp.CheckpointManager(_absolute(path)).latest_step()


def write_model_config(workdir: str, config: model_lib.ModelConfig) -> None:
  tmp = epath.Path(workdir) / (MODEL_CONFIG_FILE + '.tmp')
  tmp.write_text(json.dumps(dataclasses.asdict(config), indent=1))
  tmp.replace(epath.Path(workdir) / MODEL_CONFIG_FILE)


def read_model_config(workdir: str, what: str = '--workdir') -> model_lib.ModelConfig:
  """The ModelConfig a workdir was trained with; UserError if the workdir holds no trained model."""
  path = os.path.join(workdir, MODEL_CONFIG_FILE)
  if not epath.Path(path).exists() or latest_step(workdir) is None:
    raise UserError(f'{what}={workdir!r} holds no trained model ({path} or {workdir}/{CHECKPOINT_DIR}/ is '
                    'missing). Train one there first with --mode=train, or point at the workdir of a run that did.')
  return model_lib.ModelConfig(**json.loads(epath.Path(path).read_text()))


def load_params(workdir: str, what: str = '--workdir', mesh=None) -> tuple[model_lib.ModelConfig, dict, int]:
  """(model config, parameters, step) of the newest checkpoint in a workdir; on `mesh` if given, laid out
  by bpd.sharding's rules (without one: on the default device)."""
  config = read_model_config(workdir, what)
  mngr = manager(workdir)
  step = mngr.latest_step()
  # Shapes only (jax.eval_shape): running the initializers op by op just for a template took ~5 s.
  shapes = jax.eval_shape(lambda: model_lib.init_params(config, jax.random.PRNGKey(0)))
  if mesh is None:
    device = jax.sharding.SingleDeviceSharding(jax.local_devices()[0])
    template = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=device), shapes)
  else:
    template = jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), shapes,
                            sharding.state_sharding(shapes, mesh))
  params = restore(mngr, {'params': template}, step)['params']
  return config, params, step


class PreemptionGuard:
  """Turns SIGTERM / SIGINT into a flag the train loop polls, so it can save a checkpoint and stop cleanly.

  Cloud TPU preemption sends SIGTERM; Ctrl-C sends SIGINT. A second signal is not caught again.
  """

  def __init__(self):
    self.requested = None
    self._previous = {}

  def __enter__(self):
    for sig in (signal.SIGTERM, signal.SIGINT):
      try:
        self._previous[sig] = signal.signal(sig, self._handle)
      except ValueError:  # not the main thread: no handlers, the run just stops where it is
        pass
    return self

  def _handle(self, signum, frame):
    del frame
    logging.warning('Received signal %d: saving a checkpoint and stopping.', signum)
    self.requested = signum
    signal.signal(signum, self._previous.get(signum, signal.SIG_DFL))

  def __exit__(self, *exc):
    for sig, handler in self._previous.items():
      signal.signal(sig, handler)
    return False
