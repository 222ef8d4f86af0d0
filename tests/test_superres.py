"""Super-resolution through the real entry points (train_and_evaluate, decode_sweep) on a tiny config:
npy and mock-TFDS data, frozen heads, the decode sweep's PSNR/SSIM records and image grid, clear errors."""

import json
import os
import shutil
import subprocess
import sys
import time

import jax
import numpy as np
from PIL import Image
import pytest

from bpd import checkpoint
from bpd import evaluate
from bpd import evaluate_images
from bpd import train
from bpd.data import images
from bpd.data import pipeline
from bpd.errors import UserError
from configs import celeba_sr
from configs import common
from experiments import study
from tests.test_images import _write_prepared_celeba_metadata

DECODE_LEN = 24  # decode only the first 24 of 3072 sub-pixels: the loop is the same, the test is fast


def fake_faces(n, seed):
  """Smooth random 32x32 'faces' (upsampled 4x4 noise): neighbouring sub-pixels are predictable."""
  coarse = np.random.default_rng(seed).integers(0, 256, (n, 4, 4, 3)).astype(np.uint8)
  return np.repeat(np.repeat(coarse, 8, axis=1), 8, axis=2)


def npy_dir(root):
  """A folder laid out like ../shared/data/celeba32 (train/val .npy and _8x8.npy), with 6 and 3 images."""
  os.makedirs(root, exist_ok=True)
  for split, n, seed in (('train', 6, 0), ('val', 3, 1)):
    highres = fake_faces(n, seed)
    np.save(os.path.join(root, f'{split}.npy'), highres)
    np.save(os.path.join(root, f'{split}_8x8.npy'), images.downsample_area(highres, 8))
  return root


def tiny_config(data_dir, **overrides):
  c = celeba_sr.get_config('runlocal')
  c.data.dir = data_dir
  c.data.max_eval_examples = 2
  c.train.batch_size = 2
  c.train.num_steps = 2
  c.train.checkpoint_every = 2
  c.train.log_every = 1
  c.train.eval_every = 2
  c.decode.ks = (3,)  # each setting costs a compile
  c.decode.criteria = ('exact', 'distance:2')
  c.decode.batch_sizes = (1,)
  c.decode.max_examples = 2
  c.decode.max_len = DECODE_LEN
  return common.override(c, **overrides)


@pytest.fixture(scope='module')
def trained(tmp_path_factory):
  """A base model (2 steps) and a 3-head frozen model (2 steps) on fake npy faces."""
  root = tmp_path_factory.mktemp('sr')
  data = npy_dir(str(root / 'data'))
  base_dir, heads_dir = str(root / 'base'), str(root / 'frozen')
  base_metrics = train.train_and_evaluate(tiny_config(data, **{'train.eval_every': 0}), base_dir)
  heads_metrics = train.train_and_evaluate(
      tiny_config(data, **{'k': 3, 'train.regime': 'frozen', 'train.init_from': base_dir,
                           'train.eval_psnr_examples': 1}), heads_dir)
  return data, base_dir, heads_dir, base_metrics, heads_metrics


def test_training_on_images_uses_pixel_vocabulary_and_local_attention(trained):
  _, base_dir, heads_dir, base_metrics, heads_metrics = trained
  for workdir in (base_dir, heads_dir):
    model_config = checkpoint.read_model_config(workdir)
    assert model_config.vocab_size == images.IMAGE_VOCAB_SIZE
    assert model_config.attention_block == 128
    assert (model_config.image_side, model_config.image_input_side) == (32, 8)  # 2D positions (celeba_sr.py)
    assert not os.path.exists(os.path.join(workdir, 'spm.model'))  # no tokenizer for pixels
  assert checkpoint.read_model_config(heads_dir).k == 3
  assert base_metrics == {'step': 2}  # eval_every=0
  assert {'loss', 'accuracy_head1', 'accuracy_head3', 'greedy_psnr'} <= set(heads_metrics)


def test_frozen_image_heads_leave_the_base_bitwise_unchanged(trained):
  _, base_dir, heads_dir, _, _ = trained
  base = jax.device_get(checkpoint.load_params(base_dir)[1])
  heads = jax.device_get(checkpoint.load_params(heads_dir)[1])
  assert set(heads) == set(base) | {'multi_output'}
  for name in base:
    jax.tree.map(np.testing.assert_array_equal, heads[name], base[name])


def test_image_decode_sweep_writes_psnr_records_and_grid(trained):
  data, _, heads_dir, _, _ = trained
  records = evaluate.decode_sweep(tiny_config(data, k=3), heads_dir)
  out = os.path.join(heads_dir, 'decode')
  assert json.load(open(os.path.join(out, 'results.json'))) == json.loads(json.dumps(records))
  assert {(r['k'], r['criterion']) for r in records} == {(1, 'greedy'), (3, 'exact'), (3, 'distance:2')}
  for r in records:
    assert r['quality_metric'] == 'psnr' and r['examples'] == 2
    for key in ('quality', 'ssim', 'psnr_vs_greedy', 'distinct_intensities', 'greedy_quality',
                'mean_accepted_block_size', 'iterations', 'invocations', 'tokens', 'seconds', 'greedy_seconds',
                'speedup', 'identical_to_greedy', 'nearest_psnr', 'nearest_ssim', 'bicubic_psnr', 'bicubic_ssim'):
      assert key in r, key
    assert r['tokens'] == 2 * DECODE_LEN  # no EOS: every image runs to max_len
    assert 1.0 <= r['mean_accepted_block_size'] <= r['k'] + 1 and 1 <= r['distinct_intensities'] <= 256
    if r['criterion'] in ('greedy', 'exact'):
      assert r['identical_to_greedy'] == 1.0
      assert r['quality'] == records[0]['quality'] and r['psnr_vs_greedy'] == float('inf')
  assert 'PSNR vs greedy' in open(os.path.join(out, 'results.md')).read()
  greedy = np.load(os.path.join(out, 'val.greedy.b1.npy'))
  assert greedy.shape == (2, 32, 32, 3) and greedy.dtype == np.uint8
  assert not greedy.reshape(2, -1)[:, DECODE_LEN:].any()  # not decoded: black
  # Grid: rows input, greedy, 2 blockwise settings, ground truth; 2 columns; cells 32*4 px + 2 px gaps.
  grid = Image.open(os.path.join(out, 'val.grid.png'))
  assert grid.height == 5 * (128 + 2) + 2
  assert grid.width > 2 * (128 + 2) + 2  # plus the label column


def test_batch1_decodes_only_the_first_images_and_the_grid_uses_the_full_batch(trained, tmp_path):
  data, _, heads_dir, _, _ = trained
  workdir = str(tmp_path / 'frozen')
  shutil.copytree(heads_dir, workdir, ignore=shutil.ignore_patterns('decode*'))
  config = tiny_config(data, k=3, **{'decode.batch_sizes': (2, 1), 'decode.batch1_examples': 1,
                                     'decode.criteria': ('exact',), 'decode.matmul_precision': 'highest'})
  records = evaluate.decode_sweep(config, workdir)
  assert {(r['batch_size'], r['examples']) for r in records} == {(2, 2), (1, 1)}
  assert all(r['identical_to_greedy'] == 1.0 for r in records)
  width_2_examples = Image.open(os.path.join(workdir, 'decode', 'val.grid.png')).width
  assert width_2_examples > 2 * (128 + 2) + 2  # 2 examples plus the label column
  assert np.load(os.path.join(workdir, 'decode', 'val.greedy.b1.npy')).shape == (1, 32, 32, 3)
  # Batch 1 alone: the grid shows the images it decoded.
  shutil.rmtree(os.path.join(workdir, 'decode'))
  evaluate.decode_sweep(common.override(config, **{'decode.batch_sizes': (1,)}), workdir)
  assert Image.open(os.path.join(workdir, 'decode', 'val.grid.png')).width == width_2_examples - (128 + 2)


def test_image_sampling_through_the_decode_sweep_is_reproducible_and_in_the_grid(trained, tmp_path):
  """config.decode.temperature > 0 adds a sampled row (k = 1, criterion sample:T) beside greedy and the blockwise
  rows: PSNR and the image fields, its own .npy, a row of the grid; the same seed gives the same images."""
  data, _, heads_dir, _, _ = trained
  config = tiny_config(data, k=3, **{'decode.criteria': ('exact',), 'decode.temperature': 1.0,
                                     'decode.seed': 5})
  outputs = []
  for name in ('a', 'b'):
    workdir = str(tmp_path / name)
    shutil.copytree(heads_dir, workdir, ignore=shutil.ignore_patterns('decode*'))
    records = evaluate.decode_sweep(config, workdir)
    outputs.append(np.load(os.path.join(workdir, 'decode', 'val.sample1.b1.npy')))
  assert [(r['k'], r['criterion']) for r in records] == [(1, 'greedy'), (1, 'sample:1'), (3, 'exact')]
  sampled = records[1]
  assert sampled['quality_metric'] == 'psnr' and (sampled['temperature'], sampled['seed']) == (1.0, 5)
  assert sampled['tokens'] == 2 * DECODE_LEN and sampled['mean_accepted_block_size'] == 1.0
  for key in ('quality', 'ssim', 'psnr_vs_greedy', 'distinct_intensities', 'identical_to_greedy', 'speedup'):
    assert key in sampled, key
  np.testing.assert_array_equal(outputs[0], outputs[1])
  assert outputs[0].shape == (2, 32, 32, 3)
  assert 'sample:1' in open(os.path.join(workdir, 'decode', 'results.md')).read()
  grid = Image.open(os.path.join(workdir, 'decode', 'val.grid.png'))
  assert grid.height == 5 * (128 + 2) + 2  # input, greedy, sample:1, k3.exact, ground truth


def test_decoded_images_round_trip_the_tokens(trained):
  tokens_NxL = np.arange(2 * DECODE_LEN).reshape(2, DECODE_LEN) % 256 + images.PIXEL_OFFSET
  out = evaluate_images.outputs_to_images(tokens_NxL)
  np.testing.assert_array_equal(images.image_to_tokens(out)[:, :DECODE_LEN], tokens_NxL)


def test_mock_tfds_celeb_a_through_the_pipeline(tmp_path):
  tfds = pytest.importorskip('tensorflow_datasets')
  _write_prepared_celeba_metadata(str(tmp_path))
  config = tiny_config('', **{'data.image_source': 'tfds', 'data.tfds_data_dir': str(tmp_path),
                              'data.train_split': 'train', 'data.eval_split': 'validation'})
  with tfds.testing.mock_data(num_examples=5, policy=tfds.testing.MockPolicy.USE_FILES, data_dir=str(tmp_path)):
    pipeline.check_source(config.data, need_splits=('train', 'validation'))
    lowres, highres = pipeline.load_image_split(config.data, 'validation', max_examples=3)
    src_NxS, tgt_NxT = pipeline.image_tokens(lowres, highres)
    with pytest.raises(UserError, match="split 'valid'"):
      pipeline.check_source(config.data, need_splits=('valid',))
  assert src_NxS.shape == (3, 192) and tgt_NxT.shape == (3, 3072)
  assert src_NxS.min() >= images.PIXEL_OFFSET and tgt_NxT.max() < images.IMAGE_VOCAB_SIZE


def test_fixed_train_batches_depend_on_seed_and_step_only():
  from bpd.data import batching  # pylint: disable=g-import-not-at-top
  src = np.arange(5 * 3).reshape(5, 3) + 3
  tgt = np.arange(5 * 7).reshape(5, 7) + 3
  a = batching.make_fixed_train_batch_fn(src, tgt, 2, seed=1)
  b = batching.make_fixed_train_batch_fn(src, tgt, 2, seed=1)
  assert a.steps_per_epoch == 3
  seen = set()
  for step in (0, 1, 2):
    batch = a(step)
    assert batch['src_BxS'].shape == (2, 3) and batch['tgt_BxT'].shape == (2, 7)
    np.testing.assert_array_equal(batch['tgt_BxT'], b(step)['tgt_BxT'])
    seen |= {int(r[0]) for r in batch['src_BxS']}
  assert seen == set(src[:, 0].tolist())  # every image once per epoch


def test_input_noise_moves_only_pixel_inputs_and_stays_in_range():
  """config.train.input_noise: noise on the decoder's input pixel ids only (BOS and padding kept), rounded and
  clipped to the 256 intensities; its std as asked; 0 leaves training's inputs as they were."""
  tgt_in = np.tile(np.array([[2, 3, 100, 258, 130, 0]]), (4000, 1))
  noisy = np.asarray(train.noisy_pixel_inputs(jax.numpy.asarray(tgt_in), jax.random.PRNGKey(0), 40.0))
  np.testing.assert_array_equal(noisy[:, [0, 5]], tgt_in[:, [0, 5]])
  assert noisy[:, 1:5].min() >= images.PIXEL_OFFSET and noisy[:, 1:5].max() < images.IMAGE_VOCAB_SIZE
  assert abs(np.std(noisy[:, 4] - 130) - 40) < 2 and abs(np.mean(noisy[:, 4] - 130)) < 2  # far from the clips
  assert (noisy[:, 1] >= 3).all() and (noisy[:, 1] == 3).mean() > 0.4  # intensity 0: half the noise clips to 0


def test_colocated_model_with_input_noise_trains_and_decodes(tmp_path):
  """configs/celeba_sr.py:...,colocated with input noise, through the real entry points: model.json records the
  switch (check_init_from compares it) and the decode sweep's greedy runs on the cached path with the source in
  the decode state."""
  data = npy_dir(str(tmp_path / 'data'))
  workdir = str(tmp_path / 'colocated')
  config = tiny_config(data, **{'model.colocated_input': True, 'train.input_noise': 20.0, 'train.eval_every': 0})
  train.train_and_evaluate(config, workdir)
  assert checkpoint.read_model_config(workdir).colocated_input
  records = evaluate.decode_sweep(config, workdir)
  assert [r['criterion'] for r in records] == ['greedy'] and records[0]['tokens'] == 2 * DECODE_LEN
  faithful = tiny_config(data, **{'k': 3, 'train.regime': 'frozen', 'train.init_from': workdir})
  _expect_error('colocated_input: True there, False here', train.train_and_evaluate, faithful,
                str(tmp_path / 'frozen'))


# -- clear errors, before any compile -------------------------------------------------------------------------

def _expect_error(match, fn, *args):
  start = time.time()
  with pytest.raises(UserError, match=match):
    fn(*args)
  assert time.time() - start < 10


def test_error_missing_image_dir(tmp_path):
  _expect_error(r'\(config\.data\.dir\) does not exist', train.train_and_evaluate,
                tiny_config(str(tmp_path / 'nope')), str(tmp_path / 'w'))


def test_error_bad_input_noise(tmp_path):
  data = npy_dir(str(tmp_path / 'data'))
  _expect_error(r'config\.train\.input_noise=-1', train.train_and_evaluate,
                tiny_config(data, **{'train.input_noise': -1.0}), str(tmp_path / 'w'))


def test_error_missing_image_split(tmp_path):
  data = npy_dir(str(tmp_path / 'data'))
  _expect_error(r"Missing .*valid\.npy.*\['train\.npy', 'train_8x8\.npy', 'val\.npy', 'val_8x8\.npy'\]",
                train.train_and_evaluate, tiny_config(data, **{'data.eval_split': 'valid'}), str(tmp_path / 'w'))


def test_error_bad_matmul_precision_and_unknown_decode_model(tmp_path, trained):
  data, _, heads_dir, _, _ = trained
  _expect_error('matmul_precision', evaluate.decode_sweep,
                tiny_config(data, k=3, **{'decode.matmul_precision': 'fp8'}), heads_dir)
  plan = study.SuperresPlan(stages=('decode',), regimes=('frozen',), decode_models=('finetune',))
  _expect_error('no model', study.run_superres, tiny_config(data), str(tmp_path), plan)


def test_error_bad_image_source_and_decode_length(tmp_path, trained):
  data, _, heads_dir, _, _ = trained
  _expect_error(r"image_source='png' is not one of \('npy', 'tfds'\)", train.train_and_evaluate,
                tiny_config(data, **{'data.image_source': 'png'}), str(tmp_path / 'w'))
  _expect_error(r'max_len=4000: a 32x32x3 image has 3072 sub-pixels', evaluate.decode_sweep,
                tiny_config(data, **{'k': 3, 'decode.max_len': 4000}), heads_dir)


def test_error_negative_temperature(trained):
  data, _, heads_dir, _, _ = trained
  _expect_error(r'config\.decode\.temperature=-0\.5 must be >= 0', evaluate.decode_sweep,
                tiny_config(data, **{'k': 3, 'decode.temperature': -0.5}), heads_dir)


def test_distill_on_images_is_a_clear_error_before_anything_runs(tmp_path):
  """Through the real command line, on an empty workdir with no data: the first thing the user hears is that
  distillation is for translation and what to do for images, not a missing checkpoint or a WMT14 error."""
  repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  workdir = tmp_path / 'sr'
  cmd = [sys.executable, '-m', 'bpd.main', '--config=configs/celeba_sr.py:runlocal', f'--workdir={workdir}',
         '--mode=distill', f'--config.data.dir={tmp_path / "no_data"}']
  proc = subprocess.run(cmd, cwd=repo, capture_output=True, text=True, timeout=120)
  assert proc.returncode != 0
  assert 'error: --mode=distill is sequence-level knowledge distillation for translation' in proc.stderr
  assert 'not defined for super-resolution' in proc.stderr and 'distance:2' in proc.stderr
  assert 'Traceback' not in proc.stderr and 'WMT14' not in proc.stderr
  assert not workdir.exists()  # nothing was written


def test_study_skips_trained_stages_decodes_and_writes_table_and_grid(trained, tmp_path):
  data, base_dir, heads_dir, _, _ = trained
  root = str(tmp_path / 'study')
  shutil.copytree(base_dir, os.path.join(root, 'base'), ignore=shutil.ignore_patterns('decode*'))
  shutil.copytree(heads_dir, os.path.join(root, 'frozen'), ignore=shutil.ignore_patterns('decode*'))
  plan = study.SuperresPlan(regimes=('frozen',), ks=(3,), max_examples=2, base_steps=2, head_steps=2)
  config = tiny_config(data, k=3)
  study.run_superres(config, root, plan)  # both models are trained to their steps: decode and table only
  rows = json.load(open(os.path.join(root, 'study.json')))
  assert {(r['model'], r['k'], r['criterion']) for r in rows} >= {
      ('base', 1, 'greedy'), ('frozen', 3, 'exact'), ('frozen', 3, 'distance:2')}
  assert all(r['identical_to_greedy'] == 1.0 for r in rows if r['criterion'] == 'exact')
  grid = Image.open(os.path.join(root, 'study_val_grid.png'))
  assert grid.height == 5 * (128 + 2) + 2  # input, ground truth, base greedy, frozen k3 exact and distance:2
  for name in ('study.md', 'study.csv', 'study_paper.md', 'study_val_b1_frozen.png'):
    assert os.path.exists(os.path.join(root, name)), name
  stamp = os.path.getmtime(os.path.join(root, 'frozen', 'decode_val', 'results.json'))
  study.run_superres(config, root, plan)
  assert os.path.getmtime(os.path.join(root, 'frozen', 'decode_val', 'results.json')) == stamp


def test_table2_layout_puts_each_cell_beside_the_papers():
  """study_table2_*.md: the paper's four rows by k (no k = 1 column: the base's greedy is not a Table 2 cell),
  ours as block / PSNR beside the paper's block, each model's greedy PSNR, and the enlargement baselines."""
  common = dict(split='val', batch_size=16, examples=16, nearest_psnr=18.72, bicubic_psnr=20.3)
  rows = [dict(common, model='base', criterion='greedy', k=1, quality=19.49, mean_accepted_block_size=1.0),
          dict(common, model='base', criterion='exact', k=1, quality=19.49, mean_accepted_block_size=1.0)]
  for model, greedy in (('frozen', 19.49), ('finetune', 19.56)):
    rows.append(dict(common, model=model, criterion='greedy', k=1, quality=greedy, mean_accepted_block_size=1.0))
    for k in (2, 10):
      for criterion, block in (('exact', 1.2), ('distance:2', 1.5)):
        rows.append(dict(common, model=model, criterion=criterion, k=k, quality=greedy + 0.01,
                         mean_accepted_block_size=block + k / 10))
  md = study.table2_markdown(rows)
  header = next(line for line in md.split('\n') if line.startswith('| row'))
  assert header == '| row | model greedy PSNR | k = 2 | paper | k = 10 | paper |'
  both = next(line for line in md.split('\n') if line.startswith('| Both'))
  assert both == '| Both (finetune, distance:2) | 19.56 dB | 1.70 / 19.57 dB | 1.96 | 2.50 / 19.57 dB | 6.79 |'
  regular = next(line for line in md.split('\n') if line.startswith('| Regular'))
  assert regular == '| Regular (frozen, exact) | 19.49 dB | 1.40 / 19.50 dB | 1.07 | 2.20 / 19.50 dB | 1.10 |'
  assert 'nearest enlargement 18.72 dB, bicubic enlargement 20.30 dB' in md


def test_a_stage_stopped_early_stops_the_study(monkeypatch, tmp_path):
  """A base that returns before its last step (SIGTERM: train saves and returns) must not be handed to the heads
  or decoded: the study stops and says to rerun."""
  calls = []
  monkeypatch.setattr(study.train, 'train_and_evaluate', lambda cfg, workdir: calls.append(workdir))
  monkeypatch.setattr(study, 'decode_superres', lambda *a: calls.append('decode'))
  study.run_superres(tiny_config(str(tmp_path)), str(tmp_path), study.SuperresPlan(base_steps=5))
  assert calls == [os.path.join(str(tmp_path), 'base')]
