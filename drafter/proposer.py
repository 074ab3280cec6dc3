"""Proposer: what the Drafter service (drafter/service.py) drafts with.

A proposer turns a request's state into a candidate tree: segserve's segment corpora
(drafter/planner.py's DraftPlanner) or SuffixDecoding (drafter/suffix.py's SuffixPlanner),
chosen by `--drafter-backend`, behind one service.
"""

from __future__ import annotations

from collections import Counter
from contextlib import AbstractContextManager
from typing import Protocol, runtime_checkable

from drafter.segments import SegmentsConfig
from drafter.state import RequestState
from protos.segserve.v1.tree import CandidateTree


@runtime_checkable
class Proposer(Protocol):
    """What the Drafter service (drafter/service.py) drafts with; holds corpora, no network."""

    backend: str
    """The name `--drafter-backend` gives it (DrafterStats.backend)."""
    segments: SegmentsConfig
    """The segment kinds a request's tree is labelled with, and their markers (sent with every reply)."""
    num_learned_tokens: Counter[str]
    """Tokens learned per segment kind since start."""

    def draft(self, state: RequestState, max_nodes: int, min_node_prob: float = 0.0) -> tuple[CandidateTree, str]:
        """The request's tree within max_nodes (no node less likely than min_node_prob, where the proposer
        applies the price) and its segment kind."""
        ...

    def release(self, request_id: str, final: RequestState | None = None) -> None:
        """A request ended (`final`: its last state, when it ended with a final update)."""
        ...

    def reading(self) -> AbstractContextManager:
        """Hold the corpora still while drafting or saving."""
        ...

    def wait_learned(self, timeout_s: float | None = None) -> bool:
        """Wait until everything queued for learning is learned; False on timeout."""
        ...

    def corpus_sizes(self) -> tuple[Counter[str], Counter[str]]:
        """Entries and bytes per segment kind (every kind it holds a corpus for, empty ones too)."""
        ...

    def source_stats(self, kind: str) -> dict[str, tuple[int, int]]:
        """Per source of the kind: (tokens of its proposals judged, those that matched); empty if none judged."""
        ...
