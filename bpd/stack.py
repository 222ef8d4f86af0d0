"""Enough stack for XLA's CPU compiler, in one helper that every entry point calls first.

Compiling a deep program (a large context-aware tree: `dynamic:64` at k' = 8 has 7 expansion depths inside the decode
loop) recurses deeply in XLA's compiler, which runs on the calling thread. Under the common default soft limit of
8 MiB the main thread's stack can run out and the process dies with a segmentation fault inside backend_compile
(docs/results/trees.md). Linux checks RLIMIT_STACK when the main thread's stack grows, so raising the soft limit
in the running process is enough, up to the room the kernel left below the stack at exec (at least 128 MiB); no
re-exec, and jax may already be imported. Threads are not affected (their stacks are allocated when they start).
"""

import resource


def raise_stack_limit() -> tuple[int, int]:
  """Raises the soft RLIMIT_STACK to the hard limit (what `ulimit -s unlimited` does when the hard limit allows
  it). Returns the (soft, hard) limits now in force. A hard limit below the need cannot be raised from inside."""
  soft, hard = resource.getrlimit(resource.RLIMIT_STACK)
  if soft != hard:
    resource.setrlimit(resource.RLIMIT_STACK, (hard, hard))
  return resource.getrlimit(resource.RLIMIT_STACK)
