r"""The backend's floor under the price of verification: only the matmuls of a greedy step and of an iteration.

  python -m experiments.matmul_floor --config=configs/multi30k_ende.py --ks=4,8 --batch_sizes=1 --repeats=7

For the config's model size (random weights, as experiments/bench_decode.py), four jitted `lax.while_loop`s run
alternately (bpd/timing.py), --max_len greedy steps or max_len / k iterations each:
  model greedy / model blockwise: the real decoding loops (experiments/profile_decode.py's programs: greedy, and
    blockwise with min_block:k, so every iteration accepts k tokens);
  matmuls greedy / matmuls blockwise: a program with nothing but the weight matmuls of one step / one iteration,
    at the same shapes, reading the same parameter arrays: per decoder layer the self-attention query, key,
    value and output projections, the cross-attention query and output projections and the feed-forward pair at
    M = B (greedy) or M = B x k rows (iteration); the tied vocabulary projection at M rows; for the iteration
    also the multi-output layer at one position per row (k - 1 heads, [d, d_ff] and [d_ff, d] each) and its
    vocabulary projection at B x (k - 1) rows. Each matmul feeds the next (through a tanh, so XLA can neither
    hoist nor drop them), with no attention over caches, no layer norms, no argmax, no cache writes.
The matmul programs' ratio is what this backend gives for the weights alone; the model's ratio over it is the
model's own overhead (every kernel that is not one of these matmuls, and the matmuls' fusion with them).

Compare the printed per-step times across rows only within one run: the machine's load moves them.
"""

import functools

from absl import app
from absl import flags
import jax
import jax.numpy as jnp
from ml_collections import config_flags
import numpy as np

from bpd import errors
from bpd import model as model_lib
from bpd import timing
from experiments import profile_decode

if __name__ == '__main__':
  _CONFIG = config_flags.DEFINE_config_file('config', None, 'Config file; its model size and vocabulary are used.')
  _KS = flags.DEFINE_list('ks', ['4', '8'], 'Block sizes k.')
  _BATCH_SIZES = flags.DEFINE_list('batch_sizes', ['1'], 'Batch sizes.')
  _MAX_LEN = flags.DEFINE_integer('max_len', 120, 'Tokens decoded per run (a multiple of every k).')
  _SRC_LEN = flags.DEFINE_integer('src_len', 24, 'Source length.')
  _REPEATS = flags.DEFINE_integer('repeats', 7, 'Alternating timed runs.')
  _PERCENTILE = flags.DEFINE_float('percentile', 50, "Percentile of each program's timed runs (50: the median; "
                                   'lower on a loaded machine keeps the least disturbed runs).')


def layer_matrices(params, num_layers):
  """Per decoder layer the [in, out] weight matrices a decoding call multiplies by, in the order it does."""
  out = []
  for i in range(num_layers):
    layer = params[f'decoder_layers_{i}']
    flat_in = lambda kernel: kernel.reshape(kernel.shape[0], -1)    # DenseGeneral [D, H, K] -> [D, D]
    flat_out = lambda kernel: kernel.reshape(-1, kernel.shape[-1])  # [H, K, D] -> [D, D]
    self_attn, cross = layer['self_attn'], layer['cross_attn']
    out.append([flat_in(self_attn['query']['kernel']), flat_in(self_attn['key']['kernel']),
                flat_in(self_attn['value']['kernel']), flat_out(self_attn['out']['kernel']),
                flat_in(cross['query']['kernel']), flat_out(cross['out']['kernel']),
                layer['ff']['wi']['kernel'], layer['ff']['wo']['kernel']])
  return out


def matmul_step(params, x_MxD, num_layers, heads, batch):
  """One step's (heads = 0) or one iteration's (heads = k - 1) weight matmuls on M = batch x (1 or k) rows;
  returns the next x_MxD. params['multi_output'] holds exactly `heads` heads (cut outside the loop).

  Self-attention's q, k and v all read the layer's input (their sum goes on, so none is dead); every other matmul
  reads the previous one's output, as in the model."""
  embedding_VxD = params['embed']['embedding']
  h = x_MxD
  for q, k, v, o, cq, co, wi, wo in layer_matrices(params, num_layers):
    a = jnp.tanh(h @ q + h @ k + h @ v) @ o
    c = jnp.tanh(a @ cq) @ co
    h = jnp.tanh(jax.nn.relu(c @ wi) @ wo)
  logits_MxV = jnp.einsum('md,vd->mv', h, embedding_VxD)
  signal = jnp.max(logits_MxV) * 1e-6  # the next step depends on the projection, as the next token does
  if heads:
    heads_params = params['multi_output']
    last_BxD = h.reshape(batch, -1, h.shape[-1])[:, -1]  # the proposals come from one position per row
    # In the multi-output layer's layout (layers.MultiOutput): the head axis first, a batched matmul per weight.
    x_NxBxD = jnp.broadcast_to(last_BxD, (heads,) + last_BxD.shape)
    hidden_NxBxF = jax.nn.relu(jnp.einsum('nbd,ndf->nbf', x_NxBxD, heads_params['wi_kernel']))
    vectors_BxNxD = jnp.moveaxis(jnp.einsum('nbf,nfd->nbd', hidden_NxBxF, heads_params['wo_kernel']), 0, 1)
    signal = signal + jnp.max(jnp.einsum('bnd,vd->bnv', jnp.tanh(vectors_BxNxD), embedding_VxD)) * 1e-6
  return jnp.tanh(h + signal)


def main(argv):
  del argv
  config = _CONFIG.value
  k_values = [int(k) for k in _KS.value]
  max_len = _MAX_LEN.value
  c = model_lib.model_config(config.model.size, vocab_size=config.data.vocab_size, k=max(k_values),
                             dropout_rate=0.0, dtype=config.model.dtype)
  model = model_lib.Transformer(c)
  params = model_lib.init_params(c, jax.random.PRNGKey(0))
  cache_len = max_len + max(k_values) + 1
  encode = jax.jit(lambda p, s: model_lib.decode_fns(model, p)[0](s, cache_len))

  @functools.partial(jax.jit, static_argnames=('batch', 'k', 'steps'))
  def matmuls(params_k, batch, k, steps):  # params_k: the first k heads (k = 1: a greedy step), cut outside
    x = jnp.full((batch * k, c.d_model), 0.01, jnp.float32)
    return jax.lax.fori_loop(0, steps, lambda _, x: matmul_step(params_k, x, c.num_decoder_layers, k - 1, batch),
                             x)

  print(f'model {config.model.size}: d={c.d_model}, {c.num_decoder_layers} decoder layers, ff {c.d_ff}, vocab '
        f'{c.vocab_size}; {max_len} tokens per run; {_REPEATS.value} alternating runs, percentile '
        f'{_PERCENTILE.value:g}; ms per greedy '
        'step or iteration')
  print('| k | batch | model step | model iteration | model ratio | matmuls step | matmuls iteration | matmuls ratio '
        '| model ratio / matmuls ratio |')
  print('|---|---|---|---|---|---|---|---|---|')
  rng = np.random.RandomState(0)
  for batch in [int(b) for b in _BATCH_SIZES.value]:
    src = jnp.asarray(rng.randint(4, c.vocab_size, size=(batch, _SRC_LEN.value)), jnp.int32)
    state = jax.block_until_ready(encode(params, src))
    real = profile_decode.programs(model, params, state, k_values, max_len)
    greedy_fn, greedy_args, _, _ = real['greedy']
    for k in k_values:
      block_fn, block_args, block_kwargs, iterations = real[f'blockwise k={k}']
      fns = [lambda: greedy_fn(*greedy_args),
             lambda: block_fn(*block_args, **block_kwargs),
             lambda: matmuls(params, batch=batch, k=1, steps=max_len),
             lambda k=k: matmuls(block_args[0], batch=batch, k=k, steps=iterations)]
      g, b, mg, mb = timing.time_alternating(fns, _REPEATS.value, f'matmul_floor k={k} batch={batch}',
                                             lambda t: float(np.percentile(t, _PERCENTILE.value)))
      # The blockwise loop's first call only proposes (about one greedy step): not an iteration.
      step, iteration = g / max_len, (b - g / max_len) / iterations
      m_step, m_iteration = mg / max_len, mb / iterations
      print(f'| {k} | {batch} | {1e3 * step:.3f} | {1e3 * iteration:.3f} | {iteration / step:.2f} | '
            f'{1e3 * m_step:.3f} | {1e3 * m_iteration:.3f} | {m_iteration / m_step:.2f} | '
            f'{(iteration / step) / (m_iteration / m_step):.2f} |', flush=True)


if __name__ == '__main__':
  flags.mark_flags_as_required(['config'])
  app.run(lambda argv: errors.exit_on_user_error(main, argv))
