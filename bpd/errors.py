"""The one exception type for bad user input.

Anything a user can fix (a flag, a file, a config field) raises `UserError` with a message that names the
offending flag or file and says how to fix it. The entry points (`bpd.main`, the study scripts) print the message
alone through `exit_on_user_error` (no traceback) and exit with status 2. Raise it before compiling or
training, so that nothing already written is touched.
"""

import sys

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

