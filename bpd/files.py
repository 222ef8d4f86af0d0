"""Writing a file that a later run reads: whole or not at all.

A run killed while writing (kill -9, a preempted VM, a full disk) must leave either the previous file or the new
one, never half of one: a later run would read the half (a results.json cut mid-record, a tokenizer that does not
load) or, worse, take it for finished work. `write_atomic` writes a temporary file beside the target (same folder,
so the same file system), flushes it to disk and renames it over the target; a rename within one file system is
atomic. Checkpoints are orbax's: it writes each step into a temporary folder and renames it (see
bpd/checkpoint.py).
"""

import os

from etils import epath


def temporary_path(path: str) -> str:
  """Where write_atomic writes before renaming: hidden, beside `path`, one per process (no clash between two)."""
  folder, name = os.path.split(path)
  return os.path.join(folder, f'.{name}.{os.getpid()}.tmp')


def write_atomic(path: str, data: str | bytes) -> None:
  """Replaces `path` by `data` (text is written as UTF-8) in one step: a reader sees the old file or the new one."""
  data = data.encode('utf-8') if isinstance(data, str) else data
  if '://' in path:  # an object store (gs://) writes an object whole or not at all by itself
    epath.Path(path).write_bytes(data)
    return
  tmp = temporary_path(path)
  try:
    with open(tmp, 'wb') as f:
      f.write(data)
      f.flush()
      os.fsync(f.fileno())  # on disk before the rename: after a crash the new name never points at missing data
    os.replace(tmp, path)
  except BaseException:
    if os.path.exists(tmp):
      os.remove(tmp)
    raise


def append_line(path: str, line: str) -> None:
  """Appends one line (no newline inside) whole: one write of the line and its newline, flushed to disk.

  A crash can still cut the last line short (a full disk); readers skip a line that does not parse
  (metrics.read_scalars), and the next append starts on a fresh line.
  """
  with open(path, 'a+b') as f:
    f.seek(0, os.SEEK_END)
    if f.tell():
      f.seek(-1, os.SEEK_END)
      if f.read(1) != b'\n':  # the previous append was cut short: close its line so that ours stays whole
        line = '\n' + line
    f.write((line + '\n').encode('utf-8'))
    f.flush()
    os.fsync(f.fileno())
