"""Defaults shared by every config, and the parser of a config file's argument.

A config file declares the arguments it accepts (`Arg`), reads them with `parse_args` and calls `defaults()`,
whose fields it overrides. `defaults()` lists every field that code reads and is locked, so that a misspelt
field in a config file fails where it is written instead of adding a field nothing reads.

Fields (the command line reaches each as --config.FIELD=VALUE):
  seed                 one seed for initialization, data order and dropout.
  checkpoint_step      the checkpoint step to read: --workdir's for decode and distill, config.train.init_from's for
                       frozen/finetune training. 0 = the newest (training always resumes from its newest readable).
  k                    number of heads of the model (1 = plain Transformer; paper: 1..10).
  model_axis_size      mesh axis that shards the vocabulary and feed-forward weights (1: pure data parallel).
  model.size           tiny | small | base | big | image_tiny | image_small | image_medium
                       (bpd/model.py SIZES).
  model.attention_block  decoder self-attention: 0 = full causal, W > 0 = local blocks of W (images).
  model.image_positions  images: encode positions as 2D coordinates shared by input and output (else 1D).
  model.colocated_input  images (with image_positions): add the co-located input sub-pixel's embedding to each
                       decoder position (a deviation from the paper; bpd/model.py Transformer._colocated).
  model.output_prior_sigma  images: > 0 adds to every head's logits a Gaussian log-prior of this width (intensity
                       levels) around the bicubic enlargement of the input. 0 = off. Not in the paper:
                       README, "Output prior".
  model.head_type      independent (the paper's proposal heads) | sequential (head i + 1 also sees the token
                       proposed for the position before, teacher-forced in training; Hydra, Ankner et al. 2024;
                       chains and context-aware dynamic:N trees, not static trees: bpd/model.py ModelConfig.head_type).
  model.draft_vocab    R > 0: the proposal heads draft from the R most frequent training target tokens only (their
                       projection reads R rows, not V; verification keeps the whole vocabulary, so exact decoding
                       stays greedy's); 0 = off. Counted at training, kept in model.json; at decode time this
                       field decides (bpd/draft_vocab.py). Not in the paper: EAGLE-3, FR-Spec.
  model.ordinal_pixel_init  images: initialize the 256 intensity embeddings as sinusoids of the intensity, so that
                       nearby intensities start out alike (not in the paper; layers.ordinal_pixel_embedding_init).
  data.source          synthetic | text | tfds (translation) | images (CelebA 8x8 -> 32x32).
  data.dir             folder with {split}.{src_lang} / {split}.{tgt_lang} (source=text), or with
                       {split}.npy / {split}_8x8.npy (source=images, image_source=npy).
  data.image_source    npy (arrays in data.dir) | tfds (TFDS celeb_a in data.tfds_data_dir); source=images.
  data.tfds_data_dir   TFDS data dir (source=tfds); None = TFDS's default.
  data.vocab_size      SentencePiece vocabulary, shared by source and target.
  data.max_len         longest training example in tokens (EOS included); longer pairs are dropped.
  data.bucket_lengths  padded lengths of training batches (the last is max_len): fewer wasted FLOPs.
  data.distilled_from  workdir of a `--mode=distill` run, or the corpus folder it wrote (distill.out_dir): train on
                       its distilled targets (paper §6.2).
  train.regime         base (k=1 from scratch) | frozen (train only the heads) | finetune (train all).
  train.init_from      workdir of the base model that frozen/finetune start from.
  train.head_loss      mean (mean of the k heads' losses) | random (one random head per step, t2t style).
  train.head1_weight   weight of head 1 against the proposal heads in the mean loss (1 = plain mean).
  train.head_learning_rate  peak rate of the new proposal heads (frozen, finetune; 0 = train.learning_rate):
                       fresh heads learn fast at a high rate that would wreck the trained base (train.py).
  train.input_noise    images: Gaussian noise (std in intensity levels) on the decoder's input pixels in training,
                       targets clean (not in the paper; bpd/train.py noisy_pixel_inputs). 0 = off.
  decode.*             the sweep of `--mode=decode`: heads k' <= k, criteria, trees, batch sizes, splits.
  decode.temperature   > 0 adds a row sampled at this temperature (seed decode.seed) beside greedy and the blockwise
                       rows, which stay argmax-based; the criterion 'speculative' in decode.criteria samples at it
                       blockwise, exactly (bpd/speculative.py; 'speculative:block' with block verification of
                       the chain); 0 = greedy only.
  decode.sample_top_k, decode.sample_top_p  truncate the distribution both samplers draw from (the top_k most
                       likely tokens, then the top_p nucleus; 0 and 1 = off; bpd/speculative.py sampling_logits).
  decode.drafter       what proposes the blockwise rows' tokens: heads (default) | prompt_lookup[:N] (n-gram lookup
                       in the source and the output so far: bpd/prompt_lookup.py; chains at any k', no heads needed).
  decode.grid_examples images: how many validation images the figure of outputs shows (decode/SPLIT.grid.png).
  distill.*            `--mode=distill`: the teacher's beam (beam_size, alpha: the length penalty ((5 + len) / 6)^alpha
                       of flax's wmt example), max_len, batch_size, and out_dir (the corpus folder; '' = WORKDIR/distill).
"""

import dataclasses
from typing import Any

import ml_collections

from bpd.errors import UserError


@dataclasses.dataclass(frozen=True)
class Arg:
  """One key of a config file's argument ('configs/demo.py:k=2,regime=frozen').

  The default's type is the key's type (bool, int, float or str). A bool key may be given bare (`cpu`) or as
  cpu=true|false|1|0; another key given bare takes `bare` (None: it needs a value). `choices` limits a str key.
  """
  default: Any
  help: str
  choices: tuple[str, ...] = ()
  bare: Any = None


_TRUE, _FALSE = ('1', 'true', 'yes'), ('0', 'false', 'no')


_KIND = {bool: 'a boolean (true|false|1|0)', int: 'an integer', float: 'a number', str: 'text'}


def _usage(config_file: str, accepted: dict[str, Arg]) -> str:
  """One line: every accepted key with its type and default (the Arg help texts are for the config's reader)."""
  def describe(name, a):
    if isinstance(a.default, bool):
      return f'{name}[=true|false] (bare: true, default {str(a.default).lower()})'
    kind = '|'.join(a.choices) if a.choices else type(a.default).__name__.upper()
    optional = f'{name}[={kind}] (bare: {a.bare}' if a.bare is not None else f'{name}={kind} ('
    return f'{optional}{", " if a.bare is not None else ""}default {a.default})'
  return f'{config_file} accepts, comma-separated: {", ".join(describe(n, a) for n, a in accepted.items())}.'


def _value(config_file: str, accepted: dict[str, Arg], name: str, text: str | None):
  """The typed value of one key; text None: the key was given bare."""
  a = accepted[name]
  kind = type(a.default)
  if text is None:
    if kind is bool:
      return True
    if a.bare is None:
      raise UserError(f'{config_file}:{name} needs a value ({name}=...). {_usage(config_file, accepted)}')
    return a.bare
  try:
    if kind is bool:
      if text.lower() not in _TRUE + _FALSE:
        raise ValueError(text)
      return text.lower() in _TRUE
    value = kind(text)
  except ValueError:
    raise UserError(f'{config_file}:{name}={text}: not {_KIND[kind]}. '
                    f'{_usage(config_file, accepted)}') from None
  if a.choices and value not in a.choices:
    raise UserError(f'{config_file}:{name}={text}: not one of {"|".join(a.choices)}. '
                    f'{_usage(config_file, accepted)}')
  return value


def parse_args(arg: str | None, accepted: dict[str, Arg], config_file: str) -> dict[str, Any]:
  """Every accepted key's value, from the text after the config file's colon ('k=2,cpu'; None: all defaults).

  An unknown key, a repeated key or a value of the wrong type is a UserError naming the accepted keys: it is
  raised while the command line is read, before anything is built.
  """
  values, given = {name: a.default for name, a in accepted.items()}, set()
  for piece in (arg or '').split(','):
    if not piece.strip():
      continue
    name, sep, text = piece.strip().partition('=')
    if name not in accepted:
      raise UserError(f'{config_file}: unknown argument {name!r}. {_usage(config_file, accepted)}')
    if name in given:
      raise UserError(f'{config_file}: argument {name!r} given twice in {arg!r}.')
    given.add(name)
    values[name] = _value(config_file, accepted, name, text if sep else None)
  return values



def defaults() -> ml_collections.ConfigDict:
  c = ml_collections.ConfigDict()
  c.seed = 0
  c.checkpoint_step = 0  # 0: the newest; else that step (e.g. when the newest cannot be read)
  c.k = 8
  c.model_axis_size = 1  # devices per model shard (bpd/sharding.py); the rest of the mesh is data parallel

  c.model = ml_collections.ConfigDict()
  c.model.size = 'small'
  c.model.dropout_rate = 0.1
  c.model.dtype = 'float32'
  c.model.attention_block = 0  # 0: full causal decoder self-attention; W > 0: local 1D blocks (images)
  c.model.image_positions = False  # images: 2D (row, column, channel) position encodings (Image Transformer)
  c.model.colocated_input = False  # images: co-located input sub-pixel embedding at each decoder position (not paper)
  c.model.ordinal_pixel_init = False  # images: nearby intensities start with nearby embeddings (not paper)
  c.model.output_prior_sigma = 0.0  # images: > 0, width of a log-prior around the bicubic input (not paper)
  c.model.head_type = 'independent'  # the paper's heads; 'sequential': each head sees the previous proposal (Hydra)
  c.model.draft_vocab = 0  # R > 0: heads draft from the R most frequent target tokens (bpd/draft_vocab.py); 0 = off

  c.data = ml_collections.ConfigDict()
  c.data.source = 'synthetic'
  c.data.dir = ''
  c.data.tfds_data_dir = ml_collections.FieldReference(None, field_type=str)
  c.data.image_source = 'npy'  # source=images: 'npy' (data.dir) or 'tfds' (celeb_a)
  c.data.src_lang = 'en'
  c.data.tgt_lang = 'de'
  c.data.train_split = 'train'
  c.data.eval_split = 'val'  # periodic evaluation during training
  c.data.vocab_size = 8000
  c.data.max_len = 64
  c.data.bucket_lengths = (16, 32, 64)
  c.data.max_eval_examples = 0  # 0 = all
  c.data.distilled_from = ''
  c.data.synthetic_train_size = 20000

  c.train = ml_collections.ConfigDict()
  c.train.regime = 'base'
  c.train.init_from = ''
  c.train.num_steps = 10000
  c.train.batch_size = 64
  c.train.learning_rate = 1e-3  # peak, after linear warmup; then rsqrt decay (Vaswani et al. §5.3)
  c.train.warmup_steps = 1000
  c.train.label_smoothing = 0.1
  c.train.head_loss = 'mean'
  c.train.head1_weight = 1.0  # weight of head 1 in the mean loss (1: the paper's plain mean; see train.py)
  c.train.head_learning_rate = 0.0  # peak rate of the proposal heads (frozen, finetune); 0: train.learning_rate
  c.train.checkpoint_every = 500
  c.train.keep_checkpoints = 3
  c.train.eval_every = 1000  # 0: never
  c.train.log_every = 100
  c.train.input_noise = 0.0  # images: std (intensity levels) of noise on the decoder's input pixels (not paper)
  c.train.eval_psnr_examples = 0  # source=images: greedy-decode this many eval images for a PSNR (slow on CPU)

  c.decode = ml_collections.ConfigDict()
  c.decode.splits = ('val',)
  c.decode.ks = (1, 2, 4, 6, 8, 10)  # heads used, each <= k; greedy is always decoded as the baseline
  c.decode.criteria = ('exact', 'top_k:2')
  # Tree decoding (bpd/trees.py; translation only): 'comb:R', 'dense:R', 'nodes:N' (from WORKDIR/trees.json,
  # python -m experiments.diagnostics --mode=choose_tree), 'dynamic:N' (a context-aware tree of N nodes per row and
  # iteration), each built for every k' >= 2 of decode.ks, with every criterion ('chain': the ks chains).
  # () = chains only (paper).
  c.decode.trees = ()
  # What proposes the chains' tokens (bpd/drafters.py): 'heads' (the model's proposal heads, the paper) |
  # 'prompt_lookup' / 'prompt_lookup:N' (the continuation of the last N..1 tokens' latest earlier occurrence in the
  # source and the output; no heads needed, so any k' runs, even on a k=1 model; chains only).
  c.decode.drafter = 'heads'
  c.decode.batch_sizes = (32,)
  c.decode.max_len = 64  # longest output, EOS included
  c.decode.max_examples = 0  # 0 = all
  c.decode.max_src_len = 256  # longer sources are cut (logged); decoding has its own limit, not data.max_len
  c.decode.timing_examples = 0  # time greedy vs blockwise on the first N examples (0 = all)
  c.decode.batch1_examples = 0  # batch size 1 decodes only the first N examples (0 = all)
  c.decode.matmul_precision = ''  # '' (the backend's default) | 'highest' (float32 matmuls on GPU/TPU)
  # The weight matmuls of decoding (bpd/matmul.py): 'auto' (bpd's skinny kernel on CPU where it builds, else XLA) |
  # 'xla' | 'skinny' (CPU, one device; an error where it cannot be built). Parameters are the same either way.
  c.decode.matmul_kernel = 'auto'
  # The weights of proposal heads 2..k and their projection as the skinny kernel reads them: 'int8' (a quarter of
  # the bytes, a float32 scale per column, products and sums in float32) | 'float16' (half) | 'float32'. Head 1,
  # which verifies, stays float32 either way, so exact decoding stays greedy's; only proposals can differ.
  # XLA's matmuls read the float32 parameters whatever this says. Not in the paper.
  c.decode.head_weights = 'int8'
  # Sequential heads 2..k' on the skinny kernel: True runs them in one library call per iteration (the same
  # products; its layer norm may round a last bit differently from XLA's, proposals only) | False: one kernel
  # call per product, with XLA's fusions between them.
  c.decode.fused_heads = True
  c.decode.timing_repeats = 3  # alternate greedy/blockwise runs this many times; medians give the speedup
  c.decode.temperature = 0.0  # > 0 also decodes by sampling at this temperature (a row of its own; 'speculative')
  c.decode.seed = 0  # the sampled row's random seed (same seed and batch size: same samples)
  c.decode.sample_top_k = 0  # > 0: sample among the most likely tokens only (ancestral and speculative rows)
  c.decode.sample_top_p = 1.0  # < 1: sample from the nucleus of this probability (after sample_top_k)
  c.decode.grid_examples = 8  # images: validation images in the figure of outputs (decode/SPLIT.grid.png)

  c.distill = ml_collections.ConfigDict()
  c.distill.beam_size = 4
  c.distill.alpha = 0.6
  c.distill.batch_size = 32
  c.distill.max_len = 64
  c.distill.out_dir = ''  # the corpus folder; '' = WORKDIR/distill. One folder per teacher and beam setting
  c.lock()  # a config file's misspelt field raises here instead of adding a field that nothing reads
  return c


def override(config: ml_collections.ConfigDict, **fields) -> ml_collections.ConfigDict:
  """A copy of `config` with dotted fields replaced: override(c, **{'train.num_steps': 10, 'k': 4})."""
  c = config.copy_and_resolve_references()
  for key, value in fields.items():
    target = c
    *path, last = key.split('.')
    for part in path:
      target = target[part]
    target[last] = value
  return c
