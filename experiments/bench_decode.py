r"""The price of verification: time of one blockwise iteration / time of one greedy step, with its accounting.

  python -m experiments.bench_decode --config=configs/multi30k_ende.py --json=bench.json

For the model size in the config (random weights), both decoders run their real jitted `lax.while_loop`s
over the same encoder state, side by side in one process:
  greedy:    `max_len` steps, one token each (eos_id = -1 so no row stops early);
  blockwise: criterion min_block:k, so every iteration scores k tokens, accepts k and proposes the next
             k; max_len / k iterations plus the initial proposal call.
For EACH (k, batch) row, greedy and blockwise alternate --repeats times after one untimed warm-up run of each on
exactly the timed inputs (bpd/timing.py: a trace or compile inside the timed runs raises). greedy_step_s =
median greedy time / max_len; block_step_s = (median blockwise time - one greedy step, for the initial proposal
call) / iterations; ratio = block_step_s / greedy_step_s, both from the same row's alternating runs.
For one sequence of m tokens decoded in m / k̂ iterations (k̂ = mean accepted block size), the wall-clock
speedup is about m / ((m / k̂ + 1) · ratio), i.e. k̂ / ratio for long outputs; in a batch the loop runs until
its slowest row is done.

Accounting (why the ratio is what it is). For one greedy step (one score call on 1 token + argmax) and one
blockwise iteration (the loop body: score k tokens, accept, propose at one position), each compiled on its own:
  xla_*:    FLOPs and bytes accessed from XLA's cost analysis of the compiled step (not of the loop: XLA counts a
            while_loop's body once whatever the trip count; the script prints that check).
  count_*:  the same from the shapes: 2 x multiply-adds of the decoder layers at T positions (projections,
            attention over the whole cache and source, feed-forward), of the vocabulary projections (1 for a
            greedy step; k to verify + k - 1 proposals for an iteration, DESIGN §3) and of the multi-output layer
            at one position; bytes = the weights read once (float32) + the KV caches read.
  achieved GFLOP/s and GB/s = count / measured time, against this machine's measured peaks (a large float32
  matmul under jit; a large array sum under jit). roofline_ratio = max(FLOPs / peak, bytes / bandwidth) of an
  iteration over that of a greedy step: the ratio a machine at its roofline would give.

TPU estimate (--tpu=v5e,v4; needs the optional extra `pip install -e '.[tpu]'`, no TPU): for each row, the same
greedy step and blockwise iteration, in bfloat16, compiled for one chip of each named generation by libtpu
(experiments/tpu_estimate.py), for each model size of --tpu_sizes (default: the config's). Nothing runs on a TPU:
tpu_<chip>_<size>_ratio = max(FLOPs / peak, bytes / HBM bandwidth) of the iteration over that of the greedy step,
from the TPU compiler's cost analysis and the chip's published peaks. An ESTIMATE, labelled so in the table.

  python -m experiments.bench_decode --config=configs/multi30k_ende.py --ks=4,8 --batch_sizes=1,32 \
      --tpu=v5e,v4 --tpu_sizes=small,base --json=bench.json
"""

import dataclasses
import functools
import json
import statistics

from absl import app
from absl import flags
import jax
import jax.numpy as jnp
from ml_collections import config_flags
import numpy as np

from bpd import decoder as decoder_lib
from bpd import decoding
from bpd import draft_vocab
from bpd import errors
from bpd import model as model_lib
from bpd import timing
from bpd.data import images
from experiments import tpu_estimate

# Flags exist only when this file runs as a script: importing it (tests, another script) defines none, so
# scripts that share flag names (--config) can be imported together.
if __name__ == '__main__':
  _CONFIG = config_flags.DEFINE_config_file(
      'config', None, 'Config file; its model size, vocabulary, dtype, head type and attention block are used.')
  _JSON = flags.DEFINE_string('json', None, 'Write the records here as a JSON list.')
  _KS = flags.DEFINE_list('ks', ['2', '4', '6', '8', '10'], 'Block sizes k to time.')
  _BATCH_SIZES = flags.DEFINE_list('batch_sizes', ['1', '8', '32'], 'Batch sizes to time.')
  _MAX_LEN = flags.DEFINE_integer('max_len', 120, 'Tokens decoded per run (a multiple of every k keeps '
                                  'every block full).')
  _SRC_LEN = flags.DEFINE_integer('src_len', 24, 'Source length.')
  _HEAD_HIDDEN = flags.DEFINE_integer('head_hidden', 0, 'Hidden width of each proposal head (model.head_hidden; '
                                      '0 = d_ff, the paper\'s multi-output layer).')
  _DRAFT_VOCAB = flags.DEFINE_list('draft_vocab', [], 'Also time blockwise iterations whose heads draft from a '
                                   'truncated vocabulary of each of these sizes R (model.draft_vocab; evenly spaced '
                                   'ids, random weights), alternating with greedy and the full-vocabulary heads.')
  _REPEATS = flags.DEFINE_integer('repeats', 7, 'Alternating timed runs per (k, batch) row (medians reported).')
  _TPU = flags.DEFINE_list('tpu', [], 'TPU chips (v5e, v4) to estimate each row for, by compiling for them with libtpu '
                           "(pip install -e '.[tpu]'; no TPU needed). Empty: no estimate.")
  _TPU_SIZES = flags.DEFINE_list('tpu_sizes', [], 'Model sizes (bpd.model.SIZES) of the TPU estimate, with the '
                                 "config's vocabulary. Empty: the config's model size.")

BOS = 2
NEVER = -1  # an EOS id that argmax never returns: every row decodes max_len tokens
F32 = 4  # bytes


# -- this machine's peaks -------------------------------------------------------------------------------------

def machine_peaks(repeats=7, matmul_n=2048, sum_mb=256, cached_mb=8):
  """Measured float32 matmul GFLOP/s (n x n @ n x n under jit) and memory GB/s (sum of an array under jit): of
  `sum_mb` (main memory) and of `cached_mb` (fits this team's 32 MB L3, where a greedy step's ~16 MB of weights
  can stay between steps).

  Peaks are what the machine can do, so they take the fastest of the runs, not the median: on a machine shared
  with other jobs the median measures the other jobs too.
  """
  a = jax.random.normal(jax.random.PRNGKey(0), (matmul_n, matmul_n), jnp.float32)
  x = jnp.ones((sum_mb * 2**20 // F32,), jnp.float32)
  y = jnp.ones((cached_mb * 2**20 // F32,), jnp.float32)
  matmul = jax.jit(lambda a: a @ a)
  total = jax.jit(jnp.sum)
  matmul_s, sum_s, cached_s = timing.time_alternating([lambda: matmul(a), lambda: total(x), lambda: total(y)],
                                                      repeats, 'machine peaks', min)
  return {'peak_gflop_s': 2 * matmul_n**3 / matmul_s / 1e9, 'peak_gbyte_s': x.nbytes / sum_s / 1e9,
          'cached_gbyte_s': y.nbytes / cached_s / 1e9}


# -- FLOPs and bytes ------------------------------------------------------------------------------------------

def xla_cost(jitted, *args, **kwargs):
  """(FLOPs, bytes accessed) from XLA's cost analysis of jitted(*args, **kwargs), compiled (not run)."""
  cost = jitted.lower(*args, **kwargs).compile().cost_analysis()
  cost = cost[0] if isinstance(cost, (list, tuple)) else cost  # older JAX returns one dict per device
  return float(cost.get('flops', 0.0)), float(cost.get('bytes accessed', 0.0))


def shape_count(c: model_lib.ModelConfig, *, batch: int, new_tokens: int, cache_len: int, src_len: int,
                projections: int, proposal_heads: int):
  """FLOPs and minimum bytes of one decoder call from the shapes (see the module docstring).

  new_tokens = T positions per row through the decoder; projections = vectors per row projected onto the
  vocabulary; proposal_heads = heads of the multi-output layer evaluated (at one position per row). With a draft
  vocabulary (c.draft_ids) the proposal_heads of the projections read its R rows instead of V (gathered once per
  decode: R more rows of weights read, beside the full embedding that verification reads).
  With local attention (attention_block W) a call reads only its window of 2W + T cache slots (layers.key_window).
  Returns {'flops', 'weight_bytes', 'cache_bytes', 'bytes'}.
  """
  d, f, v = c.d_model, c.d_ff, c.vocab_size
  if c.attention_block:
    cache_len = min(cache_len, 2 * c.attention_block + new_tokens)
  head_f = c.head_hidden or f
  rows = len(c.draft_ids) or v  # rows each proposal projection reads
  # Per position and decoder layer: self q, k, v, out (4 d²), cross q, out (2 d²; cross keys/values are cached),
  # feed-forward (2 d f), attention over the whole cache and the source (scores and weighted sum: 2 L d + 2 S d).
  layer_macs = 6 * d * d + 2 * d * f + 2 * cache_len * d + 2 * src_len * d
  macs = batch * (new_tokens * c.num_decoder_layers * layer_macs + (projections - proposal_heads) * v * d
                  + proposal_heads * rows * d + proposal_heads * 2 * d * head_f)
  layer_weights = 6 * d * d + 2 * d * f
  draft_weights = len(c.draft_ids) * d if proposal_heads else 0
  weights = c.num_decoder_layers * layer_weights + v * d + draft_weights + proposal_heads * 2 * d * head_f
  cache = batch * c.num_decoder_layers * 2 * (cache_len + src_len) * d  # self and cross keys and values
  return {'flops': 2.0 * macs, 'weight_bytes': F32 * weights, 'cache_bytes': F32 * cache,
          'bytes': F32 * (weights + cache)}


# -- the benchmark --------------------------------------------------------------------------------------------

def draft_model(model, size: int):
  """`model` with a draft vocabulary of `size` evenly spaced ids (0: `model` itself); for timing, the ids of a
  random model do not matter, only how many."""
  if not size:
    return model
  ids = tuple(int(i) for i in np.linspace(0, model.config.vocab_size - 1, size).round())
  return model_lib.Transformer(dataclasses.replace(model.config, draft_ids=ids))


def bench(model, params, k_values, batch_sizes, max_len, src_len, repeats, seed=0, peaks=None, draft_sizes=()):
  """Returns a list of {k, batch_size, draft_vocab, greedy_step_s, block_step_s, ratio, ...accounting} records.

  draft_sizes: for each k and batch, besides the full-vocabulary heads (draft_vocab 0), the same iteration with a
  draft vocabulary of each of these sizes (`draft_model`), all timed alternately with the same greedy runs.
  """
  cache_len = decoder_lib.cache_len(max_len, block=max(k_values))  # one cache for greedy and every k
  c = model.config

  def fixed(state):
    return decoding.Fixed(batch_size=state['src_mask_BxS'].shape[0], max_len=max_len, bos_id=BOS, eos_id=NEVER)

  @jax.jit
  def encode(params, src):
    init_state, _, _ = model_lib.decode_fns(model, params)
    state = init_state(src, cache_len)
    decoder_lib.check_cache_len(state, max_len, block=max(k_values))
    return state

  @jax.jit
  def run_greedy(params, state):
    _, score_fn, _ = model_lib.decode_fns(model, params)
    return decoding.greedy(score_fn, state, fixed=fixed(state))[0]

  @functools.partial(jax.jit, static_argnames=('k', 'block_model'))
  def run_block(params, state, k, block_model=model):
    _, score_fn, propose_fn = model_lib.decode_fns(block_model, params, num_heads=k)
    result = decoding.blockwise(decoding.ModelFns(score_fn, propose_fn), state, fixed=fixed(state),
                                tree=decoder_lib.chain(k), rule=decoding.Criterion(min_block=k))
    return result.tokens_BxL, result.invocations

  # One greedy step and one blockwise iteration, alone, for XLA's cost analysis.
  @jax.jit
  def greedy_carry(state):
    return decoding.greedy_init(state, fixed=fixed(state))

  @jax.jit
  def greedy_step(params, carry):
    _, score_fn, _ = model_lib.decode_fns(model, params)
    return decoding.greedy_body(score_fn, fixed=fixed(carry[-1]))(carry)

  # The first k heads (model and parameters) are taken once per decode, outside the loop (model_lib.first_heads):
  # take them outside the compiled iteration too, so that the one-time copy is not counted as a per-iteration cost.
  # model_k already has k heads (or k = 1), so decode_fns' own first_heads slices nothing.
  @functools.partial(jax.jit, static_argnames=('model_k', 'k'))
  def block_carry(params_k, state, model_k, k):
    _, score_fn, propose_fn = model_lib.decode_fns(model_k, params_k, num_heads=k)
    return decoding.blockwise_init(decoding.ModelFns(score_fn, propose_fn), state, fixed=fixed(state),
                                   tree=decoder_lib.chain(k), rule=decoding.Criterion(min_block=k))

  @functools.partial(jax.jit, static_argnames=('model_k', 'k'))
  def block_step(params_k, s, model_k, k):
    _, score_fn, propose_fn = model_lib.decode_fns(model_k, params_k, num_heads=k)
    return decoding.blockwise_body(decoding.ModelFns(score_fn, propose_fn), fixed=fixed(s.model_state),
                                   tree=decoder_lib.chain(k), rule=decoding.Criterion(min_block=k))(s)

  peaks = peaks or machine_peaks()
  records = []
  rng = np.random.RandomState(seed)
  for batch_size in batch_sizes:
    src = jnp.asarray(rng.randint(4, c.vocab_size, size=(batch_size, src_len)), jnp.int32)
    state = jax.block_until_ready(encode(params, src))
    greedy_flops, greedy_bytes = xla_cost(greedy_step, params, greedy_carry(state))
    loop_flops, _ = xla_cost(run_greedy, params, state)
    greedy_count = shape_count(c, batch=batch_size, new_tokens=1, cache_len=cache_len, src_len=src_len,
                               projections=1, proposal_heads=0)
    print(f'batch {batch_size}: XLA counts the whole {max_len}-step greedy loop at {loop_flops / greedy_flops:.2f} x '
          'one step: a while_loop body is counted once, so costs below come from steps compiled alone.')
    for k in k_values:
      variants = [(size, draft_model(model, size)) for size in (0, *draft_sizes)]
      g_seconds, *variant_seconds = timing.time_alternating(
          [lambda: run_greedy(params, state)]
          + [lambda k=k, m=m: run_block(params, state, k=k, block_model=m) for _, m in variants], repeats,
          f'bench k={k} batch={batch_size}')
      for (size, block_model), b_seconds in zip(variants, variant_seconds):
        iterations = int(run_block(params, state, k=k, block_model=block_model)[1]) - 1  # the first only proposes
        greedy_s = g_seconds / max_len
        block_s = (b_seconds - greedy_s) / iterations
        model_k, params_k = model_lib.first_heads(block_model, params, k)
        block_flops, block_bytes = xla_cost(block_step, params_k, block_carry(params_k, state, model_k=model_k, k=k),
                                            model_k=model_k, k=k)
        block_count = shape_count(block_model.config, batch=batch_size, new_tokens=k, cache_len=cache_len,
                                  src_len=src_len, projections=2 * k - 1, proposal_heads=k - 1)
        roof = lambda count, bandwidth='peak_gbyte_s': max(count['flops'] / (peaks['peak_gflop_s'] * 1e9),
                                                           count['bytes'] / (peaks[bandwidth] * 1e9))
        records.append({
            'k': k, 'batch_size': batch_size, 'draft_vocab': size, 'greedy_step_s': greedy_s,
            'block_step_s': block_s, 'ratio': block_s / greedy_s, 'iterations': iterations, 'max_len': max_len,
            'cache_len': cache_len, 'src_len': src_len, 'repeats': repeats,
            'greedy_flops_xla': greedy_flops, 'greedy_bytes_xla': greedy_bytes,
            'block_flops_xla': block_flops, 'block_bytes_xla': block_bytes,
            'greedy_flops_count': greedy_count['flops'], 'greedy_bytes_count': greedy_count['bytes'],
            'block_flops_count': block_count['flops'], 'block_bytes_count': block_count['bytes'],
            'block_weight_bytes_count': block_count['weight_bytes'],
            'greedy_gflop_s': greedy_count['flops'] / greedy_s / 1e9,
            'block_gflop_s': block_count['flops'] / block_s / 1e9,
            'greedy_gbyte_s': greedy_count['bytes'] / greedy_s / 1e9,
            'block_gbyte_s': block_count['bytes'] / block_s / 1e9,
            'greedy_roofline_s': roof(greedy_count), 'block_roofline_s': roof(block_count),
            'roofline_ratio': roof(block_count) / roof(greedy_count),
            'roofline_ratio_cached': roof(block_count, 'cached_gbyte_s') / roof(greedy_count, 'cached_gbyte_s'),
            **peaks})
  return records


# -- the TPU estimate (experiments/tpu_estimate.py) -----------------------------------------------------------

def tpu_setup(chips: list[str], sizes: list[str], vocab_size: int, k: int, head_hidden: int):
  """({chip: (device, devices per chip)}, {size: ModelConfig}) for add_tpu_estimates, or a UserError (no libtpu, an
  unknown chip or size) before anything is measured or compiled."""
  if sizes and not chips:
    raise errors.UserError(f'--tpu_sizes={",".join(sizes)} sizes the TPU estimate: name the chips too, e.g. '
                           '--tpu=v5e,v4.')
  configs = {size: model_lib.model_config(size, vocab_size=vocab_size, k=k, dropout_rate=0.0, head_hidden=head_hidden)
             for size in sizes}
  return {chip: tpu_estimate.chip_device(chip) for chip in chips}, configs


def add_tpu_estimates(records, chip_devices, configs):
  """Adds tpu_<chip>_<size>_{greedy,block}_{flops,bytes,roofline_s} and tpu_<chip>_<size>_ratio to each record.

  For each record's (k, batch, cache length) and each chip and model size: the greedy step and the k-token iteration
  compiled for that chip (tpu_estimate.step_cost; bfloat16) and their rooflines from its published peaks.
  """
  greedy = {}  # a greedy step does not depend on k: compiled once per (chip, size, batch)
  for r in records:
    shapes = dict(batch=r['batch_size'], max_len=r['max_len'], src_len=r['src_len'], cache_len=r['cache_len'])
    for chip, (device, devices_per_chip) in chip_devices.items():
      for size, config in configs.items():
        key = (chip, size, r['batch_size'])
        if key not in greedy:
          greedy[key] = tpu_estimate.step_cost(config, device, 'greedy', k=1, **shapes)
        block = tpu_estimate.step_cost(config, device, 'block', k=r['k'], **shapes)
        roofs = {step: tpu_estimate.roofline_s(c, chip, devices_per_chip)
                 for step, c in (('greedy', greedy[key]), ('block', block))}
        prefix = f'tpu_{chip}_{size}_'
        r.update({f'{prefix}greedy_flops': greedy[key]['flops'], f'{prefix}greedy_bytes': greedy[key]['bytes'],
                  f'{prefix}block_flops': block['flops'], f'{prefix}block_bytes': block['bytes'],
                  f'{prefix}greedy_roofline_s': roofs['greedy'], f'{prefix}block_roofline_s': roofs['block'],
                  f'{prefix}ratio': roofs['block'] / roofs['greedy']})
  return records


def format_table(records, title='', tpu_chips=(), tpu_sizes=()):
  """The records as a markdown table; one more column per TPU chip, its estimated ratio for each of tpu_sizes."""
  lines = [title] if title else []
  tpu_headers = [f"TPU {chip} ESTIMATE: ratio ({'; '.join(tpu_sizes)})" for chip in tpu_chips]
  lines += ['| k | batch | draft vocab | greedy step (ms) | blockwise iteration (ms) | ratio | '
            'roofline ratio (memory; L3) | '
            'ratio / roofline ratio | '
            + ''.join(f'{h} | ' for h in tpu_headers) +
            'GFLOP greedy / iter (XLA; count) | MB greedy / iter (XLA; weights+cache) | '
            'achieved GFLOP/s greedy / iter | achieved GB/s greedy / iter |',
            '|---' * (12 + len(tpu_headers)) + '|']
  for r in records:
    tpu = ''.join('; '.join(f"{r[f'tpu_{chip}_{size}_ratio']:.2f}" for size in tpu_sizes) + ' | '
                  for chip in tpu_chips)
    lines.append(
        f"| {r['k']} | {r['batch_size']} | {r.get('draft_vocab') or '-'} | {1e3 * r['greedy_step_s']:.2f} | "
        f"{1e3 * r['block_step_s']:.2f} | "
        f"{r['ratio']:.2f} | {r['roofline_ratio']:.2f}; {r['roofline_ratio_cached']:.2f} | "
        f"{r['ratio'] / r['roofline_ratio']:.2f} | {tpu}"
        f"{r['greedy_flops_xla'] / 1e9:.3f} / {r['block_flops_xla'] / 1e9:.3f} "
        f"({r['greedy_flops_count'] / 1e9:.3f} / {r['block_flops_count'] / 1e9:.3f}) | "
        f"{r['greedy_bytes_xla'] / 1e6:.1f} / {r['block_bytes_xla'] / 1e6:.1f} "
        f"({r['greedy_bytes_count'] / 1e6:.1f} / {r['block_bytes_count'] / 1e6:.1f}) | "
        f"{r['greedy_gflop_s']:.1f} / {r['block_gflop_s']:.1f} | "
        f"{r['greedy_gbyte_s']:.1f} / {r['block_gbyte_s']:.1f} |")
  return '\n'.join(lines)


def tpu_title(chip_devices, configs):
  """The header line that says what the TPU columns are and where their peaks come from."""
  chips = []
  for chip, (_, devices_per_chip) in chip_devices.items():
    peaks = tpu_estimate.CHIPS[chip]
    chips.append(f"{chip} {peaks['flop_s'] / 1e12:.0f} TFLOP/s, {peaks['byte_s'] / 1e9:.0f} GB/s"
                 + (f' (compiled for one of its {devices_per_chip} TensorCores, with 1/{devices_per_chip} of these)'
                    if devices_per_chip > 1 else ''))
  sizes = [f'{size} d={c.d_model}, {c.num_decoder_layers} decoder layers, ff {c.d_ff}' for size, c in configs.items()]
  return ('TPU columns: ESTIMATES, nothing ran on a TPU. The same greedy step and blockwise iteration in bfloat16, '
          'compiled by libtpu for one chip (sizes: ' + '; '.join(sizes) + '); ratio = max(FLOPs / peak, bytes / '
          "bandwidth) of the iteration over that of the greedy step, from the TPU compiler's cost analysis and the "
          'published per-chip bf16 and HBM peaks (Google Cloud TPU documentation, v4 and v5e system architecture): '
          + '; '.join(chips) + '.')


def main(argv):
  del argv
  config = _CONFIG.value
  k_values = [int(k) for k in _KS.value]
  tpu_sizes = _TPU_SIZES.value or ([config.model.size] if _TPU.value else [])
  # Images: the pixel vocabulary (config.data.vocab_size is SentencePiece's, unused there).
  vocab_size = images.IMAGE_VOCAB_SIZE if config.data.source == 'images' else config.data.vocab_size
  # First, so that a missing libtpu or a bad name stops the command before it measures anything.
  chip_devices, tpu_configs = tpu_setup(_TPU.value, tpu_sizes, vocab_size, max(k_values),
                                        _HEAD_HIDDEN.value)
  draft_sizes = [int(size) for size in _DRAFT_VOCAB.value]
  for size in draft_sizes:
    draft_vocab.check(size, vocab_size)
    if not size:
      raise errors.UserError('--draft_vocab=0: the full-vocabulary heads are always timed; list sizes R >= 1 only.')
  if draft_sizes and chip_devices:
    raise errors.UserError('--draft_vocab and --tpu: the TPU estimate compiles full-vocabulary heads only; run them '
                           'separately.')
  model_config = model_lib.model_config(config.model.size, vocab_size=vocab_size, k=max(k_values),
                                        dropout_rate=0.0, dtype=config.model.dtype, head_hidden=_HEAD_HIDDEN.value,
                                        head_type=config.model.head_type,
                                        attention_block=config.model.attention_block)
  model = model_lib.Transformer(model_config)
  params = model_lib.init_params(model_config, jax.random.PRNGKey(0))
  peaks = machine_peaks()
  records = bench(model, params, k_values, [int(b) for b in _BATCH_SIZES.value], _MAX_LEN.value, _SRC_LEN.value,
                  _REPEATS.value, peaks=peaks, draft_sizes=draft_sizes)
  add_tpu_estimates(records, chip_devices, tpu_configs)
  c = model_config
  title = (f'model {config.model.size}: d={c.d_model}, {c.num_encoder_layers}+{c.num_decoder_layers} layers, '
           f'ff {c.d_ff}, head_hidden {c.head_hidden or c.d_ff}, {c.head_type} heads, vocab {c.vocab_size}, {c.dtype}; '
           f'{jax.devices()[0].platform}, {len(jax.devices())} device(s); {_MAX_LEN.value} tokens per run, '
           f'median of {_REPEATS.value} alternating runs per row; '
           f"measured peaks {peaks['peak_gflop_s']:.1f} GFLOP/s (float32 matmul), "
           f"{peaks['peak_gbyte_s']:.1f} GB/s (256 MB array sum), {peaks['cached_gbyte_s']:.1f} GB/s (8 MB, in L3)")
  if chip_devices:
    title += '\n' + tpu_title(chip_devices, tpu_configs)
  print(format_table(records, title, tpu_chips=list(chip_devices), tpu_sizes=tpu_sizes))
  if _JSON.value:
    with open(_JSON.value, 'w') as f:
      json.dump(records, f, indent=1)


if __name__ == '__main__':
  flags.mark_flags_as_required(['config'])
  app.run(lambda argv: errors.exit_on_user_error(main, argv), flags_parser=errors.parse_flags)
