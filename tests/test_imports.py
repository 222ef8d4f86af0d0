"""No import circles inside bpd/: a module never imports, directly or through others, a module importing it back.

A circle works only while every import in it stays at a function's top or inside a function (Python hands back
a half-initialized module otherwise), so it breaks when someone tidies an import to the top of the file; and
modules in a circle cannot be read, tested or reused one at a time. The graph is read from the source with `ast`,
imports nested inside functions included, so the test needs no import of the package.
"""

import ast
import os

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def module_files(root, package):
  """{dotted module name: path} of every .py file under root/package (package __init__ files by their package)."""
  files = {}
  for folder, _, names in os.walk(os.path.join(root, package)):
    for name in names:
      if name.endswith('.py'):
        rel = os.path.relpath(os.path.join(folder, name), root)[:-len('.py')].split(os.sep)
        files['.'.join(rel[:-1] if rel[-1] == '__init__' else rel)] = os.path.join(folder, name)
  return files


def imported_modules(path, module, known):
  """The modules of `known` that the file at `path` (module `module`) imports anywhere in its body."""
  is_package = os.path.basename(path) == '__init__.py'
  found = set()
  for node in ast.walk(ast.parse(open(path, encoding='utf-8').read(), path)):
    if isinstance(node, ast.Import):
      candidates = [alias.name for alias in node.names]
    elif isinstance(node, ast.ImportFrom):
      base = node.module or ''
      if node.level:  # relative: from . import x, from ..data import y
        parts = module.split('.')[:len(module.split('.')) - node.level + (1 if is_package else 0)]
        base = '.'.join(parts + ([base] if base else []))
      # `from pkg import name`: name is a submodule if such a file exists, else an attribute of pkg.
      candidates = [f'{base}.{alias.name}' if f'{base}.{alias.name}' in known else base for alias in node.names]
    else:
      continue
    for name in candidates:
      while name and name not in known:  # `import bpd.data.images` names the module; keep the longest known prefix
        name = name.rpartition('.')[0]
      if name and name != module and known[name] and not known[name].endswith('__init__.py'):
        found.add(name)
  return found


def import_graph(root, package):
  known = module_files(root, package)
  return {module: imported_modules(path, module, known) for module, path in known.items()}


def find_cycle(graph):
  """One import circle as a list [a, b, ..., a], or None. Depth-first search with colours."""
  state, stack = {}, []

  def visit(node):
    state[node] = 'open'
    stack.append(node)
    for nxt in sorted(graph.get(node, ())):
      if state.get(nxt) == 'open':
        return stack[stack.index(nxt):] + [nxt]
      if nxt not in state:
        cycle = visit(nxt)
        if cycle:
          return cycle
    stack.pop()
    state[node] = 'done'
    return None

  for node in sorted(graph):
    if node not in state:
      cycle = visit(node)
      if cycle:
        return cycle
  return None


def test_bpd_has_no_import_circle():
  graph = import_graph(REPO, 'bpd')
  assert 'bpd.evaluate' in graph and 'bpd.data.pipeline' in graph  # the walk found the package
  assert 'bpd.tasks' in graph['bpd.evaluate']  # nested and top-level imports are both read
  cycle = find_cycle(graph)
  assert cycle is None, ('import circle: ' + ' -> '.join(cycle) + '. Move what both sides need into a module '
                         'that imports neither (as bpd/decoder.py does for the decode sweep and training).')


@pytest.mark.parametrize('b_imports, cycle', [
    ('def f():\n  from pkg import a\n', ['pkg.a', 'pkg.b', 'pkg.a']),  # nested in a function
    ('from . import c\n', ['pkg.a', 'pkg.b', 'pkg.c', 'pkg.a']),  # relative, through a third module
    ('import pkg.sub.d\n', None),  # d does not import back
])
def test_the_checker_finds_circles_nested_relative_and_indirect(tmp_path, b_imports, cycle):
  """The checker itself, on a throwaway package: a imports b; b imports as given; c imports a; d imports nothing."""
  pkg = tmp_path / 'pkg'
  (pkg / 'sub').mkdir(parents=True)
  for name, text in {'__init__': '', 'a': 'from pkg import b\n', 'b': b_imports, 'c': 'import pkg.a as a\n',
                     'sub/__init__': '', 'sub/d': 'import os\n'}.items():
    (pkg / f'{name}.py').write_text(text)
  assert find_cycle(import_graph(str(tmp_path), 'pkg')) == cycle


# The modules that read the experiment's ConfigDict (DESIGN §4, "Where the config goes"): the command line and its
# three modes, the checks of the config, and the task record chosen from it (with the data pipeline and the image
# task's side that it calls). Everything else takes plain arguments, so a researcher can call it without a config.
READS_THE_CONFIG = {'bpd.main', 'bpd.train', 'bpd.evaluate', 'bpd.distill', 'bpd.checks', 'bpd.tasks',
                    'bpd.evaluate_images', 'bpd.data.pipeline'}
_CONFIG_FIELDS = {'data', 'decode', 'train', 'model', 'distill', 'checkpoint_step', 'seed'}


def reads_of_the_config(path):
  """Lines where the file reads a field of the experiment's ConfigDict (config.decode..., data_config.dir):
  attribute reads on a name `config` whose field is one of the ConfigDict's sections, or on the sections' usual
  names."""
  found = []
  for node in ast.walk(ast.parse(open(path, encoding='utf-8').read(), path)):
    if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and (
        (node.value.id == 'config' and node.attr in _CONFIG_FIELDS) or
        node.value.id in ('data_config', 'distill_config', 'decode_config', 'train_config')):
      found.append(node.lineno)
  return found


def test_the_config_stops_at_the_modules_that_read_it():
  known = module_files(REPO, 'bpd')
  readers = {module: lines for module, path in known.items() if (lines := reads_of_the_config(path))}
  assert set(readers) <= READS_THE_CONFIG, {m: lines for m, lines in readers.items() if m not in READS_THE_CONFIG}
  assert {'bpd.train', 'bpd.evaluate', 'bpd.checks'} <= set(readers)  # the check sees reads where they are
