"""From token ids to fixed-shape batches: length buckets, deterministic per step, and eval batches.

Shapes: every batch is [batch_size, L] with L taken from a short list `bucket_lengths` (the last entry is
max_len), so XLA compiles one program per bucket and no more (each new shape costs seconds of compile).

Training batches depend on (seed, step) only: a run resumed at step s sees exactly the batches an
uninterrupted run would have seen, without saving any iterator state in the checkpoint.
"""

import functools
import math
from collections.abc import Callable, Sequence

from absl import logging
import numpy as np

from bpd.data.tokenizer import EOS_ID, PAD_ID
from bpd.errors import UserError


def encode_pairs(tokenizer, src: Sequence[str], tgt: Sequence[str], max_len: int,
                 truncate: bool = False) -> tuple[list[np.ndarray], list[np.ndarray], dict]:
  """Tokenizes sentence pairs and appends EOS to both sides.

  A pair with a side longer than `max_len` tokens (EOS included) is dropped, or, with `truncate=True`, cut
  to its first `max_len` tokens. A cut sequence has no EOS: the model should not learn to end a sentence
  where we cut it. Use truncate=True for evaluation sets, whose examples must all stay.

  Returns (src ids, tgt ids, stats): lists of int32 arrays [len <= max_len], and stats = {'pairs', 'kept',
  'dropped_too_long', 'truncated'} (counts of pairs).
  """
  if len(src) != len(tgt):
    raise ValueError(f'{len(src)} source sentences but {len(tgt)} targets')
  stats = {'pairs': len(src), 'kept': 0, 'dropped_too_long': 0, 'truncated': 0}
  src_out, tgt_out = [], []
  for s, t in zip(tokenizer.encode_batch(src), tokenizer.encode_batch(tgt)):
    s, t = s + [EOS_ID], t + [EOS_ID]
    if len(s) > max_len or len(t) > max_len:
      if not truncate:
        stats['dropped_too_long'] += 1
        continue
      stats['truncated'] += 1
      s, t = s[:max_len], t[:max_len]
    src_out.append(np.asarray(s, np.int32))
    tgt_out.append(np.asarray(t, np.int32))
  stats['kept'] = len(src_out)
  logging.info('Encoded %d pairs (max_len %d): kept %d, dropped %d as too long, truncated %d.',
               stats['pairs'], max_len, stats['kept'], stats['dropped_too_long'], stats['truncated'])
  if stats['pairs'] and not stats['kept']:
    raise UserError(f'All {stats["pairs"]} sentence pairs are longer than max_len={max_len} tokens: raise '
                    f'max_len (the last bucket length) in the config.')
  return src_out, tgt_out, stats


def _check_buckets(bucket_lengths: Sequence[int], lengths_N: np.ndarray) -> np.ndarray:
  """Returns the bucket index of each example: the first bucket as long as its longer side."""
  buckets = np.asarray(bucket_lengths)
  if len(buckets) == 0 or np.any(buckets <= 0) or np.any(np.diff(buckets) <= 0):
    raise UserError(f'bucket_lengths={list(bucket_lengths)} must be positive and increasing; the last one '
                    f'is max_len.')
  if len(lengths_N) and lengths_N.max() > buckets[-1]:
    raise ValueError(f'a sequence of {lengths_N.max()} tokens is longer than the last bucket '
                     f'({buckets[-1]}): encode with max_len={buckets[-1]}.')
  return np.searchsorted(buckets, lengths_N, side='left')


def _pad(rows: Sequence[np.ndarray], length: int) -> np.ndarray:
  """Stacks id arrays into int32 [len(rows), length], right-padded with PAD_ID."""
  out = np.full((len(rows), length), PAD_ID, np.int32)
  for i, row in enumerate(rows):
    out[i, :len(row)] = row
  return out


def _epoch_batches(bucket_N: np.ndarray, num_buckets: int, batch_size: int, seed: int,
                   epoch: int) -> list[np.ndarray]:
  """The batches of one epoch, as arrays of example indices [batch_size], in the order they are served.

  A seeded permutation of all examples is split by bucket (keeping the permuted order) and chunked into
  batches. A bucket's last batch is filled by wrapping around to the start of that bucket's list: every
  example appears at least once per epoch, and at most batch_size - 1 per bucket appear twice. Then the
  epoch's batches are shuffled, so buckets are mixed over time.
  """
  rng = np.random.default_rng([seed, epoch])
  order_N = rng.permutation(len(bucket_N))
  batches = []
  for b in range(num_buckets):
    members = order_N[bucket_N[order_N] == b]
    if len(members):
      num = math.ceil(len(members) / batch_size)
      batches += list(np.resize(members, num * batch_size).reshape(num, batch_size))  # resize wraps around.
  return [batches[i] for i in rng.permutation(len(batches))]


def make_train_batch_fn(src_ids: Sequence[np.ndarray], tgt_ids: Sequence[np.ndarray], batch_size: int,
                        bucket_lengths: Sequence[int], seed: int) -> Callable[[int], dict]:
  """Returns `batch_for_step(step) -> {'src_BxS': int32 [B, S], 'tgt_BxT': int32 [B, T]}`.

  Each batch holds `batch_size` examples of one bucket; S = T = that bucket's length (the smallest entry of
  `bucket_lengths` that fits the longer side of each of its examples), zero-padded. The batch depends on
  (seed, step) alone: step -> (epoch, position in epoch), and the epoch's batches come from a permutation
  seeded by (seed, epoch), see `_epoch_batches`. Caching the current epoch only saves time.

  The returned function has an attribute `steps_per_epoch` (the same for every epoch).
  """
  if len(src_ids) != len(tgt_ids):
    raise ValueError(f'{len(src_ids)} source sequences but {len(tgt_ids)} targets')
  if not len(src_ids):
    raise UserError('No training examples left to batch: the training split is empty after filtering '
                    '(see the encode log line); check the data config or raise max_len.')
  lengths_N = np.array([max(len(s), len(t)) for s, t in zip(src_ids, tgt_ids)])
  bucket_N = _check_buckets(bucket_lengths, lengths_N)
  counts = np.bincount(bucket_N, minlength=len(bucket_lengths))
  steps_per_epoch = int(sum(math.ceil(c / batch_size) for c in counts))
  logging.info('Buckets %s hold %s examples; %d batches of %d per epoch.', list(bucket_lengths),
               counts.tolist(), steps_per_epoch, batch_size)

  @functools.lru_cache(maxsize=2)
  def epoch_batches(epoch: int) -> list[np.ndarray]:
    return _epoch_batches(bucket_N, len(bucket_lengths), batch_size, seed, epoch)

  def batch_for_step(step: int) -> dict:
    epoch, i = divmod(int(step), steps_per_epoch)
    rows_B = epoch_batches(epoch)[i]
    length = bucket_lengths[bucket_N[rows_B[0]]]
    return {'src_BxS': _pad([src_ids[r] for r in rows_B], length),
            'tgt_BxT': _pad([tgt_ids[r] for r in rows_B], length)}

  batch_for_step.steps_per_epoch = steps_per_epoch
  return batch_for_step


def eval_batches(src_ids: Sequence[np.ndarray], tgt_ids: Sequence[np.ndarray] | None, batch_size: int,
                 bucket_lengths: Sequence[int]) -> list[tuple]:
  """Splits a set, in source order, into fixed-shape batches.

  Returns a list of (indices_B, src_BxL) or, with targets, (indices_B, src_BxL, tgt_BxL): consecutive
  examples, L the smallest bucket that fits the batch's longest sequence. The last batch is filled up with
  rows of index -1 that the caller drops; their source is a lone EOS (never a fully masked row, whose
  attention would be undefined) and their target is all padding. Write results back with
  `out[indices_B[indices_B >= 0]] = ...` to keep source order.
  """
  lengths_N = np.array([len(s) for s in src_ids])
  if tgt_ids is not None:
    if len(tgt_ids) != len(src_ids):
      raise ValueError(f'{len(src_ids)} source sequences but {len(tgt_ids)} targets')
    lengths_N = np.maximum(lengths_N, [len(t) for t in tgt_ids])
  _check_buckets(bucket_lengths, lengths_N)
  batches = []
  for start in range(0, len(src_ids), batch_size):
    indices = np.arange(start, min(start + batch_size, len(src_ids)))
    length = next(b for b in bucket_lengths if b >= lengths_N[indices].max())
    num_fill = batch_size - len(indices)
    indices_B = np.concatenate([indices, np.full(num_fill, -1)]).astype(np.int32)
    src_BxL = _pad([src_ids[i] for i in indices] + [np.array([EOS_ID])] * num_fill, length)
    if tgt_ids is None:
      batches.append((indices_B, src_BxL))
    else:
      tgt_BxL = _pad([tgt_ids[i] for i in indices] + [np.array([], np.int32)] * num_fill, length)
      batches.append((indices_B, src_BxL, tgt_BxL))
  return batches


# -- fixed-length examples (images: 192 source and 3072 target pixel ids, no padding, no buckets) ----------

def make_fixed_train_batch_fn(src_NxS: np.ndarray, tgt_NxT: np.ndarray, batch_size: int,
                              seed: int) -> Callable[[int], dict]:
  """`make_train_batch_fn` for examples that all have one length: the same contract, without buckets.

  Returns `batch_for_step(step) -> {'src_BxS': int32 [B, S], 'tgt_BxT': int32 [B, T]}` (S and T differ:
  an image's source is short), depending on (seed, step) alone, with `steps_per_epoch`. Every epoch is a
  seeded permutation of all examples, its last batch filled by wrapping around (see `_epoch_batches`).
  """
  # Kept in the caller's dtype (e.g. uint16 pixel ids: half the memory of int32 for TFDS's 162k faces);
  # each batch is cast to int32.
  src_NxS, tgt_NxT = np.asarray(src_NxS), np.asarray(tgt_NxT)
  if len(src_NxS) != len(tgt_NxT):
    raise ValueError(f'{len(src_NxS)} source sequences but {len(tgt_NxT)} targets')
  if not len(src_NxS):
    raise UserError('No training examples: the training split is empty; check config.data.')
  one_bucket_N = np.zeros(len(src_NxS), np.int64)
  steps_per_epoch = math.ceil(len(src_NxS) / batch_size)
  logging.info('%d fixed-length examples (source %d, target %d); %d batches of %d per epoch.', len(src_NxS),
               src_NxS.shape[1], tgt_NxT.shape[1], steps_per_epoch, batch_size)

  @functools.lru_cache(maxsize=2)
  def epoch_batches(epoch: int) -> list[np.ndarray]:
    return _epoch_batches(one_bucket_N, 1, batch_size, seed, epoch)

  def batch_for_step(step: int) -> dict:
    epoch, i = divmod(int(step), steps_per_epoch)
    rows_B = epoch_batches(epoch)[i]
    return {'src_BxS': src_NxS[rows_B].astype(np.int32), 'tgt_BxT': tgt_NxT[rows_B].astype(np.int32)}

  batch_for_step.steps_per_epoch = steps_per_epoch
  return batch_for_step


def fixed_eval_batches(src_NxS: np.ndarray, tgt_NxT: np.ndarray, batch_size: int) -> list[tuple]:
  """`eval_batches` for fixed-length examples: (indices_B, src_BxS, tgt_BxT), in order, no buckets.

  Fill rows of the last batch have index -1, a source of EOS ids (never a fully masked row) and an
  all-padding target (weight 0 in the loss).
  """
  batches = []
  for start in range(0, len(src_NxS), batch_size):
    indices = np.arange(start, min(start + batch_size, len(src_NxS)))
    num_fill = batch_size - len(indices)
    indices_B = np.concatenate([indices, np.full(num_fill, -1)]).astype(np.int32)
    src_BxS = np.concatenate([src_NxS[indices], np.full((num_fill, src_NxS.shape[1]), EOS_ID)]).astype(np.int32)
    tgt_BxT = np.concatenate([tgt_NxT[indices], np.full((num_fill, tgt_NxT.shape[1]), PAD_ID)]).astype(np.int32)
    batches.append((indices_B, src_BxS, tgt_BxT))
  return batches
