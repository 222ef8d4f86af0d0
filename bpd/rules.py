"""The acceptance rules a decode can name (config.decode.criteria): the one registration a new rule adds (DESIGN,
"Adding an acceptance rule"). A criterion names its rule by a word of its spec; a spec that names none is one of
the paper's greedy criteria (decoding.Criterion: 'exact', 'top_k:T', 'distance:EPS', 'min_block:L', and a check
joined with a minimum block by '+')."""

from bpd import decoding
from bpd import speculative
from bpd.errors import UserError

# word -> parser(spec, k, sampling): the rule of a spec with this word in it ('speculative', 'speculative:block').
# k: the model's heads (None: not known); sampling: the config's temperature, top_k and top_p, for rules that draw.
REGISTRY = {
    speculative.CRITERION: lambda spec, k, sampling: speculative.parse(spec, **sampling),
}


def parse(spec, k: int | None = None, temperature: float = 0.0, top_k: int = 0, top_p: float = 1.0):
  """The rule of one config.decode.criteria entry, or UserError naming what is wrong before anything compiles."""
  words = {part.strip().partition(':')[0] for part in str(spec).split('+')}
  named = sorted(words & set(REGISTRY))
  if not named:
    return decoding.parse_criterion(spec, k)
  if len(named) > 1:
    raise UserError(f'Criterion {spec!r} joins the rules {named}: a criterion is one rule.')
  return REGISTRY[named[0]](spec, k, dict(temperature=temperature, top_k=top_k, top_p=top_p))
