"""SentencePiece tokenizer: one vocabulary shared by source and target, trained once per workdir.

The model is trained on the training split (both languages) and saved as `{workdir}/spm.model` (+ `.vocab`).
Later runs in the same workdir (resume, decode, evaluate) load that file instead of training again: the ids a
checkpoint was trained with must not change under it.

Fixed ids, the same in every vocabulary of this project: pad=0, eos=1, bos=2, unk=3. Sequences end with EOS;
the decoder's start token is BOS; 0 is padding everywhere, so masks are simply `ids != PAD_ID`.
"""

import os
import shutil
import tempfile
from collections.abc import Iterable, Sequence

from absl import logging
import numpy as np
import sentencepiece as spm

from bpd.errors import UserError

PAD_ID = 0
EOS_ID = 1
BOS_ID = 2
UNK_ID = 3
MODEL_NAME = 'spm.model'


class Tokenizer:
  """Text <-> ids with a SentencePiece model. `encode` adds neither BOS nor EOS."""

  def __init__(self, model_path: str):
    self.model_path = model_path
    self._sp = spm.SentencePieceProcessor(model_file=model_path)
    ids = (self._sp.pad_id(), self._sp.eos_id(), self._sp.bos_id(), self._sp.unk_id())
    if ids != (PAD_ID, EOS_ID, BOS_ID, UNK_ID):
      raise UserError(
          f'{model_path} has pad/eos/bos/unk ids {ids}, but this project needs '
          f'{(PAD_ID, EOS_ID, BOS_ID, UNK_ID)}. It was not made by bpd: delete it (a new one is trained) or '
          f'use another workdir.')

  @property
  def vocab_size(self) -> int:
    return self._sp.vocab_size()

  def encode(self, text: str) -> list[int]:
    return self._sp.encode(text)

  def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
    return self._sp.encode(list(texts))

  def decode(self, ids: Sequence[int]) -> str:
    """Text of `ids` up to the first EOS; pad and bos ids are ignored wherever they are."""
    out = []
    for i in np.asarray(ids).tolist():
      if i == EOS_ID:
        break
      if i not in (PAD_ID, BOS_ID):
        out.append(i)
    return self._sp.decode(out)

  def decode_batch(self, ids_BxL) -> list[str]:
    """Decodes each row of an int array (or list of id lists) [B, L]."""
    return [self.decode(row) for row in ids_BxL]


def load(path: str) -> Tokenizer:
  """Loads a SentencePiece model file (e.g. `{workdir}/spm.model`)."""
  if not os.path.isfile(path):
    raise UserError(f'Tokenizer model {path} not found. Train one by running training with this workdir, '
                    f'or point at the workdir of the run whose checkpoint you use.')
  return Tokenizer(path)


def _train(input_path: str, model_prefix: str, vocab_size: int, max_sentences: int, hard_limit: bool):
  spm.SentencePieceTrainer.train(
      input=input_path, model_prefix=model_prefix, vocab_size=vocab_size, model_type='unigram',
      character_coverage=1.0,  # Keep every character: German umlauts and rare letters must not become unk.
      pad_id=PAD_ID, eos_id=EOS_ID, bos_id=BOS_ID, unk_id=UNK_ID,
      input_sentence_size=max_sentences, shuffle_input_sentence=True,
      hard_vocab_limit=hard_limit, minloglevel=2)  # minloglevel=2: no page of training logs.


def train_or_load(workdir: str, texts: Iterable[str], vocab_size: int,
                  max_sentences: int = 1_000_000) -> Tokenizer:
  """Loads `{workdir}/spm.model` if it exists; otherwise trains it on `texts` and saves it there.

  `texts` (source and target training sentences together) is only read when training. SentencePiece samples
  at most `max_sentences` of them. A corpus too small for `vocab_size` gets a smaller vocabulary (logged).
  The files appear atomically: a killed run leaves either a complete tokenizer or none.
  """
  path = os.path.join(workdir, MODEL_NAME)
  if os.path.exists(path):
    tokenizer = Tokenizer(path)
    logging.info('Reusing tokenizer %s (vocab size %d).', path, tokenizer.vocab_size)
    if tokenizer.vocab_size != vocab_size:
      logging.warning('%s has vocab size %d, not the %d asked for; keeping it, since checkpoints in this '
                      'workdir use its ids.', path, tokenizer.vocab_size, vocab_size)
    return tokenizer

  os.makedirs(workdir, exist_ok=True)
  # A temporary folder inside workdir: same file system, so os.replace below is an atomic rename.
  tmp_dir = tempfile.mkdtemp(prefix='.spm_tmp_', dir=workdir)
  try:
    input_path = os.path.join(tmp_dir, 'text.txt')
    num_lines = 0
    with open(input_path, 'w', encoding='utf-8') as f:
      for text in texts:
        text = ' '.join(text.split())  # One sentence per line: no newlines inside.
        if text:
          f.write(text + '\n')
          num_lines += 1
    if not num_lines:
      raise UserError('No training text for the tokenizer: the training split is empty. Check the data '
                      'config (config.data.*).')
    prefix = os.path.join(tmp_dir, 'spm')
    logging.info('Training a %d-piece SentencePiece model on %d sentences.', vocab_size, num_lines)
    try:
      _train(input_path, prefix, vocab_size, max_sentences, hard_limit=True)
    except RuntimeError as e:
      if 'Vocabulary size too high' not in str(e):
        raise
      # Tiny corpora (tests, the synthetic default) have fewer pieces than asked for: take what there is.
      logging.warning('The corpus is too small for %d pieces (%s); training with a soft limit instead.',
                      vocab_size, e)
      _train(input_path, prefix, vocab_size, max_sentences, hard_limit=False)
    # The .model file is renamed last: whoever sees it also finds the .vocab beside it.
    os.replace(prefix + '.vocab', os.path.join(workdir, 'spm.vocab'))
    os.replace(prefix + '.model', path)
  finally:
    shutil.rmtree(tmp_dir, ignore_errors=True)
  tokenizer = Tokenizer(path)
  logging.info('Saved tokenizer %s (vocab size %d).', path, tokenizer.vocab_size)
  return tokenizer
