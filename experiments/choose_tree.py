r"""Choose a tree of candidates for tree decoding from a trained k-head model's measured top-r agreement.

  python -m experiments.choose_tree --config=configs/demo.py:regime=finetune,k=4 --workdir=runs/demo/k4 \
      --nodes=8,16,32,64

Greedy-decodes the config's eval split (config.data.eval_split, the val split), teacher-forces the model on its
own greedy output and counts, per head i and rank r, how often head i's rank-r choice is greedy's token
(train.top_r_agreement). From that table it builds, for each N in --nodes, the sparse tree of N nodes that
greedily maximizes the expected accepted length (bpd/trees.py, `sparse_tree`; Medusa's sparse trees), prints the
trees with their expected length, and saves the table and the trees as WORKDIR/trees.json, next to the
checkpoint. `config.decode.trees=('nodes:N',)` then decodes with the N-node tree (any N: it is rebuilt from the
saved table).
"""

import os

from absl import app
from absl import flags
from absl import logging
from ml_collections import config_flags
import numpy as np

from bpd import checkpoint
from bpd import decoder as decoder_lib
from bpd import errors
from bpd import metrics
from bpd import model as model_lib
from bpd import train
from bpd import trees
from bpd.data import batching
from bpd.data import pipeline
from bpd.data import tokenizer as tokenizer_lib
from bpd.errors import UserError

# Flags exist only when this file runs as a script: importing it (tests) defines none.
if __name__ == '__main__':
  _CONFIG = config_flags.DEFINE_config_file('config', None, 'The config the model was trained with.')
  _WORKDIR = flags.DEFINE_string('workdir', None, 'The k-head model\'s workdir; trees.json is written there.')
  _NODES = flags.DEFINE_list('nodes', ['8', '16', '32', '64'], 'Tree sizes N to build (and save).')
  _RANKS = flags.DEFINE_integer('ranks', 8, 'Choices per head measured: ranks 0..R-1.')
  _EXAMPLES = flags.DEFINE_integer('examples', 500, 'Val examples to measure on (0 = all).')
  _BATCH = flags.DEFINE_integer('batch_size', 32, 'Batch size of the greedy decode and the teacher-forced pass.')


def choose(config, workdir: str, nodes: list[int], ranks: int, examples: int, batch_size: int) -> dict:
  """Measures the top-r agreement, builds and saves the trees; returns {'N': paths}."""
  if any(n < 1 for n in nodes) or ranks < 1 or examples < 0 or batch_size < 1:
    raise UserError(f'--nodes={nodes} must all be >= 1, --ranks={ranks} >= 1, --examples={examples} >= 0 and '
                    f'--batch_size={batch_size} >= 1.')
  if config.data.source == 'images':
    raise UserError('Tree decoding is implemented for translation only (config.data.source=images).')
  model_config, params, step = checkpoint.load_params(workdir, step=config.checkpoint_step)
  if model_config.k < 2:
    raise UserError(f'The model in {workdir} has k=1: no proposal heads to build a tree from.')
  tokenizer = tokenizer_lib.load(os.path.join(workdir, tokenizer_lib.MODEL_NAME))
  split = config.data.eval_split
  src, tgt = pipeline.load_split(config.data, split, config.seed)
  if examples:
    src, tgt = src[:examples], tgt[:examples]
  src_ids, _, _ = batching.encode_pairs(tokenizer, src, tgt, config.decode.max_src_len, truncate=True)
  model = model_lib.Transformer(model_config)
  decoder = decoder_lib.Decoder(model, config.decode.max_len)
  greedy_ids, _ = decoder_lib.run_batches(lambda s: decoder.greedy(params, s).tokens_BxL, src_ids, batch_size,
                                          f'{split} greedy')
  agreement_KxR = train.top_r_agreement(model, params, src_ids, greedy_ids, batch_size, ranks)
  built = {str(n): trees.sparse_tree(agreement_KxR, n) for n in nodes}
  path = trees.write_trees(workdir, agreement_KxR, built, {'split': split, 'examples': len(src_ids), 'step': step})
  np.set_printoptions(precision=3, suppress=True)
  print(f'top-r agreement with greedy on {split} ({len(src_ids)} examples; row i = head i + 1, column r = rank r):')
  print(agreement_KxR)
  print(f'chain of {model_config.k}: expected accepted length '
        f'{trees.expected_length(trees.named_tree("chain", model_config.k), agreement_KxR):.3f}')
  for n, paths in built.items():
    print(f'nodes:{n}: expected accepted length {trees.expected_length(paths, agreement_KxR):.3f}, '
          f'depth {max(map(len, paths))}: {paths}')
  print(f'saved {path}')
  return built


def _run():
  try:
    nodes = [int(n) for n in _NODES.value]
  except ValueError:
    raise UserError(f'--nodes={",".join(_NODES.value)}: give integers, e.g. --nodes=8,16,32.') from None
  logging.info('choose_tree: %s', _WORKDIR.value)
  return choose(_CONFIG.value, _WORKDIR.value, nodes, _RANKS.value, _EXAMPLES.value, _BATCH.value)


def main(argv):
  del argv
  metrics.quiet_library_logs()
  errors.exit_on_user_error(_run)


if __name__ == '__main__':
  flags.mark_flags_as_required(['config', 'workdir'])
  app.run(main, flags_parser=errors.parse_flags)
