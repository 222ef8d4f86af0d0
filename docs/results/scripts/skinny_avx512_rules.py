"""The skinny kernel's AVX-512 row rules, side by side in one process, for M = 1..16 rows (the verification of a
chain up to k = 16, a tree's nodes): which register blocks the rows of a product take.

  now    up to 6 rows in one pass of 6 x 64 blocks (a whole tile), 7 to 12 in one pass of 12 x 32 blocks, more in
         several passes of 12 x 32 blocks (the rule written before any AVX-512 machine was at hand);
  pairs  3 to 8 rows two at a time over 64-column strips (2 x 64 blocks), more as `now` (AVX2's rule for 3..8);
  wide   6 x 64 blocks at every M, re-reading each tile from cache per six rows;
  tall   12 x 32 blocks from 3 rows on: each 32-column part read front to back in one stream.

Weights: one matrix (held in L2), sets of 31 MB (a `small` decoder's weights are ~20 MB) and of 256 MB (memory).
All rules must give the same bits; the script checks it. 20th percentile of 9 alternating runs of a jitted loop of
products.

How: it copies bpd/kernels to a temporary directory, adds a switch (`bpd_rule(0..3)`), builds that copy, and points
bpd.matmul at it (skinny_row_blocking.py's way).

  python docs/results/scripts/skinny_avx512_rules.py [--rows=1,2,3,4,5,6,8,12,16]
"""
import argparse
import pathlib
import sys
import tempfile
import time

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(pathlib.Path(__file__).parent))
import skinny_row_blocking  # pylint: disable=wrong-import-position

RULES = ('now', 'pairs', 'wide', 'tall')
REPEATS = 9


def switchable_library(directory: pathlib.Path) -> pathlib.Path:
  """The kernel library built from a copy of bpd/kernels whose row rule is RULES[g_rule], chosen at run time."""
  return skinny_row_blocking.library_with_switch(
      directory, 'const bool wide = kOnlyWide || M <= kWideMr;',
      'const bool wide = kOnlyWide || g_rule == 2 || (g_rule != 3 && M <= kWideMr);', 'rule', 0,
      more={'const bool pairs = M > 2 && M <= kPairsUpTo;':
            'const bool pairs = g_rule == 1 ? (M > 2 && M <= 8) : (M > 2 && M <= kPairsUpTo);'})


def main():
  parser = argparse.ArgumentParser()
  parser.add_argument('--rows', default='1,2,3,4,5,6,8,12,16')
  rows = [int(m) for m in parser.parse_args().rows.split(',')]
  matmul, switch = skinny_row_blocking.load(
      switchable_library(pathlib.Path(tempfile.mkdtemp(prefix='bpd_avx512_rules_'))), 'rule')
  if not matmul.kernel_info().startswith('avx512'):
    sys.exit('the rules switched here are the AVX-512 path\'s; run on an AVX-512 CPU')
  print('µs per product (GB/s of weights); the best rule in bold\n')
  print('| weights | M | ' + ' | '.join(RULES) + ' | now / best |')
  print('|---|---|' + '---|' * (len(RULES) + 1))
  rng = np.random.default_rng(0)
  for name, k, n, count, steps in (('[256, 1024] x1 (in L2)', 256, 1024, 1, 400),
                                   ('[256, 1024] x30 (31 MB)', 256, 1024, 30, 30),
                                   ('[1024, 256] x30 (31 MB)', 1024, 256, 30, 30),
                                   ('[1024, 2048] x32 (256 MB)', 1024, 2048, 32, 3)):
    ws = [jnp.asarray(rng.standard_normal((k, n)), jnp.float32) for _ in range(count)]
    packs = [jax.jit(matmul.pack)(w) for w in ws]
    fn = skinny_row_blocking.program(matmul, ws, packs, steps)
    for m in rows:
      x = jnp.asarray(rng.standard_normal((m, k)), jnp.float32)
      outs = []
      for rule in range(len(RULES)):
        switch(rule)
        outs.append(np.asarray(fn(x)))
      if not all(np.array_equal(o, outs[0]) for o in outs):
        sys.exit(f'{name} M={m}: the rules gave different bits')
      times = {rule: [] for rule in range(len(RULES))}
      for _ in range(REPEATS):
        for rule in range(len(RULES)):
          switch(rule)
          start = time.perf_counter()
          jax.block_until_ready(fn(x))
          times[rule].append((time.perf_counter() - start) / steps / count)
      us = [float(np.percentile(times[rule], 20)) * 1e6 for rule in range(len(RULES))]
      best = min(us)
      cells = [(f'**{t:.1f}**' if t == best else f'{t:.1f}') + f' ({4 * k * n / t / 1e3:.0f})' for t in us]
      print(f'| {name} | {m} | ' + ' | '.join(cells) + f' | {us[0] / best:.2f}x |', flush=True)
  switch(0)


if __name__ == '__main__':
  sys.exit(main())
