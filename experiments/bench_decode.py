r"""Decoding benchmarks, one --mode each: what one blockwise iteration costs against one greedy step, and why.

  python -m experiments.bench_decode --mode=ratio --config=configs/multi30k_ende.py --json=bench.json
  python -m experiments.bench_decode --mode=profile --config=configs/multi30k_ende.py --ks=4,8 --batch_sizes=1,32
  python -m experiments.bench_decode --mode=matmul_floor --config=configs/multi30k_ende.py --ks=4,8 --batch_sizes=1
  python -m experiments.bench_decode --mode=fixed_cost --config=configs/multi30k_ende.py --k=4
  python -m experiments.bench_decode --mode=latency --config=configs/demo.py:regime=finetune,k=4 --workdir=runs/demo_b1
  python -m experiments.bench_decode --mode=trees --config=configs/demo.py:regime=finetune,k=4 --workdir=runs/demo/k4

  ratio         (the default) the price of verification: time of one iteration / time of one greedy step, with its
                accounting (FLOPs, bytes, achieved bandwidth against this machine's peaks; --tpu: an estimate for
                TPU chips, compiled by libtpu, bpd/tpu_estimate.py)
  profile       which compiled kernels a greedy step's and an iteration's time goes to (jax.profiler)
  matmul_floor  the backend's floor under that price: only the weight matmuls of a step and of an iteration
  fixed_cost    a batch-1 sentence's fixed cost, broken down: dispatch, encoder, first call, loop, copy back
  latency       a trained model's batch-1 time per sentence fit as fixed cost + per-step cost x steps
  trees         tree decoding against the chain: mean accepted block, iterations and wall-clock against tree size
Flags that several modes share (--ks, --batch_sizes, --src_len, --repeats, --split, --examples, --config) take the
default of the mode run (MODE_DEFAULTS). The modes, in this file's order:

--mode=ratio. For the model size in the config (random weights), both decoders run their real jitted
`lax.while_loop`s over the same encoder state, side by side in one process:
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
(bpd/tpu_estimate.py), for each model size of --tpu_sizes (default: the config's). Nothing runs on a TPU:
tpu_<chip>_<size>_ratio = max(FLOPs / peak, bytes / HBM bandwidth) of the iteration over that of the greedy step,
from the TPU compiler's cost analysis and the chip's published peaks. An ESTIMATE, labelled so in the table.

  python -m experiments.bench_decode --config=configs/multi30k_ende.py --ks=4,8 --batch_sizes=1,32 \
      --tpu=v5e,v4 --tpu_sizes=small,base --json=bench.json

--mode=profile. For the config's model size (random weights, as --mode=ratio), each program is the real jitted
decoding loop (`decoding.greedy`, `decoding.blockwise` with min_block:k, so every iteration scores and accepts k
tokens; on the skinny kernel, heads 2..k packed in the config's decode.head_weights, as Decoder packs them). It
is compiled, warmed up, then run --runs times under jax.profiler. XLA's CPU runtime records one trace
event per executed kernel (thunk), named after its HLO instruction; the profile sums them per instruction and
divides by the loop's trip count: microseconds per greedy step or per iteration. Each kernel's row gives its kind
(fusion, dot, copy, ...), its output shape, the bytes of its operands and output from the compiled HLO (what the
kernel must at least move), the achieved GB/s, and the jax operation it came from (HLO metadata op_name).
Times are thread-time: a kernel split over both cores counts both halves, and independent kernels may run at the
same time on the two cores, so the shares are of the summed kernel time, not of the wall clock (which
--mode=ratio measures).
  --markdown=FILE   also write the tables as markdown (docs/results keeps one).
  --reduce=median   count each kernel's runs at its median duration (a loaded machine preempts some runs).

--mode=matmul_floor. For the config's model size (random weights), four jitted `lax.while_loop`s run alternately
(bpd/timing.py), --max_len greedy steps or max_len / k iterations each:
  model greedy / model blockwise: the real decoding loops (--mode=profile's programs: greedy, and
    blockwise with min_block:k, so every iteration accepts k tokens);
  matmuls greedy / matmuls blockwise: a program with nothing but the weight matmuls of one step / one iteration,
    at the same shapes, reading the same parameter arrays: per decoder layer the self-attention query, key,
    value and output projections, the cross-attention query and output projections and the feed-forward pair at
    M = B (greedy) or M = B x k rows (iteration); the tied vocabulary projection at M rows; for the iteration
    also the multi-output layer at one position per row (k - 1 heads, [d, d_ff] and [d_ff, d] each) and its
    vocabulary projection at B x (k - 1) rows. Each matmul feeds the next (through a tanh, so XLA can neither
    hoist nor drop them), with no attention over caches, no layer norms, no argmax, no cache writes.
The matmul programs' ratio is what this backend gives for the weights alone; the model's ratio over it is the
model's own overhead (every kernel that is not one of these matmuls, and the matmuls' fusion with them).
Compare the printed per-step times across rows only within one run: the machine's load moves them.

--mode=fixed_cost.
  python -m experiments.bench_decode --mode=fixed_cost --config=configs/multi30k_ende.py --k=4    # random weights
  python -m experiments.bench_decode --mode=fixed_cost --config=configs/demo.py:regime=finetune,k=4 \
      --workdir=DIR --k=4
  python -m experiments.bench_decode --mode=fixed_cost --config=configs/multi30k_ende.py --k=4 \
      --before_pad_to=48 --trace
--mode=latency fits a sentence's time as fixed + steps x per step on real sentences; this mode splits the fixed
part. Every program decodes one source row (batch 1) through bpd.decoder.Decoder exactly as the decode sweep calls
it (a one-device mesh, the host batch put on it, the result copied back), with eos_id = -1 so that the number of
steps is set, not drawn: greedy runs max_len = L tokens, blockwise (criterion min_block:k) the first call and
ceil((L - 1) / k) iterations, for several L (each decoder's cache is sized for its L, decoder.cache_len: a few
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

--mode=latency. Each sentence of the split's first --examples is decoded alone (its own call: encoder, loop, host
copy), greedy and then blockwise (--criterion), alternating, --repeats times, after a warm-up on the first
sentences. A least-squares line through (steps, seconds) per decoder splits its time into what every sentence pays
once (encoder, first call, dispatch, copy back) and what each greedy step or blockwise iteration costs inside the
real loop: the first is why the end-to-end speedup at batch 1 is below block / iteration ratio, the second is that
ratio as the decoder runs it (--mode=ratio times a loop of random weights at a fixed length).

--mode=trees.
  python -m experiments.diagnostics --mode=choose_tree --config=configs/demo.py:regime=finetune,k=4 \
      --workdir=runs/demo/k4
  python -m experiments.bench_decode --mode=trees --config=configs/demo.py:regime=finetune,k=4 --workdir=runs/demo/k4 \
      --nodes=1,8,16,32,64 --batch_sizes=1,32 --figure=runs/demo/k4/trees.png
N = 1 is the paper's chain of k proposals (decoding.blockwise); N > 1 is the sparse tree 'nodes:N' built from the
model's WORKDIR/trees.json (experiments/diagnostics.py --mode=choose_tree), verified in one call per iteration
(decoding.blockwise). All with exact acceptance, so every row must equal greedy decoding token for token (the
'identical' column). Mean accepted block and iterations (DESIGN §2) do not depend on the machine; the seconds and
the speedup over greedy are medians of alternating runs on the first --timing_examples examples, and mean nothing on
a loaded machine. --figure draws one tree (the --figure_nodes one) and its attention mask. --tpu adds, per chip, the
estimated iteration / greedy-step ratio of each row and the speedup it would give.
"""

import collections
import dataclasses
import functools
import glob
import json
import math
import os
import re
import statistics
import tempfile
import time

from absl import app
from absl import flags
import jax
import jax.numpy as jnp
import numpy as np

from bpd import checks
from bpd import checkpoint
from bpd import decoder as decoder_lib
from bpd import decoding
from bpd import draft_vocab
from bpd import errors
from bpd import evaluate
from bpd import matmul
from bpd import metrics
from bpd import model as model_lib
from bpd import report
from bpd import sharding
from bpd import stack
from bpd import tasks
from bpd import timing
from bpd import tpu_estimate
from bpd import trees
from bpd.data import batching
from bpd.data import images
from bpd.data import pipeline
from bpd.data import tokenizer as tokenizer_lib
from bpd.errors import UserError

MODES = ('ratio', 'profile', 'matmul_floor', 'fixed_cost', 'latency', 'trees')
# The flags that several modes share under one name, each mode with its own default (command-line text).
MODE_DEFAULTS = {
    'ratio': {'ks': '2,4,6,8,10', 'batch_sizes': '1,8,32', 'src_len': '24', 'repeats': '7'},
    'profile': {'ks': '4,8', 'batch_sizes': '1,32', 'src_len': '24'},
    'matmul_floor': {'ks': '4,8', 'batch_sizes': '1', 'src_len': '24', 'repeats': '7'},
    'fixed_cost': {'src_len': '14', 'repeats': '30'},
    'latency': {'config': 'configs/demo.py:regime=finetune,k=4', 'split': '', 'examples': '100', 'repeats': '3'},
    'trees': {'batch_sizes': '1,32', 'split': 'test', 'examples': '0', 'repeats': '1'},
}

_defaults = functools.partial(errors.per_mode_help, MODE_DEFAULTS)


# Flags exist only when this file runs as a script: importing it (tests, another script) defines none, so
# scripts that share flag names (--config) can be imported together.
if __name__ == '__main__':
  _MODE = flags.DEFINE_enum('mode', 'ratio', MODES, 'What to measure (see the module docstring).')
  _CONFIG = errors.define_config_file(
      'config', None, 'Config file; its model size, vocabulary, dtype, head type and attention block are used '
      '(latency, trees: the config the model was trained with). Required but for --mode=latency (default '
      f"{MODE_DEFAULTS['latency']['config']}).")
  _WORKDIR = flags.DEFINE_string('workdir', None, 'A trained model (latency, trees: required; fixed_cost: instead '
                                 'of random weights; trees: the k-head model with trees.json).')
  # ratio, profile, matmul_floor
  _KS = flags.DEFINE_list('ks', None, 'Block sizes k to time or profile. ' + _defaults('ks'))
  _BATCH_SIZES = flags.DEFINE_list('batch_sizes', None, 'Batch sizes. ' + _defaults('batch_sizes'))
  _MAX_LEN = flags.DEFINE_integer('max_len', 120, 'Tokens decoded per run (a multiple of every k keeps '
                                  'every block full).')
  _SRC_LEN = flags.DEFINE_integer('src_len', None, 'Source length (tokens). ' + _defaults('src_len'))
  _REPEATS = flags.DEFINE_integer('repeats', None, 'Alternating timed runs per row or program (medians reported); '
                                  'latency: passes over the sentences. ' + _defaults('repeats'))
  _PERCENTILE = flags.DEFINE_float('percentile', 50, "fixed_cost, matmul_floor: percentile of each program's timed "
                                   'runs (50: the median; lower on a loaded machine keeps the least disturbed runs).')
  # ratio
  _JSON = flags.DEFINE_string('json', None, 'ratio: write the records here as a JSON list.')
  _HEAD_HIDDEN = flags.DEFINE_integer('head_hidden', 0, 'ratio: hidden width of each proposal head '
                                      "(model.head_hidden; 0 = d_ff, the paper's multi-output layer).")
  _DRAFT_VOCAB = flags.DEFINE_list('draft_vocab', [], 'ratio, latency: also time blockwise iterations whose heads '
                                   'draft from a truncated vocabulary of each of these sizes R (model.draft_vocab; '
                                   'ratio: evenly spaced ids, random weights; latency: the R most frequent target '
                                   'tokens, as the decode sweep counts them), alternating with greedy and the '
                                   'full-vocabulary heads.')
  _HEAD_WEIGHTS = flags.DEFINE_list('head_weights', [], 'ratio, latency: the dtypes in which the skinny kernel reads '
                                    'heads 2..k (decode.head_weights: float32, float16, int8), each timed alternating '
                                    'with the others; empty: the config\'s decode.head_weights alone.')
  _TPU = flags.DEFINE_list('tpu', [], 'ratio, trees: TPU chips (v5e, v4) to estimate each row for, by compiling for '
                           "them with libtpu (pip install -e '.[tpu]'; no TPU needed). Empty: no estimate.")
  _TPU_SIZES = flags.DEFINE_list('tpu_sizes', [], 'ratio: model sizes (bpd.model.SIZES) of the TPU estimate, with '
                                 "the config's vocabulary. Empty: the config's model size.")
  # profile
  _RUNS = flags.DEFINE_integer('runs', 5, 'profile: profiled runs of each loop (after one untimed warm-up).')
  _TOP = flags.DEFINE_integer('top', 12, 'profile: kernels listed per program.')
  _PROFILE_TREES = flags.DEFINE_list('trees', [], "profile, ratio, latency: also each of these trees at every k, e.g. "
                                     "'dynamic:16' (exact rule; trip count = its iterations), with the config's head "
                                     'type (ratio: its iteration timed against greedy, alternating, in a table of its '
                                     'own).')
  _MARKDOWN = flags.DEFINE_string('markdown', None, 'profile: write the tables here too.')
  _REDUCE = flags.DEFINE_enum('reduce', 'sum', ['sum', 'median'], "profile: a kernel's time: the sum of its runs, or "
                              'its median run times its runs (robust to preemptions on a loaded machine).')
  # fixed_cost, latency
  _K = flags.DEFINE_integer('k', 4, "fixed_cost, latency: heads k' of the blockwise decoder (fixed_cost with random "
                            'weights: the model has k heads).')
  _LENGTHS = flags.DEFINE_list('lengths', ['1', '9', '17', '33'], 'fixed_cost: output lengths L (tokens) the line '
                               'is fit through.')
  _BEFORE_PAD_TO = flags.DEFINE_integer(
      'before_pad_to', 0, 'fixed_cost: also time every program with the source padded to this many positions and '
      "the batch put on the mesh as a sharded array (how a sentence was decoded before: padded to the split's "
      'longest source), alternating with the rest (0: off).')
  _AT = flags.DEFINE_list('at', ['14.92', '6.27'], 'fixed_cost: greedy tokens and blockwise iterations of a typical '
                          'sentence (default: the Multi30k Both model at k = 4, docs/results/benchmark.md) for the '
                          'share and speedup columns.')
  _MESH = flags.DEFINE_bool('mesh', True, 'fixed_cost: decode on a one-device mesh, as the decode sweep does.')
  _ALTERNATE = flags.DEFINE_enum(
      'alternate', 'sentence', ['sentence', 'pass'], 'latency: what alternates between the decoders. sentence: every '
      'decoder in turn on each sentence (each then finds the caches holding the others\' weights); pass: each decoder '
      'over all the sentences in a row, as a decode of a test set runs (its weights stay warm from one sentence to '
      'the next), decoders in turn pass by pass.')
  _TRACE = flags.DEFINE_bool('trace', False, 'fixed_cost: also print the profiler timeline of whole calls.')
  _SPLIT = flags.DEFINE_string('split', None, "latency, trees: the split (latency's empty default: the config's first "
                               'decode split). ' + _defaults('split'))
  _CRITERION = flags.DEFINE_string('criterion', 'exact', 'latency: acceptance criterion.')
  _EXAMPLES = flags.DEFINE_integer('examples', None, 'latency: sentences to decode, from the first; trees: examples '
                                   'decoded (0 = all of config.decode.max_examples). ' + _defaults('examples'))
  # trees
  _NODES = flags.DEFINE_list('nodes', ['1', '8', '16', '32', '64'], 'trees: tree sizes; 1 = the chain.')
  _BATCH1_EXAMPLES = flags.DEFINE_integer('batch1_examples', 0, 'trees: at batch size 1, only the first N '
                                          '(0 = as others).')
  _TIMING_EXAMPLES = flags.DEFINE_integer('timing_examples', 64, 'trees: examples timed (0 = no timing).')
  _FIGURE = flags.DEFINE_string('figure', '', 'trees: PNG of a tree and its attention mask (empty = none).')
  _FIGURE_NODES = flags.DEFINE_integer('figure_nodes', 16, 'trees: the tree drawn in --figure.')
  _HEADS = flags.DEFINE_integer('heads', 0, "trees: heads k' <= k to use (0 = all the model's k): the chain and the "
                                "trees' depth.")

BOS = 2
NEVER = -1  # an EOS id that argmax never returns: every row decodes max_len tokens
F32 = 4  # bytes


# -- shared by the modes -----------------------------------------------------------------------------------------------

def kernel_jit(kernel):
  """jax.jit whose programs are traced with `kernel`'s matmuls (matmul.traced), usable as @jit or
  @jit(static_argnames=...)."""
  def jit(fn=None, **kwargs):
    if fn is None:
      return functools.partial(jit, **kwargs)
    return jax.jit(matmul.traced(fn, kernel), **kwargs)
  return jit


def fit(steps, seconds):
  """(intercept, slope) of the least-squares line seconds = intercept + slope * steps: a decoder's fixed seconds
  per sentence and seconds per step."""
  slope, intercept = np.polyfit(np.asarray(steps, np.float64), np.asarray(seconds, np.float64), 1)
  return float(intercept), float(slope)


def random_model(config, k, vocab_size=None, **options):
  """(model, params) of the config's model size and dtype with k heads and random weights (vocab_size: default the
  config's data.vocab_size)."""
  model_config = model_lib.model_config(config.model.size, vocab_size=vocab_size or config.data.vocab_size, k=k,
                                        dropout_rate=0.0, dtype=config.model.dtype, **options)
  return model_lib.Transformer(model_config), model_lib.init_params(model_config, jax.random.PRNGKey(0))


def profiled_events(fn, runs: int, prefix: str, options=None) -> list:
  """(start ns, end ns, name) of every trace event on the host CPU while fn() runs `runs` times under jax.profiler."""
  directory = tempfile.mkdtemp(prefix=prefix)
  jax.profiler.start_trace(directory, **({'profiler_options': options} if options else {}))
  for _ in range(runs):
    fn()
  jax.profiler.stop_trace()
  path = sorted(glob.glob(os.path.join(directory, '**', '*.xplane.pb'), recursive=True))[-1]
  return [(e.start_ns, e.start_ns + e.duration_ns, e.name) for plane in jax.profiler.ProfileData.from_file(path).planes
          if plane.name == '/host:CPU' for line in plane.lines for e in line.events]


# -- --mode=ratio: the price of verification, accounted ----------------------------------------------------------------

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


def draft_model(model, size: int):
  """`model` with a draft vocabulary of `size` evenly spaced ids (0: `model` itself); for timing, the ids of a
  random model do not matter, only how many."""
  if not size:
    return model
  ids = tuple(int(i) for i in np.linspace(0, model.config.vocab_size - 1, size).round())
  return model_lib.Transformer(dataclasses.replace(model.config, draft_ids=ids))


def bench(model, params, k_values, batch_sizes, max_len, src_len, repeats, seed=0, peaks=None, draft_sizes=(),
          matmul_kernel='xla', head_weights=('float32',)):
  """Returns a list of {k, batch_size, draft_vocab, greedy_step_s, block_step_s, ratio, ...accounting} records.

  draft_sizes: for each k and batch, besides the full-vocabulary heads (draft_vocab 0), the same iteration with a
  draft vocabulary of each of these sizes (`draft_model`), all timed alternately with the same greedy runs.
  matmul_kernel: 'xla' or 'skinny' (bpd/matmul.py, resolved), for every program, greedy's included.
  head_weights: the dtypes of heads 2..k's packed weights on the skinny kernel (config.decode.head_weights): each
  draft size is timed with each, alternating.
  """
  cache_len = decoder_lib.cache_len(max_len, block=max(k_values))  # one cache for greedy and every k
  c = model.config
  jit = kernel_jit(matmul_kernel)
  # The skinny kernel reads packed weights, made once outside every timed program (as bpd.decoder.Decoder does).
  if matmul_kernel != 'skinny':  # XLA reads the float32 parameters whatever the setting
    head_weights = ('float32',)
  pack_jit = jax.jit(model_lib.packed_weights, static_argnames=('head_weights', 'draft_ids'))
  pack = ((lambda params, draft_ids=(), weights='float32': pack_jit(params, head_weights=weights, draft_ids=draft_ids))
          if matmul_kernel == 'skinny' else lambda params, draft_ids=(), weights='float32': None)
  packed = pack(params)

  def fixed(state):
    return decoding.Fixed(batch_size=state['src_mask_BxS'].shape[0], max_len=max_len, bos_id=BOS, eos_id=NEVER)

  @jit
  def encode(params, packed, src):
    init_state = model_lib.decode_fns(model, params, packed=packed).init
    state = init_state(src, cache_len)
    decoder_lib.check_cache_len(state, max_len, block=max(k_values))
    return state

  @jit
  def run_greedy(params, packed, state):
    score_fn = model_lib.decode_fns(model, params, packed=packed).score
    return decoding.greedy(score_fn, state, fixed=fixed(state)).tokens_BxL

  @jit(static_argnames=('k', 'block_model'))
  def run_block(params_k, packed_k, state, k, block_model=model):  # the first k heads, cut outside (block_carry)
    fns = model_lib.decode_fns(block_model, params_k, num_heads=k, packed=packed_k)
    result = decoding.blockwise(fns, state, fixed=fixed(state),
                                tree=decoding.chain(k), rule=decoding.Criterion(min_block=k))
    return result.tokens_BxL, result.invocations

  # One greedy step and one blockwise iteration, alone, for XLA's cost analysis.
  @jit
  def greedy_carry(state):
    return decoding.greedy_init(state, fixed=fixed(state))

  @jit
  def greedy_step(params, packed, carry):
    score_fn = model_lib.decode_fns(model, params, packed=packed).score
    return decoding.greedy_body(score_fn, fixed=fixed(carry.model_state))(carry)

  # The first k heads (model and parameters) are taken once per decode, outside the loop (model_lib.first_heads):
  # take them outside the compiled iteration too, so that the one-time copy is not counted as a per-iteration cost.
  # model_k already has k heads (or k = 1), so decode_fns' own first_heads slices nothing.
  @jit(static_argnames=('model_k', 'k'))
  def block_carry(params_k, packed_k, state, model_k, k):
    fns = model_lib.decode_fns(model_k, params_k, num_heads=k, packed=packed_k)
    return decoding.blockwise_init(fns, state, fixed=fixed(state),
                                   tree=decoding.chain(k), rule=decoding.Criterion(min_block=k))

  @jit(static_argnames=('model_k', 'k'))
  def block_step(params_k, packed_k, s, model_k, k):
    fns = model_lib.decode_fns(model_k, params_k, num_heads=k, packed=packed_k)
    return decoding.blockwise_body(fns, fixed=fixed(s.model_state),
                                   tree=decoding.chain(k), rule=decoding.Criterion(min_block=k))(s)

  peaks = peaks or machine_peaks()
  records = []
  rng = np.random.RandomState(seed)
  for batch_size in batch_sizes:
    src = jnp.asarray(rng.randint(4, c.vocab_size, size=(batch_size, src_len)), jnp.int32)
    state = jax.block_until_ready(encode(params, packed, src))
    greedy_flops, greedy_bytes = xla_cost(greedy_step, params, packed, greedy_carry(state))
    loop_flops, _ = xla_cost(run_greedy, params, packed, state)
    greedy_count = shape_count(c, batch=batch_size, new_tokens=1, cache_len=cache_len, src_len=src_len,
                               projections=1, proposal_heads=0)
    print(f'batch {batch_size}: XLA counts the whole {max_len}-step greedy loop at {loop_flops / greedy_flops:.2f} x '
          'one step: a while_loop body is counted once, so costs below come from steps compiled alone.')
    for k in k_values:
      variants = [(size, draft_model(model, size), weights) for size in (0, *draft_sizes) for weights in head_weights]
      params_k = model_lib.first_heads(model, params, k)[1]
      # the heads' packed projection has V or R columns, in the variant's dtype
      packs = [pack(params_k, m.config.draft_ids, weights) for _, m, weights in variants]
      g_seconds, *variant_seconds = timing.time_alternating(
          [lambda: run_greedy(params, packed, state)]
          + [lambda k=k, m=m, p=p: run_block(params_k, p, state, k=k, block_model=m)
             for (_, m, _), p in zip(variants, packs)],
          repeats, f'bench k={k} batch={batch_size}')
      for (size, block_model, weights), packed_k, b_seconds in zip(variants, packs, variant_seconds):
        # the first call only proposes
        iterations = int(run_block(params_k, packed_k, state, k=k, block_model=block_model)[1]) - 1
        greedy_s = g_seconds / max_len
        block_s = (b_seconds - greedy_s) / iterations
        model_k = model_lib.first_heads(block_model, params, k)[0]
        block_flops, block_bytes = xla_cost(block_step, params_k, packed_k,
                                            block_carry(params_k, packed_k, state, model_k=model_k, k=k),
                                            model_k=model_k, k=k)
        block_count = shape_count(block_model.config, batch=batch_size, new_tokens=k, cache_len=cache_len,
                                  src_len=src_len, projections=2 * k - 1, proposal_heads=k - 1)
        roof = lambda count, bandwidth='peak_gbyte_s': max(count['flops'] / (peaks['peak_gflop_s'] * 1e9),
                                                           count['bytes'] / (peaks[bandwidth] * 1e9))
        records.append({
            'k': k, 'batch_size': batch_size, 'draft_vocab': size, 'head_weights': weights,
            'greedy_step_s': greedy_s,
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


def head_weight_settings(config) -> tuple[str, ...]:
  """--head_weights (each checked as decode.head_weights is), or the config's one setting."""
  settings = tuple(_HEAD_WEIGHTS.value) or (checks.check_head_weights(config),)
  for weights in settings:
    if weights not in model_lib.HEAD_WEIGHTS:
      raise UserError(f'--head_weights={weights}: choose among {",".join(model_lib.HEAD_WEIGHTS)}.')
  return settings


def format_table(records, title='', tpu_chips=(), tpu_sizes=()):
  """The records as a markdown table; one more column per TPU chip, its estimated ratio for each of tpu_sizes."""
  columns = [
      ('k', 'k', '{}'), ('batch_size', 'batch', '{}'),
      (None, 'draft vocab', lambda r: str(r.get('draft_vocab') or '-')),
      (None, 'head weights', lambda r: r.get('head_weights', 'float32')),
      (None, 'greedy step (ms)', lambda r: f"{1e3 * r['greedy_step_s']:.2f}"),
      (None, 'blockwise iteration (ms)', lambda r: f"{1e3 * r['block_step_s']:.2f}"), ('ratio', 'ratio', '{:.2f}'),
      (None, 'roofline ratio (memory; L3)', lambda r: f"{r['roofline_ratio']:.2f}; {r['roofline_ratio_cached']:.2f}"),
      (None, 'ratio / roofline ratio', lambda r: f"{r['ratio'] / r['roofline_ratio']:.2f}")]
  columns += [(None, f"TPU {chip} ESTIMATE: ratio ({'; '.join(tpu_sizes)})",
               lambda r, chip=chip: '; '.join(f"{r[f'tpu_{chip}_{size}_ratio']:.2f}" for size in tpu_sizes))
              for chip in tpu_chips]
  greedy_block = lambda name, scale, spec: lambda r: (f"{r[f'greedy_{name}'] / scale:{spec}} / "
                                                      f"{r[f'block_{name}'] / scale:{spec}}")
  columns += [
      (None, 'GFLOP greedy / iter (XLA; count)',
       lambda r: f"{greedy_block('flops_xla', 1e9, '.3f')(r)} ({greedy_block('flops_count', 1e9, '.3f')(r)})"),
      (None, 'MB greedy / iter (XLA; weights+cache)',
       lambda r: f"{greedy_block('bytes_xla', 1e6, '.1f')(r)} ({greedy_block('bytes_count', 1e6, '.1f')(r)})"),
      (None, 'achieved GFLOP/s greedy / iter', greedy_block('gflop_s', 1, '.1f')),
      (None, 'achieved GB/s greedy / iter', greedy_block('gbyte_s', 1, '.1f'))]
  return (title + '\n' if title else '') + report.markdown_table(records, columns)


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


def run_ratio(config):
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
  model, params = random_model(config, max(k_values), vocab_size, head_hidden=_HEAD_HIDDEN.value,
                               head_type=config.model.head_type, attention_block=config.model.attention_block)
  kernel = matmul.resolve(config.decode.matmul_kernel)
  peaks = machine_peaks()
  records = bench(model, params, k_values, [int(b) for b in _BATCH_SIZES.value], _MAX_LEN.value, _SRC_LEN.value,
                  _REPEATS.value, peaks=peaks, draft_sizes=draft_sizes, matmul_kernel=kernel,
                  head_weights=head_weight_settings(config))
  add_tpu_estimates(records, chip_devices, tpu_configs)
  c = model.config
  title = (f'model {config.model.size}: d={c.d_model}, {c.num_encoder_layers}+{c.num_decoder_layers} layers, '
           f'ff {c.d_ff}, head_hidden {c.head_hidden or c.d_ff}, {c.head_type} heads, vocab {c.vocab_size}, {c.dtype}; '
           f'{jax.devices()[0].platform}, {len(jax.devices())} device(s); matmuls: {kernel}'
           f'{" (" + matmul.kernel_info() + ")" if kernel == "skinny" else ""}; {_MAX_LEN.value} tokens per run, '
           f'median of {_REPEATS.value} alternating runs per row; '
           f"measured peaks {peaks['peak_gflop_s']:.1f} GFLOP/s (float32 matmul), "
           f"{peaks['peak_gbyte_s']:.1f} GB/s (256 MB array sum), {peaks['cached_gbyte_s']:.1f} GB/s (8 MB, in L3)")
  if chip_devices:
    title += '\n' + tpu_title(chip_devices, tpu_configs)
  print(format_table(records, title, tpu_chips=list(chip_devices), tpu_sizes=tpu_sizes))
  if _PROFILE_TREES.value:
    records += tree_ratios(model, params, k_values, [int(b) for b in _BATCH_SIZES.value], _PROFILE_TREES.value, kernel)
  if _JSON.value:
    with open(_JSON.value, 'w') as f:
      json.dump(records, f, indent=1)


def tree_ratios(model, params, k_values, batch_sizes, tree_specs, kernel) -> list[dict]:
  """--mode=ratio --trees: each tree's exact-rule iteration against a greedy step, both the real loops
  (loop_programs), timed alternately; prints a table and returns its rows."""
  cache_len = _MAX_LEN.value + max([int(k) for k in k_values] + [
      trees.parse_tree_spec(spec, max(k_values), vocab_size=model.config.vocab_size).num_nodes
      for spec in tree_specs]) + 1
  encode = jax.jit(lambda p, s: model_lib.decode_fns(model, p).init(s, cache_len))
  rows = []
  rng = np.random.RandomState(0)
  for batch in batch_sizes:
    src = jnp.asarray(rng.randint(4, model.config.vocab_size, size=(batch, _SRC_LEN.value)), jnp.int32)
    programs = loop_programs(model, params, jax.block_until_ready(encode(params, src)), k_values, _MAX_LEN.value,
                             tree_specs, kernel)
    greedy_fn, greedy_args, _, _ = programs['greedy']
    for name, (fn, args, kwargs, iterations) in programs.items():
      if name == 'greedy' or name.startswith('blockwise'):
        continue
      g, t = timing.time_alternating([lambda: greedy_fn(*greedy_args), lambda: fn(*args, **kwargs)],
                                     _REPEATS.value, f'tree ratio {name} batch={batch}')
      step = g / _MAX_LEN.value
      iteration = (t - step) / iterations  # the first call only proposes
      rows.append({'tree': name, 'batch_size': batch, 'greedy_step_s': step, 'tree_step_s': iteration,
                   'tree_ratio': iteration / step, 'iterations': iterations})
  columns = [('tree', 'tree', '{}'), ('batch_size', 'batch', '{}'),
             (None, 'greedy step (ms)', lambda r: f"{1e3 * r['greedy_step_s']:.2f}"),
             (None, 'tree iteration (ms)', lambda r: f"{1e3 * r['tree_step_s']:.2f}"),
             ('tree_ratio', 'ratio', '{:.2f}'), ('iterations', 'iterations per run', '{}')]
  print(report.markdown_table(rows, columns))
  return rows


# -- --mode=profile: per-kernel time of a greedy step and an iteration -------------------------------------------------

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
  kernels = collections.defaultdict(lambda: [0.0, 0])
  durations = collections.defaultdict(list)
  for start, end, name in profiled_events(lambda: jax.block_until_ready(fn()), runs, 'bpd_profile_'):
    info = instructions.get(name)
    if info is None or info['kind'] == 'while':
      continue
    kernels[name][0] += end - start
    kernels[name][1] += 1
    durations[name].append(end - start)
  if reduce == 'median':
    for name, ns in durations.items():
      kernels[name][0] = float(np.median(ns)) * len(ns)
  return kernels


def kernel_table(title, kernels, instructions, steps, top):
  """Markdown: the `top` kernels by time per step, with bytes, GB/s and their jax origin."""
  total = sum(ns for ns, _ in kernels.values())
  unknown = {'kind': '?', 'shape': '?', 'bytes': 0, 'op': ''}
  rows = [{**instructions.get(name, unknown), 'name': name, 'ns': ns, 'count': count}
          for name, (ns, count) in sorted(kernels.items(), key=lambda kv: -kv[1][0])[:top]]

  def gbs(r):
    per_run_ns = r['ns'] / max(r['count'], 1)
    return f"{r['bytes'] / per_run_ns if per_run_ns else 0.0:.1f}"

  def origin(r):
    op = r['op'].replace('jit(', '').replace('|', '/')
    return op if len(op) < 70 else '…' + op[-69:]

  columns = [('name', 'kernel', '{}'), ('kind', 'kind', '{}'), ('shape', 'output', '{}'),
             (None, 'µs / step', lambda r: f"{1e-3 * r['ns'] / steps:.1f}"),
             (None, 'share', lambda r: f"{r['ns'] / total:.1%}"),
             (None, 'runs / step', lambda r: f"{r['count'] / steps:.1f}"),
             (None, 'MB moved', lambda r: f"{r['bytes'] / 1e6:.2f}"), (None, 'GB/s', gbs), (None, 'from', origin)]
  return (f'{title}: {1e-3 * total / steps:.1f} µs summed kernel (thread) time, {len(kernels)} distinct kernels, '
          f'{sum(n for _, n in kernels.values()) / steps:.0f} kernel runs per step\n\n'
          + report.markdown_table(rows, columns))


def loop_programs(model, params, state, k_values, max_len, tree_specs=(), matmul_kernel='xla',
                  head_weights='float32'):
  """{name: (jitted fn, args, static kwargs, trip count)}: greedy and the blockwise loop for each k; with
  tree_specs, the exact-rule loop over each tree (a spec of bpd/trees.py without trees.json, e.g. 'dynamic:16') at
  each k, whose trip count (its iterations: random heads are rarely right) is read from one run."""
  batch = state['src_mask_BxS'].shape[0]
  fixed = decoding.Fixed(batch_size=batch, max_len=max_len, bos_id=BOS, eos_id=NEVER)
  jit = kernel_jit(matmul_kernel)

  @jit
  def run_greedy(params, packed, state):
    score_fn = model_lib.decode_fns(model, params, num_heads=1, packed=packed).score
    return decoding.greedy(score_fn, state, fixed=fixed).tokens_BxL

  @jit(static_argnames='k')
  def run_block(params_k, packed_k, state, k):
    # params_k: the first k heads, cut once outside (as bpd.decoder.Decoder does), so no copy is profiled here.
    model_k = model_lib.Transformer(dataclasses.replace(model.config, k=k))
    fns = model_lib.decode_fns(model_k, params_k, packed=packed_k)
    return decoding.blockwise(fns, state, fixed=fixed,
                              tree=decoding.chain(k), rule=decoding.Criterion(min_block=k)).tokens_BxL

  @jit(static_argnames=('k', 'tree'))
  def run_tree(params_k, packed_k, state, k, tree):
    model_k = model_lib.Transformer(dataclasses.replace(model.config, k=k))
    fns = model_lib.decode_fns(model_k, params_k, packed=packed_k)
    result = decoding.blockwise(fns, state, fixed=fixed, tree=tree, rule=decoding.EXACT)
    return result.tokens_BxL, result.invocations

  first_heads = jax.jit(lambda params, k: model_lib.first_heads(model, params, k)[1], static_argnames='k')
  # The skinny kernel reads packed weights, made once outside the programs (as bpd.decoder.Decoder does).
  pack = (jax.jit(functools.partial(model_lib.packed_weights, head_weights=head_weights))
          if matmul_kernel == 'skinny' else lambda params: None)
  out = {'greedy': (run_greedy, (params, pack(params), state), {}, max_len)}
  for k in k_values:
    params_k = first_heads(params, k=k)
    args = (params_k, pack(params_k), state)
    out[f'blockwise k={k}'] = (run_block, args, {'k': k}, -(-max_len // k))
    for spec in tree_specs:
      tree = trees.parse_tree_spec(spec, k, vocab_size=model.config.vocab_size)
      iterations = int(run_tree(*args, k=k, tree=tree)[1]) - 1
      out[f'{spec} k={k}'] = (run_tree, args, {'k': k, 'tree': tree}, iterations)
  return out


def run_profile(config):
  k_values = [int(k) for k in _KS.value]
  model, params = random_model(config, max(k_values), head_type=config.model.head_type)
  c = model.config
  tree_nodes = [trees.parse_tree_spec(spec, max(k_values), vocab_size=c.vocab_size).num_nodes
                for spec in _PROFILE_TREES.value]
  cache_len = _MAX_LEN.value + max(k_values + tree_nodes) + 1
  kernel = matmul.resolve(config.decode.matmul_kernel)
  encode = jax.jit(lambda p, s: model_lib.decode_fns(model, p).init(s, cache_len))
  tables = [f'model {config.model.size}: d={c.d_model}, {c.num_decoder_layers} decoder layers, ff {c.d_ff}, '
            f'vocab {c.vocab_size}, {c.dtype}, {c.head_type} heads; {_MAX_LEN.value} tokens per run, '
            f'{_RUNS.value} profiled runs, '
            f'kernel time {_REDUCE.value}; matmuls: {kernel}, heads 2..k {checks.check_head_weights(config)}; '
            f'XLA_FLAGS={os.environ.get("XLA_FLAGS", "")!r}']
  rng = np.random.RandomState(0)
  for batch in [int(b) for b in _BATCH_SIZES.value]:
    src = jnp.asarray(rng.randint(4, c.vocab_size, size=(batch, _SRC_LEN.value)), jnp.int32)
    state = jax.block_until_ready(encode(params, src))
    programs = loop_programs(model, params, state, k_values, _MAX_LEN.value, _PROFILE_TREES.value, kernel,
                             head_weights=checks.check_head_weights(config))
    for name, (jitted, args, kwargs, steps) in programs.items():
      instructions = hlo_instructions(jitted.lower(*args, **kwargs).compile().as_text())
      kernels = profile(lambda: jitted(*args, **kwargs), _RUNS.value, instructions, _REDUCE.value)
      table = kernel_table(f'### {name}, batch {batch}', kernels, instructions, steps * _RUNS.value,
                           _TOP.value)
      print(table + '\n', flush=True)
      tables.append(table)
  if _MARKDOWN.value:
    with open(_MARKDOWN.value, 'w') as f:
      f.write('\n\n'.join(tables) + '\n')


# -- --mode=matmul_floor: only the weight matmuls of a step and of an iteration ----------------------------------------

def layer_matrices(params, num_layers, packed=False):
  """Per decoder layer the [in, out] weight matrices a decoding call multiplies by, in the order it does; with
  packed, the same of the packed tree (model.packed_weights), already flat."""
  out = []
  for i in range(num_layers):
    layer = params[f'decoder_layers_{i}']
    flat_in = lambda kernel: kernel if packed else kernel.reshape(kernel.shape[0], -1)  # [D, H, K] -> [D, D]
    flat_out = lambda kernel: kernel if packed else kernel.reshape(-1, kernel.shape[-1])  # [H, K, D] -> [D, D]
    self_attn, cross = layer['self_attn'], layer['cross_attn']
    out.append([flat_in(self_attn['query']['kernel']), flat_in(self_attn['key']['kernel']),
                flat_in(self_attn['value']['kernel']), flat_out(self_attn['out']['kernel']),
                flat_in(cross['query']['kernel']), flat_out(cross['out']['kernel']),
                layer['ff']['wi']['kernel'], layer['ff']['wo']['kernel']])
  return out


def matmul_step(params, x_MxD, num_layers, heads, batch, packed=None):
  """One step's (heads = 0) or one iteration's (heads = k - 1) weight matmuls on M = batch x (1 or k) rows;
  returns the next x_MxD. params['multi_output'] holds exactly `heads` heads (cut outside the loop).

  Self-attention's q, k and v all read the layer's input (their sum goes on, so none is dead); every other matmul
  reads the previous one's output, as in the model. packed: model.packed_weights(params) for the skinny kernel."""
  embedding_VxD = params['embed']['embedding']
  h = x_MxD
  # lax.dot_general, or the skinny kernel (on the packed weights) inside matmul.use('skinny'), as the model's matmuls
  packs = iter(sum(layer_matrices(packed, num_layers, packed=True), []) if packed is not None else [])
  mm = lambda x, w: matmul.dense(x, w, packed=next(packs, None))
  for q, k, v, o, cq, co, wi, wo in layer_matrices(params, num_layers):
    a = mm(jnp.tanh(mm(h, q) + mm(h, k) + mm(h, v)), o)
    c = mm(jnp.tanh(mm(a, cq)), co)
    h = jnp.tanh(mm(jax.nn.relu(mm(c, wi)), wo))
  logits_MxV = matmul.dense_nt(h, embedding_VxD)
  signal = jnp.max(logits_MxV) * 1e-6  # the next step depends on the projection, as the next token does
  if heads:
    heads_params = params['multi_output']
    last_BxD = h.reshape(batch, -1, h.shape[-1])[:, -1]  # the proposals come from one position per row
    # In the multi-output layer's layout (layers.MultiOutput): the head axis first, a batched matmul per weight.
    x_NxBxD = jnp.broadcast_to(last_BxD, (heads,) + last_BxD.shape)
    heads_packed = packed['multi_output'] if packed is not None else {}
    hidden_NxBxF = jax.nn.relu(matmul.batched(x_NxBxD, heads_params['wi_kernel'], packed=heads_packed.get('wi_kernel')))
    vectors_BxNxD = jnp.moveaxis(matmul.batched(hidden_NxBxF, heads_params['wo_kernel'],
                                                packed=heads_packed.get('wo_kernel')), 0, 1)
    signal = signal + jnp.max(matmul.dense_nt(jnp.tanh(vectors_BxNxD), embedding_VxD)) * 1e-6
  return jnp.tanh(h + signal)


def run_matmul_floor(config):
  k_values = [int(k) for k in _KS.value]
  max_len = _MAX_LEN.value
  model, params = random_model(config, max(k_values))
  c = model.config
  cache_len = max_len + max(k_values) + 1
  encode = jax.jit(lambda p, s: model_lib.decode_fns(model, p).init(s, cache_len))
  kernel = matmul.resolve(config.decode.matmul_kernel)

  @functools.partial(jax.jit, static_argnames=('batch', 'k', 'steps'))
  @functools.partial(matmul.traced, kernel=kernel)
  def matmuls(params_k, packed_k, batch, k, steps):  # params_k: the first k heads (k = 1: a greedy step), cut outside
    x = jnp.full((batch * k, c.d_model), 0.01, jnp.float32)
    return jax.lax.fori_loop(
        0, steps, lambda _, x: matmul_step(params_k, x, c.num_decoder_layers, k - 1, batch, packed_k), x)

  print(f'model {config.model.size}: d={c.d_model}, {c.num_decoder_layers} decoder layers, ff {c.d_ff}, vocab '
        f'{c.vocab_size}; matmuls: {kernel}; {max_len} tokens per run; {_REPEATS.value} alternating runs, percentile '
        f'{_PERCENTILE.value:g}; ms per greedy '
        'step or iteration')
  ms = lambda name: lambda r: f'{1e3 * r[name]:.3f}'
  columns = [('k', 'k', '{}'), ('batch', 'batch', '{}'), (None, 'model step', ms('step')),
             (None, 'model iteration', ms('iteration')), ('model_ratio', 'model ratio', '{:.2f}'),
             (None, 'matmuls step', ms('m_step')), (None, 'matmuls iteration', ms('m_iteration')),
             ('matmuls_ratio', 'matmuls ratio', '{:.2f}'),
             (None, 'model ratio / matmuls ratio', lambda r: f"{r['model_ratio'] / r['matmuls_ratio']:.2f}")]
  print(report.markdown_table([], columns))
  rng = np.random.RandomState(0)
  for batch in [int(b) for b in _BATCH_SIZES.value]:
    src = jnp.asarray(rng.randint(4, c.vocab_size, size=(batch, _SRC_LEN.value)), jnp.int32)
    state = jax.block_until_ready(encode(params, src))
    real = loop_programs(model, params, state, k_values, max_len, matmul_kernel=kernel)
    greedy_fn, greedy_args, _, _ = real['greedy']
    for k in k_values:
      block_fn, block_args, block_kwargs, iterations = real[f'blockwise k={k}']
      fns = [lambda: greedy_fn(*greedy_args),
             lambda: block_fn(*block_args, **block_kwargs),
             lambda: matmuls(params, greedy_args[1], batch=batch, k=1, steps=max_len),
             lambda k=k: matmuls(block_args[0], block_args[1], batch=batch, k=k, steps=iterations)]
      g, b, mg, mb = timing.time_alternating(fns, _REPEATS.value, f'matmul_floor k={k} batch={batch}',
                                             lambda t: float(np.percentile(t, _PERCENTILE.value)))
      # The blockwise loop's first call only proposes (about one greedy step): not an iteration.
      step, iteration = g / max_len, (b - g / max_len) / iterations
      m_step, m_iteration = mg / max_len, mb / iterations
      row = {'k': k, 'batch': batch, 'step': step, 'iteration': iteration, 'model_ratio': iteration / step,
             'm_step': m_step, 'm_iteration': m_iteration, 'matmuls_ratio': m_iteration / m_step}
      print(report.markdown_table([row], columns, header=False), flush=True)


# -- --mode=fixed_cost: a batch-1 sentence's fixed cost, broken down ---------------------------------------------------

BEFORE = ' (before)'
BATCHING_SENTENCES = 64  # run_batches' host work is timed over this many sentences and divided


def load_model(config, workdir, k, mesh):
  """(model, params): the checkpoint in workdir, or random weights of the config's size with k heads."""
  if workdir:
    model_config, params, _ = checkpoint.load_params(workdir, mesh=mesh)
    return model_lib.Transformer(model_config), params
  model, params = random_model(config, k)
  if mesh is not None:
    params = sharding.put(params, sharding.state_sharding(params, mesh))
  return model, params


def fixed_cost_programs(model, params, mesh, k, lengths, sources, matmul_kernel='auto'):
  """{name: fn() -> host result} for every part; sources: {variant: src_1xS}, each decoded at every L; the
  decoders on config.decode.matmul_kernel."""
  longest = max(lengths)
  criterion, chain = decoding.Criterion(min_block=k), decoding.chain(k)
  out = {}
  decoders = {length: decoder_lib.Decoder(model, length, mesh, eos_id=NEVER, matmul_kernel=matmul_kernel)
              for length in lengths}
  base = decoders[longest]
  noop = jax.jit(lambda params, src_BxS: src_BxS[0, 0])
  put = base._put  # pylint: disable=protected-access
  src_1xS = sources['']
  out['dispatch'] = lambda: jax.device_get(noop(params, put(src_1xS)))
  if mesh is not None:  # how Decoder put the host batch on a mesh before (a sharded array built first)
    out['dispatch, sharded batch'] = lambda: jax.device_get(noop(params, sharding.shard_global_batch(src_1xS, mesh)))
  cache = decoder_lib.cache_len(longest, k)
  # The encoder alone, on the decoders' matmuls (the skinny kernel reads the packed weights, Decoder._packed).
  init = jax.jit(matmul.traced(lambda params, packed, src_BxS: model_lib.decode_fns(
      model, params, num_heads=1, packed=packed).init(src_BxS, cache), base.matmul_kernel))
  packed = base._packed(params)  # pylint: disable=protected-access
  for variant, src in sources.items():
    out[f'encoder{variant}'] = lambda src=src: jax.block_until_ready(init(params, packed, put(src)))
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
  options = jax.profiler.ProfileOptions()
  options.python_tracer_level = 0

  def annotated():
    with jax.profiler.TraceAnnotation('bpd_call'):
      fn()

  events = profiled_events(annotated, runs, 'bpd_fixed_cost_', options)
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


def run_fixed_cost(config):
  k = _K.value
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
  fns = fixed_cost_programs(model, params, mesh, k, lengths, sources, config.decode.matmul_kernel)
  names = list(fns)
  reduce = lambda t: float(np.percentile(t, _PERCENTILE.value))
  seconds = dict(zip(names, timing.time_alternating([fns[n] for n in names], _REPEATS.value, 'fixed_cost', reduce)))
  ms = {name: 1e3 * s for name, s in seconds.items()}
  print(f'model {config.model.size if not _WORKDIR.value else _WORKDIR.value}: d={model.config.d_model}, '
        f'{model.config.num_encoder_layers}+{model.config.num_decoder_layers} layers, vocab {model.config.vocab_size}; '
        f'batch 1, source {_SRC_LEN.value} tokens padded to {src_len}'
        + (f' (before: {_BEFORE_PAD_TO.value})' if _BEFORE_PAD_TO.value else '') +
        f', k = {k}, {_REPEATS.value} alternating runs, percentile {_PERCENTILE.value} of each, mesh={_MESH.value}, '
        f'matmuls: {matmul.resolve(config.decode.matmul_kernel, mesh)}')
  print(report.markdown_table(
      [{'program': name, 'ms': ms[name] / (BATCHING_SENTENCES if name == 'batching' else 1)} for name in names],
      [('program', 'program', '{}'), ('ms', f'ms (percentile {_PERCENTILE.value})', '{:.3f}')]))
  variants = {'after': ('', 'dispatch')}
  if _BEFORE_PAD_TO.value:
    variants = {'before': (BEFORE, 'dispatch, sharded batch' if mesh is not None else 'dispatch'), **variants}
  greedy_steps, block_steps = (float(x) for x in _AT.value)
  rows = []
  for label, (variant, dispatch) in variants.items():
    parts = breakdown(ms, seconds, lengths, k, variant, dispatch)
    total = {'greedy': parts['greedy'][0] + greedy_steps * parts['greedy'][1],
             'blockwise': parts['blockwise'][0] + block_steps * parts['blockwise'][1]}
    for decoder, (fixed, per_step, part_ms, rest) in parts.items():
      rows.append({'code': label, 'decoder': decoder, 'fixed': fixed, 'per_step': per_step, **part_ms, 'rest': rest,
                   'total': total[decoder], 'share': fixed / total[decoder],
                   'speedup': total['greedy'] / total[decoder]})
  columns = ([('code', 'code', '{}'), ('decoder', 'decoder', '{}'), ('fixed', 'fixed ms (intercept)', '{:.3f}'),
              ('per_step', 'ms per step', '{:.3f}')]
             + [(part, part, '{:.3f}') for part in ('batching', 'dispatch', 'encoder', 'first call', 'copy back')]
             + [('rest', 'rest of fixed', '{:.3f}'),
                ('total', f'ms at {greedy_steps:g} tokens / {block_steps:g} iterations', '{:.2f}'),
                ('share', 'fixed share', '{:.0%}'), ('speedup', 'speedup', '{:.2f}x')])
  print('\n' + report.markdown_table(rows, columns))
  if _TRACE.value:
    print('\nprofiler timeline of whole calls (ms, median of runs)')
    phases = ('python', 'before loop', 'loop', 'copy back')
    timelines = [{'program': name, **trace_timeline(fns[name], max(3, _REPEATS.value // 3))}
                 for name in names if ' L=' in name]
    print(report.markdown_table(timelines, [('program', 'program', '{}')] + [
        (None, phase, lambda t, phase=phase: f'{t.get(phase, 0.0):.3f}') for phase in phases]))


# -- --mode=latency: a trained model's time per sentence as fixed + per-step cost --------------------------------------


HEAD_LABELS = {'float32': '', 'float16': ' f16 heads', 'int8': ' int8 heads'}  # latency rows' names


def latency_order(names: list, sentences: int, alternate: str) -> list:
  """One pass of --mode=latency: (sentence index, decoder name) in the order they run. 'sentence': every decoder
  in turn on sentence 0, then on sentence 1, ...; 'pass': the first decoder over every sentence, then the next."""
  if alternate == 'sentence':
    return [(i, name) for i in range(sentences) for name in names]
  if alternate == 'pass':
    return [(i, name) for name in names for i in range(sentences)]
  raise ValueError(f'alternate={alternate!r}: sentence or pass')


def run_latency(config):
  """Every decoder of a trained model, each sentence alone at batch 1, on XLA's matmuls and on the skinny kernel,
  all alternating sentence by sentence (--alternate=pass: pass by pass): greedy on each setting, and blockwise (the
  chain of --k, and each of --trees at k' = --k) on each. The speedups are against greedy on the same setting and
  against the faster greedy, so that no speedup comes from slowing greedy down."""
  workdir = _WORKDIR.value
  task = tasks.for_config(config)
  criterion = decoding.parse_criterion(_CRITERION.value)
  model_config, params, _, tokenizer, decoder = evaluate.load_for_decoding(config, workdir, task,
                                                                           sharding.make_mesh(1))
  if not 1 < _K.value <= model_config.k:
    raise UserError(f'--k={_K.value}: choose 2..{model_config.k} (the heads of the model in {workdir}).')
  kernels = [k for k in ('xla', 'skinny') if k == 'xla' or matmul.resolve('auto') == 'skinny']
  # The heads drafting over the whole vocabulary (R = 0), and over each --draft_vocab size R: greedy is the same
  # program for every R (head 1 always scores the whole vocabulary), so it runs once per kernel.
  full_config = dataclasses.replace(model_config, draft_ids=())
  models = {0: model_lib.Transformer(full_config)}
  for size in sorted({int(size) for size in _DRAFT_VOCAB.value} - {0}):
    models[size] = model_lib.Transformer(draft_vocab.for_decoding(
        size, full_config, lambda: task.target_counts(config, tokenizer)))
  # Heads 2..k in each of the --head_weights dtypes (the skinny kernel only: XLA reads the float32 parameters).
  weights = head_weight_settings(config)
  variants = [(kernel, size, w) for kernel in kernels for size in models
              for w in (weights if kernel == 'skinny' else ('float32',))]
  decoders = {(kernel, size, w): decoder_lib.Decoder(models[size], decoder.max_len, None, decoder.eos_id,
                                                     matmul_kernel=kernel, head_weights=w)
              for kernel, size, w in variants}
  shapes = [('chain', decoding.chain(_K.value))] + [
      (spec, trees.parse_tree_spec(spec, _K.value, workdir, vocab_size=model_config.vocab_size))
      for spec in _PROFILE_TREES.value]
  src_ids = task.decode_examples(config, _SPLIT.value or config.decode.splits[0], tokenizer)[0][:_EXAMPLES.value]
  batches = [src for _, src in batching.eval_batches(src_ids, None, 1, decoder_lib.source_buckets(src_ids))]

  def greedy(d):
    def run(src_1xS):
      out = jax.device_get(d.greedy(params, src_1xS))
      return int(out.length_B[0]), out.tokens_BxL[0]  # tokens = greedy steps
    return run

  def blockwise(d, tree):
    def run(src_1xS):
      out = jax.device_get(d.blockwise(params, src_1xS, criterion, tree))
      return int(out.iterations_B[0]), out.tokens_BxL[0]
    return run

  programs = {}
  for kernel in kernels:
    # greedy never runs heads 2..k: any of the kernel's decoders serves
    programs[f'greedy, {kernel}'] = greedy(next(d for (kern, size, _), d in decoders.items()
                                                 if kern == kernel and size == 0))
  for kernel, size, w in variants:
    for name, tree in shapes:
      label = f'{name}{f" R={size}" if size else ""}{HEAD_LABELS[w]}'
      programs[f'{label}, {kernel}'] = blockwise(decoders[kernel, size, w], tree)
  # Compile and warm up on every padded source length that is timed (run_batches pads each sentence to its own
  # multiple of 8, decoder.source_buckets), then time with no compile allowed.
  for src in list({src.shape[1]: src for src in batches}.values()) + batches[:3]:
    for fn in programs.values():
      fn(src)
  rows = {name: [] for name in programs}
  tokens_of = {}  # (decoder, sentence) -> its tokens (the same every pass)
  by_sentence = _ALTERNATE.value == 'sentence'
  order = latency_order(list(programs), len(batches), _ALTERNATE.value)
  with timing.no_compiles('bench_decode --mode=latency'):
    for _ in range(_REPEATS.value):
      for i, name in order:
        start = time.perf_counter()
        steps, tokens_of[name, i] = programs[name](batches[i])
        rows[name].append((steps, time.perf_counter() - start))
  # The share of sentences each decoder decodes as greedy on the same matmuls does.
  identical = {name: np.mean([np.array_equal(tokens_of[name, i], tokens_of[f'greedy, {name.rsplit(", ", 1)[1]}', i])
                              for i in range(len(batches))]) for name in programs}
  print(f'{len(batches)} sentences x {_REPEATS.value} passes, batch 1, k = {_K.value}, {_CRITERION.value}; '
        f'matmuls: {", ".join(kernels)} ({matmul.kernel_info()}); alternating '
        + ('sentence by sentence' if by_sentence else 'pass by pass (each decoder over all sentences in a row)'))
  seconds_of = {name: np.array([t for _, t in column]) for name, column in rows.items()}
  fastest_greedy = min(seconds_of[f'greedy, {kernel}'].sum() for kernel in kernels)
  table = []
  for name, column in rows.items():
    steps, seconds = (np.array(c, dtype=np.float64) for c in zip(*column))
    fixed, per_step = fit(steps, seconds)
    kernel = name.rsplit(', ', 1)[1]
    table.append({'decoder': name, 'ms': seconds.mean() * 1e3, 'steps': steps.mean(), 'fixed_ms': fixed * 1e3,
                  'step_ms': per_step * 1e3, 'fixed_share': fixed / seconds.mean(),
                  'speedup_same': seconds_of[f'greedy, {kernel}'].sum() / seconds.sum(),
                  'speedup_fastest': fastest_greedy / seconds.sum(),
                  'identical': identical[name]})
  print(report.markdown_table(table, [
      ('decoder', 'decoder, matmuls', '{}'), ('ms', 'ms per sentence', '{:.2f}'),
      ('steps', 'steps per sentence', '{:.2f}'), ('fixed_ms', 'fixed ms per sentence', '{:.3f}'),
      ('fixed_share', 'fixed share', '{:.0%}'), ('step_ms', 'ms per step', '{:.3f}'),
      ('speedup_same', 'speedup vs greedy, same matmuls', '{:.2f}x'),
      ('speedup_fastest', 'speedup vs the fastest greedy', '{:.2f}x'), ('identical', 'identical to greedy', '{:.3f}')]))
  for kernel in kernels:  # the full-vocabulary chain, in each head dtype the kernel ran
    greedy_step = next(r['step_ms'] for r in table if r['decoder'] == f'greedy, {kernel}')
    for r in table:
      if r['decoder'] in (f'chain, {kernel}', f'chain f16 heads, {kernel}'):
        print(f"{r['decoder']}: iteration / greedy step inside the loop: {r['step_ms'] / greedy_step:.2f}")


# -- --mode=trees: tree decoding against the chain ---------------------------------------------------------------------

def draw_tree(paths, path: str, title: str = ''):
  """The tree (node = rank of its head's choice, columns = depth) beside its ancestor attention mask."""
  import matplotlib  # pylint: disable=g-import-not-at-top
  matplotlib.use('Agg')
  import matplotlib.pyplot as plt  # pylint: disable=g-import-not-at-top
  layout = decoding.layout(paths)
  depth_N, parent_N = layout.depth_N, layout.parent_N
  # y: leaves in canonical DFS order, parents centred over their children.
  children = {n: [m for m in range(len(paths)) if parent_N[m] == n] for n in range(-1, len(paths))}
  y, next_leaf = {}, [0]

  def place(n):
    kids = sorted(children[n], key=lambda m: paths[m])
    for m in kids:
      place(m)
    if n >= 0:
      y[n] = np.mean([y[m] for m in kids]) if kids else next_leaf[0]
      if not kids:
        next_leaf[0] += 1
  place(-1)
  fig, (ax_tree, ax_mask) = plt.subplots(1, 2, figsize=(10, 4.2), gridspec_kw={'width_ratios': [1.1, 1]})
  for n in range(len(paths)):
    x = depth_N[n] + 1
    if parent_N[n] >= 0:
      ax_tree.plot([x - 1, x], [y[parent_N[n]], y[n]], color='gray', lw=1, zorder=1)
    else:
      ax_tree.plot([0, x], [np.mean(list(y.values())), y[n]], color='gray', lw=1, zorder=1)
    ax_tree.scatter([x], [y[n]], s=160, color='tab:blue' if paths[n][-1] == 0 else 'tab:orange', zorder=2)
    ax_tree.text(x, y[n], str(paths[n][-1]), ha='center', va='center', color='white', fontsize=7, zorder=3)
  ax_tree.scatter([0], [np.mean(list(y.values()))], s=160, color='black', zorder=2)
  ax_tree.set_xticks(range(layout.path_NxD.shape[1] + 1))
  ax_tree.set_xticklabels(['j (last\naccepted)'] + [f'head {d + 1}' for d in range(layout.path_NxD.shape[1])])
  ax_tree.set_yticks([])
  ax_tree.invert_yaxis()
  ax_tree.set_title('tree: rank of the head\'s choice at each node')
  ax_mask.imshow(layout.ancestor_NxN, cmap='Greys', interpolation='nearest')
  ax_mask.set_xlabel('key: tree node (slot start + m)')
  ax_mask.set_ylabel('query: tree node n')
  ax_mask.set_title('attention among the nodes (plus the whole prefix)')
  report.save_figure(fig, path, title)


def bench_trees(config, workdir, split, nodes, batch_sizes, examples, batch1_examples, timing_examples, repeats,
                heads=0):
  model_config, params, _ = checkpoint.load_params(workdir)
  if not 0 <= heads <= model_config.k:
    raise UserError(f'--heads={heads}: the model in {workdir} has k={model_config.k}; use 1..{model_config.k}.')
  k = heads or model_config.k
  settings = []  # (label, topology or None for the chain)
  for n in nodes:
    settings.append((f'chain (k={k})', decoding.chain(k)) if n == 1 else
                    (f'nodes:{n}', trees.parse_tree_spec(f'nodes:{n}', k, workdir)))
  tokenizer = tokenizer_lib.load(os.path.join(workdir, tokenizer_lib.MODEL_NAME))
  src, tgt = pipeline.load_split(config.data, split, config.seed)
  limit = examples or config.decode.max_examples
  if limit:
    src, tgt = src[:limit], tgt[:limit]
  all_ids, _, _ = batching.encode_pairs(tokenizer, src, tgt, config.decode.max_src_len, truncate=True)
  decoder = decoder_lib.Decoder(model_lib.Transformer(model_config), config.decode.max_len)
  criterion = decoding.Criterion()
  rows = []
  for batch_size in batch_sizes:
    src_ids = all_ids[:batch1_examples] if batch_size == 1 and batch1_examples else all_ids
    bucket = decoder_lib.source_bucket(src_ids)
    greedy_fn = lambda s: decoder.greedy(params, s).tokens_BxL
    greedy_out, _ = decoder_lib.run_batches(greedy_fn, src_ids, batch_size, bucket=bucket)
    for label, tree in settings:
      fn = lambda s, tree=tree: decoder.blockwise(params, s, criterion, tree)
      outs, _ = decoder_lib.run_batches(fn, src_ids, batch_size, bucket=bucket)
      tokens = sum(int(o.length_B) for o in outs)
      iterations = sum(int(o.iterations_B) for o in outs)
      identical = np.mean([np.array_equal(o.tokens_BxL, g) for o, g in zip(outs, greedy_out)])
      row = {'batch': batch_size, 'tree': label, 'nodes': tree.num_nodes, 'examples': len(src_ids),
             'paths': None if tree.is_chain else tree.paths,
             'mean_accepted_block': tokens / max(iterations, 1), 'iterations': iterations,
             'identical_to_greedy': float(identical)}
      if timing_examples:
        g_s, s = decoder_lib.time_side_by_side([greedy_fn, fn], src_ids[:timing_examples], batch_size, repeats,
                                               bucket, f'b{batch_size} {label}')
        row.update(greedy_seconds=g_s, seconds=s, speedup=g_s / s)
      rows.append(row)
      print({key: v for key, v in row.items() if key != 'paths'}, flush=True)
  return rows, model_config, k


def add_tree_tpu_estimates(rows, model_config, chips, k, max_len, src_len=32):
  """Per row and chip: tpu_<chip>_ratio, one iteration (chain or tree) over one greedy step, from the TPU compiler's
  FLOPs and bytes of the model compiled in bfloat16 for one chip (bpd/tpu_estimate.py; an ESTIMATE), and
  tpu_<chip>_speedup = mean accepted block / that ratio: what the wall clock would give at the roofline."""
  for chip in chips:
    device, devices_per_chip = tpu_estimate.chip_device(chip)
    greedy = {}
    for r in rows:
      paths = r.get('paths')
      cache_len = max_len + max(r['nodes'], k) + 1
      shapes = dict(batch=r['batch'], max_len=max_len, src_len=src_len, cache_len=cache_len)
      if r['batch'] not in greedy:
        greedy[r['batch']] = tpu_estimate.roofline_s(
            tpu_estimate.step_cost(model_config, device, 'greedy', k=1, **shapes), chip, devices_per_chip)
      step = (tpu_estimate.step_cost(model_config, device, 'block', k=k, **shapes) if paths is None else
              tpu_estimate.step_cost(model_config, device, 'tree', k=k, paths=paths, **shapes))
      r[f'tpu_{chip}_ratio'] = tpu_estimate.roofline_s(step, chip, devices_per_chip) / greedy[r['batch']]
      r[f'tpu_{chip}_speedup'] = r['mean_accepted_block'] / r[f'tpu_{chip}_ratio']
  return rows


def trees_table(rows, chain_block, chips=()) -> str:
  columns = [('batch', 'batch', '{}'), ('tree', 'tree', '{}'), ('nodes', 'nodes', '{}'),
             ('mean_accepted_block', 'mean accepted block', '{:.3f}'),
             (None, 'vs chain', lambda r: f"{r['mean_accepted_block'] / chain_block[r['batch']]:.3f}x"),
             ('iterations', 'iterations', '{}'), ('identical_to_greedy', 'identical to greedy', '{:.3f}'),
             ('speedup', 'speedup over greedy (loaded CPU)', '{:.2f}x')]
  columns += [(None, f'TPU {c} ESTIMATE: iteration / greedy step, speedup',
               lambda r, c=c: f"{r[f'tpu_{c}_ratio']:.2f}, {r[f'tpu_{c}_speedup']:.2f}x") for c in chips]
  return report.markdown_table(rows, columns)


def run_trees(config):
  try:
    nodes = [int(n) for n in _NODES.value]
    batch_sizes = [int(b) for b in _BATCH_SIZES.value]
  except ValueError:
    raise UserError('--nodes and --batch_sizes take integers, e.g. --nodes=1,8,16 --batch_sizes=1,32.') from None
  if any(n < 1 for n in nodes) or any(b < 1 for b in batch_sizes):
    raise UserError('--nodes and --batch_sizes must be >= 1 (nodes 1 = the chain).')
  workdir = _WORKDIR.value
  if _FIGURE.value:
    k = _HEADS.value or checkpoint.read_model_config(workdir).k
    paths = trees.parse_tree_spec(f'nodes:{_FIGURE_NODES.value}', k, workdir).paths
    draw_tree(paths, _FIGURE.value, f'sparse tree of {len(paths)} nodes (nodes:{_FIGURE_NODES.value})')
    print(f'wrote {_FIGURE.value}')
  for chip in _TPU.value:  # no libtpu or an unknown chip: a clear error before anything decodes
    tpu_estimate.chip_device(chip)
  rows, model_config, k = bench_trees(config, workdir, _SPLIT.value, nodes, batch_sizes, _EXAMPLES.value,
                                      _BATCH1_EXAMPLES.value, _TIMING_EXAMPLES.value, _REPEATS.value, _HEADS.value)
  if _TPU.value:
    print('TPU columns: ESTIMATES, nothing ran on a TPU: ratio = max(FLOPs / peak, bytes / bandwidth) of one '
          'iteration over that of one greedy step, this model in bfloat16 compiled by libtpu for one chip '
          '(bpd/tpu_estimate.py, published peaks); speedup = mean accepted block / ratio.')
    add_tree_tpu_estimates(rows, dataclasses.replace(model_config, k=k, dropout_rate=0.0), _TPU.value, k,
                           config.decode.max_len)
  chain_block = {r['batch']: r['mean_accepted_block'] for r in rows if r['tree'].startswith('chain')}
  chain_block = {b: chain_block.get(b, 1.0) for b in {r['batch'] for r in rows}}
  print(trees_table(rows, chain_block, _TPU.value))


RUNS = {'ratio': run_ratio, 'profile': run_profile, 'matmul_floor': run_matmul_floor, 'fixed_cost': run_fixed_cost,
        'latency': run_latency, 'trees': run_trees}


def main(argv):
  del argv
  metrics.quiet_library_logs()
  mode = _MODE.value
  errors.set_defaults(MODE_DEFAULTS[mode])
  if _CONFIG.value is None:
    raise UserError(f'--mode={mode} needs --config, e.g. --config=configs/multi30k_ende.py.')
  if mode in ('latency', 'trees') and not _WORKDIR.value:
    raise UserError(f'--mode={mode} needs --workdir: the trained k-head model.')
  RUNS[mode](_CONFIG.value)


if __name__ == '__main__':
  stack.raise_stack_limit()  # before anything compiles (bpd/stack.py)
  app.run(lambda argv: errors.exit_on_user_error(main, argv), flags_parser=errors.parse_flags)
