"""Tree-structured candidates (bpd/decoding.py, blockwise over a tree): topology checks, static and per-row
(context-aware) trees, exactness on stubs and on the real model."""

import dataclasses
import functools

import hypothesis
from hypothesis import strategies as st
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from bpd import checks
from bpd import decoding
from bpd import drafters
from bpd import model as model_lib
from bpd import rules
from bpd import speculative
from bpd import trees
from bpd.errors import UserError
from tests.conftest import BOS as TOY_BOS, EOS as TOY_EOS, SRC_LEN, toy_batch
from configs import common
from configs import demo
from tests import reference
from tests.stubs import BOS, EOS, Stub

SETTINGS = hypothesis.settings(max_examples=8, deadline=None, derandomize=True, database=None)

# A few topologies, so that jit's cache is reused across examples: the chain, a Medusa-like sparse tree, a
# tree whose deepest path leaves the rank-0 spine, and one with second choices at the root.
TREES = (
    decoding.chain_tree(4),
    ((0,), (1,), (0, 0), (0, 1), (1, 0), (0, 0, 0), (0, 0, 1), (0, 1, 0), (0, 0, 0, 0)),
    ((0,), (0, 1), (0, 2), (0, 1, 0), (0, 1, 1), (0, 1, 0, 0)),
    ((0,), (1,), (2,), (0, 0), (1, 0), (2, 0)),
)


# -- topology ----------------------------------------------------------------------------------------------

def test_layout_of_a_small_tree():
  paths = decoding.check_tree(((0, 1), (0,), (1,), (0, 0), (0, 0, 0)), k=3)
  assert paths == ((0,), (1,), (0, 0), (0, 1), (0, 0, 0))  # canonical: by depth, then by ranks
  layout = decoding.layout(paths)
  assert layout is decoding.layout(paths)  # built once per topology
  assert layout.depth_N.tolist() == [0, 0, 1, 1, 2]
  assert layout.rank_N.tolist() == [0, 1, 0, 1, 0]
  assert layout.parent_N.tolist() == [-1, -1, 0, 0, 2]
  assert layout.ancestor_NxN.astype(int).tolist() == [
      [1, 0, 0, 0, 0], [0, 1, 0, 0, 0], [1, 0, 1, 0, 0], [1, 0, 0, 1, 0], [1, 0, 1, 0, 1]]
  assert layout.path_NxD[4].tolist() == [0, 2, 4] and layout.path_NxD[3].tolist()[:2] == [0, 3]
  assert layout.zero_path_D.tolist() == [0, 2, 4]
  assert not layout.is_chain and decoding.layout(decoding.chain_tree(3)).is_chain
  assert decoding.check_tree(decoding.chain_tree(3), k=3) == ((0,), (0, 0), (0, 0, 0))
  # A tree per row built from the parents alone has the same ancestors and paths.
  rows = decoding.row_tree(jnp.asarray(layout.depth_N)[None], jnp.asarray(layout.rank_N)[None],
                           jnp.asarray(layout.parent_N)[None], jnp.zeros((1, 5), jnp.int32), depth=3, num_ranks=2)
  np.testing.assert_array_equal(np.asarray(rows.ancestor_BxNxN[0]), layout.ancestor_NxN)
  for n, path in enumerate(paths):
    assert np.asarray(rows.path_BxNxD[0, n, :len(path)]).tolist() == layout.path_NxD[n, :len(path)].tolist()


@pytest.mark.parametrize('paths, message', [
    (((0,), (0, 1, 0)), r'parent \(0, 1\) is missing'),
    (((0,), (0, 0), (0, 0)), 'appears twice'),
    (((0,), (0, 0), (0, 0, 0), (0, 0, 0, 0)), 'depth 3, but with k=3'),
    (((0,), (0, 20)), 'rank 20, but a head offers only the top 20'),
    (((1,), (1, 0)), r'must contain the path \(0,\)'),
    (((0,), ()), 'non-empty tuple of ranks'),
    (((0,), (0, -1)), 'non-empty tuple of ranks'),
    ((('a',),), 'a tree is a tuple of paths'),
])
def test_bad_trees_raise_clear_errors(paths, message):
  with pytest.raises(UserError, match=message):
    decoding.check_tree(paths, k=3, max_rank=20)


def test_min_block_needs_the_rank_zero_path():
  stub = Stub(vocab_size=16, k=3)
  with pytest.raises(UserError, match='lacks'):
    run(stub, [1], [5], 8, ((0,), (1,), (1, 0)), decoding.parse_criterion('min_block:2'))


# -- stub model --------------------------------------------------------------------------------------------

@functools.partial(jax.jit, static_argnames=('batch_size', 'tree', 'max_len', 'criterion', 'expand'))
def _decode(seed_B, eos_at_B, stub, *, batch_size, tree, max_len, criterion, expand=False):
  """stub: a traced argument (its accuracies, EOS rate and ties are leaves), so examples share compiles. expand: the
  stub's heads are fed their parent's token (Stub.expand_fn), as sequential heads are."""
  state = stub.init_state(seed_B, eos_at_B, max_len + tree.num_nodes + 1)
  fns = decoding.ModelFns(stub.score_fn, stub.propose_fn, stub.move_fn, stub.expand_fn if expand else None)
  return decoding.blockwise(fns, state,
                            fixed=decoding.Fixed(batch_size=batch_size, max_len=max_len, bos_id=BOS, eos_id=EOS),
                            tree=tree, rule=criterion)


@dataclasses.dataclass(frozen=True, eq=False)
class _Unspecialised(decoding.Layout):
  """A one-path tree decoded as a general tree (tree mask, cache move): what the chain's trace-time
  specialisation must equal."""

  @property
  def is_chain(self):
    return False


def run(stub, seed_B, eos_at_B, max_len, paths, criterion=decoding.Criterion(), with_blockwise=False, expand=False):
  """The result over `paths` (a topology, or a decoding.Dynamic), or (the chain of all stub.k heads, that result)
  with_blockwise. expand: the heads are fed their parent's token (`_decode`)."""
  args = jnp.asarray(np.asarray(seed_B)), jnp.asarray(np.asarray(eos_at_B)), stub
  statics = dict(batch_size=len(seed_B), max_len=max_len, criterion=criterion, expand=expand)
  tree = paths if isinstance(paths, (decoding.Dynamic, decoding.Layout)) else decoding.layout(
      decoding.check_tree(paths, stub.k))
  result = _decode(*args, tree=tree, **statics)
  return (_decode(*args, tree=decoding.layout(decoding.chain_tree(stub.k)), **statics), result) if with_blockwise \
      else result


def _assert_same_result(a, b):
  for field in ('tokens_BxL', 'length_B', 'iterations_B', 'block_counts_BxK', 'first_call_B', 'invocations'):
    np.testing.assert_array_equal(np.asarray(getattr(a, field)), np.asarray(getattr(b, field)), err_msg=field)


cases = st.fixed_dictionaries({
    'tree': st.sampled_from(TREES),
    'batch': st.sampled_from([1, 8]),
    'max_len': st.sampled_from([1, 20]),
    'accuracy': st.sampled_from([0.5, 1.0]),
    'runner_up': st.sampled_from([0.0, 0.9]),
    'eos_rate': st.sampled_from([0, 5]),
    'seed': st.integers(0, 2**31 - 1),
})


@hypothesis.given(cases)
@SETTINGS
def test_exact_tree_equals_greedy_reference(case):
  """Ragged acceptance across rows (each row its own path), EOS and max_len inside an accepted path."""
  stub = Stub(vocab_size=16, k=4, head_accuracy=case['accuracy'], eos_rate=case['eos_rate'],
              runner_up_accuracy=case['runner_up'])
  rng = np.random.RandomState(case['seed'] % 2**31)
  seed_B = rng.randint(0, 2**31, size=case['batch'])
  eos_at_B = rng.randint(1, case['max_len'] + 3, size=case['batch'])
  reference = stub.reference_greedy(seed_B, eos_at_B, case['max_len'])
  tree = run(stub, seed_B, eos_at_B, case['max_len'], case['tree'])
  np.testing.assert_array_equal(np.asarray(tree.tokens_BxL), reference)
  length = (reference != 0).sum(axis=1)
  np.testing.assert_array_equal(np.asarray(tree.length_B), length)
  counts = np.asarray(tree.block_counts_BxK)
  assert counts.shape[1] == decoding.tree_depth(decoding.check_tree(case['tree'], 4)) + 1
  np.testing.assert_array_equal(counts.sum(axis=1), np.asarray(tree.iterations_B))
  first_call_only = np.asarray(tree.iterations_B) == 0  # the first call produced the row's only token
  np.testing.assert_array_equal(first_call_only, length == 1)
  np.testing.assert_array_equal((counts * np.arange(1, counts.shape[1] + 1)).sum(axis=1), length - first_call_only)


@hypothesis.given(st.sampled_from([1, 2, 4]), st.sampled_from([1, 8]), st.sampled_from([1, 7, 20]),
                  st.sampled_from(['exact', 'top_k:2', 'distance:2', 'top_k:2+min_block:2']), st.integers(0, 10_000))
@hypothesis.settings(SETTINGS, max_examples=8)  # each example compiles two loops
def test_one_path_tree_is_exactly_blockwise(k, batch, max_len, spec, seed):
  stub = Stub(vocab_size=16, k=k, head_accuracy=0.6, eos_rate=7, runner_up_accuracy=0.5)
  if decoding.parse_criterion(spec).min_block > k:
    return
  rng = np.random.RandomState(seed)
  seed_B, eos_at_B = rng.randint(0, 2**31, size=batch), rng.randint(1, max_len + 3, size=batch)
  block, tree = run(stub, seed_B, eos_at_B, max_len, decoding.chain_tree(k), decoding.parse_criterion(spec),
                    with_blockwise=True)
  _assert_same_result(tree, block)
  unspecialised = _Unspecialised(**{f.name: getattr(decoding.layout(decoding.chain_tree(k)), f.name)
                                    for f in dataclasses.fields(decoding.Layout)})
  _assert_same_result(run(stub, seed_B, eos_at_B, max_len, unspecialised, decoding.parse_criterion(spec)), block)


def test_heads_always_right_accept_full_paths_and_stop_inside_one():
  """Heads always right: every iteration accepts the tree's depth, except the last, cut by EOS or max_len; a last
  token left alone (EOS at index 8, after two full paths) comes with the iteration before it."""
  stub = Stub(vocab_size=16, k=4, head_accuracy=1.0)
  eos_at_B = np.array([6, 9, 100, 100])  # EOS at output index 5 and 8: inside a 4-token path
  tree = run(stub, [11, 12, 13, 14], eos_at_B, 14, TREES[1])
  assert np.asarray(tree.length_B).tolist() == [6, 9, 14, 14]  # 14: max_len inside the fourth path
  assert np.asarray(tree.iterations_B).tolist() == [2, 2, 4, 4]
  assert np.asarray(tree.tokens_BxL)[0, 5] == EOS


def test_a_tree_finds_second_choices_the_chain_misses():
  """With the right token always second where a head is wrong, the tree with every second choice accepts more."""
  stub = Stub(vocab_size=16, k=3, head_accuracy=0.3, runner_up_accuracy=1.0)
  paths = ((0,), (0, 0), (0, 1), (0, 0, 0), (0, 0, 1), (0, 1, 0), (0, 1, 1))
  rng = np.random.RandomState(0)
  block, tree = run(stub, rng.randint(0, 2**31, size=8), np.full(8, 100), 30, paths, with_blockwise=True)
  np.testing.assert_array_equal(np.asarray(tree.tokens_BxL), np.asarray(block.tokens_BxL))
  # Every head is right in its top 2, so every iteration accepts all 3 tokens (the last one cut by max_len).
  assert np.asarray(tree.iterations_B).tolist() == [10] * 8
  assert np.asarray(block.iterations_B).sum() > 8 * 10


# -- context-aware trees (decoding.Dynamic): a tree per row and iteration --------------------------------------

dynamic_cases = st.fixed_dictionaries({
    'tree': st.sampled_from([decoding.Dynamic(4, 3, beam=2, ranks=2), decoding.Dynamic(8, 4, beam=4, ranks=4),
                             decoding.Dynamic(16, 4)]),
    'batch': st.sampled_from([1, 3, 8]),
    'max_len': st.sampled_from([1, 20]),
    'accuracy': st.sampled_from([0.0, 0.5, 1.0]),
    'runner_up': st.sampled_from([0.0, 0.9]),
    'noise_levels': st.sampled_from([1000, 2]),  # 2: the heads' other tokens tie in pairs and beyond
    'eos_rate': st.sampled_from([0, 5]),
    'expand': st.booleans(),  # heads fed their parent's token (sequential heads), or one choice list per depth
    'seed': st.integers(0, 2**31 - 1),
})


@hypothesis.given(dynamic_cases)
@SETTINGS
def test_exact_dynamic_tree_equals_greedy_reference(case):
  """Rows with different trees in one batch (each row's heads differ), ties in the heads' scores included, with
  heads that are fed their parent's token or not: the output is greedy's, token for token, at every batch size."""
  stub = Stub(vocab_size=16, k=4, head_accuracy=case['accuracy'], eos_rate=case['eos_rate'],
              runner_up_accuracy=case['runner_up'], noise_levels=case['noise_levels'])
  rng = np.random.RandomState(case['seed'] % 2**31)
  seed_B = rng.randint(0, 2**31, size=case['batch'])
  eos_at_B = rng.randint(1, case['max_len'] + 3, size=case['batch'])
  reference_tokens = stub.reference_greedy(seed_B, eos_at_B, case['max_len'])
  result = run(stub, seed_B, eos_at_B, case['max_len'], case['tree'], expand=case['expand'])
  np.testing.assert_array_equal(np.asarray(result.tokens_BxL), reference_tokens)
  np.testing.assert_array_equal(np.asarray(result.length_B), (reference_tokens != 0).sum(axis=1))


def test_a_tree_expanded_per_parent_gives_each_node_its_parents_choice():
  """With heads fed their parent's token, node n at depth d holds the rank_n-th choice of head d + 1 fed the token
  of n's parent, and its score ranks it among all candidates: every path's product beats every left-out node's."""
  B, V, tree = 5, 12, decoding.Dynamic(10, 4, beam=3, ranks=3)
  head1_BxV = jax.random.normal(jax.random.PRNGKey(0), (B, V))
  table_DxVxV = 3.0 * jax.random.normal(jax.random.PRNGKey(1), (4, V, V))  # [depth, parent token, child logits]
  built = tree.build(decoding.argmax(head1_BxV), lambda d, parents_BxW: table_DxVxV[d][parents_BxW])
  token, parent, depth, rank = (np.asarray(x) for x in (built.token_BxN, built.parent_BxN, built.depth_BxN,
                                                        built.rank_BxN))
  assert (token[:, 0] == np.argmax(np.asarray(head1_BxV), axis=1)).all()
  logp_DxVxV = np.asarray(jax.nn.log_softmax(table_DxVxV))
  score = np.zeros((B, tree.num_nodes))
  for b in range(B):
    for n in range(1, tree.num_nodes):
      p = parent[b, n]
      assert 0 <= p < n and depth[b, n] == depth[b, p] + 1
      order = np.argsort(-logp_DxVxV[depth[b, n], token[b, p]], kind='stable')
      assert token[b, n] == order[rank[b, n]]
      score[b, n] = score[b, p] + logp_DxVxV[depth[b, n], token[b, p], token[b, n]]
  # Children of different parents differ: the tree is not one choice list per depth.
  assert any(len({token[b, n] for n in range(tree.num_nodes) if depth[b, n] == 2 and rank[b, n] == 0}) > 1
             for b in range(B))
  # The chosen nodes' scores are the top N of the candidates: the worst chosen one is no worse than the best child
  # of a chosen node that was left out (the children of chosen beam nodes are candidates).
  for b in range(B):
    for n in range(tree.num_nodes):
      if depth[b, n] == 3:
        continue
      kids = {token[b, m] for m in range(tree.num_nodes) if parent[b, m] == n}
      left = [score[b, n] + logp_DxVxV[depth[b, n] + 1, token[b, n], v] for v in
              np.argsort(-logp_DxVxV[depth[b, n] + 1, token[b, n]], kind='stable')[:3] if v not in kids]
      assert all(value <= score[b].min() + 1e-5 for value in left) or len(kids) == 0


def test_dynamic_trees_differ_per_row_and_accept_more_than_a_static_tree_of_the_same_size():
  """The trees really are per row (different parents in one batch), and spending the nodes where the heads are
  confident beats the static 8-node tree (runner-up choices are right half the time where the first is wrong)."""
  stub = Stub(vocab_size=16, k=4, head_accuracy=0.5, runner_up_accuracy=0.6)
  tree = decoding.Dynamic(8, 4, beam=4, ranks=4)
  head1_BxV = jax.random.normal(jax.random.PRNGKey(0), (6, 16))
  heads_BxDm1xV = 3.0 * jax.random.normal(jax.random.PRNGKey(1), (6, 3, 16))
  built = tree.build(decoding.argmax(head1_BxV), lambda d, parents_BxW: heads_BxDm1xV[:, d - 1, None])
  parents = np.asarray(built.parent_BxN)
  assert len({tuple(row) for row in parents.tolist()}) > 1
  assert (parents[:, 0] == -1).all() and (parents[:, 1:] >= 0).all() and (parents[:, 1:] < np.arange(1, 8)).all()
  rng = np.random.RandomState(0)
  seed_B, eos_at_B = rng.randint(0, 2**31, size=16), np.full(16, 100)
  static = run(stub, seed_B, eos_at_B, 40, TREES[1][:8])
  dynamic = run(stub, seed_B, eos_at_B, 40, tree)
  np.testing.assert_array_equal(np.asarray(dynamic.tokens_BxL), np.asarray(static.tokens_BxL))
  assert decoding.summarize(dynamic)['mean_accepted_block_size'] > decoding.summarize(static)['mean_accepted_block_size']


@pytest.mark.parametrize('tree, vocab, max_len', [(decoding.Dynamic(1, 5), 9, 7), (decoding.Dynamic(3, 8), 16, 12),
                                                   (decoding.Dynamic(2, 4, beam=2, ranks=2), 16, 9)])
def test_dynamic_trees_of_fewer_nodes_than_heads_stay_inside_the_cache(tree, vocab, max_len):
  """N < depth, rows running to max_len: the verification call writes N slots and the move min(N, D), inside the
  cache of max_len + N + 1 slots (the stub raises on a write past its end). The smallest case: dynamic:1, k' = 5,
  V = 9, max_len = 7, batch 1; once a row was within depth - N tokens of max_len, a move of D slots ran past the
  end, and a clamped one overwrote the prefix."""
  for accuracy in (0.5, 1.0):
    stub = Stub(vocab_size=vocab, k=tree.depth, head_accuracy=accuracy, runner_up_accuracy=0.5)
    for seed_B in ([0], [1, 2, 3, 4]):
      eos_at_B = np.full(len(seed_B), 100)
      result = run(stub, seed_B, eos_at_B, max_len, tree)
      np.testing.assert_array_equal(np.asarray(result.tokens_BxL), stub.reference_greedy(seed_B, eos_at_B, max_len))


def test_the_stub_refuses_a_cache_write_past_its_end():
  """The guard the tests above rely on: a write of T slots from start with start + T > L raises, as a move of D
  slots did with dynamic:1 at k' = 5; the last slots themselves can be written."""
  stub = Stub(vocab_size=9, k=5)
  state = stub.init_state(jnp.asarray([0]), jnp.asarray([100]), 9)
  tokens_Bx4 = jnp.full((1, 4), 5, jnp.int32)
  jax.block_until_ready(jax.jit(stub.score_fn)(state, tokens_Bx4, jnp.asarray([5])))
  with pytest.raises(Exception, match='cache write past the end'):
    jax.block_until_ready(jax.jit(stub.score_fn)(state, tokens_Bx4, jnp.asarray([6])))
  with pytest.raises(Exception, match='cache write past the end'):
    jax.block_until_ready(jax.jit(stub.move_fn)(state, jnp.asarray([3]), jnp.zeros((1, 7), jnp.int32)))


def test_a_second_root_may_go_deeper_than_an_ending_next_token():
  """The last-token rule: with several roots under top_k:2 the row is not decided by head 1's next token alone, so
  no iteration is skipped when that token ends the row. The smallest case: tree ((0,), (1,), (0, 0), (1, 0)), k = 2,
  max_len 2, head 1's first choice EOS: an iteration at BOS may accept the second root and its child."""
  stub = Stub(vocab_size=16, k=2, head_accuracy=0.5)
  paths = ((0,), (1,), (0, 0), (1, 0))
  rng = np.random.RandomState(0)
  seed_B, eos_at_B = rng.randint(0, 2**31, size=64), np.ones(64, int)  # EOS is head 1's first choice
  criterion = decoding.parse_criterion('top_k:2')
  result = run(stub, seed_B, eos_at_B, 2, paths, criterion)
  lengths = np.asarray(result.length_B)
  for b in range(64):
    tokens, iterations = reference.reference_blockwise(stub, int(seed_B[b]), int(eos_at_B[b]), 2, paths, criterion)
    assert list(np.asarray(result.tokens_BxL[b])[:lengths[b]]) == tokens
    assert int(result.iterations_B[b]) == iterations == 1
  assert (lengths == 2).any() and (lengths == 1).any()  # some rows took the second root's path
  # Exact acceptance, or a single root: only head 1's choice can start the block, and the first call ends the row.
  for paths, criterion in ((paths, decoding.EXACT), (((0,), (0, 0)), criterion)):
    result = run(stub, seed_B, eos_at_B, 2, paths, criterion)
    assert (np.asarray(result.length_B) == 1).all() and (np.asarray(result.iterations_B) == 0).all()
    assert (np.asarray(result.first_call_B) == 1).all()


@pytest.mark.parametrize('spec', ['exact', 'top_k:2', 'distance:2'])
def test_a_one_path_tree_off_the_rank_zero_path_is_decoded_as_a_tree(spec):
  """((0,), (0, 1)) has one node per depth, but its node asks for head 2's second choice: it is not the chain, and
  is verified and accepted as a tree (before, the chain's fast path drafted head 2's first choice: under exact the
  tokens stayed right and the iteration counts did not, under top_k and distance the tokens differed). The smallest
  case, k = 2, max_len 3, against the documented rule (reference.reference_blockwise). Users reach it:
  trees.sparse_tree returns it for agreement where head 2's second choice is the more often right."""
  paths = ((0,), (0, 1))
  assert trees.sparse_tree([[1, .5], [.2, .6]], 2) == paths
  assert not decoding.layout(paths).is_chain and decoding.layout(decoding.chain_tree(2)).is_chain
  stub = Stub(vocab_size=16, k=2, head_accuracy=0.3, runner_up_accuracy=0.9)
  criterion = decoding.parse_criterion(spec)
  seed_B = np.random.RandomState(5).randint(0, 2**31, size=16)
  eos_at_B = np.full(16, 100)
  result = run(stub, seed_B, eos_at_B, 3, paths, criterion)
  two = 0
  for b in range(16):
    tokens, iterations = reference.reference_blockwise(stub, int(seed_B[b]), int(eos_at_B[b]), 3, paths, criterion)
    assert list(np.asarray(result.tokens_BxL[b])[:int(result.length_B[b])]) == tokens, b
    assert int(result.iterations_B[b]) == iterations, b
    two += iterations == 1  # 3 tokens in one iteration: head 2's second choice was accepted
  assert 0 < two < 16
  with pytest.raises(UserError, match='lacks'):  # min_block forces the rank-0 path, which this tree lacks
    run(stub, seed_B, eos_at_B, 3, paths, decoding.parse_criterion('min_block:2'))


@pytest.mark.parametrize('spec, iterations', [('exact', 0), ('top_k:1', 0), ('distance:0', 0), ('top_k:4', 1)])
def test_checks_exact_in_effect_end_a_row_without_an_iteration_with_several_roots(spec, iterations):
  """The last-token rule's exception for several roots (DESIGN §3) is for checks looser than exact: top_k:1 and
  distance:0 accept what exact accepts, so a row whose next token ends it needs no iteration, as under exact. The
  smallest case: tree ((0,), (3,)), max_len 1: the first call produces the row (first_call 1, no iteration); under
  top_k:4 the root of rank 3 could pass, and the iteration runs."""
  stub = Stub(vocab_size=16, k=2)
  criterion = decoding.parse_criterion(spec)
  seed_B, eos_at_B = np.arange(4), np.full(4, 100)
  result = run(stub, seed_B, eos_at_B, 1, ((0,), (3,)), criterion)
  assert np.asarray(result.iterations_B).tolist() == [iterations] * 4
  assert np.asarray(result.first_call_B).tolist() == [1 - iterations] * 4
  for b in range(4):
    tokens, expected = reference.reference_blockwise(stub, int(seed_B[b]), 100, 1, ((0,), (3,)), criterion)
    assert expected == iterations and list(np.asarray(result.tokens_BxL[b])) == tokens


# -- other criteria against an uncached reference ----------------------------------------------------------

@pytest.mark.parametrize('spec', ['exact', 'top_k:2', 'distance:2', 'top_k:2+min_block:2', 'min_block:3'])
def test_every_criterion_matches_an_uncached_reference(spec):
  stub = Stub(vocab_size=16, k=4, head_accuracy=0.5, eos_rate=9, runner_up_accuracy=0.7)
  criterion = decoding.parse_criterion(spec, k=4)
  rng = np.random.RandomState(sum(map(ord, spec)))
  seed_B, eos_at_B = rng.randint(0, 2**31, size=2), rng.randint(1, 16, size=2)
  tree = run(stub, seed_B, eos_at_B, 13, TREES[1], criterion)
  for b in range(2):
    tokens, iterations = reference.reference_blockwise(stub, int(seed_B[b]), int(eos_at_B[b]), 13, TREES[1],
                                                       criterion)
    length = int(tree.length_B[b])
    assert list(np.asarray(tree.tokens_BxL[b])[:length]) == tokens
    assert int(tree.iterations_B[b]) == iterations


# -- the real model ----------------------------------------------------------------------------------------

def _last_logits(model, params, src_BxS, sequences):
  """Head-1 logits after each sequence, fed whole (no cache), all in one call: [len(sequences), V]. The decoder is
  causal, so padding a sequence at its end leaves the logits at its last token unchanged."""
  longest = max(map(len, sequences))
  tgt_in = np.array([list(s) + [3] * (longest - len(s)) for s in sequences], np.int32)
  full = jax.jit(model.apply)({'params': params}, jnp.asarray(src_BxS), jnp.asarray(tgt_in))
  return np.asarray(full)[np.arange(len(sequences)), [len(s) - 1 for s in sequences], 0]


@pytest.mark.parametrize('attention_block', [0, 2], ids=['full', 'local'])
def test_tree_scores_match_full_recompute(toy_model, attention_block):
  """Every node's head-1 logits equal those of its path fed as a plain sequence; after move_cache the accepted
  path's cache is what the chain would have written (the next call continues exactly). Local: the same weights
  with local attention of 2-position blocks, so that each call reads a window of the cache (layers.key_window)
  that starts inside the prefix and holds the whole tree."""
  model, params, _ = toy_model
  model = model_lib.Transformer(dataclasses.replace(model.config, attention_block=attention_block))
  rng = np.random.RandomState(1)
  B = 3
  src, _ = toy_batch(rng, B)
  paths = decoding.check_tree(TREES[1], 4)
  layout = decoding.layout(paths)
  N = len(paths)
  prefix = rng.randint(3, 24, size=(B, 5))
  prefix[:, 0] = TOY_BOS
  nodes = rng.randint(3, 24, size=(B, N))
  fns = model_lib.decode_fns(model, params)
  init_state, score_fn = fns.init, fns.score
  tree = layout.mask()
  score_tree = jax.jit(lambda state, tokens, start: score_fn(state, tokens, start, tree))
  init_state, score_fn = jax.jit(init_state, static_argnums=1), jax.jit(score_fn)
  state = init_state(jnp.asarray(src), 5 + N + 8)
  start = np.array([2, 5, 3])  # rows at different lengths; slots past them hold stale entries
  _, _, state = score_fn(state, jnp.asarray(prefix), jnp.zeros((B,), jnp.int32))
  logits, _, state = score_tree(state, jnp.asarray(nodes), jnp.asarray(start))
  sequences = [list(prefix[b, :start[b]]) + [nodes[b, layout.path_NxD[n, d]] for d in range(len(paths[n]))]
               for b in range(B) for n in range(N)]
  expected = _last_logits(model, params, np.repeat(src, N, axis=0), sequences)
  np.testing.assert_allclose(np.asarray(logits).reshape(B * N, -1), expected, atol=1e-4)
  # Accept the path to node 7 = (0, 1, 0) in every row, move it into place, then feed one more token after it.
  assert paths[7] == (0, 1, 0)
  state = model_lib.move_cache(state, jnp.asarray(start), jnp.asarray(np.tile(layout.path_NxD[7], (B, 1))))
  after = rng.randint(3, 24, size=(B, 1))
  logits, _, _ = score_fn(state, jnp.asarray(after), jnp.asarray(start + 3))
  sequences = [list(prefix[b, :start[b]]) + [nodes[b, n] for n in layout.path_NxD[7, :3]] + [after[b, 0]]
               for b in range(B)]
  np.testing.assert_allclose(np.asarray(logits[:, 0]), _last_logits(model, params, src, sequences), atol=1e-4)


@functools.partial(jax.jit, static_argnames=('model', 'tree', 'max_len'))
def _real_decode(params, src, *, model, tree, max_len):
  """Greedy (tree None), or blockwise over the tree (a Layout or a Dynamic) with its first tree.depth heads."""
  k = 1 if tree is None else tree.depth
  fns = model_lib.decode_fns(model, params, num_heads=k)
  init_state, score_fn, propose_fn = fns.init, fns.score, fns.propose
  state = init_state(src, max_len + (1 if tree is None else tree.num_nodes) + 1)
  fixed = decoding.Fixed(batch_size=src.shape[0], max_len=max_len, bos_id=TOY_BOS, eos_id=TOY_EOS)
  if tree is None:
    g = decoding.greedy(score_fn, state, fixed=fixed)
    return g.tokens_BxL, g.length_B, g.invocations
  return decoding.blockwise(decoding.ModelFns(score_fn, propose_fn, model_lib.move_cache), state, fixed=fixed,
                            tree=tree)


@hypothesis.given(tree=st.sampled_from(TREES[1:3] + (decoding.chain_tree(2), decoding.Dynamic(6, 4, beam=3, ranks=3))),
                  batch=st.sampled_from([1, 8]), max_len=st.sampled_from([6, 14]), seed=st.integers(0, 10_000))
@hypothesis.settings(max_examples=6, deadline=None, derandomize=True, database=None)
def test_exact_tree_equals_greedy_on_the_real_model(toy_model, tree, batch, max_len, seed):
  """Source lengths vary per row (3..8 words, then padding), so rows accept different paths (and build different
  trees per row: Dynamic); EOS and max_len fall where the model puts them, inside paths too. Through the model's
  per-row tree mask, positions and move_cache."""
  model, params, _ = toy_model
  src = jnp.asarray(toy_batch(np.random.RandomState(seed), batch)[0])
  if not isinstance(tree, decoding.Dynamic):
    tree = decoding.layout(decoding.check_tree(tree, 4))
  greedy_tokens, greedy_length, _ = _real_decode(params, src, model=model, tree=None, max_len=max_len)
  result = _real_decode(params, src, model=model, tree=tree, max_len=max_len)
  np.testing.assert_array_equal(np.asarray(result.tokens_BxL), np.asarray(greedy_tokens))
  np.testing.assert_array_equal(np.asarray(result.length_B), np.asarray(greedy_length))


def _untrained_model(k, head_type):
  """(model, params): a tiny untrained model with k heads whose decoder layers' outputs are scaled up, so that
  its greedy output changes along a row (at init the input token dominates and a random model repeats it)."""
  config = model_lib.model_config('tiny', vocab_size=40, k=k, dropout_rate=0.0, d_model=32, d_ff=64,
                                  head_type=head_type)
  params = dict(jax.jit(model_lib.init_params, static_argnums=0)(config, jax.random.PRNGKey(0)))
  for name in ('decoder_layers_0', 'decoder_layers_1'):
    layer = params[name]
    scaled = lambda sub, inner, layer=layer: dict(layer[sub], **{inner: dict(layer[sub][inner],
                                                                              kernel=layer[sub][inner]['kernel'] * 10)})
    params[name] = dict(layer, self_attn=scaled('self_attn', 'out'), cross_attn=scaled('cross_attn', 'out'),
                        ff=scaled('ff', 'wo'))
  return model_lib.Transformer(config), params


@pytest.mark.parametrize('head_type', ['independent', 'sequential'])
def test_small_dynamic_trees_near_max_len_equal_greedy_on_the_real_model(head_type):
  """dynamic:N with N < depth (k' = 8): the cache holds max_len + N + 1 slots, and rows run through every length
  up to max_len (an untrained model seldom says EOS; dynamic:1 accepts one token per iteration). The accepted path
  is moved into min(N, D) slots, not D, which would run past the cache's end there and overwrite the prefix."""
  model, params = _untrained_model(8, head_type)
  src = jnp.asarray(toy_batch(np.random.RandomState(3), 4)[0])
  fixed = decoding.Fixed(batch_size=4, max_len=12, bos_id=TOY_BOS, eos_id=TOY_EOS)
  for tree in (decoding.Dynamic(1, 8), decoding.Dynamic(3, 8, beam=2, ranks=2)):
    (greedy_tokens, greedy_length, _), block = reference.greedy_and_blockwise(params, src, model=model, tree=tree,
                                                                              fixed=fixed)
    assert (np.asarray(greedy_length) >= 9).any()  # some rows pass the lengths where a move of D slots overran
    np.testing.assert_array_equal(np.asarray(block.tokens_BxL), np.asarray(greedy_tokens), err_msg=str(tree))


# -- choosing a tree (bpd/trees.py) and the sweep's tree specs -----------------------------------------------

def test_sparse_tree_maximizes_expected_length_greedily():
  agreement = np.array([[1.0, 0.0, 0.0], [0.6, 0.3, 0.1], [0.5, 0.2, 0.0]])
  assert trees.sparse_tree(agreement, 1) == ((0,),)
  # Path probabilities: (0,0) .6, (0,1) .3, (0,0,0) .3, (0,1,0) .15, (0,0,1) .12, (0,2) .1, ...
  assert trees.sparse_tree(agreement, 4) == ((0,), (0, 0), (0, 1), (0, 0, 0))
  six = trees.sparse_tree(agreement, 6)
  assert set(six) == {(0,), (0, 0), (0, 1), (0, 0, 0), (0, 1, 0), (0, 0, 1)}
  assert trees.expected_length(six, agreement) == pytest.approx(1 + .6 + .3 + .3 + .15 + .12)
  # Every tree of N nodes it builds beats the chain of the same depth once N > depth.
  assert trees.expected_length(six, agreement) > trees.expected_length(decoding.chain_tree(3), agreement)


def test_named_trees():
  assert trees.named_tree('chain', 3) == decoding.chain_tree(3)
  assert trees.named_tree('comb:2', 3) == ((0,), (0, 0), (0, 1), (0, 0, 0), (0, 0, 1))
  assert len(trees.named_tree('dense:2', 3)) == 1 + 2 + 4
  assert trees.named_tree('comb:1', 4) == trees.named_tree('dense:1', 4) == decoding.chain_tree(4)


@pytest.mark.parametrize('spec, message', [
    ('bogus', 'Unknown tree spec'), ('comb:x', 'a tree spec is'), ('dense:0', 'at least 1'), ('nodes:0', 'at least 1'),
    ('nodes:8', 'experiments.diagnostics --mode=choose_tree'), ('dense:20', 'more than 4096 nodes'),
    ('dynamic:0', 'at least 1'), ('dynamic:5000', 'N must be between 1 and'),
])
def test_bad_tree_specs_raise_clear_errors(spec, message, tmp_path):
  with pytest.raises(UserError, match=message):
    trees.parse_tree_spec(spec, 4, str(tmp_path))


def test_nodes_spec_reads_the_saved_agreement(tmp_path):
  agreement = np.array([[1.0, 0.0], [0.7, 0.2], [0.4, 0.3]])
  trees.write_trees(str(tmp_path), agreement, {'4': trees.sparse_tree(agreement, 4)}, {'split': 'val'})
  assert trees.parse_tree_spec('nodes:4', 3, str(tmp_path)).paths == trees.sparse_tree(agreement, 4)
  assert trees.parse_tree_spec('chain', 3, str(tmp_path)).paths == decoding.chain_tree(3)
  assert trees.parse_tree_spec('dynamic:16', 3, str(tmp_path)) == decoding.Dynamic(16, 3)
  with pytest.raises(UserError, match='agreement of 3 heads, the model has k=4'):
    trees.parse_tree_spec('nodes:4', 4, str(tmp_path))


def test_trees_without_a_k_of_two_and_repeated_ks_are_refused_before_compiling(tmp_path):
  """config.decode.trees with config.decode.ks=(1,) would decode no tree row at all, and a k' listed twice would be
  decoded twice: both said, before anything compiles."""
  model_config = model_lib.model_config('tiny', vocab_size=24, k=3)
  config = common.override(demo.get_config(), **{'decode.trees': ('dynamic:8',), 'decode.ks': (1,)})
  with pytest.raises(UserError, match=r"needs a k' of at least 2"):
    checks.check_decode(config, str(tmp_path), model_config)
  with pytest.raises(UserError, match=r"names k'=\[2\] more than once"):
    checks.check_decode(common.override(config, **{'decode.ks': (2, 3, 2)}), str(tmp_path), model_config)
  chains_only = common.override(config, **{'decode.trees': ('chain',)})
  assert {s.spec for s in checks.check_decode(chains_only, str(tmp_path), model_config)} == {'chain'}


@pytest.mark.parametrize('overrides, message', [
    ({'decode.trees': ('dynamic:0',)}, 'N must be at least 1'),
    ({'decode.trees': ('dynamic:-1',)}, 'N must be at least 1'),
    ({'decode.trees': ('dynamic:x',)}, "Tree spec 'dynamic:x': a tree spec is"),
    ({'decode.trees': ('dynamic:5000',)}, 'N must be between 1 and'),
    ({'decode.trees': ('dynamic:20',), 'decode.ks': (2,)}, "cannot be built at any k' of config.decode.ks=\\(2,\\)"),
    ({'model.draft_vocab': 24}, 'draft_vocab=24'),
    ({'model.draft_vocab': -1}, 'draft_vocab=-1'),
    ({'decode.trees': ('comb:2',), 'decode.criteria': ('speculative:block',), 'decode.temperature': 1.0},
     "names 'comb:2', but no criterion .* verifies a chain"),
    ({'decode.trees': ('dynamic:8',), 'decode.criteria': ('speculative:block',), 'decode.temperature': 1.0},
     "names 'dynamic:8', but no criterion .* verifies a chain"),
    ({'decode.trees': ('dynamic:8',), 'decode.criteria': ('speculative',), 'decode.temperature': 1.0}, None),
    ({'decode.trees': ('comb:2',), 'decode.criteria': ('min_block:2',), 'decode.ks': (3,)}, None),  # it runs
])
def test_new_settings_refuse_bad_values_before_compiling(overrides, message, tmp_path):
  """What a new user might try (docs/results/reliability.md, "New settings"): each a UserError from the sweep's
  checks, before anything loads or compiles (bpd.main prints it as one line, exit status 2)."""
  model_config = model_lib.model_config('tiny', vocab_size=24, k=3)
  config = common.override(demo.get_config(), **{'decode.ks': (2, 3), **overrides})
  if message is None:
    assert checks.check_decode(config, str(tmp_path), model_config)
    return
  with pytest.raises(UserError, match=message):
    checks.check_decode(config, str(tmp_path), model_config)


def test_static_trees_with_sequential_heads_are_refused_by_the_sweep(tmp_path):
  model_config = model_lib.model_config('tiny', vocab_size=24, k=3, head_type='sequential')
  config = common.override(demo.get_config(), **{'decode.trees': ('comb:2',), 'decode.ks': (3,)})
  with pytest.raises(UserError, match='sequential heads'):
    checks.check_decode(config, str(tmp_path), model_config)


@pytest.mark.parametrize('make, message', [
    (lambda: speculative.Sampling(verify='blok'), "verify='blok'"),
    (lambda: speculative.Sampling(top_k=-1), 'sample_top_k=-1'),
    (lambda: speculative.Sampling(top_p=1.5), 'sample_top_p=1.5'),
    (lambda: decoding.Criterion(kind='exakt'), "kind='exakt'"),
    (lambda: decoding.Criterion(kind='top_k', top_k=0), 'top_k=0'),
    (lambda: decoding.Criterion(min_block=0), 'min_block=0'),
])
def test_typed_rules_check_their_own_fields(make, message):
  """A rule built in Python fails as the command line's words do: Sampling(verify='blok') ran token verification."""
  with pytest.raises(UserError, match=message):
    make()
  assert str(speculative.Sampling(verify='block')) == 'speculative:block'


@pytest.mark.parametrize('expand', [False, True], ids=['independent', 'sequential'])
def test_the_design_notes_example_tree_policy_decodes_greedy(expand, tmp_path):
  """docs/DESIGN.md's worked example of a new tree policy, executed and registered as written: the spec resolves
  through trees.POLICIES, the sweep's checks accept it, and exact decoding over it is greedy's, token for token,
  with heads read once per depth or fed the root (Stub.expand_fn); some iterations accept two tokens."""
  import os  # pylint: disable=g-import-not-at-top
  text = open(os.path.join(os.path.dirname(__file__), '..', 'docs', 'DESIGN.md')).read()
  section = text.split('### Adding a tree policy')[1].split('\n### ')[0]
  code, registration = [block.split('```')[0] for block in section.split('```python')[1:3]]
  scope = {'dataclasses': dataclasses, 'jax': jax, 'jnp': jnp, 'UserError': UserError, 'decoding': decoding,
           'trees': trees}
  exec(code, scope)  # pylint: disable=exec-used
  saved = dict(trees.POLICIES)
  try:
    exec(registration, scope)  # pylint: disable=exec-used
    tree = trees.parse_tree_spec('fan:4', 4, str(tmp_path), vocab_size=16)
    with pytest.raises(UserError, match='needs proposal heads'):
      trees.parse_tree_spec('fan:4', 1, str(tmp_path), vocab_size=16)
  finally:
    trees.POLICIES.clear()
    trees.POLICIES.update(saved)
  assert str(tree) == 'fan:4' and tree.depth == 2
  stub = Stub(vocab_size=16, k=4, head_accuracy=0.5, runner_up_accuracy=0.9)
  rng = np.random.RandomState(0)
  seed_B, eos_at_B = rng.randint(0, 2**31, size=8), np.full(8, 100)
  reference_tokens = stub.reference_greedy(seed_B, eos_at_B, 20)
  result = _decode(jnp.asarray(seed_B), jnp.asarray(eos_at_B), stub, batch_size=8, tree=tree, max_len=20,
                   criterion=decoding.EXACT, expand=expand)
  np.testing.assert_array_equal(np.asarray(result.tokens_BxL), reference_tokens)
  assert int(np.asarray(result.block_counts_BxK)[:, 1:].sum()) > 0  # blocks of 2 or more


@pytest.mark.parametrize('which', ['chain', 'static', 'dynamic', 'dynamic_sequential'])
def test_the_design_notes_example_rule_decodes_every_tree_through_its_registration(which):
  """docs/DESIGN.md's worked example of a new acceptance rule, executed and registered as written: the spec
  resolves through rules.REGISTRY; with rho = 1 it accepts what exact accepts (the stub's argmax is unique), so the
  output is greedy's token for token with exact's iterations, on a chain, a static tree with second choices and
  dynamic:N trees (heads read once per depth, or fed their parent); with a tiny rho it accepts longer blocks."""
  import os  # pylint: disable=g-import-not-at-top
  import flax  # pylint: disable=g-import-not-at-top
  text = open(os.path.join(os.path.dirname(__file__), '..', 'docs', 'DESIGN.md')).read()
  section = text.split('### Adding an acceptance rule')[1].split('\n### ')[0]
  code, registration = [block.split('```')[0] for block in section.split('```python')[1:3]]
  scope = {'flax': flax, 'jax': jax, 'jnp': jnp, 'UserError': UserError, 'decoding': decoding, 'rules': rules}
  exec(code, scope)  # pylint: disable=exec-used
  saved = dict(rules.REGISTRY)
  try:
    exec(registration, scope)  # pylint: disable=exec-used
    strict, loose = rules.parse('ratio:1.0', k=4), rules.parse('ratio:1e-30', k=4)
  finally:
    rules.REGISTRY.clear()
    rules.REGISTRY.update(saved)
  assert str(strict) == 'ratio:1.0' and strict.rho == 1.0
  tree = {'chain': decoding.chain(4),
          'static': decoding.layout(decoding.check_tree(((0,), (0, 0), (0, 1), (0, 0, 0), (0, 1, 0)), 4)),
          'dynamic': decoding.Dynamic(8, 4), 'dynamic_sequential': decoding.Dynamic(8, 4)}[which]
  for rule in (strict, loose):
    rule.check(tree)
  with pytest.raises(UserError, match='one root'):
    strict.check(decoding.layout(decoding.check_tree(((0,), (1,), (0, 0)), 4)))
  stub = Stub(vocab_size=16, k=4, head_accuracy=0.5, runner_up_accuracy=0.9)
  rng = np.random.RandomState(3)
  seed_B, eos_at_B = rng.randint(0, 2**31, size=8), rng.randint(1, 30, size=8)
  decode = lambda rule: _decode(jnp.asarray(seed_B), jnp.asarray(eos_at_B), stub, batch_size=8, tree=tree,
                                max_len=20, criterion=rule, expand=which == 'dynamic_sequential')
  exact, same, wide = decode(decoding.EXACT), decode(strict), decode(loose)
  np.testing.assert_array_equal(np.asarray(same.tokens_BxL), stub.reference_greedy(seed_B, eos_at_B, 20))
  np.testing.assert_array_equal(np.asarray(same.iterations_B), np.asarray(exact.iterations_B))
  assert decoding.summarize(wide)['mean_accepted_block_size'] > decoding.summarize(exact)['mean_accepted_block_size']


@dataclasses.dataclass(frozen=True)
class _HeadsByAnotherName:
  """A drafter of the test's own that proposes what the heads propose and counts its moves in its state: the loop
  must decode with it exactly as with decoding.HEADS, the default, so the heads have no path of their own."""
  reads_heads = True

  def check(self, tree, rule):
    decoding.HEADS.check(tree, rule)

  def init(self, context_BxC):
    return jnp.zeros(context_BxC.shape[:1], jnp.int32)

  def move(self, moves_B, rows):
    return moves_B + 1

  def propose(self, moves_B, seen, depth, per_row):
    return decoding.HEADS.propose((), seen, depth, per_row)


@pytest.mark.parametrize('which', ['chain', 'static', 'dynamic', 'dynamic_sequential'])
def test_the_heads_are_one_drafter_among_others(which):
  """Drafter, tree and rule meet only in the loop: the heads wrapped in another drafter decode token for token and
  iteration for iteration as the default, on every kind of tree; the drafter's state is moved once an iteration."""
  stub = Stub(vocab_size=16, k=4, head_accuracy=0.6, eos_rate=3, runner_up_accuracy=0.9)
  tree = {'chain': decoding.chain(4), 'static': decoding.layout(decoding.check_tree(((0,), (1,), (0, 0), (0, 1),
                                                                                      (0, 0, 0)), 4)),
          'dynamic': decoding.Dynamic(8, 4), 'dynamic_sequential': decoding.Dynamic(8, 4)}[which]
  expand = which == 'dynamic_sequential'
  seed_B, eos_at_B, max_len = jnp.arange(5), jnp.asarray([3, 9, 14, 20, 20]), 20
  fixed = decoding.Fixed(batch_size=5, max_len=max_len, bos_id=BOS, eos_id=EOS)
  fns = decoding.ModelFns(stub.score_fn, stub.propose_fn, stub.move_fn, stub.expand_fn if expand else None)
  state = stub.init_state(seed_B, eos_at_B, max_len + tree.num_nodes + 1)
  drafter = _HeadsByAnotherName()
  default = decoding.blockwise(fns, state, fixed=fixed, tree=tree)
  wrapped = decoding.blockwise(fns, state, fixed=fixed, tree=tree, drafter=drafter, context_BxC=seed_B[:, None])
  _assert_same_result(default, wrapped)
  reference = stub.reference_greedy(np.asarray(seed_B), np.asarray(eos_at_B), max_len)
  np.testing.assert_array_equal(np.asarray(wrapped.tokens_BxL), reference)
  if which == 'chain':  # the state is moved once an iteration (the same code for every tree)
    body = decoding.blockwise_body(fns, fixed=fixed, tree=tree, drafter=drafter)
    twice = jax.jit(lambda state: body(body(decoding.blockwise_init(fns, state, fixed=fixed, tree=tree,
                                                                    drafter=drafter, context_BxC=seed_B[:, None]))))
    assert np.asarray(twice(state).draft_state).tolist() == [2] * 5


def test_the_heads_are_the_drafter_named_heads():
  assert drafters.parse('heads') is decoding.HEADS and str(decoding.HEADS) == 'heads'
