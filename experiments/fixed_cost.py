r"""A batch-1 sentence's fixed cost, broken down: dispatch, encoder, first call, loop, copy back; greedy and blockwise.

  python -m experiments.fixed_cost --config=configs/multi30k_ende.py --k=4              # random weights
  python -m experiments.fixed_cost --config=configs/demo.py:regime=finetune,k=4 --workdir=DIR --k=4
  python -m experiments.fixed_cost --config=configs/multi30k_ende.py --k=4 --before_pad_to=48 --trace

experiments/latency_fit.py fits a sentence's time as fixed + steps x per step on real sentences; this script splits
the fixed part. Every program decodes one source row (batch 1) through bpd.decoder.Decoder exactly as the decode
sweep calls it (a one-device mesh, the host batch put on it, the result copied back), with eos_id = -1 so that the
number of steps is set, not drawn: greedy runs max_len = L tokens, blockwise (criterion min_block:k) the first call
and ceil((L - 1) / k) iterations, for several L (each decoder's cache is sized for its L, decoder.cache_len: a few
slots of attention more or less, which at these sizes is noise beside the weights a step reads). Parts, each the
--percentile (default the median) of --repeats alternating runs (bpd/timing.py; a compile while timing raises):

  batching    run_batches' host work per sentence (eval_batches' padding, the row split), over 64 sentences with
              the decoder stubbed out (it returns a host copy of a result)
  dispatch    a jitted no-op taking the same arguments (the parameter tree and the source): Python, argument
              handling, host to device, an empty execution, a scalar back
  encoder     the decoder's init_state (encoder, cross-attention keys and values, zero caches) minus dispatch
  first call  the program at L = 1 minus the two above: greedy's first step, blockwise's proposing call, loop setup
  copy back   jax.device_get of the finished result (already computed)
  fixed       the intercept of a least-squares line through (steps, seconds) over the L values; per step: its slope

--before_pad_to=N also times every decoding program with the source padded to N positions, alternating with the
rest, and the dispatch with the batch put on the mesh as a sharded array: how a batch-1 sentence was decoded before
run_batches padded each batch to its own bucket (decoder.source_buckets) and the one-device Decoder handed jit the
host batch (N = the split's longest source rounded up to 8: 48 on the Multi30k test split, 40 on the demo's).
The table then has a 'before' and an 'after' row per decoder; 'ms at' is fixed + steps x per step at --at (greedy
tokens, blockwise iterations of a typical sentence), 'fixed share' the fixed cost's part of it, and 'speedup'
greedy's time over each decoder's at those steps (random weights accept what min_block:k forces; --at says how
many iterations a trained model needs).

--trace also records each program under jax.profiler and prints the timeline of whole calls: Python until the
executable's first kernel, the kernels before its while loop, the loop, and the copy back (a profiled run, which
tracing slows a little; the timers above are what the tables report).

The machine's load moves every number; the parts are measured alternating, so their ratios hold.
"""

import collections
import glob
import math
import os
import statistics
import tempfile
import time

from absl import app
from absl import flags
import jax
import jax.numpy as jnp
from ml_collections import config_flags
import numpy as np

from bpd import checkpoint
from bpd import decoder as decoder_lib
from bpd import decoding
from bpd import errors
from bpd import model as model_lib
from bpd import sharding
from bpd import timing

if __name__ == '__main__':
  _CONFIG = config_flags.DEFINE_config_file('config', None, 'Config file: model size and vocabulary (random weights).')
  _WORKDIR = flags.DEFINE_string('workdir', None, 'A trained model to load instead of random weights.')
  _K = flags.DEFINE_integer('k', 4, 'Heads of the blockwise decoder (random weights: the model has k heads).')
  _LENGTHS = flags.DEFINE_list('lengths', ['1', '9', '17', '33'], 'Output lengths L (tokens) the line is fit through.')
  _SRC_LEN = flags.DEFINE_integer('src_len', 14, 'Source tokens.')
  _BEFORE_PAD_TO = flags.DEFINE_integer(
      'before_pad_to', 0, "Also time every program with the source padded to this many positions and the batch put "
      "on the mesh as a sharded array (how a sentence was decoded before: padded to the split's longest source), "
      'alternating with the rest (0: off).')
  _PERCENTILE = flags.DEFINE_float('percentile', 50, 'Percentile of each program\'s timed runs (50: the median; '
                                   'lower on a loaded machine keeps the least disturbed runs).')
  _AT = flags.DEFINE_list('at', ['14.92', '6.27'], 'Greedy tokens and blockwise iterations of a typical sentence '
                          '(default: the Multi30k Both model at k = 4, docs/results/benchmark.md) for the share and '
                          'speedup columns.')
  _REPEATS = flags.DEFINE_integer('repeats', 30, 'Alternating timed runs of every program (medians reported).')
  _MESH = flags.DEFINE_bool('mesh', True, 'Decode on a one-device mesh, as the decode sweep does.')
  _TRACE = flags.DEFINE_bool('trace', False, 'Also print the profiler timeline of whole calls.')

NEVER = -1
BEFORE = ' (before)'
BATCHING_SENTENCES = 64  # run_batches' host work is timed over this many sentences and divided


def fit(steps, seconds):
  """(intercept, slope) of the least-squares line seconds = intercept + slope * steps."""
  slope, intercept = np.polyfit(np.asarray(steps, np.float64), np.asarray(seconds, np.float64), 1)
  return float(intercept), float(slope)


def load_model(config, workdir, k, mesh):
  """(model, params): the checkpoint in workdir, or random weights of the config's size with k heads."""
  if workdir:
    model_config, params, _ = checkpoint.load_params(workdir, mesh=mesh)
  else:
    model_config = model_lib.model_config(config.model.size, vocab_size=config.data.vocab_size, k=k,
                                          dropout_rate=0.0, dtype=config.model.dtype)
    params = model_lib.init_params(model_config, jax.random.PRNGKey(0))
    if mesh is not None:
      params = sharding.put(params, sharding.state_sharding(params, mesh))
  return model_lib.Transformer(model_config), params


def programs(model, params, mesh, k, lengths, sources):
  """{name: fn() -> host result} for every part; sources: {variant: src_1xS}, each decoded at every L."""
  longest = max(lengths)
  criterion, chain = decoding.Criterion(min_block=k), decoder_lib.chain(k)
  out = {}
  decoders = {length: decoder_lib.Decoder(model, length, mesh, eos_id=NEVER) for length in lengths}
  base = decoders[longest]
  noop = jax.jit(lambda params, src_BxS: src_BxS[0, 0])
  put = base._put  # pylint: disable=protected-access
  src_1xS = sources['']
  out['dispatch'] = lambda: jax.device_get(noop(params, put(src_1xS)))
  if mesh is not None:  # how Decoder put the host batch on a mesh before (a sharded array built first)
    out['dispatch, sharded batch'] = lambda: jax.device_get(noop(params, sharding.shard_global_batch(src_1xS, mesh)))
  cache = decoder_lib.cache_len(longest, k)
  init = jax.jit(lambda params, src_BxS: model_lib.decode_fns(model, params, num_heads=1)[0](src_BxS, cache))
  for variant, src in sources.items():
    out[f'encoder{variant}'] = lambda src=src: jax.block_until_ready(init(params, put(src)))
  for variant, src in sources.items():
    for length, decoder in decoders.items():
      out[f'greedy L={length}{variant}'] = lambda d=decoder, s=src: jax.device_get(d.greedy(params, s))
      out[f'blockwise L={length}{variant}'] = lambda d=decoder, s=src: jax.device_get(
          d.blockwise(params, s, criterion, chain))
  ready = {'greedy': jax.block_until_ready(base.greedy(params, src_1xS)),
           'blockwise': jax.block_until_ready(base.blockwise(params, src_1xS, criterion, chain))}
  out['copy back greedy'] = lambda: jax.device_get(ready['greedy'])
  out['copy back blockwise'] = lambda: jax.device_get(ready['blockwise'])
  host = jax.device_get(ready['blockwise'])
  sentences = [np.asarray(src_1xS[0][src_1xS[0] > 0])] * BATCHING_SENTENCES
  out['batching'] = lambda: decoder_lib.run_batches(lambda src: host, sentences, 1)
  return out


def trace_timeline(fn, runs: int) -> dict:
  """Median milliseconds of the phases of a whole call fn() (which ends with the copy back) under jax.profiler.

  Phases: 'python' (from the call until the executable's first kernel), 'before loop' (kernels until the while
  loop starts: encoder, cache, blockwise's first call), 'loop' (from there until the last kernel ends: the
  while thunk's own trace event ends when it has handed its body to the thread pool, not when the loop is done,
  so the few kernels after the loop count here), 'copy back' (until fn returns)."""
  directory = tempfile.mkdtemp(prefix='bpd_fixed_cost_')
  options = jax.profiler.ProfileOptions()
  options.python_tracer_level = 0
  jax.profiler.start_trace(directory, profiler_options=options)
  for _ in range(runs):
    with jax.profiler.TraceAnnotation('bpd_call'):
      fn()
  jax.profiler.stop_trace()
  path = sorted(glob.glob(os.path.join(directory, '**', '*.xplane.pb'), recursive=True))[-1]
  events = []
  for plane in jax.profiler.ProfileData.from_file(path).planes:
    if plane.name == '/host:CPU':
      for line in plane.lines:
        events += [(e.start_ns, e.start_ns + e.duration_ns, e.name) for e in line.events]
  calls = sorted((s, e) for s, e, name in events if name == 'bpd_call')
  skip = ('bpd_call', 'Thunk', 'Threadpool', 'Pjit', 'Parse', 'Common', 'Handle', 'Allocate', 'Wait', 'Python',
          'ArrayImpl', 'np.asarray', 'DevicePut', 'SlinkyThreadPool', 'end:')
  phases = collections.defaultdict(list)
  for start, end in calls:
    inside = [(s, e, n) for s, e, n in events if start <= s < end and not n.startswith(skip)]
    loops = [s for s, _, n in inside if n.startswith('while')]
    kernels = [(s, e) for s, e, n in inside if not n.startswith('while') and n != 'copy']
    if not kernels:
      continue
    first, last = min(s for s, _ in kernels), max(e for _, e in kernels)
    loop_start = min(loops) if loops else last
    phases['python'].append(first - start)
    phases['before loop'].append(loop_start - first)
    phases['loop'].append(last - loop_start)
    phases['copy back'].append(end - last)
  return {name: statistics.median(ns) / 1e6 for name, ns in phases.items()}


def breakdown(ms, seconds, lengths, k, variant, dispatch):
  """{decoder: (fixed ms, ms per step, {part: ms}, rest ms)} from the medians of one variant's programs."""
  steps = {'greedy': lengths, 'blockwise': [math.ceil((n - 1) / k) for n in lengths]}
  out = {}
  for decoder in ('greedy', 'blockwise'):
    fixed, per_step = fit(steps[decoder], [seconds[f'{decoder} L={n}{variant}'] for n in lengths])
    fixed, per_step = 1e3 * fixed + ms[dispatch] - ms['dispatch'], 1e3 * per_step
    at_one = ms[f'{decoder} L={lengths[0]}{variant}'] - per_step * steps[decoder][0]
    copy = ms[f'copy back {decoder}']
    parts = {'batching': ms['batching'] / BATCHING_SENTENCES, 'dispatch': ms[dispatch],
             'encoder': ms[f'encoder{variant}'] - ms['dispatch'],
             'first call': at_one - ms[f'encoder{variant}'] - copy, 'copy back': copy}
    out[decoder] = (fixed, per_step, parts, fixed - sum(v for n, v in parts.items() if n != 'batching'))
  return out


def main(argv):
  del argv
  config, k = _CONFIG.value, _K.value
  lengths = sorted(int(n) for n in _LENGTHS.value)
  mesh = sharding.make_mesh(1) if _MESH.value else None
  model, params = load_model(config, _WORKDIR.value, k, mesh)
  if not 1 < k <= model.config.k:
    raise errors.UserError(f'--k={k}: choose 2..{model.config.k} (the heads of the model).')
  tokens = np.random.RandomState(0).randint(4, model.config.vocab_size, _SRC_LEN.value)
  padded = lambda width: np.pad(tokens, (0, width - len(tokens)))[None].astype(np.int32)
  src_len = -(-_SRC_LEN.value // 8) * 8
  sources = {'': padded(src_len)}
  if _BEFORE_PAD_TO.value:
    sources[BEFORE] = padded(_BEFORE_PAD_TO.value)
  fns = programs(model, params, mesh, k, lengths, sources)
  names = list(fns)
  reduce = lambda t: float(np.percentile(t, _PERCENTILE.value))
  seconds = dict(zip(names, timing.time_alternating([fns[n] for n in names], _REPEATS.value, 'fixed_cost', reduce)))
  ms = {name: 1e3 * s for name, s in seconds.items()}
  print(f'model {config.model.size if not _WORKDIR.value else _WORKDIR.value}: d={model.config.d_model}, '
        f'{model.config.num_encoder_layers}+{model.config.num_decoder_layers} layers, vocab {model.config.vocab_size}; '
        f'batch 1, source {_SRC_LEN.value} tokens padded to {src_len}'
        + (f' (before: {_BEFORE_PAD_TO.value})' if _BEFORE_PAD_TO.value else '') +
        f', k = {k}, {_REPEATS.value} alternating runs, percentile {_PERCENTILE.value} of each, mesh={_MESH.value}')
  print(f'| program | ms (percentile {_PERCENTILE.value}) |\n|---|---|')
  for name in names:
    print(f'| {name} | {ms[name] / (BATCHING_SENTENCES if name == "batching" else 1):.3f} |')
  variants = {'after': ('', 'dispatch')}
  if _BEFORE_PAD_TO.value:
    variants = {'before': (BEFORE, 'dispatch, sharded batch' if mesh is not None else 'dispatch'), **variants}
  greedy_steps, block_steps = (float(x) for x in _AT.value)
  print('\n| code | decoder | fixed ms (intercept) | ms per step | batching | dispatch | encoder | first call | '
        f'copy back | rest of fixed | ms at {greedy_steps:g} tokens / {block_steps:g} iterations | fixed share | '
        'speedup |\n|---|---|---|---|---|---|---|---|---|---|---|---|---|')
  for label, (variant, dispatch) in variants.items():
    rows = breakdown(ms, seconds, lengths, k, variant, dispatch)
    total = {'greedy': rows['greedy'][0] + greedy_steps * rows['greedy'][1],
             'blockwise': rows['blockwise'][0] + block_steps * rows['blockwise'][1]}
    for decoder, (fixed, per_step, parts, rest) in rows.items():
      speedup = total['greedy'] / total[decoder]
      print(f'| {label} | {decoder} | {fixed:.3f} | {per_step:.3f} | ' +
            ' | '.join(f'{v:.3f}' for v in parts.values()) +
            f' | {rest:.3f} | {total[decoder]:.2f} | {fixed / total[decoder]:.0%} | {speedup:.2f}x |')
  if _TRACE.value:
    print('\nprofiler timeline of whole calls (ms, median of runs)')
    print('| program | python | before loop | loop | copy back |\n|---|---|---|---|---|')
    for name in names:
      if ' L=' in name:
        t = trace_timeline(fns[name], max(3, _REPEATS.value // 3))
        print(f'| {name} | ' + ' | '.join(f'{t.get(p, 0.0):.3f}' for p in
                                          ('python', 'before loop', 'loop', 'copy back')) + ' |')


if __name__ == '__main__':
  flags.mark_flags_as_required(['config'])
  app.run(lambda argv: errors.exit_on_user_error(main, argv))
