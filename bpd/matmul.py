"""The weight matmuls of decoding, on XLA or on bpd's skinny-matmul kernel (bpd/kernels).

Why a kernel of our own: at batch 1 every decoder call multiplies a few rows (1 for a greedy step, k or a tree's N
for a verification) by each weight matrix, and its time is that of reading the weights. XLA's CPU backend runs such
products at a fraction of the bandwidth of a one-row product once M > 1, so a k-token verification cost several
greedy steps (docs/results/benchmark.md). The skinny kernel streams each weight once for all M <= MAX_ROWS rows,
and sums every output in one order whatever M is: on CPU a verification's logits are bit for bit a greedy step's
(DESIGN §8).

How it plugs in: the model's matmuls go through the functions here (`dot_general` for flax's Dense and
DenseGeneral, `dense`, `dense_nt` for the tied vocabulary projection, `batched` for the multi-output layer), which
call `lax.dot_general` unless a decoder traces them inside `use('skinny')`. The parameters are the same either way.
Training never enters `use`, so gradients never meet the kernel.

The setting (config.decode.matmul_kernel): 'xla' always lax.dot_general; 'skinny' the kernel (CPU, one device;
a clear error where it cannot be built); 'auto' the kernel where it can run, else XLA, with one warning line.
"""

import contextlib
import contextvars
import ctypes
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from absl import logging

from bpd.errors import UserError

KERNELS = ('auto', 'xla', 'skinny')
MAX_ROWS = 64  # rows (M) the kernel takes; more go to XLA: its weight strips are re-read from cache per 6 rows
_TARGET = 'bpd_skinny_matmul'
_ARGMAX = 'bpd_argmax'
_TAKE_ROWS = 'bpd_take_rows'
_SEQUENTIAL_HEADS = 'bpd_sequential_heads'

_active = contextvars.ContextVar('bpd_matmul_kernel', default='xla')
_fused_heads = contextvars.ContextVar('bpd_fused_heads', default=True)


@functools.cache
def _library():
  """(isa, threads) of the loaded library, built on first use and registered with XLA; raises BuildError."""
  from bpd.kernels import build  # pylint: disable=import-outside-toplevel
  lib = ctypes.CDLL(str(build.library_path()))
  lib.bpd_skinny_isa.restype = ctypes.c_char_p
  isa = lib.bpd_skinny_isa().decode()
  if not isa:
    raise build.BuildError('this CPU has neither AVX-512 nor AVX2 with FMA')
  jax.ffi.register_ffi_target(_TARGET, jax.ffi.pycapsule(lib.BpdSkinnyMatmul), platform='cpu')
  jax.ffi.register_ffi_target(_ARGMAX, jax.ffi.pycapsule(lib.BpdArgmax), platform='cpu')
  jax.ffi.register_ffi_target(_TAKE_ROWS, jax.ffi.pycapsule(lib.BpdTakeRows), platform='cpu')
  jax.ffi.register_ffi_target(_SEQUENTIAL_HEADS, jax.ffi.pycapsule(lib.BpdSequentialHeads), platform='cpu')
  return isa, lib.bpd_skinny_threads()


def kernel_info() -> str:
  """'avx512, 2 threads' where the kernel runs, else why not (for benchmark records)."""
  from bpd.kernels import build  # pylint: disable=import-outside-toplevel
  try:
    isa, threads = _library()
  except build.BuildError as e:
    return f'unavailable: {e}'
  return f'{isa}, {threads} threads'


def resolve(setting: str, mesh=None) -> str:
  """'xla' or 'skinny' for a decoder from config.decode.matmul_kernel (see the module docstring); mesh: the
  decoder's mesh (the kernel runs on one CPU device; sharded decoding stays on XLA)."""
  from bpd.kernels import build  # pylint: disable=import-outside-toplevel
  if setting not in KERNELS:
    raise UserError(f'config.decode.matmul_kernel={setting!r}: choose one of {KERNELS} (auto: the skinny kernel on '
                    'CPU where it builds, else XLA).')
  if setting == 'xla':
    return 'xla'
  where = None
  if jax.default_backend() != 'cpu':
    where = f'it runs on CPU only (the backend is {jax.default_backend()})'
  elif mesh is not None and mesh.size > 1:
    where = f'it runs on one device (the mesh has {mesh.size})'
  else:
    try:
      _library()
    except build.BuildError as e:
      where = f'it could not be built: {e}'
  if where is None:
    return 'skinny'
  if setting == 'skinny':
    raise UserError(f'config.decode.matmul_kernel=skinny: {where}; use auto or xla.')
  _warn_once(f'config.decode.matmul_kernel=auto: using XLA\'s matmuls, since the skinny kernel cannot be used: {where}')
  return 'xla'


@functools.cache
def _warn_once(message):
  logging.warning(message)


@contextlib.contextmanager
def use(kernel: str, fused_heads: bool = True):
  """Trace the model's matmuls with `kernel` ('xla' or 'skinny', from `resolve`). Enter it inside the function
  that jax.jit traces, so that each compiled program is traced under its own setting. fused_heads (skinny only,
  config.decode.fused_heads): sequential heads run in one library call (`sequential_heads`) rather than one
  kernel call per product."""
  if kernel not in ('xla', 'skinny'):
    raise ValueError(f'use({kernel!r}): pass resolve(...)\'s result, xla or skinny')
  token, fused = _active.set(kernel), _fused_heads.set(bool(fused_heads))
  try:
    yield
  finally:
    _active.reset(token)
    _fused_heads.reset(fused)


def active() -> str:
  """'skinny' while a decoder traces under use('skinny'), else 'xla'."""
  return _active.get()


def traced(fn, kernel: str, fused_heads: bool = True):
  """fn, traced under use(kernel, fused_heads): wrap a function before jax.jit, so that its program is compiled
  with that setting."""
  @functools.wraps(fn)
  def with_kernel(*args, **kwargs):
    with use(kernel, fused_heads):
      return fn(*args, **kwargs)
  return with_kernel


def _fits(x, w, rows: int) -> bool:
  return (_active.get() == 'skinny' and 0 < rows <= MAX_ROWS and x.dtype == jnp.float32 and w.dtype == jnp.float32)


def _skinny(x_BxMxK, w, bias_BwxN, n: int, transpose_w=False, packed=False, w_index=-1, scale=None):
  """The kernel on 3-D x: y [B, M, N] = x . w, w [Bw, K, N], [Bw, N, K] (transpose_w) or `pack`'s
  [Bw, tiles, parts, K, PART] (packed), Bw in {1, B}; with w_index >= 0, w has one more leading axis and its entry
  w_index is used. scale: int8 weights' per-column factors, w's leading axes then N ([(H,) Bw, N])."""
  _library()  # registers the target before anything is compiled with it
  b, m, _ = x_BxMxK.shape
  if bias_BwxN is None:
    bias_BwxN = jnp.zeros((0, n), jnp.float32)
  if scale is None:
    scale = jnp.zeros((0, n), jnp.float32)
  call = jax.ffi.ffi_call(_TARGET, jax.ShapeDtypeStruct((b, m, n), jnp.float32), vmap_method='sequential')
  return call(x_BxMxK, w, bias_BwxN.astype(jnp.float32), scale, transpose_w=int(transpose_w), packed=int(packed),
              w_index=int(w_index))


def _split(packed):
  """(weights, scale) of a packed operand: `pack`'s int8 (weights, scale) pair, or (weights, None)."""
  return packed if isinstance(packed, tuple) else (packed, None)


TILE, PART = 64, 32  # columns per packed tile and per contiguous part of it (kTile, kPackCols in the kernel)


def pack(w_Bx___xKxN, dtype=jnp.float32):
  """The packed layout of weights [..., K, N]: [..., tiles, TILE / PART, K, PART], each PART columns of a tile
  contiguous, zeros past N. The kernel reads a packed weight front to back; in the [K, N] layout its column tiles are strided rows,
  which DRAM serves at a fraction of the rate once the weights do not fit in cache. Made once per decoder and
  parameters (bpd/decoder.py), never in a decoding loop. dtype float16: the kernel widens each weight to float32
  as it reads it (half the bytes; products and sums stay float32).

  dtype int8: returns (packed int8 weights, scale [..., N] float32), symmetric per column (scale = the column's
  largest |w| / 127, weights rounded to the nearest multiple of it); the kernel sums x . q in float32 and multiplies
  each finished sum by its column's scale: a quarter of the bytes, at the price of int8 rounding of the weights."""
  scale = None
  if jnp.dtype(dtype) == jnp.int8:
    w_Bx___xKxN = w_Bx___xKxN.astype(jnp.float32)
    scale = jnp.max(jnp.abs(w_Bx___xKxN), axis=-2) / 127.0  # [..., N]
    safe = jnp.where(scale > 0, scale, 1.0)
    w_Bx___xKxN = jnp.clip(jnp.round(w_Bx___xKxN / safe[..., None, :]), -127, 127)
  w_Bx___xKxN = w_Bx___xKxN.astype(dtype)
  *lead, k, n = w_Bx___xKxN.shape
  tiles = -(-n // TILE)
  padded = jnp.pad(w_Bx___xKxN, [(0, 0)] * len(lead) + [(0, 0), (0, tiles * TILE - n)])
  parts = padded.reshape(*lead, k, tiles, TILE // PART, PART)
  packed = jnp.moveaxis(parts, -4, -2)  # [..., tiles, parts, K, PART]
  return packed if scale is None else (packed, scale)


def dense(x_Bx___xK, w_KxN, bias_N=None, preferred_element_type=None, packed=None, packed_index=None):
  """x @ w (+ bias): [..., K] x [K, N] -> [..., N]. packed: `pack(w)` (the kernel reads it instead of w), or with
  packed_index (a Python int) pack of the [H, K, N] stack whose entry packed_index w is; an int8 pack's (weights,
  scale) pair is read as it lies, the scale's entry picked by the kernel as the weights' is."""
  rows = math.prod(x_Bx___xK.shape[:-1])
  if not _fits(x_Bx___xK, w_KxN, rows):
    y = jnp.matmul(x_Bx___xK, w_KxN, preferred_element_type=preferred_element_type)
    return y if bias_N is None else y + bias_N
  bias = None if bias_N is None else bias_N[None]
  n = w_KxN.shape[1]
  x = x_Bx___xK.reshape(1, rows, -1)
  packed, scale = _split(packed)
  if packed is None:
    y = _skinny(x, w_KxN[None], bias, n)
  elif packed_index is None:
    y = _skinny(x, packed[None], bias, n, packed=True, scale=None if scale is None else scale[None])
  else:
    y = _skinny(x, packed[:, None], bias, n, packed=True, w_index=packed_index,
                scale=None if scale is None else scale[:, None])
  return y.reshape(x_Bx___xK.shape[:-1] + (n,))


def dense_nt(x_Bx___xK, w_NxK, packed=None):
  """x @ w.T, float32: [..., K] x [N, K] -> [..., N] (the tied vocabulary projection, embedding [V, D]).
  packed: `pack(w.T)`, which the kernel then reads instead, as `dense` reads a packed [K, N]: each output one sum
  over k in order, in register blocks of up to a whole tile, where w's contiguous rows take a dot product per
  output and a sum across the vector's lanes (slower at every row count measured)."""
  rows = math.prod(x_Bx___xK.shape[:-1])
  if not _fits(x_Bx___xK, w_NxK, rows):
    return jnp.einsum('...k,nk->...n', x_Bx___xK.astype(w_NxK.dtype), w_NxK, preferred_element_type=jnp.float32)
  x = x_Bx___xK.reshape(1, rows, -1)
  packed, scale = _split(packed)
  if packed is None:
    y = _skinny(x, w_NxK[None], None, w_NxK.shape[0], transpose_w=True)
  else:
    y = _skinny(x, packed[None], None, w_NxK.shape[0], packed=True, scale=None if scale is None else scale[None])
  return y.reshape(x_Bx___xK.shape[:-1] + w_NxK.shape[:1])


def batched(x_Nx___xK, w_NxKxF, bias_NxF=None, packed=None):
  """One matmul per leading index n: [n, ..., K] x [n, K, F] -> [n, ..., F] (+ bias [n, F]), the multi-output
  layer's heads (layers.MultiOutput) and the attention over the decoding caches. packed: `pack(w)`. w may also be
  [n1, n2, K, F] with n1 * n2 = n (a cache [B, H, K, S]): the kernel reads it as it lies, without a reshape."""
  n, rows = x_Nx___xK.shape[0], math.prod(x_Nx___xK.shape[1:-1])
  if w_NxKxF.ndim > 3:
    if math.prod(w_NxKxF.shape[:-2]) != n:
      raise ValueError(f'batched: w {w_NxKxF.shape} has not {n} matrices (x {x_Nx___xK.shape})')
    if packed is not None or not _fits(x_Nx___xK, w_NxKxF, rows):
      w_NxKxF = w_NxKxF.reshape((n,) + w_NxKxF.shape[-2:])
  if not _fits(x_Nx___xK, w_NxKxF, rows):
    y = jnp.einsum('n...k,nkf->n...f', x_Nx___xK, w_NxKxF)
    if bias_NxF is not None:
      y = y + bias_NxF.reshape((n,) + (1,) * (x_Nx___xK.ndim - 2) + bias_NxF.shape[-1:])
    return y
  f = w_NxKxF.shape[-1]
  x = x_Nx___xK.reshape(n, rows, -1)
  packed, scale = _split(packed)
  y = (_skinny(x, w_NxKxF, bias_NxF, f) if packed is None
       else _skinny(x, packed, bias_NxF, f, packed=True, scale=scale))
  return y.reshape(x_Nx___xK.shape[:-1] + (f,))


def argmax(logits_Bx___xV):
  """The library's argmax over the last axis (first index of the maximum), int32 [B, ...], inside use('skinny');
  None elsewhere (the caller uses XLA's). On a vocabulary-wide buffer that a kernel wrote (not fusible into its
  producer), XLA's CPU argmax and top_k took longer than the projection that made the logits."""
  if _active.get() != 'skinny' or logits_Bx___xV.dtype != jnp.float32 or logits_Bx___xV.shape[-1] == 0:
    return None
  _library()
  rows = math.prod(logits_Bx___xV.shape[:-1])
  call = jax.ffi.ffi_call(_ARGMAX, jax.ShapeDtypeStruct((rows,), jnp.int32), vmap_method='sequential')
  return call(logits_Bx___xV.reshape(rows, -1)).reshape(logits_Bx___xV.shape[:-1])


def take_rows(table_VxD, ids_Bx___):
  """table_VxD[ids] ([B, ..., D]) as jnp.take(table, ids, axis=0) computes it (a negative id counts from the end, an
  id outside the table gives NaN), by the library, inside use('skinny'); None elsewhere (the caller uses XLA's).
  XLA's CPU backend fused the gather of a decoding call's few token rows with the ops after it and split that
  fusion over threads, its cost model counting the whole table: tens of microseconds for a few rows. Decoding
  only: no gradient."""
  if (_active.get() != 'skinny' or table_VxD.dtype != jnp.float32 or table_VxD.ndim != 2
      or not jnp.issubdtype(ids_Bx___.dtype, jnp.signedinteger)):  # int32 ids pass as they are
    return None
  _library()
  rows = math.prod(ids_Bx___.shape)
  call = jax.ffi.ffi_call(_TAKE_ROWS, jax.ShapeDtypeStruct((rows, table_VxD.shape[1]), jnp.float32),
                          vmap_method='sequential')
  return call(table_VxD, ids_Bx___.reshape(rows).astype(jnp.int32)).reshape(ids_Bx___.shape + table_VxD.shape[1:])


def sequential_heads(hidden_BxD, first_B, embedding_VxD, draft_ids, token, wi, wi_bias_HxF, wo, wo_bias_HxD,
                     ln_scale_D, ln_bias_D, projection, heads: int, embed_scale: float, epsilon: float):
  """Sequential proposal heads 2..heads + 1 in one library call, inside use('skinny'): (logits [B, heads, X] float32,
  tokens [B, heads] int32), X = len(draft_ids) (their ids ascending) or V; None elsewhere, or under
  use(..., fused_heads=False) (the caller runs them one product at a time). Head n + 2 is fed head n + 1's choice,
  head 2 first_B (bpd/model.py, Transformer._propose_sequential, computes the same with the same products; only the
  layer norm may round a last bit differently, and heads 2..k only propose). token, wi, wo: `pack`s of the
  multi-output layer's [H, K, N] stacks (H >= heads); projection: `pack` of the [D, X] projection; an int8 pack is
  its (weights, scale) pair."""
  if (_active.get() != 'skinny' or not _fused_heads.get() or hidden_BxD.dtype != jnp.float32
      or embedding_VxD.dtype != jnp.float32):
    return None
  _library()
  b, d = hidden_BxD.shape
  columns = len(draft_ids) if draft_ids else embedding_VxD.shape[0]
  def operand(pack_, n):
    weights, scale = _split(pack_)
    return weights, jnp.zeros((0, n), jnp.float32) if scale is None else scale
  call = jax.ffi.ffi_call(_SEQUENTIAL_HEADS, (jax.ShapeDtypeStruct((b, heads, columns), jnp.float32),
                                              jax.ShapeDtypeStruct((b, heads), jnp.int32)), vmap_method='sequential')
  f = wi_bias_HxF.shape[-1]
  return call(hidden_BxD, first_B.astype(jnp.int32), embedding_VxD, jnp.asarray(list(draft_ids or ()), jnp.int32),
              *operand(token, d), *operand(wi, f), wi_bias_HxF.astype(jnp.float32), *operand(wo, d),
              wo_bias_HxD.astype(jnp.float32), ln_scale_D.astype(jnp.float32), ln_bias_D.astype(jnp.float32),
              *operand(projection, columns), embed_scale=np.float32(embed_scale), epsilon=np.float32(epsilon))
