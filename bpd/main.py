r"""Command line: train, distill and decode.

  python -m bpd.main --config=configs/NAME.py[:ARGS] --workdir=DIR [--mode=train|distill|decode] \
      [--config.FIELD=VALUE ...]

train    trains, resuming from the newest checkpoint in DIR (configs/common.py lists the fields).
distill  translates the training sources with the model in DIR (beam search) into DIR/distill/.
decode   decodes the evaluation splits with greedy and every blockwise setting; writes DIR/decode/.
Glue only: the work is in bpd.train, bpd.distill and bpd.evaluate.

Multi-host (e.g. a TPU pod: every host runs the same command): --multihost or BPD_MULTIHOST=1 calls
jax.distributed.initialize(), which finds the other hosts by itself on Cloud TPU. Elsewhere (e.g. several
processes on one CPU machine, as the tests do) set BPD_COORDINATOR=HOST:PORT, BPD_NUM_PROCESSES=N and
BPD_PROCESS_ID=I in each process; BPD_COORDINATOR alone switches multi-host on.
"""

import os

from absl import app
from absl import flags
from absl import logging
from ml_collections import config_flags

from bpd import errors
from bpd import stack

_CONFIG = config_flags.DEFINE_config_file('config', None, 'Config file, e.g. configs/demo.py.')
_WORKDIR = flags.DEFINE_string('workdir', None, 'Folder for checkpoints, logs and results.')
_MODE = flags.DEFINE_enum('mode', 'train', ['train', 'distill', 'decode'], 'What to do.')
_MULTIHOST = flags.DEFINE_bool(
    'multihost', os.environ.get('BPD_MULTIHOST') == '1' or 'BPD_COORDINATOR' in os.environ,
    'Call jax.distributed.initialize() first (every host runs the same command). Default: the environment '
    'variable BPD_MULTIHOST=1 (or BPD_COORDINATOR set).')


def _initialize_distributed():
  """jax.distributed.initialize(), told the coordinator, process count and id by BPD_* variables if set."""
  import jax  # pylint: disable=g-import-not-at-top
  kwargs = {}
  if 'BPD_COORDINATOR' in os.environ:
    kwargs['coordinator_address'] = os.environ['BPD_COORDINATOR']
  if 'BPD_NUM_PROCESSES' in os.environ:
    kwargs['num_processes'] = int(os.environ['BPD_NUM_PROCESSES'])
  if 'BPD_PROCESS_ID' in os.environ:
    kwargs['process_id'] = int(os.environ['BPD_PROCESS_ID'])
  jax.distributed.initialize(**kwargs)
  if jax.process_index() != 0:  # one copy of the progress lines; warnings and errors still show everywhere
    logging.set_verbosity(logging.WARNING)


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f'Unexpected arguments: {argv[1:]}')
  if _MULTIHOST.value:
    _initialize_distributed()
  from bpd import distill, evaluate, metrics, train  # pylint: disable=g-import-not-at-top
  metrics.quiet_library_logs()
  config, workdir = _CONFIG.value, _WORKDIR.value
  run = {'train': train.train_and_evaluate, 'distill': distill.distill, 'decode': evaluate.decode_sweep}
  errors.exit_on_user_error(run[_MODE.value], config, workdir)


if __name__ == '__main__':
  stack.raise_stack_limit()  # before anything compiles (bpd/stack.py)
  flags.mark_flags_as_required(['config', 'workdir'])
  app.run(main, flags_parser=errors.parse_flags)  # a bad flag or config argument: one line, status 2
