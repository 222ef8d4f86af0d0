"""Parallel text files: `{data_dir}/{split}.{lang}`, line i of the source aligned with line i of the target.

This is the format of Multi30k (train.en / train.de, val.en / val.de, test_2016_flickr.en / ...) and of most
MT test sets once unpacked. A line that is not valid UTF-8, or empty on either side, is skipped and counted:
one bad line should cost one example, not the run.
"""

import os

from absl import logging

from bpd.errors import UserError


def available_splits(data_dir: str, src_lang: str = 'en', tgt_lang: str = 'de') -> list[str]:
  """Names of the splits in `data_dir` that have both a `.{src_lang}` and a `.{tgt_lang}` file, sorted."""
  if not os.path.isdir(data_dir):
    return []
  names = set(os.listdir(data_dir))
  src_suffix = '.' + src_lang
  return sorted(name[:-len(src_suffix)] for name in names
                if name.endswith(src_suffix) and name[:-len(src_suffix)] + '.' + tgt_lang in names)


def _read_lines(path: str) -> list[bytes]:
  """The lines of a file as bytes, without line ends.

  Splits on b'\\n' only: str.splitlines() would also split inside a line at characters such as U+2028 or
  U+0085, and shift every later line out of alignment with the other language.
  """
  with open(path, 'rb') as f:
    data = f.read()
  lines = data.split(b'\n')
  if lines and lines[-1] == b'':
    lines.pop()  # The file's final newline ends the last line; it does not start a new one.
  return [line[:-1] if line.endswith(b'\r') else line for line in lines]


def _decode(line: bytes) -> str | None:
  try:
    return line.decode('utf-8')
  except UnicodeDecodeError:
    return None


def _checked_lines(data_dir: str, split: str, src_lang: str, tgt_lang: str):
  """The two files' paths and lines, after checking that both exist and have the same line count."""
  if not os.path.isdir(data_dir):
    raise UserError(
        f'Data folder {data_dir!r} does not exist or is not a folder (config.data.dir). Set '
        f'config.data.dir to a folder with parallel text files, one sentence per line: '
        f'train.{src_lang}/train.{tgt_lang}, val.{src_lang}/val.{tgt_lang}, ...')
  paths = [os.path.join(data_dir, f'{split}.{lang}') for lang in (src_lang, tgt_lang)]
  for path in paths:
    if not os.path.isfile(path):
      splits = available_splits(data_dir, src_lang, tgt_lang)
      found = ', '.join(f'{s}.{src_lang}/{s}.{tgt_lang}' for s in splits) if splits else 'none'
      raise UserError(
          f'File {path!r} not found. Split {split!r} needs {split}.{src_lang} and {split}.{tgt_lang} in '
          f'{data_dir!r}; the splits there with both files are: {found}. Rename the files or choose one '
          f'of these splits.')

  src_lines, tgt_lines = _read_lines(paths[0]), _read_lines(paths[1])
  if len(src_lines) != len(tgt_lines):
    raise UserError(
        f'{paths[0]!r} has {len(src_lines)} lines but {paths[1]!r} has {len(tgt_lines)}: parallel files '
        f'must have one sentence per line, line i of one aligned with line i of the other. Fix or '
        f're-extract them.')

  return paths, src_lines, tgt_lines


def check_split(data_dir: str, split: str, src_lang: str = 'en', tgt_lang: str = 'de') -> None:
  """Raises the UserError that load_split would raise for a missing folder/file or unequal line counts."""
  _checked_lines(data_dir, split, src_lang, tgt_lang)


def load_split(data_dir: str, split: str, src_lang: str = 'en',
               tgt_lang: str = 'de') -> tuple[list[str], list[str], dict]:
  """Reads `{data_dir}/{split}.{src_lang}` and `.{tgt_lang}`.

  Returns (source sentences, target sentences, counts), the sentences stripped of surrounding white space,
  and counts = {'read': line pairs read, 'kept': pairs returned, 'skipped_empty': pairs with an empty side,
  'skipped_non_utf8': pairs with a side that is not valid UTF-8}.

  Raises UserError if the folder or a file is missing, or if the two files have different line counts.
  """
  paths, src_lines, tgt_lines = _checked_lines(data_dir, split, src_lang, tgt_lang)
  src, tgt = [], []
  counts = {'read': len(src_lines), 'kept': 0, 'skipped_empty': 0, 'skipped_non_utf8': 0}
  for src_bytes, tgt_bytes in zip(src_lines, tgt_lines):
    src_text, tgt_text = _decode(src_bytes), _decode(tgt_bytes)
    if src_text is None or tgt_text is None:
      counts['skipped_non_utf8'] += 1
      continue
    src_text, tgt_text = src_text.strip(), tgt_text.strip()
    if not src_text or not tgt_text:
      counts['skipped_empty'] += 1
      continue
    src.append(src_text)
    tgt.append(tgt_text)
  counts['kept'] = len(src)
  logging.info('%s/%s.{%s,%s}: read %d line pairs, kept %d, skipped %d empty, %d not UTF-8.', data_dir,
               split, src_lang, tgt_lang, counts['read'], counts['kept'], counts['skipped_empty'],
               counts['skipped_non_utf8'])
  return src, tgt, counts
