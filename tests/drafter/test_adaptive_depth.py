"""Match-length–adaptive depth (a kind's spec_factor, drafter/planner.py): drafts as deep as the match behind them."""

from __future__ import annotations

import pytest

from drafter.history import MAX_MATCH, HistorySource
from drafter.planner import DraftPlanner, adaptive_depth
from drafter.segments import DEFAULT_SEGMENT, parse_segments
from drafter.state import RequestStates
from drafter.types import Continuation

TEXT = list(range(100, 140))  # 40 distinct tokens


def _planner(spec_factor: float) -> tuple[DraftPlanner, RequestStates]:
    segments = parse_segments({"default": {"algorithm": "best_first", "max_nodes": 6, "max_depth": 6,
                                           "spec_factor": spec_factor}})  # fmt: skip
    return DraftPlanner(segments), RequestStates(segments, on_segment_closed=lambda *args, **kwargs: None)


def test_a_long_match_drafts_past_the_kinds_depth_up_to_the_schedulers_budget():
    """Text being copied from the prompt: a 20-token match drafts 16 deep (the budget), not the kind's 6."""
    planner, states = _planner(1.0)
    state = states.update("r", [*TEXT, 7, *TEXT[:20]], 61, 61)
    tree, _ = planner.draft(state, max_nodes=16)
    assert tree.token_ids == tuple(TEXT[20:36]) and tree.max_depth == 16
    fixed_planner, fixed_states = _planner(0.0)
    fixed, _ = fixed_planner.draft(fixed_states.update("r", [*TEXT, 7, *TEXT[:20]], 61, 61), max_nodes=16)
    assert fixed.max_depth == 6 and len(fixed) == 6  # spec_factor 0: the kind's fixed depth and budget


def test_a_short_match_drafts_as_few_tokens_as_it_matched():
    planner, states = _planner(1.0)
    planner.learn(DEFAULT_SEGMENT, [1, 2, *TEXT[:10]])
    state = states.update("r", [9, 1, 2], 3, 3)  # a 2-token match in the corpus
    tree, _ = planner.draft(state, max_nodes=16)
    assert tree.token_ids == tuple(TEXT[:2])


def test_the_history_follows_a_full_key_match_back_along_the_text():
    history = HistorySource(max_key=4, min_key=2)
    history.extend([*TEXT, 7, *TEXT[:30]])
    (found,) = history.propose(history.tokens, 5, 4)
    assert found.token_ids == tuple(TEXT[30:35]) and found.match_len == 30
    long_text = list(range(200, 300))
    history = HistorySource(max_key=4, min_key=2)
    history.extend([*long_text, 7, *long_text[:90]])
    assert history.propose(history.tokens, 5, 4)[0].match_len == MAX_MATCH  # 90 tokens match; followed back 64


@pytest.mark.parametrize(("match_len", "kept"), [(0, 6), (1, 1), (3, 3), (12, 12)])
def test_adaptive_depth_cuts_each_lookup_continuation_to_its_match(match_len, kept):
    (adapted,), depth = adaptive_depth([Continuation(tuple(range(20)), 1.0, match_len)], 1.0, 6)
    assert len(adapted.token_ids) == kept and depth == max(6, kept)


def test_spec_factor_is_checked():
    with pytest.raises(ValueError, match="spec_factor >= 0"):
        parse_segments({"default": {"spec_factor": -1.0}})
