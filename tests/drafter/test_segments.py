"""Segments config (TOML, marker resolution, validation) and the SegmentTracker."""

from __future__ import annotations

import tomllib

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from drafter.state import RequestStates, split_segments
from drafter.segments import DEFAULT_CONFIG_PATH, DEFAULT_SEGMENT, load_segments, parse_segments
from drafter.tracker import ClosedSegment, SegmentTracker

# Token ids: 1 = fence, 2 = "json", 3 = <turn>, 4 = </turn>, 5 = <think>, 6 = </think>; >= 10 text.
RAW = {
    "default": {"algorithm": "single_branch", "max_nodes": 4},
    "segment": [
        {"name": "json", "start": [1, 2], "end": 1, "algorithm": "multi_branch_bfs"},
        {"name": "code", "start": 1, "end": 1, "algorithm": "multi_branch_dfs",
         "draft_model": {"kind": "self_speculative", "num_layers": 2, "mode": "replace"}},
        {"name": "turn", "start": 3, "end": 4, "corpus": {"max_entries": 50, "decay": 0.25}},
        {"name": "think", "start": 5, "end": 6},
    ],
}


@pytest.fixture
def segments():
    return parse_segments(RAW)


def test_parse_resolves_ids_and_defaults(segments):
    assert segments.default.name == DEFAULT_SEGMENT and segments.default.algorithm == "single_branch"
    json_kind, code, turn, _ = segments.kinds
    assert json_kind.start == (1, 2) and json_kind.end == (1,)
    assert code.draft_model.kind == "self_speculative" and code.draft_model.mode == "replace"
    assert code.draft_model.loader_spec("/target") == {"kind": "self_speculative", "num_layers": 2, "target": "/target"}
    assert turn.corpus.max_entries == 50 and turn.corpus.decay == 0.25
    assert turn.algorithm == "best_first"


@pytest.mark.parametrize("bad", [
    {"segment": [{"name": "x", "start": 1}]},  # no end
    {"segment": [{"name": "x", "start": 1, "end": 2, "algorithm": "random"}]},
    {"segment": [{"name": "x", "start": 1, "end": 2, "colour": "red"}]},
    {"segment": [{"name": "x", "start": 1, "end": 2}, {"name": "x", "start": 3, "end": 4}]},
    {"segment": [{"name": "x", "start": 1, "end": 2, "draft_model": {"kind": "model", "mode": "maybe"}}]},
    {"segment": [{"name": "x", "start": 1, "end": 2, "draft_model": {"kind": "big"}}]},
    {"segment": [{"name": "x", "start": 1, "end": 2, "corpus": {"decay": 1.5}}]},
    {"segment": [{"name": "x", "start": 1, "end": 2, "min_prob": 1.0}]},
    {"default": {"min_prob": -0.1}},
    {"segment": [{"name": "x", "start": "```", "end": 2}]},  # a string needs a tokenizer
    {"segments": []},
])
def test_invalid_configs_are_refused(bad):
    with pytest.raises(ValueError):
        parse_segments(bad)


def test_string_markers_resolve_through_the_tokenizer(tiny_gemma3_dir):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_gemma3_dir)
    raw = {"segment": [{"name": "turn", "start": ["<bos>", "<|end|>"], "end": "<eos>"},
                       {"name": "words", "start": "quick brown", "end": "lazy dog"}]}
    turn, words = parse_segments(raw, tokenizer).kinds
    assert turn.start == (tokenizer.bos_token_id, tokenizer.convert_tokens_to_ids("<|end|>"))
    assert turn.end == (tokenizer.eos_token_id,)
    assert words.start == tuple(tokenizer.encode("quick brown", add_special_tokens=False))


@pytest.mark.real_model
def test_shipped_default_config_matches_the_default_model(default_model_dir):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(default_model_dir)
    segments = load_segments(None, tokenizer)
    fence = tokenizer.convert_tokens_to_ids("```")
    assert segments.kind("code").start == (fence,) == segments.kind("code").end
    assert segments.kind("json").start == tuple(tokenizer.encode("```json", add_special_tokens=False))
    assert segments.kind("turn").start == (tokenizer.convert_tokens_to_ids("<start_of_turn>"),)
    with open(DEFAULT_CONFIG_PATH, "rb") as f:
        assert "default" in tomllib.load(f)


@pytest.mark.real_model
def test_the_instruct_models_own_config_is_found_and_matches_its_tokenizer(instruct_model_dir, tiny_gemma3_dir):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(instruct_model_dir)
    segments = load_segments(None, tokenizer)
    fence = tokenizer.convert_tokens_to_ids("```")
    assert segments.kind("code").start == (fence,) == segments.kind("code").end
    assert segments.kind("json").start == tuple(tokenizer.encode("```json", add_special_tokens=False))
    for kind, start, end in (("turn", "<|im_start|>", "<|im_end|>"), ("tool_call", "<tool_call>", "</tool_call>")):
        assert segments.kind(kind).start == (tokenizer.convert_tokens_to_ids(start),)
        assert segments.kind(kind).end == (tokenizer.convert_tokens_to_ids(end),)
    # a model the catalog did not convert gets the shipped default
    assert load_segments(None, AutoTokenizer.from_pretrained(tiny_gemma3_dir)).kind("turn").start != \
        segments.kind("turn").start


def test_tracker_nesting_and_closing(segments):
    tracker = SegmentTracker(segments.kinds)
    assert tracker.append([10, 3, 11]) == [] and tracker.current == "turn"
    assert tracker.append([5, 12]) == [] and tracker.current == "think"
    assert tracker.append([6]) == [ClosedSegment("think", 3, 6)]
    assert tracker.current == "turn"
    assert tracker.append([1, 13]) == [] and tracker.current == "code"
    assert tracker.append([1]) == [ClosedSegment("code", 6, 9)]  # the same token closes the fence
    assert tracker.current == "turn" and tracker.current_start == 1
    assert tracker.append([4]) == [ClosedSegment("turn", 1, 10)]
    assert tracker.current == DEFAULT_SEGMENT and tracker.current_start is None


def test_outer_end_closes_unclosed_inner_segments(segments):
    tracker = SegmentTracker(segments.kinds)
    tracker.append([3, 5, 10])  # <turn> <think> ... never closed
    assert tracker.append([4]) == [ClosedSegment("turn", 0, 4)]
    assert tracker.current == DEFAULT_SEGMENT


def test_longer_marker_refines_and_closing_token_does_not_reopen(segments):
    tracker = SegmentTracker(segments.kinds)
    tracker.append([1])
    assert tracker.current == "code"
    tracker.append([2])  # "```" then "json"
    assert tracker.current == "json"
    assert tracker.append([10, 1]) == [ClosedSegment("json", 0, 4)]
    assert tracker.append([2]) == [] and tracker.current == DEFAULT_SEGMENT  # "```" closed, not "```json"


def test_tracker_is_incremental(segments):
    tokens = [10, 3, 1, 2, 11, 1, 12, 5, 13, 6, 4, 1, 14]
    whole = SegmentTracker(segments.kinds)
    closed_whole = whole.append(tokens)
    pieces = SegmentTracker(segments.kinds)
    closed_pieces = [c for t in tokens for c in pieces.append([t])]
    assert closed_whole == closed_pieces
    assert whole.current == pieces.current == "code"
    assert [c.name for c in closed_whole] == ["json", "think", "turn"]


@settings(max_examples=200, deadline=None)
@given(tokens=st.lists(st.sampled_from([1, 2, 3, 4, 5, 6, 7, 10, 11]), max_size=60),
       cuts=st.lists(st.integers(0, 60), max_size=6))
def test_looking_only_at_tokens_that_end_a_marker_changes_nothing(tokens, cuts):
    """The tracker skips tokens no marker ends with; one that looks at every token (the set of last tokens made
    all-inclusive) closes the same segments at the same places and is in the same segment after every piece."""
    kinds = parse_segments({**RAW, "segment": [*RAW["segment"], {"name": "tag", "start": [7, 10], "end": [11, 7]}]})
    fast, every = SegmentTracker(kinds.kinds), SegmentTracker(kinds.kinds)
    every._last_tokens = set(range(100))
    bounds = sorted({0, len(tokens), *(c for c in cuts if c < len(tokens))})
    for lo, hi in zip(bounds, bounds[1:]):
        assert fast.append(tokens[lo:hi]) == every.append(tokens[lo:hi])
        assert (fast.current, fast.current_start, fast.num_tokens) == (every.current, every.current_start, hi)


@pytest.mark.parametrize(("tokens", "pieces"), [
    ([10, 11, 1, 12, 1, 13, 3, 14, 4], [("default", [10, 11]), ("code", [1, 12, 1]), ("turn", [3, 14, 4])]),
    ([10, 11, 1, 12, 1, 13, 15, 3, 14], [("default", [10, 11]), ("code", [1, 12, 1]), ("default", [13, 15]),
                                         ("turn", [3, 14])]),
])
def test_corpus_building_splits_a_text_as_a_request_learns_its_output(segments, tokens, pieces):
    """Offline (`segserve corpus build`) and online, one rule: closed segments, runs outside every segment of two
    tokens or more (one token, 13 in the first, is no key a lookup could use), a segment still open at the end."""
    assert split_segments(tokens, segments) == pieces
    learned = []
    states = RequestStates(segments, lambda name, token_ids, tenant: learned.append((name, list(token_ids))))
    states.finish("r", tokens, len(tokens), 0)
    assert learned == pieces
