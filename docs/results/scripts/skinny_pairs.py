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
import ctypes
import dataclasses
import pathlib
import subprocess
import sys
import tempfile
import time

import jax
import jax.numpy as jnp
import numpy as np

from bpd.kernels import build

sys.path.insert(0, str(pathlib.Path(__file__).parent))
import skinny_row_blocking  # pylint: disable=wrong-import-position

STEPS, REPEATS = skinny_row_blocking.STEPS, skinny_row_blocking.REPEATS


def switchable_library(directory: pathlib.Path) -> pathlib.Path:
  """The kernel library built from a copy of bpd/kernels whose two-row rule is switched at run time."""
  import shutil  # pylint: disable=import-outside-toplevel
  shutil.copytree(build.HERE, directory, dirs_exist_ok=True)
  units, ffi = directory / 'skinny_units.h', directory / 'skinny_ffi.cc'
  text = units.read_text()
  rule = 'const bool pairs = M > 2 && M <= kPairsUpTo;'
  if rule not in text:
    sys.exit('skinny_units.h no longer has the two-row rule this script switches; update the script.')
  text = text.replace(rule, 'const bool pairs = g_pairs && M > 2 && M <= kPairsUpTo;')
  units.write_text(text.replace('namespace bpd {\nnamespace {', 'namespace bpd {\nextern int g_pairs;\nnamespace {', 1))
  text = ffi.read_text().replace('namespace bpd {\nnamespace {', 'namespace bpd {\nint g_pairs = 1;\nnamespace {', 1)
  ffi.write_text(text.replace('extern "C" {', 'extern "C" {\n__attribute__((visibility("default"))) void '
                              'bpd_pairs(int on) { bpd::g_pairs = on; }', 1))
  include = jax.ffi.include_dir()
  objects = []
  for name in build.SOURCES:
    obj = str(directory / (name + '.o'))
    subprocess.run([build.compiler(), *build.COMMON_FLAGS, *build.ISA_FLAGS[name], f'-I{include}', '-c',
                    str(directory / name), '-o', obj], check=True)
    objects.append(obj)
  library = directory / build.LIBRARY
  subprocess.run([build.compiler(), '-shared', '-pthread', *objects, '-o', str(library)], check=True)
  return library


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


def decoders(switch, workdir, data_dir, passes=3, sentences=60):
  from bpd import decoder as decoder_lib, decoding, draft_vocab, evaluate, sharding, tasks  # pylint: disable=import-outside-toplevel
  from bpd import model as model_lib  # pylint: disable=import-outside-toplevel
  from bpd.data import batching  # pylint: disable=import-outside-toplevel
  from configs import multi30k_ende  # pylint: disable=import-outside-toplevel
  config = multi30k_ende.get_config('k=10')
  config.data.dir = data_dir
  task = tasks.for_config(config)
  model_config, params, _, tokenizer, decoder = evaluate.load_for_decoding(config, workdir, task, sharding.make_mesh(1))
  full = dataclasses.replace(model_config, draft_ids=())
  drafting = model_lib.Transformer(draft_vocab.for_decoding(2000, full, lambda: task.target_counts(config, tokenizer)))
  greedy = decoder_lib.Decoder(model_lib.Transformer(full), decoder.max_len, None, decoder.eos_id, matmul_kernel='skinny')
  chain = decoder_lib.Decoder(drafting, decoder.max_len, None, decoder.eos_id, matmul_kernel='skinny',
                              head_weights='float16')
  rule, tree = decoding.parse_criterion('exact'), decoding.chain(4)
  src_ids = task.decode_examples(config, 'test_2016_flickr', tokenizer)[0][:sentences]
  batches = [src for _, src in batching.eval_batches(src_ids, None, 1, decoder_lib.source_buckets(src_ids))]
  fns = {'greedy': lambda src: jax.device_get(greedy.greedy(params, src)),
         'chain': lambda src: jax.device_get(chain.blockwise(params, src, rule, tree))}
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
  library = switchable_library(pathlib.Path(tempfile.mkdtemp(prefix='bpd_pairs_')))
  build.library_path = lambda: library  # bpd.matmul loads and registers this copy
  from bpd import matmul  # pylint: disable=import-outside-toplevel
  switch = ctypes.CDLL(str(library)).bpd_pairs
  print(f'skinny kernel: {matmul.kernel_info()}')
  if not matmul.kernel_info().startswith('avx2'):
    sys.exit('the two-row rule is AVX2 only; run on an AVX2 CPU, or with BPD_SKINNY_ISA=avx2')
  matrices(matmul, switch)
  if args.model:
    decoders(switch, args.model, args.data)
  switch(1)


if __name__ == '__main__':
  sys.exit(main())
