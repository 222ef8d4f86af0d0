"""Fair side-by-side timing: warm-up on the exact timed shapes, alternation, medians, no compile in a timed region.

Why this file exists: a study once reported 1.2-1.6x "speedups" that were a compile landing inside
the greedy baseline's timed region (the warm-up ran at another padded shape than the timed runs). Every timing
in the project (bpd/evaluate.py, experiments/bench_decode.py) goes through
`time_alternating`, which
  1. runs every function once, untimed, on exactly what it will time (compile + warm-up);
  2. alternates the functions `repeats` times (a changing machine load hits all of them alike, DESIGN §7);
  3. counts JAX traces and XLA compiles while timing and raises `RecompileError` if there was any.
"""

import contextlib
import statistics
import time
from typing import Callable, Sequence

import jax
from jax import monitoring

# Events JAX records when it traces a function to a jaxpr and when XLA compiles a program. A cache hit records
# neither, so a nonzero count inside a timed region means the region paid for tracing or compiling.
COMPILE_EVENTS = ('/jax/core/compile/jaxpr_trace_duration', '/jax/core/compile/backend_compile_duration')


class RecompileError(RuntimeError):
  """Something was traced or compiled inside a timed region: the timing would include it."""


@contextlib.contextmanager
def count_compiles():
  """Yields a dict whose 'traces' and 'compiles' count the JAX traces / XLA compiles inside the block."""
  counts = {'traces': 0, 'compiles': 0}

  def listener(event, duration_secs, **kwargs):
    del duration_secs, kwargs
    if event == COMPILE_EVENTS[0]:
      counts['traces'] += 1
    elif event == COMPILE_EVENTS[1]:
      counts['compiles'] += 1

  monitoring.register_event_duration_secs_listener(listener)
  try:
    yield counts
  finally:
    monitoring.unregister_event_duration_listener(listener)


@contextlib.contextmanager
def no_compiles(what: str):
  """Raises RecompileError if anything is traced or compiled inside the block (a timed region)."""
  with count_compiles() as counts:
    yield counts
  if counts['traces'] or counts['compiles']:
    raise RecompileError(
        f'{what}: {counts["traces"]} trace(s) and {counts["compiles"]} compile(s) happened inside the timed region, '
        'so its time includes compilation. Warm up on exactly the shapes (and static arguments) that are timed.')


def seconds(fn: Callable[[], object]) -> float:
  """Wall-clock seconds of fn() until its outputs are ready."""
  start = time.perf_counter()
  jax.block_until_ready(fn())
  return time.perf_counter() - start


def time_alternating(fns: Sequence[Callable[[], object]], repeats: int, what: str = 'timing',
                     reduce: Callable[[list[float]], float] = statistics.median) -> list[float]:
  """Median (or `reduce`) seconds of each fn(), after one untimed warm-up call of each, run alternately
  `repeats` times. Each fn must do exactly what its warm-up did (same shapes, same static arguments):
  RecompileError otherwise.
  """
  for fn in fns:
    seconds(fn)  # compile + warm-up on exactly what is timed
  times = [[] for _ in fns]
  with no_compiles(what):
    for _ in range(max(repeats, 1)):
      for fn, fn_times in zip(fns, times):
        fn_times.append(seconds(fn))
  return [reduce(t) for t in times]
