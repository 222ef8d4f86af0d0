r"""Runs a grid of `bpd.main` runs, one workdir each, and gathers their decode results into one table.

  python launch/sweep.py --config=configs/multi30k_ende.py --workdir_root=runs/sweep \
      --grid='k=2,4,8;train.regime=frozen,finetune' --extra='--config.train.init_from=runs/base'

Grid: each --grid holds `field=v1,v2,...` specs separated by ';' (the flag may also repeat); the runs are all
combinations, the first field varying slowest. A field is a config field (a leading `config.` is optional);
values are passed verbatim as `--config.FIELD=VALUE`, and commas inside brackets or quotes do not split, so
`decode.ks=(2,4),(8,)` is two values. Each run is named by its values, e.g. `k=4+train.regime=frozen`, and
writes into WORKDIR_ROOT/NAME. Names hold only letters, digits and `._=+-`: commas inside a value become `-`,
anything else unsafe `_`. No commas and no colons: SentencePiece splits the paths it is given at commas, and
scp reads HOST:PATH.

Modes: train, decode, or train_then_decode (the default; two invocations of bpd.main per run).

Decode-only sweeps over one trained model, --decode_only_from=DIR (needs --mode=decode, the default then):
every run decodes with --workdir=DIR and its grid's decode.* overrides, so each one overwrites
DIR/decode/results.json; after a run succeeds the sweep copies that file to
WORKDIR_ROOT/NAME/decode/results.json, where the table and the resume check look. The runs therefore go one
at a time.

Runners:
  local    runs the commands here, one after the other. A run whose WORKDIR_ROOT/NAME/decode/results.json
           exists (or, for --mode=train, whose WORKDIR_ROOT/NAME/sweep_train.done exists) is skipped, so an
           interrupted sweep resumes when started again. Prints progress with an ETA.
  tpu_pod  the same through `launch/tpu_pod.sh run` (foreground, on every worker), then
           `launch/tpu_pod.sh fetch` of each run's results.json from worker 0. Paths in the commands are
           then paths on the pod (relative ones: to the repo there); results and the table go under
           --local_root (default: --workdir_root) on this machine.
  print    prints the commands (and, for decode-only, the copy after each) to run by hand; collects any
           results that already exist.
--dry_run shows what the chosen runner would do, and which runs it would skip, without running anything.

At the end (not for --mode=train) every run's results.json is read, each record gets `run` and one
`config.FIELD` column per grid field, and ROOT/sweep_results.{json,csv,md} are written; the Markdown table is
printed. BPD_MAIN overrides the command that starts bpd.main (default `python -m bpd.main`, where `python`
is the interpreter running this script), split with shlex.
"""

import ast
import csv
import dataclasses
import itertools
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import time

from absl import app
from absl import flags

LAUNCH_DIR = os.path.dirname(os.path.abspath(__file__))
TPU_POD = os.path.join(LAUNCH_DIR, 'tpu_pod.sh')
RESULTS = os.path.join('decode', 'results.json')
TRAIN_DONE = 'sweep_train.done'

_CONFIG = flags.DEFINE_string('config', None, 'bpd.main --config value, path[:args]; passed through.',
                              required=True)
_WORKDIR_ROOT = flags.DEFINE_string('workdir_root', None, 'Each run writes into WORKDIR_ROOT/NAME.',
                                    required=True)
_GRID = flags.DEFINE_multi_string('grid', [], "'field=v1,v2,...' specs, separated by ';' or repeated.")
_MODE = flags.DEFINE_enum('mode', None, ['train', 'decode', 'train_then_decode'],
                          'Default: decode with --decode_only_from, else train_then_decode.')
_RUNNER = flags.DEFINE_enum('runner', 'local', ['local', 'tpu_pod', 'print'], 'Where the runs go.')
_EXTRA = flags.DEFINE_multi_string('extra', [], 'More bpd.main flags, shlex-split, passed to every run.')
_DECODE_ONLY_FROM = flags.DEFINE_string('decode_only_from', '', 'Workdir of a trained model to decode.')
_LOCAL_ROOT = flags.DEFINE_string('local_root', '', 'tpu_pod runner: local folder for fetched results.')
_DRY_RUN = flags.DEFINE_bool('dry_run', False, 'Show what would run; run nothing, write nothing.')


class SweepError(ValueError):
  pass


# ------------------------------------------------------------------------------------------------ the grid


def split_top_level(text: str, sep: str) -> list[str]:
  """Splits at `sep` except inside brackets or quotes: '(2,4),(8,)' -> ['(2,4)', '(8,)']."""
  parts, depth, quote, start = [], 0, '', 0
  for i, ch in enumerate(text):
    if quote:
      quote = '' if ch == quote else quote
    elif ch in '\'"':
      quote = ch
    elif ch in '([{':
      depth += 1
    elif ch in ')]}':
      depth -= 1
    elif ch == sep and depth == 0:
      parts.append(text[start:i])
      start = i + 1
  parts.append(text[start:])
  return parts


def parse_grid(specs: list[str]) -> list[tuple[str, list[str]]]:
  """['k=2,4;train.regime=frozen'] -> [('k', ['2', '4']), ('train.regime', ['frozen'])]."""
  grid = []
  for spec in specs:
    for part in split_top_level(spec, ';'):
      part = part.strip()
      if not part:
        continue
      field, eq, values = part.partition('=')
      field = field.strip().removeprefix('config.')
      if not eq or not re.fullmatch(r'[A-Za-z_][A-Za-z0-9_.]*', field):
        raise SweepError(f"--grid: '{part}' is not 'field=v1,v2,...' (e.g. 'k=2,4,8' or 'decode.ks=(2,4),(8,)')")
      values = [v.strip() for v in split_top_level(values, ',')]
      if not all(values):
        raise SweepError(f"--grid: '{part}' has an empty value")
      if field in dict(grid):
        raise SweepError(f"--grid: field '{field}' is given twice")
      grid.append((field, values))
  return grid


def sanitize(value: str) -> str:
  """A grid value as part of a directory name: '(2,4)' -> '2-4', 'top_k:2' -> 'top_k_2'."""
  value = re.sub(r'''[\s'"()\[\]{}]''', '', value).rstrip(',').replace(',', '-')  # (8,) -> 8
  value = re.sub(r'[^A-Za-z0-9._-]', '_', value)  # '+' is left to separate the fields
  return value or 'empty'


@dataclasses.dataclass
class Run:
  name: str
  values: dict[str, str]  # grid field -> value as written in --grid
  workdir: str  # where bpd.main writes: ROOT/NAME, or the --decode_only_from DIR
  results: str  # this run's results.json under the local root
  done_marker: str  # exists once the run (train mode) or its training (train_then_decode) is done


def expand(grid, workdir_root: str, local_root: str, decode_only_from: str) -> list[Run]:
  fields = [field for field, _ in grid]
  runs = []
  for combo in itertools.product(*(values for _, values in grid)):
    values = dict(zip(fields, combo))
    name = '+'.join(f'{field}={sanitize(value)}' for field, value in values.items()) or 'default'
    workdir = decode_only_from or os.path.join(workdir_root, name)
    runs.append(Run(name, values, workdir, os.path.join(local_root, name, RESULTS),
                    os.path.join(local_root, name, TRAIN_DONE)))
  names = [run.name for run in runs]
  clashes = sorted({name for name in names if names.count(name) > 1})
  if clashes:
    raise SweepError(f'--grid: different values give the same run name {clashes}; make the values differ in '
                     'letters or digits, not only in punctuation')
  return runs


def bpd_args(run: Run, mode: str, config: str, extra: list[str]) -> list[str]:
  overrides = [f'--config.{field}={value}' for field, value in run.values.items()]
  return [f'--config={config}', f'--workdir={run.workdir}', f'--mode={mode}', *overrides, *extra]


# ------------------------------------------------------------------------------------------------ running


def main_command() -> list[str]:
  command = shlex.split(os.environ.get('BPD_MAIN', 'python -m bpd.main'))
  # Plain `python` means this interpreter: the one whose environment has bpd installed.
  if command and command[0] == 'python' and 'BPD_MAIN' not in os.environ:
    command[0] = sys.executable
  return command


@dataclasses.dataclass
class Step:
  run: Run
  mode: str  # train | decode
  args: list[str]  # bpd.main's

  def done(self) -> bool:
    if self.mode == 'train':  # Decode results also mean that training finished.
      return os.path.exists(self.run.done_marker) or os.path.exists(self.run.results)
    return os.path.exists(self.run.results)


def plan(runs: list[Run], mode: str, config: str, extra: list[str]) -> list[Step]:
  modes = ['train', 'decode'] if mode == 'train_then_decode' else [mode]
  return [Step(run, m, bpd_args(run, m, config, extra)) for run in runs for m in modes]


def copy_atomically(src: str, dst: str) -> None:
  os.makedirs(os.path.dirname(dst), exist_ok=True)
  shutil.copyfile(src, dst + '.tmp')
  os.replace(dst + '.tmp', dst)


def execute(step: Step, runner: str) -> None:
  """Runs one step; afterwards step.done() holds. Raises CalledProcessError or SweepError if it fails."""
  run = step.run
  if runner == 'local':
    subprocess.run(main_command() + step.args, check=True)
    if step.mode == 'decode':
      produced = os.path.join(run.workdir, RESULTS)
      if not os.path.exists(produced):
        raise SweepError(f'{run.name}: bpd.main succeeded but wrote no {produced}')
      if os.path.abspath(produced) != os.path.abspath(run.results):  # decode-only: copy out of DIR
        copy_atomically(produced, run.results)
  else:  # tpu_pod
    subprocess.run([TPU_POD, 'run', *step.args], check=True, env={**os.environ, 'BPD_FOREGROUND': '1'})
    if step.mode == 'decode':
      os.makedirs(os.path.dirname(run.results), exist_ok=True)
      subprocess.run([TPU_POD, 'fetch', os.path.join(run.workdir, RESULTS), run.results + '.tmp'], check=True)
      os.replace(run.results + '.tmp', run.results)
  if step.mode == 'train':
    os.makedirs(os.path.dirname(run.done_marker), exist_ok=True)
    with open(run.done_marker, 'w') as f:
      f.write(shlex.join(step.args) + '\n')


def shown(step: Step, runner: str) -> str:
  """The step's command as a shell line to read or paste."""
  if runner == 'tpu_pod':
    return shlex.join([os.path.relpath(TPU_POD), 'run', *step.args])
  command = main_command() if 'BPD_MAIN' in os.environ else ['python', '-m', 'bpd.main']
  return shlex.join(command + step.args)


def print_commands(steps: list[Step], decode_only: bool) -> None:
  for step in steps:
    print(f'# {step.run.name}')
    print(shown(step, 'print'))
    if decode_only and step.mode == 'decode':
      produced = os.path.join(step.run.workdir, RESULTS)
      print(shlex.join(['mkdir', '-p', os.path.dirname(step.run.results)]) + ' && ' +
            shlex.join(['cp', produced, step.run.results]))


def run_all(steps: list[Step], runner: str, dry_run: bool) -> list[str]:
  """Runs the steps not done yet, in order; returns the names of failed runs."""
  pending = [step for step in steps if not step.done()]
  print(f'[sweep] {len(steps)} steps in {len({s.run.name for s in steps})} runs; '
        f'{len(steps) - len(pending)} already done, {len(pending)} to run', flush=True)
  failed, spent, finished = [], 0.0, 0
  for i, step in enumerate(pending):
    if dry_run:
      print(f'[sweep] would run {step.run.name} ({step.mode}): {shown(step, runner)}')
      continue
    if step.run.name in failed:  # Its training failed: decoding it would fail too.
      continue
    print(f'[sweep] {i + 1}/{len(pending)} {step.run.name} ({step.mode}): {shown(step, runner)}', flush=True)
    start = time.time()
    try:
      execute(step, runner)
    except (subprocess.CalledProcessError, SweepError) as e:
      print(f'[sweep] FAILED {step.run.name} ({step.mode}): {e}', flush=True)
      failed.append(step.run.name)
    spent += time.time() - start
    finished += 1
    left = len(pending) - i - 1
    eta = spent / finished * left
    print(f'[sweep] {step.run.name} ({step.mode}) took {time.time() - start:.0f} s; {left} steps left, '
          f'ETA {eta / 60:.1f} min', flush=True)
  return failed


# ------------------------------------------------------------------------------------------------ the table

TABLE_COLUMNS = [  # (header, key in a row)
    ('run', 'run'), ('split', 'split'), ('k', 'k'), ('criterion', 'criterion'), ('batch', 'batch_size'),
    ('quality', 'quality'), ('mean accepted block size', 'mean_accepted_block_size'),
    ('speedup', 'speedup'), ('identical to greedy', 'identical_to_greedy')]


def as_value(text: str):
  """A grid value as JSON: '4' -> 4, '(2,4)' -> [2, 4]; text that is no Python literal stays a string."""
  try:
    value = ast.literal_eval(text)
  except (ValueError, SyntaxError):
    return text
  return list(value) if isinstance(value, tuple) else value


def collect(runs: list[Run]) -> list[dict]:
  rows = []
  for run in runs:
    if not os.path.exists(run.results):
      continue
    with open(run.results) as f:
      records = json.load(f)
    grid_columns = {f'config.{field}': as_value(value) for field, value in run.values.items()}
    rows.extend({'run': run.name, **grid_columns, **record} for record in records)
  return rows


def cell(value) -> str:
  if value is None:
    return ''
  if isinstance(value, bool):
    return 'yes' if value else 'no'
  if isinstance(value, float):
    return f'{value:.2f}'
  return str(value)


def markdown_table(rows: list[dict]) -> str:
  lines = ['| ' + ' | '.join(header for header, _ in TABLE_COLUMNS) + ' |',
           '|' + '|'.join('---' for _ in TABLE_COLUMNS) + '|']
  for row in rows:
    lines.append('| ' + ' | '.join(cell(row.get(key)) for _, key in TABLE_COLUMNS) + ' |')
  return '\n'.join(lines) + '\n'


def write_tables(rows: list[dict], root: str) -> str:
  os.makedirs(root, exist_ok=True)
  with open(os.path.join(root, 'sweep_results.json'), 'w') as f:
    json.dump(rows, f, indent=1)
  columns = list(dict.fromkeys(key for row in rows for key in row))  # every key, in order of first use
  with open(os.path.join(root, 'sweep_results.csv'), 'w', newline='') as f:
    writer = csv.DictWriter(f, fieldnames=columns)
    writer.writeheader()
    for row in rows:
      writer.writerow({k: json.dumps(v) if isinstance(v, (list, dict)) else v for k, v in row.items()})
  table = markdown_table(rows)
  with open(os.path.join(root, 'sweep_results.md'), 'w') as f:
    f.write(table)
  return table


# ------------------------------------------------------------------------------------------------ main


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f'unexpected arguments {argv[1:]}; bpd.main flags go in --extra')
  decode_only = _DECODE_ONLY_FROM.value
  mode = _MODE.value or ('decode' if decode_only else 'train_then_decode')
  runner = _RUNNER.value
  if decode_only and mode != 'decode':
    raise app.UsageError(f'--decode_only_from decodes a trained model: it needs --mode=decode, not {mode}')
  if _LOCAL_ROOT.value and runner != 'tpu_pod':
    raise app.UsageError('--local_root is for --runner=tpu_pod; locally the results are under --workdir_root')
  local_root = _LOCAL_ROOT.value or _WORKDIR_ROOT.value
  extra = [arg for text in _EXTRA.value for arg in shlex.split(text)]
  try:
    grid = parse_grid(_GRID.value)
    runs = expand(grid, _WORKDIR_ROOT.value, local_root, decode_only)
  except SweepError as e:
    raise app.UsageError(str(e))
  steps = plan(runs, mode, _CONFIG.value, extra)

  failed = []
  if runner == 'print':
    print_commands(steps, bool(decode_only))
  else:
    failed = run_all(steps, runner, _DRY_RUN.value)
  if _DRY_RUN.value or mode == 'train':
    return 1 if failed else 0

  rows = collect(runs)
  have = sum(os.path.exists(run.results) for run in runs)
  if runner == 'print' and not have:
    return 0
  table = write_tables(rows, local_root)
  print(f'\n[sweep] results of {have}/{len(runs)} runs in {os.path.join(local_root, "sweep_results")}'
        '.{json,csv,md}\n')
  print(table, end='')
  if failed:
    print(f'\n[sweep] {len(failed)} runs failed: {", ".join(failed)}')
    return 1
  return 0


if __name__ == '__main__':
  app.run(main)
