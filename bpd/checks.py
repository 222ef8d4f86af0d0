"""Checks of the config, flags and files, run before anything is compiled, trained or written.

Each failure is a UserError naming the offending flag, field or file and saying how to fix it. Nothing in
the workdir is touched before these pass, so a bad command never costs a checkpoint or a result.
"""

import filecmp
import os
import tempfile

from absl import logging

from bpd import checkpoint
from bpd import decoder as decoder_lib
from bpd import decoding
from bpd import draft_vocab
from bpd import drafters
from bpd import matmul
from bpd import model as model_lib
from bpd import rules as rules_lib
from bpd import speculative
from bpd import trees
from bpd.data import images
from bpd.data import pipeline
from bpd.data import tokenizer as tokenizer_lib
from bpd.errors import UserError

REGIMES = ('base', 'frozen', 'finetune')
HEAD_LOSSES = ('mean', 'random')


def check_workdir(workdir: str) -> None:
  """The workdir exists (or can be made) and can be written to."""
  if not workdir:
    raise UserError('--workdir is empty: give a folder for checkpoints and results, e.g. --workdir=runs/demo.')
  try:
    os.makedirs(workdir, exist_ok=True)
    with tempfile.NamedTemporaryFile(dir=workdir, prefix='.write_test'):
      pass
  except OSError as e:
    raise UserError(f'Cannot write to --workdir={workdir!r} ({e.strerror or e}). Choose a folder you can write '
                    'to, or fix its permissions.') from None


def check_model(config) -> None:
  if config.k < 1:
    raise UserError(f'config.k={config.k}: the number of heads must be at least 1 (1 = a plain Transformer; '
                    'the paper uses 2..10).')
  if config.model.size not in model_lib.SIZES:
    raise UserError(f'config.model.size={config.model.size!r} is not one of {sorted(model_lib.SIZES)}.')
  head_type = config.model.head_type
  if head_type not in model_lib.HEAD_TYPES:
    raise UserError(f'config.model.head_type={head_type!r} is not one of {model_lib.HEAD_TYPES} (independent: the '
                    'paper\'s heads; sequential: each head also sees the token proposed before it).')
  # Early, against the configured vocabulary; bpd/draft_vocab.py checks again against the tokenizer's own.
  draft_vocab.check(config.model.draft_vocab, images.IMAGE_VOCAB_SIZE if config.data.source == 'images'
                    else config.data.vocab_size)


def check_train(config, workdir: str) -> None:
  tc = config.train
  check_model(config)
  if tc.regime not in REGIMES:
    raise UserError(f'config.train.regime={tc.regime!r} is not one of {REGIMES}.')
  if tc.head_loss not in HEAD_LOSSES:
    raise UserError(f'config.train.head_loss={tc.head_loss!r} is not one of {HEAD_LOSSES}.')
  if tc.head_learning_rate < 0:
    raise UserError(f'config.train.head_learning_rate={tc.head_learning_rate} must be >= 0 (0: the heads use '
                    'config.train.learning_rate).')
  noise = tc.input_noise
  if noise < 0 or (noise > 0 and config.data.source != 'images'):
    raise UserError(f'config.train.input_noise={noise}: the std of the noise on the decoder\'s input pixels, in '
                    'intensity levels: >= 0, and 0 unless config.data.source=images.')
  for field in ('num_steps', 'batch_size', 'checkpoint_every', 'log_every', 'warmup_steps'):
    if tc[field] < 1:
      raise UserError(f'config.train.{field}={tc[field]} must be at least 1.')
  if tc.eval_every < 0:
    raise UserError(f'config.train.eval_every={tc.eval_every} must be at least 0 (0: never evaluate).')
  if tc.regime == 'base' and tc.init_from:
    raise UserError('config.train.init_from is set but config.train.regime=base trains from scratch: use '
                    'regime=frozen or regime=finetune to start from that model, or drop init_from.')
  if tc.regime != 'base':
    if not tc.init_from:
      raise UserError(f'config.train.regime={tc.regime} starts from a trained base model: set '
                      'config.train.init_from=BASE_WORKDIR (the --workdir of a regime=base run).')
    checkpoint.read_model_config(tc.init_from, 'config.train.init_from')
    if config.k < 2:
      raise UserError(f'config.train.regime={tc.regime} adds proposal heads to the base model: set config.k >= 2.')
  pipeline.check_source(config.data, need_splits=(config.data.train_split, config.data.eval_split))
  check_workdir(workdir)


def check_init_from(model_config: model_lib.ModelConfig, init_from: str, workdir: str) -> None:
  """The base model in init_from has the shape and vocabulary of the model about to be trained."""
  if not init_from:
    return
  base = checkpoint.read_model_config(init_from, 'config.train.init_from')
  fields = ('vocab_size', 'd_model', 'num_heads', 'num_encoder_layers', 'num_decoder_layers', 'd_ff',
            'attention_block', 'image_side', 'image_input_side', 'colocated_input', 'output_prior_sigma')
  diffs = [f'{f}: {getattr(base, f)} there, {getattr(model_config, f)} here' for f in fields
           if getattr(base, f) != getattr(model_config, f)]
  mine = os.path.join(workdir, tokenizer_lib.MODEL_NAME)
  theirs = os.path.join(init_from, tokenizer_lib.MODEL_NAME)
  if os.path.exists(mine) and os.path.exists(theirs) and not filecmp.cmp(mine, theirs, shallow=False):
    diffs.append(f'the tokenizer {mine} differs from {theirs}')
  if diffs:
    raise UserError(f'config.train.init_from={init_from!r} holds a model of a different size or vocabulary ('
                    + '; '.join(diffs) + '). Use the same config.model.size (for images also '
                    'config.model.image_positions: image_side 0 means the base used 1D positions; and '
                    'config.model.colocated_input) and tokenizer as '
                    'the base run, or point init_from at a matching base model.')


MATMUL_PRECISIONS = ('', 'default', 'high', 'highest')  # '' and three of jax.default_matmul_precision's names


def check_matmul_precision(config) -> str:
  """config.decode.matmul_precision, checked."""
  precision = config.decode.matmul_precision
  if precision not in MATMUL_PRECISIONS:
    raise UserError(f'config.decode.matmul_precision={precision!r}: choose one of {MATMUL_PRECISIONS} '
                    "('' keeps the backend's default; 'highest' is full float32).")
  return precision


def check_matmul_kernel(config) -> str:
  """config.decode.matmul_kernel, checked: 'auto', 'xla' or 'skinny' (bpd/matmul.py, which also refuses skinny
  where it cannot run, when a decoder is made)."""
  kernel = config.decode.get('matmul_kernel', 'auto')
  if kernel not in matmul.KERNELS:
    raise UserError(f'config.decode.matmul_kernel={kernel!r}: choose one of {matmul.KERNELS} (auto: the skinny '
                    'kernel on CPU where it builds, else XLA).')
  return kernel


def check_head_weights(config) -> str:
  """config.decode.head_weights, checked: the dtype in which a skinny-kernel decoder reads heads 2..k."""
  head_weights = config.decode.get('head_weights', 'int8')
  if head_weights not in model_lib.HEAD_WEIGHTS:
    raise UserError(f'config.decode.head_weights={head_weights!r}: choose one of {tuple(model_lib.HEAD_WEIGHTS)} '
                    '(int8, the default, or float16: heads 2..k read narrow weights on the skinny kernel; head 1 '
                    'verifies in float32).')
  return head_weights


def check_fused_heads(config) -> bool:
  """config.decode.fused_heads, checked: whether a skinny-kernel decoder runs sequential heads 2..k' in one call."""
  fused = config.decode.get('fused_heads', True)
  if not isinstance(fused, bool):
    raise UserError(f'config.decode.fused_heads={fused!r}: set True (sequential heads in one library call on the '
                    'skinny kernel) or False (one kernel call per product, as XLA\'s path runs them).')
  return fused


def check_decode(config, workdir: str, model_config) -> list:
  """The blockwise settings of the sweep, one list of decoder.Setting: every k' of config.decode.ks with every
  criterion (chains), then every tree of config.decode.trees with every criterion. UserError for a bad criterion,
  tree or value, or a k' beyond the checkpoint's k, before anything compiles; settings that cannot run (min_block
  above k', a tree without the rank-0 path a min_block forces, sampling on a tree with several roots) are left
  out, logged."""
  dc, model_k = config.decode, model_config.k
  drafter = check_drafter(config)
  if not drafter.reads_heads:  # it drafts without heads: any k' is a chain it can fill
    model_k = max([model_k, *dc.ks])
  # A plain Transformer (k = 1) has no proposal heads: of a blockwise sweep only the k' = 1 settings can run
  # (the rest are left out, logged); ks and criteria are still checked for typos.
  repeated = sorted({k for k in dc.ks if list(dc.ks).count(k) > 1})
  if repeated:
    raise UserError(f'config.decode.ks={tuple(dc.ks)} names k\'={repeated} more than once: each would be decoded and '
                    'timed again. List each k\' once (a flag given twice may have joined two lists).')
  for k in dc.ks:
    if k < 1 or (model_k > 1 and k > model_k):
      raise UserError(f'config.decode.ks contains {k}, but the checkpoint in {workdir} has k={model_k} heads: '
                      f'a sweep can use k\' = 1..{model_k} heads. Drop {k} or train a model with more heads.')
  temperature = dc.temperature
  if temperature < 0:
    raise UserError(f'config.decode.temperature={temperature} must be >= 0 (0: no sampling; 1: the model\'s own '
                    'distribution; below 1 sharper).')
  speculative.check_truncation(dc.sample_top_k, dc.sample_top_p)
  rules = [rules_lib.parse(spec, k=model_k if model_k > 1 else None, temperature=temperature,  # raises
                           top_k=dc.sample_top_k, top_p=dc.sample_top_p) for spec in dc.criteria]
  for field in ('batch_sizes',):
    if any(b < 1 for b in dc[field]):
      raise UserError(f'config.decode.{field}={tuple(dc[field])}: batch sizes must be at least 1.')
  if dc.max_len < 1:
    raise UserError(f'config.decode.max_len={dc.max_len} must be at least 1.')
  if dc.max_src_len < 1:
    raise UserError(f'config.decode.max_src_len={dc.max_src_len} must be at least 1 (longer sources are cut).')
  if dc.timing_repeats < 1 or dc.timing_examples < 0:
    raise UserError(f'config.decode.timing_repeats={dc.timing_repeats} must be >= 1 and '
                    f'config.decode.timing_examples={dc.timing_examples} >= 0 (0 = time every example).')
  if dc.batch1_examples < 0:
    raise UserError(f'config.decode.batch1_examples={dc.batch1_examples} must be >= 0 (0 = every example).')
  if (dc.sample_top_k or dc.sample_top_p < 1.0) and temperature <= 0:
    raise UserError(f'config.decode.sample_top_k={dc.sample_top_k} / sample_top_p={dc.sample_top_p} truncate '
                    'sampling, but config.decode.temperature is 0 (no sampling): set '
                    '--config.decode.temperature=T > 0 or leave them at 0 / 1.')
  sampling = [str(rule) for rule in rules if rule.draws]
  if sampling and temperature <= 0:
    raise UserError(f'config.decode.criteria contains {sampling[0]!r}, which samples at config.decode.temperature, '
                    'but the temperature is 0: set --config.decode.temperature=T > 0 (1: the model\'s own '
                    'distribution) or drop the criterion.')
  draft_vocab.check(config.model.draft_vocab, model_config.vocab_size)
  trees_ = _check_trees(config, workdir, model_config)
  pipeline.check_source(config.data, need_splits=tuple(dc.splits))
  check_workdir(workdir)
  settings, why_not = [], {}
  chains = [(str(k), decoding.chain(k), 'chain') for k in dc.ks if k <= model_k]
  for what, tree, spec in chains + trees_:
    for rule in rules:
      try:
        rule.check(tree)
      except UserError as e:  # e.g. min_block above k', or a forced path the tree lacks: left out
        logging.info('Left out of the sweep: %s with %s on %s (%s).', rule, spec, what, e)
        why_not.setdefault(spec, e)
        continue
      drafter.check(tree, rule)  # raises: a rule it cannot draft for is the user's to drop
      settings.append(decoder_lib.Setting(rule=rule, tree=tree, spec=spec, drafter=drafter))
  # A tree the user names that no criterion can decode would be left out whole: say so instead.
  for spec in {spec for _, _, spec in trees_} - {s.spec for s in settings}:
    raise UserError(f'config.decode.trees names {spec!r}, but no criterion of config.decode.criteria='
                    f'{tuple(dc.criteria)} can decode it: {why_not[spec]}')
  if model_k == 1 and len(settings) < len(dc.ks) * len(rules):
    logging.info('The model in %s has k=1 (no proposal heads): the sweep keeps only k\'=1 (greedy is always '
                 'decoded).', workdir)
  return settings


def check_drafter(config):
  """config.decode.drafter as the sweep's drafter (bpd/drafters.py): decoding.HEADS for the model's heads. UserError
  for an unknown name and for images; the trees and rules it can draft for, it says itself (its `check`, per
  setting)."""
  spec = config.decode.get('drafter', 'heads')
  drafter = drafters.parse(spec)  # raises
  if drafter.reads_heads:
    return drafter
  if config.data.source == 'images':
    raise UserError(f'config.decode.drafter={spec!r}: drafters other than the heads run on translation (they look '
                    'up source and output ids); the super-resolution sweep drafts with the heads. Set '
                    'config.decode.drafter=heads.')
  return drafter


def _check_trees(config, workdir: str, model_config) -> list:
  """(what, tree, spec) for every spec of config.decode.trees (bpd/trees.py) at every k' >= 2 of config.decode.ks
  (a tree of k' heads: depth k'; 'chain' is the ks chains themselves); UserError for a bad spec, for a missing
  WORKDIR/trees.json, for images, for a plain model or for static trees with sequential heads (dynamic:N runs). A spec that cannot
  be built with k' heads (more nodes than k' heads offer) is left out at that k', logged."""
  specs, model_k = tuple(config.decode.trees), model_config.k
  if not specs:
    return []
  if config.data.source == 'images':
    raise UserError(f'config.decode.trees={specs}: tree decoding is implemented for translation only; the '
                    'super-resolution sweep (bpd/evaluate_images.py) decodes chains. Set config.decode.trees=().')
  if model_k < 2:
    raise UserError(f'config.decode.trees={specs}: the model in {workdir} has k=1, no proposal heads to build a tree '
                    'from. Train heads first (config.train.regime=frozen or finetune).')
  ks = [k for k in config.decode.ks if 2 <= k <= model_k]
  if not ks and any(spec != 'chain' for spec in specs):
    raise UserError(f'config.decode.trees={specs} needs a k\' of at least 2 in config.decode.ks={tuple(config.decode.ks)} '
                    f'(a tree of k\' heads; the model has k={model_k}): add one, e.g. '
                    f'--config.decode.ks=({min(4, model_k)},), or set config.decode.trees=().')
  out = []
  for spec in specs:
    tree = trees.parse_tree_spec(spec, model_k, workdir, model_config.vocab_size)  # raises for a bad spec
    if not tree_runs_on(tree, model_config.head_type):
      raise UserError(f'config.decode.trees={specs}, and the model in {workdir} has sequential heads. '
                      + model_lib.SEQUENTIAL_TREES)
    if spec == 'chain':
      continue  # the chains of config.decode.ks
    built = []
    for k in ks:
      try:
        built.append((f'{spec} k={k}', trees.parse_tree_spec(spec, k, workdir, model_config.vocab_size), spec))
      except UserError as e:
        logging.info('Left out of the sweep: tree %s with k\'=%d heads (%s).', spec, k, e)
        if not built and k == ks[-1]:  # at no k' of the sweep: the tree would not be decoded at all
          raise UserError(f'config.decode.trees names {spec!r}, which cannot be built at any k\' of '
                          f'config.decode.ks={tuple(config.decode.ks)}: {e}') from None
    out += built
  return out


def tree_runs_on(tree, head_type: str) -> bool:
  """Whether the model's heads can draft this tree: sequential heads draft chains and context-aware trees (each
  parent expanded from its own token), not static trees (one choice list per depth)."""
  return head_type != 'sequential' or tree.per_row or tree.is_chain


def check_distill(config, workdir: str) -> None:
  # First, before the checkpoint or the data are looked at: the other checks would only say what is missing.
  if config.data.source == 'images':
    raise UserError(
        '--mode=distill is sequence-level knowledge distillation for translation (paper §6.2: the teacher\'s '
        'beam-search translations replace the training targets); it is not defined for super-resolution '
        '(config.data.source=images). For images, train the heads on the ground truth (--mode=train with '
        'config.train.regime=frozen or finetune and config.train.init_from=BASE_WORKDIR) and decode with the '
        'approximate criterion distance:2 (--mode=decode; the paper\'s Table 2).')
  checkpoint.read_model_config(workdir)
  if config.distill.beam_size < 1:
    raise UserError(f'config.distill.beam_size={config.distill.beam_size} must be at least 1.')
  out_dir = pipeline.corpus_dir(config.distill, workdir)
  made, wanted = pipeline.read_manifest(out_dir), pipeline.distill_settings(config.distill, workdir)
  if made is not None and any(made.get(key) != value for key, value in wanted.items()):
    differ = ', '.join(f'{key} {made.get(key)!r} there, {value!r} now' for key, value in wanted.items()
                       if made.get(key) != value)
    raise UserError(f'{out_dir} holds a distilled corpus made with other settings ({differ}): its parts would be '
                    'mixed with the new ones. Distil into another folder with --config.distill.out_dir=..., or '
                    'remove that folder.')
  data = config.data.copy_and_resolve_references()
  data.distilled_from = ''  # the teacher translates the original training sources
  pipeline.check_source(data, need_splits=(data.train_split,))
  check_workdir(workdir)
