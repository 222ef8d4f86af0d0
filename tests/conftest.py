"""Shared fixtures: a tiny real Transformer trained for a few seconds on a toy task.

A freshly initialized model with tied embeddings repeats its input token forever, which makes decoding
tests trivial. A few hundred Adam steps on "reverse the source" give a model whose outputs depend on the
prefix, that emits EOS, and whose extra heads are right only part of the time: a fair test subject.
Training goes a little differently on every CPU (float rounding), so tests assert only what holds for any
such run, with wide margins (tests/test_model.py, test_trained_toy_model_is_a_fair_test_subject).
The image subject is built without training instead (tests/test_local_attention.py, image_model).
"""

import hashlib
import os
import tempfile


def _kernel_sources_hash() -> str:
  """A hash of the skinny-matmul kernel's sources: programs that call the kernel are cached per kernel version, so
  that no executable compiled against another build of the library is ever loaded."""
  folder = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), 'bpd', 'kernels')
  digest = hashlib.sha256()
  for name in sorted(os.listdir(folder)):
    if name.endswith(('.cc', '.h')):
      with open(os.path.join(folder, name), 'rb') as f:
        digest.update(f.read())
  return digest.hexdigest()[:12]


# Compiles are most of the suite's time, and many programs recur: the tiny config trained and decoded by several
# end-to-end tests, a Decoder rebuilt per sweep, the command-line tests' subprocesses (they inherit these variables).
# A persistent XLA cache shares them; its keys hold the program, the flags and the jax version, so a hit is the
# same executable a compile would give. One folder per xdist worker: jax writes an entry in place, without a lock
# unless the cache has a size limit, so a process that read an entry while another wrote it would load a cut
# executable; a worker's tests and their subprocesses run one at a time. Set before jax is imported, which reads them.
# The root is decided once, in pytest's first process (the workers inherit it; a JAX_COMPILATION_CACHE_DIR set
# before pytest starts is the root), and each process takes its own folder under it.
_CACHE_ROOT = os.environ.setdefault(
    'BPD_TEST_XLA_CACHE_ROOT',
    os.environ.get('JAX_COMPILATION_CACHE_DIR')
    or os.path.join(tempfile.gettempdir(), f'bpd-tests-xla-cache-{os.getuid()}-{_kernel_sources_hash()}'))
os.environ['JAX_COMPILATION_CACHE_DIR'] = os.path.join(_CACHE_ROOT, os.environ.get('PYTEST_XDIST_WORKER', 'main'))
os.environ.setdefault('JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS', '0')
os.environ.setdefault('JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES', '0')

import jax  # pylint: disable=g-import-not-at-top,wrong-import-position
import jax.numpy as jnp  # pylint: disable=g-import-not-at-top,wrong-import-position
import numpy as np
import optax
import pytest

from bpd import losses
from bpd import model as model_lib

VOCAB, EOS, BOS = 24, 1, 2


def pytest_configure(config):
  # End-to-end tests that train or decode in subprocesses (the command line, 8 fake devices, two processes): the
  # slowest part of the suite. `pytest -m "not slow"` runs the rest while developing; CI runs everything.
  config.addinivalue_line('markers', 'slow: end-to-end test in subprocesses; deselect with -m "not slow"')
SRC_LEN = 10

# The slowest files first (from --durations): `--dist loadfile` hands files to the workers in collection order, so
# a long file collected last would run alone at the end while the other worker idles.
SLOWEST_FIRST = ('test_trees.py', 'test_pipeline.py', 'test_decoding.py', 'test_accelerator_run.py',
                 'test_sharding.py', 'test_heads_training.py', 'test_speculative.py', 'test_model.py',
                 'test_local_attention.py', 'test_superres.py', 'test_speculative_block.py')


def pytest_collection_modifyitems(items):
  rank = {name: i for i, name in enumerate(SLOWEST_FIRST)}
  items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable: the rest keep their order


@pytest.fixture(autouse=True, scope='module')
def _free_compiled_programs():
  """Drops every compiled program after each test file. A worker that keeps the thousands of programs of a whole
  suite run exhausts the process's memory mappings (LLVM's JIT then fails with "Cannot allocate memory" and XLA
  crashes, in the cache write or the compile of whichever test comes next); the persistent cache makes a program
  needed again a load, not a compile."""
  yield
  jax.clear_caches()


def toy_batch(rng: np.random.RandomState, batch: int):
  """Source: 3..8 random words then padding; target: the words reversed, then EOS."""
  src = np.zeros((batch, SRC_LEN), np.int32)
  tgt = np.zeros((batch, SRC_LEN), np.int32)
  for b in range(batch):
    n = rng.randint(3, 9)
    words = rng.randint(3, VOCAB, size=n)
    src[b, :n] = words
    tgt[b, :n] = words[::-1]
    tgt[b, n] = EOS
  return src, tgt


def train_toy(config, batch_fn, steps):
  """(model, params): `steps` Adam steps (lr 3e-3) on the mean of the heads' cross-entropies.

  batch_fn(rng) -> (src_BxS, tgt_BxT) draws a batch from a numpy RandomState seeded with 0.
  """
  model = model_lib.Transformer(config)
  params = model_lib.init_params(config, jax.random.PRNGKey(0))
  opt = optax.adam(3e-3)
  opt_state = opt.init(params)

  @jax.jit
  def step(params, opt_state, src, tgt):
    def loss_fn(p):
      tgt_in = jnp.pad(tgt[:, :-1], ((0, 0), (1, 0)), constant_values=BOS)
      loss_K, _, _ = losses.heads_cross_entropy(model.apply({'params': p}, src, tgt_in), tgt)
      return jnp.mean(loss_K)
    loss, grads = jax.value_and_grad(loss_fn)(params)
    updates, opt_state = opt.update(grads, opt_state)
    return optax.apply_updates(params, updates), opt_state, loss

  rng = np.random.RandomState(0)
  for _ in range(steps):
    params, opt_state, _ = step(params, opt_state, *batch_fn(rng))
  return model, params


@pytest.fixture(scope='session')
def toy_model():
  """(model, params, config) of a tiny 4-head model trained on reversal for ~300 steps."""
  config = model_lib.model_config('tiny', vocab_size=VOCAB, k=4, dropout_rate=0.0, d_model=64)
  model, params = train_toy(config, lambda rng: toy_batch(rng, 32), steps=300)
  return model, params, config
