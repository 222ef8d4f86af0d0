"""The skinny kernel's two row blockings on AVX2, side by side in one process: tall blocks (up to 12 rows x 8
columns, the rule before every M took wide blocks) against wide blocks (6 rows x 16 columns, re-reading each
weight strip from cache per 6 rows), for M = 7..64 rows, packed float32 weights in cache (1 matrix) and from
memory (30 matrices). Both blockings must give the same bits; the script checks it. (Three to eight rows now go
two at a time whatever this switch says, skinny_pairs.py: rows 7 and 8 time the same code either way.)

How: it copies bpd/kernels to a temporary directory, adds a switch that the timing loop flips between runs
(`bpd_only_wide(0 | 1)`), builds that copy, and points bpd.matmul at it. 20th percentile of 9 alternating runs
of a jitted loop of 50 products per matrix.

  python docs/results/scripts/skinny_row_blocking.py [--rows=7,8,12,16,24,32,48,64]
"""
import argparse
import ctypes
import functools
import pathlib
import shutil
import subprocess
import sys
import tempfile
import time

import jax
import jax.numpy as jnp
import numpy as np

from bpd.kernels import build

STEPS, REPEATS = 50, 9


def library_with_switch(directory: pathlib.Path, rule: str, switched: str, name: str, default: int,
                        more: dict = None) -> pathlib.Path:
  """The kernel library built from a copy of bpd/kernels in which skinny_units.h's line `rule` reads `switched`
  instead (and each line of `more` its value), `switched` testing a global int g_NAME (initially `default`) that
  bpd_NAME(int) sets at run time."""
  shutil.copytree(build.HERE, directory, dirs_exist_ok=True)
  units, ffi = directory / 'skinny_units.h', directory / 'skinny_ffi.cc'
  text = units.read_text()
  for line, value in {rule: switched, **(more or {})}.items():
    if line not in text:
      sys.exit(f'skinny_units.h no longer has the rule this script switches ({line}); update the script.')
    text = text.replace(line, value)
  units.write_text(text.replace('namespace bpd {\nnamespace {', f'namespace bpd {{\nextern int g_{name};\nnamespace {{', 1))
  text = ffi.read_text().replace('namespace bpd {\nnamespace {',
                                 f'namespace bpd {{\nint g_{name} = {default};\nnamespace {{', 1)
  ffi.write_text(text.replace('extern "C" {', 'extern "C" {\n__attribute__((visibility("default"))) void '
                              f'bpd_{name}(int on) {{ bpd::g_{name} = on; }}', 1))
  include = jax.ffi.include_dir()
  objects = []
  for source in build.SOURCES:
    obj = str(directory / (source + '.o'))
    subprocess.run([build.compiler(), *build.COMMON_FLAGS, *build.ISA_FLAGS[source], f'-I{include}', '-c',
                    str(directory / source), '-o', obj], check=True)
    objects.append(obj)
  library = directory / build.LIBRARY
  subprocess.run([build.compiler(), '-shared', '-pthread', *objects, '-o', str(library)], check=True)
  return library


def switchable_library(directory: pathlib.Path) -> pathlib.Path:
  """The kernel library built from a copy of bpd/kernels whose AVX2 row blocking is chosen at run time."""
  return library_with_switch(directory, 'const bool wide = kOnlyWide || M <= kWideMr;',
                             'const bool wide = (kOnlyWide && g_only_wide) || M <= kWideMr;', 'only_wide', 1)


def load(library: pathlib.Path, name: str):
  """(bpd.matmul, the switch bpd_NAME of `library`): bpd.matmul loads and registers `library`, a switchable copy."""
  build.library_path = lambda: library
  from bpd import matmul  # pylint: disable=import-outside-toplevel
  print(f'skinny kernel: {matmul.kernel_info()}')
  return matmul, getattr(ctypes.CDLL(str(library)), f'bpd_{name}')


def program(matmul, ws, packs, steps=STEPS):
  """fn(x): a jitted loop of `steps` passes, each one product of x with every matrix of ws (read packed)."""
  def run(x, ws, packs):  # the weights as arguments: closed over, XLA would embed them as constants
    with matmul.use('skinny'):
      def body(_, x):
        acc = 0.0
        for w, p in zip(ws, packs):
          acc = acc + matmul.dense(x, w, packed=p)[0, 0]
        return x + 1e-9 * acc
      return jax.lax.fori_loop(0, steps, body, x)
  return functools.partial(jax.jit(run), ws=ws, packs=packs)


def main():
  parser = argparse.ArgumentParser()
  parser.add_argument('--rows', default='7,8,12,16,24,32,48,64')
  rows = [int(m) for m in parser.parse_args().rows.split(',')]
  matmul, switch = load(switchable_library(pathlib.Path(tempfile.mkdtemp(prefix='bpd_row_blocking_'))), 'only_wide')
  if not matmul.kernel_info().startswith('avx2'):
    sys.exit('the switch only changes the AVX2 path (AVX-512 keeps its tall blocks); run on an AVX2 CPU, or with '
             'BPD_SKINNY_ISA=avx2')
  print('| weights | M | tall µs | wide µs | wide GFLOP/s | tall / wide |')
  print('|---|---|---|---|---|---|')
  rng = np.random.default_rng(0)
  for name, k, n, count in (('[256, 1024] x1 (in cache)', 256, 1024, 1), ('[256, 1024] x30 (31 MB)', 256, 1024, 30),
                            ('[1024, 256] x30 (31 MB)', 1024, 256, 30), ('[256, 256] x30 (8 MB)', 256, 256, 30)):
    ws = [jnp.asarray(rng.standard_normal((k, n)), jnp.float32) for _ in range(count)]
    packs = [jax.jit(matmul.pack)(w) for w in ws]
    fn = program(matmul, ws, packs)
    for m in rows:
      x = jnp.asarray(rng.standard_normal((m, k)), jnp.float32)
      outs = {}
      for wide in (0, 1):
        switch(wide)
        outs[wide] = np.asarray(fn(x))
      if not np.array_equal(outs[0], outs[1]):
        sys.exit(f'{name} M={m}: the two blockings gave different bits')
      times = {0: [], 1: []}
      for _ in range(REPEATS):
        for wide in (0, 1):
          switch(wide)
          start = time.perf_counter()
          jax.block_until_ready(fn(x))
          times[wide].append((time.perf_counter() - start) / STEPS / count)
      tall, wide = (float(np.percentile(times[w], 20)) for w in (0, 1))
      print(f'| {name} | {m} | {tall * 1e6:.1f} | {wide * 1e6:.1f} | {2 * m * k * n / wide / 1e9:.0f} | '
            f'{tall / wide:.2f}x |', flush=True)
  switch(1)


if __name__ == '__main__':
  sys.exit(main())
