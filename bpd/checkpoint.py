"""Checkpoints with orbax: periodic saves, keep the newest N, resume from the latest, save on preemption.

A checkpoint is two items, 'params' and 'opt_state', under {workdir}/checkpoints/{step}. We rely on orbax's
commit for a save interrupted by the run's end: orbax writes each step into a temporary folder, writes its
commit marker (commit_success.txt) into it and renames it when complete (on object stores, where there is no
rename, the marker alone marks it complete), so a run killed mid-save (kill -9, a preempted TPU VM) leaves the
previous checkpoints intact and the next run resumes from the newest complete one. The model's shape
(model.json) and the tokenizer (spm.model) sit beside them in the workdir.

A step damaged after its save (a full disk, a failed copy of the workdir, a cut file) is found before reading
its arrays (`step_problem`: commit markers, metadata, and the sizes of the array files against the byte ranges
the checkpoint's own index lists) or, failing that, by the restore itself. Reading it for decoding, distillation
or init_from is a UserError that names the step, what is wrong and the readable steps
(config.checkpoint_step picks one); training sets it aside in {workdir}/damaged_checkpoints/ (moved, never
deleted) and resumes from the newest step that reads.

Multi-process runs: every process calls save and restore (orbax coordinates them; each process writes and
reads the shards of its own devices); arrays come back laid out like the template's shardings.
"""

import dataclasses
import json
import os
import posixpath
import re
import signal

from absl import logging
from etils import epath
import jax
import orbax.checkpoint as ocp

from bpd import files
from bpd import model as model_lib
from bpd import sharding
from bpd.errors import UserError

CHECKPOINT_DIR = 'checkpoints'
DAMAGED_DIR = 'damaged_checkpoints'  # steps that training found unreadable, moved out of orbax's sight
ITEMS = ('params', 'opt_state')
MODEL_CONFIG_FILE = 'model.json'
COMMIT_MARKER = 'commit_success.txt'  # orbax writes it last into every step folder and every item folder


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
  files.write_atomic(os.path.join(workdir, MODEL_CONFIG_FILE), json.dumps(dataclasses.asdict(config), indent=1))


def read_model_config(workdir: str, what: str = '--workdir') -> model_lib.ModelConfig:
  """The ModelConfig a workdir was trained with; UserError if the workdir holds no trained model."""
  path = os.path.join(workdir, MODEL_CONFIG_FILE)
  step = latest_step(workdir)
  if step is not None and not epath.Path(path).exists():
    raise UserError(f'{what}={workdir}: {path} is missing, the model shape that training writes beside the '
                    f'checkpoints (newest step {step}). Rerun the training command of that workdir (it rewrites '
                    'model.json from the config, then resumes or stops at once), or copy model.json from a copy of '
                    'the workdir.')
  if step is None:
    raise UserError(f'{what}={workdir!r} holds no trained model ({path} or {workdir}/{CHECKPOINT_DIR}/ is '
                    'missing). Train one there first with --mode=train, or point at the workdir of a run that did.')
  try:
    return model_lib.ModelConfig(**json.loads(epath.Path(path).read_text()))
  except (ValueError, TypeError) as e:  # cut short, or written by a version of bpd with other fields
    raise UserError(f'{what}={workdir}: {path} cannot be read ({type(e).__name__}: {_first_line(e)}). Rerun the '
                    'training command of that workdir (it rewrites model.json from the config, then resumes or stops '
                    'at once), or copy model.json from a copy of the workdir.') from None


# -- damaged steps ---------------------------------------------------------------------------------------------

def _first_line(e, limit: int = 300) -> str:
  text = str(e).strip().split('\n')[0]
  return text if len(text) <= limit else text[:limit] + '...'


def _step_dir(workdir: str, step: int) -> str:
  return os.path.join(workdir, CHECKPOINT_DIR, str(step))


def _uses_markers(workdir: str) -> bool:
  """Whether the orbax that saved here writes commit markers into step folders (versions before it did not, and
  a folder of theirs without one is complete): then a step folder without one is a save or copy cut short."""
  root = epath.Path(workdir) / CHECKPOINT_DIR
  return root.is_dir() and any((p / COMMIT_MARKER).exists() for p in root.iterdir() if p.name.isdigit())


# Where TensorStore's OCDBT index (ts.ocdbt.dump) puts a b-tree node or a value: 'btreenode:BASE:FILE:OFFSET:LENGTH'
# or 'value:BASE:FILE:OFFSET:LENGTH', FILE relative to the folder BASE of the item's folder.
_LOCATION = re.compile(r'^(?:btreenode|value):([^:]*):(.+):(\d+):(\d+)$')


class _UnknownIndex(Exception):
  """An index location in a form _LOCATION does not describe."""


def _ocdbt_problem(item_dir: str) -> str | None:
  """What is wrong with an item's array files, read from its OCDBT index alone (the manifest and the b-tree
  nodes, kilobytes): a file that is missing or shorter than the byte ranges the index says it holds. None if every
  file is long enough, or the item is not in OCDBT format (the restore then finds out)."""
  if not os.path.exists(os.path.join(item_dir, 'manifest.ocdbt')):
    if any(name.startswith('ocdbt.process_') for name in os.listdir(item_dir)):  # the arrays are there, the index not
      return f'{item_dir}/manifest.ocdbt is missing'
    return None
  import tensorstore as ts  # pylint: disable=g-import-not-at-top
  if not hasattr(getattr(ts, 'ocdbt', None), 'dump'):
    return None
  needed = {}  # file (relative to item_dir) -> bytes it must hold

  def need(location):
    match = _LOCATION.match(location)
    if not match:
      raise _UnknownIndex(location)
    path = posixpath.join(match.group(1), match.group(2))
    needed[path] = max(needed.get(path, 0), int(match.group(3)) + int(match.group(4)))

  def short_file():
    for path, end in sorted(needed.items()):
      full = os.path.join(item_dir, path)
      if not os.path.exists(full):
        return f'{full} is missing'
      size = os.path.getsize(full)
      if size < end:
        return f'{full} is {size} bytes, where the checkpoint\'s index puts data up to byte {end} (cut short)'
    return None

  try:
    kvstore = ts.KvStore.open({'driver': 'file', 'path': item_dir.rstrip('/') + '/'}).result()
    versions = ts.ocdbt.dump(kvstore).result().get('versions') or []
    newest = max(versions, key=lambda v: v['generation_number'], default={})
    pending = [newest['root']['location']] if newest.get('root', {}).get('location') else []
    while pending:
      location = pending.pop()
      need(location)
      problem = short_file()  # before reading the node: a cut node file would fail with a less clear error
      if problem:
        return problem
      for entry in ts.ocdbt.dump(kvstore, location).result().get('entries', []):
        if str(entry.get('location', '')).startswith('btreenode:'):
          pending.append(entry['location'])
        elif isinstance(entry.get('indirect_value'), str):
          need(entry['indirect_value'])
  except ValueError as e:  # TensorStore: the manifest or a node cannot be read
    return f'its index {item_dir}/manifest.ocdbt cannot be read ({_first_line(e)})'
  except (_UnknownIndex, KeyError, TypeError, AttributeError):  # a layout this code does not know: the restore decides
    return None
  return short_file()


def step_problem(workdir: str, step: int, items=ITEMS) -> str | None:
  """Why `step` of workdir cannot be read, found without reading its arrays; None if nothing is wrong that way.

  What a cut-short save or copy leaves: no commit marker, an item folder or its metadata missing or cut, an
  array file missing or shorter than the checkpoint's index says. Reads only small files. Damage inside the
  arrays' bytes (a flipped bit) shows only when they are restored.
  """
  step_dir = epath.Path(_step_dir(workdir, step))
  markers = _uses_markers(workdir)
  if markers and not (step_dir / COMMIT_MARKER).exists():
    return f'{step_dir} has no commit marker ({COMMIT_MARKER}): its save or a copy of it did not finish'
  for item in items:
    item_dir = step_dir / item
    if not item_dir.is_dir():
      return f'{item_dir} is missing'
    if markers and not (item_dir / COMMIT_MARKER).exists():
      return f'{item_dir} has no commit marker ({COMMIT_MARKER}): its save or a copy of it did not finish'
    metadata = item_dir / '_METADATA'
    if metadata.exists():
      try:
        json.loads(metadata.read_text())
      except ValueError as e:
        return f'{metadata} is not valid JSON ({_first_line(e)}): cut short?'
    if '://' not in str(item_dir):
      problem = _ocdbt_problem(str(item_dir))
      if problem:
        return problem
  return None


# TensorStore's error codes for files that are missing, cut short or garbled (a tree that does not match the
# template is a plain ValueError of orbax's, without one).
_READ_ERROR = re.compile(r'\b(OUT_OF_RANGE|DATA_LOSS|NOT_FOUND|FAILED_PRECONDITION): ')


def read_failure(e: BaseException) -> str | None:
  """The reason, if the restore's exception `e` says that the checkpoint's files cannot be read; None if it says
  something else (a saved tree that differs from the template, a bug)."""
  seen = set()
  while e is not None and id(e) not in seen:
    seen.add(id(e))
    text = str(e)
    if (isinstance(e, (OSError, json.JSONDecodeError)) or _READ_ERROR.search(text)
        or 'was not found in the checkpoint' in text):
      return _first_line(text)
    e = e.__cause__ or e.__context__
  return None


def _unreadable(workdir: str, what: str, step: int, problem: str, readable: list[int]) -> UserError:
  if readable:
    fix = (f'Readable steps: {", ".join(map(str, readable))}. Use one with --config.checkpoint_step={readable[-1]}, '
           f'or move {_step_dir(workdir, step)} out of {CHECKPOINT_DIR}/ to use the newest readable step.')
  else:
    fix = ('No other step there can be read: train again (--mode=train in that workdir sets unreadable steps '
           f'aside in {DAMAGED_DIR}/ and resumes from the newest readable one).')
  return UserError(f'{what}={workdir}: checkpoint step {step} cannot be read: {problem}. {fix}')


def load_params(workdir: str, what: str = '--workdir', mesh=None,
                step: int = 0) -> tuple[model_lib.ModelConfig, dict, int]:
  """(model config, parameters, step) of the newest checkpoint in a workdir (or of `step`, if not 0; the
  config.checkpoint_step of the caller); on `mesh` if given, laid out by bpd.sharding's rules (without one: on the
  default device). A step that cannot be read is a UserError naming the readable ones."""
  config = read_model_config(workdir, what)
  mngr = manager(workdir)
  steps = sorted(mngr.all_steps())
  if step < 0 or (step and step not in steps):
    raise UserError(f'config.checkpoint_step={step}: {what}={workdir} has no checkpoint step {step}; its steps: '
                    f'{", ".join(map(str, steps))} (0: the newest).')
  step = step or steps[-1]
  problem = step_problem(workdir, step, ('params',))
  if problem is None:
    # Shapes only (jax.eval_shape): running the initializers op by op just for a template took ~5 s.
    shapes = jax.eval_shape(lambda: model_lib.init_params(config, jax.random.PRNGKey(0)))
    if mesh is None:
      device = jax.sharding.SingleDeviceSharding(jax.local_devices()[0])
      template = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=device), shapes)
    else:
      template = jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), shapes,
                              sharding.state_sharding(shapes, mesh))
    try:
      return config, restore(mngr, {'params': template}, step)['params'], step
    except Exception as e:  # pylint: disable=broad-except  (orbax wraps TensorStore's error in a bare Exception)
      problem = read_failure(e)
      if problem is None:
        raise
  readable = [s for s in steps if s != step and step_problem(workdir, s, ('params',)) is None]
  raise _unreadable(workdir, what, step, problem, readable)


def _set_aside(mngr: ocp.CheckpointManager, workdir: str, step: int, problem: str, older: int | None) -> None:
  """Moves an unreadable step to {workdir}/damaged_checkpoints/ (one warning line). Left among the checkpoints,
  orbax would later save over its step number or delete it as an old one; the user decides what to do with it."""
  target = os.path.join(workdir, DAMAGED_DIR, str(step))
  if jax.process_index() == 0:
    os.makedirs(os.path.dirname(target), exist_ok=True)
    n = 1
    while os.path.exists(target):
      n += 1
      target = os.path.join(workdir, DAMAGED_DIR, f'{step}.{n}')
    os.replace(_step_dir(workdir, step), target)
  sharding.barrier(f'set aside step {step}')
  mngr.reload()
  then = f'resuming from step {older}' if older is not None else 'no older step reads: training from step 0'
  logging.warning('Checkpoint step %d in %s cannot be read (%s); moved it to %s (nothing deleted), %s.', step,
                  workdir, problem, target, then)


def newest_intact_step(mngr: ocp.CheckpointManager, workdir: str) -> int | None:
  """The newest step that passes `step_problem` (every item), for resuming; the newer ones that do not are set
  aside (_set_aside). Reads only the steps' small files. None: no step left."""
  steps = sorted(mngr.all_steps(), reverse=True)
  problems = {}
  for step in steps:
    problems[step] = step_problem(workdir, step)
    if problems[step] is None:
      break
  intact = next((s for s in steps if s in problems and problems[s] is None), None)
  for step in steps:
    if problems.get(step) is not None:
      _set_aside(mngr, workdir, step, problems[step], intact)
  return intact


def restore_newest_readable(mngr: ocp.CheckpointManager, workdir: str, template: dict,
                            step: int) -> tuple[dict, int]:
  """(state, step) restored from `step` (from newest_intact_step) or, if its arrays do not read, from the newest
  older step that does, each unreadable one set aside. Only a failed restore leads to reading an older step."""
  while True:
    problem = None
    try:
      state = restore(mngr, template, step)
    except Exception as e:  # pylint: disable=broad-except  (orbax wraps TensorStore's error in a bare Exception)
      problem = read_failure(e)
      if problem is None:
        raise
    # Every process must go on from the same step; each reads its own shards, so one may fail alone.
    if not sharding.any_process(problem is not None):
      return state, step
    older = max((s for s in mngr.all_steps() if s < step and step_problem(workdir, s) is None), default=None)
    _set_aside(mngr, workdir, step, problem or 'another process could not read its shards', older)
    if older is None:
      raise UserError(f'No checkpoint step in {workdir}/{CHECKPOINT_DIR} can be read (each is now in '
                      f'{workdir}/{DAMAGED_DIR}/). Rerun the same command to train from step 0.')
    step = older


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
