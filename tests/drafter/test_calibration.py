"""Node calibration: what became of the drafter's nodes turns their weights into chances of acceptance per kind."""

from __future__ import annotations

import pytest

from drafter.calibration import MAX_JUDGED, NUM_BINS, NodeCalibration
from drafter.planner import DraftPlanner
from drafter.segments import parse_segments
from drafter.state import RequestStates
from drafter.trees import BUILDERS, grow, merge
from drafter.types import Continuation
from protos.segserve.v1.tree import CandidateTree

A, B, C, D, E, F = 30, 31, 32, 33, 34, 35
# weights (scores summing to 1): (1) 0.7, (1, 2) 0.6, (1, 2, 3, 4) 0.4, (9, 10) 0.3, (1, 2, 7) 0.2, (1, 12) 0.1
CONTINUATIONS = [
    Continuation((1, 2, 3, 4), 0.4),
    Continuation((9, 10), 0.3),
    Continuation((1, 2, 7), 0.2),
    Continuation((1, 12), 0.1),
]


def _paths(tree: CandidateTree) -> set[tuple[int, ...]]:
    paths: list[tuple[int, ...]] = []
    for token_id, parent in zip(tree.token_ids, tree.parents):
        paths.append((paths[parent] if parent >= 0 else ()) + (token_id,))
    return set(paths)


def _grow(calibration: NodeCalibration, kind: str, algorithm: str = "best_first", max_nodes: int = 16,
          min_prob: float = 0.0) -> CandidateTree:
    return grow(algorithm, merge(CONTINUATIONS, 8), max_nodes, min_prob, calibration.calibrate(kind))


@pytest.mark.parametrize("algorithm", sorted(BUILDERS))
@pytest.mark.parametrize("min_prob", [0.0, 0.15, 0.35, 0.65])
def test_before_anything_is_judged_the_chances_are_the_weights(algorithm, min_prob):
    plain = grow(algorithm, merge(CONTINUATIONS, 8), 16, min_prob)
    assert _grow(NodeCalibration(), "code", algorithm, min_prob=min_prob) == plain


def test_a_chain_written_only_to_its_second_token_stops_being_drafted_past_it_at_a_price():
    calibration = NodeCalibration()
    for _ in range(50):
        calibration.judge("code", merge(CONTINUATIONS, 8), [1, 2, 5, 6])  # (1, 2) accepted, then neither 3 nor 7
    priced = _paths(_grow(calibration, "code", min_prob=0.3))
    assert (1, 2) in priced and (1, 2, 3) not in priced and (1, 2, 7) not in priced
    assert (1, 2, 3) in _paths(grow("best_first", merge(CONTINUATIONS, 8), 16, 0.3)), "by weight alone: 0.4"
    assert _grow(calibration, "json", min_prob=0.3) == grow("best_first", merge(CONTINUATIONS, 8), 16, 0.3), \
        "each kind is measured apart"


def test_a_node_the_price_left_out_is_still_judged_and_drafted_once_it_proves_likely():
    calibration = NodeCalibration()
    assert (9,) not in _paths(_grow(calibration, "code", min_prob=0.35))  # weight 0.3
    for _ in range(50):
        trie = merge(CONTINUATIONS, 8)
        grow("best_first", trie, 16, 0.35, calibration.calibrate("code"))  # drafted without (9, ...)
        calibration.judge("code", trie, [9, 10])
    drafted = _paths(_grow(calibration, "code", min_prob=0.35))
    assert {(9,), (9, 10)} <= drafted
    assert (1,) not in drafted, "(1) was judged too, and rejected every time"


def test_judging_stops_where_the_written_tokens_leave_the_trie_or_end():
    calibration = NodeCalibration()
    calibration.judge("code", merge(CONTINUATIONS, 8), [1])
    by_depth = calibration.of_kind("code")
    assert sum(judged for judged, _ in by_depth[0]) == 2  # (1) and (9)
    assert sum(judged for bucket in by_depth.values() if bucket is not by_depth[0] for judged, _ in bucket) == 0
    calibration.judge("code", merge(CONTINUATIONS, 8), [5, 1, 2])
    assert sum(judged for judged, _ in calibration.of_kind("code")[0]) == 4  # nothing under a rejected first token
    assert sum(accepted for _, accepted in calibration.of_kind("code")[0]) == 1
    calibration.judge("code", merge(CONTINUATIONS, 8), [])
    assert sum(judged for judged, _ in calibration.of_kind("code")[0]) == 4


def test_counts_halve_past_their_bound_so_that_the_chances_follow_the_traffic():
    calibration = NodeCalibration()
    trie = merge([Continuation((1,), 1.0)], 8)
    for _ in range(int(MAX_JUDGED) + 10):
        calibration.judge("code", trie, [2])
    judged, accepted = calibration.of_kind("code")[0][NUM_BINS - 1]
    assert MAX_JUDGED / 2 <= judged < MAX_JUDGED and accepted == 0
    assert calibration.chance("code", 1, 1.0, 1.0) < 0.01


def test_the_planner_judges_each_requests_last_trie_when_its_next_tokens_come():
    """The request's own text has A, B, C, D, E, F: its history drafts the whole run after A, B. The model writes
    C, D then something new each time; judged, the nodes past D stop being drafted at a price of 0.5."""
    segments = parse_segments({"default": {"algorithm": "best_first", "max_nodes": 6, "max_depth": 6,
                                           "corpus": {"min_key": 2}}})
    planner = DraftPlanner(segments)
    states = RequestStates(segments, on_segment_closed=lambda *a, **k: None)
    tokens = [A, B, C, D, E, F, 50]
    states.update("r", tokens, len(tokens), len(tokens))
    trees = []
    for i in range(12):
        tokens += [A, B]
        tree, kind = planner.draft(states.update("r", [A, B], len(tokens), 7), max_nodes=6, min_node_prob=0.5)
        trees.append(tree)
        tokens += [C, D, 60 + i]  # what the model wrote
        states.update("r", [C, D, 60 + i], len(tokens), 7)
    assert trees[0].token_ids[:4] == (C, D, E, F)
    assert _paths(trees[-1]) == {(C,), (C, D)}
    judged = planner.calibration.of_kind(kind)
    assert sum(j for j, _ in judged[0]) >= 11 and sum(a for _, a in judged[0]) >= 11  # C, every time
    assert sum(j for j, _ in judged[2]) >= 11 and sum(a for _, a in judged[2]) == 0  # past D: never
