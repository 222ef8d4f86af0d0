"""The skinny kernel's AVX2 blocks for 3 to 8 rows, side by side in one process: two rows at a time over 32-column
strips (the rule) against one pass of 6 x 16 blocks (the rule before), one matrix at a time (in L2) and over sets
of 31-50 MB (streamed from L3 and DRAM, as a decoding step streams its weights); then, with --model, a trained
Multi30k model's greedy and k' = 4 chain (float16 heads, a 2000-token draft vocabulary) under each, alternating
sentence by sentence. Both blockings must give the same bits; the script checks it (and the same tokens).

How: it copies bpd/kernels to a temporary directory, adds a switch (`bpd_pairs(0 | 1)`), builds that copy, and
points bpd.matmul at it (skinny_row_blocking.py's way). 20th percentile of 9 alternating runs of 50 products.

  python docs/results/scripts/skinny_pairs.py [--model=WORKDIR [--data=DIR]]
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

STEPS, REPEATS = skinny_row_blocking.STEPS, skinny_row_blocking.REPEATS


def switchable_library(directory: pathlib.Path) -> pathlib.Path:
  """The kernel library built from a copy of bpd/kernels whose two-row rule is switched at run time."""
  return skinny_row_blocking.library_with_switch(directory, 'const bool pairs = M > 2 && M <= kPairsUpTo;',
                                                 'const bool pairs = g_pairs && M > 2 && M <= kPairsUpTo;', 'pairs', 1)


def matrices(matmul, switch):
  print('| weights | M | 6 x 16 µs | pairs µs | 6 x 16 / pairs |')
  print('|---|---|---|---|---|')
  rng = np.random.default_rng(0)
  for name, k, n, count in (('[512, 2048] x12 (50 MB)', 512, 2048, 12), ('[2048, 512] x12 (50 MB)', 2048, 512, 12),
                            ('[256, 1024] x30 (31 MB)', 256, 1024, 30), ('[256, 1024] x1 (in L2)', 256, 1024, 1)):
    ws = [jnp.asarray(rng.standard_normal((k, n)), jnp.float32) for _ in range(count)]
    packs = [jax.jit(matmul.pack)(w) for w in ws]
    fn = skinny_row_blocking.program(matmul, ws, packs)
    for m in (2, 3, 4, 6, 8):  # 2: the same code either way (a control for the noise)
      x = jnp.asarray(rng.standard_normal((m, k)), jnp.float32)
      outs, times = {}, {0: [], 1: []}
      for on in (0, 1):
        switch(on)
        outs[on] = np.asarray(fn(x))
      if not np.array_equal(outs[0], outs[1]):
        sys.exit(f'{name} M={m}: the two blockings gave different bits')
      for _ in range(REPEATS):
        for on in (0, 1):
          switch(on)
          start = time.perf_counter()
          jax.block_until_ready(fn(x))
          times[on].append((time.perf_counter() - start) / STEPS / count)
      before, pairs = (float(np.percentile(times[on], 20)) * 1e6 for on in (0, 1))
      print(f'| {name} | {m} | {before:.1f} | {pairs:.1f} | {before / pairs:.2f}x |', flush=True)


def decoders(switch, workdir, data_dir, passes=3):
  import per_sentence_fit  # pylint: disable=import-outside-toplevel  (after main points bpd.matmul at the copy)
  greedy, chain, batches = per_sentence_fit.decoders(workdir, data_dir)
  fns = {'greedy': greedy, 'chain': chain}
  for src in batches:  # compile and warm up
    for fn in fns.values():
      fn(src)
  seconds = {(name, on): 0.0 for name in fns for on in (0, 1)}
  for _ in range(passes):
    for src in batches:
      outs = []
      for on in (0, 1):
        switch(on)
        for name, fn in fns.items():
          start = time.perf_counter()
          outs.append(fn(src))
          seconds[(name, on)] += time.perf_counter() - start
      if not all(np.array_equal(o.tokens_BxL, outs[0].tokens_BxL) for o in outs):
        sys.exit('a decoder changed its output')
  ms = {key: 1e3 * s / (passes * len(batches)) for key, s in seconds.items()}
  print(f'\n{len(batches)} sentences x {passes} passes, mean ms a sentence, every output identical to greedy')
  print('| decoder | 6 x 16 | pairs | 6 x 16 / pairs |\n|---|---|---|---|')
  for name in fns:
    print(f'| {name} | {ms[(name, 0)]:.2f} | {ms[(name, 1)]:.2f} | {ms[(name, 0)] / ms[(name, 1)]:.3f}x |')
  print(f"chain / greedy: 6 x 16 {ms[('greedy', 0)] / ms[('chain', 0)]:.3f}x, "
        f"pairs {ms[('greedy', 1)] / ms[('chain', 1)]:.3f}x")


def main():
  parser = argparse.ArgumentParser()
  parser.add_argument('--model', default='', help='a trained Multi30k workdir (k = 10 sequential heads)')
  parser.add_argument('--data', default='../shared/data/multi30k')
  args = parser.parse_args()
  matmul, switch = skinny_row_blocking.load(switchable_library(pathlib.Path(tempfile.mkdtemp(prefix='bpd_pairs_'))),
                                            'pairs')
  if not matmul.kernel_info().startswith('avx2'):
    sys.exit('the two-row rule is AVX2 only; run on an AVX2 CPU, or with BPD_SKINNY_ISA=avx2')
  matrices(matmul, switch)
  if args.model:
    decoders(switch, args.model, args.data)
  switch(1)


if __name__ == '__main__':
  sys.exit(main())
