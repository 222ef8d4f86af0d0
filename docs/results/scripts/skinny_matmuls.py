"""One weight matrix at a time: XLA's product against the skinny kernel (plain and packed), M = 1..16 rows, in a
jitted loop of 100 products over a set of matrices (`--count` of them: 1 stays in cache, 30 x 1 MB does not),
alternating the programs, 20th percentile of 9 runs. Prints time per product, GB/s of weights read and GFLOP/s.

  python docs/results/scripts/skinny_matmuls.py
"""
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

from bpd import matmul

REPEATS, STEPS = 9, 100


def program(kernel, form, ws, packs):
  def run(x):
    with matmul.use(kernel):
      def body(_, x):
        acc = 0.0
        for w, p in zip(ws, packs):
          if form == 'nt':
            y = matmul.dense_nt(x, w)
          else:
            y = matmul.dense(x, w, packed=p if form == 'packed' else None)
          acc = acc + y[0, 0]
        return x + 1e-9 * acc
      return jax.lax.fori_loop(0, STEPS, body, x)
  return jax.jit(run)


def main():
  rng = np.random.default_rng(0)
  print(f'skinny kernel: {matmul.kernel_info()}')
  print('| weights | M | XLA µs | skinny µs | skinny packed µs | packed GB/s | packed GFLOP/s | packed vs XLA |')
  print('|---|---|---|---|---|---|---|---|')
  for name, k, n, count, nt in (('[256, 1024] x1 (in cache)', 256, 1024, 1, False),
                                ('[256, 1024] x30 (31 MB)', 256, 1024, 30, False),
                                ('[1024, 256] x30 (31 MB)', 1024, 256, 30, False),
                                ('[2048, 512] x8 (34 MB, base ff)', 2048, 512, 8, False),
                                ('vocabulary [4000, 256]^T', 256, 4000, 1, True)):
    ws = [jnp.asarray(rng.standard_normal((n, k) if nt else (k, n)), jnp.float32) for _ in range(count)]
    packs = [None] * count if nt else [jax.jit(matmul.pack)(w) for w in ws]
    for m in (1, 4, 8, 16):
      x = jnp.asarray(rng.standard_normal((m, k)), jnp.float32)
      forms = {'xla': ('xla', 'nt' if nt else 'plain'), 'skinny': ('skinny', 'nt' if nt else 'plain'),
               'packed': ('skinny', 'nt' if nt else 'packed')}
      fns = {key: program(kernel, form, ws, packs) for key, (kernel, form) in forms.items()}
      for fn in fns.values():
        jax.block_until_ready(fn(x))
      times = {key: [] for key in fns}
      for _ in range(REPEATS):
        for key, fn in fns.items():
          start = time.perf_counter()
          jax.block_until_ready(fn(x))
          times[key].append((time.perf_counter() - start) / STEPS / count)
      t = {key: float(np.percentile(v, 20)) for key, v in times.items()}
      bytes_, flops = k * n * 4, 2 * m * k * n
      print(f"| {name} | {m} | {t['xla'] * 1e6:.1f} | {t['skinny'] * 1e6:.1f} | {t['packed'] * 1e6:.1f} | "
            f"{bytes_ / t['packed'] / 1e9:.0f} | {flops / t['packed'] / 1e9:.0f} | {t['xla'] / t['packed']:.2f}x |",
            flush=True)


if __name__ == '__main__':
  sys.exit(main())
