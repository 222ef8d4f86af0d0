"""Where a trained Multi30k model's batch-1 time goes, sentence by sentence: greedy and the k' = 4 chain (float16
heads, a 2000-token draft vocabulary), both on the skinny kernel, alternating sentence by sentence (3 passes over
the first 60 test_2016_flickr sentences); then least-squares fits of each decoder's milliseconds against its steps
(tokens or iterations), with and without the source length, to see whether the intercept ("fixed cost") of
`bench_decode --mode=latency` holds once the source length is a regressor of its own.

  python docs/results/scripts/per_sentence_fit.py WORKDIR [DATA_DIR]
"""
import dataclasses
import sys
import time

import jax
import numpy as np

from bpd import decoder as decoder_lib
from bpd import decoding, draft_vocab, evaluate, sharding, tasks
from bpd import model as model_lib
from bpd.data import batching
from configs import multi30k_ende


def decoders(workdir, data_dir='../shared/data/multi30k', k=4, draft=2000, sentences=60):
  """(greedy, chain, batches): run_greedy(src) and run_chain(src) decode one padded batch to host results, both on
  the skinny kernel (the chain: k' = k, float16 heads, the `draft` most frequent target tokens); batches: the first
  `sentences` of test_2016_flickr at batch 1. Also skinny_pairs.py's subjects."""
  config = multi30k_ende.get_config('k=10')
  config.data.dir = data_dir
  task = tasks.for_config(config)
  model_config, params, _, tokenizer, decoder = evaluate.load_for_decoding(config, workdir, task,
                                                                           sharding.make_mesh(1))
  full = dataclasses.replace(model_config, draft_ids=())
  drafting = model_lib.Transformer(draft_vocab.for_decoding(draft, full, lambda: task.target_counts(config, tokenizer)))
  greedy = decoder_lib.Decoder(model_lib.Transformer(full), decoder.max_len, None, decoder.eos_id,
                               matmul_kernel='skinny')
  chain = decoder_lib.Decoder(drafting, decoder.max_len, None, decoder.eos_id, matmul_kernel='skinny',
                              head_weights='float16')
  rule, tree = decoding.parse_criterion('exact'), decoding.chain(k)
  src_ids = task.decode_examples(config, 'test_2016_flickr', tokenizer)[0][:sentences]
  batches = [src for _, src in batching.eval_batches(src_ids, None, 1, decoder_lib.source_buckets(src_ids))]
  run_greedy = lambda src: jax.device_get(greedy.greedy(params, src))
  run_chain = lambda src: jax.device_get(chain.blockwise(params, src, rule, tree))
  return run_greedy, run_chain, batches


def main(workdir, data_dir='../shared/data/multi30k', k=4, draft=2000, sentences=60, passes=3):
  run_greedy, run_chain, batches = decoders(workdir, data_dir, k, draft, sentences)
  for src in batches:  # compile and warm up on every padded length
    run_greedy(src)
    run_chain(src)
  rows = []
  for _ in range(passes):
    for src in batches:
      t0 = time.perf_counter()
      out_greedy = run_greedy(src)
      t1 = time.perf_counter()
      out_chain = run_chain(src)
      t2 = time.perf_counter()
      if not np.array_equal(out_greedy.tokens_BxL, out_chain.tokens_BxL):
        raise AssertionError('the chain differs from greedy on a sentence')
      rows.append((int((src > 0).sum()), int(out_greedy.length_B[0]), int(out_chain.iterations_B[0]), t1 - t0, t2 - t1))
  source, tokens, iterations, ms_greedy, ms_chain = (np.array(c, np.float64) for c in zip(*rows))
  ms_greedy, ms_chain = 1e3 * ms_greedy, 1e3 * ms_chain

  def fit(columns, y):
    a = np.column_stack([np.ones(len(y))] + columns)
    return ', '.join(f'{c:.3f}' for c in np.linalg.lstsq(a, y, rcond=None)[0])

  print(f'{len(batches)} sentences x {passes} passes; means: greedy {ms_greedy.mean():.2f} ms, chain k\' = {k} '
        f'{ms_chain.mean():.2f} ms ({ms_greedy.mean() / ms_chain.mean():.2f}x); {tokens.mean():.2f} tokens, '
        f'{iterations.mean():.2f} iterations, {source.mean():.1f} source tokens a sentence')
  print('| fit (ms) | coefficients |\n|---|---|')
  print(f'| greedy = a + b tokens | {fit([tokens], ms_greedy)} |')
  print(f'| greedy = a + b tokens + c source | {fit([tokens, source], ms_greedy)} |')
  print(f'| chain = a + b iterations | {fit([iterations], ms_chain)} |')
  print(f'| chain = a + b iterations + c source | {fit([iterations, source], ms_chain)} |')
  print(f'| chain = a + b iterations + c tokens | {fit([iterations, tokens], ms_chain)} |')
  print(f'correlation of iterations and tokens {np.corrcoef(iterations, tokens)[0, 1]:.2f}, '
        f'of tokens and source {np.corrcoef(tokens, source)[0, 1]:.2f}')


if __name__ == '__main__':
  main(*sys.argv[1:])
