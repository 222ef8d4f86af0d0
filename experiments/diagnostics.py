r"""Diagnostics of trained models and of training, one --mode each: what a model agrees with, how its samples spread.

  python -m experiments.diagnostics --mode=choose_tree --config=configs/demo.py:regime=finetune,k=4 \
      --workdir=runs/demo/k4 --nodes=8,16,32,64
  python -m experiments.diagnostics --mode=where_tau_stops --config=configs/multi30k_ende.py:k=10 \
      --workdir=runs/m30k_eval/indep --heads=8 --nodes=8,16,32,64 --out=/tmp/where_tau_stops.md
  python -m experiments.diagnostics --mode=sampling_seeds --config=configs/multi30k_ende.py:k=10,regime=finetune \
      --workdir=runs/m30k_both/finetune_distilled --temperature=1.0 --seeds=0-8 --ks=1,4
  python -m experiments.diagnostics --mode=superres_agreement \
      --workdirs=runs/sr_table2/frozen,runs/sr_table2/finetune --examples=4 --eps=2
  python -m experiments.diagnostics --mode=superres_prefix_check --workdirs=runs/sr_colocated/base,runs/sr_noise/base \
      --examples=4
  python -m experiments.diagnostics --mode=head_loss --config=configs/multi30k_ende.py --k=8

Flags that several modes share (--config, --examples, --batch_size, --split) take the default of the mode run
(MODE_DEFAULTS). The modes, in this file's order:

--mode=choose_tree: choose a tree of candidates for tree decoding from a trained k-head model's measured top-r
agreement. Greedy-decodes the config's eval split (config.data.eval_split, the val split), teacher-forces the model
on its own greedy output and counts, per head i and rank r, how often head i's rank-r choice is greedy's token
(train.top_r_agreement). From that table it builds, for each N in --nodes, the sparse tree of N nodes that
greedily maximizes the expected accepted length (bpd/trees.py, `sparse_tree`; Medusa's sparse trees), prints the
trees with their expected length, and saves the table and the trees as WORKDIR/trees.json, next to the
checkpoint. `config.decode.trees=('nodes:N',)` then decodes with the N-node tree (any N: it is rebuilt from the
saved table).

--mode=where_tau_stops: where exact decoding's accepted path stops, and why. Greedy-decodes --split (the config's
first decode split), teacher-forces the k-head model (independent heads) on [BOS] + its greedy output and, at every
position t of every sentence (y_1..y_t accepted), takes head 1's and heads 2..D's logits there (D = --heads). Greedy's
continuation y_{t+1}..y_{t+D} (cut at the sentence's end, EOS included) is accepted by the chain of D up to the first
head d whose top-1 is not y_{t+d}, and by a context-aware tree dynamic:N (decoding.Dynamic, built and drafted as the
decoder builds and drafts it) as deep as it runs along one root path of the tree. Prints (a) the chain's stop
histogram and head d+1's top-1 / top-8 agreement given a right prefix, and (b) per tree the mean accepted length (over
positions, not decode iterations), where it stops and why: greedy's next token not among the next head's top r
choices, its parent pruned from the beam of Dynamic.build, or a candidate cut by the node budget N; with, for
comparison, every candidate of Dynamic.build (no budget) and greedy's tokens as deep as each is among its head's top r
(no beam either). Writes nothing into the workdir; --out writes the tables.

--mode=sampling_seeds: quality of sampled outputs across seeds, ancestral sampling against speculative sampling with
k' heads. One sample of every example of the split per seed and sampler (batch --batch_size), scored as the decode
sweep scores it (BLEU or PSNR), plus the mean output length. Speculative sampling is exact in distribution
(docs/speculative.md), so its quality differs from ancestral sampling's only by the draw: the seed-to-seed spread
printed here is the yardstick for the one-seed rows of a decode sweep (`sample:T` against `k<k'>.speculative`).

--mode=superres_agreement: per-head agreement with greedy decoding on images, the diagnostic behind exact and
distance:EPS acceptance. For each k-head model: teacher-force it on its own greedy output
(WORKDIR/decode_<split>/<split>.greedy.b<B>.npy, written by the decode sweep) and count, per head i, how often head
i's argmax at decoder position t equals greedy's sub-pixel at t + i (exact acceptance, paper §5) and how often it is
within EPS intensity levels (distance:EPS). Also: how often head 1 itself is within EPS of the *previous* greedy
sub-pixel of the same channel, a measure of how much of the image is flat enough for any head to guess.

--mode=superres_prefix_check: one-step quality of trained super-resolution models: the argmax of head 1 at every
sub-pixel given a fixed prefix (teacher forcing), as PSNR against the ground truth, beside nearest-neighbour
enlargement. Separates what a model predicts one step at a time from what greedy decoding does with its own outputs
(README, Super-resolution: a model whose one-step argmax is near the baseline can still collapse in greedy
decoding, by following its own prefix). Prefixes: the true image, and the nearest-neighbour enlargement.

--mode=head_loss: what the sampled-head loss saves: one training step with head_loss=mean (all k heads projected onto
the vocabulary) against head_loss=random (one drawn head projected, paper §6), per regime. Random weights at the
config's model size and vocabulary; a fixed batch of random ids; the real jitted train step of bpd/train.py. The two
programs alternate after compile and warm-up, and each time is a median of --repeats, so a changing machine load
falls on both.
"""

import functools
import os
import statistics
import time

from absl import app
from absl import flags
from absl import logging
import jax
import jax.numpy as jnp
import numpy as np

from bpd import checkpoint
from bpd import decoder as decoder_lib
from bpd import decoding
from bpd import errors
from bpd import evaluate
from bpd import files
from bpd import losses
from bpd import metrics
from bpd import model as model_lib
from bpd import report
from bpd import sharding
from bpd import speculative as speculative_lib
from bpd import stack
from bpd import tasks
from bpd import train
from bpd import trees
from bpd.data import batching
from bpd.data import images
from bpd.data import pipeline
from bpd.data import tokenizer as tokenizer_lib
from bpd.errors import UserError
from configs import celeba_sr

MODES = ('choose_tree', 'where_tau_stops', 'sampling_seeds', 'superres_agreement', 'superres_prefix_check', 'head_loss')
# The flags that several modes share under one name, each mode with its own default (command-line text).
MODE_DEFAULTS = {
    'choose_tree': {'examples': '500', 'batch_size': '32'},
    'where_tau_stops': {'split': '', 'examples': '0', 'batch_size': '32'},
    'sampling_seeds': {'config': 'configs/multi30k_ende.py:k=10,regime=finetune', 'split': '', 'batch_size': '32'},
    'superres_agreement': {'split': 'val', 'batch_size': '16', 'examples': '4'},
    'superres_prefix_check': {'examples': '4'},
    'head_loss': {'config': 'configs/multi30k_ende.py', 'batch_size': '64'},
}

_defaults = functools.partial(errors.per_mode_help, MODE_DEFAULTS)


# Flags exist only when this file runs as a script: importing it (tests, another script) defines none.
if __name__ == '__main__':
  _MODE = flags.DEFINE_enum('mode', None, MODES, 'What to measure (see the module docstring).', required=True)
  _CONFIG = errors.define_config_file(
      'config', None, 'choose_tree, where_tau_stops: the config the model was trained with (required); '
      'sampling_seeds: the decode config; head_loss: model size and vocabulary. ' + _defaults('config'))
  _WORKDIR = flags.DEFINE_string('workdir', None, "choose_tree: the k-head model's workdir, trees.json is written "
                                 'there; where_tau_stops: the k-head model (nothing is written there); '
                                 'sampling_seeds: the k-head model to sample from (required).')
  _WORKDIRS = flags.DEFINE_list('workdirs', [], 'superres_agreement: k-head image models whose decode_<split>/ holds a '
                                'greedy decode; superres_prefix_check: trained image models.')
  _EXAMPLES = flags.DEFINE_integer('examples', None, 'choose_tree: val examples to measure on (0 = all); '
                                   'where_tau_stops: the first N sentences of --split (0 = all); superres_*: the '
                                   'first N val images. ' + _defaults('examples'))
  _BATCH = flags.DEFINE_integer('batch_size', None, 'Batch size (choose_tree, where_tau_stops: of the greedy decode '
                                'and the teacher-forced pass; superres_agreement: of the greedy decode to read, '
                                '<split>.greedy.b<B>.npy; head_loss: rows per step). ' + _defaults('batch_size'))
  _SPLIT = flags.DEFINE_string('split', None, "where_tau_stops, sampling_seeds: the split (empty: the config's first "
                               'decode split); superres_agreement: the decoded split. ' + _defaults('split'))
  # choose_tree, where_tau_stops
  _NODES = flags.DEFINE_list('nodes', ['8', '16', '32', '64'], 'choose_tree: tree sizes N to build (and save); '
                             'where_tau_stops: the context-aware trees dynamic:N to measure.')
  _RANKS = flags.DEFINE_integer('ranks', 8, 'choose_tree: choices per head measured: ranks 0..R-1.')
  _HEADS = flags.DEFINE_integer('heads', 0, "where_tau_stops: heads D of the chain and the trees (0: the model's k).")
  _OUT = flags.DEFINE_string('out', '', 'where_tau_stops: also write the tables to this markdown file.')
  # sampling_seeds
  _TEMPERATURE = flags.DEFINE_float('temperature', 1.0, 'sampling_seeds: sampling temperature (> 0).')
  _SEEDS = flags.DEFINE_string('seeds', '0-4', 'sampling_seeds: seeds as FIRST-LAST (inclusive).')
  _KS = flags.DEFINE_list('ks', ['1', '4'], "sampling_seeds: heads k' of the speculative sampler.")
  # superres_agreement, superres_prefix_check
  _EPS = flags.DEFINE_integer('eps', 2, 'superres_agreement: intensity distance of the approximate criterion '
                              '(distance:EPS).')
  _DATA = flags.DEFINE_string('data_dir', '../shared/data/celeba32', 'superres_prefix_check: folder with val.npy and '
                              'val_8x8.npy')
  # head_loss
  _K = flags.DEFINE_integer('k', 8, 'head_loss: heads.')
  _LENGTH = flags.DEFINE_integer('length', 32, 'head_loss: source and target length.')
  _REPEATS = flags.DEFINE_integer('repeats', 5, 'head_loss: timed steps per program (median).')
  _REGIMES = flags.DEFINE_list('regimes', ['finetune', 'frozen'], 'head_loss: regimes to time.')


# -- --mode=choose_tree: a tree of candidates from a model's measured top-r agreement ----------------------------------

def decode_greedy(config, workdir: str, model_config, params, split: str, examples: int, batch_size: int):
  """Greedy outputs of a workdir's model on the first `examples` sentences of `split` (0: all), what choose_tree and
  where_tau_stops teacher-force the model on: (model, src_ids, greedy_ids)."""
  tokenizer = tokenizer_lib.load(os.path.join(workdir, tokenizer_lib.MODEL_NAME))
  src, tgt = pipeline.load_split(config.data, split, config.seed)
  if examples:
    src, tgt = src[:examples], tgt[:examples]
  src_ids, _, _ = batching.encode_pairs(tokenizer, src, tgt, config.decode.max_src_len, truncate=True)
  model = model_lib.Transformer(model_config)
  decoder = decoder_lib.Decoder(model, config.decode.max_len)
  greedy_ids, _ = decoder_lib.run_batches(lambda s: decoder.greedy(params, s).tokens_BxL, src_ids, batch_size,
                                          f'{split} greedy')
  return model, src_ids, greedy_ids


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
  split = config.data.eval_split
  model, src_ids, greedy_ids = decode_greedy(config, workdir, model_config, params, split, examples, batch_size)
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


def parse_nodes(values) -> list[int]:
  """--nodes as integers (choose_tree, where_tau_stops)."""
  try:
    return [int(n) for n in values]
  except ValueError:
    raise UserError(f'--nodes={",".join(values)}: give integers, e.g. --nodes=8,16,32.') from None


def run_choose_tree():
  nodes = parse_nodes(_NODES.value)
  logging.info('choose_tree: %s', _WORKDIR.value)
  return choose(_CONFIG.value, _WORKDIR.value, nodes, _RANKS.value, _EXAMPLES.value, _BATCH.value)


# -- --mode=where_tau_stops: at which depth an accepted path ends, and why ---------------------------------------------

CAUSES = ('outside top-r', 'pruned by beam', 'cut by node budget')


def teacher_forced_trees(model, params, src_ids, greedy_ids, policies, batch_size: int) -> dict:
  """The trees the decoder would draft at every position of greedy's outputs, the model teacher-forced on [BOS] +
  greedy output (as train.top_r_agreement runs it).

  At position t (y_1..y_t accepted, t = 0..length - 1) head 1's logits and heads 2..D's draft each policy's tree
  (decoding.Dynamic, all of one depth D, beam and ranks) as the decoder drafts it: decoding._draft, i.e.
  Dynamic.build, then the exact rule's draft gives the nodes their tokens. Host arrays over the P positions of
  every sentence, in source order:
    y_PxD          greedy's continuation y_{t+1}..y_{t+D}, 0 past the sentence's end (EOS included);
    rank_PxD       the rank of y_{t+d} among head d's `ranks` best tokens (the choices the draft gives nodes; rank 0 =
                   argmax), `ranks` where it is not among them;
    logp_PxDm1xR   the top-r log-softmax values of heads 2..D, what Dynamic.build scores its candidates with;
    trees          {N: {'depth', 'parent', 'token', 'rank' [P, N]}}, per policy of N nodes.
  """
  depth, ranks = policies[0].depth, policies[0].ranks
  tokens = train.greedy_targets(greedy_ids)
  length = max(decoder_lib.source_bucket(src_ids), max(len(t) for t in tokens))

  @jax.jit
  def trees_at_positions(params, src_BxS, tgt_BxT):
    tgt_in_BxT = jnp.pad(tgt_BxT[:, :-1], ((0, 0), (1, 0)), constant_values=tokenizer_lib.BOS_ID)
    logits_BxTxDxV = model.apply({'params': params}, src_BxS, tgt_in_BxT)[:, :, :depth]
    P, V = logits_BxTxDxV.shape[0] * logits_BxTxDxV.shape[1], logits_BxTxDxV.shape[-1]
    logits_PxDxV = logits_BxTxDxV.reshape(P, depth, V)
    head1_PxV, heads_PxDm1xV = logits_PxDxV[:, 0], logits_PxDxV[:, 1:]
    r = min(ranks, V)
    y_PxD = losses.head_targets(tgt_BxT, depth).reshape(P, depth)
    is_y_PxDxR = jax.lax.top_k(logits_PxDxV, r)[1] == y_PxD[..., None]
    out = {'y_PxD': y_PxD,
           'rank_PxD': jnp.where(jnp.any(is_y_PxDxR, axis=-1), jnp.argmax(is_y_PxDxR, axis=-1), r),
           'logp_PxDm1xR': jax.lax.top_k(jax.nn.log_softmax(heads_PxDm1xV.astype(jnp.float32)), r)[0], 'trees': {}}
    target = decoding.EXACT.target(head1_PxV)
    draft = decoding._draft  # pylint: disable=protected-access
    # The heads drafter reads no output so far: empty rows, one per position.
    rows = decoding.start_rows(jnp.zeros((P,), jnp.int32), depth=depth, ends_early=False,
                               fixed=decoding.Fixed(batch_size=P, max_len=1, bos_id=tokenizer_lib.BOS_ID, eos_id=-1))
    for policy in policies:  # the decoder's own drafting; its propose_fn here reads heads 2..D's logits as they are
      nodes_PxN, tree, _ = draft(decoding.EXACT, policy, target, heads_PxDm1xV, decoding.ModelFns(None, lambda h: h),
                                 None, decoding.HEADS, (), rows, V)
      out['trees'][policy.num_nodes] = {'depth': tree.depth_BxN, 'parent': tree.parent_BxN, 'token': nodes_PxN,
                                         'rank': tree.rank_BxN}
    return out

  parts = []
  for _, src, tgt in batching.eval_batches(src_ids, tokens, batch_size, (length,)):
    out = jax.device_get(trees_at_positions(params, jnp.asarray(src), jnp.asarray(tgt)))
    keep_P = out['y_PxD'][:, 0] > 0  # positions t < length: padding rows and positions past EOS go
    parts.append(jax.tree.map(lambda x, keep_P=keep_P: x[keep_P], out))
  return jax.tree.map(lambda *xs: np.concatenate(xs), *parts)


def candidates(logp_PxDm1xR, beam: int) -> dict:
  """Dynamic's candidate nodes (`decoding.Dynamic.candidate_nodes`, the decoder's own code) from the measured top-r
  log-probabilities of heads 2..D (independent heads: every parent at a depth gets the same r choices). score_PxM;
  depth_M; path_PxMxD: the ranks from the root to the node (-1 past its depth); in_beam_PxM: kept in the beam at its
  depth, so that its children are candidates."""
  P, Dm1, R = logp_PxDm1xR.shape
  policy = decoding.Dynamic(num_nodes=1, depth=Dm1 + 1, beam=beam, ranks=R)

  @jax.jit
  def nodes(logp_PxDm1xR):  # the tokens do not matter here: rank r stands for head d + 1's r-th choice
    top_ranks = lambda d, _: (logp_PxDm1xR[:, None, d - 1, :].astype(jnp.float32),
                              jnp.broadcast_to(jnp.arange(R, dtype=jnp.int32), (P, 1, R)))
    return policy.candidate_nodes(jnp.zeros((P,), jnp.int32), top_ranks)

  c = jax.device_get(nodes(jnp.asarray(logp_PxDm1xR)))
  return {'score_PxM': np.asarray(c.score_BxM), 'depth_M': np.array(c.depth_M), 'path_PxMxD': np.asarray(c.path_BxMxD),
          'in_beam_PxM': np.asarray(c.in_beam_BxM)}


def accepted_on_tree(tree: dict, y_PxD, available_P) -> np.ndarray:
  """How deep greedy's continuation runs along one root path of each position's tree (nodes' tokens and parents):
  the exact rule's accepted length. The root always passes (head 1's choice is greedy's next token); at most the
  depth available."""
  length_P = np.ones(len(y_PxD), np.int64)
  node_P = np.zeros(len(y_PxD), np.int64)  # the deepest accepted node so far: the root
  going_P = np.ones(len(y_PxD), bool)
  for d in range(1, y_PxD.shape[1]):
    hit_PxN = (tree['depth'] == d) & (tree['parent'] == node_P[:, None]) & (tree['token'] == y_PxD[:, d:d + 1])
    going_P &= np.any(hit_PxN, axis=1) & (d < available_P)
    node_P = np.where(going_P, np.argmax(hit_PxN, axis=1), node_P)
    length_P += going_P
  return length_P


def tau_stops(measured: dict, beam: int) -> dict:
  """Where greedy's continuation stops being accepted, per position (`teacher_forced_trees`' arrays), for the chain
  of D, each tree of N nodes, all of Dynamic's candidates (no node budget) and every head's top r (no beam either).

  Returns {'positions', 'depth', 'ranks', 'available_P', 'chain_by_depth': rows of table (a), 'trees': rows of
  table (b)}; a row of (b) holds the per-position accepted lengths (length_P) and counts: stops_D[a] (stops at depth
  a: accepted length a < the depth available), reached (every depth available accepted), reached_end (of those, the
  positions with fewer than D tokens left), causes[i] (CAUSES, per stop; None for the chain).
  """
  y_PxD, rank_PxD = measured['y_PxD'], measured['rank_PxD']
  (P, D), R = y_PxD.shape, measured['logp_PxDm1xR'].shape[-1]
  available_P = np.sum(y_PxD > 0, axis=1)
  cands = candidates(measured['logp_PxDm1xR'], beam)
  depth_M = cands['depth_M']
  # Greedy's node at depth d (rank path rank_PxD[:, :d + 1], the root's rank 0) is a candidate iff its parent is in
  # the beam at depth d - 1 and y_{t+d+1} is among head d + 1's top r; one candidate at most per depth.
  greedy_rank_PxD = np.concatenate([np.zeros((P, 1), rank_PxD.dtype), rank_PxD[:, 1:]], axis=1)
  greedy_PxM = np.all((cands['path_PxMxD'] == greedy_rank_PxD[:, None, :]) | (cands['path_PxMxD'] < 0), axis=2)
  candidate_PxD = np.stack([np.any(greedy_PxM[:, depth_M == d], axis=1) for d in range(D)], axis=1)
  beam_PxD = np.stack([np.any((greedy_PxM & cands['in_beam_PxM'])[:, depth_M == d], axis=1) for d in range(D)], axis=1)
  live_PxD = np.arange(D)[None, :] < available_P[:, None]
  oracle_P = np.sum(np.cumprod(candidate_PxD & live_PxD, axis=1), axis=1)
  chain_P = np.sum(np.cumprod(((rank_PxD == 0) | (np.arange(D) == 0)) & live_PxD, axis=1), axis=1)
  top_r_P = np.sum(np.cumprod(((rank_PxD < R) | (np.arange(D) == 0)) & live_PxD, axis=1), axis=1)

  def row(name, length_P, with_causes=True):
    stopped_P = length_P < available_P
    r = {'tree': name, 'length_P': length_P, 'mean': float(np.mean(length_P)), 'positions': P,
         'stops_D': np.bincount(length_P[stopped_P], minlength=D)[:D], 'reached': int(np.sum(~stopped_P)),
         'reached_end': int(np.sum(~stopped_P & (available_P < D))), 'causes': None}
    if with_causes:  # the missing node is at depth a = length: head a + 1's token y_{t+a+1}, under greedy's node a - 1
      a_S = length_P[stopped_P]
      outside_S = rank_PxD[stopped_P, a_S] >= R
      pruned_S = ~outside_S & ~beam_PxD[stopped_P, a_S - 1]
      r['causes'] = np.array([np.sum(outside_S), np.sum(pruned_S), np.sum(~outside_S & ~pruned_S)])
    return r

  trees_ = [row(f'chain of {D}', chain_P, with_causes=False)]
  trees_ += [row(f'dynamic:{n}', accepted_on_tree(tree, y_PxD, available_P))
             for n, tree in sorted(measured['trees'].items())]
  trees_.append(row(f'all {len(depth_M)} candidates (no node budget)', oracle_P))
  trees_.append(row(f'every head\'s top {R} (no beam, no budget)', top_r_P))
  by_depth = []
  for d in range(1, D):  # head d + 1 given that the chain accepted y_{t+1..t+d} and y_{t+d+1} exists
    right_P = (chain_P >= d) & (available_P > d)
    by_depth.append({'depth': d, 'stops': float(np.mean((chain_P == d) & (available_P > d))),
                     'top1': float(np.mean(rank_PxD[right_P, d] == 0)) if right_P.any() else float('nan'),
                     'topr': float(np.mean(rank_PxD[right_P, d] < R)) if right_P.any() else float('nan'),
                     'count': int(np.sum(right_P))})
  return {'positions': P, 'depth': D, 'ranks': R, 'available_P': available_P, 'chain_by_depth': by_depth,
          'trees': trees_, 'head1_mismatches': int(np.sum(rank_PxD[:, 0] != 0)),
          'over_oracle': {r['tree']: int(np.sum(r['length_P'] > oracle_P)) for r in trees_[1:-2]}}


def stop_tables(stats: dict) -> str:
  """Tables (a) and (b) of `tau_stops` as markdown."""
  D, R, P = stats['depth'], stats['ranks'], stats['positions']
  reached, end = f'reached D={D}', f'reached the end (< {D} left)'
  chain_ = stats['trees'][0]
  chain = report.markdown_table(stats['chain_by_depth'] + [
      {'depth': reached, 'stops': (chain_['reached'] - chain_['reached_end']) / P},
      {'depth': end, 'stops': chain_['reached_end'] / P}], [
          ('depth', 'chain stops at depth d', '{}'), ('stops', 'fraction of positions', '{:.3f}'),
          ('top1', 'head d+1 top-1, prefix right', '{:.3f}'), ('topr', f'head d+1 top-{R}, prefix right', '{:.3f}'),
          ('count', 'positions with prefix right', '{}')])
  columns = [('tree', 'tree', '{}'), ('mean', 'mean accepted length', '{:.3f}')]
  columns += [(None, f'stops at {a}', lambda r, a=a: f"{r['stops_D'][a] / r['positions']:.3f}") for a in range(1, D)]
  columns.append((None, reached, lambda r: f"{(r['reached'] - r['reached_end']) / r['positions']:.3f}"))
  columns.append((None, end, lambda r: f"{r['reached_end'] / r['positions']:.3f}"))
  for i, cause in enumerate(CAUSES):
    columns.append((None, cause.replace('top-r', f'top-{R}') + ' (of stops)', lambda r, i=i: '' if r['causes'] is None
                    else f"{r['causes'][i] / max(int(np.sum(r['stops_D'])), 1):.3f}"))
  trees_ = report.markdown_table(stats['trees'], columns)
  notes = [f'{P} positions; the most any tree could accept (every depth available): '
           f'{np.mean(np.minimum(stats["available_P"], D)):.3f} on average.']
  if stats['head1_mismatches']:
    notes.append(f"At {stats['head1_mismatches']} positions head 1's teacher-forced argmax is not greedy's token "
                 '(float rounding between the cached and the teacher-forced pass): counted as passing, as decoding '
                 'would.')
  if any(stats['over_oracle'].values()):
    notes.append(f"Positions where a tree accepted deeper than the candidates allow (ties between the candidates "
                 f"from the measured top-r and Dynamic.build's from the full logits): {stats['over_oracle']}.")
  return '\n\n'.join([
      f'(a) The chain of {D} heads (exact): where it stops, and head d+1 given that the chain accepted '
      f'y_(t+1)..y_(t+d).', chain,
      f'(b) Accepted length per position (teacher-forced: averaged over positions t, not over decode iterations as a '
      f"decoder's tokens / iterations is), where it stops (fractions of all positions) and why (fractions of the "
      f'stops): greedy\'s next token not among head a+1\'s top {R} (outside top-{R}), its parent not kept in the '
      'beam at depth a (pruned by beam), or a candidate not among the N best (cut by node budget). The last two '
      'rows: every candidate Dynamic.build scores (no node budget), and greedy\'s tokens as deep as each is among its '
      f'head\'s top {R} (no beam either).', trees_,
      ' '.join(notes)])


def where_tau_stops(config, workdir: str, split: str, heads: int, nodes: list[int], examples: int,
                    batch_size: int) -> str:
  """Where exact tree decoding's accepted path stops, and why (module docstring); returns the tables as markdown."""
  if examples < 0 or batch_size < 1:
    raise UserError(f'--examples={examples} must be >= 0 and --batch_size={batch_size} >= 1.')
  if config.data.source == 'images':
    raise UserError('Tree decoding is implemented for translation only (config.data.source=images).')
  if config.model.draft_vocab:
    raise UserError(f'config.model.draft_vocab={config.model.draft_vocab}: --mode=where_tau_stops measures heads '
                    'drafting from the whole vocabulary; set it to 0.')
  model_config = checkpoint.read_model_config(workdir)
  if model_config.head_type != 'independent':
    raise UserError(f'The model in {workdir} has head_type={model_config.head_type!r}: --mode=where_tau_stops '
                    "supports independent heads only (a sequential head's logits depend on the node's parent, "
                    'and tree decoding refuses them).')
  heads = heads or model_config.k
  if not 2 <= heads <= model_config.k:
    raise UserError(f'--heads={heads}: the trees need 2 <= D <= k heads, and the model in {workdir} has '
                    f'k={model_config.k}.')
  policies = [decoding.Dynamic(num_nodes=n, depth=heads) for n in nodes]
  for policy in policies:
    policy.check(model_config.vocab_size)
  split = split or config.decode.splits[0]
  model_config, params, step = checkpoint.load_params(workdir, step=config.checkpoint_step)
  model, src_ids, greedy_ids = decode_greedy(config, workdir, model_config, params, split, examples, batch_size)
  stats = tau_stops(teacher_forced_trees(model, params, src_ids, greedy_ids, policies, batch_size),
                    policies[0].beam)
  return (f'Where τ stops: {workdir} (step {step}), {split}, {len(src_ids)} sentences, D={heads} heads, '
          f'dynamic trees with beam {policies[0].beam} and {policies[0].ranks} ranks per head.\n\n' +
          stop_tables(stats) + '\n')


def run_where_tau_stops():
  text = where_tau_stops(_CONFIG.value, _WORKDIR.value, _SPLIT.value, _HEADS.value, parse_nodes(_NODES.value),
                         _EXAMPLES.value, _BATCH.value)
  print(text)
  if _OUT.value:
    files.write_atomic(_OUT.value, text)
    print(f'saved {_OUT.value}')


# -- --mode=sampling_seeds: the spread of sampled quality across seeds -------------------------------------------------

def parse_seeds(text) -> range:
  first, sep, last = text.partition('-')
  try:
    seeds = range(int(first), int(last if sep else first) + 1)
  except ValueError:
    seeds = range(0)
  if not seeds:
    raise UserError(f'--seeds={text!r}: write FIRST-LAST with FIRST <= LAST, e.g. --seeds=0-8.')
  return seeds


def run_sampling_seeds():
  config, workdir, temperature = _CONFIG.value, _WORKDIR.value, _TEMPERATURE.value
  task = tasks.for_config(config)
  seeds, ks = parse_seeds(_SEEDS.value), [int(k) for k in _KS.value]
  if temperature <= 0:
    raise UserError(f'--temperature={temperature}: sampling needs a temperature > 0.')
  model_config, params, _, tokenizer, decoder = evaluate.load_for_decoding(config, workdir, task,
                                                                           sharding.make_mesh(1))
  if max(ks) > model_config.k:
    raise UserError(f'--ks={_KS.value}: the model in {workdir} has k={model_config.k} heads.')
  split = _SPLIT.value or config.decode.splits[0]
  src_ids, references, _ = task.decode_examples(config, split, tokenizer)
  bucket = decoder_lib.source_bucket(src_ids)

  def score(fn):
    out, _ = decoder_lib.run_batches(fn, src_ids, _BATCH.value, bucket=bucket)
    outputs = task.outputs(tokenizer, [o.tokens_BxL for o in out])
    quality = task.scores(outputs, references, outputs)['quality']
    return quality, float(np.mean([int(o.length_B) for o in out]))

  def speculative(k, seed):
    return lambda src_BxS: decoder.blockwise(params, src_BxS, speculative_lib.Sampling(temperature=temperature),
                                             decoding.chain(k), seed=seed)

  names = ['ancestral'] + [f'speculative k={k}' for k in ks]
  qualities = {name: [] for name in names}
  columns = [('seed', 'seed', '{}')] + [(n, f'{n} {task.quality_metric} (mean length)', '{}') for n in names]
  print(report.markdown_table([], columns))
  for seed in seeds:
    cells = [score(lambda src, seed=seed: decoder.sample(params, src, temperature, seed))]
    cells += [score(speculative(k, seed)) for k in ks]
    for name, cell in zip(names, cells):
      qualities[name].append(cell[0])
    row = {'seed': seed, **{n: f'{q:.2f} ({length:.2f})' for n, (q, length) in zip(names, cells)}}
    print(report.markdown_table([row], columns, header=False), flush=True)
  spread = lambda q: np.std(q, ddof=1) / np.sqrt(len(seeds)) if len(seeds) > 1 else 0
  means = {n: f'{np.mean(qualities[n]):.2f} ± {spread(qualities[n]):.2f}' for n in names}
  print(report.markdown_table([{'seed': 'mean ± s.e.', **means}], columns, header=False))


# -- --mode=superres_agreement: per-head agreement with greedy on images -----------------------------------------------

def agreement(workdir, split, batch_size, examples, eps):
  """Returns (exact_K, within_eps_K): per head, the fraction of positions where it matches greedy."""
  model_config, params, _ = checkpoint.load_params(workdir)
  greedy_Nx32x32x3 = np.load(os.path.join(workdir, f'decode_{split}', f'{split}.greedy.b{batch_size}.npy'))[:examples]
  data = celeba_sr.get_config('cpu').data
  lowres_Nx8x8x3, _ = pipeline.load_image_split(data, split, examples)
  src_NxS = jnp.asarray(images.image_to_tokens(lowres_Nx8x8x3))
  tgt_NxT = jnp.asarray(images.image_to_tokens(greedy_Nx32x32x3))
  tgt_in_NxT = jnp.pad(tgt_NxT[:, :-1], ((0, 0), (1, 0)), constant_values=tokenizer_lib.BOS_ID)
  model = model_lib.Transformer(model_config)
  heads_NxTxK = np.asarray(jax.jit(lambda p, s, t: jnp.argmax(model.apply({'params': p}, s, t), axis=-1))(
      params, src_NxS, tgt_in_NxT))
  tgt = np.asarray(tgt_NxT)
  exact, near = [], []
  for i in range(model_config.k):  # head i + 1 at position t predicts target index t + i
    proposed, truth = heads_NxTxK[:, :tgt.shape[1] - i, i], tgt[:, i:]
    exact.append(np.mean(proposed == truth))
    near.append(np.mean(np.abs(proposed.astype(int) - truth) <= eps))
  return np.array(exact), np.array(near)


def run_superres_agreement():
  for workdir in _WORKDIRS.value:
    exact_K, near_K = agreement(workdir, _SPLIT.value, _BATCH.value, _EXAMPLES.value, _EPS.value)
    print(f'{workdir}: agreement with greedy, heads 1..{len(exact_K)}')
    print('  exact:       ' + ' '.join(f'{a:.2f}' for a in exact_K))
    print(f'  within {_EPS.value}:    ' + ' '.join(f'{a:.2f}' for a in near_K))


# -- --mode=superres_prefix_check: head 1's one-step quality given a fixed prefix --------------------------------------

def run_superres_prefix_check():
  lowres_Nx8x8x3, highres_Nx32x32x3 = images.load_npy_split(_DATA.value, 'val')
  lowres_Nx8x8x3, highres_Nx32x32x3 = lowres_Nx8x8x3[:_EXAMPLES.value], highres_Nx32x32x3[:_EXAMPLES.value]
  nearest = images.enlarge(lowres_Nx8x8x3)
  src_NxS = jnp.asarray(images.image_to_tokens(lowres_Nx8x8x3))
  prefixes = {'true image': images.image_to_tokens(highres_Nx32x32x3), 'nearest': images.image_to_tokens(nearest)}
  print(f'nearest-neighbour enlargement: {images.psnr(nearest, highres_Nx32x32x3).mean():.2f} dB')
  for workdir in _WORKDIRS.value:
    config, params, step = checkpoint.load_params(workdir)
    model = model_lib.Transformer(config)
    argmax = jax.jit(lambda p, src, tgt_in: jnp.argmax(model.apply({'params': p}, src, tgt_in)[:, :, 0], axis=-1))
    for name, tokens_NxT in prefixes.items():
      # Position p's input is the prefix's sub-pixel p - 1 (BOS at 0); its argmax is the guess for sub-pixel p.
      tgt_in_NxT = np.concatenate([np.full((len(tokens_NxT), 1), tokenizer_lib.BOS_ID), tokens_NxT[:, :-1]], axis=1)
      guess = images.tokens_to_image(np.asarray(argmax(params, src_NxS, jnp.asarray(tgt_in_NxT))))
      print(f'{workdir} step {step}, prefix {name}: one-step argmax '
            f'{images.psnr(guess, highres_Nx32x32x3).mean():.2f} dB')


# -- --mode=head_loss: one train step, all heads projected against one drawn head --------------------------------------


def run_head_loss():
  config = _CONFIG.value
  model_config = model_lib.model_config(config.model.size, vocab_size=config.data.vocab_size, k=_K.value,
                                        dropout_rate=config.model.dropout_rate)
  model = model_lib.Transformer(model_config)
  params = train.fresh_params(model_config, 0)
  rng = np.random.default_rng(0)
  batch = {name: rng.integers(3, model_config.vocab_size, (_BATCH.value, _LENGTH.value)).astype(np.int32)
           for name in ('src_BxS', 'tgt_BxT')}
  print(f'model {config.model.size}, vocab {model_config.vocab_size}, k={_K.value}, batch {_BATCH.value} x '
        f'{_LENGTH.value}, {jax.devices()[0].platform}; median of {_REPEATS.value}, alternating')
  columns = [('regime', 'regime', '{}'), ('mean', 'mean (s/step)', '{:.3f}'), ('random', 'random (s/step)', '{:.3f}'),
             (None, 'mean / random', lambda r: f"{r['mean'] / r['random']:.2f}")]
  print(report.markdown_table([], columns))
  for regime in _REGIMES.value:
    frozen = regime == 'frozen'
    optimizer = train.make_optimizer(regime, params, 1e-3, 100)
    steps = {loss: train.make_train_step(model, optimizer, seed=0, head_loss=loss, label_smoothing=0.1, frozen=frozen)
             for loss in ('mean', 'random')}
    # Own copies: a train step donates its state's buffers.
    states = {loss: jax.tree.map(lambda x: x.copy(), {'params': params, 'opt_state': optimizer.init(params)})
              for loss in steps}
    times = {loss: [] for loss in steps}
    for i in range(_REPEATS.value + 1):  # the first round compiles and warms up
      for loss, step in steps.items():
        start = time.perf_counter()
        states[loss], out = step(states[loss], batch, i)
        jax.block_until_ready(out['loss'])
        if i:
          times[loss].append(time.perf_counter() - start)
    row = {'regime': regime, **{loss: statistics.median(t) for loss, t in times.items()}}
    print(report.markdown_table([row], columns, header=False))


RUNS = {'choose_tree': run_choose_tree, 'where_tau_stops': run_where_tau_stops,
        'sampling_seeds': run_sampling_seeds, 'superres_agreement': run_superres_agreement,
        'superres_prefix_check': run_superres_prefix_check, 'head_loss': run_head_loss}


def main(argv):
  del argv
  metrics.quiet_library_logs()
  mode = _MODE.value
  errors.set_defaults(MODE_DEFAULTS[mode])
  if mode in ('choose_tree', 'where_tau_stops', 'sampling_seeds', 'head_loss') and _CONFIG.value is None:
    raise UserError(f'--mode={mode} needs --config: the config the model was trained with.')
  if mode in ('choose_tree', 'where_tau_stops', 'sampling_seeds') and not _WORKDIR.value:
    raise UserError(f'--mode={mode} needs --workdir: the trained k-head model.')
  RUNS[mode]()


if __name__ == '__main__':
  stack.raise_stack_limit()  # before anything compiles (bpd/stack.py)
  app.run(lambda argv: errors.exit_on_user_error(main, argv), flags_parser=errors.parse_flags)
