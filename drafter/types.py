"""Shared drafting types: what a continuation source proposes and the tree built from it.

Every source (lookup corpus, the request's own history, a draft model) returns
`Continuation`s; a tree builder (drafter/trees.py) merges them into a `DraftTree`
rooted at the context's last token.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol, Sequence, runtime_checkable


@dataclass(frozen=True)
class Continuation:
    """A predicted run of tokens following a context."""

    token_ids: tuple[int, ...]
    """Predicted tokens following the context, nearest first."""
    score: float
    """Higher = more likely (a frequency for corpora, a probability for draft models)."""


class ContinuationSource(Protocol):
    """Anything that can guess how a context continues."""

    def propose(self, context: Sequence[int], max_len: int, max_candidates: int) -> list[Continuation]:
        """At most `max_candidates` continuations of at most `max_len` tokens, best first."""
        ...


@runtime_checkable
class RequestAwareSource(Protocol):
    """A source that keeps per-request state (a draft model's KV cache); the planner prefers these calls."""

    def propose_for(
        self, request_id: str, context: Sequence[int], max_len: int, max_candidates: int
    ) -> list[Continuation]:
        """Like propose, reusing what was computed for this request's earlier contexts."""
        ...

    def release(self, request_id: str) -> None:
        """Forget a finished request."""
        ...


@dataclass
class DraftTree:
    """Draft tokens in topological order; the root (the context's last token) is implicit.

    Invariant: parents[i] == -1 (a child of the root) or 0 <= parents[i] < i.
    """

    token_ids: list[int] = field(default_factory=list)
    """Draft tokens, a parent always before its children."""
    parents: list[int] = field(default_factory=list)
    """Parent index of each token: -1 = the root, else an index smaller than its own."""

    def __len__(self) -> int:
        return len(self.token_ids)

    @property
    def depths(self) -> list[int]:
        """Depth of each node: the root's children have depth 1."""
        depths: list[int] = []
        for parent in self.parents:
            depths.append(1 if parent < 0 else depths[parent] + 1)
        return depths

    def is_valid(self) -> bool:
        """True when lengths agree and every parent precedes its child."""
        if len(self.token_ids) != len(self.parents):
            return False
        return all(-1 <= p < i for i, p in enumerate(self.parents))
