"""The translation study script end to end on a tiny synthetic config: every stage, then resume skips all."""

import json
import os

import pytest

from bpd.errors import UserError
from experiments import study
from tests.test_pipeline import tiny_config


def test_study_runs_every_stage_and_resumes(tmp_path):
  config = tiny_config(**{'k': 3, 'data.synthetic_train_size': 48, 'train.num_steps': 4})
  plan = study.TranslationPlan(models=('finetune_distilled',), splits=('test',), ks=(1, 2),
                                criteria=('exact', 'top_k:2'), batch_sizes=(8,), max_examples=8,
                                batch1_examples=3, timing_examples=4, timing_repeats=2,
                                finetune_config=("train.head1_weight=3.0",), other_criteria=("exact",))
  root = str(tmp_path)
  study.run_translation(config, root, plan)
  rows = json.load(open(os.path.join(root, 'study.json')))
  models = {r['model'] for r in rows}
  assert models == {'base', 'finetune_distilled'}
  settings = {(r['model'], r['k'], r['criterion']) for r in rows}
  assert ('finetune_distilled', 2, 'top_k:2') in settings and ('base', 1, 'greedy') in settings
  assert all(r['identical_to_greedy'] == 1.0 for r in rows if r['criterion'] == 'exact')
  assert {(r['batch_size'], r['examples']) for r in rows} == {(8, 8)}  # batch 1's subset: tests/test_superres.py
  block_rows = [r for r in rows if r['criterion'] != 'greedy']
  assert all(r['timing_repeats'] == 2 and r['batch_invocations'] >= 1 and r['greedy_seconds'] > 0
             for r in block_rows)
  assert all(r['batch_invocations'] <= r['invocations'] for r in block_rows if r['batch_size'] == 8)
  assert os.path.exists(os.path.join(root, 'base', 'distill', 'train.de'))
  for name in ('study.md', 'study.csv', 'study_paper.md', 'study_test_b8_finetune_distilled.png',
               'study_test_b8_mean_accepted_block_size.png'):
    assert os.path.exists(os.path.join(root, name)), name
  table1 = open(os.path.join(root, 'study_table1.md')).read()
  assert '| Both | Both (paper) | Both, top-2 |' in table1 and '| 2 | ' in table1 and '1.88' in table1
  paper = open(os.path.join(root, 'study_paper.md')).read()
  assert '| finetune_distilled | top_k:2 |' in paper and '| base | greedy |' in paper and 'k=2' in paper
  stamp = os.path.getmtime(os.path.join(root, 'finetune_distilled', 'decode_test_b8', 'results.json'))
  study.run_translation(config, root, plan)  # everything is done: nothing runs again
  assert os.path.getmtime(os.path.join(root, 'finetune_distilled', 'decode_test_b8', 'results.json')) == stamp


def test_head_recipe_overrides_apply_by_regime():
  """--head_config applies to every k-head model, --finetune_config after it to fine-tuned ones only."""
  config = tiny_config()
  plan = study.TranslationPlan(head_steps=7, head_config=('train.head_learning_rate=3e-3', 'model.dropout_rate=0'),
                                finetune_config=('train.learning_rate=3e-4', 'train.head1_weight=7'))
  frozen = study.head_model_config(config, plan, 'frozen')
  finetune = study.head_model_config(config, plan, 'finetune')
  assert frozen.train.num_steps == finetune.train.num_steps == 7
  assert frozen.train.head_learning_rate == finetune.train.head_learning_rate == 3e-3
  assert frozen.model.dropout_rate == finetune.model.dropout_rate == 0.0
  assert frozen.train.learning_rate == config.train.learning_rate and frozen.train.head1_weight == 1.0
  assert finetune.train.learning_rate == 3e-4 and finetune.train.head1_weight == 7.0
  plan = study.TranslationPlan(head_steps=7, other_head_steps=5)  # the time box: fewer steps for the other columns
  assert study.head_model_config(config, plan, 'finetune', 'distilled').train.num_steps == 7
  assert study.head_model_config(config, plan, 'finetune', 'original').train.num_steps == 5
  assert study.head_model_config(config, plan, 'frozen', 'distilled').train.num_steps == 5


@pytest.mark.parametrize('items', [('train.learning_rate',), ('train.no_such_field=1',), ('=3',)])
def test_bad_head_overrides_fail_before_training(tmp_path, items):
  plan = study.TranslationPlan(head_config=items)
  with pytest.raises(UserError, match='head_config'):
    study.run_translation(tiny_config(), str(tmp_path), plan)
  assert not os.listdir(tmp_path)


def test_a_stopped_stage_stops_the_study(tmp_path, monkeypatch):
  """A stage that stops early (preemption: train returns after saving) must not hand a half-trained model on."""
  monkeypatch.setattr(study.train, 'train_and_evaluate', lambda cfg, workdir: None)
  def must_not_run(*args):
    raise AssertionError('a later stage ran after the base stopped early')
  monkeypatch.setattr(study.distill, 'distill', must_not_run)
  monkeypatch.setattr(study, 'decode_translation', must_not_run)
  study.run_translation(tiny_config(), str(tmp_path), study.TranslationPlan(models=('finetune_distilled',)))
