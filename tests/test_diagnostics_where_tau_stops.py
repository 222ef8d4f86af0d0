"""experiments/diagnostics.py --mode=where_tau_stops: where exact tree decoding's accepted path stops, and why.

A tiny random-weights model, teacher-forced on random target sentences rather than on its own greedy output (a
random model's greedy output repeats one token: every head would agree everywhere). The measure does not need the
targets to be greedy's: it asks how deep each one runs along the trees the decoder would draft. A vocabulary of 8 and
trees with 4 ranks and a beam of 2 make every stop depth and every cause occur.
"""

import dataclasses

import jax
import numpy as np
import pytest

from bpd import decoding
from bpd import model as model_lib
from bpd.data import tokenizer as tokenizer_lib
from bpd.errors import UserError
from configs import demo
from experiments import diagnostics

VOCAB, DEPTH, BEAM, RANKS = 8, 4, 2, 4


@pytest.fixture(scope='module')
def measured():
  """(teacher_forced_trees' arrays, the policies, the number of candidates M): trees of 3, 6 and all M nodes."""
  config = model_lib.model_config('tiny', vocab_size=VOCAB, k=DEPTH + 1, dropout_rate=0.0)
  params = model_lib.init_params(config, jax.random.PRNGKey(0))
  rng = np.random.default_rng(0)
  src_ids = [rng.integers(3, VOCAB, rng.integers(3, 9)).astype(np.int32) for _ in range(24)]
  targets = [np.append(rng.integers(3, VOCAB, rng.integers(2, 12)), tokenizer_lib.EOS_ID).astype(np.int32)
             for _ in src_ids]
  targets[0] = targets[0][:-1]  # one output that ran to max_len: no EOS
  every = decoding.Dynamic(1, DEPTH, beam=BEAM, ranks=RANKS).candidates(VOCAB)
  policies = [decoding.Dynamic(n, DEPTH, beam=BEAM, ranks=RANKS) for n in (3, 6, every)]
  out = diagnostics.teacher_forced_trees(model_lib.Transformer(config), params, src_ids, targets, policies,
                                         batch_size=8)
  assert len(out['y_PxD']) == sum(len(t) for t in targets)  # one position per token, EOS included
  return out, policies, every


def _rank_paths(tree, p):
  """The rank path (root to node, -1 past its depth) of every node of position p's tree."""
  paths = []
  for n in range(tree['depth'].shape[1]):
    parent = tree['parent'][p, n]
    path = list(paths[parent]) if parent >= 0 else [-1] * DEPTH
    path[tree['depth'][p, n]] = tree['rank'][p, n]
    paths.append(tuple(path))
  return paths


def test_candidates_hold_dynamic_builds_chosen_nodes(measured):
  """diagnostics.candidates (the measured top-r through Dynamic.candidate_nodes) hold every node Dynamic.build chose
  from the full logits, and their N best are its N nodes up to ties."""
  out, policies, every = measured
  cands = diagnostics.candidates(out['logp_PxDm1xR'], BEAM)
  assert cands['score_PxM'].shape[1] == every
  for policy in policies:
    tree = out['trees'][policy.num_nodes]
    for p in range(len(out['y_PxD'])):
      score = {tuple(path): s for path, s in zip(cands['path_PxMxD'][p].tolist(), cands['score_PxM'][p])}
      chosen = set(_rank_paths(tree, p))
      assert chosen <= set(score) and len(chosen) == policy.num_nodes
      best = np.argsort(-cands['score_PxM'][p], kind='stable')[:policy.num_nodes]
      numpy_best = {tuple(cands['path_PxMxD'][p, m].tolist()) for m in best}
      boundary = cands['score_PxM'][p, best[-1]]
      assert all(score[path] == boundary for path in chosen ^ numpy_best), p


def test_stops_add_up_and_the_whole_tree_is_the_oracle(measured):
  out, _, every = measured
  stats = diagnostics.tau_stops(out, BEAM)
  P = stats['positions']
  chain_by_depth = [r['stops'] for r in stats['chain_by_depth']]
  chain = stats['trees'][0]
  assert chain['tree'] == f'chain of {DEPTH}' and chain['causes'] is None
  assert np.isclose(sum(chain_by_depth) + chain['reached'] / P, 1.0) and 0 < chain['reached_end'] < chain['reached']
  np.testing.assert_allclose(chain_by_depth, chain['stops_D'][1:] / P)
  rows = {r['tree']: r for r in stats['trees']}
  oracle = rows[f'all {every} candidates (no node budget)']
  top_r = rows[f"every head's top {RANKS} (no beam, no budget)"]
  np.testing.assert_array_equal(rows[f'dynamic:{every}']['length_P'], oracle['length_P'])
  assert oracle['causes'][2] == 0 and np.all(top_r['causes'][1:] == 0)  # what no budget and no beam leave
  for r in stats['trees']:
    assert r['stops_D'][0] == 0 and int(np.sum(r['stops_D'])) + r['reached'] == P
    assert np.all((1 <= r['length_P']) & (r['length_P'] <= np.minimum(stats['available_P'], DEPTH)))
    if r['causes'] is not None:
      assert int(np.sum(r['causes'])) == int(np.sum(r['stops_D']))
      assert np.all(r['length_P'] <= top_r['length_P'])
      assert r is top_r or np.all(r['length_P'] <= oracle['length_P'])
  assert not any(stats['over_oracle'].values())
  # A larger budget never accepts less; the chain and every cause occur on this subject.
  assert np.all(rows['dynamic:3']['length_P'] <= rows['dynamic:6']['length_P'])
  assert np.all(rows['dynamic:6']['length_P'] <= oracle['length_P'])
  assert np.all(rows['dynamic:6']['causes'] > 0) and np.all(oracle['causes'][:2] > 0)
  assert set(np.nonzero(chain['stops_D'])[0]) == {1, 2, 3}
  text = diagnostics.stop_tables(stats)
  assert 'cut by node budget (of stops)' in text and 'outside top-4 (of stops)' in text and 'not over decode' in text


def test_sequential_heads_and_too_many_heads_are_clear_errors(monkeypatch):
  """Refused before anything loads: sequential heads, and D outside 2..k."""
  config = demo.get_config()
  model_config = model_lib.model_config('tiny', vocab_size=VOCAB, k=3, head_type='sequential')
  monkeypatch.setattr(diagnostics.checkpoint, 'read_model_config', lambda workdir: model_config)
  with pytest.raises(UserError, match='sequential.*independent heads only'):
    diagnostics.where_tau_stops(config, 'wd', '', 0, [8], 0, 8)
  independent = dataclasses.replace(model_config, head_type='independent')
  monkeypatch.setattr(diagnostics.checkpoint, 'read_model_config', lambda workdir: independent)
  with pytest.raises(UserError, match='--heads=4'):
    diagnostics.where_tau_stops(config, 'wd', '', 4, [8], 0, 8)
  with pytest.raises(UserError, match='dynamic:200'):
    diagnostics.where_tau_stops(config, 'wd', '', 3, [200], 0, 8)


def test_the_mode_is_registered():
  assert 'where_tau_stops' in diagnostics.MODES and 'where_tau_stops' in diagnostics.RUNS
  assert set(diagnostics.MODE_DEFAULTS) == set(diagnostics.MODES)
