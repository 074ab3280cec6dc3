"""`segserve corpus build`: text files and data-reflow logs in, drafter corpora out.

The drafter builds corpora from plain texts (drafter/build.py); reading the
reflow logs is offline tooling and stays here, so that the drafter service never
imports the router's packages. From reflow logs the texts are what the model
wrote (segserve.reflow.export.generated_texts): each completed turn's completion
prompt plus its response (the prompt may open the segment the response
continues), or a chat turn's response alone (the chat template's turn markers
are not in the log, so a chat reply counts as text outside a turn).
"""

from __future__ import annotations

from pathlib import Path
from typing import Iterable, Iterator


def reflow_texts(reflow_dirs: Iterable[str | Path]) -> Iterator[str]:
    """The generated texts of every reflow log directory, in order."""
    from segserve.reflow.export import generated_texts

    for sink_dir in reflow_dirs:
        yield from generated_texts(sink_dir)


def build_corpus(
    files: Iterable[str | Path], tokenizer_dir: str | None, segments_config: str | None, out_dir: str | Path,
    reflow_dirs: Iterable[str | Path] = (),
) -> dict[str, int]:
    """Add the segments of the files and of the reflow logs' turns to the corpora in out_dir;
    returns the node count per segment."""
    from drafter.build import build_corpus as build_from_texts

    return build_from_texts(files, tokenizer_dir, segments_config, out_dir, reflow_texts(reflow_dirs))
