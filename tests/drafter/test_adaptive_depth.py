"""Match-length–adaptive depth (a kind's spec_factor, drafter/planner.py): drafts as deep as the match behind them."""

from __future__ import annotations

import pytest

from drafter.history import MAX_MATCH, HistorySource
from drafter.planner import DraftPlanner, adaptive_depth, by_match
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


def test_text_learned_whole_drafts_on_past_the_corpus_depth_by_chained_lookups():
    """The corpus cuts key and continuation together at its depth (16): an 8-token key leaves 8 tokens, and the
    draft goes on from its own end, as long as each lookup matches a whole key, up to the budget."""
    planner, states = _planner(1.0)
    planner.learn(DEFAULT_SEGMENT, TEXT)
    state = states.update("r", [9, *TEXT[:10]], 11, 11)
    tree, _ = planner.draft(state, max_nodes=24)
    assert tree.token_ids == tuple(TEXT[10:34]) and tree.max_depth == 24
    unchained, _ = planner.draft(state, max_nodes=8)
    assert unchained.token_ids == tuple(TEXT[10:18])


def test_the_source_with_the_longer_match_takes_the_trees_nodes_first():
    """The corpus matches 8 tokens; the request's own text matches 4 (TEXT[6:10], once followed by 1, 2, 3). Scores
    normalized per source alone would split the nodes evenly between the two guesses; scaled by match, the
    corpus's whole chain comes first."""
    planner, states = _planner(1.0)
    planner.learn(DEFAULT_SEGMENT, TEXT)
    state = states.update("r", [*TEXT[6:10], 1, 2, 3, *TEXT[:10]], 17, 17)
    tree, _ = planner.draft(state, max_nodes=8)
    assert tree.token_ids == tuple(TEXT[10:18])
    assert by_match([[Continuation((1,), 1.0, 4)], [Continuation((2,), 1.0, 8)], [Continuation((3,), 1.0, 0)]]) == [
        Continuation((1,), 0.5, 4), Continuation((2,), 1.0, 8), Continuation((3,), 1.0, 0)]
