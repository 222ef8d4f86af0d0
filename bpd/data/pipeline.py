"""Translation data for training and decoding: read a split from the configured source, tokenize it.

Sources (config.data.source):
  synthetic  the embedded rule-based corpus (bpd/data/synthetic.py); splits train / val / test.
  text       parallel files {dir}/{split}.{src_lang} and {dir}/{split}.{tgt_lang}, e.g. Multi30k.
  tfds       WMT14 En->De through TFDS (bpd/data/wmt14.py); splits train / validation / test.
With config.data.distilled_from=TEACHER_DIR the training split is TEACHER_DIR/distill/train.* instead
(sequence-level distillation, paper §6.2), written by `--mode=distill`.

The SentencePiece model lives in the workdir. A run that starts from another workdir's model (init_from)
or trains on a teacher's distilled corpus takes that workdir's tokenizer, so ids mean the same everywhere.
"""

import os
import shutil

from absl import logging

from bpd.data import synthetic
from bpd.data import text_files
from bpd.data import tokenizer as tokenizer_lib
from bpd.data import wmt14
from bpd.errors import UserError

SOURCES = ('synthetic', 'text', 'tfds')
DISTILL_DIR = 'distill'


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
  if data_config.distilled_from:
    for lang in (data_config.src_lang, data_config.tgt_lang):
      path = os.path.join(data_config.distilled_from, DISTILL_DIR, f'train.{lang}')
      if not os.path.exists(path):
        raise UserError(f'config.data.distilled_from={data_config.distilled_from!r} has no distilled corpus '
                        f'({path} is missing). Run `python -m bpd.main --mode=distill '
                        f'--workdir={data_config.distilled_from} --config=...` first.')


def load_split(data_config, split: str, seed: int = 0) -> tuple[list[str], list[str]]:
  """(source sentences, target sentences) of one split, as text."""
  if split == data_config.train_split and data_config.distilled_from:
    folder = os.path.join(data_config.distilled_from, DISTILL_DIR)
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
        tmp = path + '.tmp'
        shutil.copyfile(other_path, tmp)
        os.replace(tmp, path)
        break
  if os.path.exists(path):
    return tokenizer_lib.load(path)
  src, tgt = load_split(data_config, data_config.train_split, seed)
  return tokenizer_lib.train_or_load(workdir, src + tgt, data_config.vocab_size)
