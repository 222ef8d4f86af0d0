"""The translation study script end to end on a tiny synthetic config: every stage, then resume skips all."""

import json
import os

from experiments import translation_study
from tests.test_pipeline import tiny_config


def test_study_runs_every_stage_and_resumes(tmp_path):
  config = tiny_config(**{'k': 3, 'data.synthetic_train_size': 48, 'train.num_steps': 4})
  plan = translation_study.Plan(regimes=('finetune',), data=('distilled',), splits=('test',), ks=(1, 2, 3),
                                criteria=('exact', 'top_k:2'), batch_sizes=(8,), max_examples=8)
  root = str(tmp_path)
  translation_study.run_stages(config, root, plan)
  rows = json.load(open(os.path.join(root, 'study.json')))
  models = {r['model'] for r in rows}
  assert models == {'base', 'finetune_distilled'}
  settings = {(r['model'], r['k'], r['criterion']) for r in rows}
  assert ('finetune_distilled', 3, 'top_k:2') in settings and ('base', 1, 'greedy') in settings
  assert all(r['identical_to_greedy'] == 1.0 for r in rows if r['criterion'] == 'exact')
  assert os.path.exists(os.path.join(root, 'base', 'distill', 'train.de'))
  for name in ('study.md', 'study.csv', 'study_test_b8_finetune_distilled.png'):
    assert os.path.exists(os.path.join(root, name)), name
  stamp = os.path.getmtime(os.path.join(root, 'finetune_distilled', 'decode_test', 'results.json'))
  translation_study.run_stages(config, root, plan)  # everything is done: nothing runs again
  assert os.path.getmtime(os.path.join(root, 'finetune_distilled', 'decode_test', 'results.json')) == stamp
