r"""The price of verification: time of one blockwise iteration / time of one greedy step.

  python -m experiments.bench_decode --config=configs/multi30k_ende.py --json=bench.json

For the model size in the config (random weights), both decoders run their real jitted `lax.while_loop`s
over the same encoder state, side by side in one process, after compile and warm-up:
  greedy:    `max_len` steps, one token each (eos_id = -1 so no row stops early);
  blockwise: criterion min_block:k, so every iteration scores k tokens, accepts k and proposes the next
             k; max_len / k iterations plus the initial proposal call.
greedy_step_s = greedy time / max_len; block_step_s = (blockwise time - one greedy step, for the initial
proposal call) / iterations. Each time is the median of --repeats runs, greedy and blockwise alternating.
For one sequence of m tokens decoded in m / k̂ iterations (k̂ = mean accepted block size), the wall-clock
speedup is about m / ((m / k̂ + 1) · ratio), i.e. k̂ / ratio for long outputs; in a batch the loop runs until
its slowest row is done. On accelerators the ratio is close to 1.
"""

import functools
import json
import statistics
import time

from absl import app
from absl import flags
import jax
import jax.numpy as jnp
from ml_collections import config_flags
import numpy as np

from bpd import decoding
from bpd import model as model_lib

_CONFIG = config_flags.DEFINE_config_file('config', None, 'Config file; its model size and vocabulary are used.')
_JSON = flags.DEFINE_string('json', None, 'Write the records here as a JSON list.')
_KS = flags.DEFINE_list('ks', ['2', '4', '6', '8', '10'], 'Block sizes k to time.')
_BATCH_SIZES = flags.DEFINE_list('batch_sizes', ['1', '8', '32'], 'Batch sizes to time.')
_MAX_LEN = flags.DEFINE_integer('max_len', 120, 'Tokens decoded per run (a multiple of every k keeps '
                                'every block full).')
_SRC_LEN = flags.DEFINE_integer('src_len', 24, 'Source length.')
_REPEATS = flags.DEFINE_integer('repeats', 5, 'Timed runs per setting (median reported).')

BOS = 2
NEVER = -1  # an EOS id that argmax never returns: every row decodes max_len tokens


def _time(fn, *args):
  start = time.perf_counter()
  jax.block_until_ready(fn(*args))
  return time.perf_counter() - start


def bench(model, params, k_values, batch_sizes, max_len, src_len, repeats, seed=0):
  """Returns a list of {k, batch_size, greedy_step_s, block_step_s, ratio, ...} records."""
  cache_len = max_len + max(k_values) + 1

  @jax.jit
  def encode(params, src):
    init_state, _, _ = model_lib.decode_fns(model, params)
    return init_state(src, cache_len)

  @jax.jit
  def run_greedy(params, state):
    _, score_fn, _ = model_lib.decode_fns(model, params)
    return decoding.greedy(score_fn, state, batch_size=state['src_mask_BxS'].shape[0], max_len=max_len,
                           bos_id=BOS, eos_id=NEVER)[0]

  @functools.partial(jax.jit, static_argnames='k')
  def run_block(params, state, k):
    _, score_fn, propose_fn = model_lib.decode_fns(model, params, num_heads=k)
    result = decoding.blockwise(score_fn, propose_fn, state, batch_size=state['src_mask_BxS'].shape[0], k=k,
                                max_len=max_len, bos_id=BOS, eos_id=NEVER,
                                criterion=decoding.Criterion(min_block=k))
    return result.tokens_BxL, result.invocations

  records = []
  rng = np.random.RandomState(seed)
  for batch_size in batch_sizes:
    src = jnp.asarray(rng.randint(4, model.config.vocab_size, size=(batch_size, src_len)), jnp.int32)
    state = jax.block_until_ready(encode(params, src))
    _time(run_greedy, params, state)  # compile + warm-up
    invocations = {}
    for k in k_values:
      _time(functools.partial(run_block, k=k), params, state)
      invocations[k] = int(run_block(params, state, k=k)[1])
    greedy_times = []
    block_times = {k: [] for k in k_values}
    for _ in range(repeats):
      greedy_times.append(_time(run_greedy, params, state))
      for k in k_values:
        block_times[k].append(_time(functools.partial(run_block, k=k), params, state))
    greedy_step = statistics.median(greedy_times) / max_len
    for k in k_values:
      iterations = invocations[k] - 1  # the first invocation only proposes; it costs about one greedy step
      block_step = (statistics.median(block_times[k]) - greedy_step) / iterations
      records.append({'k': k, 'batch_size': batch_size, 'greedy_step_s': greedy_step, 'block_step_s': block_step,
                      'ratio': block_step / greedy_step, 'iterations': iterations, 'max_len': max_len})
  return records


def format_table(records, title=''):
  lines = [title] if title else []
  lines += ['| k | batch | greedy step (ms) | blockwise iteration (ms) | ratio |', '|---|---|---|---|---|']
  for r in records:
    lines.append(f"| {r['k']} | {r['batch_size']} | {1e3 * r['greedy_step_s']:.2f} | "
                 f"{1e3 * r['block_step_s']:.2f} | {r['ratio']:.2f} |")
  return '\n'.join(lines)


def main(argv):
  del argv
  config = _CONFIG.value
  k_values = [int(k) for k in _KS.value]
  model_config = model_lib.model_config(config.model.size, vocab_size=config.data.vocab_size, k=max(k_values),
                                        dropout_rate=0.0, dtype=config.model.dtype)
  model = model_lib.Transformer(model_config)
  params = model_lib.init_params(model_config, jax.random.PRNGKey(0))
  records = bench(model, params, k_values, [int(b) for b in _BATCH_SIZES.value], _MAX_LEN.value, _SRC_LEN.value,
                  _REPEATS.value)
  c = model_config
  title = (f'model {config.model.size}: d={c.d_model}, {c.num_encoder_layers}+{c.num_decoder_layers} layers, '
           f'ff {c.d_ff}, vocab {c.vocab_size}; {jax.devices()[0].platform}, {len(jax.devices())} device(s); '
           f'{_MAX_LEN.value} tokens per run, median of {_REPEATS.value}')
  print(format_table(records, title))
  if _JSON.value:
    with open(_JSON.value, 'w') as f:
      json.dump(records, f, indent=1)


if __name__ == '__main__':
  flags.mark_flags_as_required(['config'])
  app.run(main)
