"""experiments/bench_decode.py --mode=profile: the HLO parsing and the per-kernel profile on a small jitted program."""

import jax
import jax.numpy as jnp

from experiments import bench_decode


def test_shape_bytes_counts_every_array_in_an_hlo_fragment():
  assert bench_decode.shape_bytes('f32[1,4,256]{2,1,0}') == 4 * 1024
  assert bench_decode.shape_bytes('(bf16[8], s32[2,3], pred[])') == 16 + 24 + 1


def test_profile_finds_the_kernels_of_a_compiled_program_and_their_bytes():
  x, w = jnp.ones((4, 256)), jnp.ones((256, 512))
  fn = jax.jit(lambda x, w: jnp.tanh(x @ w))
  instructions = bench_decode.hlo_instructions(fn.lower(x, w).compile().as_text())
  # The matmul: its output [4, 512] and both operands, float32.
  dots = [i for i in instructions.values() if i['shape'] == 'f32[4,512]' and 'dot_general' in i['op']]
  assert dots and dots[0]['bytes'] == 4 * (4 * 512 + 4 * 256 + 256 * 512)
  kernels = bench_decode.profile(lambda: fn(x, w), 3, instructions)
  assert kernels and all(name in instructions for name in kernels)
  assert all(count == 3 and ns > 0 for ns, count in kernels.values())
  table = bench_decode.kernel_table('### tiny', kernels, instructions, steps=3, top=5)
  assert table.startswith('### tiny:') and '| kernel | kind |' in table
  assert len(table.splitlines()) == 4 + min(5, len(kernels))


def test_loop_programs_include_each_tree_with_its_iterations_as_trip_count():
  """--trees: a context-aware tree over sequential heads is profiled as its own loop; its trip count is the
  iterations it ran (random heads: about one token each), not max_len / k."""
  from bpd import model as model_lib  # pylint: disable=import-outside-toplevel
  config = model_lib.model_config('tiny', vocab_size=40, k=3, dropout_rate=0.0, head_type='sequential')
  model = model_lib.Transformer(config)
  params = model_lib.init_params(config, jax.random.PRNGKey(0))
  max_len = 6
  state = jax.jit(lambda p, s: model_lib.decode_fns(model, p).init(s, max_len + 4 + 1))(params, jnp.ones((1, 5), jnp.int32))
  programs = bench_decode.loop_programs(model, params, state, [3], max_len, tree_specs=['dynamic:4'])
  assert list(programs) == ['greedy', 'blockwise k=3', 'dynamic:4 k=3']
  jitted, args, kwargs, iterations = programs['dynamic:4 k=3']
  tokens, invocations = jitted(*args, **kwargs)
  assert tokens.shape == (1, max_len) and 1 <= iterations == int(invocations) - 1 <= max_len
