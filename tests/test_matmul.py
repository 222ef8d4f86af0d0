"""The skinny-matmul kernel (bpd/kernels, bpd/matmul.py): against numpy, bitwise independence of the row count,
inside jit and lax.while_loop, the packed layout, the library's argmax, the settings and their errors, and the
model's decoding on it (a k-token verification computes the greedy steps' logits bit for bit)."""

import functools
import os
import re
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from bpd import decoder as decoder_lib
from bpd import decoding
from bpd import layers
from bpd import matmul
from bpd import model as model_lib
from bpd import trees
from bpd.errors import UserError

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# (K, N): ragged against the AVX-512 / AVX2 widths (16 / 8), the 64-column tile, and smaller than a vector.
SHAPES = ((33, 77), (64, 130), (16, 5), (256, 64))


def _int8(w_Bx___xKxN):
  """matmul.pack(w, int8) and, unpacked in float64, the weights it holds (each column's int8 times its scale)."""
  packed, scale = matmul.pack(w_Bx___xKxN, jnp.int8)
  k, n = w_Bx___xKxN.shape[-2:]
  q = np.moveaxis(np.asarray(packed), -2, -4)  # [..., K, tiles, parts, PART]
  q = q.reshape(q.shape[:-3] + (-1,))[..., :n].astype(np.float64)
  assert q.shape[-2] == k and np.abs(q).max() <= 127
  return (packed, scale), q * np.asarray(scale, np.float64)[..., None, :]


def _ops(m, k, n, seed):
  """{name: (fn under use('skinny'), float64 numpy reference)} for every form the model uses, on M = m rows."""
  rng = np.random.default_rng(seed)
  f32 = lambda *shape: rng.standard_normal(shape).astype(np.float32)
  x, w, b, w_nt = f32(m, k), f32(k, n), f32(n), f32(n, k)
  x_bt, xs, ws, bs = f32(2, m, k), f32(3, m, k), f32(3, k, n), f32(3, n)
  d = lambda a: a.astype(np.float64)
  (w8, w8_ref), (ws8, ws8_ref) = _int8(w), _int8(ws)
  return {
      # int8 weights (decode.head_weights='int8'): the reference is the weights the pack holds, summed in float64
      'dense, int8 packed': (lambda: matmul.dense(x, w, b, packed=w8), d(x) @ w8_ref + d(b)),
      'dense, one head of an int8 packed stack': (
          lambda: matmul.dense(x, ws[1], bs[1], packed=ws8, packed_index=1), d(x) @ ws8_ref[1] + d(bs[1])),
      'batched, int8 packed': (lambda: matmul.batched(xs, ws, bs, packed=ws8),
                               np.einsum('nmk,nkf->nmf', d(xs), ws8_ref) + d(bs)[:, None]),
      'dense': (lambda: matmul.dense(x, w), d(x) @ d(w)),
      'dense+bias': (lambda: matmul.dense(x, w, b), d(x) @ d(w) + d(b)),
      'dense, packed': (lambda: matmul.dense(x, w, b, packed=matmul.pack(w)), d(x) @ d(w) + d(b)),
      'dense, batch axis (B x T rows)': (lambda: matmul.dense(x_bt, w, b), d(x_bt) @ d(w) + d(b)),
      'dense, one head of a packed stack': (
          lambda: matmul.dense(x, ws[1], bs[1], packed=matmul.pack(ws), packed_index=1), d(x) @ d(ws[1]) + d(bs[1])),
      'dense_nt': (lambda: matmul.dense_nt(x, w_nt), d(x) @ d(w_nt).T),
      'batched': (lambda: matmul.batched(xs, ws, bs), np.einsum('nmk,nkf->nmf', d(xs), d(ws)) + d(bs)[:, None]),
      'batched, packed': (lambda: matmul.batched(xs, ws, packed=matmul.pack(ws)),
                          np.einsum('nmk,nkf->nmf', d(xs), d(ws))),
      # w with two leading axes (a decoding cache [B, H, K, S]), read as its 6 = 2 x 3 matrices
      'batched, w [2, 3, K, N]': (lambda: matmul.batched(np.concatenate([xs, xs + 1]), np.stack([ws, -ws])),
                                  np.einsum('nmk,nkf->nmf', d(np.concatenate([xs, xs + 1])),
                                            d(np.concatenate([ws, -ws])))),
  }


def _run_all(ops, kernel='skinny'):
  names = list(ops)

  @jax.jit
  def run():
    with matmul.use(kernel):
      return [ops[name][0]() for name in names]
  return dict(zip(names, (np.asarray(y) for y in run())))


@pytest.mark.parametrize('m', [1, 2, 5, 8, 13, 32, 64])
def test_kernel_matches_numpy(m):
  for k, n in SHAPES:
    ops = _ops(m, k, n, seed=m * 1000 + k)
    for name, y in _run_all(ops).items():
      ref = ops[name][1]
      assert y.shape == ref.shape, name
      np.testing.assert_allclose(y, ref, rtol=2e-5, atol=2e-5 * np.abs(ref).max(), err_msg=f'{name}, M={m}, {k}x{n}')


def test_a_row_does_not_depend_on_how_many_rows_come_with_it():
  """Each row is summed in one order whatever M is: row i of an M-row product equals, bit for bit, the same row
  computed alone and within any other row count (so a verification's logits are a greedy step's)."""
  rng = np.random.default_rng(0)
  for k, n in ((256, 1024), (33, 77), (64, 130), (1024, 256)):
    x = rng.standard_normal((64, k)).astype(np.float32)
    w, w_nt = rng.standard_normal((k, n)).astype(np.float32), rng.standard_normal((n, k)).astype(np.float32)
    b = rng.standard_normal(n).astype(np.float32)

    @jax.jit
    def run(x):
      with matmul.use('skinny'):
        return (matmul.dense(x, w, b), matmul.dense(x, w, b, packed=matmul.pack(w)), matmul.dense_nt(x, w_nt),
                matmul.batched(jnp.stack([x, 2 * x]), jnp.stack([w, w])),
                matmul.dense(x, w, b, packed=matmul.pack(w, jnp.int8)))
    full = [np.asarray(y) for y in run(x)]
    for m in (1, 2, 3, 4, 7, 8, 9, 12, 13, 16, 31):
      part = [np.asarray(y) for y in run(x[:m])]
      for name, y_full, y_part in zip(('dense', 'packed', 'dense_nt', 'batched', 'int8'), full, part):
        assert np.array_equal(y_full[..., :m, :], y_part), f'{name}: {k}x{n}, rows 0..{m} differ from M=64'
    assert np.array_equal(full[0], full[1]), 'the packed layout sums in the same order as the plain one'


def test_inside_jit_and_while_loop():
  rng = np.random.default_rng(1)
  w = rng.standard_normal((48, 48)).astype(np.float32) / 8
  x = rng.standard_normal((3, 48)).astype(np.float32)

  def loop(kernel):
    @jax.jit
    def run(x, w):
      with matmul.use(kernel):
        return jax.lax.while_loop(lambda c: c[0] < 5, lambda c: (c[0] + 1, jnp.tanh(matmul.dense(c[1], w))),
                                  (0, x))[1]
    return np.asarray(run(x, w))
  ref = x.astype(np.float64)
  for _ in range(5):
    ref = np.tanh(ref @ w)
  np.testing.assert_allclose(loop('skinny'), ref, rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(loop('xla'), ref, rtol=1e-5, atol=1e-5)


def test_argmax_ties_go_to_the_lower_id_and_nan_wins():
  rng = np.random.default_rng(2)
  logits = rng.standard_normal((2, 5, 300)).astype(np.float32)
  logits[0, 0, [7, 9]] = 50.0  # a tie: 7
  logits[0, 1, :] = 1.0  # all tied: 0
  logits[1, 2, [4, 200]] = np.nan  # jnp.argmax's NaN rule: the first NaN
  logits[1, 3, 299] = 99.0  # the last id

  @jax.jit
  def run(x):
    with matmul.use('skinny'):
      return decoding.argmax(x), decoding.argmax(x[:, 0])
  rows, first = run(logits)
  np.testing.assert_array_equal(np.asarray(rows), np.asarray(jnp.argmax(logits, -1)))
  np.testing.assert_array_equal(np.asarray(first), np.argmax(logits[:, 0], -1))
  assert np.asarray(rows)[0, 0] == 7 and np.asarray(rows)[1, 2] == 4
  assert matmul.argmax(logits) is None, 'outside use(skinny) the caller uses XLA'


@pytest.mark.parametrize('v', [1, 3, 4, 7, 8, 9, 15, 300, 4001])
def test_argmax_is_numpys_at_every_vocabulary_size(v):
  # The reference is numpy's documented rule: the first index of the maximum, a NaN (its first) being the maximum.
  # Rows put the maximum, its ties, a NaN, -0 / +0 and -inf in the vector part and in the scalar tail.
  rng = np.random.default_rng(v)
  rows = [rng.standard_normal(v), np.full(v, -np.inf), np.zeros(v), -np.zeros(v)]
  for place in {0, v // 2, v - 1}:
    tied = rng.standard_normal(v)
    tied[place] = tied[v - 1 - place] = 9.0
    nan = rng.standard_normal(v)
    nan[place] = np.nan
    signed_zero = -np.abs(rng.standard_normal(v)) - 1.0
    signed_zero[place] = -0.0
    signed_zero[v - 1] = 0.0
    rows += [tied, nan, signed_zero]
  logits = np.stack(rows).astype(np.float32)

  @jax.jit
  def run(x):
    with matmul.use('skinny'):
      return decoding.argmax(x)
  np.testing.assert_array_equal(np.asarray(run(logits)), np.argmax(logits, -1))


def test_take_rows_is_jnp_take_including_negative_and_out_of_range_ids():
  # The reference is numpy's indexing, with the rule jnp.take documents for its default mode: a negative index
  # counts from the end, one still outside the table fills with NaN.
  rng = np.random.default_rng(3)
  table = rng.standard_normal((50, 12)).astype(np.float32)
  ids = np.array([[0, 49, 7, -1], [-50, 50, -51, 3]], np.int32)
  expected = np.full((2, 4, 12), np.nan, np.float32)
  for (b, t), i in np.ndenumerate(ids):
    if -50 <= i < 50:
      expected[b, t] = table[i]

  @jax.jit
  def run(table, ids):
    with matmul.use('skinny'):
      return matmul.take_rows(table, ids)
  got = np.asarray(run(table, ids))
  np.testing.assert_array_equal(got, expected)  # bit for bit, NaN where expected is NaN
  np.testing.assert_array_equal(got, np.asarray(jnp.take(table, ids, axis=0)))
  assert matmul.take_rows(table, ids) is None, 'outside use(skinny) the caller uses XLA'


def test_xla_outside_use_and_for_large_m():
  """Training never enters use('skinny') and more than MAX_ROWS rows go to XLA: no custom call is compiled."""
  w = np.ones((8, 8), np.float32)
  plain = jax.jit(lambda x: matmul.dense(x, w)).lower(np.ones((2, 8), np.float32)).as_text()
  assert 'bpd_skinny_matmul' not in plain

  def big(x):
    with matmul.use('skinny'):
      return matmul.dense(x, w)
  assert 'bpd_skinny_matmul' not in jax.jit(big).lower(np.ones((matmul.MAX_ROWS + 1, 8), np.float32)).as_text()
  assert 'bpd_skinny_matmul' in jax.jit(big).lower(np.ones((matmul.MAX_ROWS, 8), np.float32)).as_text()


class _Mesh:
  size = 2


def test_settings_and_their_errors():
  assert matmul.resolve('xla') == 'xla'
  assert matmul.resolve('skinny') == 'skinny'  # this CPU builds it (the CI machine has g++)
  assert matmul.resolve('auto') == 'skinny'
  assert matmul.resolve('auto', mesh=_Mesh()) == 'xla'
  with pytest.raises(UserError, match='one device'):
    matmul.resolve('skinny', mesh=_Mesh())
  with pytest.raises(UserError, match=r"matmul_kernel='fast'.*choose one of"):
    matmul.resolve('fast')
  with pytest.raises(ValueError, match='resolve'):
    with matmul.use('auto'):
      pass
  from bpd import checks  # pylint: disable=import-outside-toplevel
  from configs import common  # pylint: disable=import-outside-toplevel
  import ml_collections  # pylint: disable=import-outside-toplevel
  assert checks.check_fused_heads(common.defaults()) is True
  with pytest.raises(UserError, match=r"fused_heads='yes'.*True"):
    checks.check_fused_heads(ml_collections.ConfigDict({'decode': {'fused_heads': 'yes'}}))


def _python(code, **env):
  return subprocess.run([sys.executable, '-c', code], capture_output=True, text=True, cwd=REPO, timeout=300,
                        env={**os.environ, **env})


def test_without_a_compiler_auto_warns_and_uses_xla_and_skinny_is_an_error(tmp_path):
  code = ('from bpd import matmul\nfrom bpd.errors import UserError\nprint(matmul.resolve("auto"))\n'
          'try:\n  matmul.resolve("skinny")\nexcept UserError as e:\n  print("error:", e)\n')
  done = _python(code, CXX=str(tmp_path / 'no-such-g++'), BPD_KERNEL_CACHE=str(tmp_path / 'cache'))
  assert done.returncode == 0, done.stderr
  lines = done.stdout.splitlines()
  assert lines[0] == 'xla'
  assert lines[1].startswith('error: config.decode.matmul_kernel=skinny: it could not be built')
  assert 'use auto' in lines[1]
  assert done.stderr.count('using XLA') == 1, done.stderr  # one warning line


def test_avx2_path_matches_numpy_and_is_independent_of_m():
  """The narrower instruction set (chosen at run time on CPUs without AVX-512), forced here."""
  code = '''
import numpy as np, jax
from bpd import layers
from bpd import matmul
from tests.test_matmul import _int8
assert matmul.kernel_info().startswith('avx2'), matmul.kernel_info()
rng = np.random.default_rng(0)
for k, n in ((33, 77), (256, 130)):
  x = rng.standard_normal((13, k)).astype(np.float32); w = rng.standard_normal((k, n)).astype(np.float32)
  def run(x):
    with matmul.use('skinny'):
      return (matmul.dense(x, w), matmul.dense(x, w, packed=matmul.pack(w)), matmul.dense_nt(x, w.T.copy()),
              matmul.dense(x, w, packed=w8))
  w8, w8_ref = _int8(w)  # the int8 weights as they lie, unpacked
  full = [np.asarray(y) for y in jax.jit(run)(x)]
  for y in full[:3]:
    np.testing.assert_allclose(y, x.astype(np.float64) @ w, rtol=1e-4, atol=1e-4)
  np.testing.assert_allclose(full[3], x.astype(np.float64) @ w8_ref, rtol=1e-4, atol=1e-4)
  for m in (1, 5, 8):
    assert all(np.array_equal(a[:m], np.asarray(b)) for a, b in zip(full, jax.jit(run)(x[:m])))
print('ok')
'''
  done = _python(code, BPD_SKINNY_ISA='avx2')
  assert done.returncode == 0 and done.stdout.strip().endswith('ok'), done.stderr[-2000:]


@pytest.fixture(scope='module')
def tiny_model():
  c = model_lib.model_config('tiny', vocab_size=97, k=4, dropout_rate=0.0)
  return model_lib.Transformer(c), model_lib.init_params(c, jax.random.PRNGKey(3))


def test_verification_logits_are_greedy_steps_logits_bit_for_bit(tiny_model):
  """score() on T tokens at once equals T one-token calls, bitwise, on the kernel (matmuls and attention alike):
  blockwise exact decoding is greedy decoding with no floating-point caveat on CPU."""
  model, params = tiny_model
  packed = jax.jit(model_lib.packed_weights)(params)
  src = np.random.default_rng(4).integers(4, 97, (2, 9)).astype(np.int32)
  tokens = np.random.default_rng(5).integers(4, 97, (2, 6)).astype(np.int32)

  @jax.jit
  def run(params, packed):
    with matmul.use('skinny'):
      fns = model_lib.decode_fns(model, params, packed=packed)
      init_state, score_fn = fns.init, fns.score
      state = init_state(src, 16)
      block, _, _ = score_fn(state, tokens, jnp.array([0, 0]))
      steps = []
      for t in range(tokens.shape[1]):
        logits, _, state = score_fn(state, tokens[:, t:t + 1], jnp.array([t, t]))
        steps.append(logits[:, 0])
      return block, jnp.stack(steps, 1)
  block, steps = run(params, packed)
  assert np.array_equal(np.asarray(block), np.asarray(steps))
  lowered = jax.jit(run).lower(params, packed).as_text()
  # every weight matmul of the decoder read its packed copy: per layer q, k, v, out (self), q, out (cross), wi, wo
  assert lowered.count('packed = 1') >= 8 * model.config.num_decoder_layers


def _while_body(hlo_text: str) -> str:
  """The text of the (first) while loop's body computation in a compiled HLO module."""
  name = re.search(r'body=%([\w.\-]+)', hlo_text).group(1)
  start = re.search(rf'^%?{re.escape(name)} .*{{\s*$', hlo_text, re.M).start()
  return hlo_text[start:hlo_text.index('\n}', start)]


def test_greedy_loop_writes_its_cache_in_place(tiny_model):
  """A greedy step on the kernel writes one token's keys and values into the cache and reads the cache, with no
  copy of a whole cache in the loop (XLA's CPU backend made two per layer and call when the attention reshaped the
  freshly written cache for the kernel)."""
  model, params = tiny_model
  decoder = decoder_lib.Decoder(model, max_len=12, matmul_kernel='skinny', eos_id=-1)
  src = np.random.default_rng(6).integers(4, 97, (1, 7)).astype(np.int32)
  hlo = decoder._greedy_jit.lower(params, decoder._packed(params), src).compile().as_text()  # pylint: disable=protected-access
  cache = decoder_lib.cache_len(12)
  copies = [line for line in _while_body(hlo).splitlines() if ' copy(' in line and f',{cache}' in line.split('=')[1]]
  assert not copies, copies


def test_one_rows_cache_write_is_a_dynamic_update_slice():
  """layers.write_rows at batch 1 with a per-row start (a blockwise call's k rows) is one dynamic_update_slice, as
  greedy's scalar start is, not the scatter that several rows' starts lower to; the values are the per-row write's."""
  rng = np.random.default_rng(3)
  cache = jnp.asarray(rng.standard_normal((1, 4, 8, 13)), jnp.float32)  # [B, H, K, L], positions last
  new = jnp.asarray(rng.standard_normal((1, 4, 8, 3)), jnp.float32)
  write = jax.jit(lambda c, n, s: layers.write_rows(c, n, s, axis=3))
  text = write.lower(cache, new, jnp.asarray([5], jnp.int32)).as_text()
  assert 'dynamic_update_slice' in text and 'scatter' not in text
  for start in (0, 5, 10):
    expected = np.asarray(cache).copy()
    expected[0, :, :, start:start + 3] = np.asarray(new)[0]
    np.testing.assert_array_equal(np.asarray(write(cache, new, jnp.asarray([start], jnp.int32))), expected)
  two = jnp.concatenate([cache, -cache]), jnp.concatenate([new, -new])  # two rows, two starts: still per row
  out = np.asarray(write(*two, jnp.asarray([2, 7], jnp.int32)))
  np.testing.assert_array_equal(out[1, :, :, 7:10], -np.asarray(new)[0])
  np.testing.assert_array_equal(out[0, :, :, 2:5], np.asarray(new)[0])


def test_decoder_on_the_kernel_decodes_exactly(tiny_model):
  """Decoder(matmul_kernel='skinny'): exact blockwise (chain and a context-aware tree) equals its greedy, and the
  packed weights are those of the parameters passed (made again for new parameters)."""
  model, params = tiny_model
  decoder = decoder_lib.Decoder(model, max_len=12, matmul_kernel='skinny', eos_id=-1)
  assert decoder.matmul_kernel == 'skinny'
  src = np.random.default_rng(6).integers(4, 97, (3, 7)).astype(np.int32)
  for p in (params, jax.tree.map(lambda a: a * 1.01, params)):
    greedy = decoder.greedy(p, src)
    for tree in (decoding.chain(4), trees.parse_tree_spec("dynamic:6", 4, vocab_size=97)):
      out = decoder.blockwise(p, src, decoding.EXACT, tree)
      np.testing.assert_array_equal(np.asarray(out.tokens_BxL), np.asarray(greedy.tokens_BxL))
  xla = decoder_lib.Decoder(model, max_len=12, matmul_kernel='xla', eos_id=-1)
  assert xla.matmul_kernel == 'xla' and xla._packed(params) is None  # pylint: disable=protected-access


def test_fused_sequential_heads_are_the_heads_one_product_at_a_time():
  """decode.fused_heads: sequential heads 2..k' in one library call compute what the one-product-at-a-time path
  computes: each head fed the previous head's choice, the same packed products (float32, float16, int8; whole
  vocabulary and a draft vocabulary), a layer norm that may round a last bit differently. The weights are scaled
  up so that every head's best logit leads its runner-up by far more than that rounding: then every choice, and
  so every later head's input, must be the same. A malformed call is an error, not a silent read."""
  import dataclasses  # pylint: disable=import-outside-toplevel
  c = model_lib.model_config('tiny', vocab_size=97, k=5, dropout_rate=0.0, head_type='sequential')
  params = model_lib.init_params(c, jax.random.PRNGKey(11))
  rng = np.random.default_rng(12)
  # token_kernel starts at zero (layers.MultiOutput): drawn here, so that each head depends on the token before it;
  # the embedding scaled so that the logits' gaps dwarf float32 rounding
  params['multi_output']['token_kernel'] = jnp.asarray(rng.standard_normal((c.k - 1, c.d_model, c.d_model)) * 0.1,
                                                       jnp.float32)
  params['embed']['embedding'] = params['embed']['embedding'] * 30
  hidden = {'hidden_BxTxD': jnp.asarray(rng.standard_normal((3, c.d_model)) * 3, jnp.float32),
            'first_BxT': jnp.asarray([5, 96, 40], jnp.int32)}
  for draft in ((), tuple(range(2, 97, 2))):
    model = model_lib.Transformer(dataclasses.replace(c, draft_ids=draft))
    for weights in ('float32', 'float16', 'int8'):
      packed = model_lib.packed_weights(params, head_weights=weights, draft_ids=draft)

      @functools.partial(jax.jit, static_argnames='fused')
      def run(params, packed, fused, model=model):
        with matmul.use('skinny', fused_heads=fused):
          return model_lib.decode_fns(model, params, packed=packed).propose_choices(hidden)
      fused_logits, fused_tokens = (np.asarray(a) for a in run(params, packed, True))
      logits, tokens = (np.asarray(a) for a in run(params, packed, False))
      assert 'bpd_sequential_heads' in run.lower(params, packed, True).as_text()
      assert 'bpd_sequential_heads' not in run.lower(params, packed, False).as_text()
      assert fused_tokens.shape == (3, c.k - 1) and fused_logits.shape == (3, c.k - 1, 97)
      finite = np.isfinite(logits)
      assert np.array_equal(np.isfinite(fused_logits), finite)
      top2 = np.sort(np.where(finite, logits, -np.inf), axis=-1)[..., -2:]
      assert (top2[..., 1] - top2[..., 0]).min() > 1e-2, 'pick another seed: a near-tie leaves the choice to rounding'
      np.testing.assert_allclose(fused_logits[finite], logits[finite], rtol=1e-5, atol=1e-4, err_msg=weights)
      np.testing.assert_array_equal(fused_tokens, tokens, err_msg=f'{weights}, draft {bool(draft)}')
      np.testing.assert_array_equal(fused_tokens, np.argmax(fused_logits, axis=-1))
      assert len(set(fused_tokens.ravel())) > 3, 'the heads chose almost one token: the test would show little'
      if draft:
        assert set(fused_tokens.ravel()) <= set(draft)

  # A stack with fewer heads than asked for: the library refuses it.
  small = model_lib.packed_weights(params, head_weights='float32')
  with pytest.raises(Exception, match='bpd sequential heads'):
    with matmul.use('skinny'):
      out = matmul.sequential_heads(
          hidden['hidden_BxTxD'], hidden['first_BxT'], params['embed']['embedding'], (),
          small['multi_output']['token_kernel'], small['multi_output']['wi_kernel'],
          params['multi_output']['wi_bias'], small['multi_output']['wo_kernel'], params['multi_output']['wo_bias'],
          params['multi_output']['ln']['scale'], params['multi_output']['ln']['bias'],
          small['heads_projection_97'], heads=c.k, embed_scale=1.0, epsilon=1e-6)
      jax.block_until_ready(out)


def test_narrow_heads_propose_as_float32_heads_and_decode_exactly():
  """decode.head_weights='float16' / 'int8': heads 2..k (sequential and independent) read their packed layer and
  projection (all V, or the draft vocabulary's R) in half precision, or as int8 with a scale per column. Their logits
  are the float32 heads' within that rounding (a float32 packed projection gives the unpacked one's bit for bit where
  both sum in the same order), the program reads the narrow weights, and exact decoding still equals greedy (head 1
  verifies in float32)."""
  import dataclasses  # pylint: disable=import-outside-toplevel
  c = model_lib.model_config('tiny', vocab_size=97, k=4, dropout_rate=0.0, head_type='sequential')
  params = model_lib.init_params(c, jax.random.PRNGKey(7))
  independent = dataclasses.replace(c, head_type='independent')
  independent_params = model_lib.init_params(independent, jax.random.PRNGKey(9))
  rng = np.random.default_rng(8)
  hidden_BxD = jnp.asarray(rng.standard_normal((3, c.d_model)), jnp.float32)
  inputs = {'sequential': {'hidden_BxTxD': hidden_BxD, 'first_BxT': jnp.asarray(rng.integers(4, 97, 3), jnp.int32)},
            'independent': hidden_BxD}
  # (dtype, its name in the program's text, how far its logits may stray from the float32 heads'): int8 rounds each
  # weight to 1/254 of its column's largest, float16 to 2^-11 of itself.
  narrow = (('float16', 'xf16>', 2e-2), ('int8', 'xi8>', 1e-1))
  for config, p in ((c, params), (independent, independent_params)):
    for draft in ((), tuple(range(1, 97, 3))):
      model = model_lib.Transformer(dataclasses.replace(config, draft_ids=draft))
      hidden = inputs[config.head_type]

      def propose(packed, kernel='skinny', fused=True, model=model, p=p, hidden=hidden):
        @jax.jit
        def run(params, packed):
          with matmul.use(kernel, fused_heads=fused):
            return model_lib.decode_fns(model, params, packed=packed).propose(hidden)
        return np.asarray(run(p, packed)), run.lower(p, packed).as_text()
      pack = lambda weights, p=p, draft=draft: model_lib.packed_weights(p, head_weights=weights, draft_ids=draft)
      unpacked, _ = propose(None)
      full, text = propose(pack('float32'))
      xla, _ = propose(None, kernel='xla')
      if config.head_type == 'sequential':
        # one product at a time, the packed float32 heads are the unpacked ones bit for bit; in one library call
        # (decode.fused_heads, the default) the same products, and a layer norm of its own
        one_at_a_time, _ = propose(pack('float32'), fused=False)
        assert np.array_equal(one_at_a_time, unpacked)
        assert 'bpd_sequential_heads' in text
        np.testing.assert_allclose(full, unpacked, rtol=1e-5, atol=1e-5)
      else:  # unpacked, the independent heads' projection reads the [X, D] rows (lane sums: another order)
        np.testing.assert_allclose(full, unpacked, rtol=1e-5, atol=1e-5)
      finite = np.isfinite(xla)
      assert finite.sum() == 3 * (c.k - 1) * (len(draft) or 97)
      np.testing.assert_allclose(full[finite], xla[finite], rtol=1e-4, atol=1e-4)
      for weights, name, tolerance in narrow:
        logits, text = propose(pack(weights))
        assert np.array_equal(np.isfinite(logits), finite), weights
        np.testing.assert_allclose(logits[finite], xla[finite], rtol=tolerance, atol=tolerance, err_msg=weights)
        assert not np.array_equal(logits, full), f'the {weights} weights were not read'
        assert name in text and f'heads_projection_{len(draft) or 97}' in pack(weights), weights

  src = rng.integers(4, 97, (3, 7)).astype(np.int32)
  # Decoding with each head type in float16, and with int8 sequential heads (the head type the Multi30k records use);
  # the int8 independent heads' logits are checked above.
  for config, p, weights in ((c, params, 'float16'), (independent, independent_params, 'float16'), (c, params, 'int8')):
    model = model_lib.Transformer(config)
    decoder = decoder_lib.Decoder(model, max_len=12, matmul_kernel='skinny', eos_id=-1, head_weights=weights)
    greedy = decoder.greedy(p, src)
    for tree in (decoding.chain(4), trees.parse_tree_spec('dynamic:6', 4, vocab_size=97)):
      out = decoder.blockwise(p, src, decoding.EXACT, tree)
      np.testing.assert_array_equal(np.asarray(out.tokens_BxL), np.asarray(greedy.tokens_BxL), err_msg=weights)
  with pytest.raises(UserError, match='head_weights'):
    decoder_lib.Decoder(model, max_len=12, head_weights='bfloat16')
