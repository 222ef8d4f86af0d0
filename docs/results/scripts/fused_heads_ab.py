r"""Multi30k Both at batch 1: greedy, and the k' = 4 chain with sequential heads one kernel call per product
(decode.fused_heads=False) and in one library call (True), each decoder over all the sentences per pass (warm
weights, as bench_decode --alternate=pass), passes alternating; every output checked against greedy's.

  python docs/results/scripts/fused_heads_ab.py --workdir=ROOT/ablate_self_greedy_sequential \
      --data_dir=../shared/data/multi30k [--examples=60 --repeats=5 --head_weights=int8 --draft_vocab=1000 --k=4]
"""
import dataclasses

import jax
import numpy as np
from absl import app, flags

from bpd import decoder as decoder_lib, decoding, evaluate, matmul, model as model_lib, tasks, timing
from bpd.data import batching
from configs import multi30k_ende

_WORKDIR = flags.DEFINE_string('workdir', None, 'The Multi30k Both model (k = 10 sequential heads).', required=True)
_DATA = flags.DEFINE_string('data_dir', '../shared/data/multi30k', 'Multi30k text files.')
_EXAMPLES = flags.DEFINE_integer('examples', 60, 'The first N sentences of test_2016_flickr.')
_REPEATS = flags.DEFINE_integer('repeats', 5, 'Passes per decoder; medians.')
_HEAD_WEIGHTS = flags.DEFINE_string('head_weights', 'int8', 'decode.head_weights of the chains.')
_DRAFT = flags.DEFINE_integer('draft_vocab', 1000, 'model.draft_vocab of the chains (0: the whole vocabulary).')
_K = flags.DEFINE_integer('k', 4, "Heads the chain proposes with (k').")


def main(_):
  config = multi30k_ende.get_config('k=10')
  config.data.dir = _DATA.value
  config.model.draft_vocab = _DRAFT.value
  task = tasks.for_config(config)
  model_config, params, _, tokenizer, loaded = evaluate.load_for_decoding(config, _WORKDIR.value, task)
  src_ids = task.decode_examples(config, 'test_2016_flickr', tokenizer)[0][:_EXAMPLES.value]
  batches = [src for _, src in batching.eval_batches(src_ids, None, 1, decoder_lib.source_buckets(src_ids))]
  make = lambda config_, **kw: decoder_lib.Decoder(model_lib.Transformer(config_), loaded.max_len, None,
                                                   eos_id=loaded.eos_id, matmul_kernel='skinny', **kw)
  greedy = make(dataclasses.replace(model_config, draft_ids=()))
  chains = {fused: make(model_config, head_weights=_HEAD_WEIGHTS.value, fused_heads=fused) for fused in (False, True)}
  chain = decoding.chain(_K.value)
  every = lambda decode: (lambda: [jax.device_get(decode(src)) for src in batches])
  programs = {'greedy, skinny': every(lambda src: greedy.greedy(params, src))}
  for fused, decoder in chains.items():
    programs[f"chain k'={_K.value}, fused_heads={fused}"] = every(
        lambda src, d=decoder: d.blockwise(params, src, decoding.EXACT, chain))
  outputs = {name: run() for name, run in programs.items()}
  reference = outputs['greedy, skinny']
  seconds = timing.time_alternating(list(programs.values()), _REPEATS.value, 'passes', np.median)
  print(f'{len(batches)} sentences x {_REPEATS.value} passes, batch 1; heads {_HEAD_WEIGHTS.value}, draft vocabulary '
        f'{_DRAFT.value or "-"}; kernel {matmul.kernel_info()}')
  print('| decoder | ms per sentence | speedup vs greedy | iterations (steps) per sentence | identical to greedy |')
  print('|---|---|---|---|---|')
  for (name, out), s in zip(outputs.items(), seconds):
    same = np.mean([np.array_equal(a.tokens_BxL, b.tokens_BxL) for a, b in zip(out, reference)])
    count = np.mean([int((o.length_B if name.startswith('greedy') else o.iterations_B)[0]) for o in out])
    print(f'| {name} | {s / len(batches) * 1e3:.2f} | {seconds[0] / s:.2f}x | {count:.2f} | {same:.3f} |')


if __name__ == '__main__':
  app.run(main)
