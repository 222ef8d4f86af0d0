"""The one exception type for bad user input.

Anything a user can fix (a flag, a file, a config field) raises `UserError` with a message that names the
offending flag or file and says how to fix it. The entry points (`bpd.main`, the study scripts) print the message
alone through `exit_on_user_error` (no traceback) and exit with status 2. Raise it before compiling or
training, so that nothing already written is touched.

The command line is a bad input too: `app.run(main, flags_parser=errors.parse_flags)` turns what a config
file's get_config raises (a UserError, wrapped by ml_collections in a flags error with its traceback as text)
and a misspelt --config.FIELD override (ml_collections raises AttributeError or KeyError) into the same one line
and exit status 2.
"""

import re
import sys

from absl import flags
from absl import logging


class UserError(ValueError):
  """Bad input that the user can fix; the message says what is wrong and how to fix it."""


def exit_on_user_error(fn, *args, **kwargs):
  """Runs fn; a UserError becomes one line on stderr and exit status 2 (no traceback: the message says it all)."""
  try:
    return fn(*args, **kwargs)
  except UserError as e:
    logging.flush()
    print(f'error: {e}', file=sys.stderr)
    sys.exit(2)



def _innermost_user_error(e: BaseException) -> UserError | None:
  """The first UserError raised along e's chain of causes (ml_collections re-raises it with a traceback)."""
  found, seen = None, set()
  while e is not None and id(e) not in seen:
    seen.add(id(e))
    if isinstance(e, UserError):
      found = e
    e = e.__cause__ or e.__context__
  return found


def _override_typo(e: LookupError, argv: list[str]) -> str:
  """The message for a --config.FIELD override that names no field: the flag, and ml_collections' suggestion."""
  while e.args and isinstance(e.args[0], BaseException):  # AttributeError(KeyError(text))
    e = e.args[0]
  text = str(e.args[0]) if e.args else str(e)
  key = re.search(r"'(\w+)'", text)
  key = key.group(1) if key else text.split('\n')[0]
  flag = next((a.split('=', 1)[0] for a in argv[1:] if re.match(rf'--?(no)?\w+\.(\w+\.)*{re.escape(key)}\b', a)),
              f'a --config override of {key!r}')
  hint = re.search(r'Did you mean "[^"]+" instead of "[^"]+"\?', text)
  return f'{flag}: the config has no field {key!r}.{" " + hint.group(0) if hint else ""} configs/common.py lists them.'


def _unloadable_config() -> str | None:
  """The message for a config flag whose file did not load (ml_collections defers that error to first use)."""
  for name in flags.FLAGS:
    value = flags.FLAGS[name].value
    if type(value).__name__ == '_ErrorConfig':
      error = object.__getattribute__(value, '_error')
      return f'--{name}: cannot load the config file: {str(error).strip().splitlines()[-1].strip()}'
  return None


_FLAG_ERRORS = (flags.Error, AttributeError, KeyError, TypeError, ValueError)


def _flag_error_message(e: Exception, argv: list[str]) -> str:
  """The one line for an error raised while reading the flags; re-raises what is a bug rather than bad input."""
  user_error = _innermost_user_error(e)
  if user_error is not None:
    return str(user_error)
  if isinstance(e, (AttributeError, KeyError)) and any(re.match(r'--?\w+\.', a) for a in argv[1:]):
    return _override_typo(e, argv)
  if isinstance(e, flags.Error) and 'Error whilst parsing config file' not in str(e):  # else a bug: traceback
    return str(e).strip().split('\n')[0]
  raise e


def _exit_with(message: str):
  logging.flush()
  print(f'error: {message}', file=sys.stderr)
  sys.exit(2)


def parse_flags(argv: list[str]) -> list[str]:
  """app.run's flags parser: a bad flag or config argument is one line on stderr and exit status 2."""
  try:
    rest = flags.FLAGS(argv)
  except _FLAG_ERRORS as e:
    _exit_with(_flag_error_message(e, argv))
  message = _unloadable_config()
  if message is not None:
    _exit_with(message)
  return rest


def define_config_file(name: str, default: str | None, help_string: str):
  """config_flags.DEFINE_config_file, for a flag with a default: ml_collections then loads the default and applies
  the --NAME.FIELD overrides of sys.argv at once, before app.run, so a typo there is caught here."""
  from ml_collections import config_flags  # pylint: disable=g-import-not-at-top
  try:
    return config_flags.DEFINE_config_file(name, default, help_string)
  except _FLAG_ERRORS as e:
    _exit_with(_flag_error_message(e, sys.argv))


def set_defaults(defaults: dict) -> None:
  """Parses defaults[name] (command-line text) into each flag the command line did not set: the defaults of the
  mode or plan a script runs, where its modes share a flag's name but not its default (--ks, --config)."""
  for name, text in defaults.items():
    if not flags.FLAGS[name].present:
      try:
        flags.FLAGS[name].parse(text)
      except _FLAG_ERRORS as e:
        _exit_with(_flag_error_message(e, sys.argv))
  message = _unloadable_config()
  if message is not None:
    _exit_with(message)


def per_mode_help(mode_defaults: dict, name: str, option: str = 'mode') -> str:
  """The end of a flag's help whose default set_defaults gives per mode: 'Default per --mode: a 1,2; b 4.'"""
  return (f'Default per --{option}: ' + '; '.join(f'{mode} {d[name] or "(empty)"}' for mode, d in mode_defaults.items()
                                                if name in d) + '.')
