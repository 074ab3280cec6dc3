"""Segment annotation: the boundary rules, marker insertion, the tokenizer's new tokens, and the drafter
finding the annotated segments by their marker tokens."""

from __future__ import annotations

import json

import pytest
from transformers import AutoTokenizer

from drafter.segments import load_segments
from drafter.tracker import SegmentTracker
from segserve.annotate import (MARKERS_CONFIG_PATH, MARKERS_KEY, MarkedKind, Span, annotate, annotate_sample,
                               code_fence, insert_markers, json_value, load_marked_kinds, quoted_context,
                               reasoning_block, segment_spans)

KINDS = load_marked_kinds()
CODE = "Sure:\n```python\nd = {\"a\": 1}\n```\nDone."


def _spans(text: str, rule) -> list[str]:
    return [text[s.start:s.end] for s in rule(text)]


def test_code_fence_spans_whole_fenced_blocks_but_json_ones():
    text = CODE + "\n```json\n{\"b\": 2}\n```\n```\nplain\n```"
    assert _spans(text, code_fence) == ["```python\nd = {\"a\": 1}\n```", "```\nplain\n```"]
    assert code_fence("inline ``` is not a fence") == []


def test_json_value_finds_bare_and_fenced_values_not_code_or_scalars():
    text = CODE + ' then {"x": [1, 2]} and ```json\n[{"y": null}]\n``` but {not json} 3 "s" {} [] [7]'
    assert _spans(text, json_value) == ['{"x": [1, 2]}', '[{"y": null}]', "[7]"]


def test_quoted_context_and_reasoning_block():
    text = "Context:\n> first line\n> second\nAnswer <think>a\nb</think> ok"
    assert _spans(text, quoted_context) == ["> first line\n> second"]
    assert _spans(text, reasoning_block) == ["<think>a\nb</think>"]


def test_markers_go_exactly_at_the_boundaries():
    assert insert_markers(CODE, KINDS) == "Sure:\n<seg:code>```python\nd = {\"a\": 1}\n```</seg:code>\nDone."
    text = 'Record: {"a": 1}.\n> he said {"q": [2]}\nend'
    assert insert_markers(text, KINDS) == ('Record: <seg:json>{"a": 1}</seg:json>.\n'
                                           '<seg:quote>> he said <seg:json>{"q": [2]}</seg:json></seg:quote>\nend')
    assert insert_markers("no segment here", KINDS) == "no segment here"


def test_markers_that_are_the_segments_own_text_are_not_doubled():
    fence = [MarkedKind("code", "```", "```", "code_fence")]
    assert insert_markers(CODE, fence) == CODE
    think = [MarkedKind("think", "<think>", "</think>", "reasoning_block")]
    assert insert_markers("a <think>b</think> c", think) == "a <think>b</think> c"


def test_crossing_spans_keep_the_first_and_nested_ones_close_inner_first(monkeypatch):
    import segserve.annotate as annotate_module

    a, b, c = MarkedKind("a", "<a>", "</a>", "ra"), MarkedKind("b", "<b>", "</b>", "rb"), \
        MarkedKind("c", "<c>", "</c>", "rc")
    monkeypatch.setitem(annotate_module.RULES, "ra", lambda text: [Span(0, 6)])
    monkeypatch.setitem(annotate_module.RULES, "rb", lambda text: [Span(3, 9)])  # crosses a: dropped
    monkeypatch.setitem(annotate_module.RULES, "rc", lambda text: [Span(0, 6), Span(2, 4)])  # nested in a
    assert [(k.name, s) for k, s in segment_spans("abcdefghij", [a, b, c])] == \
        [("a", Span(0, 6)), ("c", Span(0, 6)), ("c", Span(2, 4))]
    assert insert_markers("abcdefghij", [a, b, c]) == "<a><c>ab<c>cd</c>ef</c></a>ghij"


def test_annotate_sample_marks_only_the_labels():
    chat = {"messages": [{"role": "user", "content": "```x\ny\n```"}, {"role": "assistant", "content": CODE}]}
    annotated, counts = annotate_sample(chat, KINDS)
    assert annotated["messages"][0] == chat["messages"][0]
    assert annotated["messages"][1]["content"].startswith("Sure:\n<seg:code>```python")
    assert counts == {"code": 1}
    completion, _ = annotate_sample({"prompt": "```\nq\n```", "completion": CODE}, KINDS)
    assert completion["prompt"] == "```\nq\n```" and "<seg:code>" in completion["completion"]
    with pytest.raises(ValueError, match="prompt"):
        annotate_sample({"text": "x"}, KINDS)
    with pytest.raises(ValueError, match="assistant"):
        annotate_sample({"messages": [{"role": "user", "content": "hi"}]}, KINDS)


def test_rules_are_validated(tmp_path):
    with pytest.raises(ValueError, match="unknown rule 'nope'"):
        load_marked_kinds(rules={"code": "nope"})
    with pytest.raises(ValueError, match="does not have"):
        load_marked_kinds(rules={"missing": "code_fence"})
    assert {k.name: k.rule for k in load_marked_kinds(rules={"code": "reasoning_block"})}["code"] == "reasoning_block"
    config = tmp_path / "s.toml"
    config.write_text('[[segment]]\nname = "x"\nstart = "<x>"\nend = "</x>"\n')
    with pytest.raises(ValueError, match="no segment"):
        load_marked_kinds(config)
    assert load_marked_kinds(config, {"x": "code_fence"}) == [MarkedKind("x", "<x>", "</x>", "code_fence")]


def test_annotate_adds_marker_tokens_and_the_drafter_finds_the_segments(tmp_path, tiny_gemma3_dir):
    data = tmp_path / "in.jsonl"
    samples = [{"prompt": "Q: code\nA:", "completion": CODE},
               {"messages": [{"role": "user", "content": "json?"},
                             {"role": "assistant", "content": 'It is {"a": [1, 2]} and\n> quoted'}]}]
    data.write_text("".join(json.dumps(s) + "\n" for s in samples))
    base = AutoTokenizer.from_pretrained(str(tiny_gemma3_dir))
    summary = annotate([data], tmp_path / "out", tiny_gemma3_dir)
    assert summary["num_samples"] == 2 and summary["segments"] == {"code": 1, "json": 1, "quote": 1, "think": 0}
    markers = [m for k in KINDS for m in (k.start, k.end)]
    assert summary["added_tokens"] == markers
    tokenizer = AutoTokenizer.from_pretrained(str(tmp_path / "out" / "tokenizer"))
    assert len(tokenizer) == len(base) + len(markers)
    assert tokenizer.init_kwargs[MARKERS_KEY] == markers
    assert all(len(tokenizer.encode(m, add_special_tokens=False)) == 1 for m in markers)
    rows = [json.loads(line) for line in (tmp_path / "out" / "samples.jsonl").read_text().splitlines()]
    label = rows[1]["messages"][1]["content"]
    assert label == 'It is <seg:json>{"a": [1, 2]}</seg:json> and\n<seg:quote>> quoted</seg:quote>'

    # The drafter, given the markers' segments config and this tokenizer, finds exactly these segments.
    segments = load_segments(MARKERS_CONFIG_PATH, tokenizer)
    tracker = SegmentTracker(segments.all_kinds)
    ids = tokenizer.encode(label, add_special_tokens=False)
    closed = tracker.append(ids)
    assert [c.name for c in closed] == ["json", "quote"]
    json_segment = closed[0]
    assert tokenizer.decode(ids[json_segment.start:json_segment.end]) == '<seg:json>{"a": [1, 2]}</seg:json>'

    # Annotating again with the extended tokenizer adds nothing new.
    again = annotate([data], tmp_path / "again", tmp_path / "out" / "tokenizer")
    assert again["added_tokens"] == [] and again["markers"] == markers


def test_bad_jsonl_names_the_line(tmp_path, tiny_gemma3_dir):
    data = tmp_path / "bad.jsonl"
    data.write_text('{"prompt": "a", "completion": "b"}\nnot json\n')
    with pytest.raises(ValueError, match="bad.jsonl:2"):
        annotate([data], tmp_path / "out", tiny_gemma3_dir)


def test_annotate_reads_reflow_logs_through_the_cli(tmp_path, tiny_gemma3_dir):
    from segserve.cli import main
    from tests.segserve.reflow.test_export import _logs

    _logs(tmp_path)
    out = tmp_path / "annotated"
    assert main(["segments", "annotate", "--from-reflow", str(tmp_path / "logs"), "--out", str(out),
                 "--tokenizer", str(tiny_gemma3_dir)]) == 0
    rows = [json.loads(line) for line in (out / "samples.jsonl").read_text().splitlines()]
    assert len(rows) == 3  # one chat example per conversation, as `reflow export` gives
    assert [m["role"] for m in rows[0]["messages"]] == ["system", "user", "assistant", "user", "assistant"]
    assert json.loads((out / "annotation.json").read_text())["num_samples"] == 3
