"""Builds the skinny-matmul library (skinny_*.cc) with the system's C++ compiler into a cache directory, once.

The library is keyed by a hash of its sources, the compiler and jaxlib's FFI headers, so a change to any of them
builds a new one; concurrent builders (test workers) each compile into a private directory and rename into place.
`python -m bpd.kernels.build` builds it ahead of time and prints its path.
"""

import hashlib
import os
import pathlib
import shutil
import subprocess
import sys
import tempfile

HERE = pathlib.Path(__file__).parent
SOURCES = ('skinny_avx512.cc', 'skinny_avx2.cc', 'skinny_ffi.cc')
HEADERS = ('skinny_matmul.h', 'skinny_units.h')
# Per file: the instruction set its functions are compiled for (the dispatcher picks one at run time).
ISA_FLAGS = {'skinny_avx512.cc': ['-mavx512f', '-mfma'], 'skinny_avx2.cc': ['-mavx2', '-mfma', '-mf16c'],
             'skinny_ffi.cc': []}
# -ffp-contract=off: no fused multiply-add beyond the kernels' explicit ones, so that each output's sum is the one
# the source spells out, whatever the compiler decides.
COMMON_FLAGS = ['-O3', '-std=c++17', '-fPIC', '-ffp-contract=off', '-w']
LIBRARY = 'libbpd_skinny.so'


class BuildError(RuntimeError):
  """The library could not be built here (no compiler, or it failed): the message says why."""


def compiler() -> str:
  cxx = os.environ.get('CXX') or shutil.which('g++') or shutil.which('c++') or shutil.which('clang++')
  if not cxx:
    raise BuildError('no C++ compiler found (set CXX, or install g++: apt-get install g++)')
  return cxx


def cache_dir() -> pathlib.Path:
  root = os.environ.get('BPD_KERNEL_CACHE') or os.path.join(os.environ.get('XDG_CACHE_HOME') or
                                                            os.path.expanduser('~/.cache'), 'bpd', 'kernels')
  return pathlib.Path(root)


def _key(cxx: str, include_dir: str) -> str:
  h = hashlib.sha256()
  for name in SOURCES + HEADERS:
    h.update((HERE / name).read_bytes())
  for header in ('api.h', 'ffi.h', 'c_api.h'):
    path = pathlib.Path(include_dir, 'xla', 'ffi', 'api', header)
    h.update(path.read_bytes() if path.exists() else b'')
  h.update(_run([cxx, '--version']).encode())
  h.update(' '.join(COMMON_FLAGS).encode())
  return h.hexdigest()[:16]


def library_path() -> pathlib.Path:
  """The built library, building it first if this machine has none for these sources."""
  import jax  # pylint: disable=import-outside-toplevel
  include_dir = jax.ffi.include_dir()
  cxx = compiler()
  target = cache_dir() / _key(cxx, include_dir) / LIBRARY
  if target.exists():
    return target
  target.parent.mkdir(parents=True, exist_ok=True)
  with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
    objects = []
    for name in SOURCES:
      obj = os.path.join(tmp, name + '.o')
      cmd = [cxx, *COMMON_FLAGS, *ISA_FLAGS[name], f'-I{include_dir}', '-c', str(HERE / name), '-o', obj]
      _run(cmd)
      objects.append(obj)
    lib = os.path.join(tmp, LIBRARY)
    _run([cxx, '-shared', '-pthread', *objects, '-o', lib])
    os.replace(lib, target)  # atomic: a concurrent builder's identical library is replaced, never half-written
  return target


def _run(cmd) -> str:
  """cmd's standard output; BuildError if it cannot run or fails."""
  try:
    done = subprocess.run(cmd, capture_output=True, text=True)
  except OSError as e:
    raise BuildError(f'{cmd[0]} could not run ({e.strerror})') from e
  if done.returncode != 0:
    raise BuildError(f'{" ".join(cmd)} failed:\n{done.stderr[-2000:]}')
  return done.stdout


if __name__ == '__main__':
  try:
    print(library_path())
  except BuildError as e:
    sys.exit(f'bpd skinny matmul: {e}')
