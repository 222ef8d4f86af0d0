"""A damaged checkpoint or an interrupted write, through the real entry points on the tiny config: a clear error
when reading, the newest readable step when resuming, nothing lost (docs/results/reliability.md lists the cases).

The damage is what a full disk, a failed copy or a cut file leaves in the newest step: an array file cut to
1000 bytes, a step folder without orbax's commit marker, an array file whose first bytes are garbled (found only
by the restore itself), a missing or cut model.json.
"""

import glob
import json
import os
import shutil
import signal
import subprocess
import sys

import jax
import numpy as np
import pytest

from bpd import checkpoint
from bpd import distill
from bpd import evaluate
from bpd import files
from bpd import metrics
from bpd import train
from bpd.errors import UserError
from tests.test_pipeline import REPO, tiny_config

NEWEST, OLDER = 12, (4, 8)  # the steps of the fixture's model: 12 steps, a checkpoint every 4


@pytest.fixture(scope='module')
def base(tmp_path_factory):
  workdir = str(tmp_path_factory.mktemp('runs') / 'base')
  train.train_and_evaluate(tiny_config(), workdir)
  assert sorted(checkpoint.manager(workdir).all_steps()) == [*OLDER, NEWEST]
  return workdir


def _largest_array_file(step_dir, item='params'):
  return max(glob.glob(os.path.join(step_dir, item, 'ocdbt.process_*', 'd', '*')), key=os.path.getsize)


def _cut(step_dir):
  os.truncate(_largest_array_file(step_dir), 1000)


def _unmark(step_dir):
  os.remove(os.path.join(step_dir, checkpoint.COMMIT_MARKER))


def _garble(step_dir):
  # A data file starts with the first array's zstd frame: zeros there fail its decompression, for certain. The
  # sizes stay right, so only the restore finds it.
  with open(_largest_array_file(step_dir), 'r+b') as f:
    f.write(b'\0' * 64)


DAMAGE = {'cut': (_cut, 'is 1000 bytes'), 'unmarked': (_unmark, 'no commit marker'),
          'garbled': (_garble, 'FAILED_PRECONDITION|DATA_LOSS')}


def _damaged_copy(base, tmp_path, damage):
  workdir = str(tmp_path / 'damaged')
  shutil.copytree(base, workdir)
  step_dir = os.path.join(workdir, checkpoint.CHECKPOINT_DIR, str(NEWEST))
  DAMAGE[damage][0](step_dir)
  return workdir, step_dir


def _files(folder):
  """{relative path: bytes} of every file under folder."""
  return {os.path.relpath(p, folder): open(p, 'rb').read()
          for p in glob.glob(os.path.join(folder, '**'), recursive=True) if os.path.isfile(p)}


def _params(workdir):
  return jax.device_get(checkpoint.load_params(workdir)[1])


@pytest.mark.parametrize('damage', sorted(DAMAGE))
@pytest.mark.parametrize('reader', ['decode', 'distill', 'init_from'])
def test_reading_a_damaged_newest_step_names_it_and_the_readable_steps(base, tmp_path, damage, reader):
  workdir, step_dir = _damaged_copy(base, tmp_path, damage)
  before = _files(step_dir)
  run = {'decode': lambda: evaluate.decode_sweep(tiny_config(), workdir),
         'distill': lambda: distill.distill(tiny_config(), workdir),
         'init_from': lambda: train.train_and_evaluate(
             tiny_config(**{'k': 2, 'train.regime': 'finetune', 'train.init_from': workdir}), str(tmp_path / 'k2'))}
  what = 'config.train.init_from' if reader == 'init_from' else '--workdir'
  with pytest.raises(UserError) as e:
    run[reader]()
  message = str(e.value)
  assert '\n' not in message
  assert message.startswith(f'{what}={workdir}: checkpoint step {NEWEST} cannot be read: ')
  assert any(word in message for word in DAMAGE[damage][1].split('|')), message
  assert f'Readable steps: 4, 8. Use one with --config.checkpoint_step=8, or move {step_dir} ' in message
  assert _files(step_dir) == before  # reading touches nothing


def test_decode_reads_the_step_the_error_suggests(base, tmp_path):
  workdir, step_dir = _damaged_copy(base, tmp_path, 'cut')
  before = _files(step_dir)
  records = evaluate.decode_sweep(tiny_config(checkpoint_step=8), workdir)
  assert {r['step'] for r in records} == {8}
  assert _files(step_dir) == before
  with pytest.raises(UserError, match=r'config\.checkpoint_step=5: .* has no checkpoint step 5; its steps: 4, 8, 12'):
    evaluate.decode_sweep(tiny_config(checkpoint_step=5), workdir)


@pytest.mark.parametrize('damage', sorted(DAMAGE))
def test_resume_sets_the_damaged_step_aside_and_trains_on_from_the_newest_readable(base, tmp_path, damage):
  workdir, step_dir = _damaged_copy(base, tmp_path, damage)
  damaged = _files(step_dir)
  train.train_and_evaluate(tiny_config(), workdir)
  # Moved, not deleted nor overwritten: every byte of the damaged step is kept for the user.
  assert _files(os.path.join(workdir, checkpoint.DAMAGED_DIR, str(NEWEST))) == damaged
  # Resumed from step 8 (the batches depend on the step alone): the same parameters as the undamaged run.
  assert checkpoint.latest_step(workdir) == NEWEST
  jax.tree.map(np.testing.assert_array_equal, _params(workdir), _params(base))


def test_base_training_refuses_a_checkpoint_step(base, tmp_path):
  with pytest.raises(UserError, match=r'config\.checkpoint_step=8 .* a base run resumes from its own newest'):
    train.train_and_evaluate(tiny_config(checkpoint_step=8), str(tmp_path / 'w'))


@pytest.mark.parametrize('damage', ['missing', 'cut'])
def test_a_missing_or_cut_model_json_says_how_to_restore_it(base, tmp_path, damage):
  workdir = str(tmp_path / 'w')
  shutil.copytree(base, workdir)
  path = os.path.join(workdir, checkpoint.MODEL_CONFIG_FILE)
  original = open(path).read()
  if damage == 'missing':
    os.remove(path)
  else:
    os.truncate(path, 20)
  match = 'is missing' if damage == 'missing' else 'cannot be read'
  with pytest.raises(UserError, match=rf'--workdir={workdir}: {path} {match}.*Rerun the training command'):
    evaluate.decode_sweep(tiny_config(), workdir)
  train.train_and_evaluate(tiny_config(), workdir)  # the advice: rewrites model.json, nothing left to train
  assert open(path).read() == original
  assert checkpoint.latest_step(workdir) == NEWEST


@pytest.mark.slow
def test_cli_decode_of_a_damaged_step_is_one_line_and_exit_status_2(base, tmp_path):
  workdir, _ = _damaged_copy(base, tmp_path, 'cut')
  proc = subprocess.run([sys.executable, '-m', 'bpd.main', '--config=configs/demo.py', f'--workdir={workdir}',
                         '--mode=decode'], cwd=REPO, capture_output=True, text=True,
                        timeout=300)
  assert proc.returncode == 2, proc.stderr[-3000:]
  errors = [line for line in proc.stderr.splitlines() if line.startswith('error: ')]
  assert len(errors) == 1 and f'checkpoint step {NEWEST} cannot be read' in errors[0]
  assert 'Traceback' not in proc.stderr


# A decode killed at the moment it replaces results.json: the test's os.replace kills the process (SIGKILL) when
# asked to rename the new results.json into place, after its bytes were written to the temporary file.
_KILL_AT_RESULTS = '''
import os, runpy, signal, sys
rename = os.replace
def replace(src, dst):
  if os.path.basename(dst) == 'results.json':
    os.kill(os.getpid(), signal.SIGKILL)
  rename(src, dst)
os.replace = replace
sys.argv = ['bpd.main'] + sys.argv[1:]
runpy.run_module('bpd.main', run_name='__main__', alter_sys=True)
'''


@pytest.mark.slow
def test_decode_killed_while_writing_results_leaves_the_earlier_results(base, tmp_path):
  workdir = str(tmp_path / 'w')
  shutil.copytree(base, workdir)
  evaluate.decode_sweep(tiny_config(**{'decode.max_examples': 4}), workdir)
  results = os.path.join(workdir, 'decode', 'results.json')
  earlier = open(results, 'rb').read()
  proc = subprocess.run([sys.executable, '-c', _KILL_AT_RESULTS, '--config=configs/demo.py', f'--workdir={workdir}',
                         '--mode=decode', '--config.decode.max_examples=12', '--config.decode.batch_sizes=(8,)',
                         '--config.decode.max_len=24'],
                        cwd=REPO, capture_output=True, text=True, timeout=300)
  assert proc.returncode == -signal.SIGKILL, proc.stderr[-3000:]
  assert open(results, 'rb').read() == earlier
  json.loads(earlier)
  # It was killed mid-write: the new results (of 12 examples, not 4) lie whole in the temporary file.
  (tmp,) = glob.glob(os.path.join(workdir, 'decode', '.results.json.*.tmp'))
  assert {r['examples'] for r in json.loads(earlier)} == {4}
  assert {r['examples'] for r in json.loads(open(tmp).read())} == {12}


def test_write_atomic_keeps_the_old_file_when_the_write_fails(tmp_path, monkeypatch):
  path = str(tmp_path / 'results.json')
  files.write_atomic(path, '[1]')
  def fail(fd):
    raise OSError('No space left on device')
  monkeypatch.setattr(os, 'fsync', fail)
  with pytest.raises(OSError, match='No space'):
    files.write_atomic(path, '[1, 2]')
  assert open(path).read() == '[1]'
  assert os.listdir(tmp_path) == ['results.json']  # no temporary file left behind


def test_metrics_rows_survive_a_line_cut_short(tmp_path):
  path = str(tmp_path / metrics.JSONL)
  files.append_line(path, json.dumps({'step': 1, 'prefix': 'eval', 'loss': 2.0}))
  with open(path, 'a') as f:  # a run killed (or a disk full) while appending
    f.write('{"step": 2, "prefix": "ev')
  assert [r['step'] for r in metrics.read_scalars(str(tmp_path), 'eval')] == [1]
  files.append_line(path, json.dumps({'step': 3, 'prefix': 'eval', 'loss': 1.0}))  # the resumed run goes on
  assert [r['step'] for r in metrics.read_scalars(str(tmp_path), 'eval')] == [1, 3]
