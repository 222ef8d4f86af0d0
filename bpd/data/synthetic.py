"""A synthetic English -> German-like translation corpus, generated here, no download.

The source side comes from a small grammar in an English vocabulary of about 150 words: subjects, adjectives,
nouns, transitive and intransitive verbs, objects, prepositional phrases, numbers, sentence adverbs,
relative clauses and subordinate clauses. The target side is a rule-based German (real German words) with
the things that make translation more than a word-for-word lookup:

- gender, number and case agreement between article, adjective and noun
  ("the big dog" -> "der große Hund", "a big dog" as object -> "einen großen Hund", "with the big dogs" ->
  "mit den großen Hunden"), and contractions ("in the park" -> "im Park");
- verb-second order after a sentence adverb ("today the dog sleeps" -> "heute schläft der Hund");
- verb-final order in subordinate and relative clauses ("because the dog sees the cat" -> "weil der Hund die
  Katze sieht"), with commas around the German clauses.

`translate` is the rule: a deterministic function of the source sentence (it parses the source and renders
the German), so a model can learn the mapping exactly. `make_corpus` draws sentences from the grammar with a
seeded `random.Random`, which is stable across Python versions.
"""

import random

# Nouns: English singular, English plural, German singular, German plural, gender, animate.
# No noun has the same English singular and plural ("fish", "sheep"): the German number must follow from
# the English words alone.
_NOUNS = [
    ('man', 'men', 'Mann', 'Männer', 'm', True),
    ('woman', 'women', 'Frau', 'Frauen', 'f', True),
    ('child', 'children', 'Kind', 'Kinder', 'n', True),
    ('dog', 'dogs', 'Hund', 'Hunde', 'm', True),
    ('cat', 'cats', 'Katze', 'Katzen', 'f', True),
    ('horse', 'horses', 'Pferd', 'Pferde', 'n', True),
    ('bird', 'birds', 'Vogel', 'Vögel', 'm', True),
    ('teacher', 'teachers', 'Lehrer', 'Lehrer', 'm', True),
    ('pupil', 'pupils', 'Schüler', 'Schüler', 'm', True),
    ('doctor', 'doctors', 'Arzt', 'Ärzte', 'm', True),
    ('friend', 'friends', 'Freund', 'Freunde', 'm', True),
    ('girl', 'girls', 'Mädchen', 'Mädchen', 'n', True),
    ('baby', 'babies', 'Baby', 'Babys', 'n', True),
    ('cook', 'cooks', 'Koch', 'Köche', 'm', True),
    ('king', 'kings', 'König', 'Könige', 'm', True),
    ('queen', 'queens', 'Königin', 'Königinnen', 'f', True),
    ('mouse', 'mice', 'Maus', 'Mäuse', 'f', True),
    ('house', 'houses', 'Haus', 'Häuser', 'n', False),
    ('car', 'cars', 'Auto', 'Autos', 'n', False),
    ('book', 'books', 'Buch', 'Bücher', 'n', False),
    ('table', 'tables', 'Tisch', 'Tische', 'm', False),
    ('chair', 'chairs', 'Stuhl', 'Stühle', 'm', False),
    ('garden', 'gardens', 'Garten', 'Gärten', 'm', False),
    ('street', 'streets', 'Straße', 'Straßen', 'f', False),
    ('city', 'cities', 'Stadt', 'Städte', 'f', False),
    ('apple', 'apples', 'Apfel', 'Äpfel', 'm', False),
    ('ball', 'balls', 'Ball', 'Bälle', 'm', False),
    ('letter', 'letters', 'Brief', 'Briefe', 'm', False),
    ('flower', 'flowers', 'Blume', 'Blumen', 'f', False),
    ('tree', 'trees', 'Baum', 'Bäume', 'm', False),
    ('box', 'boxes', 'Kiste', 'Kisten', 'f', False),
    ('bag', 'bags', 'Tasche', 'Taschen', 'f', False),
    ('picture', 'pictures', 'Bild', 'Bilder', 'n', False),
    ('window', 'windows', 'Fenster', 'Fenster', 'n', False),
    ('door', 'doors', 'Tür', 'Türen', 'f', False),
    ('river', 'rivers', 'Fluss', 'Flüsse', 'm', False),
    ('park', 'parks', 'Park', 'Parks', 'm', False),
    ('shop', 'shops', 'Laden', 'Läden', 'm', False),
    ('school', 'schools', 'Schule', 'Schulen', 'f', False),
    ('boat', 'boats', 'Boot', 'Boote', 'n', False),
    ('cup', 'cups', 'Tasse', 'Tassen', 'f', False),
    ('key', 'keys', 'Schlüssel', 'Schlüssel', 'm', False),
    ('song', 'songs', 'Lied', 'Lieder', 'n', False),
    ('cake', 'cakes', 'Kuchen', 'Kuchen', 'm', False),
    ('hat', 'hats', 'Hut', 'Hüte', 'm', False),
    ('lamp', 'lamps', 'Lampe', 'Lampen', 'f', False),
]

# Adjectives: English -> German stem; the ending depends on article, gender, number and case.
_ADJECTIVES = {
    'big': 'groß', 'small': 'klein', 'old': 'alt', 'young': 'jung', 'red': 'rot', 'blue': 'blau',
    'green': 'grün', 'black': 'schwarz', 'white': 'weiß', 'fast': 'schnell', 'slow': 'langsam',
    'tired': 'müde', 'happy': 'glücklich', 'hungry': 'hungrig', 'loud': 'laut', 'quiet': 'leise',
    'beautiful': 'schön', 'new': 'neu', 'clever': 'klug', 'friendly': 'freundlich', 'cold': 'kalt',
    'warm': 'warm',
}

# Verbs: English 3rd singular, English plural, German 3rd singular, German plural.
# Every German verb here takes an accusative object, so the object case is always accusative.
_TRANSITIVE = [
    ('sees', 'see', 'sieht', 'sehen'), ('eats', 'eat', 'isst', 'essen'), ('likes', 'like', 'mag', 'mögen'),
    ('finds', 'find', 'findet', 'finden'), ('carries', 'carry', 'trägt', 'tragen'),
    ('buys', 'buy', 'kauft', 'kaufen'), ('paints', 'paint', 'malt', 'malen'),
    ('reads', 'read', 'liest', 'lesen'),
    ('hears', 'hear', 'hört', 'hören'), ('holds', 'hold', 'hält', 'halten'),
    ('watches', 'watch', 'beobachtet', 'beobachten'), ('visits', 'visit', 'besucht', 'besuchen'),
    ('takes', 'take', 'nimmt', 'nehmen'), ('washes', 'wash', 'wäscht', 'waschen'),
    ('builds', 'build', 'baut', 'bauen'), ('catches', 'catch', 'fängt', 'fangen'),
    ('needs', 'need', 'braucht', 'brauchen'),
]
_INTRANSITIVE = [
    ('sleeps', 'sleep', 'schläft', 'schlafen'), ('runs', 'run', 'läuft', 'laufen'),
    ('sings', 'sing', 'singt', 'singen'), ('waits', 'wait', 'wartet', 'warten'),
    ('plays', 'play', 'spielt', 'spielen'), ('laughs', 'laugh', 'lacht', 'lachen'),
    ('sits', 'sit', 'sitzt', 'sitzen'), ('works', 'work', 'arbeitet', 'arbeiten'),
    ('swims', 'swim', 'schwimmt', 'schwimmen'), ('dances', 'dance', 'tanzt', 'tanzen'),
]

# Prepositions here all take the dative (locations and companions).
_PREPOSITIONS = {
    'in': 'in', 'with': 'mit', 'on': 'auf', 'near': 'neben', 'from': 'von', 'under': 'unter',
    'behind': 'hinter', 'at': 'an',
}
# German merges preposition + "dem": "in dem Park" -> "im Park".
_CONTRACTIONS = {('in', 'dem'): 'im', ('von', 'dem'): 'vom', ('an', 'dem'): 'am'}
_ADVERBS = {'today': 'heute', 'now': 'jetzt', 'often': 'oft', 'sometimes': 'manchmal', 'tomorrow': 'morgen'}
_CONJUNCTIONS = {'because': 'weil', 'when': 'wenn', 'while': 'während', 'although': 'obwohl'}
_NUMBERS = {'two': 'zwei', 'three': 'drei', 'four': 'vier', 'five': 'fünf'}

# Determiners: English word -> (German kind, German stem, English number: 'sg', 'pl' or 'any').
# Kinds: 'def' (der-words, weak adjective endings), 'ein' (ein-words, mixed endings), 'none' (no article
# inflection of its own; strong plural adjective endings).
_DETERMINERS = {
    'the': ('def', None, 'any'), 'this': ('dies', 'dies', 'sg'), 'these': ('dies', 'dies', 'pl'),
    'a': ('ein', 'ein', 'sg'), 'an': ('ein', 'ein', 'sg'), 'my': ('ein', 'mein', 'any'),
    'many': ('viel', 'viel', 'pl'),
}
_DETERMINERS.update({n: ('number', de, 'pl') for n, de in _NUMBERS.items()})

# Inflection tables, indexed [case][gender or 'pl'].
_DEFINITE = {
    'nom': {'m': 'der', 'f': 'die', 'n': 'das', 'pl': 'die'},
    'acc': {'m': 'den', 'f': 'die', 'n': 'das', 'pl': 'die'},
    'dat': {'m': 'dem', 'f': 'der', 'n': 'dem', 'pl': 'den'},
}
_DIES_ENDING = {
    'nom': {'m': 'er', 'f': 'e', 'n': 'es', 'pl': 'e'},
    'acc': {'m': 'en', 'f': 'e', 'n': 'es', 'pl': 'e'},
    'dat': {'m': 'em', 'f': 'er', 'n': 'em', 'pl': 'en'},
}
_EIN_ENDING = {
    'nom': {'m': '', 'f': 'e', 'n': '', 'pl': 'e'},
    'acc': {'m': 'en', 'f': 'e', 'n': '', 'pl': 'e'},
    'dat': {'m': 'em', 'f': 'er', 'n': 'em', 'pl': 'en'},
}
_WEAK_ADJ = {  # After a der-word, whose own ending already shows case and gender.
    'nom': {'m': 'e', 'f': 'e', 'n': 'e', 'pl': 'en'},
    'acc': {'m': 'en', 'f': 'e', 'n': 'e', 'pl': 'en'},
    'dat': {'m': 'en', 'f': 'en', 'n': 'en', 'pl': 'en'},
}
_MIXED_ADJ = {  # After an ein-word: the adjective shows gender where "ein" has no ending.
    'nom': {'m': 'er', 'f': 'e', 'n': 'es', 'pl': 'en'},
    'acc': {'m': 'en', 'f': 'e', 'n': 'es', 'pl': 'en'},
    'dat': {'m': 'en', 'f': 'en', 'n': 'en', 'pl': 'en'},
}
# No article (numbers, "many"): the adjective and "viel" show the case themselves.
_STRONG_PLURAL = {'nom': 'e', 'acc': 'e', 'dat': 'en'}

_NOUN_SG = {n[0]: n for n in _NOUNS}
_NOUN_PL = {n[1]: n for n in _NOUNS}
_VERB_SG = {v[0]: v for v in _TRANSITIVE + _INTRANSITIVE}
_VERB_PL = {v[1]: v for v in _TRANSITIVE + _INTRANSITIVE}
_TRANSITIVE_WORDS = {w for v in _TRANSITIVE for w in v[:2]}

MIN_WORDS = 4
MAX_WORDS = 20


def source_vocabulary() -> set[str]:
  """All English words the grammar can produce (lowercase, without punctuation)."""
  words = set(_NOUN_SG) | set(_NOUN_PL) | set(_VERB_SG) | set(_VERB_PL) | set(_ADJECTIVES)
  words |= set(_PREPOSITIONS) | set(_ADVERBS) | set(_CONJUNCTIONS) | set(_DETERMINERS) | {'that'}
  return words


# ---------------------------------------------------------------------------------------------------------
# Parsing the source. A noun phrase is a dict: det, adj (or None), noun (a _NOUNS entry), plural, rel (or
# None). A relative clause is (verb entry, object noun phrase or None). A clause is a dict: subj, verb, obj,
# pp = (preposition, noun phrase) or None.


class _Words:
  """The words of a source sentence and a read position."""

  def __init__(self, words: list[str], sentence: str):
    self.words = words
    self.sentence = sentence
    self.pos = 0

  def peek(self) -> str | None:
    return self.words[self.pos] if self.pos < len(self.words) else None

  def take(self) -> str:
    word = self.peek()
    if word is None:
      self.fail('sentence ends too early')
    self.pos += 1
    return word

  def fail(self, why: str):
    raise ValueError(f'not a sentence of the synthetic grammar ({why} at word {self.pos}): {self.sentence!r}')


def _parse_np(words: _Words, allow_rel: bool) -> dict:
  det = words.take()
  if det not in _DETERMINERS:
    words.fail(f'expected a determiner, got {det!r}')
  adj = words.take() if words.peek() in _ADJECTIVES else None
  noun_word = words.take()
  if noun_word in _NOUN_SG:
    noun, plural = _NOUN_SG[noun_word], False
  elif noun_word in _NOUN_PL:
    noun, plural = _NOUN_PL[noun_word], True
  else:
    words.fail(f'expected a noun, got {noun_word!r}')
  det_number = _DETERMINERS[det][2]
  if det_number != 'any' and det_number != ('pl' if plural else 'sg'):
    words.fail(f'{det!r} does not agree with {noun_word!r}')
  rel = None
  if allow_rel and words.peek() == 'that':
    words.take()
    verb = _parse_verb(words, plural)
    rel = (verb, _parse_np(words, allow_rel=False) if verb[0] in _TRANSITIVE_WORDS else None)
  return {'det': det, 'adj': adj, 'noun': noun, 'plural': plural, 'rel': rel}


def _parse_verb(words: _Words, plural: bool) -> tuple:
  word = words.take()
  verb = (_VERB_PL if plural else _VERB_SG).get(word)
  if verb is None:
    words.fail(f'expected a verb agreeing with the subject, got {word!r}')
  return verb


def _parse_clause(words: _Words, allow_rel: bool) -> dict:
  subj = _parse_np(words, allow_rel)
  verb = _parse_verb(words, subj['plural'])
  obj = _parse_np(words, allow_rel) if verb[0] in _TRANSITIVE_WORDS else None
  pp = None
  if words.peek() in _PREPOSITIONS:
    prep = words.take()
    pp = (prep, _parse_np(words, allow_rel=False))
  return {'subj': subj, 'verb': verb, 'obj': obj, 'pp': pp}


# ---------------------------------------------------------------------------------------------------------
# Rendering the German.


def _with_ending(stem: str, ending: str) -> str:
  # "müde" + "en" -> "müden", not "müdeen".
  if stem.endswith('e') and ending.startswith('e'):
    return stem + ending[1:]
  return stem + ending


def _render_np(np_: dict, case: str) -> list[str]:
  """German words of a noun phrase in `case` ('nom', 'acc' or 'dat')."""
  gender = 'pl' if np_['plural'] else np_['noun'][4]
  kind, stem, _ = _DETERMINERS[np_['det']]
  if kind == 'def':
    out, adj_table = [_DEFINITE[case][gender]], _WEAK_ADJ
  elif kind == 'dies':
    out, adj_table = [stem + _DIES_ENDING[case][gender]], _WEAK_ADJ
  elif kind == 'ein':
    out, adj_table = [stem + _EIN_ENDING[case][gender]], _MIXED_ADJ
  elif kind == 'viel':
    out, adj_table = [stem + _STRONG_PLURAL[case]], None
  else:  # A number: "zwei" does not inflect.
    out, adj_table = [stem], None
  if np_['adj'] is not None:
    ending = adj_table[case][gender] if adj_table else _STRONG_PLURAL[case]
    out.append(_with_ending(_ADJECTIVES[np_['adj']], ending))
  noun = np_['noun'][3] if np_['plural'] else np_['noun'][2]
  if np_['plural'] and case == 'dat' and not noun.endswith(('n', 's')):
    noun += 'n'  # Dative plural: "mit den Hunden".
  out.append(noun)
  if np_['rel'] is not None:
    # Subject relative clause, verb last: "der Hund, der die Katze sieht,".
    verb, obj = np_['rel']
    out += [',', _DEFINITE['nom'][gender]]
    if obj is not None:
      out += _render_np(obj, 'acc')
    out += [verb[3] if np_['plural'] else verb[2], ',']
  return out


def _render_pp(pp: tuple) -> list[str]:
  prep, np_ = pp
  words = [_PREPOSITIONS[prep]] + _render_np(np_, 'dat')
  merged = _CONTRACTIONS.get((words[0], words[1]))
  return [merged] + words[2:] if merged else words


def _render_clause(clause: dict, order: str) -> list[str]:
  """`order`: 'svo' (main clause), 'vso' (after a sentence adverb: verb second), 'sov' (subordinate)."""
  verb = [clause['verb'][3] if clause['subj']['plural'] else clause['verb'][2]]
  subj = _render_np(clause['subj'], 'nom')
  rest = _render_np(clause['obj'], 'acc') if clause['obj'] else []
  if clause['pp']:
    rest += _render_pp(clause['pp'])
  if order == 'svo':
    return subj + verb + rest
  if order == 'vso':
    return verb + subj + rest
  return subj + rest + verb


def _join(tokens: list[str]) -> str:
  """Joins words, attaching commas and the full stop; a comma before another mark is dropped."""
  out = []
  for token in tokens:
    if token in (',', '.'):
      if out and out[-1].endswith(','):
        out[-1] = out[-1][:-1]
      out[-1] += token
    else:
      out.append(token)
  text = ' '.join(out)
  return text[0].upper() + text[1:]


def translate(src: str) -> str:
  """Translates one source sentence of the grammar into the German-like target language.

  Raises ValueError if `src` is not a sentence the grammar can produce.
  """
  text = src.strip()
  if not text.endswith('.'):
    raise ValueError(f'not a sentence of the synthetic grammar (no final "."): {src!r}')
  words = text[:-1].split()
  if words:
    words[0] = words[0].lower()  # Only the sentence start is capitalised in English here.
  words = _Words(words, src)
  adverb = words.take() if words.peek() in _ADVERBS else None
  main = _parse_clause(words, allow_rel=True)
  sub = None
  if words.peek() in _CONJUNCTIONS:
    conj = words.take()
    sub = (conj, _parse_clause(words, allow_rel=False))
  if words.peek() is not None:
    words.fail(f'unexpected {words.peek()!r}')

  if adverb:
    tokens = [_ADVERBS[adverb]] + _render_clause(main, 'vso')
  else:
    tokens = _render_clause(main, 'svo')
  if sub:
    tokens += [',', _CONJUNCTIONS[sub[0]]] + _render_clause(sub[1], 'sov')
  return _join(tokens + ['.'])


# ---------------------------------------------------------------------------------------------------------
# Sampling source sentences.


def _sample_np(rng: random.Random, animate: bool) -> tuple[list[str], bool]:
  """English words of a random noun phrase (no relative clause), and whether it is plural."""
  noun = rng.choice([n for n in _NOUNS if n[5]] if animate else _NOUNS)
  r = rng.random()
  if r < 0.40:
    det = 'the'
    plural = rng.random() < 0.3
  elif r < 0.65:
    det, plural = 'a', False
  elif r < 0.75:
    det = 'my'
    plural = rng.random() < 0.3
  elif r < 0.85:
    plural = rng.random() < 0.4
    det = 'these' if plural else 'this'
  else:
    det, plural = rng.choice(sorted(_NUMBERS) + ['many']), True
  words = [rng.choice(sorted(_ADJECTIVES))] if rng.random() < 0.35 else []
  words.append(noun[1] if plural else noun[0])
  if det == 'a' and words[0][0] in 'aeiou':
    det = 'an'
  return [det] + words, plural


def _sample_verb(rng: random.Random, plural: bool, transitive: bool) -> str:
  verb = rng.choice(_TRANSITIVE if transitive else _INTRANSITIVE)
  return verb[1] if plural else verb[0]


def _sample_relative(rng: random.Random, plural: bool) -> list[str]:
  transitive = rng.random() < 0.6
  words = ['that', _sample_verb(rng, plural, transitive)]
  if transitive:
    words += _sample_np(rng, animate=False)[0]
  return words


def _sample_clause(rng: random.Random, allow_rel: bool) -> list[str]:
  subj, plural = _sample_np(rng, animate=True)
  if allow_rel and rng.random() < 0.12:
    subj += _sample_relative(rng, plural)
  transitive = rng.random() < 0.65
  words = subj + [_sample_verb(rng, plural, transitive)]
  obj_rel = False
  if transitive:
    obj, obj_plural = _sample_np(rng, animate=False)
    # An object relative clause ends the clause: a following prepositional phrase could belong to
    # either clause, and the German word order would differ.
    obj_rel = allow_rel and rng.random() < 0.15
    words += obj + (_sample_relative(rng, obj_plural) if obj_rel else [])
  if not obj_rel and rng.random() < 0.4:
    words += [rng.choice(sorted(_PREPOSITIONS))] + _sample_np(rng, animate=False)[0]
  return words


def sample_sentence(rng: random.Random) -> str:
  """One random English sentence of the grammar, MIN_WORDS..MAX_WORDS words, capitalised, with a "."."""
  while True:
    words = [rng.choice(sorted(_ADVERBS))] if rng.random() < 0.15 else []
    words += _sample_clause(rng, allow_rel=True)
    if rng.random() < 0.3:
      words += [rng.choice(sorted(_CONJUNCTIONS))] + _sample_clause(rng, allow_rel=False)
    if MIN_WORDS <= len(words) <= MAX_WORDS:
      text = ' '.join(words)
      return text[0].upper() + text[1:] + '.'


def make_corpus(seed: int, num_train: int = 20000, num_val: int = 500,
                num_test: int = 500) -> dict[str, tuple[list[str], list[str]]]:
  """Draws distinct source sentences and their translations, the same for the same arguments.

  Returns {'train': (src, tgt), 'val': (src, tgt), 'test': (src, tgt)}. No source sentence appears twice, so
  no val or test sentence is in train.
  """
  rng = random.Random(seed)
  total = num_train + num_val + num_test
  sources = {}  # A dict keeps the draw order (a set would not).
  for _ in range(100 * total + 1000):
    if len(sources) == total:
      break
    sources.setdefault(sample_sentence(rng), None)
  else:
    raise ValueError(f'could not draw {total} distinct sentences from the synthetic grammar')
  sources = list(sources)
  splits = {
      'val': sources[:num_val],
      'test': sources[num_val:num_val + num_test],
      'train': sources[num_val + num_test:],
  }
  return {name: (src, [translate(s) for s in src]) for name, src in splits.items()}
