"""Entry points raise the soft stack limit before anything compiles (bpd/stack.py): XLA's CPU compiler recursed
out of an 8 MiB stack compiling dynamic:64 at k' = 8 (docs/results/trees.md). That crash did not reproduce here at
any test-sized shape (docs/results/reliability.md), so these tests check the mechanism: the limit is raised in the
running process, deep native recursion on the main thread then survives, and every entry point calls the helper."""

import os
import re
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ENTRY_POINTS = ('bpd/main.py', 'experiments/accelerator_run.py', 'experiments/bench_decode.py',
                'experiments/bench_scale.py', 'experiments/diagnostics.py', 'experiments/study.py')
# A native recursion as deep as a compiler's, in linear time: comparing two lists nested 300000 deep (CPython's
# list comparison recurses in C). It overflows an 8 MiB stack.
DEEP = ('import sys\nsys.setrecursionlimit(10**8)\nx, y = [], []\nfor _ in range(300000):\n  x, y = [x], [y]\n'
        'print(x == y)')


def _run_at_8_mib(code):
  """code in a fresh python whose soft stack limit is 8 MiB (the common default; the hard limit as it is)."""
  return subprocess.run(['bash', '-c', f'ulimit -S -s 8192 && exec {sys.executable} -c "$0"', code], cwd=REPO,
                        env={**os.environ, 'PYTHONPATH': REPO}, stdin=subprocess.DEVNULL, capture_output=True,
                        text=True, timeout=120)


def _hard_limit_allows_more():
  import resource  # pylint: disable=g-import-not-at-top
  hard = resource.getrlimit(resource.RLIMIT_STACK)[1]
  return hard == resource.RLIM_INFINITY or hard > 64 << 20


@pytest.mark.skipif(not _hard_limit_allows_more(), reason='the hard stack limit leaves nothing to raise')
def test_the_helper_raises_the_soft_limit_and_deep_recursion_then_survives():
  limits = _run_at_8_mib('import resource\nfrom bpd import stack\nprint(resource.getrlimit(resource.RLIMIT_STACK)[0], '
                         'stack.raise_stack_limit())')
  before, after = limits.stdout.split(' ', 1)
  assert int(before) == 8192 * 1024 and eval(after)[0] == eval(after)[1], limits.stdout  # pylint: disable=eval-used
  assert _run_at_8_mib(DEEP).returncode != 0  # the recursion does overflow 8 MiB
  raised = _run_at_8_mib('from bpd import stack\nstack.raise_stack_limit()\n' + DEEP)
  assert raised.returncode == 0 and raised.stdout.strip() == 'True', raised.stderr[-2000:]


@pytest.mark.parametrize('path', ENTRY_POINTS)
def test_every_entry_point_raises_the_stack_limit_before_running(path):
  text = open(os.path.join(REPO, path), encoding='utf-8').read()
  main_block = text[text.index("if __name__ == '__main__':"):]
  assert re.search(r'stack\.raise_stack_limit\(\)[^\n]*\n(.*\n)*\s*app\.run\(', main_block[-600:]), path
