"""Tests of launch/: tpu_pod.sh and run_on_host.sh against stand-ins for gcloud and python, and sweep.py.

The stand-in gcloud records its arguments. With FAKE_REMOTE_HOME set it also plays a one-worker TPU VM:
`ssh --command=C` runs C with bash in that folder (the remote home), `scp` copies to and from it. So a
command goes through every layer of quoting that it would on a pod, down to the stand-in bpd.main.
"""

import json
import os
import shlex
import shutil
import subprocess
import sys
import time
import types

import pytest

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LAUNCH = os.path.join(REPO_ROOT, 'launch')
TPU_POD = os.path.join(LAUNCH, 'tpu_pod.sh')
RUN_ON_HOST = os.path.join(LAUNCH, 'run_on_host.sh')
SWEEP = os.path.join(LAUNCH, 'sweep.py')

FAKE_GCLOUD = f'''#!{sys.executable}
import json, os, shutil, subprocess, sys

args = sys.argv[1:]
with open(os.environ['FAKE_GCLOUD_LOG'], 'a') as f:
  f.write(json.dumps(args) + '\\n')
home = os.environ.get('FAKE_REMOTE_HOME')
if not home:
  sys.exit(0)

def local(path):  # NAME:path is a path on the worker, relative to its home
  host, sep, rest = path.partition(':')
  return os.path.join(home, rest) if sep and not host.startswith('/') else path

if 'ssh' in args:
  command = next(a for a in args if a.startswith('--command=')).split('=', 1)[1]
  sys.exit(subprocess.run(['bash', '-c', command], cwd=home, env={{**os.environ, 'HOME': home}}).returncode)
if 'scp' in args:
  *sources, dest = [local(a) for a in args[args.index('scp') + 1:] if not a.startswith('--')]
  for src in sources:
    target = os.path.join(dest, os.path.basename(src)) if os.path.isdir(dest) else dest
    if os.path.isdir(src):
      shutil.copytree(src, target)
    else:
      shutil.copyfile(src, target)
'''

# Stands in for `python` (raw argv `-m bpd.main ARGS` or `-m pip ...`) and for BPD_MAIN (argv = ARGS).
# decode writes WORKDIR/decode/results.json (only inside the test's tmp folder): a greedy row and one 'exact' row
# per k in decode.ks.
FAKE_MAIN = f'''#!{sys.executable}
import ast, json, os, sys

raw = sys.argv[1:]
with open(os.environ['FAKE_MAIN_LOG'], 'a') as f:
  f.write(json.dumps({{'raw': raw, 'cwd': os.getcwd(), 'multihost': os.environ.get('BPD_MULTIHOST')}}) + '\\n')
if raw[:2] == ['-m', 'pip']:
  sys.exit(0)
args = raw[2:] if raw[:2] == ['-m', 'bpd.main'] else raw
flags = dict(a[2:].split('=', 1) for a in args if a.startswith('--') and '=' in a)
if os.environ.get('FAKE_FAIL') and os.environ['FAKE_FAIL'] in ' '.join(args):
  sys.exit(3)
workdir = os.path.abspath(flags.get('workdir', '/'))
if not workdir.startswith(os.environ['FAKE_SANDBOX'] + os.sep):  # e.g. run from the repo root: write nothing
  sys.exit(0)
os.makedirs(workdir, exist_ok=True)
if flags['mode'] == 'decode':
  ks = ast.literal_eval(flags.get('config.decode.ks', '(2,)'))
  k_model = int(flags.get('config.k', 8))
  rows = [dict(split='val', k=1, criterion='greedy', batch_size=32, quality=20.0, mean_accepted_block_size=1.0,
               iterations=100, invocations=100, tokens=100, seconds=2.0, greedy_seconds=2.0, speedup=1.0,
               identical_to_greedy=True)]
  for k in ks:
    block = min(k, k_model) * 0.75
    rows.append(dict(rows[0], k=k, criterion='exact', mean_accepted_block_size=block, seconds=2.0 / block,
                     speedup=block, iterations=int(100 / block)))
  os.makedirs(os.path.join(workdir, 'decode'), exist_ok=True)
  with open(os.path.join(workdir, 'decode', 'results.json'), 'w') as f:
    json.dump(rows, f)
'''

POD_ENV = {'BPD_TPU_NAME': 'bpd-test', 'BPD_ZONE': 'us-central2-b', 'BPD_PROJECT': 'my-project'}
ZONE_PROJECT = ['--zone=us-central2-b', '--project=my-project']
# Arguments that must reach bpd.main unchanged through ssh and two shells.
TRICKY_ARGS = [
    '--config=configs/multi30k_ende.py:k=4,regime=frozen', '--workdir=runs/with space', '--mode=decode',
    '--config.decode.ks=(2,4)', "--config.decode.criteria=('exact', 'top_k:2')", '--config.data.dir=$HOME/x;ls *',
    '--config.train.init_from="quoted"']


def write_script(path, text):
  with open(path, 'w') as f:
    f.write(text)
  os.chmod(path, 0o755)
  return str(path)


@pytest.fixture
def fake(tmp_path):
  """Paths of the stand-ins and an environment that finds them first on PATH and has a fresh HOME."""
  bin_dir = tmp_path / 'bin'
  bin_dir.mkdir()
  write_script(bin_dir / 'gcloud', FAKE_GCLOUD)
  main = write_script(bin_dir / 'python', FAKE_MAIN)  # `python -m bpd.main` of run_on_host.sh
  write_script(bin_dir / 'sudo', '#!/bin/sh\necho "fake sudo: not expected here: $*" >&2\nexit 1\n')
  home = tmp_path / 'home'
  home.mkdir()
  env = {k: v for k, v in os.environ.items() if not k.startswith(('BPD_', 'TPU_', 'CLOUD_TPU_', 'FAKE_'))}
  env.update(POD_ENV, PATH=f'{bin_dir}:{os.environ["PATH"]}', HOME=str(home),
             FAKE_GCLOUD_LOG=str(tmp_path / 'gcloud.log'), FAKE_MAIN_LOG=str(tmp_path / 'main.log'),
             FAKE_SANDBOX=str(tmp_path))
  return types.SimpleNamespace(env=env, main=main, home=home, tmp=tmp_path)


def read_lines(path):
  if not os.path.exists(path):
    return []
  with open(path) as f:
    return [json.loads(line) for line in f]


def gcloud_calls(fake):
  return read_lines(fake.env['FAKE_GCLOUD_LOG'])


def main_calls(fake):
  return read_lines(fake.env['FAKE_MAIN_LOG'])


def flag(call, name):
  values = [a.split('=', 1)[1] for a in call if a.startswith(f'--{name}=')]
  assert len(values) == 1, (name, call)
  return values[0]


def run(cmd, env, cwd=None, check=True):
  result = subprocess.run(cmd, env=env, cwd=cwd, capture_output=True, text=True, timeout=60)
  if check and result.returncode != 0:
    raise AssertionError(f'{cmd} failed ({result.returncode}):\n{result.stdout}\n{result.stderr}')
  return result


def make_remote_home(fake):
  """Plays the worker: the remote home holds the repo's launch/ scripts under bpd/."""
  shutil.copytree(LAUNCH, fake.home / 'bpd' / 'launch')
  fake.env.update(FAKE_REMOTE_HOME=str(fake.home), BPD_SKIP_INSTALL='1', BPD_PYTHON=fake.main)


# ------------------------------------------------------------------------------------------------ tpu_pod.sh


def test_create_names_accelerator_runtime_zone_and_project(fake):
  fake.env.update(BPD_CREATE_FLAGS='--spot --description=bpd run')
  run([TPU_POD, 'create'], fake.env)
  assert gcloud_calls(fake) == [[
      'compute', 'tpus', 'tpu-vm', 'create', 'bpd-test', '--accelerator-type=v4-32',
      '--version=tpu-ubuntu2204-base', '--spot', '--description=bpd', 'run', *ZONE_PROJECT]]


def test_create_takes_accelerator_and_version_from_env(fake):
  fake.env.update(BPD_ACCELERATOR='v5litepod-16', BPD_TPU_VERSION='v2-alpha-tpuv5-lite')
  result = run([TPU_POD, 'create'], fake.env)
  [call] = gcloud_calls(fake)
  assert flag(call, 'accelerator-type') == 'v5litepod-16' and flag(call, 'version') == 'v2-alpha-tpuv5-lite'
  assert '+ gcloud compute tpus tpu-vm create bpd-test' in result.stderr  # printed before it runs


def test_setup_copies_local_repo_to_all_workers_and_installs_with_jax_tpu(fake):
  repo = fake.tmp / 'repo'
  shutil.copytree(LAUNCH, repo / 'launch')
  (repo / 'setup.py').write_text('# stand-in\n')
  for unwanted in ('.git', 'runs', 'bpd/__pycache__'):
    (repo / unwanted).mkdir(parents=True)
    (repo / unwanted / 'x').write_text('x')
  venv = fake.tmp / 'venv'
  (venv / 'bin').mkdir(parents=True)
  write_script(venv / 'bin' / 'python', FAKE_MAIN)  # records the pip calls
  fake.env.update(BPD_REPO=str(repo), FAKE_REMOTE_HOME=str(fake.home), BPD_VENV=str(venv))

  run([TPU_POD, 'setup'], fake.env)

  scp, ssh = gcloud_calls(fake)
  assert scp[:4] == ['compute', 'tpus', 'tpu-vm', 'scp'] and scp[5] == 'bpd-test:bpd-repo.tar.gz'
  assert ssh[:5] == ['compute', 'tpus', 'tpu-vm', 'ssh', 'bpd-test']
  for call in (scp, ssh):
    assert '--worker=all' in call and call[-2:] == ZONE_PROJECT
  remote = fake.home / 'bpd'
  assert (remote / 'setup.py').exists() and (remote / 'launch' / 'run_on_host.sh').exists()
  assert not any((remote / d).exists() for d in ('.git', 'runs', 'bpd/__pycache__'))
  assert not (fake.home / 'bpd-repo.tar.gz').exists()
  pip_calls = [c['raw'] for c in main_calls(fake)]
  assert pip_calls == [
      ['-m', 'pip', 'install', '-q', '--upgrade', 'pip'],
      ['-m', 'pip', 'install', '-q', '-e', '.', 'jax[tpu]', '-f',
       'https://storage.googleapis.com/jax-releases/libtpu_releases.html']]


def test_setup_clones_a_git_url_and_can_mount_a_bucket(fake):
  fake.env.update(BPD_REPO='https://github.com/someone/bpd.git', BPD_BUCKET='my-bucket')
  run([TPU_POD, 'setup'], fake.env)
  [ssh] = gcloud_calls(fake)
  assert ssh[3:5] == ['ssh', 'bpd-test'] and '--worker=all' in ssh
  command = flag(ssh, 'command')
  assert 'git clone https://github.com/someone/bpd.git bpd' in command
  assert 'gcsfuse --implicit-dirs --rename-dir-limit=1000000 my-bucket ~/bpd-runs' in command
  assert 'BPD_INSTALL_ONLY=1 bpd/launch/run_on_host.sh' in command
  assert subprocess.run(['bash', '-n', '-c', command]).returncode == 0  # parses as a shell script


@pytest.mark.parametrize('foreground', [True, False])
def test_run_passes_arguments_verbatim_to_bpd_main_on_all_workers(fake, foreground):
  make_remote_home(fake)
  if foreground:
    fake.env['BPD_FOREGROUND'] = '1'
  run([TPU_POD, 'run', *TRICKY_ARGS], fake.env)

  [ssh] = gcloud_calls(fake)
  assert ssh[3:5] == ['ssh', 'bpd-test'] and '--worker=all' in ssh and ssh[-2:] == ZONE_PROJECT
  command = flag(ssh, 'command')
  if not foreground:
    assert 'nohup launch/run_on_host.sh' in command and '> ~/bpd.log 2>&1' in command
    deadline = time.time() + 20  # the run goes on in the background
    while not main_calls(fake) and time.time() < deadline:
      time.sleep(0.05)
    assert (fake.home / 'bpd.pid').exists()
  [call] = main_calls(fake)
  assert call['raw'] == ['-m', 'bpd.main', *TRICKY_ARGS]
  assert call['cwd'] == str(fake.home / 'bpd')
  assert call['multihost'] == '1'


def test_run_refuses_while_a_background_run_is_going(fake):
  make_remote_home(fake)
  (fake.home / 'bpd.pid').write_text(f'{os.getpid()}\n')  # a live process
  result = run([TPU_POD, 'run', '--workdir=runs/x'], fake.env, check=False)
  assert result.returncode != 0 and 'a run is still going' in result.stderr
  assert main_calls(fake) == []


def test_wait_returns_once_the_background_run_has_ended(fake):
  make_remote_home(fake)
  run([TPU_POD, 'run', '--workdir=runs/x', '--mode=train'], fake.env)
  pid = int((fake.home / 'bpd.pid').read_text())
  deadline = time.time() + 20  # wait polls every 30 s: let the (short) run end first
  while time.time() < deadline:
    try:
      os.kill(pid, 0)
    except ProcessLookupError:
      break
    time.sleep(0.05)
  result = run([TPU_POD, 'wait'], fake.env)
  assert 'no run going; the end of ~/bpd.log:' in result.stdout
  assert 'run_on_host:' in result.stdout  # the log's last lines
  assert '--worker=all' in gcloud_calls(fake)[-1] and len(main_calls(fake)) == 1


def test_logs_stop_fetch_copy_status_delete(fake):
  for args in (['logs'], ['logs', '3'], ['stop'], ['fetch', 'runs/a/decode/results.json', 'out/r.json'],
               ['copy', '../shared/data/multi30k', '../shared/data'], ['status'], ['delete']):
    run([TPU_POD, *args], fake.env, cwd=fake.tmp)
  logs, logs3, stop, fetch, copy_mkdir, copy, status, delete = gcloud_calls(fake)
  assert logs[3:5] == ['ssh', 'bpd-test'] and '--worker=0' in logs and 'tail' in flag(logs, 'command')
  assert '~/bpd.log' in flag(logs, 'command') and '--worker=3' in logs3
  assert '--worker=all' in stop and 'kill' in flag(stop, 'command') and '~/bpd.pid' in flag(stop, 'command')
  assert fetch[3:] == ['scp', '--recurse', 'bpd-test:bpd/runs/a/decode/results.json', 'out/r.json',
                       '--worker=0', *ZONE_PROJECT]
  assert (fake.tmp / 'out').is_dir()  # made for the fetched file
  assert flag(copy_mkdir, 'command') == 'mkdir -p bpd/../shared/data' and '--worker=all' in copy_mkdir
  assert copy[3:] == ['scp', '--recurse', '../shared/data/multi30k', 'bpd-test:bpd/../shared/data/',
                      '--worker=all', *ZONE_PROJECT]
  assert status[3:] == ['describe', 'bpd-test', *ZONE_PROJECT]
  assert delete[3:] == ['delete', 'bpd-test', '--quiet', *ZONE_PROJECT]


@pytest.mark.parametrize('missing', sorted(POD_ENV))
def test_missing_env_var_fails_naming_it(fake, missing):
  del fake.env[missing]
  result = run([TPU_POD, 'create'], fake.env, check=False)
  assert result.returncode != 0 and missing in result.stderr
  assert gcloud_calls(fake) == []


def test_unknown_subcommand_prints_usage(fake):
  result = run([TPU_POD, 'launch'], fake.env, check=False)
  assert result.returncode == 2 and "unknown subcommand 'launch'" in result.stderr
  assert 'tpu_pod.sh run ARGS' in result.stderr


# ------------------------------------------------------------------------------------------------ run_on_host.sh


@pytest.mark.parametrize('env, args, multihost', [
    ({}, [], None),
    ({'TPU_WORKER_ID': '2'}, [], '1'),
    ({'CLOUD_TPU_TASK_ID': '0'}, [], '1'),
    ({}, ['--multihost'], '1'),
    ({'TPU_WORKER_ID': '2', 'BPD_MULTIHOST': '0'}, [], '0'),  # set by hand: kept
])
def test_run_on_host_execs_bpd_main_from_the_repo_root(fake, env, args, multihost):
  fake.env.update(env, BPD_SKIP_INSTALL='1')
  run([RUN_ON_HOST, *TRICKY_ARGS, *args], fake.env, cwd=fake.tmp)  # from elsewhere: it finds the repo
  [call] = main_calls(fake)
  assert call['raw'] == ['-m', 'bpd.main', *TRICKY_ARGS, *args]
  assert call['cwd'] == REPO_ROOT
  assert call['multihost'] == multihost


def test_run_on_host_installs_into_the_venv_once(fake):
  venv = fake.tmp / 'venv'
  (venv / 'bin').mkdir(parents=True)
  write_script(venv / 'bin' / 'python', FAKE_MAIN)  # an existing venv: no `python3 -m venv`
  fake.env.update(BPD_VENV=str(venv), BPD_PIP_EXTRA='jax[tpu] -f https://example.com/libtpu.html')
  pip_upgrade = ['-m', 'pip', 'install', '-q', '--upgrade', 'pip']
  pip_install = ['-m', 'pip', 'install', '-q', '-e', '.', 'jax[tpu]', '-f', 'https://example.com/libtpu.html']
  main = ['-m', 'bpd.main', '--mode=train']

  run([RUN_ON_HOST, '--mode=train'], fake.env)
  run([RUN_ON_HOST, '--mode=train'], fake.env)  # installed already
  fake.env['BPD_PIP_EXTRA'] = 'jax[tpu]'
  run([RUN_ON_HOST, '--mode=train'], fake.env, cwd=fake.tmp)  # other extras: install again
  fake.env['BPD_INSTALL_ONLY'] = '1'
  run([RUN_ON_HOST, '--mode=train'], fake.env)

  assert [c['raw'] for c in main_calls(fake)] == [
      pip_upgrade, pip_install, main, main, pip_upgrade, pip_install[:-2], main]


# ------------------------------------------------------------------------------------------------ sweep.py


def sweep(fake, *args, check=True):
  return run([sys.executable, SWEEP, *args], fake.env, cwd=fake.tmp, check=check)


def test_sweep_expands_grid_into_named_runs_with_quoted_overrides(fake):
  root = str(fake.tmp / 'root')
  result = sweep(fake, '--config=configs/multi30k_ende.py:k=8', f'--workdir_root={root}', '--runner=print',
                 '--grid=k=2,4;config.train.regime=frozen,finetune', '--grid=decode.ks=(2,4),(8,)',
                 '--extra=--config.train.init_from=runs/base "--config.data.dir=/a b"')
  lines = result.stdout.splitlines()
  names = [line[2:] for line in lines[::2]]
  commands = [shlex.split(line) for line in lines[1::2]]
  assert len(commands) == 16  # 2 x 2 x 2 runs, each trained then decoded
  assert names[:4] == ['k=2+train.regime=frozen+decode.ks=2-4'] * 2 + ['k=2+train.regime=frozen+decode.ks=8'] * 2
  assert len(set(names)) == 8
  assert commands[0] == [
      'python', '-m', 'bpd.main', '--config=configs/multi30k_ende.py:k=8',
      f'--workdir={root}/k=2+train.regime=frozen+decode.ks=2-4', '--mode=train', '--config.k=2',
      '--config.train.regime=frozen', '--config.decode.ks=(2,4)', '--config.train.init_from=runs/base',
      '--config.data.dir=/a b']
  assert commands[1] == [*commands[0][:5], '--mode=decode', *commands[0][6:]]
  assert not os.path.exists(root)  # nothing ran, nothing to collect


def test_sweep_names_values_with_quotes_and_colons_safely(fake):
  result = sweep(fake, '--config=c.py', '--workdir_root=r', '--runner=print', '--mode=decode',
                 "--grid=decode.criteria=('exact','top_k:2'),('distance:2',)")
  lines = result.stdout.splitlines()
  assert lines[0] == '# decode.criteria=exact-top_k_2'
  assert lines[2] == '# decode.criteria=distance_2'
  assert "--config.decode.criteria=('exact','top_k:2')" in shlex.split(lines[1])


@pytest.mark.parametrize('grid, message', [
    ('k', "'k' is not 'field=v1,v2,...'"),
    ('k=2,,4', 'empty value'),
    ('k=2;k=4', "'k' is given twice"),
    ('decode.ks=(2,4),[2,4]', 'same run name'),
])
def test_sweep_rejects_bad_grids(fake, grid, message):
  result = sweep(fake, '--config=c.py', '--workdir_root=r', '--runner=print', f'--grid={grid}', check=False)
  assert result.returncode != 0 and message in result.stderr


def test_sweep_local_runs_collects_tables_and_resumes(fake):
  fake.env['BPD_MAIN'] = f'{shlex.quote(sys.executable)} {shlex.quote(fake.main)}'
  root = fake.tmp / 'root'
  args = ['--config=configs/x.py', f'--workdir_root={root}', '--grid=k=2,4;train.regime=frozen,finetune',
          '--grid=decode.ks=(1,2,4)']

  dry = sweep(fake, *args, '--dry_run')
  assert dry.stdout.count('would run') == 8 and main_calls(fake) == [] and not root.exists()

  first = sweep(fake, *args)
  calls = [c['raw'] for c in main_calls(fake)]
  assert [(flag(c, 'workdir'), flag(c, 'mode')) for c in calls[:2]] == [
      (f'{root}/k=2+train.regime=frozen+decode.ks=1-2-4', 'train'),
      (f'{root}/k=2+train.regime=frozen+decode.ks=1-2-4', 'decode')]
  assert len(calls) == 8 and 'ETA' in first.stdout

  rows = json.loads((root / 'sweep_results.json').read_text())
  assert len(rows) == 4 * 4  # 4 runs x (greedy + 3 values of k)
  row = rows[2]
  assert row['run'] == 'k=2+train.regime=frozen+decode.ks=1-2-4'
  assert (row['config.k'], row['config.train.regime'], row['config.decode.ks']) == (2, 'frozen', [1, 2, 4])
  assert (row['k'], row['criterion'], row['mean_accepted_block_size']) == (2, 'exact', 1.5)
  csv_lines = (root / 'sweep_results.csv').read_text().splitlines()
  assert csv_lines[0].startswith('run,config.k,config.train.regime,config.decode.ks,split,k,criterion,')
  assert len(csv_lines) == 1 + 16
  table = (root / 'sweep_results.md').read_text()
  assert table.splitlines()[0] == ('| run | split | k | criterion | batch | quality | mean accepted block size '
                                   '| speedup | identical to greedy |')
  row_line = '| k=2+train.regime=frozen+decode.ks=1-2-4 | val | 2 | exact | 32 | 20.00 | 1.50 | 1.50 | yes |'
  assert row_line in table
  assert table in first.stdout

  again = sweep(fake, *args)  # everything is done: nothing runs, the same table comes out
  assert len(main_calls(fake)) == 8 and '0 to run' in again.stdout and table in again.stdout

  (root / 'k=4+train.regime=finetune+decode.ks=1-2-4' / 'decode' / 'results.json').unlink()
  sweep(fake, *args)  # an interrupted decode: only that one runs again
  last = [c['raw'] for c in main_calls(fake)][8:]
  assert [(flag(c, 'workdir'), flag(c, 'mode')) for c in last] == [
      (f'{root}/k=4+train.regime=finetune+decode.ks=1-2-4', 'decode')]


def test_sweep_continues_after_a_failed_run_and_exits_nonzero(fake):
  fake.env.update(BPD_MAIN=f'{sys.executable} {fake.main}', FAKE_FAIL='--config.k=2')
  root = fake.tmp / 'root'
  result = sweep(fake, '--config=c.py', f'--workdir_root={root}', '--grid=k=2,4', check=False)
  assert result.returncode == 1 and 'FAILED k=2 (train)' in result.stdout
  modes = [(flag(c['raw'], 'config.k'), flag(c['raw'], 'mode')) for c in main_calls(fake)]
  assert modes == [('2', 'train'), ('4', 'train'), ('4', 'decode')]  # k=2 is not decoded after failing
  assert {row['run'] for row in json.loads((root / 'sweep_results.json').read_text())} == {'k=4'}


def test_sweep_decode_only_decodes_one_checkpoint_and_keeps_each_result(fake):
  fake.env['BPD_MAIN'] = f'{sys.executable} {fake.main}'
  base, root = fake.tmp / 'base', fake.tmp / 'root'
  args = ['--config=c.py', f'--workdir_root={root}', f'--decode_only_from={base}', '--grid=decode.ks=(2,),(2,4)']
  sweep(fake, *args)
  calls = [c['raw'] for c in main_calls(fake)]
  assert [(flag(c, 'workdir'), flag(c, 'mode'), flag(c, 'config.decode.ks')) for c in calls] == [
      (str(base), 'decode', '(2,)'), (str(base), 'decode', '(2,4)')]
  first = json.loads((root / 'decode.ks=2' / 'decode' / 'results.json').read_text())
  second = json.loads((root / 'decode.ks=2-4' / 'decode' / 'results.json').read_text())
  assert [r['k'] for r in first] == [1, 2] and [r['k'] for r in second] == [1, 2, 4]
  assert len(json.loads((root / 'sweep_results.json').read_text())) == 5

  sweep(fake, *args)
  assert len(main_calls(fake)) == 2  # resumed: nothing left to do

  printed = sweep(fake, *args, '--runner=print').stdout.splitlines()
  assert printed[2] == f'mkdir -p {root}/decode.ks=2/decode && cp {base}/decode/results.json ' \
                       f'{root}/decode.ks=2/decode/results.json'

  wrong = sweep(fake, *args, '--mode=train', check=False)
  assert wrong.returncode != 0 and 'needs --mode=decode' in wrong.stderr


def test_sweep_tpu_pod_runner_runs_on_all_workers_and_fetches_results(fake):
  make_remote_home(fake)
  local = fake.tmp / 'local'
  sweep(fake, '--config=configs/x.py', '--workdir_root=runs/sw', f'--local_root={local}', '--runner=tpu_pod',
        '--mode=decode', '--grid=k=2,4', '--grid=decode.criteria=("exact","top_k:2")')

  calls = gcloud_calls(fake)
  assert [c[3] for c in calls] == ['ssh', 'scp', 'ssh', 'scp']
  run_k2, fetch_k2 = calls[:2]
  assert '--worker=all' in run_k2 and '--worker=0' in fetch_k2
  name = 'k=2+decode.criteria=exact-top_k_2'
  assert fetch_k2[5] == f'bpd-test:bpd/runs/sw/{name}/decode/results.json'
  [first_main, _] = main_calls(fake)
  assert first_main['raw'] == ['-m', 'bpd.main', '--config=configs/x.py', f'--workdir=runs/sw/{name}',
                               '--mode=decode', '--config.k=2', '--config.decode.criteria=("exact","top_k:2")']
  assert (fake.home / 'bpd' / 'runs' / 'sw' / name / 'decode' / 'results.json').exists()  # on the "pod"
  assert (local / name / 'decode' / 'results.json').exists()  # fetched
  assert len(json.loads((local / 'sweep_results.json').read_text())) == 4
