"""Training and decoding data: read a split from the configured source (translation text, or images).

Sources (config.data.source):
  synthetic  the embedded rule-based corpus (bpd/data/synthetic.py); splits train / val / test.
  text       parallel files {dir}/{split}.{src_lang} and {dir}/{split}.{tgt_lang}, e.g. Multi30k.
  tfds       WMT14 En->De through TFDS (bpd/data/wmt14.py); splits train / validation / test.
  images     CelebA 8x8 -> 32x32 super-resolution (bpd/data/images.py; paper §7.2), from .npy arrays in
             data.dir (data.image_source=npy, e.g. ../shared/data/celeba32: splits train / val) or from TFDS
             celeb_a (image_source=tfds: train / validation / test). No tokenizer: pixel ids, fixed lengths.
With config.data.distilled_from=TEACHER_DIR the training split is TEACHER_DIR/distill/train.* instead
(sequence-level distillation, paper §6.2), written by `--mode=distill`; distilled_from may also name the corpus
folder itself (config.distill.out_dir of that run), which holds train.* and the manifest distill.json.

The SentencePiece model lives in the workdir. A run that starts from another workdir's model (init_from)
or trains on a teacher's distilled corpus takes that workdir's tokenizer, so ids mean the same everywhere.
"""

import json
import os

from absl import logging

from bpd import files
from bpd.data import images
from bpd.data import synthetic
from bpd.data import text_files
from bpd.data import tokenizer as tokenizer_lib
from bpd.data import wmt14
from bpd.errors import UserError

SOURCES = ('synthetic', 'text', 'tfds', 'images')
IMAGE_SOURCES = ('npy', 'tfds')
DISTILL_DIR = 'distill'
MANIFEST = 'distill.json'
DISTILL_CHUNK = 2048  # sentences per part file of a distillation


def corpus_dir(distill_config, workdir: str) -> str:
  """Where --mode=distill of `workdir` writes its corpus: config.distill.out_dir, or WORKDIR/distill."""
  return distill_config.out_dir or os.path.join(workdir, DISTILL_DIR)


def distill_settings(distill_config, workdir: str) -> dict:
  """What makes a distilled corpus (its manifest's fields): the teacher and its beam search."""
  return {'teacher': os.path.abspath(workdir), 'beam_size': distill_config.beam_size,
          'alpha': distill_config.alpha, 'max_len': distill_config.max_len, 'chunk': DISTILL_CHUNK}


def read_manifest(folder: str) -> dict | None:
  """The manifest of a distilled corpus folder, or None where it has none."""
  path = os.path.join(folder, MANIFEST)
  if not os.path.exists(path):
    return None
  with open(path, encoding='utf-8') as f:
    return json.load(f)


def distilled_corpus(distilled_from: str, src_lang: str) -> str:
  """The folder of train.* that config.data.distilled_from names: the folder itself where it holds them (a corpus
  written to config.distill.out_dir), else its distill/ folder (a teacher's workdir)."""
  if os.path.exists(os.path.join(distilled_from, f'train.{src_lang}')):
    return distilled_from
  return os.path.join(distilled_from, DISTILL_DIR)


def check_source(data_config, need_splits=()):
  """Fails fast, before any compile, if the configured data is not there."""
  if data_config.source not in SOURCES:
    raise UserError(f'config.data.source={data_config.source!r} is not one of {SOURCES}.')
  if data_config.source == 'text':
    if not data_config.dir:
      raise UserError('config.data.source=text needs config.data.dir: a folder with train.en / train.de, '
                      'val.en / val.de, ... (e.g. --config.data.dir=../shared/data/multi30k).')
    for split in need_splits:
      text_files.check_split(data_config.dir, split, data_config.src_lang, data_config.tgt_lang)
  if data_config.source == 'tfds':
    for split in need_splits:
      wmt14.prepared_builder(split, data_config.tfds_data_dir)
  if data_config.source == 'images':
    _check_image_source(data_config, need_splits)
  if data_config.distilled_from:
    folder = distilled_corpus(data_config.distilled_from, data_config.src_lang)
    for lang in (data_config.src_lang, data_config.tgt_lang):
      path = os.path.join(folder, f'train.{lang}')
      if not os.path.exists(path):
        raise UserError(f'config.data.distilled_from={data_config.distilled_from!r} has no distilled corpus '
                        f'({path} is missing): name a teacher\'s workdir after `python -m bpd.main --mode=distill '
                        f'--workdir=TEACHER --config=...`, or the corpus folder it wrote (config.distill.out_dir).')


def _check_image_source(data_config, need_splits):
  image_source = data_config.image_source
  if image_source not in IMAGE_SOURCES:
    raise UserError(f'config.data.image_source={image_source!r} is not one of {IMAGE_SOURCES}.')
  if data_config.distilled_from:
    raise UserError('config.data.distilled_from is for translation; images train on their ground truth. '
                    'Set --config.data.distilled_from=.')
  if image_source == 'npy' and not data_config.dir:
    raise UserError('config.data.source=images with image_source=npy needs config.data.dir: a folder with '
                    'train.npy (N,32,32,3) uint8, val.npy, ... (e.g. --config.data.dir=../shared/data/celeba32).')
  for split in need_splits:
    # Reading the arrays checks files, shapes and dtypes (a few MB, well under a second); with TFDS,
    # max_examples=0 checks that the dataset is prepared and the split exists without reading any image.
    load_image_split(data_config, split, max_examples=0)


def load_image_split(data_config, split: str, max_examples: int | None = None):
  """(lowres_Nx8x8x3, highres_Nx32x32x3) uint8 of one image split: all of it, or its first max_examples."""
  if data_config.image_source == 'tfds':
    return images.load_tfds_split(split, data_config.tfds_data_dir, max_examples=max_examples)
  lowres_Nx8x8x3, highres_Nx32x32x3 = images.load_npy_split(data_config.dir, split)
  if max_examples is not None:
    lowres_Nx8x8x3, highres_Nx32x32x3 = lowres_Nx8x8x3[:max_examples], highres_Nx32x32x3[:max_examples]
  return lowres_Nx8x8x3, highres_Nx32x32x3


def image_tokens(lowres_Nx8x8x3, highres_Nx32x32x3):
  """(src_NxS, tgt_NxT) int32 pixel ids: S = 8*8*3 = 192, T = 32*32*3 = 3072. No EOS: every image has
  exactly T sub-pixels, and decoding runs for a fixed length."""
  return images.image_to_tokens(lowres_Nx8x8x3), images.image_to_tokens(highres_Nx32x32x3)


def load_split(data_config, split: str, seed: int = 0) -> tuple[list[str], list[str]]:
  """(source sentences, target sentences) of one split, as text."""
  if split == data_config.train_split and data_config.distilled_from:
    folder = distilled_corpus(data_config.distilled_from, data_config.src_lang)
    src, tgt, _ = text_files.load_split(folder, 'train', data_config.src_lang, data_config.tgt_lang)
    return src, tgt
  if data_config.source == 'synthetic':
    corpus = synthetic.make_corpus(seed, num_train=data_config.synthetic_train_size)
    if split not in corpus:
      raise UserError(f'The synthetic corpus has splits {sorted(corpus)}, not {split!r}.')
    return corpus[split]
  if data_config.source == 'text':
    src, tgt, _ = text_files.load_split(data_config.dir, split, data_config.src_lang, data_config.tgt_lang)
    return src, tgt
  return wmt14.load_split(split, data_config.tfds_data_dir)


def tokenizer_for(workdir: str, data_config, seed: int = 0, reuse_from: str = '') -> tokenizer_lib.Tokenizer:
  """The workdir's SentencePiece model; copied from `reuse_from` or trained on the training split if absent."""
  path = os.path.join(workdir, tokenizer_lib.MODEL_NAME)
  if not os.path.exists(path):
    for other in (reuse_from, data_config.distilled_from):
      other_path = os.path.join(other, tokenizer_lib.MODEL_NAME) if other else ''
      if other_path and os.path.exists(other_path):
        logging.info('Using the tokenizer of %s', other)
        with open(other_path, 'rb') as f:
          files.write_atomic(path, f.read())
        break
  if os.path.exists(path):
    return tokenizer_lib.load(path)
  src, tgt = load_split(data_config, data_config.train_split, seed)
  return tokenizer_lib.train_or_load(workdir, src + tgt, data_config.vocab_size)
