"""The day-to-day pipeline through its real entry points, on tiny configs: train, resume, freeze, decode,
distill, and a clear error for every bad input."""

import json
import os
import shutil
import signal
import subprocess
import sys
import time

import jax
import numpy as np
import pytest

from bpd import checkpoint
from bpd import decoder as decoder_lib
from bpd import decoding
from bpd import distill
from bpd import evaluate
from bpd import model as model_lib
from bpd import train
from bpd.data import pipeline
from bpd.data import synthetic
from bpd.data import tokenizer as tokenizer_lib
from bpd.errors import UserError
from configs import common
from configs import demo

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def tiny_config(**overrides):
  """The demo config, shrunk: 2k synthetic pairs, one length bucket (one compile), a few steps."""
  c = demo.get_config()
  c.model.size = 'tiny'  # the demo's own size is larger; tests keep compiles and steps short
  c.data.synthetic_train_size = 2000
  c.data.vocab_size = 200
  c.data.bucket_lengths = (40,)
  c.data.max_eval_examples = 16
  c.train.batch_size = 16
  c.train.num_steps = 12
  c.train.checkpoint_every = 4
  c.train.log_every = 4
  c.train.eval_every = 0
  c.decode.ks = (2, 3)
  c.decode.criteria = ('exact', 'top_k:2')
  c.decode.batch_sizes = (8,)
  c.decode.max_examples = 12
  c.decode.max_len = 24
  c.distill.beam_size = 2
  c.distill.max_len = 24
  c.distill.batch_size = 16
  return common.override(c, **overrides)


@pytest.fixture(scope='module')
def trained(tmp_path_factory):
  """A base model (12 steps) and a 3-head fine-tuned model (8 steps) on top of it."""
  root = tmp_path_factory.mktemp('runs')
  base_dir, heads_dir = str(root / 'base'), str(root / 'k3')
  train.train_and_evaluate(tiny_config(), base_dir)
  train.train_and_evaluate(tiny_config(**{'k': 3, 'train.regime': 'finetune', 'train.init_from': base_dir,
                                          'train.num_steps': 8}), heads_dir)
  return base_dir, heads_dir


def _params(workdir):
  return jax.device_get(checkpoint.load_params(workdir)[1])


def test_frozen_training_leaves_base_parameters_bitwise_unchanged(trained, tmp_path):
  base_dir, _ = trained
  frozen_dir = str(tmp_path / 'frozen')
  train.train_and_evaluate(tiny_config(**{'k': 3, 'train.regime': 'frozen', 'train.init_from': base_dir,
                                          'train.num_steps': 4}), frozen_dir)
  base, frozen = _params(base_dir), _params(frozen_dir)
  assert set(frozen) == set(base) | {'multi_output'}
  for name in base:
    jax.tree.map(np.testing.assert_array_equal, frozen[name], base[name])
  fresh = _params(frozen_dir)['multi_output']
  assert any(np.abs(x).sum() > 0 for x in jax.tree.leaves(fresh))


def test_head1_weight_weighs_the_first_head_in_the_loss():
  model = model_lib.Transformer(model_lib.model_config('tiny', vocab_size=50, k=3))
  params = model_lib.init_params(model.config, jax.random.PRNGKey(0))
  rng = np.random.default_rng(0)
  batch = {'src_BxS': rng.integers(4, 50, (2, 6)), 'tgt_BxT': rng.integers(4, 50, (2, 5))}
  kwargs = dict(model=model, head_loss='mean', label_smoothing=0.1, train=False)
  plain, aux = train.loss_and_metrics(params, batch, None, **kwargs)
  weighted, _ = train.loss_and_metrics(params, batch, None, head1_weight=4.0, **kwargs)
  loss_K = np.asarray(aux['loss_K'])
  np.testing.assert_allclose(plain, loss_K.mean(), rtol=1e-6)
  np.testing.assert_allclose(weighted, (4 * loss_K[0] + loss_K[1:].sum()) / 6, rtol=1e-6)


def test_finetune_moves_base_parameters(trained):
  base_dir, heads_dir = trained
  base, heads = _params(base_dir), _params(heads_dir)
  assert not np.array_equal(base['decoder_norm']['scale'], heads['decoder_norm']['scale'])


def test_decode_sweep_writes_results_tables_hypotheses_and_plots(trained):
  _, heads_dir = trained
  records = evaluate.decode_sweep(tiny_config(k=3), heads_dir)
  out = os.path.join(heads_dir, 'decode')
  on_disk = json.load(open(os.path.join(out, 'results.json')))
  assert on_disk == json.loads(json.dumps(records))
  settings = {(r['k'], r['criterion']) for r in records}
  assert settings == {(1, 'greedy'), (2, 'exact'), (2, 'top_k:2'), (3, 'exact'), (3, 'top_k:2')}
  for r in records:
    for key in ('split', 'k', 'criterion', 'batch_size', 'quality', 'mean_accepted_block_size', 'iterations',
                'invocations', 'tokens', 'seconds', 'greedy_seconds', 'speedup', 'identical_to_greedy'):
      assert key in r, key
    assert r['tokens'] > 0 and r['seconds'] > 0
    assert r['invocations'] == r['iterations'] + (12 if r['criterion'] != 'greedy' else 0)
    if r['criterion'] in ('exact', 'greedy'):
      assert r['identical_to_greedy'] == 1.0 and r['quality'] == records[0]['quality']
    assert 1.0 <= r['mean_accepted_block_size'] <= r['k'] + 1  # a row's last token may come with its last iteration
  for name in ('results.md', 'test.b8.png', 'test.greedy.b8.txt', 'test.k3.top_k2.b8.txt'):
    assert os.path.exists(os.path.join(out, name)), name
  lines = open(os.path.join(out, 'test.k2.exact.b8.txt'), encoding='utf-8').read().split('\n')
  assert len(lines) == 12 + 1  # one line per source sentence, then the final newline


def test_a_failing_setting_leaves_the_other_rows_written_and_fails_the_sweep(trained, tmp_path, monkeypatch):
  """One setting raises (as a compile that fails would): the sweep logs it, decodes the others, writes their rows,
  and raises naming the setting (bpd.main then exits non-zero)."""
  _, heads_dir = trained
  workdir = str(tmp_path / 'k3')
  shutil.copytree(heads_dir, workdir, ignore=shutil.ignore_patterns('decode'))
  real = decoder_lib.Decoder.blockwise

  def blockwise(self, params, src, rule, tree, seed=0, drafter=decoding.HEADS):
    if tree.depth == 2 and str(rule) == 'top_k:2':
      raise RuntimeError('compile failed')
    return real(self, params, src, rule, tree, seed, drafter)
  monkeypatch.setattr(decoder_lib.Decoder, 'blockwise', blockwise)
  with pytest.raises(evaluate.SettingsFailed, match=r'1 setting\(s\) of the sweep failed: test b8 k2\.top_k2 '
                                                     r'\(RuntimeError: compile failed\)'):
    evaluate.decode_sweep(tiny_config(k=3), workdir)
  on_disk = json.load(open(os.path.join(workdir, 'decode', 'results.json')))
  assert {(r['k'], r['criterion']) for r in on_disk} == {(1, 'greedy'), (2, 'exact'), (3, 'exact'), (3, 'top_k:2')}


def test_trees_choose_then_decode_in_the_sweep(trained, tmp_path):
  """experiments/diagnostics.py --mode=choose_tree saves trees.json with the model; config.decode.trees decodes with
  them, exactly."""
  from experiments import diagnostics  # pylint: disable=g-import-not-at-top
  _, heads_dir = trained
  heads_copy = str(tmp_path / 'k3')
  shutil.copytree(heads_dir, heads_copy, ignore=shutil.ignore_patterns('decode'))
  built = diagnostics.choose(tiny_config(k=3), heads_copy, nodes=[4, 6], ranks=3, examples=12, batch_size=8)
  saved = json.load(open(os.path.join(heads_copy, 'trees.json')))
  assert np.asarray(saved['agreement_KxR']).shape == (3, 3) and set(saved['trees']) == {'4', '6'}
  assert len(built['6']) == 6
  records = evaluate.decode_sweep(tiny_config(**{'k': 3, 'decode.ks': (3,), 'decode.criteria': ('exact',),
                                                 'decode.trees': ('nodes:6', 'comb:2')}), heads_copy)
  rows = {r['tree']: r for r in records if r['criterion'] == 'exact'}
  assert set(rows) == {'chain', 'nodes:6', 'comb:2'}
  assert rows['nodes:6']['tree_nodes'] == 6 and rows['comb:2']['tree_nodes'] == 5
  for r in rows.values():
    assert r['identical_to_greedy'] == 1.0
  assert os.path.exists(os.path.join(heads_copy, 'decode', 'test.tree-nodes6.k3.exact.b8.txt'))


@pytest.mark.parametrize('trees, match', [
    (('bogus',), 'Unknown tree spec'),
    (('nodes:8',), 'experiments.diagnostics --mode=choose_tree'),  # no trees.json in the workdir
    (('dense:0',), 'at least 1'),
])
def test_error_bad_tree_specs(trained, trees, match):
  _, heads_dir = trained
  _expect_error(match, evaluate.decode_sweep, tiny_config(**{'decode.trees': trees}), heads_dir)


def test_distill_writes_an_aligned_corpus_and_training_uses_it(trained, tmp_path):
  base_dir, _ = trained
  teacher = str(tmp_path / 'teacher')
  shutil.copytree(base_dir, teacher)
  config = tiny_config(**{'data.synthetic_train_size': 40})
  out = distill.distill(config, teacher)
  src = open(os.path.join(out, 'train.en'), encoding='utf-8').read().split('\n')
  tgt = open(os.path.join(out, 'train.de'), encoding='utf-8').read().split('\n')
  # Sources longer than data.max_len tokens (the teacher saw them cut) are left out; the rest stay aligned.
  all_src, _ = pipeline.load_split(config.data, config.data.train_split, config.seed)
  tokenizer = tokenizer_lib.load(os.path.join(teacher, tokenizer_lib.MODEL_NAME))
  fits = [s for s, ids in zip(all_src, tokenizer.encode_batch(all_src)) if len(ids) + 1 <= config.data.max_len]
  assert 0 < len(fits) < 40  # the test covers both cases
  assert len(src) == len(tgt) == len(fits) + 1 and src[:-1] == fits
  # Resumes: the chunk is not decoded again.
  before = os.path.getmtime(os.path.join(out, 'parts', 'part-00000.de'))
  distill.distill(config, teacher)
  assert os.path.getmtime(os.path.join(out, 'parts', 'part-00000.de')) == before
  student = str(tmp_path / 'student')
  train.train_and_evaluate(tiny_config(**{'data.distilled_from': teacher, 'train.num_steps': 2}), student)
  assert checkpoint.latest_step(student) == 2


def test_distill_into_its_own_folder_records_its_settings_and_refuses_others(trained, tmp_path):
  """config.distill.out_dir: one corpus folder per teacher and beam setting (the paper's teacher and the ablations
  of Table 1 distil one base twice). Its manifest names the settings; a distillation with other settings into the
  same folder is refused before anything loads, leaving the parts as they were; training reads the folder itself."""
  base_dir, _ = trained
  out = str(tmp_path / 'corpus_beam2')
  config = tiny_config(**{'data.synthetic_train_size': 40, 'distill.out_dir': out})
  assert distill.distill(config, base_dir) == out
  assert not os.path.exists(os.path.join(base_dir, 'distill'))  # the teacher's workdir is left alone
  manifest = pipeline.read_manifest(out)
  assert manifest['beam_size'] == 2 and manifest['teacher'] == os.path.abspath(base_dir)
  assert manifest['step'] == checkpoint.latest_step(base_dir) and manifest['sources'] == 40
  part = os.path.join(out, 'parts', 'part-00000.de')
  before = (os.path.getmtime(part), open(part, encoding='utf-8').read())
  with pytest.raises(UserError, match=r'other settings \(beam_size 2 there, 1 now\).*--config.distill.out_dir'):
    distill.distill(tiny_config(**{'data.synthetic_train_size': 40, 'distill.out_dir': out,
                                   'distill.beam_size': 1}), base_dir)
  assert (os.path.getmtime(part), open(part, encoding='utf-8').read()) == before
  student = str(tmp_path / 'student')
  train.train_and_evaluate(tiny_config(**{'data.distilled_from': out, 'train.num_steps': 2,
                                          'train.init_from': base_dir, 'train.regime': 'finetune'}), student)
  assert checkpoint.latest_step(student) == 2
  with pytest.raises(UserError, match='has no distilled corpus.*config.distill.out_dir'):
    pipeline.check_source(tiny_config(**{'data.distilled_from': str(tmp_path / 'nothing')}).data)


def test_nan_loss_stops_with_a_message_and_keeps_the_last_good_checkpoint(tmp_path):
  workdir = str(tmp_path / 'nan')
  train.train_and_evaluate(tiny_config(**{'train.num_steps': 4}), workdir)
  with pytest.raises(UserError, match='diverged.*last good checkpoint'):
    train.train_and_evaluate(tiny_config(**{'train.num_steps': 12, 'train.learning_rate': 1e30,
                                            'train.warmup_steps': 1}), workdir)
  assert checkpoint.latest_step(workdir) == 4
  assert all(np.isfinite(x).all() for x in jax.tree.leaves(_params(workdir)))


def _main(workdir, *flags, env=None):
  cmd = [sys.executable, '-m', 'bpd.main', '--config=configs/demo.py', f'--workdir={workdir}',
         '--config.model.size=tiny', '--config.data.synthetic_train_size=2000', '--config.data.vocab_size=200',
         '--config.data.bucket_lengths=(40,)', '--config.train.batch_size=16', '--config.train.eval_every=0',
         '--config.train.log_every=1', *flags]
  return subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)


@pytest.mark.slow
def test_killed_and_resumed_run_ends_with_the_same_parameters(tmp_path):
  killed = str(tmp_path / 'killed')
  proc = _main(killed, '--config.train.num_steps=1000', '--config.train.checkpoint_every=3')
  deadline = time.time() + 240
  while (checkpoint.latest_step(killed) or 0) < 6 and time.time() < deadline and proc.poll() is None:
    time.sleep(0.2)
  proc.send_signal(signal.SIGKILL)
  proc.wait()
  resumed_from = checkpoint.latest_step(killed)
  assert resumed_from is not None and resumed_from >= 6, proc.stderr.read()[-2000:]
  final = resumed_from + 4
  train.train_and_evaluate(tiny_config(**{'train.num_steps': final, 'train.checkpoint_every': 3}), killed)
  straight = str(tmp_path / 'straight')
  train.train_and_evaluate(tiny_config(**{'train.num_steps': final, 'train.checkpoint_every': 3}), straight)
  a, b = _params(killed), _params(straight)
  jax.tree.map(np.testing.assert_array_equal, a, b)


@pytest.mark.slow
def test_sigterm_saves_a_checkpoint_and_exits_cleanly(tmp_path):
  workdir = str(tmp_path / 'term')
  proc = _main(workdir, '--config.train.num_steps=100000', '--config.train.checkpoint_every=100000')
  deadline = time.time() + 240
  log = ''
  metrics_path = os.path.join(workdir, 'metrics.jsonl')
  # Signal once the train loop has logged a step (log_every=1), not after a fixed sleep: on a loaded machine the
  # run may still be loading data after any fixed time, before the handler that saves is installed.
  while time.time() < deadline and proc.poll() is None:
    time.sleep(0.5)
    if os.path.exists(metrics_path) and '"prefix": "train"' in open(metrics_path).read():
      break
  proc.send_signal(signal.SIGTERM)
  _, log = proc.communicate(timeout=120)
  assert proc.returncode == 0, log[-2000:]
  step = checkpoint.latest_step(workdir)
  assert step is not None and 0 < step < 100000
  assert 'rerun the same command to resume' in log


# -- clear errors, before any compile, nothing lost --------------------------------------------------------

def _expect_error(match, fn, *args):
  start = time.time()
  with pytest.raises(UserError, match=match):
    fn(*args)
  assert time.time() - start < 10  # fails fast: nothing compiled, nothing downloaded


def _text_dir(tmp_path, train_lines=('a b', 'c d'), val_src=('x',), val_tgt=('y',)):
  d = tmp_path / 'text'
  d.mkdir()
  (d / 'train.en').write_text('\n'.join(train_lines) + '\n')
  (d / 'train.de').write_text('\n'.join(train_lines) + '\n')
  (d / 'val.en').write_text('\n'.join(val_src) + '\n')
  (d / 'val.de').write_text('\n'.join(val_tgt) + '\n')
  return str(d)


def test_error_missing_data_dir(tmp_path):
  _expect_error(r'does not exist.*config\.data\.dir', train.train_and_evaluate,
                tiny_config(**{'data.source': 'text', 'data.dir': str(tmp_path / 'nope')}), str(tmp_path / 'w'))


def test_error_missing_file(tmp_path):
  d = _text_dir(tmp_path)
  os.remove(os.path.join(d, 'val.de'))
  _expect_error(r"val\.de' not found.*splits there with both files are: train", train.train_and_evaluate,
                tiny_config(**{'data.source': 'text', 'data.dir': d}), str(tmp_path / 'w'))


def test_error_line_counts_differ(tmp_path):
  d = _text_dir(tmp_path, val_src=('x', 'z'), val_tgt=('y',))
  _expect_error(r'has 2 lines but .*val\.de\' has 1', train.train_and_evaluate,
                tiny_config(**{'data.source': 'text', 'data.dir': d}), str(tmp_path / 'w'))


def test_error_k_below_one(tmp_path):
  _expect_error(r'config\.k=0', train.train_and_evaluate, tiny_config(k=0), str(tmp_path / 'w'))


@pytest.mark.parametrize('criterion, match', [
    ('fastest', 'Unknown criterion'),
    ('top_k:0', 'top_k needs T >= 1'),
    ('distance:-2', 'distance needs EPS >= 0'),
    ('min_block:4', 'at most k=3'),
    ('speculative', 'temperature is 0'),  # sampling needs config.decode.temperature > 0
    ('speculative:block', 'temperature is 0'),
    ('speculative+top_k:2', 'cannot be used with speculative sampling'),
])
def test_error_bad_criteria(trained, criterion, match):
  _, heads_dir = trained
  _expect_error(match, evaluate.decode_sweep, tiny_config(**{'decode.criteria': (criterion,)}), heads_dir)


@pytest.mark.parametrize('overrides, match', [
    ({'decode.sample_top_k': 5}, 'temperature is 0'),  # truncation applies to sampling only
    ({'decode.temperature': 1.0, 'decode.sample_top_p': 0.0}, r'sample_top_p=0\.0 must be in \(0, 1\]'),
    ({'decode.temperature': 1.0, 'decode.sample_top_k': -2}, 'sample_top_k=-2 must be an integer >= 0'),
])
def test_error_bad_sampling_truncation(trained, overrides, match):
  _, heads_dir = trained
  _expect_error(match, evaluate.decode_sweep, tiny_config(**overrides), heads_dir)


def test_error_sweep_k_larger_than_checkpoint(trained):
  _, heads_dir = trained
  _expect_error(r"contains 5, but the checkpoint .* has k=3", evaluate.decode_sweep,
                tiny_config(**{'decode.ks': (2, 5)}), heads_dir)


def test_prompt_lookup_decodes_a_plain_model_exactly_through_the_sweep(trained, tmp_path):
  """--config.decode.drafter=prompt_lookup on the base (k = 1, no heads): chains at k' = 2 and 4 decode, exactly,
  and name their drafter in the records and file names."""
  base_dir, _ = trained
  workdir = str(tmp_path / 'base')
  shutil.copytree(base_dir, workdir, ignore=shutil.ignore_patterns('decode'))
  records = evaluate.decode_sweep(tiny_config(**{'decode.drafter': 'prompt_lookup', 'decode.ks': (2, 4),
                                                 'decode.criteria': ('exact',)}), workdir)
  rows = [r for r in records if r['criterion'] == 'exact']
  assert [(r['k'], r['drafter']) for r in rows] == [(2, 'prompt_lookup'), (4, 'prompt_lookup')]
  for r in rows:
    assert r['identical_to_greedy'] == 1.0 and r['quality'] == records[0]['quality']
    assert r['mean_accepted_block_size'] >= 1.0
  assert os.path.exists(os.path.join(workdir, 'decode', 'test.k4.exact.prompt_lookup.b8.txt'))


@pytest.mark.parametrize('overrides, match', [
    ({'decode.drafter': 'prompt'}, 'Unknown drafter'),
    ({'decode.drafter': 'prompt_lookup:0'}, 'integer >= 1'),
    ({'decode.drafter': 'prompt_lookup', 'decode.trees': ('dynamic:4',)}, 'cannot fill the tree'),
    ({'decode.drafter': 'prompt_lookup', 'decode.temperature': 1.0, 'decode.criteria': ('speculative',)},
     'samples that token'),
])
def test_error_bad_drafter_settings(trained, overrides, match):
  _, heads_dir = trained
  _expect_error(match, evaluate.decode_sweep, tiny_config(**{'k': 3, **overrides}), heads_dir)


def test_speculative_sampling_through_the_decode_sweep(trained, tmp_path):
  """--config.decode.temperature=1.0 --config.decode.criteria="('speculative','speculative:block')" on text,
  nucleus-truncated: the ancestral row (sample:1) and a row per verification rule with BLEU, mean accepted block
  size and its speedup over ancestral sampling; the same seed gives the same samples."""
  _, heads_dir = trained
  config = tiny_config(**{'k': 3, 'decode.ks': (3,), 'decode.criteria': ('speculative', 'speculative:block'),
                          'decode.temperature': 1.0, 'decode.seed': 3, 'decode.sample_top_p': 0.9})
  samples = []
  for name in ('a', 'b'):
    workdir = str(tmp_path / name)
    shutil.copytree(heads_dir, workdir, ignore=shutil.ignore_patterns('decode'))
    records = evaluate.decode_sweep(config, workdir)
    samples.append(open(os.path.join(workdir, 'decode', 'test.k3.speculative.b8.txt'), encoding='utf-8').read())
  assert [(r['k'], r['criterion']) for r in records] == [(1, 'greedy'), (1, 'sample:1'), (3, 'speculative'),
                                                         (3, 'speculative:block')]
  for row in records[2:]:
    for key in ('quality', 'mean_accepted_block_size', 'speedup', 'sample_seconds', 'seconds', 'tokens',
                'block_size_histogram'):
      assert key in row, key
    assert (row['temperature'], row['seed'], row['quality_metric']) == (1.0, 3, 'bleu')
    assert 1.0 <= row['mean_accepted_block_size'] <= 3 and row['invocations'] == row['iterations'] + 12
    assert row['speedup'] == row['sample_seconds'] / row['seconds']
  assert all((r['sample_top_k'], r['sample_top_p']) == (0, 0.9) for r in records[1:])
  assert os.path.exists(os.path.join(workdir, 'decode', 'test.k3.speculativeblock.b8.txt'))
  assert samples[0] == samples[1] and len(samples[0].split('\n')) == 12 + 1


def test_error_init_from_a_different_model_size(trained, tmp_path):
  base_dir, _ = trained
  config = tiny_config(**{'k': 3, 'train.regime': 'finetune', 'train.init_from': base_dir, 'model.size': 'small'})
  _expect_error(r'different size or vocabulary .*d_model: 64 there, 256 here', train.train_and_evaluate, config,
                str(tmp_path / 'w'))


def test_error_init_from_a_different_vocabulary(trained, tmp_path):
  base_dir, _ = trained
  workdir = str(tmp_path / 'w')
  src, tgt = synthetic.make_corpus(0, num_train=500)['train']
  tokenizer_lib.train_or_load(workdir, src + tgt, vocab_size=150)  # this workdir already has its own
  config = tiny_config(**{'k': 3, 'train.regime': 'finetune', 'train.init_from': base_dir})
  _expect_error(r'different size or vocabulary .*vocab_size: 200 there, 150 here', train.train_and_evaluate,
                config, workdir)


def test_error_init_from_without_a_model(tmp_path):
  config = tiny_config(**{'k': 3, 'train.regime': 'frozen', 'train.init_from': str(tmp_path)})
  _expect_error('holds no trained model', train.train_and_evaluate, config, str(tmp_path / 'w'))


def test_error_unwritable_workdir(tmp_path):
  blocker = tmp_path / 'a_file'
  blocker.write_text('not a folder')
  _expect_error('Cannot write to --workdir', train.train_and_evaluate, tiny_config(), str(blocker / 'run'))


def test_error_tfds_not_prepared_fails_fast(tmp_path):
  config = tiny_config(**{'data.source': 'tfds', 'data.tfds_data_dir': str(tmp_path / 'tfds'),
                          'data.train_split': 'train', 'data.eval_split': 'validation'})
  _expect_error(r'(?s)not prepared.*tfds build', train.train_and_evaluate, config, str(tmp_path / 'w'))


def test_cli_prints_one_clear_line_and_no_traceback(tmp_path):
  proc = _main(str(tmp_path / 'w'), '--config.k=0')
  _, err = proc.communicate(timeout=120)
  assert proc.returncode != 0
  assert 'error: config.k=0' in err
  assert 'Traceback' not in err


def test_draft_vocabulary_is_counted_stored_and_decoded_exactly(trained, tmp_path):
  """config.model.draft_vocab end to end (bpd/draft_vocab.py): training counts the ids on the training targets and
  writes them into model.json; a decode reads them, or counts them for a model trained without; 0 turns the draft
  vocabulary off at decode time; the exact rows stay identical to greedy."""
  from bpd import draft_vocab  # pylint: disable=g-import-not-at-top
  from bpd import tasks  # pylint: disable=g-import-not-at-top
  base_dir, heads_dir = trained
  draft_dir = str(tmp_path / 'draft')
  config = tiny_config(**{'k': 3, 'train.regime': 'finetune', 'train.init_from': base_dir, 'train.num_steps': 2,
                          'model.draft_vocab': 50, 'decode.ks': (3,), 'decode.criteria': ('exact',)})
  train.train_and_evaluate(config, draft_dir)
  stored = checkpoint.read_model_config(draft_dir).draft_ids
  task = tasks.for_config(config)
  tokenizer = task.tokenizer_for_decoding(base_dir)  # both runs took the base's tokenizer
  assert stored == draft_vocab.most_frequent(task.target_counts(config, tokenizer), 50)
  assert evaluate.load_for_decoding(config, heads_dir, task)[4].model.config.draft_ids == stored  # counted
  off = common.override(config, **{'model.draft_vocab': 0})
  assert evaluate.load_for_decoding(off, draft_dir, task)[4].model.config.draft_ids == ()
  records = evaluate.decode_sweep(config, draft_dir)
  assert [(r['criterion'], r['draft_vocab'], r['identical_to_greedy']) for r in records] == [
      ('greedy', 50, 1.0), ('exact', 50, 1.0)]
