r"""Tree decoding against the chain: mean accepted block, iterations and wall-clock against tree size N.

  python -m experiments.choose_tree --config=configs/demo.py:regime=finetune,k=4 --workdir=runs/demo/k4
  python -m experiments.bench_trees --config=configs/demo.py:regime=finetune,k=4 --workdir=runs/demo/k4 \
      --nodes=1,8,16,32,64 --batch_sizes=1,32 --figure=runs/demo/k4/trees.png

N = 1 is the paper's chain of k proposals (decoding.blockwise); N > 1 is the sparse tree 'nodes:N' built from the
model's WORKDIR/trees.json (experiments/choose_tree.py), verified in one call per iteration (decoding.blockwise). All
with exact acceptance, so every row must equal greedy decoding token for token (the 'identical' column).
Mean accepted block and iterations (DESIGN §2) do not depend on the machine; the seconds and the speedup over
greedy are medians of alternating runs on the first --timing_examples examples, and mean nothing on a loaded
machine. --figure draws one tree (the --figure_nodes one) and its attention mask.
"""

import dataclasses
import os

from absl import app
from absl import flags
from ml_collections import config_flags
import numpy as np

from bpd import checkpoint
from bpd import decoder as decoder_lib
from bpd import decoding
from bpd import errors
from bpd import metrics
from bpd import model as model_lib
from bpd import trees
from bpd.data import batching
from bpd.data import pipeline
from bpd.data import tokenizer as tokenizer_lib
from bpd.errors import UserError
from experiments import tpu_estimate

# Flags exist only when this file runs as a script: importing it (tests) defines none.
if __name__ == '__main__':
  _CONFIG = config_flags.DEFINE_config_file('config', None, 'The config the model was trained with.')
  _WORKDIR = flags.DEFINE_string('workdir', None, 'The k-head model\'s workdir (with trees.json).')
  _SPLIT = flags.DEFINE_string('split', 'test', 'Split to decode.')
  _NODES = flags.DEFINE_list('nodes', ['1', '8', '16', '32', '64'], 'Tree sizes; 1 = the chain.')
  _BATCH_SIZES = flags.DEFINE_list('batch_sizes', ['1', '32'], 'Batch sizes.')
  _EXAMPLES = flags.DEFINE_integer('examples', 0, 'Examples decoded (0 = all of config.decode.max_examples).')
  _BATCH1_EXAMPLES = flags.DEFINE_integer('batch1_examples', 0, 'At batch size 1, only the first N (0 = as others).')
  _TIMING_EXAMPLES = flags.DEFINE_integer('timing_examples', 64, 'Examples timed (0 = no timing).')
  _REPEATS = flags.DEFINE_integer('repeats', 1, 'Alternating timed runs per setting.')
  _FIGURE = flags.DEFINE_string('figure', '', 'PNG of a tree and its attention mask (empty = none).')
  _FIGURE_NODES = flags.DEFINE_integer('figure_nodes', 16, 'The tree drawn in --figure.')
  _TPU = flags.DEFINE_list('tpu', [], 'TPU chips (v5e, v4) to estimate each row\'s iteration / greedy-step ratio for, by '
                           "compiling for them with libtpu (pip install -e '.[tpu]'; no TPU needed). Empty: none.")
  _HEADS = flags.DEFINE_integer('heads', 0, "Heads k' <= k to use (0 = all the model's k): the chain and the "
                                'trees\' depth.')


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
  ax_tree.set_xticks(range(layout['path_NxD'].shape[1] + 1))
  ax_tree.set_xticklabels(['j (last\naccepted)'] + [f'head {d + 1}' for d in range(layout['path_NxD'].shape[1])])
  ax_tree.set_yticks([])
  ax_tree.invert_yaxis()
  ax_tree.set_title('tree: rank of the head\'s choice at each node')
  ax_mask.imshow(layout['ancestor_NxN'], cmap='Greys', interpolation='nearest')
  ax_mask.set_xlabel('key: tree node (slot start + m)')
  ax_mask.set_ylabel('query: tree node n')
  ax_mask.set_title('attention among the nodes (plus the whole prefix)')
  fig.suptitle(title)
  fig.tight_layout()
  fig.savefig(path, dpi=110)
  plt.close(fig)


def bench(config, workdir, split, nodes, batch_sizes, examples, batch1_examples, timing_examples, repeats, heads=0):
  model_config, params, _ = checkpoint.load_params(workdir)
  if not 0 <= heads <= model_config.k:
    raise UserError(f'--heads={heads}: the model in {workdir} has k={model_config.k}; use 1..{model_config.k}.')
  k = heads or model_config.k
  settings = []  # (label, topology or None for the chain)
  for n in nodes:
    settings.append((f'chain (k={k})', decoder_lib.chain(k)) if n == 1 else
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


def add_tpu_estimates(rows, model_config, chips, k, max_len, src_len=32):
  """Per row and chip: tpu_<chip>_ratio, one iteration (chain or tree) over one greedy step, from the TPU compiler's
  FLOPs and bytes of the model compiled in bfloat16 for one chip (experiments/tpu_estimate.py; an ESTIMATE), and
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


def table(rows, chain_block, chips=()) -> str:
  tpu = ''.join(f'TPU {c} ESTIMATE: iteration / greedy step, speedup | ' for c in chips)
  lines = ['| batch | tree | nodes | mean accepted block | vs chain | iterations | identical to greedy | '
           'speedup over greedy (loaded CPU) | ' + tpu, '|---' * (8 + len(chips)) + '|']
  for r in rows:
    speed = f"{r['speedup']:.2f}x" if 'speedup' in r else ''
    est = ''.join(f"{r[f'tpu_{c}_ratio']:.2f}, {r[f'tpu_{c}_speedup']:.2f}x | " for c in chips)
    lines.append(f"| {r['batch']} | {r['tree']} | {r['nodes']} | {r['mean_accepted_block']:.3f} | "
                 f"{r['mean_accepted_block'] / chain_block[r['batch']]:.3f}x | {r['iterations']} | "
                 f"{r['identical_to_greedy']:.3f} | {speed} | {est}")
  return '\n'.join(lines)


def _run():
  try:
    nodes = [int(n) for n in _NODES.value]
    batch_sizes = [int(b) for b in _BATCH_SIZES.value]
  except ValueError:
    raise UserError('--nodes and --batch_sizes take integers, e.g. --nodes=1,8,16 --batch_sizes=1,32.') from None
  if any(n < 1 for n in nodes) or any(b < 1 for b in batch_sizes):
    raise UserError('--nodes and --batch_sizes must be >= 1 (nodes 1 = the chain).')
  config, workdir = _CONFIG.value, _WORKDIR.value
  if _FIGURE.value:
    k = _HEADS.value or checkpoint.read_model_config(workdir).k
    paths = trees.parse_tree_spec(f'nodes:{_FIGURE_NODES.value}', k, workdir).paths
    draw_tree(paths, _FIGURE.value, f'sparse tree of {len(paths)} nodes (nodes:{_FIGURE_NODES.value})')
    print(f'wrote {_FIGURE.value}')
  for chip in _TPU.value:  # no libtpu or an unknown chip: a clear error before anything decodes
    tpu_estimate.chip_device(chip)
  rows, model_config, k = bench(config, workdir, _SPLIT.value, nodes, batch_sizes, _EXAMPLES.value,
                                _BATCH1_EXAMPLES.value, _TIMING_EXAMPLES.value, _REPEATS.value, _HEADS.value)
  if _TPU.value:
    print('TPU columns: ESTIMATES, nothing ran on a TPU: ratio = max(FLOPs / peak, bytes / bandwidth) of one '
          'iteration over that of one greedy step, this model in bfloat16 compiled by libtpu for one chip '
          '(experiments/tpu_estimate.py, published peaks); speedup = mean accepted block / ratio.')
    add_tpu_estimates(rows, dataclasses.replace(model_config, k=k, dropout_rate=0.0), _TPU.value, k,
                      config.decode.max_len)
  chain_block = {r['batch']: r['mean_accepted_block'] for r in rows if r['tree'].startswith('chain')}
  chain_block = {b: chain_block.get(b, 1.0) for b in {r['batch'] for r in rows}}
  print(table(rows, chain_block, _TPU.value))


def main(argv):
  del argv
  metrics.quiet_library_logs()
  errors.exit_on_user_error(_run)


if __name__ == '__main__':
  flags.mark_flags_as_required(['config', 'workdir'])
  app.run(main, flags_parser=errors.parse_flags)
