"""The drafters a decode can name (config.decode.drafter): the one registration a new drafter adds (DESIGN,
"Adding a drafter"). 'heads' is the model's own proposal heads (the paper's; None to the loop)."""

from bpd import prompt_lookup
from bpd.errors import UserError

# name -> the drafter made from the spec's argument (the text after ':', None without one)
REGISTRY = {
    'prompt_lookup': lambda arg: prompt_lookup.PromptLookup() if arg is None else prompt_lookup.PromptLookup(
        max_ngram=_integer(arg, 'prompt_lookup')),
}

HELP = prompt_lookup.HELP


def _integer(text: str, name: str) -> int:
  try:
    return int(text)
  except ValueError:
    raise UserError(f'Drafter {name}:{text}: {text!r} is not an integer; {HELP}.') from None


def parse(spec: str):
  """'heads' -> None (the loop's default drafter, the model's heads); 'prompt_lookup:3' -> its drafter. UserError
  for a name no drafter is registered under."""
  name, _, arg = str(spec).strip().partition(':')
  if name == 'heads' and not arg:
    return None
  if name not in REGISTRY:
    raise UserError(f'Unknown drafter {spec!r}: {HELP}.')
  return REGISTRY[name](arg or None)
