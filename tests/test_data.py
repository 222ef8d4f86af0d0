"""Tests of bpd.data: synthetic corpus, text files, WMT14 via TFDS, tokenizer, batching."""

import os
import time
from unittest import mock

import numpy as np
import pytest

from bpd.data import batching
from bpd.data import synthetic
from bpd.data import text_files
from bpd.data import tokenizer as tokenizer_lib
from bpd.data import wmt14
from bpd.errors import UserError

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# CI has ../shared beside the checkout; it is never copied into the repo.
MULTI30K_DIR = os.path.join(os.path.dirname(REPO_ROOT), 'shared', 'data', 'multi30k')


# ------------------------------------------------------------------------------------------------ synthetic


def test_synthetic_is_deterministic_from_seed():
  a = synthetic.make_corpus(seed=7, num_train=300, num_val=20, num_test=20)
  b = synthetic.make_corpus(seed=7, num_train=300, num_val=20, num_test=20)
  c = synthetic.make_corpus(seed=8, num_train=300, num_val=20, num_test=20)
  assert a == b
  assert a['train'][0] != c['train'][0]


def test_synthetic_splits_have_sizes_and_are_disjoint():
  corpus = synthetic.make_corpus(seed=0, num_train=2000, num_val=100, num_test=150)
  sizes = {name: (len(src), len(tgt)) for name, (src, tgt) in corpus.items()}
  assert sizes == {'train': (2000, 2000), 'val': (100, 100), 'test': (150, 150)}
  train, val, test = (set(corpus[name][0]) for name in ('train', 'val', 'test'))
  assert len(train) == 2000  # No duplicates inside a split either.
  assert not train & val and not train & test and not val & test


def test_synthetic_target_is_the_rule_applied_to_the_source():
  src, tgt = synthetic.make_corpus(seed=1, num_train=3000, num_val=0, num_test=0)['train']
  assert tgt == [synthetic.translate(s) for s in src]
  lengths = [len(s.split()) for s in src]
  assert min(lengths) >= synthetic.MIN_WORDS and max(lengths) <= synthetic.MAX_WORDS
  words = {w.strip('.').lower() for s in src for w in s.split()}
  assert words <= synthetic.source_vocabulary()
  assert 100 <= len(synthetic.source_vocabulary()) <= 220
  # The grammar's features all occur: subordinate clauses, relative clauses, adverbs (verb second).
  joined = '\n'.join(tgt)
  for marker in (', weil ', ', der ', 'Heute ', ' im '):
    assert marker in joined


@pytest.mark.parametrize('src, expected', [
    ('The big dog sees a small cat.', 'Der große Hund sieht eine kleine Katze.'),
    ('A woman sees an old horse with two tired dogs.',
     'Eine Frau sieht ein altes Pferd mit zwei müden Hunden.'),
    ('Today the children play in the park.', 'Heute spielen die Kinder im Park.'),
    ('My friend carries a red ball because the cats like the new lamp.',
     'Mein Freund trägt einen roten Ball, weil die Katzen die neue Lampe mögen.'),
    ('The man that reads a book sleeps.', 'Der Mann, der ein Buch liest, schläft.'),
    ('These girls watch the king that dances.', 'Diese Mädchen beobachten den König, der tanzt.'),
    ('Many hungry mice eat this cake near the old houses.',
     'Viele hungrige Mäuse essen diesen Kuchen neben den alten Häusern.'),
])
def test_synthetic_translate_known_sentences(src, expected):
  assert synthetic.translate(src) == expected


def test_synthetic_translate_rejects_other_text():
  for bad in ('The dog see a cat.', 'A dogs sleeps.', 'The dog sleeps', 'Hello world.'):
    with pytest.raises(ValueError, match='synthetic grammar'):
      synthetic.translate(bad)


# ----------------------------------------------------------------------------------------------- text files


def _write(path, data: bytes):
  with open(path, 'wb') as f:
    f.write(data)


def test_text_files_skip_and_count_bad_lines(tmp_path):
  # Line 2 is not UTF-8 on the source side; line 3 is blank on the source side; line 5 holds U+2028, which
  # must not split the line; the target file has no final newline and one CRLF line end.
  _write(tmp_path / 'train.en', b'Hello\n\xff\xfe bad\n   \nWorld\nok\xe2\x80\xa8inside\n')
  _write(tmp_path / 'train.de', b'Hallo\nschlecht\nleer\nWelt\r\ngut')
  src, tgt, counts = text_files.load_split(str(tmp_path), 'train')
  assert src == ['Hello', 'World', 'ok\u2028inside']
  assert tgt == ['Hallo', 'Welt', 'gut']
  assert counts == {'read': 5, 'kept': 3, 'skipped_empty': 1, 'skipped_non_utf8': 1}


def test_text_files_mismatched_line_counts(tmp_path):
  _write(tmp_path / 'val.en', b'a\nb\nc\n')
  _write(tmp_path / 'val.de', b'x\ny\n')
  with pytest.raises(UserError) as e:
    text_files.load_split(str(tmp_path), 'val')
  message = str(e.value)
  assert str(tmp_path / 'val.en') in message and str(tmp_path / 'val.de') in message
  assert 'has 3 lines' in message and 'has 2' in message


def test_text_files_missing_dir_and_file(tmp_path):
  with pytest.raises(UserError, match='config.data.dir') as e:
    text_files.load_split(str(tmp_path / 'nope'), 'train')
  assert str(tmp_path / 'nope') in str(e.value) and 'train.en/train.de' in str(e.value)

  _write(tmp_path / 'train.en', b'a\n')
  _write(tmp_path / 'train.de', b'b\n')
  _write(tmp_path / 'dev.en', b'a\n')  # No dev.de: not a split.
  assert text_files.available_splits(str(tmp_path)) == ['train']
  with pytest.raises(UserError) as e:
    text_files.load_split(str(tmp_path), 'test')
  message = str(e.value)
  assert str(tmp_path / 'test.en') in message and 'train.en/train.de' in message
  assert 'dev.en/' not in message


@pytest.mark.skipif(not os.path.isdir(MULTI30K_DIR), reason='no ../shared/data/multi30k beside the checkout')
def test_text_files_real_multi30k_val():
  assert {'train', 'val', 'test_2016_flickr'} <= set(text_files.available_splits(MULTI30K_DIR))
  src, tgt, counts = text_files.load_split(MULTI30K_DIR, 'val')
  assert counts == {'read': 1014, 'kept': 1014, 'skipped_empty': 0, 'skipped_non_utf8': 0}
  assert src[0] == 'A group of men are loading cotton onto a truck'
  assert tgt[0] == 'Eine Gruppe von Männern lädt Baumwolle auf einen Lastwagen'


# ---------------------------------------------------------------------------------------------------- wmt14


def test_wmt14_not_prepared_fails_fast_without_downloading(tmp_path):
  import tensorflow_datasets as tfds  # pylint: disable=g-import-not-at-top
  start = time.time()
  with mock.patch.object(tfds.core.DatasetBuilder, 'download_and_prepare',
                         side_effect=AssertionError('must never download')):
    with pytest.raises(UserError) as e:
      wmt14.load_split('validation', str(tmp_path))
  assert time.time() - start < 5
  message = str(e.value)
  assert 'not prepared' in message and str(tmp_path) in message
  assert f'tfds build wmt14_translate/de-en --file_format=array_record --data_dir={tmp_path}' in message
  assert 'config.data.tfds_data_dir' in message and 'config.data.source=text' in message


def test_wmt14_unknown_split():
  with pytest.raises(UserError, match="'dev'.*train, validation, test"):
    wmt14.load_split('dev', None)


def test_wmt14_reads_mock_data_en_to_de():
  import tensorflow_datasets as tfds  # pylint: disable=g-import-not-at-top
  from tensorflow_datasets.core.data_sources import base  # pylint: disable=g-import-not-at-top

  def getitems_one_by_one(self, keys):
    return [self[k] for k in keys]

  # mock_data with MockPolicy.USE_CODE serves `as_data_source` without TensorFlow and without files. Two gaps
  # in TFDS 4.9.10's mock, patched here: `is_prepared()` stays False (the mock points the builder at a
  # non-existing folder), and the mocked `__getitems__` is set on a MagicMock without binding `self`, so
  # batched reads raise TypeError; we serve them through the mock's working `__getitem__`.
  with tfds.testing.mock_data(num_examples=30, policy=tfds.testing.MockPolicy.USE_CODE), \
       mock.patch.object(tfds.core.DatasetBuilder, 'is_prepared', return_value=True), \
       mock.patch.object(base.BaseDataSource, '__getitems__', getitems_one_by_one):
    src, tgt = wmt14.load_split('train', '/nonexistent/tfds', max_examples=12)
    all_src, all_tgt = wmt14.load_split('test', None)
    examples = tfds.data_source(wmt14.TFDS_NAME, split='test')
    expected = [(ex['en'], ex['de']) for ex in examples]
  assert len(src) == len(tgt) == 12 and len(all_src) == 30
  assert all(isinstance(s, str) and isinstance(t, str) for s, t in zip(all_src, all_tgt))
  assert list(zip(all_src, all_tgt)) == [(_text(e), _text(d)) for e, d in expected]  # Source is 'en'.
  assert src == all_src[:12]


def _text(value):
  return value.decode() if isinstance(value, bytes) else value


# ------------------------------------------------------------------------------------------------ tokenizer


@pytest.fixture(scope='module')
def synthetic_pairs():
  return synthetic.make_corpus(seed=0, num_train=1000, num_val=50, num_test=0)


def test_tokenizer_train_save_reuse(tmp_path, synthetic_pairs):
  src, tgt = synthetic_pairs['train']
  tok = tokenizer_lib.train_or_load(str(tmp_path), src + tgt, vocab_size=200)
  model_path = tmp_path / 'spm.model'
  assert model_path.is_file() and (tmp_path / 'spm.vocab').is_file()
  assert sorted(os.listdir(tmp_path)) == ['spm.model', 'spm.vocab']  # No temporary files left.
  assert tok.vocab_size == 200

  val_src, val_tgt = synthetic_pairs['val']
  for text in val_src[:20] + val_tgt[:20]:
    ids = tok.encode(text)
    assert ids and min(ids) > tokenizer_lib.UNK_ID  # No pad/eos/bos/unk inside a sentence.
    assert tok.decode(ids) == text
    assert tok.decode([tokenizer_lib.BOS_ID] + ids + [tokenizer_lib.EOS_ID] + ids + [0, 0]) == text

  def must_not_read():
    raise AssertionError('the existing tokenizer should be reused, not retrained')
    yield  # pylint: disable=unreachable

  mtime = model_path.stat().st_mtime_ns
  again = tokenizer_lib.train_or_load(str(tmp_path), must_not_read(), vocab_size=200)
  loaded = tokenizer_lib.load(str(model_path))
  assert model_path.stat().st_mtime_ns == mtime
  assert again.encode_batch(val_tgt[:5]) == loaded.encode_batch(val_tgt[:5]) == tok.encode_batch(val_tgt[:5])

  sp = loaded._sp  # pylint: disable=protected-access
  assert [sp.pad_id(), sp.eos_id(), sp.bos_id(), sp.unk_id()] == [0, 1, 2, 3]
  ids = (tokenizer_lib.PAD_ID, tokenizer_lib.EOS_ID, tokenizer_lib.BOS_ID, tokenizer_lib.UNK_ID)
  assert ids == (0, 1, 2, 3)

  padded = np.zeros((2, 40), np.int32)
  for row, text in enumerate(val_src[:2]):
    ids = tok.encode(text) + [tokenizer_lib.EOS_ID]
    padded[row, :len(ids)] = ids
  assert tok.decode_batch(padded) == val_src[:2]


def test_tokenizer_small_corpus_gets_smaller_vocab(tmp_path):
  texts = ['der Hund schläft', 'the dog sleeps'] * 5
  tok = tokenizer_lib.train_or_load(str(tmp_path), texts, vocab_size=500)
  assert 4 < tok.vocab_size < 500
  assert tok.decode(tok.encode('the dog sleeps')) == 'the dog sleeps'


def test_tokenizer_errors(tmp_path):
  with pytest.raises(UserError, match='spm.model not found'):
    tokenizer_lib.load(str(tmp_path / 'spm.model'))
  with pytest.raises(UserError, match='No training text'):
    tokenizer_lib.train_or_load(str(tmp_path), ['', '  '], vocab_size=100)
  assert not os.listdir(tmp_path)


# ------------------------------------------------------------------------------------------------- batching


class _WordTokenizer:
  """One id per word, so lengths are easy to predict."""

  def encode_batch(self, texts):
    return [[4 + len(w) for w in t.split()] for t in texts]


def test_encode_pairs_drop_or_truncate():
  src = ['a b', 'a b c d e f', 'a', 'x']
  tgt = ['c', 'd', 'a b c d e f g', 'y']
  s, t, stats = batching.encode_pairs(_WordTokenizer(), src, tgt, max_len=4)
  assert stats == {'pairs': 4, 'kept': 2, 'dropped_too_long': 2, 'truncated': 0}
  assert [x.tolist() for x in s] == [[5, 5, 1], [5, 1]] and [x.tolist() for x in t] == [[5, 1], [5, 1]]
  assert s[0].dtype == np.int32

  s, t, stats = batching.encode_pairs(_WordTokenizer(), src, tgt, max_len=4, truncate=True)
  assert stats == {'pairs': 4, 'kept': 4, 'dropped_too_long': 0, 'truncated': 2}
  assert s[1].tolist() == [5, 5, 5, 5] and t[2].tolist() == [5, 5, 5, 5]  # Cut: no EOS.

  with pytest.raises(UserError, match='max_len=1'):
    batching.encode_pairs(_WordTokenizer(), src, tgt, max_len=1)


def _numbered_examples(n, seed=0):
  """Example i starts with token 10 + i, so a batch row tells which example it is; lengths 2..31."""
  rng = np.random.default_rng(seed)
  src, tgt = [], []
  for i in range(n):
    ls, lt = rng.integers(1, 31, size=2)
    src.append(np.array([10 + i] + [7] * (ls - 1) + [1], np.int32))
    tgt.append(np.array([10 + i] + [8] * (lt - 1) + [1], np.int32))
  return src, tgt


BUCKETS = (8, 16, 32)


def test_train_batches_depend_on_seed_and_step_only():
  src, tgt = _numbered_examples(203)
  fn_a = batching.make_train_batch_fn(src, tgt, batch_size=16, bucket_lengths=BUCKETS, seed=5)
  fn_b = batching.make_train_batch_fn(src, tgt, batch_size=16, bucket_lengths=BUCKETS, seed=5)
  fn_c = batching.make_train_batch_fn(src, tgt, batch_size=16, bucket_lengths=BUCKETS, seed=6)
  steps = list(range(3 * fn_a.steps_per_epoch))
  batches_a = [fn_a(s) for s in steps]
  for s in reversed(steps):  # A resumed run starts anywhere; the order of calls must not matter.
    b = fn_b(s)
    np.testing.assert_array_equal(b['src_BxS'], batches_a[s]['src_BxS'])
    np.testing.assert_array_equal(b['tgt_BxT'], batches_a[s]['tgt_BxT'])
  assert any(not np.array_equal(fn_c(s)['src_BxS'], batches_a[s]['src_BxS']) for s in steps[:5])


def test_train_batches_cover_every_example_each_epoch_in_buckets():
  src, tgt = _numbered_examples(203)
  batch_size = 16
  fn = batching.make_train_batch_fn(src, tgt, batch_size=batch_size, bucket_lengths=BUCKETS, seed=0)
  lengths = np.array([max(len(s), len(t)) for s, t in zip(src, tgt)])
  sizes = np.bincount(np.searchsorted(BUCKETS, lengths), minlength=3)
  assert fn.steps_per_epoch == sum(-(-c // batch_size) for c in sizes)

  orders = []
  for epoch in range(2):
    seen = []
    for step in range(epoch * fn.steps_per_epoch, (epoch + 1) * fn.steps_per_epoch):
      batch = fn(step)
      src_BxS, tgt_BxT = batch['src_BxS'], batch['tgt_BxT']
      assert src_BxS.dtype == tgt_BxT.dtype == np.int32
      assert src_BxS.shape[0] == batch_size and src_BxS.shape == tgt_BxT.shape
      length = src_BxS.shape[1]
      assert length in BUCKETS
      ids = (src_BxS[:, 0] - 10).tolist()
      for row, i in enumerate(ids):
        np.testing.assert_array_equal(src_BxS[row, :len(src[i])], src[i])
        np.testing.assert_array_equal(tgt_BxT[row, :len(tgt[i])], tgt[i])
        assert not src_BxS[row, len(src[i]):].any() and not tgt_BxT[row, len(tgt[i]):].any()
        # The smallest bucket that fits: every example of a batch belongs to that bucket.
        assert BUCKETS[np.searchsorted(BUCKETS, lengths[i])] == length
      seen += ids
    assert sorted(set(seen)) == list(range(len(src)))  # Every example once per epoch...
    assert len(seen) - len(src) <= (batch_size - 1) * len(BUCKETS)  # ...plus the wrap-around fill.
    orders.append(seen)
  assert orders[0] != orders[1]  # Each epoch has its own order.


def test_eval_batches_keep_source_order_and_fixed_shapes():
  src, tgt = _numbered_examples(37, seed=1)
  batches = batching.eval_batches(src, tgt, batch_size=8, bucket_lengths=BUCKETS)
  assert len(batches) == 5
  indices = np.concatenate([b[0] for b in batches])
  assert indices.tolist() == list(range(37)) + [-1] * 3
  out = [None] * 37
  for indices_B, src_BxL, tgt_BxL in batches:
    assert indices_B.shape == (8,) and src_BxL.shape[0] == tgt_BxL.shape[0] == 8
    assert src_BxL.shape[1] == tgt_BxL.shape[1] and src_BxL.shape[1] in BUCKETS
    keep = indices_B >= 0
    for i, row in zip(indices_B[keep], src_BxL[keep]):
      out[i] = row[:len(src[i])]
    for row in src_BxL[~keep]:
      assert row.tolist() == [tokenizer_lib.EOS_ID] + [0] * (len(row) - 1)
    assert not tgt_BxL[~keep].any()
  for i in range(37):
    np.testing.assert_array_equal(out[i], src[i])

  no_targets = batching.eval_batches(src, None, batch_size=8, bucket_lengths=BUCKETS)
  assert all(len(b) == 2 for b in no_targets)
  with pytest.raises(ValueError, match='longer than the last bucket'):
    batching.eval_batches(src, tgt, batch_size=8, bucket_lengths=(8, 16))
