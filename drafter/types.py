"""Drafting-internal types: what a continuation source proposes.

Every source (lookup corpus, the request's own history, a draft model) returns
`Continuation`s; a tree builder (drafter/trees.py) merges them into a
protos.segserve.v1.tree.CandidateTree rooted at the context's last token.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cache
from typing import Protocol, Sequence, runtime_checkable


@dataclass(frozen=True)
class Continuation:
    """A predicted run of tokens following a context."""

    token_ids: tuple[int, ...]
    """Predicted tokens following the context, nearest first."""
    score: float
    """Higher = more likely (a frequency for corpora, a probability for draft models)."""
    match_len: int = 0
    """Tokens of the context a lookup matched to find it (0: not a lookup, e.g. a draft model's)."""


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


def is_request_aware(source: object) -> bool:
    """isinstance(source, RequestAwareSource), decided once per class: the Protocol's runtime check walks its
    members on every call, and drafting asks it of every source of every query."""
    return _is_request_aware_class(type(source))


@cache
def _is_request_aware_class(cls: type) -> bool:
    return issubclass(cls, RequestAwareSource)
