"""What code comments and docs cite exists: DESIGN §n sections, README headings, linked and named docs files.

The README stays short (results live in docs/results/, one record per study, each linked from it).
"""

import os
import re

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_design_citations_point_at_existing_sections():
  design = open(os.path.join(REPO, 'docs', 'DESIGN.md'), encoding='utf-8').read()
  sections = {int(n) for n in re.findall(r'^## (\d+)\. ', design, flags=re.M)}
  assert sections == set(range(1, max(sections) + 1)), sections  # numbered 1..n without gaps
  cited = {}
  paths = [os.path.join(REPO, 'README.md')]
  for folder in ('bpd', 'configs', 'experiments', 'launch', 'tests'):
    for root, _, names in os.walk(os.path.join(REPO, folder)):
      paths += [os.path.join(root, n) for n in names if n.endswith(('.py', '.sh', '.md'))]
  for path in paths:
    for n in re.findall(r'DESIGN §(\d+)', open(path, encoding='utf-8').read()):
      cited.setdefault(int(n), []).append(os.path.relpath(path, REPO))
  assert cited, 'no citations found: has the citation style changed?'
  missing = {n: where for n, where in cited.items() if n not in sections}
  assert not missing, f'DESIGN sections cited but absent from docs/DESIGN.md: {missing}'


def _code_and_docs_paths():
  paths = []
  for folder in ('bpd', 'configs', 'experiments', 'launch', 'tests'):
    for root, _, names in os.walk(os.path.join(REPO, folder)):
      paths += [os.path.join(root, n) for n in names if n.endswith(('.py', '.sh', '.md'))]
  for root, _, names in os.walk(os.path.join(REPO, 'docs')):
    paths += [os.path.join(root, n) for n in names if n.endswith('.md')]
  return [p for p in paths if os.path.basename(p) != 'test_docs.py']


def _readme():
  return open(os.path.join(REPO, 'README.md'), encoding='utf-8').read()


# A citation of a README heading: README, "Output prior" / README "Training" / README, Super-resolution, "Co-located
# input" (an unquoted piece counts when it starts with a capital: "README, Super-resolution: a model ..." cites
# "Super-resolution"; "README at commit ..." cites nothing).
_PIECE = r'(?:"[^"\n]+"|[A-Z][^,.;:()"\n]*)'
_README_CITATION = re.compile(rf'README(?:, | )({_PIECE}(?:, {_PIECE})*)')


def test_readme_headings_cited_in_code_and_docs_exist():
  headings = {h.strip() for h in re.findall(r'^#+ (.+)$', _readme(), flags=re.M)}
  cited = {}
  for path in _code_and_docs_paths():
    text = re.sub(r'\s*\n\s*#?\s*', ' ', open(path, encoding='utf-8').read())  # citations may wrap lines
    for match in _README_CITATION.finditer(text):
      for piece in re.findall(_PIECE, match.group(1)):
        cited.setdefault(piece.strip('"').strip(), set()).add(os.path.relpath(path, REPO))
  assert {'Output prior', 'Co-located input'} <= set(cited), sorted(cited)  # the citation style still parses
  missing = {heading: sorted(where) for heading, where in cited.items() if heading not in headings}
  assert not missing, f'README headings cited but absent from README.md: {missing}'


def test_relative_links_and_cited_docs_exist():
  broken = []
  for path in [os.path.join(REPO, 'README.md')] + _code_and_docs_paths():
    text = open(path, encoding='utf-8').read()
    if path.endswith('.md'):  # markdown links, relative to the file
      for target in re.findall(r'\]\(([^)\s]+)\)', text):
        if not re.match(r'[a-z]+:', target) and not target.startswith('#'):
          if not os.path.exists(os.path.join(os.path.dirname(path), target.split('#')[0])):
            broken.append((os.path.relpath(path, REPO), target))
    for target in re.findall(r'(?<![\w/.])docs/[\w/.-]*\w\.(?:md|png)', text):  # paths cited from the repo root
      if not os.path.exists(os.path.join(REPO, target)):
        broken.append((os.path.relpath(path, REPO), target))
  assert not broken, f'links to files that do not exist: {broken}'


def test_readme_is_short_and_links_every_results_record():
  readme = _readme()
  assert len(readme) <= 20_000, len(readme)
  records = sorted(n for n in os.listdir(os.path.join(REPO, 'docs', 'results')) if n.endswith('.md'))
  assert records and all(f'](docs/results/{n})' in readme for n in records), records
