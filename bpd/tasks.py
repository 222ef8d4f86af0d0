"""The two tasks, chosen once from the config: translation (paper §7.1) and super-resolution (paper §7.2).

A Task is a plain record of everything that differs between them: vocabulary, EOS, output lengths, training
data, the quick evaluation during training, the quality metric (BLEU or PSNR) and what the decode sweep writes
(text lines, or image arrays and a grid). bpd/train.py and the one decode sweep (bpd/evaluate.py) call these
functions and never ask which task they run; `for_config` is the only place that looks.

To add a task, write its functions and one more Task below (the style of big_vision, whose trainer takes its
evaluators by config name).
"""

import dataclasses
import io
import os
from typing import Any, Callable

from absl import logging
import jax
import numpy as np
import sacrebleu

from bpd import evaluate_images
from bpd import files
from bpd import report
from bpd import sharding
from bpd.data import batching
from bpd.data import images
from bpd.data import pipeline
from bpd.data import tokenizer as tokenizer_lib
from bpd.errors import UserError

EVAL_BLEU_EXAMPLES = 256  # a quick greedy BLEU during training; the full one is --mode=decode


@dataclasses.dataclass(frozen=True)
class Task:
  """What a task supplies. `outputs` are what the sweep scores and writes: detokenized sentences (translation),
  or uint8 images [N, 32, 32, 3] (super-resolution); `references` are the targets in the same form."""
  name: str
  quality_metric: str  # results' quality_metric and the quick evaluation's key greedy_<metric>: 'bleu' | 'psnr'
  eos_id: int  # decoding stops at it; evaluate_images.NO_EOS never matches, so images run to max_len
  columns: list  # results.md columns: [(record key, title, format)]
  agreement_in_quick_eval: bool  # per-head agreement and exact block size in training's evaluation (k > 1)
  tokenizer_for_training: Callable[[Any, str], Any]  # (config, workdir) -> Tokenizer, or None (pixel ids)
  tokenizer_for_decoding: Callable[[str], Any]  # (workdir) -> Tokenizer, or None
  vocab_size: Callable[[Any], int]  # (tokenizer) -> the model's vocabulary
  training_decode_len: Callable[[Any], int]  # (config) -> max output length of the quick evaluation's decodes
  # (config, tokenizer) -> (batch_for_step, eval_batches, eval_src_ids, eval_references)
  training_data: Callable[[Any, Any], tuple]
  quick_eval_examples: Callable[[Any], int]  # (config) -> examples greedy-decoded in training's evaluation
  check_decode: Callable[[Any], None]  # (config) -> None; UserError for a setting the task cannot decode
  # (config, split, tokenizer) -> (src_ids: one id row per example, references, inputs: sources as data)
  decode_examples: Callable[[Any, str, Any], tuple]
  outputs: Callable[[Any, list], Any]  # (tokenizer, [tokens_L per example]) -> outputs
  # (outputs, references, greedy_outputs) -> {'quality': float, ...task-specific fields of the record}
  scores: Callable[[Any, Any, Any], dict]
  baselines: Callable[[Any, Any], dict]  # (inputs, references) -> fields every record of a split carries
  write_outputs: Callable[[str, Any], None]  # (path without extension, outputs): one file per setting
  # (path_png, inputs, references, {setting name: outputs}, examples) -> None: one overview per split (or none)
  write_grid: Callable[[str, Any, Any, dict, int], None]
  model_options: Callable[[Any], dict]  # (config) -> the ModelConfig fields the task sets (image sides, ...)
  # (config, tokenizer) -> int [V]: how often each id occurs in the training targets (bpd/draft_vocab.py)
  target_counts: Callable[[Any, Any], np.ndarray]


def for_config(config) -> Task:
  """The task of a config: super-resolution for config.data.source=images, translation for every text source."""
  return SUPERRES if config.data.source == 'images' else TRANSLATION


# Model options of images only, and what to say when one is set where it cannot work.
_IMAGE_OPTIONS = {
    'colocated_input': 'config.model.colocated_input=True needs config.data.source=images and '
                       'config.model.image_positions=True (it maps each output sub-pixel to the input sub-pixel '
                       'that covers it, in the 2D image layout).',
    'output_prior_sigma': 'config.model.output_prior_sigma={} centres each output on the bicubic enlargement of '
                          'the input image: use it with config.data.source=images and '
                          'config.model.image_positions=True (configs/celeba_sr.py), or set it to 0.',
    'ordinal_pixel_init': 'config.model.ordinal_pixel_init=True initializes the 256 intensity embeddings of '
                          'images: use it with config.data.source=images only.',
}


def _refuse_image_options(config, names) -> None:
  for name in names:
    if config.model[name]:
      raise UserError(_IMAGE_OPTIONS[name].format(config.model[name]))


# -- translation -----------------------------------------------------------------------------------------------

def bleu(hypotheses, references) -> float:
  """Corpus BLEU with sacrebleu's defaults (13a tokenization) on detokenized text (signature: BLEU_SIGNATURE)."""
  return sacrebleu.corpus_bleu(list(hypotheses), [list(references)]).score


# sacreBLEU's signature of `bleu` (reference count, case, evaluation, tokenization, smoothing, version): records
# carry it so that a BLEU is compared only with BLEUs of the same signature.
def _bleu_signature() -> str:
  metric = sacrebleu.BLEU()
  metric.corpus_score(['a'], [['a']])  # the signature names the reference count, known once a corpus is scored
  return str(metric.get_signature())


BLEU_SIGNATURE = _bleu_signature()


def write_lines(path, lines):
  """Writes one line per item, atomically; on process 0 only (the others hold the same lines)."""
  if jax.process_index() != 0:
    return
  files.write_atomic(path, ''.join(line.replace('\n', ' ') + '\n' for line in lines))


def _text_tokenizer_for_training(config, workdir):
  # Process 0 trains (or copies) the tokenizer; the others wait for the file, then load it.
  return sharding.process_zero_first(
      lambda: pipeline.tokenizer_for(workdir, config.data, config.seed, reuse_from=config.train.init_from),
      'tokenizer')


def _text_training_data(config, tokenizer):
  dc, tc = config.data, config.train
  src, tgt = pipeline.load_split(dc, dc.train_split, config.seed)
  src_ids, tgt_ids, stats = batching.encode_pairs(tokenizer, src, tgt, dc.max_len)
  logging.info('Training pairs: %s', stats)
  batch_for_step = batching.make_train_batch_fn(src_ids, tgt_ids, tc.batch_size, dc.bucket_lengths, config.seed)
  eval_src, eval_tgt = pipeline.load_split(dc, dc.eval_split, config.seed)
  if dc.max_eval_examples:
    eval_src, eval_tgt = eval_src[:dc.max_eval_examples], eval_tgt[:dc.max_eval_examples]
  e_src_ids, e_tgt_ids, _ = batching.encode_pairs(tokenizer, eval_src, eval_tgt, dc.max_len, truncate=True)
  eval_batches = batching.eval_batches(e_src_ids, e_tgt_ids, tc.batch_size, dc.bucket_lengths)
  return batch_for_step, eval_batches, e_src_ids, eval_tgt


def _text_target_counts(config, tokenizer):
  """Counts of each id in the training targets as training reads them (encode_pairs: EOS included, too-long pairs
  dropped; the distilled targets with data.distilled_from)."""
  dc = config.data
  src, tgt = pipeline.load_split(dc, dc.train_split, config.seed)
  _, tgt_ids, _ = batching.encode_pairs(tokenizer, src, tgt, dc.max_len)
  return np.bincount(np.concatenate(tgt_ids), minlength=tokenizer.vocab_size)


def _text_decode_examples(config, split, tokenizer):
  src, references = pipeline.load_split(config.data, split, config.seed)
  if config.decode.max_examples:
    src, references = src[:config.decode.max_examples], references[:config.decode.max_examples]
  # Sources get their own length limit: out-of-domain splits (newstest) are longer than training data.
  src_ids, _, _ = batching.encode_pairs(tokenizer, src, references, config.decode.max_src_len, truncate=True)
  return src_ids, references, src


TRANSLATION = Task(
    name='translation',
    quality_metric='bleu',
    eos_id=tokenizer_lib.EOS_ID,
    columns=report.COLUMNS,
    agreement_in_quick_eval=True,
    tokenizer_for_training=_text_tokenizer_for_training,
    tokenizer_for_decoding=lambda workdir: tokenizer_lib.load(os.path.join(workdir, tokenizer_lib.MODEL_NAME)),
    vocab_size=lambda tokenizer: tokenizer.vocab_size,
    training_decode_len=lambda config: config.data.max_len,
    training_data=_text_training_data,
    quick_eval_examples=lambda config: EVAL_BLEU_EXAMPLES,
    check_decode=lambda config: None,
    decode_examples=_text_decode_examples,
    outputs=lambda tokenizer, tokens: [tokenizer.decode(t) for t in tokens],
    scores=lambda hypotheses, references, greedy_hypotheses: {'quality': bleu(hypotheses, references),
                                                               'bleu_signature': BLEU_SIGNATURE},
    baselines=lambda sources, references: {},
    write_outputs=lambda path, hypotheses: write_lines(path + '.txt', hypotheses),
    write_grid=lambda path_png, sources, references, outputs_by_name, examples: None,  # the .txt files are the outputs
    # Text has 1D positions (config.model.image_positions is ignored) and none of the image options.
    model_options=lambda config: _refuse_image_options(config, _IMAGE_OPTIONS) or {},
    target_counts=_text_target_counts,
)


# -- super-resolution (bpd/evaluate_images.py has the image-side helpers) ----------------------------------------

def _image_training_data(config, tokenizer):
  """Sources [N, 192] and targets [N, 3072] pixel ids; the quick evaluation's references are the 32x32 images."""
  del tokenizer  # pixel ids
  dc, tc = config.data, config.train
  src_NxS, tgt_NxT = pipeline.image_tokens(*pipeline.load_image_split(dc, dc.train_split))
  src_NxS, tgt_NxT = src_NxS.astype(np.uint16), tgt_NxT.astype(np.uint16)  # ids < 259: half the memory
  batch_for_step = batching.make_fixed_train_batch_fn(src_NxS, tgt_NxT, tc.batch_size, config.seed)
  eval_lowres, eval_highres = pipeline.load_image_split(dc, dc.eval_split, dc.max_eval_examples or None)
  eval_batches = batching.fixed_eval_batches(*pipeline.image_tokens(eval_lowres, eval_highres), tc.batch_size)
  return batch_for_step, eval_batches, list(images.image_to_tokens(eval_lowres)), eval_highres


def _image_decode_examples(config, split, tokenizer):
  del tokenizer
  lowres_Nx8x8x3, highres_Nx32x32x3 = pipeline.load_image_split(config.data, split, config.decode.max_examples or None)
  return list(images.image_to_tokens(lowres_Nx8x8x3)), highres_Nx32x32x3, lowres_Nx8x8x3


def _image_model_options(config) -> dict:
  """ModelConfig fields for 2D image positions (config.model.image_positions), the co-located input embedding
  and the output prior (config.model.colocated_input, output_prior_sigma: both need the image sides, so 2D
  positions too) and the ordinal initialization of the intensity embeddings (config.model.ordinal_pixel_init)."""
  m = config.model
  ordinal = {'ordinal_pixel_init': True} if m.ordinal_pixel_init else {}
  if not m.image_positions:
    _refuse_image_options(config, ('colocated_input', 'output_prior_sigma'))
    return ordinal
  prior = {'output_prior_sigma': float(m.output_prior_sigma)} if m.output_prior_sigma else {}
  return dict(image_side=images.HIGHRES, image_input_side=images.LOWRES,
              colocated_input=bool(m.colocated_input), **prior, **ordinal)


def _image_target_counts(config, tokenizer):
  """Counts of each pixel id in the training targets: the 256 intensities of the 32x32 training images (the ids
  below images.PIXEL_OFFSET never occur in a target)."""
  del tokenizer
  _, highres_Nx32x32x3 = pipeline.load_image_split(config.data, config.data.train_split)
  counts_V = np.zeros(images.IMAGE_VOCAB_SIZE, np.int64)
  counts_V[images.PIXEL_OFFSET:] = np.bincount(np.asarray(highres_Nx32x32x3, np.uint8).reshape(-1), minlength=256)
  return counts_V


def _save_images(path, images_Nx32x32x3):
  if jax.process_index() == 0:
    buffer = io.BytesIO()
    np.save(buffer, images_Nx32x32x3)
    files.write_atomic(path + '.npy', buffer.getvalue())


SUPERRES = Task(
    name='superres',
    quality_metric='psnr',
    eos_id=evaluate_images.NO_EOS,
    columns=evaluate_images.COLUMNS,
    # Agreement would need greedy and blockwise decodes of 3072 steps per image during training (slow on a CPU).
    agreement_in_quick_eval=False,
    tokenizer_for_training=lambda config, workdir: None,
    tokenizer_for_decoding=lambda workdir: None,
    vocab_size=lambda tokenizer: images.IMAGE_VOCAB_SIZE,  # pixel ids 3..258; 0..2 as in text (pad, eos, bos)
    training_decode_len=lambda config: config.decode.max_len,
    training_data=_image_training_data,
    quick_eval_examples=lambda config: config.train.eval_psnr_examples,
    check_decode=evaluate_images.check_image_decode,
    decode_examples=_image_decode_examples,
    outputs=lambda tokenizer, tokens: evaluate_images.outputs_to_images(np.stack(tokens)),
    scores=evaluate_images.scores,
    baselines=evaluate_images.baselines,
    write_outputs=_save_images,
    write_grid=evaluate_images.save_grid,
    model_options=_image_model_options,
    target_counts=_image_target_counts,
)
