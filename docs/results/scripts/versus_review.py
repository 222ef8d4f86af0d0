"""The blockwise loop of today against the one the drafter review read (801dabc), side by side in one process.

  python docs/results/scripts/versus_review.py OLD_DIR SIZE BATCH REPEATS [SETTINGS]
OLD_DIR holds the old code as package bpd_old (git archive 801dabc bpd, then `from bpd` renamed `from bpd_old`).
SETTINGS: comma-separated 'chain:K' and 'dynamic:N:K' (default chain:4,chain:8,dynamic:16:4). Random weights, V = 8000,
source 24 tokens, max_len 64; the chain with min_block = k (every iteration accepts k: the same work in both, as
bench_decode). Both loops run today's model (its score, propose and move functions): the loops alone differ.
Prints, per setting, both programs' compiled size (HLO instructions, XLA's bytes and FLOPs) and
their median times alternated after a warm-up (bpd/timing.py); outputs are checked equal first.
"""
import sys

import jax
import jax.numpy as jnp
import numpy as np

old_dir, size, batch, repeats = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
specs = (sys.argv[5] if len(sys.argv) > 5 else 'chain:4,chain:8,dynamic:16:4').split(',')
sys.path.insert(0, old_dir)
sys.path.insert(0, '.')
import bpd_old.decoding as old_decoding  # pylint: disable=g-import-not-at-top
from bpd import decoding, model as model_lib, timing  # pylint: disable=g-import-not-at-top
from experiments import bench_decode  # pylint: disable=g-import-not-at-top

V, max_len, src_len, BOS, NEVER = 8000, 64, 24, 2, -1
src = jnp.asarray(np.random.RandomState(0).randint(4, V, size=(batch, src_len)), jnp.int32)


def cost(compiled):
  c = compiled.cost_analysis()
  c = c[0] if isinstance(c, (list, tuple)) else c
  return len(bench_decode.hlo_instructions(compiled.as_text())), c.get('bytes accessed', 0.0), c.get('flops', 0.0)


print('| setting | size | batch | instructions old / new | bytes old / new | FLOPs old / new | old ms | new ms | '
      'new / old |')
print('|---|---|---|---|---|---|---|---|---|')
for spec in specs:
  parts = spec.split(':')
  k = int(parts[-1])
  config = model_lib.model_config(size, vocab_size=V, k=k, dropout_rate=0.0)
  params = jax.jit(lambda r, config=config: model_lib.init_params(config, r))(jax.random.PRNGKey(0))
  new_m = model_lib.Transformer(config)
  if parts[0] == 'chain':
    new_tree, old_tree = decoding.chain(k), old_decoding.layout(old_decoding.chain_tree(k))
    new_rule, old_rule = decoding.Criterion(min_block=k), old_decoding.Criterion(min_block=k)
  else:
    new_tree, old_tree = decoding.Dynamic(int(parts[1]), k), old_decoding.Dynamic(int(parts[1]), k)
    new_rule, old_rule = decoding.EXACT, old_decoding.EXACT
  cache = max_len + new_tree.num_nodes + 1

  @jax.jit
  def new_loop(params, src, new_m=new_m, tree=new_tree, rule=new_rule, cache=cache):
    fns = model_lib.decode_fns(new_m, params)
    r = decoding.blockwise(fns, fns.init(src, cache), fixed=decoding.Fixed(batch, max_len, BOS, NEVER), tree=tree,
                           rule=rule)
    return r.tokens_BxL, r.invocations

  @jax.jit
  def old_loop(params, src, tree=old_tree, rule=old_rule, cache=cache):
    fns = model_lib.decode_fns(new_m, params)  # today's model under the old loop: the loops alone differ
    old_fns = old_decoding.ModelFns(fns.score, fns.propose, fns.move)
    r = old_decoding.blockwise(old_fns, fns.init(src, cache), fixed=old_decoding.Fixed(batch, max_len, BOS, NEVER),
                               tree=tree, rule=rule)
    return r.tokens_BxL, r.invocations

  a, b = jax.device_get(new_loop(params, src)), jax.device_get(old_loop(params, src))
  assert np.array_equal(a[0], b[0]) and int(a[1]) == int(b[1]), f'{spec}: old and new loops differ'
  old_cost = cost(old_loop.lower(params, src).compile())
  new_cost = cost(new_loop.lower(params, src).compile())
  old_s, new_s = timing.time_alternating([lambda: jax.block_until_ready(old_loop(params, src)),
                                          lambda: jax.block_until_ready(new_loop(params, src))], repeats, spec)
  print(f'| {spec} | {size} | {batch} | {old_cost[0]} / {new_cost[0]} | {old_cost[1]:.4g} / {new_cost[1]:.4g} | '
        f'{old_cost[2]:.4g} / {new_cost[2]:.4g} | {1e3 * old_s:.1f} | {1e3 * new_s:.1f} | {new_s / old_s:.3f} |',
        flush=True)
