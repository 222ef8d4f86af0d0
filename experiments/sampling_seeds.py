r"""Quality of sampled outputs across seeds: ancestral sampling against speculative sampling with k' heads.

  python -m experiments.sampling_seeds --config=configs/multi30k_ende.py:k=10,regime=finetune \
      --workdir=runs/m30k_both/finetune_distilled --temperature=1.0 --seeds=0-8 --ks=1,4

One sample of every example of the split per seed and sampler (batch --batch_size), scored as the decode sweep scores
it (BLEU or PSNR), plus the mean output length. Speculative sampling is exact in distribution (docs/speculative.md),
so its quality differs from ancestral sampling's only by the draw: the seed-to-seed spread printed here is the
yardstick for the one-seed rows of a decode sweep (`sample:T` against `k<k'>.speculative`).
"""

import sys

from absl import app
from absl import flags
import numpy as np

from bpd import decoder as decoder_lib
from bpd import errors
from bpd import evaluate
from bpd import metrics
from bpd import sharding
from bpd import speculative as speculative_lib
from bpd import tasks
from bpd.errors import UserError

# Flags exist only when this file runs as a script: importing it (tests, another script) defines none.
if __name__ == '__main__':
  _CONFIG = errors.define_config_file('config', 'configs/multi30k_ende.py:k=10,regime=finetune', 'The decode config.')
  _WORKDIR = flags.DEFINE_string('workdir', None, 'The k-head model to sample from.', required=True)
  _SPLIT = flags.DEFINE_string('split', '', 'The split (default: the config\'s first decode split).')
  _TEMPERATURE = flags.DEFINE_float('temperature', 1.0, 'Sampling temperature (> 0).')
  _SEEDS = flags.DEFINE_string('seeds', '0-4', 'Seeds as FIRST-LAST (inclusive).')
  _KS = flags.DEFINE_list('ks', ['1', '4'], "Heads k' of the speculative sampler.")
  _BATCH_SIZE = flags.DEFINE_integer('batch_size', 32, 'Decode batch size.')


def parse_seeds(text) -> range:
  first, sep, last = text.partition('-')
  try:
    seeds = range(int(first), int(last if sep else first) + 1)
  except ValueError:
    seeds = range(0)
  if not seeds:
    raise UserError(f'--seeds={text!r}: write FIRST-LAST with FIRST <= LAST, e.g. --seeds=0-8.')
  return seeds


def main(argv):
  del argv
  metrics.quiet_library_logs()
  config, workdir, temperature = _CONFIG.value, _WORKDIR.value, _TEMPERATURE.value
  task = tasks.for_config(config)
  try:
    seeds, ks = parse_seeds(_SEEDS.value), [int(k) for k in _KS.value]
    if temperature <= 0:
      raise UserError(f'--temperature={temperature}: sampling needs a temperature > 0.')
    model_config, params, _, tokenizer, decoder = evaluate.load_for_decoding(config, workdir, task,
                                                                             sharding.make_mesh(1))
    if max(ks) > model_config.k:
      raise UserError(f'--ks={_KS.value}: the model in {workdir} has k={model_config.k} heads.')
  except UserError as e:
    print(f'error: {e}', file=sys.stderr)
    sys.exit(2)
  split = _SPLIT.value or config.decode.splits[0]
  src_ids, references, _ = task.decode_examples(config, split, tokenizer)
  bucket = decoder_lib.source_bucket(src_ids)

  def score(fn):
    out, _ = decoder_lib.run_batches(fn, src_ids, _BATCH_SIZE.value, bucket=bucket)
    outputs = task.outputs(tokenizer, [o.tokens_BxL for o in out])
    quality = task.scores(outputs, references, outputs)['quality']
    return quality, float(np.mean([int(o.length_B) for o in out]))

  def speculative(k, seed):
    return lambda src_BxS: decoder.blockwise(params, src_BxS, speculative_lib.Sampling(temperature=temperature),
                                             decoder_lib.chain(k), seed=seed)

  names = ['ancestral'] + [f'speculative k={k}' for k in ks]
  table = {name: [] for name in names}
  print(f'| seed | ' + ' | '.join(f'{n} {task.quality_metric} (mean length)' for n in names) + ' |')
  print('|---' * (1 + len(names)) + '|')
  for seed in seeds:
    row = [score(lambda src, seed=seed: decoder.sample(params, src, temperature, seed))]
    row += [score(speculative(k, seed)) for k in ks]
    for name, cell in zip(names, row):
      table[name].append(cell[0])
    print(f'| {seed} | ' + ' | '.join(f'{q:.2f} ({n:.2f})' for q, n in row) + ' |', flush=True)
  print('| mean ± s.e. | ' + ' | '.join(
      f'{np.mean(table[n]):.2f} ± {np.std(table[n], ddof=1) / np.sqrt(len(seeds)) if len(seeds) > 1 else 0:.2f}'
      for n in names) + ' |')


if __name__ == '__main__':
  app.run(main)
