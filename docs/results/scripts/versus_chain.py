"""The chain's iteration, old loop against the one loop, alternated in one process (issue 28's "no cost").

  python docs/results/scripts/versus_chain.py OLD_DIR SIZE K BATCH REPEATS
OLD_DIR holds the old code as package bpd_old (git archive OLD -- bpd, then `from bpd` renamed `from bpd_old`).
Random weights, min_block = k (every iteration accepts k: the same work in both), as bench_decode.
"""
import sys
import functools
import jax, jax.numpy as jnp, numpy as np

old_dir, size, k, batch, repeats = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5])
sys.path.insert(0, old_dir)
import bpd_old.decoding as old_decoding
import bpd_old.model as old_model
from bpd import decoding, model as model_lib, decoder as decoder_lib, timing

V, max_len, src_len, BOS, NEVER = 8000, 64, 24, 2, -1
config = model_lib.model_config(size, vocab_size=V, k=k, dropout_rate=0.0)
params = jax.jit(lambda r: model_lib.init_params(config, r))(jax.random.PRNGKey(0))
new_m = model_lib.Transformer(config)
old_m = old_model.Transformer(old_model.model_config(size, vocab_size=V, k=k, dropout_rate=0.0))
src = jnp.asarray(np.random.RandomState(0).randint(4, V, size=(batch, src_len)), jnp.int32)
cache = max_len + k + 1


@jax.jit
def new_block(params, src):
  init, score, propose = model_lib.decode_fns(new_m, params)
  r = decoding.blockwise(decoding.ModelFns(score, propose), init(src, cache),
                         fixed=decoding.Fixed(batch, max_len, BOS, NEVER), tree=decoder_lib.chain(k),
                         rule=decoding.Criterion(min_block=k))
  return r.tokens_BxL, r.invocations


@jax.jit
def old_block(params, src):
  init, score, propose = old_model.decode_fns(old_m, params)
  r = old_decoding.blockwise(score, propose, init(src, cache), batch_size=batch, k=k, max_len=max_len, bos_id=BOS,
                             eos_id=NEVER, criterion=old_decoding.Criterion(min_block=k))
  return r.tokens_BxL, r.invocations


@jax.jit
def new_greedy(params, src):
  init, score, _ = model_lib.decode_fns(new_m, params, num_heads=1)
  return decoding.greedy(score, init(src, cache), fixed=decoding.Fixed(batch, max_len, BOS, NEVER))[:2]


@jax.jit
def old_greedy(params, src):
  init, score, _ = old_model.decode_fns(old_m, params, num_heads=1)
  return old_decoding.greedy(score, init(src, cache), batch_size=batch, max_len=max_len, bos_id=BOS,
                             eos_id=NEVER)[:2]


a, b = jax.device_get(new_block(params, src)), jax.device_get(old_block(params, src))
assert np.array_equal(a[0], b[0]) and int(a[1]) == int(b[1]), 'old and new chains differ'
ga, gb = jax.device_get(new_greedy(params, src)), jax.device_get(old_greedy(params, src))
assert np.array_equal(ga[0], gb[0])
fns = [lambda: jax.block_until_ready(old_greedy(params, src)), lambda: jax.block_until_ready(old_block(params, src)),
       lambda: jax.block_until_ready(new_greedy(params, src)), lambda: jax.block_until_ready(new_block(params, src))]
og, ob, ng, nb = timing.time_alternating(fns, repeats, 'versus')
iters = int(a[1]) - 1
ratio = lambda g, b: ((b - g / max_len) / iters) / (g / max_len)
print(f'| {size} | {k} | {batch} | {1e3*og:.1f} | {1e3*ob:.1f} | {1e3*ng:.1f} | {1e3*nb:.1f} | '
      f'{ratio(og, ob):.2f} | {ratio(ng, nb):.2f} | {nb/ob:.3f} |', flush=True)
