"""Segment annotation of fine-tuning samples: the label text gets each segment's start and end markers.

In: JSONL samples ({"prompt", "completion"} or chat {"messages": [...]}, the shape `segserve reflow export`
writes) or a reflow log directory, a segments TOML whose kinds name their markers, and a tokenizer. Out: the
same samples with markers inserted into the label text (the completion, or every assistant message), and the
tokenizer with the markers added as tokens when they are new.

Where a segment starts and ends in plain text is found by a boundary rule. A rule is a function text ->
character spans, registered in RULES under a name; a segment kind picks its rule by name (DEFAULT_RULES maps
the shipped kind names, `rules=` overrides). Kinds without a rule (e.g. a chat turn, whose markers the chat
template writes) are not annotated. The start marker goes right before a span, the end marker right after
it; spans of different kinds may nest (a JSON value inside a quoted block), a span that crosses another is
dropped.

The markers are recorded in the saved tokenizer's config under `segment_markers` (MARKERS_KEY): the router
reads them from there to strip them from the text users see (router/detokenizer.py).
"""

from __future__ import annotations

import json
import re
import tomllib
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator

MARKERS_KEY = "segment_markers"
"""tokenizer_config.json key listing the marker tokens (read by the router as well)."""
MARKERS_CONFIG_PATH = Path(__file__).parent / "finetune_segments.toml"
"""Segments whose markers are new tokens (<seg:code> ... </seg:code>): what the model learns to emit."""
SAMPLES_FILE = "samples.jsonl"
TOKENIZER_DIR = "tokenizer"


@dataclass(frozen=True)
class Span:
    """Characters [start, end) of a text that form one segment."""

    start: int
    end: int


@dataclass(frozen=True)
class MarkedKind:
    """A segment kind to annotate: its markers as text and the name of its boundary rule."""

    name: str
    start: str
    end: str
    rule: str


_FENCE = re.compile(r"^```([^\n`]*)\n.*?^```[ \t]*$", re.MULTILINE | re.DOTALL)
_THINK = re.compile(r"<think>.*?</think>", re.DOTALL)
_QUOTE = re.compile(r"(?:^>[^\n]*(?:\n|$))+", re.MULTILINE)


def code_fence(text: str) -> list[Span]:
    """Fenced code blocks (``` at line starts), fences included; ```json blocks are json_value's."""
    return [Span(m.start(), m.end()) for m in _FENCE.finditer(text) if m.group(1).strip().lower() != "json"]


def json_value(text: str) -> list[Span]:
    """Non-empty JSON objects and arrays, the value itself (inside a ```json fence too); text inside other
    code fences is not searched (a dict literal in Python is code)."""
    masked = list(text)
    for span in code_fence(text):
        masked[span.start:span.end] = " " * (span.end - span.start)
    searched = "".join(masked)
    decoder, spans, pos = json.JSONDecoder(), [], 0
    while (match := re.compile(r"[\[{]").search(searched, pos)) is not None:
        try:
            value, end = decoder.raw_decode(searched, match.start())
        except json.JSONDecodeError:
            pos = match.start() + 1
            continue
        if isinstance(value, (dict, list)) and value:
            spans.append(Span(match.start(), end))
            pos = end
        else:
            pos = match.start() + 1
    return spans


def quoted_context(text: str) -> list[Span]:
    """Markdown block quotes: runs of lines starting with '>', the trailing newline excluded."""
    return [Span(m.start(), m.end() - m.group(0).endswith("\n")) for m in _QUOTE.finditer(text)]


def reasoning_block(text: str) -> list[Span]:
    """<think> ... </think> blocks, tags included."""
    return [Span(m.start(), m.end()) for m in _THINK.finditer(text)]


RULES: dict[str, Callable[[str], list[Span]]] = {
    "code_fence": code_fence,
    "json_value": json_value,
    "quoted_context": quoted_context,
    "reasoning_block": reasoning_block,
}
DEFAULT_RULES = {"code": "code_fence", "json": "json_value", "quote": "quoted_context", "think": "reasoning_block"}


def load_marked_kinds(path: str | Path | None = None, rules: dict[str, str] | None = None,
                      tokenizer: Any = None) -> list[MarkedKind]:
    """The kinds of a segments TOML (None = MARKERS_CONFIG_PATH) that have a rule, markers as text."""
    with open(path or MARKERS_CONFIG_PATH, "rb") as f:
        raw = tomllib.load(f)
    names = {table.get("name") for table in raw.get("segment", [])}
    unknown = set(rules or {}) - names
    if unknown:
        raise ValueError(f"rules name segments the config does not have: {sorted(unknown)}")
    rule_of = {**DEFAULT_RULES, **(rules or {})}
    kinds = []
    for table in raw.get("segment", []):
        rule = rule_of.get(table["name"])
        if rule is None:
            continue
        if rule not in RULES:
            raise ValueError(f"segment {table['name']!r}: unknown rule {rule!r}, one of {sorted(RULES)}")
        kinds.append(MarkedKind(table["name"], _marker_text(table["start"], tokenizer),
                                _marker_text(table["end"], tokenizer), rule))
    if not kinds:
        raise ValueError(f"no segment of {path or MARKERS_CONFIG_PATH} has a boundary rule")
    return kinds


def _marker_text(marker: Any, tokenizer: Any) -> str:
    parts = marker if isinstance(marker, list) else [marker]
    if any(isinstance(p, int) for p in parts) and tokenizer is None:
        raise ValueError(f"marker {marker!r} holds token ids: its text needs a tokenizer")
    return "".join(tokenizer.convert_ids_to_tokens(p) if isinstance(p, int) else str(p) for p in parts)


def segment_spans(text: str, kinds: Iterable[MarkedKind]) -> list[tuple[MarkedKind, Span]]:
    """Every kind's spans, outer before inner; a span crossing one kept earlier is dropped."""
    found = sorted(((kind, span) for kind in kinds for span in RULES[kind.rule](text) if span.end > span.start),
                   key=lambda ks: (ks[1].start, -ks[1].end))
    kept: list[tuple[MarkedKind, Span]] = []
    for kind, span in found:
        if all(s.end <= span.start or span.end <= s.start or (s.start <= span.start and span.end <= s.end)
               for _, s in kept):
            kept.append((kind, span))
    return kept


def insert_markers(text: str, kinds: Iterable[MarkedKind]) -> str:
    """`text` with each segment's start marker before it and end marker after it. A segment whose own text
    begins and ends with its markers (a config whose code markers are the fences) is left as it is. Text that
    holds markers already should be stripped first (strip_markers): the rules do not see through them."""
    inserts = []  # (position, order, marker): ends before starts at one position; inner ends, outer starts first
    for depth, (kind, span) in enumerate(segment_spans(text, kinds)):
        if _is_marked(text, kind, span):
            continue
        inserts.append((span.start, 1, depth, kind.start))
        inserts.append((span.end, 0, -depth, kind.end))
    out, pos = [], 0
    for at, _, _, marker in sorted(inserts):
        out.append(text[pos:at] + marker)
        pos = at
    return "".join(out) + text[pos:]


def _is_marked(text: str, kind: MarkedKind, span: Span) -> bool:
    return text.startswith(kind.start, span.start) and text[:span.end].endswith(kind.end) \
        and span.end - span.start >= len(kind.start) + len(kind.end)


def strip_markers(text: str, kinds: Iterable[MarkedKind]) -> str:
    for kind in kinds:
        text = text.replace(kind.start, "").replace(kind.end, "")
    return text


def annotate_sample(sample: dict, kinds: list[MarkedKind]) -> tuple[dict, Counter]:
    """The sample with its label text annotated, and the number of segments per kind it got."""
    counts: Counter = Counter()

    def mark(text: str) -> str:
        counts.update(kind.name for kind, _ in segment_spans(text, kinds))
        return insert_markers(text, kinds)

    if isinstance(sample.get("messages"), list):
        messages = [{**m, "content": mark(m["content"])} if m.get("role") == "assistant" else m
                    for m in sample["messages"]]
        if not any(m.get("role") == "assistant" for m in messages):
            raise ValueError("a chat sample needs an assistant message (the label)")
        return {**sample, "messages": messages}, counts
    if isinstance(sample.get("prompt"), str) and isinstance(sample.get("completion"), str):
        return {**sample, "completion": mark(sample["completion"])}, counts
    raise ValueError("a sample is {'prompt': str, 'completion': str} or {'messages': [...]}")


def read_samples(paths: Iterable[str | Path], reflow_dirs: Iterable[str | Path] = ()) -> Iterator[dict]:
    """Samples of JSONL files, then the chat examples of reflow log directories."""
    for path in paths:
        with open(path, encoding="utf-8") as f:
            for number, line in enumerate(f, 1):
                if line.strip():
                    try:
                        yield json.loads(line)
                    except json.JSONDecodeError as exc:
                        raise ValueError(f"{path}:{number}: not JSON ({exc.msg})") from None
    if reflow_dirs:
        from segserve.reflow.export import chat_samples

        for directory in reflow_dirs:
            yield from chat_samples(directory)


def add_marker_tokens(tokenizer: Any, kinds: Iterable[MarkedKind]) -> list[str]:
    """Add the markers that are not one vocabulary token yet (as plain, unnormalized tokens); record all
    markers under MARKERS_KEY. Returns the added ones."""
    from transformers import AddedToken

    markers = list(dict.fromkeys(m for kind in kinds for m in (kind.start, kind.end)))
    vocab = tokenizer.get_vocab()
    new = [m for m in markers if m not in vocab]
    tokenizer.add_tokens([AddedToken(m, special=False, normalized=False) for m in new])
    tokenizer.init_kwargs[MARKERS_KEY] = markers
    return new


def annotate(inputs: Iterable[str | Path], out_dir: str | Path, tokenizer_dir: str | Path,
             segments_config: str | Path | None = None, rules: dict[str, str] | None = None,
             reflow_dirs: Iterable[str | Path] = ()) -> dict:
    """Write OUT/samples.jsonl and OUT/tokenizer/; returns (and writes to OUT/annotation.json) a summary."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(tokenizer_dir))
    kinds = load_marked_kinds(segments_config, rules, tokenizer)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    totals: Counter = Counter()
    num_samples = 0
    with open(out / SAMPLES_FILE, "w", encoding="utf-8") as f:
        for sample in read_samples(inputs, reflow_dirs):
            annotated, counts = annotate_sample(sample, kinds)
            totals.update(counts)
            num_samples += 1
            f.write(json.dumps(annotated, ensure_ascii=False) + "\n")
    added = add_marker_tokens(tokenizer, kinds)
    tokenizer.save_pretrained(out / TOKENIZER_DIR)
    summary = {"num_samples": num_samples, "segments": {k.name: totals[k.name] for k in kinds},
               "rules": {k.name: k.rule for k in kinds}, "markers": tokenizer.init_kwargs[MARKERS_KEY],
               "added_tokens": added, "tokenizer": str(out / TOKENIZER_DIR)}
    (out / "annotation.json").write_text(json.dumps(summary, indent=2) + "\n")
    return summary
