r"""Per-kernel profile of one greedy step and one blockwise iteration: which compiled kernels the time goes to.

  python -m experiments.profile_decode --config=configs/multi30k_ende.py --ks=4,8 --batch_sizes=1,32

For the config's model size (random weights, as experiments/bench_decode.py), each program is the real jitted
decoding loop (`decoding.greedy`, `decoding.blockwise` with min_block:k, so every iteration scores and accepts k
tokens). It is compiled, warmed up, then run --runs times under jax.profiler. XLA's CPU runtime records one trace
event per executed kernel (thunk), named after its HLO instruction; this script sums them per instruction and
divides by the loop's trip count: microseconds per greedy step or per iteration. Each kernel's row gives its kind
(fusion, dot, copy, ...), its output shape, the bytes of its operands and output from the compiled HLO (what the
kernel must at least move), the achieved GB/s, and the jax operation it came from (HLO metadata op_name).

Times are thread-time: a kernel split over both cores counts both halves, and independent kernels may run at the
same time on the two cores, so the shares are of the summed kernel time, not of the wall clock (which
experiments/bench_decode.py measures).

  --markdown=FILE   also write the tables as markdown (docs/results keeps one).
  --reduce=median   count each kernel's runs at its median duration (a loaded machine preempts some runs).
"""

import collections
import dataclasses
import functools
import glob
import os
import re
import tempfile

from absl import app
from absl import flags
import jax
import jax.numpy as jnp
from ml_collections import config_flags
import numpy as np

from bpd import decoder as decoder_lib
from bpd import decoding
from bpd import errors
from bpd import model as model_lib

if __name__ == '__main__':
  _CONFIG = config_flags.DEFINE_config_file('config', None, 'Config file; its model size and vocabulary are used.')
  _KS = flags.DEFINE_list('ks', ['4', '8'], 'Block sizes k to profile.')
  _BATCH_SIZES = flags.DEFINE_list('batch_sizes', ['1', '32'], 'Batch sizes to profile.')
  _MAX_LEN = flags.DEFINE_integer('max_len', 120, 'Tokens decoded per run.')
  _SRC_LEN = flags.DEFINE_integer('src_len', 24, 'Source length.')
  _RUNS = flags.DEFINE_integer('runs', 5, 'Profiled runs of each loop (after one untimed warm-up).')
  _TOP = flags.DEFINE_integer('top', 12, 'Kernels listed per program.')
  _MARKDOWN = flags.DEFINE_string('markdown', None, 'Write the tables here too.')
  _REDUCE = flags.DEFINE_enum('reduce', 'sum', ['sum', 'median'], "A kernel's time: the sum of its runs, or its "
                              'median run times its runs (robust to preemptions on a loaded machine).')

BOS, NEVER = 2, -1
DTYPE_BYTES = {'f32': 4, 'bf16': 2, 'f16': 2, 's32': 4, 'u32': 4, 'pred': 1, 's8': 1, 'u8': 1, 's64': 8, 'f64': 8}
SHAPE = re.compile(r'\b(f32|bf16|f16|s32|u32|pred|s8|u8|s64|f64)\[([0-9,]*)\]')


def shape_bytes(text: str) -> int:
  """Bytes of every array shape written in an HLO text fragment, e.g. 'f32[1,4,256]' -> 4096."""
  total = 0
  for dtype, dims in SHAPE.findall(text):
    total += DTYPE_BYTES[dtype] * int(np.prod([int(d) for d in dims.split(',') if d] or [1]))
  return total


def hlo_instructions(hlo_text: str) -> dict:
  """{instruction name: {'kind', 'shape', 'bytes', 'op'}} of every instruction in the compiled HLO.

  bytes = the instruction's output plus its operands (looked up by name: HLO names are unique in a module), the
  least a kernel that runs the instruction must move. A fusion is one kernel: its operands are the fusion's."""
  parsed = []
  shapes = {}
  for line in hlo_text.splitlines():
    m = re.match(r'\s*(?:ROOT )?%([\w.\-]+) = (.*?) ([a-z][\w\-]*)\((.*)$', line)
    if not m:
      continue
    name, out_shape, kind, rest = m.groups()
    shapes[name] = shape_bytes(out_shape.split('{')[0] if not out_shape.startswith('(') else out_shape)
    operands = re.findall(r'%([\w.\-]+)', rest.split('), ', 1)[0])
    op = re.search(r'op_name="([^"]*)"', line)
    fused = re.search(r'kind=k(\w+)', line) if kind == 'fusion' else None
    parsed.append((name, kind + (f':{fused.group(1)}' if fused else ''), out_shape.split('{')[0], operands,
                   op.group(1) if op else ''))
  return {name: {'kind': kind, 'shape': shape, 'bytes': shapes[name] + sum(shapes.get(o, 0) for o in operands),
                 'op': op}
          for name, kind, shape, operands, op in parsed}


def profile(fn, runs: int, instructions: dict, reduce: str = 'sum'):
  """Per-kernel {name: [thread ns summed over runs, runs of it]} of fn() under jax.profiler: the trace events named
  after an instruction of the compiled program, but the `while` instruction's (it spans the whole loop).

  reduce='median': each kernel's runs count at its median duration (ns = median x runs), so that a run stretched
  by a preemption (a loaded, shared machine) does not weigh in; 'sum': the plain sum."""
  jax.block_until_ready(fn())
  directory = tempfile.mkdtemp(prefix='bpd_profile_')
  jax.profiler.start_trace(directory)
  for _ in range(runs):
    jax.block_until_ready(fn())
  jax.profiler.stop_trace()
  path = sorted(glob.glob(os.path.join(directory, '**', '*.xplane.pb'), recursive=True))[-1]
  kernels = collections.defaultdict(lambda: [0.0, 0])
  durations = collections.defaultdict(list)
  for plane in jax.profiler.ProfileData.from_file(path).planes:
    if plane.name != '/host:CPU':
      continue
    for line in plane.lines:
      for event in line.events:
        info = instructions.get(event.name)
        if info is None:
          continue
        if info['kind'] == 'while':
          continue
        kernels[event.name][0] += event.duration_ns
        kernels[event.name][1] += 1
        durations[event.name].append(event.duration_ns)
  if reduce == 'median':
    for name, ns in durations.items():
      kernels[name][0] = float(np.median(ns)) * len(ns)
  return kernels


def kernel_table(title, kernels, instructions, steps, top):
  """Markdown: the `top` kernels by time per step, with bytes, GB/s and their jax origin."""
  total = sum(ns for ns, _ in kernels.values())
  rows = sorted(kernels.items(), key=lambda kv: -kv[1][0])
  lines = [f'{title}: {1e-3 * total / steps:.1f} µs summed kernel '
           f'(thread) time, {len(kernels)} distinct kernels, {sum(n for _, n in kernels.values()) / steps:.0f} '
           'kernel runs per step',
           '',
           '| kernel | kind | output | µs / step | share | runs / step | MB moved | GB/s | from |',
           '|---|---|---|---|---|---|---|---|---|']
  for name, (ns, count) in rows[:top]:
    info = instructions.get(name, {'kind': '?', 'shape': '?', 'bytes': 0, 'op': ''})
    per_run_ns = ns / max(count, 1)
    gbs = info['bytes'] / per_run_ns if per_run_ns else 0.0
    op = info['op'].replace('jit(', '').replace('|', '/')
    op = op if len(op) < 70 else '…' + op[-69:]
    lines.append(f"| {name} | {info['kind']} | {info['shape']} | {1e-3 * ns / steps:.1f} | {ns / total:.1%} | "
                 f"{count / steps:.1f} | {info['bytes'] / 1e6:.2f} | {gbs:.1f} | {op} |")
  return '\n'.join(lines)


def programs(model, params, state, k_values, max_len):
  """{name: (jitted fn of no arguments, trip count)}: greedy and the blockwise loop for each k."""
  batch = state['src_mask_BxS'].shape[0]
  fixed = decoding.Fixed(batch_size=batch, max_len=max_len, bos_id=BOS, eos_id=NEVER)

  @jax.jit
  def run_greedy(params, state):
    _, score_fn, _ = model_lib.decode_fns(model, params, num_heads=1)
    return decoding.greedy(score_fn, state, fixed=fixed)[0]

  @functools.partial(jax.jit, static_argnames='k')
  def run_block(params_k, state, k):
    # params_k: the first k heads, cut once outside (as bpd.decoder.Decoder does), so no copy is profiled here.
    model_k = model_lib.Transformer(dataclasses.replace(model.config, k=k))
    _, score_fn, propose_fn = model_lib.decode_fns(model_k, params_k)
    return decoding.blockwise(decoding.ModelFns(score_fn, propose_fn), state, fixed=fixed,
                              tree=decoder_lib.chain(k), rule=decoding.Criterion(min_block=k)).tokens_BxL

  first_heads = jax.jit(lambda params, k: model_lib.first_heads(model, params, k)[1], static_argnames='k')
  out = {'greedy': (run_greedy, (params, state), {}, max_len)}
  for k in k_values:
    out[f'blockwise k={k}'] = (run_block, (first_heads(params, k=k), state), {'k': k}, -(-max_len // k))
  return out


def main(argv):
  del argv
  config = _CONFIG.value
  k_values = [int(k) for k in _KS.value]
  c = model_lib.model_config(config.model.size, vocab_size=config.data.vocab_size, k=max(k_values),
                             dropout_rate=0.0, dtype=config.model.dtype)
  model = model_lib.Transformer(c)
  params = model_lib.init_params(c, jax.random.PRNGKey(0))
  cache_len = _MAX_LEN.value + max(k_values) + 1
  encode = jax.jit(lambda p, s: model_lib.decode_fns(model, p)[0](s, cache_len))
  tables = [f'model {config.model.size}: d={c.d_model}, {c.num_decoder_layers} decoder layers, ff {c.d_ff}, '
            f'vocab {c.vocab_size}, {c.dtype}; {_MAX_LEN.value} tokens per run, {_RUNS.value} profiled runs, '
            f'kernel time {_REDUCE.value}; '
            f'XLA_FLAGS={os.environ.get("XLA_FLAGS", "")!r}']
  rng = np.random.RandomState(0)
  for batch in [int(b) for b in _BATCH_SIZES.value]:
    src = jnp.asarray(rng.randint(4, c.vocab_size, size=(batch, _SRC_LEN.value)), jnp.int32)
    state = jax.block_until_ready(encode(params, src))
    for name, (jitted, args, kwargs, steps) in programs(model, params, state, k_values, _MAX_LEN.value).items():
      instructions = hlo_instructions(jitted.lower(*args, **kwargs).compile().as_text())
      kernels = profile(lambda: jitted(*args, **kwargs), _RUNS.value, instructions, _REDUCE.value)
      table = kernel_table(f'### {name}, batch {batch}', kernels, instructions, steps * _RUNS.value,
                           _TOP.value)
      print(table + '\n', flush=True)
      tables.append(table)
  if _MARKDOWN.value:
    with open(_MARKDOWN.value, 'w') as f:
      f.write('\n\n'.join(tables) + '\n')


if __name__ == '__main__':
  flags.mark_flags_as_required(['config'])
  app.run(lambda argv: errors.exit_on_user_error(main, argv))
