"""Offline corpus building (`segserve corpus build`): texts (or token sequences) in, saved corpora out.

Each text is tokenized and split as a request's output is online (drafter/state.py's
split_segments): every closed segment goes to its kind's corpus, each run of two tokens
or more outside every segment to the default corpus, and a segment still open at the
end to its kind's. Existing corpora in out_dir are extended, not replaced. The texts are
text files' contents and whatever texts the caller passes; reading them from
data-reflow logs is segserve's job (segserve/corpus_build.py), not the drafter's.
"""

from __future__ import annotations

from pathlib import Path
from typing import Iterable, Sequence

from drafter.memory import load_corpora, save_corpora
from drafter.planner import DraftPlanner
from drafter.segments import SegmentsConfig, load_segments
from drafter.server import load_tokenizer
from drafter.state import split_segments


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
