"""WMT14 English -> German from TFDS `wmt14_translate/de-en`, read without TensorFlow.

The TFDS pair is named de-en, but every example holds both sides, so we translate en -> de: source 'en',
target 'de'. Splits: 'train' (about 4.5M pairs), 'validation' (newstest2013, the paper's dev set), 'test'
(newstest2014, the paper's test set).

We read with `builder.as_data_source` (random access over array-record files), which needs no TensorFlow;
`tfds.load` would. And we never download: a TFDS download cannot reach the internet from the training
machines and hangs for minutes before failing, so we check that the data is prepared and fail at once with
instructions when it is not.
"""

from absl import logging

from bpd.errors import UserError

TFDS_NAME = 'wmt14_translate/de-en'
SPLITS = ('train', 'validation', 'test')
SRC_LANG, TGT_LANG = 'en', 'de'
_READ_CHUNK = 10_000  # Examples per random-access read: far fewer calls than one per example.


def _prepare_instructions(data_dir: str) -> str:
  return (
      f'On a machine with internet access (and TensorFlow, which TFDS needs to build it), run\n'
      f'  tfds build {TFDS_NAME} --file_format=array_record --data_dir={data_dir}\n'
      f'or in Python: tfds.builder("{TFDS_NAME}", data_dir="{data_dir}", file_format="array_record")'
      f'.download_and_prepare()\n'
      f'then copy that folder here and set config.data.tfds_data_dir to it. Or set config.data.source=text '
      f'and config.data.dir to a folder of parallel text files (train.en/train.de, ...).')


def _as_text(value) -> str:
  # Real array-record examples hold UTF-8 bytes; TFDS's mock data holds str.
  return value.decode('utf-8') if isinstance(value, bytes) else str(value)


def prepared_builder(split: str, tfds_data_dir: str | None):
  """The TFDS builder of a prepared WMT14; UserError at once (no download) for a bad split or missing data."""
  if split not in SPLITS:
    raise UserError(f'Unknown WMT14 split {split!r}: choose one of {", ".join(SPLITS)}.')
  # Imported here: TFDS takes a second to import, and most runs use other data.
  import tensorflow_datasets as tfds  # pylint: disable=g-import-not-at-top
  # Registers the wmt14 builder; without TensorFlow, TFDS does not import its dataset modules by itself.
  import tensorflow_datasets.translate  # pylint: disable=g-import-not-at-top,unused-import

  # Building the builder only reads local files; download_and_prepare (never called here) would download.
  builder = tfds.builder(TFDS_NAME, data_dir=tfds_data_dir)
  if not builder.is_prepared():
    raise UserError(
        f'WMT14 ({TFDS_NAME}) is not prepared in {builder.data_dir!r} (config.data.tfds_data_dir='
        f'{tfds_data_dir!r}), and it cannot be downloaded from here.\n'
        + _prepare_instructions(tfds_data_dir or '<dir>'))
  return builder


def load_split(split: str, tfds_data_dir: str | None,
               max_examples: int | None = None) -> tuple[list[str], list[str]]:
  """Returns (English sentences, German sentences) of a prepared split, in the stored order.

  Args:
    split: 'train', 'validation' (newstest2013) or 'test' (newstest2014).
    tfds_data_dir: the TFDS data folder holding wmt14_translate/de-en/<version>/; None means TFDS's default
      (~/tensorflow_datasets or $TFDS_DATA_DIR).
    max_examples: read only the first this many examples (None: all).

  Raises UserError, without downloading anything, if the dataset is not prepared in `tfds_data_dir` or was
  prepared in a format without random access.
  """
  builder = prepared_builder(split, tfds_data_dir)
  try:
    source = builder.as_data_source(split=split)
  except (NotImplementedError, ValueError) as e:
    raise UserError(
        f'WMT14 in {builder.data_dir!r} cannot be read without TensorFlow: it must be prepared in the '
        f'array_record format ({e}).\n' + _prepare_instructions(tfds_data_dir or '<dir>')) from e

  n = len(source) if max_examples is None else min(max_examples, len(source))
  src, tgt = [], []
  for start in range(0, n, _READ_CHUNK):
    for example in source.__getitems__(list(range(start, min(start + _READ_CHUNK, n)))):
      src.append(_as_text(example[SRC_LANG]))
      tgt.append(_as_text(example[TGT_LANG]))
  logging.info('WMT14 %s from %s: %d of %d examples.', split, builder.data_dir, n, len(source))
  return src, tgt
