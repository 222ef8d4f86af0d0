"""Code comments and the README cite the design notes as "DESIGN §n": every cited section exists in docs/DESIGN.md."""

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
