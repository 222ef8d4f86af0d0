"""TensorBoard summaries, a plain-text copy of them, and progress lines with an ETA.

Summaries go to {workdir}/tensorboard (tensorboardX: no TensorFlow needed): `tensorboard --logdir WORKDIR`, and
the same scalars, one JSON object per line, to {workdir}/metrics.jsonl (for plots and tables without
TensorBoard: `read_scalars`). Only process 0 writes, so a multi-host run has one set of files.
"""

import json
import os
import time

import jax

from bpd import files


class Writer:
  """Scalars to TensorBoard event files (process 0 only)."""

  def __init__(self, workdir: str):
    self._writer = None
    self._jsonl = os.path.join(workdir, JSONL)
    if jax.process_index() == 0:
      from tensorboardX import SummaryWriter  # imported here: only process 0 needs it
      self._writer = SummaryWriter(os.path.join(workdir, 'tensorboard'))

  def scalars(self, step: int, values: dict, prefix: str = ''):
    if self._writer is None:
      return
    for name, value in values.items():
      self._writer.add_scalar(f'{prefix}/{name}' if prefix else name, value, step)
    self._writer.flush()
    if '://' in self._jsonl:  # object stores (gs://) cannot append; TensorBoard has the scalars there
      return
    # Appended (a resumed run continues the same file), one whole line at a time (files.append_line).
    files.append_line(self._jsonl, json.dumps({'step': int(step), 'prefix': prefix,
                                               **{k: float(v) for k, v in values.items()}}))

  def close(self):
    if self._writer is not None:
      self._writer.close()


JSONL = 'metrics.jsonl'


def jsonl_path(workdir: str) -> str:
  """{workdir}/metrics.jsonl, or workdir itself when it names a .jsonl file of such rows (a curve kept in
  docs/results/curves/ after its model is gone)."""
  return workdir if workdir.endswith('.jsonl') else os.path.join(workdir, JSONL)


def read_scalars(workdir: str, prefix: str) -> list[dict]:
  """The rows of {workdir}/metrics.jsonl with this prefix ('train' or 'eval'), by step; a step logged twice
  (a run resumed from an earlier checkpoint) keeps its last row. workdir may also name a .jsonl file (jsonl_path).
  A line cut short (a run killed while appending it) is skipped."""
  path = jsonl_path(workdir)
  if not os.path.exists(path):
    return []
  rows = {}
  with open(path, encoding='utf-8') as f:
    for line in f:
      try:
        row = json.loads(line)
      except ValueError:
        continue
      if row.pop('prefix') == prefix:
        rows[row['step']] = row
  return [rows[step] for step in sorted(rows)]


def format_seconds(seconds: float) -> str:
  seconds = int(max(seconds, 0))
  hours, rest = divmod(seconds, 3600)
  minutes, secs = divmod(rest, 60)
  return f'{hours}h{minutes:02d}m' if hours else f'{minutes}m{secs:02d}s'


class Progress:
  """'what 1200/6000 (20%) | 1.23 it/s | elapsed 16m10s | ETA 1h05m'.

  The rate is measured since the previous line (so compilation at the start does not skew the ETA).
  """

  def __init__(self, start: int, total: int, what: str):
    self.total, self.what = total, what
    self.t0 = time.time()
    self._last = (self.t0, start)

  def line(self, done: int) -> str:
    now = time.time()
    last_time, last_done = self._last
    rate = (done - last_done) / (now - last_time) if now > last_time and done > last_done else 0.0
    self._last = (now, done)
    pct = 100.0 * done / max(self.total, 1)
    eta_text = format_seconds((self.total - done) / rate) if rate else '?'
    return (f'{self.what} {done}/{self.total} ({pct:.0f}%) | {rate:.2f} it/s | elapsed '
            f'{format_seconds(now - self.t0)} | ETA {eta_text}')


def quiet_library_logs() -> None:
  """Drops the INFO lines orbax writes for every save (dozens per checkpoint); warnings still show."""
  import logging as py_logging  # pylint: disable=g-import-not-at-top
  from absl import logging  # pylint: disable=g-import-not-at-top

  class _Filter(py_logging.Filter):

    def filter(self, record):
      return record.levelno >= py_logging.WARNING or '/orbax/' not in record.pathname

  logging.get_absl_handler().addFilter(_Filter())
