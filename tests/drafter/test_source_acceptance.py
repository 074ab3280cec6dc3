"""Sources chosen by measurement (drafter/planner.py's SourceAcceptance): each draft's best continuation per source is
judged against what the model wrote next, and a kind's trees go to the sources that predict well in it."""

from __future__ import annotations

from drafter.config import DrafterConfig
from drafter.planner import DraftPlanner, SourceAcceptance
from drafter.segments import DEFAULT_SEGMENT, parse_segments
from drafter.server import build_servicer
from protos.segserve.v1.draft import DraftQuery
from drafter.state import RequestStates
from protos.segserve.v1.stats import DrafterSourceStats

A, B, C, D, X, Y = 10, 11, 12, 13, 20, 21
RAW = {"default": {"algorithm": "best_first", "max_nodes": 2, "max_depth": 2, "corpus": {"min_key": 2}}}


def test_judging_counts_each_continuations_leading_run_against_what_came_next():
    segments = parse_segments(RAW)
    state = RequestStates(segments, on_segment_closed=lambda *a, **k: None).update("r", [1, 2, 3], 3, 3)
    acceptance = SourceAcceptance()
    state.proposals, state.proposed_at, state.proposed_kind = {"history": (4, 5, 6), "corpus": (4, 9)}, 3, "default"
    acceptance.judge(state)  # nothing came yet: nothing judged, the proposals kept
    assert acceptance.of_kind("default") == {} and state.proposals
    state.history.extend([4, 5, 7])
    acceptance.judge(state)
    assert acceptance.of_kind("default") == {"corpus": (2, 1), "history": (3, 2)} and state.proposals == {}
    assert acceptance.weight("default", "history") == (2 + 1) / (3 + 2)
    assert acceptance.weight("default", "draft_model") == 0.5  # never judged


def test_the_source_that_predicts_what_the_model_writes_takes_the_trees_nodes():
    """After (A, B) the corpus learned X, Y and the request's own text has C, D: both match two tokens, so by
    match alone they tie for a two-node tree. The model keeps writing C, D; judged, the history earns the tree."""
    segments = parse_segments(RAW)
    planner = DraftPlanner(segments)
    for _ in range(3):
        planner.learn(DEFAULT_SEGMENT, [A, B, X, Y])
    states = RequestStates(segments, on_segment_closed=lambda *a, **k: None)
    tokens = [A, B, C, D, 50]
    state = states.update("r", tokens, len(tokens), len(tokens))
    for i in range(6):
        tokens += [A, B]
        tree, _ = planner.draft(states.update("r", [A, B], len(tokens), 5), max_nodes=2)
        tokens += [C, D, 60 + i]  # what the model wrote
        states.update("r", [C, D, 60 + i], len(tokens), 5)
    judged = planner.acceptance.of_kind(DEFAULT_SEGMENT)  # the first five drafts (the sixth is judged next time)
    assert judged["history"] == (10, 10) and judged["corpus"] == (10, 0)
    assert tree.token_ids == (C, D) and state.proposals == {"corpus": (X, Y), "history": (C, D)}


def test_get_stats_shows_each_sources_judged_and_matched_tokens():
    servicer = build_servicer(DrafterConfig(), parse_segments(RAW))
    prompt = [A, B, C, D, 50, A, B]
    servicer.draft_batch([DraftQuery("r", prompt, len(prompt), len(prompt), 2)], [])
    servicer.draft_batch([DraftQuery("r", [C, D], len(prompt) + 2, len(prompt), 2)], [])
    (segment,) = servicer.stats().segments
    assert segment.sources == (DrafterSourceStats("history", 2, 2),)


def test_a_schemas_shared_and_tenant_corpora_are_judged_apart():
    segments = parse_segments(RAW)
    planner = DraftPlanner(segments)
    planner.learn("schema", [A, B, C, D], tenant="", corpus_key="person")
    planner.learn("schema", [A, B, X, Y], tenant="t", corpus_key="person")
    states = RequestStates(segments, on_segment_closed=lambda *a, **k: None)
    state = states.update("r", [50, A, B], 3, 1, tenant="t", corpus_key="person")
    planner.draft(state, max_nodes=2)
    planner.draft(states.update("r", [C, D], 5, 1, tenant="t", corpus_key="person"), max_nodes=2)
    judged = planner.acceptance.of_kind("schema")
    assert judged["keyed"] == (2, 2) and judged["keyed_tenant"] == (2, 0)
