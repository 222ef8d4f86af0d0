r"""An accelerator run, ready before the accelerator is: every decoder at batch 1, 8 and 32, in one time-boxed command.

  python -m experiments.accelerator_run --out=runs/accel              # one GPU: <= 8 minutes, compiles included
  python -m experiments.accelerator_run --smoke --out=/tmp/accel      # the same code on CPU, tiny sizes (CI)

Models (float32 parameters and activations; every matmul at jax.default_matmul_precision('highest'), as
config.decode.matmul_precision='highest' sets for the sweep, so that `exact` rows can match greedy on GPUs):
  demo       the demo's `mini` model with k = 8 heads: its base trained, then the heads fine-tuned, in-script
             (configs/demo.py through bpd.train.train_and_evaluate, each stage stopped at its share of
             --demo_train_s through the preemption path), or loaded from --demo_workdir (a k-head workdir).
             Decoded on the synthetic test split; EOS ends a row.
  base, big  random weights (bpd.model SIZES), vocabulary --vocab (default 32000, WMT14's; Multi30k's is 4k),
             k = 8 heads, random sources of 24 tokens, no EOS (every row decodes 64 tokens).
(Plan below holds every size and count; --smoke swaps it for SMOKE.)
Decoders: greedy; the paper's chain at k = 4 and 8 (exact); the tree --tree (exact; 'nodes:N': the sparse tree of N
nodes built from the demo's measured top-r agreement on its val split, as diagnostics.py --mode=choose_tree builds it,
or read from --demo_workdir's trees.json; the random models decode the same topology); a context-aware tree
(Plan.dynamic, 'dynamic:16' at k = 8, each row's own tree per iteration); speculative sampling
(bpd/speculative.py, a chain of 4 heads, temperature 1), at every batch size of --batch_sizes.

Per setting: each decoder first decodes the examples once (compile + outputs), then runs alternately with its
baseline --repeats times over the same batches (decoder.time_side_by_side; medians; a compile while timing raises).
The baseline is greedy, and ancestral sampling at the same temperature for speculative sampling.
  tokens / iteration   mean accepted block size (DESIGN §2): tokens produced / iterations, over the examples;
  ms per batch         median seconds of a pass over the examples / batches in it;
  speedup              baseline's median / the decoder's median, side by side;
  call price           (seconds / model calls) of the decoder over that of its baseline, model calls counted per
                       whole batch (a batch runs until its slowest row is done): the price of one blockwise
                       iteration in greedy steps. Per-sentence costs (encoder, dispatch) are spread over the calls.
  identical            the fraction of examples whose output equals greedy's token for token (exact criteria).
What random-weight heads get accepted is an accident of the initialisation (about 1 token per iteration; all k when
a tiny random model repeats one token), so on `base` and `big` the block size and speedup say nothing about a
trained model: their tables give the call price only, which the weights do not change (fixed shapes). The demo's tables give all of it. Afterwards, if time is left, bench_decode's accounting of a chain
iteration against a greedy step (min_block:k, so every iteration is a full one; FLOPs, bytes, achieved bandwidth
against this device's measured peaks) for each random model at batch 1 (experiments/bench_decode.py, `bench`).

Time: nothing starts after --budget_s (default 420) from the start of the command; what is skipped is listed in the
record. The order is the order of value: the demo (training, then batch 1, 8, 32), the random models at each batch
size, the accounting. DIR/accelerator_run.md and .json are rewritten after every setting, so a run cut short
still leaves its record. The record names the device (jax.devices()[0].device_kind), the software versions, the
command and the commit.
"""

import dataclasses
import functools
import importlib.metadata
import json
import os
import signal
import subprocess
import sys
import threading
import time

from absl import app
from absl import flags
from absl import logging
import jax
import numpy as np

from bpd import checkpoint
from bpd import decoder as decoder_lib
from bpd import decoding
from bpd import errors
from bpd import evaluate
from bpd import metrics
from bpd import model as model_lib
from bpd import report
from bpd import speculative
from bpd import stack
from bpd import tasks
from bpd import train
from bpd import trees
from bpd.errors import UserError
from configs import demo as demo_config
from experiments import bench_decode

# Flags exist only when this file runs as a script: importing it (tests, another script) defines none.
if __name__ == '__main__':
  _OUT = flags.DEFINE_string('out', None, 'Folder for accelerator_run.md / .json (and the in-script demo model).')
  _SMOKE = flags.DEFINE_bool('smoke', False, 'The same code at tiny sizes, for CPU (CI): about 100 s of one core.')
  _BUDGET = flags.DEFINE_float('budget_s', 420.0, 'No setting starts after this many seconds; the rest is skipped '
                               'and listed in the record.')
  _DEMO_WORKDIR = flags.DEFINE_string('demo_workdir', '', 'A trained k-head demo workdir (study.py --plan=demo, '
                                      'runs/demo/k4) to decode instead of training one in-script.')
  _DEMO_TRAIN_DIR = flags.DEFINE_string('demo_train_dir', '', 'Where the in-script demo model is trained (default: '
                                        'OUT/demo_model; its k-head model can be passed as --demo_workdir later).')
  _DEMO_TRAIN_S = flags.DEFINE_float('demo_train_s', 110.0, 'Seconds for training the demo model, both stages.')
  _SIZES = flags.DEFINE_list('sizes', ['base', 'big'], 'Random-weight model sizes (bpd.model SIZES).')
  _VOCAB = flags.DEFINE_integer('vocab', 32000, "Vocabulary of the random-weight models (WMT14's 32k; Multi30k's 4k).")
  _BATCH_SIZES = flags.DEFINE_list('batch_sizes', ['1', '8', '32'], 'Batch sizes.')
  _TREE = flags.DEFINE_string('tree', 'nodes:8', f'The tree decoded ({trees.TREE_SPEC_HELP}; named trees are '
                              '4 heads deep).')
  _REPEATS = flags.DEFINE_integer('repeats', 3, 'Alternating timed runs of each decoder and its baseline.')
  _COMMIT = flags.DEFINE_string('commit', '', 'The commit to record when the checkout has no .git (default: git).')

RECORD = 'accelerator_run'
TREE_DEPTH = 4  # heads of a named tree ('comb:R', 'dense:R'): the depth the demo's tree study used
TEMPERATURE = 1.0
SEED = 0
NO_EOS = -1  # random weights: an EOS id that argmax never returns, so every row decodes max_len tokens
# Seconds the accounting of one model may take (about ten compiles and its timed loops): it starts only if they
# are left, so that it cannot run the command past its budget by much.
ACCOUNTING_S = 45.0


@dataclasses.dataclass(frozen=True)
class Plan:
  """What one run decodes. FULL is the accelerator run; SMOKE the same code at sizes a CPU test can afford."""
  sizes: tuple = ('base', 'big')  # random-weight models
  vocab_size: int = 32000
  batch_sizes: tuple = (1, 8, 32)
  chain_ks: tuple = (4, 8)
  speculative_k: int = 4  # the chain that drafts for speculative sampling (docs/results/speculative.md: k = 4)
  tree: str = 'nodes:8'
  dynamic: str = 'dynamic:16'  # a context-aware tree (bpd/decoding.py, Dynamic) at the largest chain k
  repeats: int = 3
  random_max_len: int = 64  # tokens per row of the random models (a multiple of every chain k)
  src_len: int = 24  # random models' source length
  batch1_random_examples: int = 4  # random models: examples at batch 1 (one batch at the others)
  demo_k: int = 8
  demo_size: str = 'mini'
  demo_base_steps: int = demo_config.BASE_STEPS
  demo_head_steps: int = demo_config.HEAD_STEPS
  demo_train_s: float = 110.0
  demo_synthetic_train_size: int = 20000
  demo_examples: int = 128  # test sentences decoded at batch 8 and 32
  demo_batch1_examples: int = 32  # at batch 1
  tree_examples: int = 128  # val sentences whose top-r agreement chooses a 'nodes:N' tree
  tree_ranks: int = 4
  peaks: dict = dataclasses.field(default_factory=dict)  # bench_decode.machine_peaks' sizes (default: its own)


FULL = Plan()
# One batch size, one chain: on CPU every decoder of every batch size is a compile of its own, and compiles are
# most of a smoke run's time.
SMOKE = Plan(sizes=('tiny',), vocab_size=300, batch_sizes=(2,), chain_ks=(2,), speculative_k=2, tree='nodes:3',
             dynamic='dynamic:3',
             repeats=1, random_max_len=6, src_len=6, batch1_random_examples=2, demo_k=2, demo_size='tiny',
             demo_base_steps=10, demo_head_steps=10, demo_train_s=60.0, demo_synthetic_train_size=2000,
             demo_examples=4, demo_batch1_examples=2, tree_examples=4, tree_ranks=2,
             peaks={'matmul_n': 256, 'sum_mb': 8, 'cached_mb': 1})


class Budget:
  """Seconds since the start against --budget_s: `allows` is False (and notes what) once they are spent."""

  def __init__(self, seconds: float):
    self.start, self.seconds, self.skipped = time.monotonic(), seconds, []

  def elapsed(self) -> float:
    return time.monotonic() - self.start

  def allows(self, what: str, needs_s: float = 0.0) -> bool:
    """Whether `what`, expected to take needs_s seconds, still starts; if not, it is listed as skipped."""
    if self.elapsed() + needs_s < self.seconds:
      return True
    self.skipped.append(what)
    print(f'[{self.elapsed():6.1f}s] budget spent: skipping {what}', flush=True)
    return False


def say(budget: Budget, text: str) -> None:
  print(f'[{budget.elapsed():6.1f}s, cpu {time.process_time():6.1f}s] {text}', flush=True)


# -- the record ---------------------------------------------------------------------------------------------------

def environment(commit: str = '') -> dict:
  """Device, software versions, CUDA / driver where visible, and the commit."""
  versions = {}
  for package in ('jax', 'jaxlib', 'flax', 'jax-cuda12-plugin', 'jax-cuda12-pjrt', 'jax-cuda13-plugin',
                  'nvidia-cuda-runtime-cu12', 'nvidia-cudnn-cu12', 'libtpu'):
    try:
      versions[package] = importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
      pass
  device = jax.devices()[0]
  try:
    smi = subprocess.run(['nvidia-smi', '--query-gpu=name,driver_version,memory.total', '--format=csv,noheader'],
                         capture_output=True, text=True, timeout=20, check=True).stdout.strip()
    cuda = subprocess.run(['nvidia-smi'], capture_output=True, text=True, timeout=20, check=True).stdout
    cuda = next((line.split('CUDA Version:')[1].strip(' |') for line in cuda.splitlines()
                 if 'CUDA Version' in line), '')
  except (OSError, subprocess.SubprocessError):
    smi, cuda = '', ''
  if not commit:
    try:
      repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
      commit = subprocess.run(['git', '-C', repo, 'rev-parse', '--short', 'HEAD'], capture_output=True, text=True,
                              timeout=20, check=True).stdout.strip()
      dirty = subprocess.run(['git', '-C', repo, 'status', '--porcelain', '--untracked-files=no'],
                             capture_output=True, text=True, timeout=20, check=True).stdout.strip()
      commit += ' (with uncommitted changes)' if dirty else ''
    except (OSError, subprocess.SubprocessError):
      commit = 'unknown (no git checkout here; pass --commit)'
  return {'device_kind': device.device_kind, 'platform': device.platform, 'devices': len(jax.devices()),
          'versions': versions, 'nvidia_smi': smi, 'cuda_driver_api': cuda, 'commit': commit,
          'python': sys.version.split()[0]}


def _fmt(value, spec='.2f', suffix=''):
  return '—' if value is None else f'{value:{spec}}{suffix}'


# One table per model (report.markdown_table); an untrained model's rows leave out tokens / iteration and speedup.
TABLE_COLUMNS = [
    ('decoder', 'decoder', '{}'), ('batch_size', 'batch', '{}'),
    (None, 'tokens / iteration', lambda r: _fmt(r['tokens_per_iteration'])),
    ('ms_per_batch', 'ms per batch', '{:.2f}'),
    (None, 'baseline ms per batch', lambda r: _fmt(r['baseline_ms_per_batch'])),
    (None, 'speedup', lambda r: _fmt(r['speedup'], '.2f', 'x')),
    (None, 'call price (per baseline step)', lambda r: _fmt(r['call_price'])),
    (None, 'identical to greedy', lambda r: _fmt(r['identical'], '.3f')),
    (None, 'calls per pass (baseline)', lambda r: f"{r['calls']} ({_fmt(r['baseline_calls'], 'd')})"),
    ('first_pass_s', 'first pass s', '{:.1f}'),
]


def markdown(record: dict) -> str:
  """The record as markdown: how it was run, then one table per model."""
  env, plan = record['environment'], record['plan']
  versions = ', '.join(f'{p} {v}' for p, v in env['versions'].items())
  lines = [
      f"# Accelerator run: every decoder at batch {', '.join(map(str, plan['batch_sizes']))}"
      + (' (SMOKE: tiny sizes, not a measurement)' if record['smoke'] else ''), '',
      f"- **Command**: `{record['command']}`",
      f"- **Commit**: {env['commit']}",
      f"- **Device**: {env['device_kind']} ({env['platform']}, {env['devices']} device(s))"
      + (f"; nvidia-smi: {env['nvidia_smi']}" if env['nvidia_smi'] else '')
      + (f"; CUDA (driver API) {env['cuda_driver_api']}" if env['cuda_driver_api'] else ''),
      f"- **Software**: Python {env['python']}, {versions}",
      "- **Precision**: float32 parameters and activations, jax.default_matmul_precision('highest').",
      f"- **Time**: {record['elapsed_s']:.0f} s of a {record['budget_s']:.0f} s budget"
      + (f"; {record['status']}" if record.get('status') else ''),
      f"- **Plan**: random models {', '.join(plan['sizes'])} (vocabulary {plan['vocab_size']}, {plan['random_max_len']}"
      f" tokens per row, sources of {plan['src_len']}); demo k = {plan['demo_k']}; batch sizes "
      f"{', '.join(map(str, plan['batch_sizes']))}; chains k = {', '.join(map(str, plan['chain_ks']))}; tree "
      f"{record.get('tree', plan['tree'])}; speculative sampling k = {plan['speculative_k']}, T = {TEMPERATURE:g}; "
      f"{plan['repeats']} alternating repeats, medians.",
  ]
  if record.get('demo'):
    lines.append(f"- **Demo model**: {record['demo']}")
  if record['skipped']:
    lines.append(f"- **Skipped (budget spent)**: {'; '.join(record['skipped'])}")
  if record.get('failures'):
    lines.append(f"- **Failed** (traceback in the log): {'; '.join(record['failures'])}")
  lines += ['', 'Definitions: experiments/accelerator_run.py. What random-weight heads get accepted is an accident '
            'of the initialisation, so for `base` and `big` only the call price (one iteration in greedy steps; for '
            'speculative sampling in ancestral-sampling steps) means anything; tokens / iteration and the speedup '
            'are given for the trained demo model only. "First pass s": the first decode of the examples, its '
            'compile included.']
  for name, rows in record['models'].items():
    trained = rows and rows[0].get('trained')
    lines += ['', f'## {name}', '']
    columns = [c for c in TABLE_COLUMNS if trained or c[1] not in ('tokens / iteration', 'speedup')]
    lines.append(report.markdown_table(rows, columns))
  if record.get('accounting'):
    lines += ['', '## A chain iteration against a greedy step, accounted (experiments/bench_decode.py)', '']
    for size, table in record['accounting'].items():
      lines += [f'`{size}`:', '', table, '']
  return '\n'.join(lines) + '\n'


def write(out: str, record: dict) -> None:
  os.makedirs(out, exist_ok=True)
  for name, text in ((f'{RECORD}.json', json.dumps(record, indent=1, default=str)), (f'{RECORD}.md', markdown(record))):
    with open(os.path.join(out, name + '.tmp'), 'w') as f:
      f.write(text)
    os.replace(os.path.join(out, name + '.tmp'), os.path.join(out, name))


# -- the demo model -----------------------------------------------------------------------------------------------

class _TimeLimit:
  """Sends this process SIGTERM after `seconds`, which train_and_evaluate's PreemptionGuard turns into 'save a
  checkpoint and stop' (the path study.py --plan=superres --timebox uses). Outside the guard (data and tokenizer
  set-up before the loop) the signal is held and sent again a second later, so it always stops the loop."""

  def __init__(self, seconds: float):
    self.seconds, self.timers = seconds, []

  def _arm(self, seconds):
    timer = threading.Timer(seconds, os.kill, (os.getpid(), signal.SIGTERM))
    timer.daemon = True
    self.timers.append(timer)
    timer.start()

  def _held(self, signum, frame):
    del signum, frame
    self._arm(1.0)

  def __enter__(self):
    self.previous = signal.signal(signal.SIGTERM, self._held)
    self._arm(max(self.seconds, 0.01))
    return self

  def __exit__(self, *exc):
    for timer in self.timers:
      timer.cancel()
    signal.signal(signal.SIGTERM, self.previous)
    return False


def demo_configs(plan: Plan):
  """(base config, k-head config) of the in-script demo: configs/demo.py with no evaluation during training."""
  configs = []
  for arg, steps in (('', plan.demo_base_steps), (f'regime=finetune,k={plan.demo_k},', plan.demo_head_steps)):
    c = demo_config.get_config(f'{arg}steps={steps}')
    c.model.size = plan.demo_size
    c.data.synthetic_train_size = plan.demo_synthetic_train_size
    c.train.eval_every = 0  # the decode below is the evaluation; quick evaluations would compile decoders
    c.train.checkpoint_every = steps
    configs.append(c)
  return configs


def train_demo(plan: Plan, workdir: str, budget: Budget) -> tuple[str, str]:
  """Trains the demo's base, then its k heads (fine-tuned), each stopped at its share of plan.demo_train_s.
  Returns (the k-head workdir, what happened)."""
  base, heads = demo_configs(plan)
  base_dir, heads_dir = os.path.join(workdir, 'base'), os.path.join(workdir, f'k{plan.demo_k}')
  heads.train.init_from = base_dir
  start = time.monotonic()
  # The base gets 60 % of the time; the heads what is left, and at least 30 % should the base overrun its share
  # (a compile takes what it takes before the first step can stop).
  for config, directory, share in ((base, base_dir, 0.6), (heads, heads_dir, 1.0)):
    seconds = max(share * (plan.demo_train_s - (time.monotonic() - start)), 0.3 * plan.demo_train_s)
    if (checkpoint.latest_step(directory) or 0) < config.train.num_steps:
      say(budget, f'training {directory} ({config.train.num_steps} steps, at most {seconds:.0f} s)')
      with _TimeLimit(seconds):
        train.train_and_evaluate(config, directory)
  steps = [checkpoint.latest_step(d) for d in (base_dir, heads_dir)]
  return heads_dir, (f'trained in-script in {time.monotonic() - start:.0f} s: base {steps[0]} of '
                     f'{base.train.num_steps} steps, {plan.demo_k} heads fine-tuned {steps[1]} of '
                     f'{heads.train.num_steps} steps ({heads_dir})')


def load_demo(workdir: str):
  """(model_config, params, decoder, step, test sources, val sources) of a k-head demo workdir."""
  model_config = checkpoint.read_model_config(workdir, '--demo_workdir')
  if model_config.k < 2:
    raise UserError(f'--demo_workdir={workdir} holds a model with k=1: give a k-head model (runs/demo/k4).')
  config = demo_config.get_config(f'regime=finetune,k={model_config.k}')
  task = tasks.for_config(config)
  _, params, step, tokenizer, decoder = evaluate.load_for_decoding(config, workdir, task)
  test_ids, _, _ = task.decode_examples(config, 'test', tokenizer)
  val_ids, _, _ = task.decode_examples(config, config.data.eval_split, tokenizer)
  return model_config, params, decoder, step, test_ids, val_ids


def choose_tree(plan: Plan, demo, demo_workdir: str):
  """(spec, paths): a named tree TREE_DEPTH heads deep, or 'nodes:N' from the demo's measured agreement."""
  name, _, _ = plan.tree.partition(':')
  if name != 'nodes':
    return plan.tree, trees.named_tree(plan.tree, TREE_DEPTH)
  if demo is None:
    return 'comb:2', trees.named_tree('comb:2', TREE_DEPTH)  # no model to measure agreement on
  model_config, params, decoder, _, _, val_ids = demo
  if demo_workdir and os.path.exists(os.path.join(demo_workdir, trees.TREES_FILE)):
    tree = trees.parse_tree_spec(plan.tree, model_config.k, demo_workdir)
    return f'{plan.tree} (from {trees.TREES_FILE})', tree.paths
  val_ids = val_ids[:plan.tree_examples]
  greedy_ids, _ = decoder_lib.run_batches(lambda s: decoder.greedy(params, s).tokens_BxL, val_ids, 32)
  agreement_KxR = train.top_r_agreement(model_lib.Transformer(model_config), params, val_ids, greedy_ids, 32,
                                        plan.tree_ranks)
  paths = trees.sparse_tree(agreement_KxR, int(plan.tree.partition(':')[2]))
  return f'{plan.tree} (top-{plan.tree_ranks} agreement on {len(val_ids)} val sentences)', paths


# -- measuring ----------------------------------------------------------------------------------------------------

def _counted(fn, calls, steps_of):
  """fn(src) that also appends steps_of(its output) (model calls of the whole batch) to `calls`."""
  def counted(src):
    out = fn(src)
    calls.append(steps_of(out))
    return out
  return counted


def _calls(result):  # a decoding.DecodeResult: model calls for the whole batch
  return result.invocations


def settings(plan: Plan, tree_spec: str, tree_paths):
  """(name, kind, k, tree) of every decoder after greedy, tree the one it decodes over (a decoding.Layout, the chain
  for chains and speculative sampling, or a Dynamic); those needing more heads than the model has are left out by
  the caller."""
  out = [(f'chain k = {k}, exact', 'chain', k, decoding.chain(k)) for k in plan.chain_ks]
  depth = max(len(p) for p in tree_paths)
  out.append((f'tree {tree_spec.split(" ")[0]} ({len(tree_paths)} nodes), exact', 'tree', depth,
              decoding.layout(decoding.check_tree(tuple(tuple(p) for p in tree_paths), depth))))
  k = max(plan.chain_ks)
  out.append((f'{plan.dynamic} k = {k}, exact', 'dynamic', k, trees.parse_tree_spec(plan.dynamic, k)))
  out.append((f'speculative sampling k = {plan.speculative_k}, T = {TEMPERATURE:g}', 'speculative', plan.speculative_k,
              decoding.chain(plan.speculative_k)))
  return out


def _decoder_fn(decoder, params, kind: str, tree):
  """src_BxS -> a decoding.BlockwiseResult of one setting (settings())."""
  if kind == 'speculative':
    rule = speculative.Sampling(temperature=TEMPERATURE)
    return lambda src: decoder.blockwise(params, src, rule, tree, seed=SEED)
  return lambda src: decoder.blockwise(params, src, decoding.EXACT, tree)


def measure(model_name, decoder, params, model_k, src_ids, batch_size, plan, tree_spec, tree_paths, budget, trained,
            failures):
  """Rows for every decoder on src_ids at batch_size: greedy, then each setting side by side with its baseline.
  A setting that fails (a device error, a compile inside the timed runs) is noted in `failures`; the rest run."""
  bucket = decoder_lib.source_buckets(src_ids)
  batches = -(-len(src_ids) // batch_size)
  what = f'{model_name} batch {batch_size}'
  greedy_fn = lambda src: decoder.greedy(params, src)
  sample_fn = lambda src: decoder.sample(params, src, TEMPERATURE, SEED)

  def one_pass(fn, steps_of):
    """Decodes every example once (compiling on the first batch); returns (outputs, seconds, model calls).
    Only this pass counts calls: the timed runs call fn itself, with nothing added to either side."""
    calls = []
    out, seconds = decoder_lib.run_batches(_counted(fn, calls, steps_of), src_ids, batch_size, bucket=bucket)
    return out, seconds, int(sum(int(c) for c in calls))

  if not budget.allows(f'{what}: every decoder'):
    return []
  greedy_out, first_s, greedy_calls = one_pass(greedy_fn, _calls)
  greedy_tokens = [np.asarray(o.tokens_BxL) for o in greedy_out]
  g_seconds, = decoder_lib.time_side_by_side([greedy_fn], src_ids, batch_size, plan.repeats, bucket, f'{what} greedy')
  base = {'model': model_name, 'batch_size': batch_size, 'examples': len(src_ids), 'batches': batches,
          'trained': trained}
  rows = [{**base, 'decoder': 'greedy', 'kind': 'greedy', 'k': 1, 'tokens_per_iteration': 1.0,
           'ms_per_batch': 1e3 * g_seconds / batches, 'baseline_ms_per_batch': None, 'speedup': None,
           'call_price': None, 'identical': 1.0, 'calls': greedy_calls, 'baseline_calls': None,
           'first_pass_s': first_s}]
  say(budget, f'{what} greedy: {rows[0]["ms_per_batch"]:.2f} ms per batch, {greedy_calls} calls per pass')
  sampling_calls = []  # ancestral sampling's calls per pass, counted once (speculative sampling's baseline)

  def one_setting(name, kind, k, tree):
    fn = _decoder_fn(decoder, params, kind, tree)
    out, first_s, calls = one_pass(fn, _calls)
    if kind == 'speculative':
      if not sampling_calls:
        sampling_calls.append(one_pass(sample_fn, _calls)[2])
      baseline_fn, baseline_calls, baseline = sample_fn, sampling_calls[0], 'ancestral sampling'
    else:
      baseline_fn, baseline_calls, baseline = greedy_fn, greedy_calls, 'greedy'
    b_seconds, seconds = decoder_lib.time_side_by_side([baseline_fn, fn], src_ids, batch_size, plan.repeats, bucket,
                                                       f'{what} {name}')
    block = sum(int(o.length_B) for o in out) / max(sum(int(o.iterations_B) for o in out), 1)
    identical = None if kind == 'speculative' else float(np.mean(
        [np.array_equal(np.asarray(o.tokens_BxL), g) for o, g in zip(out, greedy_tokens)]))
    say(budget, f'{what} {name}: {1e3 * seconds / batches:.2f} ms per batch ({baseline} '
                f'{1e3 * b_seconds / batches:.2f}), call price {(seconds / calls) / (b_seconds / baseline_calls):.2f}, '
                f'tokens / iteration {block:.2f}')
    # Random weights: acceptance and speedup describe nothing (module docstring); the JSON keeps the measured block.
    return {**base, 'decoder': name, 'kind': kind, 'k': k, 'tree_nodes': tree.num_nodes,
            'baseline': baseline, 'tokens_per_iteration': block if trained else None, 'measured_block': block,
            'ms_per_batch': 1e3 * seconds / batches, 'baseline_ms_per_batch': 1e3 * b_seconds / batches,
            'speedup': b_seconds / seconds if trained else None,
            'call_price': (seconds / calls) / (b_seconds / baseline_calls), 'identical': identical, 'calls': calls,
            'baseline_calls': baseline_calls, 'first_pass_s': first_s}

  for name, kind, k, tree in settings(plan, tree_spec, tree_paths):
    if k > model_k:
      budget.skipped.append(f'{what} {name}: the model has {model_k} heads')
    elif budget.allows(f'{what} {name}'):
      try:
        rows.append(one_setting(name, kind, k, tree))
      except (RuntimeError, ValueError, TypeError, MemoryError) as e:  # noted in the record; the rest still run
        if isinstance(e, UserError):
          raise
        logging.exception('%s %s failed', what, name)
        failures.append(f'{what} {name}: {type(e).__name__}: {str(e)[:300]}')
        say(budget, f'{what} {name} FAILED: {failures[-1]}')
  return rows


def random_model(size: str, plan: Plan):
  """(model, params) of `size` with plan.vocab_size and max(chain_ks) heads, random weights."""
  config = model_lib.model_config(size, vocab_size=plan.vocab_size, k=max(plan.chain_ks), dropout_rate=0.0)
  params = jax.jit(functools.partial(model_lib.init_params, config))(jax.random.PRNGKey(0))
  return model_lib.Transformer(config), params


def check(plan: Plan, budget_s: float, demo_workdir: str) -> None:
  """UserError for bad input, before anything is compiled."""
  if budget_s <= 0:
    raise UserError(f'--budget_s={budget_s}: give the seconds the run may take, > 0 (420 leaves a GPU run room).')
  if not plan.batch_sizes or min(plan.batch_sizes) < 1 or plan.repeats < 1:
    raise UserError(f'--batch_sizes={plan.batch_sizes} must be >= 1 and --repeats={plan.repeats} >= 1.')
  for size in plan.sizes:
    model_lib.model_config(size, vocab_size=plan.vocab_size)
  if plan.vocab_size < 8:
    raise UserError(f'--vocab={plan.vocab_size}: give a vocabulary of at least 8 ids (32000: WMT14; 4000: Multi30k).')
  name, _, arg = plan.tree.partition(':')
  if name == 'nodes':
    if not arg.isdigit() or int(arg) < 1:
      raise UserError(f'--tree={plan.tree}: {trees.TREE_SPEC_HELP}.')
  else:
    trees.named_tree(plan.tree, TREE_DEPTH)
  if demo_workdir:
    checkpoint.read_model_config(demo_workdir, '--demo_workdir')


def run(out: str, plan: Plan, budget_s: float, command: str, smoke: bool = False, demo_workdir: str = '',
        demo_train_dir: str = '', commit: str = '') -> dict:
  """The whole run; returns the record it wrote to out/accelerator_run.{md,json}."""
  check(plan, budget_s, demo_workdir)
  budget = Budget(budget_s)
  record = {'command': command, 'smoke': smoke, 'budget_s': budget_s, 'elapsed_s': 0.0,
            'environment': environment(commit), 'plan': dataclasses.asdict(plan), 'models': {},
            'skipped': budget.skipped, 'failures': []}
  say(budget, f"device {record['environment']['device_kind']}; writing {os.path.join(out, RECORD)}.md")

  def save(status=''):
    record['elapsed_s'], record['status'] = budget.elapsed(), status
    write(out, record)

  save('running')
  with jax.default_matmul_precision('highest'):
    demo = None
    if demo_workdir or budget.allows('training the demo model'):
      if not demo_workdir:
        demo_workdir, record['demo'] = train_demo(plan, demo_train_dir or os.path.join(out, 'demo_model'), budget)
      else:
        record['demo'] = f'loaded from {demo_workdir}'
      demo = load_demo(demo_workdir)
      record['demo'] += f' (step {demo[3]}, k = {demo[0].k})'
      save('running')
    tree_spec, tree_paths = choose_tree(plan, demo, demo_workdir)
    record['tree'], record['tree_paths'] = tree_spec, [list(p) for p in tree_paths]
    say(budget, f'tree {tree_spec}: {tree_paths}')
    if demo is not None:
      model_config, params, decoder, _, test_ids, _ = demo
      for batch_size in plan.batch_sizes:
        n = plan.demo_batch1_examples if batch_size == 1 else plan.demo_examples
        record['models'].setdefault('demo', []).extend(
            measure('demo', decoder, params, model_config.k, test_ids[:n], batch_size, plan, tree_spec, tree_paths,
                    budget, True, record['failures']))
        save('running')
    models = {}
    rng = np.random.RandomState(SEED)
    for batch_size in plan.batch_sizes:
      for size in plan.sizes:
        if size not in models:
          if not budget.allows(f'{size}: every batch size from {batch_size}'):
            continue
          model, params = random_model(size, plan)
          models[size] = model, params, decoder_lib.Decoder(model, plan.random_max_len, eos_id=NO_EOS)
        model, params, decoder = models[size]
        n = plan.batch1_random_examples if batch_size == 1 else batch_size
        src_ids = list(rng.randint(4, plan.vocab_size, size=(n, plan.src_len)).astype(np.int32))
        name = f'{size} (random weights, vocabulary {plan.vocab_size})'
        record['models'].setdefault(name, []).extend(
            measure(name, decoder, params, model.config.k, src_ids, batch_size, plan, tree_spec, tree_paths, budget,
                    False, record['failures']))
        save('running')
    if models and budget.allows('bench_decode accounting', ACCOUNTING_S):
      peaks = bench_decode.machine_peaks(**plan.peaks)
      record['accounting'] = {}
      for size, (model, params, _) in models.items():
        if not budget.allows(f'bench_decode accounting of {size}', ACCOUNTING_S):
          continue
        try:
          rows = bench_decode.bench(model, params, list(plan.chain_ks), [1], plan.random_max_len, plan.src_len,
                                    plan.repeats, peaks=peaks)
        except (RuntimeError, ValueError, TypeError, MemoryError) as e:  # noted; the record is still written
          logging.exception('accounting of %s failed', size)
          record['failures'].append(f'bench_decode accounting of {size}: {type(e).__name__}: {str(e)[:300]}')
          continue
        record['accounting'][size] = bench_decode.format_table(rows)
        record.setdefault('accounting_rows', {})[size] = rows
        save('running')
  save('done' + (', with skipped settings (listed above)' if budget.skipped else '')
       + (', with failed settings (listed above)' if record['failures'] else ''))
  say(budget, f'done: {os.path.join(out, RECORD)}.md')
  return record


def main(argv):
  del argv
  metrics.quiet_library_logs()
  if not _OUT.value:
    raise UserError('--out=DIR is required: the folder for accelerator_run.md and .json.')
  try:
    batch_sizes = tuple(int(b) for b in _BATCH_SIZES.value)
  except ValueError:
    raise UserError(f'--batch_sizes={",".join(_BATCH_SIZES.value)}: give integers, e.g. '
                    '--batch_sizes=1,8,32.') from None
  plan = SMOKE if _SMOKE.value else dataclasses.replace(
      FULL, sizes=tuple(_SIZES.value), vocab_size=_VOCAB.value, tree=_TREE.value, repeats=_REPEATS.value,
      demo_train_s=_DEMO_TRAIN_S.value, batch_sizes=batch_sizes)
  command = 'python -m experiments.accelerator_run ' + ' '.join(sys.argv[1:])
  run(_OUT.value, plan, _BUDGET.value, command, smoke=_SMOKE.value, demo_workdir=_DEMO_WORKDIR.value,
      demo_train_dir=_DEMO_TRAIN_DIR.value, commit=_COMMIT.value)


if __name__ == '__main__':
  stack.raise_stack_limit()  # before anything compiles (bpd/stack.py)
  app.run(lambda argv: errors.exit_on_user_error(main, argv), flags_parser=errors.parse_flags)
