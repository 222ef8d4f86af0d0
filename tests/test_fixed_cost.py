"""A batch-1 sentence's fixed cost: per-batch source buckets, the one-device host batch, and the whole-call
breakdown of experiments/bench_decode.py --mode=fixed_cost."""

import jax
import jax.numpy as jnp
import numpy as np

from bpd import decoder as decoder_lib
from bpd import model as model_lib
from bpd import sharding
from experiments import bench_decode


def test_source_buckets_are_the_multiples_of_8_up_to_the_split_bucket():
  src_ids = [np.arange(1, 4), np.arange(1, 20), np.arange(1, 9)]
  assert decoder_lib.source_bucket(src_ids) == 24
  assert decoder_lib.source_buckets(src_ids) == (8, 16, 24)


def test_run_batches_pads_each_batch_to_its_own_bucket_and_keeps_source_order():
  """At batch 1 a sentence is padded to its own length rounded up to 8, not to the split's longest source."""
  src_ids = [np.arange(1, 4), np.arange(1, 20), np.arange(1, 9), np.arange(1, 12)]
  widths = []

  def fn(src_BxS):
    widths.append(src_BxS.shape[1])
    return np.sum(src_BxS, axis=1)

  out, _ = decoder_lib.run_batches(fn, src_ids, 1)
  assert widths == [8, 24, 8, 16]
  assert [int(o) for o in out] == [int(np.sum(s)) for s in src_ids]
  widths.clear()
  decoder_lib.run_batches(fn, src_ids, 1, bucket=24)  # one given length: the old behaviour, every batch at 24
  assert widths == [24] * 4
  widths.clear()
  decoder_lib.run_batches(fn, src_ids, 2)  # a batch is padded to its longest row's bucket
  assert widths == [24, 16]


def test_time_side_by_side_with_per_batch_buckets_compiles_nothing_while_timing():
  f = jax.jit(lambda src: jnp.sum(src, axis=1))
  src_ids = [np.arange(1, 4), np.arange(1, 20), np.arange(1, 12)]
  # Three buckets (8, 24, 16), each compiled in the untimed warm-up: RecompileError otherwise.
  seconds = decoder_lib.time_side_by_side([f], src_ids, 1, repeats=2)
  assert len(seconds) == 1


def test_one_device_mesh_decodes_the_host_batch_as_it_is():
  """Decoder._put hands a numpy batch to the jitted call on one device; the outputs equal the no-mesh decoder's."""
  config = model_lib.model_config('tiny', vocab_size=32, k=2, dropout_rate=0.0)
  model, params = model_lib.Transformer(config), model_lib.init_params(config, jax.random.PRNGKey(0))
  src = np.array([[5, 6, 7, 3, 0, 0, 0, 0]], np.int32)
  mesh = sharding.make_mesh(1)
  on_mesh = decoder_lib.Decoder(model, 6, mesh)
  assert isinstance(on_mesh._put(src), np.ndarray)  # pylint: disable=protected-access
  got = jax.device_get(on_mesh.greedy(sharding.replicate(params, mesh), src))
  want = jax.device_get(decoder_lib.Decoder(model, 6).greedy(params, jnp.asarray(src)))
  np.testing.assert_array_equal(got.tokens_BxL, want.tokens_BxL)
  np.testing.assert_array_equal(got.length_B, want.length_B)


def test_fit_and_the_whole_call_timeline_of_a_jitted_loop():
  """The line of --mode=fixed_cost and --mode=latency recovers a known fixed and per-step cost."""
  fixed, per_step = bench_decode.fit([1, 9, 17, 33], [2e-3 + 5e-4 * n for n in (1, 9, 17, 33)])
  np.testing.assert_allclose([fixed, per_step], [2e-3, 5e-4], rtol=1e-9)
  steps = np.array([3.0, 5.0, 8.0, 13.0, 21.0])
  np.testing.assert_allclose(bench_decode.fit(steps, 1.5e-3 + 0.25e-3 * steps), [1.5e-3, 0.25e-3], rtol=1e-9)

  @jax.jit
  def loop(x):
    x = jnp.tanh(x @ x)  # before the loop
    return jax.lax.while_loop(lambda c: c[0] < 5, lambda c: (c[0] + 1, jnp.tanh(c[1] @ c[1])), (0, x))[1]

  x = jnp.ones((64, 64)) / 64
  jax.block_until_ready(loop(x))
  phases = bench_decode.trace_timeline(lambda: jax.device_get(loop(x)), runs=3)
  assert set(phases) == {'python', 'before loop', 'loop', 'copy back'}
  assert all(ms >= 0 for ms in phases.values()) and phases['loop'] > 0


def test_matmul_floor_step_reads_every_weight_matrix_at_the_iterations_shapes():
  """The matmul-only program of bench_decode --mode=matmul_floor: a step keeps x's shape, and an iteration's program
  multiplies by every decoder weight matrix, the embedding and the k - 1 heads' kernels."""
  config = model_lib.model_config('tiny', vocab_size=32, k=3, dropout_rate=0.0)
  params = model_lib.init_params(config, jax.random.PRNGKey(0))
  x = jnp.full((2 * 3, config.d_model), 0.01)
  out = bench_decode.matmul_step(params, x, config.num_decoder_layers, heads=2, batch=2)
  assert out.shape == x.shape and bool(jnp.all(jnp.isfinite(out)))
  matrices = bench_decode.layer_matrices(params, config.num_decoder_layers)
  assert len(matrices) == config.num_decoder_layers and all(len(m) == 8 for m in matrices)
  assert all(m.ndim == 2 for layer in matrices for m in layer)
  jaxpr = str(jax.make_jaxpr(lambda p, x: bench_decode.matmul_step(p, x, config.num_decoder_layers, 2, 2))(params, x))
  # 8 per layer, the vocabulary projection of the k rows, and the heads' two kernels and their projection.
  assert jaxpr.count('dot_general') == 8 * config.num_decoder_layers + 1 + 3


def test_profile_median_counts_each_kernel_at_its_median_run():
  x, w = jnp.ones((4, 256)), jnp.ones((256, 512))
  fn = jax.jit(lambda x, w: jnp.tanh(x @ w))
  instructions = bench_decode.hlo_instructions(fn.lower(x, w).compile().as_text())
  kernels = bench_decode.profile(lambda: fn(x, w), 5, instructions, reduce='median')
  assert kernels and all(count == 5 and ns > 0 for ns, count in kernels.values())


def test_every_part_of_the_fixed_cost_breakdown_runs():
  """--mode=fixed_cost's programs (dispatch, encoder alone, greedy and blockwise at each length, copy back,
  batching), each run once on a tiny model: the encoder-alone program once called the model's score function."""
  c = model_lib.model_config('tiny', vocab_size=50, k=2, dropout_rate=0.0)
  model, params = model_lib.Transformer(c), model_lib.init_params(c, jax.random.PRNGKey(0))
  src = np.random.default_rng(0).integers(4, 50, (1, 8)).astype(np.int32)
  programs = bench_decode.fixed_cost_programs(model, params, None, 2, (2, 4), {'': src})
  assert {'dispatch', 'encoder', 'greedy L=4', 'blockwise L=4', 'copy back blockwise', 'batching'} <= set(programs)
  for name, fn in programs.items():
    assert fn() is not None, name
