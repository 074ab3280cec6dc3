"""Offline corpus building (`segserve corpus build`): texts (or token sequences) in, saved corpora out.

Each text is tokenized and split by the SegmentTracker: every closed segment goes
to its kind's corpus, and each run of tokens outside every segment to the default
corpus. Existing corpora in out_dir are extended, not replaced. The texts are
text files' contents and whatever texts the caller passes; reading them from
data-reflow logs is segserve's job (segserve/corpus_build.py), not the drafter's.
"""

from __future__ import annotations

from pathlib import Path
from typing import Iterable, Sequence

from drafter.memory import load_corpora, save_corpora
from drafter.planner import DraftPlanner
from drafter.segments import DEFAULT_SEGMENT, SegmentsConfig, load_segments
from drafter.server import load_tokenizer
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


def learn_token_ids(planner: DraftPlanner, segments: SegmentsConfig, token_ids: Sequence[int]) -> None:
    """Teach the planner's corpora the segments of one token sequence."""
    for name, tokens in split_segments(token_ids, segments):
        planner.learn(name, tokens)


def build_corpus(
    files: Iterable[str | Path], tokenizer_dir: str | None, segments_config: str | None, out_dir: str | Path,
    texts: Iterable[str] = (),
) -> dict[str, int]:
    """Add the segments of the text files and of `texts` (after the files') to the corpora in
    out_dir; returns the node count per segment. learn_token_ids() takes token sequences."""
    tokenizer = load_tokenizer(tokenizer_dir)
    segments = load_segments(segments_config, tokenizer)
    planner = DraftPlanner(segments, load_corpora(segments, out_dir))
    all_texts = [Path(path).read_text(encoding="utf-8") for path in files]
    all_texts += list(texts)
    for text in all_texts:
        learn_token_ids(planner, segments, tokenizer.encode(text, add_special_tokens=False))
    save_corpora(planner.corpora, out_dir)
    return {name: corpus.num_entries for name, corpus in planner.corpora.items()}
