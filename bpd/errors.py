"""The one exception type for bad user input.

Anything a user can fix (a flag, a file, a config field) raises `UserError` with a message that names the
offending flag or file and says how to fix it. `bpd.main` prints the message alone (no traceback) and exits
non-zero. Raise it before compiling or training, so that nothing already written is touched.
"""


class UserError(ValueError):
  """Bad input that the user can fix; the message says what is wrong and how to fix it."""
