"""A truncated draft vocabulary (config.model.draft_vocab = R; not in the paper: after EAGLE-3, Li et al. 2025,
arXiv 2503.01840, and FR-Spec, Zhao et al. 2025): the R most frequent tokens of the task's training targets, which
the proposal heads draft from (bpd/model.py, ModelConfig.draft_ids).

Where the ids live: in the model's config (ModelConfig.draft_ids), so in the workdir's model.json beside the
checkpoints. Every decoder is built from a ModelConfig, so the ids reach propose with no new argument anywhere
(bpd/decoder.py and the decode loops are unchanged), and a checkpoint restored from model.json carries them. They
are not parameters: nothing trains them, the optimizer would have to skip them, and `init_from` copies parameters
from a base model that was counted (or not) for another config.

When they are counted (`draft_ids`), always from the training targets of the config's task (text: their
SentencePiece ids, EOS included, as training reads them; images: the 256 intensities of the training images):
- training (`--mode=train`) with draft_vocab = R > 0 counts them and writes them into model.json, or keeps the ids
  already there when a resumed run has R of them;
- decoding (`--mode=decode`, evaluate.load_for_decoding) uses config.model.draft_vocab as it is at decode time:
  0 decodes without a draft vocabulary, whatever model.json holds; R > 0 takes the R ids of model.json, or counts
  them from the task's training data when model.json has none or another number (a model trained without a draft
  vocabulary, or a second R to compare). Decoding never writes model.json.
Training itself is the same with or without: the heads are trained over the whole vocabulary.
"""

import dataclasses
from typing import Any, Callable

from absl import logging
import numpy as np

from bpd import model as model_lib
from bpd.errors import UserError


def check(draft_vocab, vocab_size: int) -> None:
  """UserError unless draft_vocab is 0 (off) or an integer 1 <= R < vocab_size."""
  if isinstance(draft_vocab, bool) or int(draft_vocab) != draft_vocab or not (
      draft_vocab == 0 or 1 <= draft_vocab < vocab_size):
    raise UserError(f'config.model.draft_vocab={draft_vocab}: the heads draft from the R most frequent target tokens; '
                    f'use 0 (off, the whole vocabulary) or an integer R with 1 <= R < {vocab_size} (the vocabulary '
                    'size), e.g. a quarter of it.')


def most_frequent(counts_V, size: int) -> tuple[int, ...]:
  """The ids of the `size` largest counts (ties to the lower id), ascending: ascending ids make an argmax over the
  draft logits break ties to the lower id, as the decode loops' argmax over the whole vocabulary does."""
  counts_V = np.asarray(counts_V)
  order = np.lexsort((np.arange(len(counts_V)), -counts_V))  # by count, descending; then by id
  return tuple(int(i) for i in np.sort(order[:size]))


def draft_ids(size: int, count_targets: Callable[[], Any], vocab_size: int, stored=()) -> tuple[int, ...]:
  """The draft vocabulary of `size` ids (config.model.draft_vocab): () when it is 0; `stored` when it holds that
  many ids (those in model.json); else the most frequent of count_targets() -> int [V], how often each id occurs
  in the training targets (the task's target_counts), called only then."""
  check(size, vocab_size)
  if not size:
    return ()
  if len(stored) == size:
    return tuple(stored)
  counts_V = np.asarray(count_targets())
  if counts_V.shape != (vocab_size,):
    raise ValueError(f'target_counts gave {counts_V.shape} counts for a vocabulary of {vocab_size}')
  ids = most_frequent(counts_V, size)
  logging.info('Draft vocabulary: the %d most frequent of %d target tokens, %.1f%% of the %d training target tokens.',
               size, vocab_size, 100 * counts_V[list(ids)].sum() / max(counts_V.sum(), 1), counts_V.sum())
  return ids


def for_decoding(size: int, model_config: model_lib.ModelConfig,
                 count_targets: Callable[[], Any]) -> model_lib.ModelConfig:
  """model_config (as read from model.json) with the draft vocabulary of `size` ids that config.model.draft_vocab
  asks for at decode time (module docstring)."""
  ids = draft_ids(size, count_targets, model_config.vocab_size, stored=model_config.draft_ids)
  return dataclasses.replace(model_config, draft_ids=ids)
