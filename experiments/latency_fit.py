r"""Where a batch-1 decode's time goes: per-sentence time = fixed cost + per-step cost x steps, greedy and blockwise.

  python -m experiments.latency_fit --config=configs/demo.py:regime=finetune,k=4 --workdir=runs/demo_b1 --k=4

Each sentence of the split's first --examples is decoded alone (its own call: encoder, loop, host copy), greedy and
then blockwise (--criterion), alternating, --repeats times, after a warm-up on the first sentences. A least-squares
line through (steps, seconds) per decoder splits its time into what every sentence pays once (encoder, first call,
dispatch, copy back) and what each greedy step or blockwise iteration costs inside the real loop: the first is why
the end-to-end speedup at batch 1 is below block / iteration ratio, the second is that ratio as the decoder runs it
(bench_decode times a loop of random weights at a fixed length).
"""

import sys
import time

from absl import app
from absl import flags
import jax
import numpy as np

from bpd import decoder as decoder_lib
from bpd import decoding
from bpd import errors
from bpd import evaluate
from bpd import metrics
from bpd import sharding
from bpd import tasks
from bpd import timing
from bpd.data import batching
from bpd.errors import UserError

# Flags exist only when this file runs as a script: importing it (tests, another script) defines none.
if __name__ == '__main__':
  _CONFIG = errors.define_config_file('config', 'configs/demo.py:regime=finetune,k=4', 'The decode config.')
  _WORKDIR = flags.DEFINE_string('workdir', None, 'The k-head model.', required=True)
  _SPLIT = flags.DEFINE_string('split', '', "The split (default: the config's first decode split).")
  _K = flags.DEFINE_integer('k', 4, "Heads k' of the blockwise decoder.")
  _CRITERION = flags.DEFINE_string('criterion', 'exact', 'Acceptance criterion.')
  _EXAMPLES = flags.DEFINE_integer('examples', 100, 'Sentences to decode, from the first.')
  _REPEATS = flags.DEFINE_integer('repeats', 3, 'Passes over the sentences.')


def fit(steps, seconds):
  """(fixed seconds, seconds per step) of the least-squares line seconds = fixed + per_step * steps."""
  design = np.stack([np.ones_like(steps), steps], axis=1)
  fixed, per_step = np.linalg.lstsq(design, seconds, rcond=None)[0]
  return float(fixed), float(per_step)


def main(argv):
  del argv
  metrics.quiet_library_logs()
  config, workdir = _CONFIG.value, _WORKDIR.value
  task = tasks.for_config(config)
  try:
    criterion = decoding.parse_criterion(_CRITERION.value)
    model_config, params, _, tokenizer, decoder = evaluate.load_for_decoding(config, workdir, task,
                                                                             sharding.make_mesh(1))
    if not 1 < _K.value <= model_config.k:
      raise UserError(f'--k={_K.value}: choose 2..{model_config.k} (the heads of the model in {workdir}).')
  except UserError as e:
    print(f'error: {e}', file=sys.stderr)
    sys.exit(2)
  src_ids = task.decode_examples(config, _SPLIT.value or config.decode.splits[0], tokenizer)[0][:_EXAMPLES.value]
  batches = [src for _, src in batching.eval_batches(src_ids, None, 1, decoder_lib.source_buckets(src_ids))]

  def greedy(src_1xS):
    return int(jax.device_get(decoder.greedy(params, src_1xS).length_B)[0])  # tokens = greedy steps

  def blockwise(src_1xS):
    result = decoder.blockwise(params, src_1xS, criterion, decoder_lib.chain(_K.value))
    return int(jax.device_get(result.iterations_B)[0])

  # Compile and warm up on every padded source length that is timed (run_batches pads each sentence to its own
  # multiple of 8, decoder.source_buckets), then time with no compile allowed.
  for src in list({src.shape[1]: src for src in batches}.values()) + batches[:3]:
    greedy(src), blockwise(src)
  rows = {'greedy': [], 'blockwise': []}
  with timing.no_compiles('latency_fit'):
    for _ in range(_REPEATS.value):
      for src in batches:
        for name, fn in (('greedy', greedy), ('blockwise', blockwise)):
          start = time.perf_counter()
          steps = fn(src)
          rows[name].append((steps, time.perf_counter() - start))
  print(f'{len(batches)} sentences x {_REPEATS.value} passes, batch 1, k = {_K.value}, {_CRITERION.value}')
  print('| decoder | ms per sentence | steps per sentence | fixed ms per sentence | ms per step |')
  print('|---|---|---|---|---|')
  per_step = {}
  for name, label in (('greedy', 'greedy (step = token)'), ('blockwise', 'blockwise (step = iteration)')):
    steps, seconds = (np.array(column, dtype=np.float64) for column in zip(*rows[name]))
    fixed, per_step[name] = fit(steps, seconds)
    print(f'| {label} | {seconds.mean() * 1e3:.2f} | {steps.mean():.2f} | {fixed * 1e3:.3f} | '
          f'{per_step[name] * 1e3:.3f} |')
  print(f'iteration / greedy step inside the loop: {per_step["blockwise"] / per_step["greedy"]:.2f}')


if __name__ == '__main__':
  app.run(main)
