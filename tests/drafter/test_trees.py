"""Tree builders: budget, depth, topological order, valid parents, best chain first, prefix merging.

Builders return the contract type, protos.segserve.v1.tree.CandidateTree (parents -1 = root).
"""

from __future__ import annotations

import pytest

from drafter.trees import BUILDERS, grow, merge
from drafter.types import Continuation
from protos.segserve.v1.tree import ROOT, CandidateTree

CONTINUATIONS = [
    Continuation((1, 2, 3, 4, 5, 6), 5.0),  # the best chain
    Continuation((1, 2, 7, 8), 2.0),  # shares (1, 2) with it
    Continuation((9, 10, 11), 3.0),
    Continuation((1, 12), 1.0),
    Continuation((13,), 0.5),
]
BEST_CHAIN = [1, 2, 3, 4, 5, 6]


def build(algorithm: str, continuations: list[Continuation], max_nodes: int, max_depth: int,
          min_prob: float = 0.0) -> CandidateTree:
    """The tree the named builder grows from the continuations' trie (as the planner does)."""
    return grow(algorithm, merge(continuations, max_depth), max_nodes, min_prob)


def _paths(tree: CandidateTree) -> set[tuple[int, ...]]:
    """Every root-to-node path of the tree, as token tuples."""
    paths: list[tuple[int, ...]] = []
    for token_id, parent in zip(tree.token_ids, tree.parents):
        paths.append((paths[parent] if parent >= 0 else ()) + (token_id,))
    return set(paths)


@pytest.mark.parametrize("algorithm", sorted(BUILDERS))
@pytest.mark.parametrize("max_nodes,max_depth", [(1, 1), (3, 6), (6, 3), (8, 4), (40, 10)])
def test_shape_properties(algorithm, max_nodes, max_depth):
    tree = build(algorithm, CONTINUATIONS, max_nodes, max_depth)
    assert isinstance(tree, CandidateTree)
    assert tree.problem(max_nodes=max_nodes) is None
    assert 1 <= len(tree) <= max_nodes
    assert tree.max_depth <= max_depth
    assert all(ROOT <= p < i for i, p in enumerate(tree.parents))
    paths = _paths(tree)
    assert len(paths) == len(tree), "siblings never repeat a token (prefixes are merged)"
    prefixes = {c.token_ids[:d] for c in CONTINUATIONS for d in range(1, len(c.token_ids) + 1)}
    assert paths <= prefixes, "every path is a prefix of some continuation"
    assert tree.token_ids[0] == 1 and tree.parents[0] == -1, "the heaviest first token comes first"


@pytest.mark.parametrize("algorithm", ["single_branch", "multi_branch_dfs"])
def test_chain_builders_put_the_best_chain_first(algorithm):
    tree = build(algorithm, CONTINUATIONS, 8, 6)
    assert list(tree.token_ids[:6]) == BEST_CHAIN
    assert tree.parents[:6] == (-1, 0, 1, 2, 3, 4)


def test_single_branch_is_one_chain():
    tree = build("single_branch", CONTINUATIONS, 40, 4)
    assert tree == CandidateTree(tuple(BEST_CHAIN[:4]), (-1, 0, 1, 2))
    assert tree.is_path(BEST_CHAIN[:5])


def test_bfs_fills_levels_in_order():
    tree = build("multi_branch_bfs", CONTINUATIONS, 40, 10)
    assert list(tree.depths) == sorted(tree.depths)
    assert tree.token_ids[:3] == (1, 9, 13)  # depth 1, heaviest first


def test_dfs_explores_the_best_chain_then_its_alternatives():
    tree = build("multi_branch_dfs", CONTINUATIONS, 40, 10)
    assert tree.token_ids[6:8] == (7, 8)  # the alternative under (1, 2) before other first tokens
    assert len(tree) == len({p for c in CONTINUATIONS for p in [c.token_ids[:d] for d in range(1, len(c.token_ids) + 1)]})


def test_best_first_takes_the_most_probable_nodes():
    tree = build("best_first", CONTINUATIONS, 5, 10)
    # weights: (1)=8, (1,2)=7, (1,2,3)..=5, (9)=3: the fifth node is (1,2,3,4) at 5, not (9) at 3
    assert _paths(tree) == {(1,), (1, 2), (1, 2, 3), (1, 2, 3, 4), (1, 2, 3, 4, 5)}
    wide = build("best_first", CONTINUATIONS, 7, 3)
    assert (9,) in _paths(wide) and (1, 2, 7) in _paths(wide)


def test_merge_sums_scores_over_shared_prefixes():
    root = merge(CONTINUATIONS, max_depth=10)
    assert root.children[1].weight == 8.0
    assert root.children[1].children[2].weight == 7.0
    assert root.weight == pytest.approx(11.5)


def test_empty_inputs_give_empty_trees():
    for algorithm in BUILDERS:
        assert build(algorithm, [], 8, 4) == CandidateTree()
        assert build(algorithm, CONTINUATIONS, 0, 4) == CandidateTree()
        assert build(algorithm, CONTINUATIONS, 8, 0) == CandidateTree()
        assert build(algorithm, [Continuation((1, 2), 0.0)], 8, 4) == CandidateTree()


@pytest.mark.parametrize("algorithm", sorted(BUILDERS))
def test_trees_survive_the_wire(algorithm):
    tree = build(algorithm, CONTINUATIONS, 40, 10)
    assert CandidateTree.from_pb(tree.to_pb()) == tree


@pytest.mark.parametrize("algorithm", sorted(BUILDERS))
def test_min_prob_drops_improbable_paths_whatever_the_budget(algorithm):
    # scores as the planner calibrates them (summing to at most 1), so a node's weight is its estimated acceptance:
    # (1) 0.70, (1,2) 0.61, (1,2,3...) 0.43, (9...) 0.26, (1,2,7,8) 0.17, (1,12) 0.09, (13) 0.04
    calibrated = [Continuation(c.token_ids, c.score / 11.5) for c in CONTINUATIONS]
    tree = build(algorithm, calibrated, 40, 10, min_prob=0.1)
    unpruned = build(algorithm, calibrated, 40, 10)
    if algorithm != "single_branch":  # one chain: the best, which no threshold below 0.43 cuts
        assert _paths(tree) == {p for p in _paths(unpruned) if p not in {(1, 12), (13,)}}
    else:
        assert tree == unpruned
    assert _paths(build(algorithm, calibrated, 40, 10, min_prob=0.5)) == {(1,), (1, 2)}
    assert build(algorithm, calibrated, 40, 10, min_prob=0.75) == CandidateTree()
    assert _paths(build(algorithm, calibrated, 1, 10, min_prob=0.1)) == {(1,)}, "the budget still binds"
