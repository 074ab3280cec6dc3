"""Offline corpus building (`segserve corpus build`): text files or reflow logs in, saved corpora out.

Each text is tokenized and split by the SegmentTracker: every closed segment goes
to its kind's corpus, and each run of tokens outside every segment to the default
corpus. Existing corpora in out_dir are extended, not replaced. From reflow
logs (router/reflow), the texts are what the model wrote: each completed turn's
completion prompt plus its response (the prompt may open the segment the
response continues), or a chat turn's response alone (the chat template's turn
markers are not in the log, so a chat reply counts as text outside a turn).
"""

from __future__ import annotations

from pathlib import Path
from typing import Iterable, Sequence

from drafter.planner import DraftPlanner
from drafter.segments import DEFAULT_SEGMENT, SegmentsConfig, load_segments
from drafter.server import load_corpora, load_tokenizer, save_corpora
from drafter.tracker import SegmentTracker


def split_segments(token_ids: Sequence[int], segments: SegmentsConfig) -> list[tuple[str, list[int]]]:
    """(segment name, tokens) pieces: closed segments, and runs outside every segment."""
    tracker = SegmentTracker(segments.kinds)
    pieces: list[tuple[str, list[int]]] = []
    outside: list[int] = []
    for token_id in token_ids:
        is_outside = tracker.current == DEFAULT_SEGMENT
        for closed in tracker.append([token_id]):
            pieces.append((closed.name, list(token_ids[closed.start : closed.end])))
        if is_outside and tracker.current == DEFAULT_SEGMENT:
            outside.append(token_id)
        elif outside:
            pieces.append((DEFAULT_SEGMENT, outside))
            outside = []
    if outside:
        pieces.append((DEFAULT_SEGMENT, outside))
    return pieces


def build_corpus(
    files: Iterable[str | Path], tokenizer_dir: str | None, segments_config: str | None, out_dir: str | Path,
    reflow_dirs: Iterable[str | Path] = (),
) -> dict[str, int]:
    """Add the segments of the files and of the reflow logs' turns to the corpora in out_dir;
    returns the node count per segment."""
    from router.reflow.export import generated_texts

    tokenizer = load_tokenizer(tokenizer_dir)
    segments = load_segments(segments_config, tokenizer)
    planner = DraftPlanner(segments, load_corpora(segments, out_dir))
    texts = [Path(path).read_text(encoding="utf-8") for path in files]
    texts += [text for sink_dir in reflow_dirs for text in generated_texts(sink_dir)]
    for text in texts:
        token_ids = tokenizer.encode(text, add_special_tokens=False)
        for name, tokens in split_segments(token_ids, segments):
            planner.learn(name, tokens)
    save_corpora(planner.corpora, out_dir)
    return {name: corpus.num_entries for name, corpus in planner.corpora.items()}
