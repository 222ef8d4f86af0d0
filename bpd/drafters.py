"""The drafters a decode can name (config.decode.drafter): the one registration a new drafter adds (DESIGN,
"Adding a drafter"). 'heads' is the model's own proposal heads (the paper's; decoding.HEADS, the loop's default)."""

from bpd import decoding
from bpd import prompt_lookup
from bpd.errors import UserError

# name -> the drafter made from the spec's argument (the text after ':', None without one)
REGISTRY = {
    'heads': lambda arg: decoding.HEADS if arg is None else _no_argument('heads', arg),
    'prompt_lookup': lambda arg: prompt_lookup.PromptLookup() if arg is None else prompt_lookup.PromptLookup(
        max_ngram=_integer(arg, 'prompt_lookup')),
}

HELP = prompt_lookup.HELP


def _integer(text: str, name: str) -> int:
  try:
    return int(text)
  except ValueError:
    raise UserError(f'Drafter {name}:{text}: {text!r} is not an integer; {HELP}.') from None


def _no_argument(name: str, arg: str):
  raise UserError(f'Drafter {name}:{arg}: {name} takes no argument; {HELP}.')


def parse(spec: str):
  """'heads' -> decoding.HEADS (the model's heads, the loop's default); 'prompt_lookup:3' -> its drafter. UserError
  for a name no drafter is registered under."""
  name, _, arg = str(spec).strip().partition(':')
  if name not in REGISTRY:
    raise UserError(f'Unknown drafter {spec!r}: {HELP}.')
  return REGISTRY[name](arg or None)
