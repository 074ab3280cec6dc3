"""The fake drafter of the scheduler's tests: `FakeDrafter` implements the Speculator's Drafter protocol. It tracks
each request's tokens like the real drafter and proposes trees whose main chain follows the rule
(tests/support/fakes.py) for `num_right` nodes; `mode` scripts its failures. tests/support/fake_services.py serves
it over gRPC."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

from protos.segserve.v1.draft import DraftQuery, DraftReply
from protos.segserve.v1.stats import DrafterSegmentStats, DrafterStats
from protos.segserve.v1.tree import ROOT, CandidateTree
from tests.support.fakes import Rule


class FakeDrafter:
    """Tracks each request's tokens like a drafter; proposes a tree whose main chain follows the rule.

    The chain is right for `num_right` nodes, then wrong; a wrong sibling hangs
    at depth 1. `mode` scripts failures: "ok", "empty", "down" (answers
    nothing), "raise", "oov", "bad_parents", "too_many", "forget" (loses all
    state at its third call, so every request must resync).
    """

    def __init__(self, rule: Rule, vocab_size: int, num_right: int = 3, segment: str = "code"):
        self.rule = rule
        self.vocab_size = vocab_size
        self.num_right = num_right
        self.segment = segment
        self.mode = "ok"
        self.delay_s = 0.0
        self.state: dict[str, list[int]] = {}
        self.finished: list[str] = []
        """Every released request id, in order (a duplicate = released twice), by a final update or a finished id."""
        self.finals: dict[str, list[int]] = {}
        """Request id -> the whole sequence its final update completed."""
        self.num_resyncs = 0
        self.num_calls = 0
        self.markers: dict[int, str] = {}
        """Segment marker token -> the segment a request is in from it on (until the next marker)."""

    async def draft(self, queries: Sequence[DraftQuery], finished_ids: Sequence[str]) -> dict[str, DraftReply]:
        if self.delay_s:
            await asyncio.sleep(self.delay_s)
        return self.draft_sync(queries, finished_ids)

    def draft_sync(self, queries: Sequence[DraftQuery], finished_ids: Sequence[str]) -> dict[str, DraftReply]:
        self.num_calls += 1
        if self.mode == "raise":
            raise RuntimeError("injected drafter bug")
        if self.mode == "down":
            return {}
        if self.mode == "forget" and self.num_calls >= 3:
            self.state.clear()
            self.mode = "ok"
        replies = {q.request_id: self._answer(q) for q in queries}
        for request_id in finished_ids:
            self.finished.append(request_id)
            self.state.pop(request_id, None)
        return replies

    def _answer(self, query: DraftQuery) -> DraftReply:
        tokens = self.state.get(query.request_id, []) + list(query.new_token_ids)
        if len(tokens) != query.num_tokens and query.is_final and len(query.new_token_ids) == query.num_tokens:
            tokens = list(query.new_token_ids)  # a final update may carry the whole sequence
        if len(tokens) != query.num_tokens:
            self.state.pop(query.request_id, None)
            self.num_resyncs += 1
            return DraftReply(CandidateTree(), needs_resync=True)
        if query.is_final:  # the request ended: its whole sequence, then its state goes
            self.finals[query.request_id] = tokens
            self.finished.append(query.request_id)
            self.state.pop(query.request_id, None)
            return DraftReply(CandidateTree())
        self.state[query.request_id] = tokens
        segment = next((self.markers[t] for t in reversed(tokens) if t in self.markers), self.segment)
        return DraftReply(self._tree(tokens, query.max_nodes), segment, marker_token_ids=tuple(self.markers))

    def _tree(self, tokens: list[int], max_nodes: int) -> CandidateTree:
        if self.mode == "empty" or max_nodes == 0:
            return CandidateTree()
        chain, context = [], list(tokens)
        for depth in range(max_nodes - 1):
            right = self.rule(context)
            chain.append(right if depth < self.num_right else (right + 1) % self.vocab_size)
            context.append(chain[-1])
        token_ids = [(self.rule(tokens) + 5) % self.vocab_size] + chain  # a wrong sibling first, then the chain
        parents = [ROOT, ROOT] + list(range(1, len(chain)))
        token_ids, parents = token_ids[:max_nodes], parents[:max_nodes]
        if self.mode == "oov":
            token_ids[-1] = self.vocab_size + 3
        elif self.mode == "bad_parents":
            parents[0] = len(parents)
        elif self.mode == "too_many":
            token_ids, parents = token_ids + [1] * 50, parents + [ROOT] * 50
        return CandidateTree(tuple(token_ids), tuple(parents))

    def stats(self) -> DrafterStats:
        """Its GetStats answer: its one segment kind, whose "corpus" is every token it holds (10 bytes each)."""
        num_tokens = sum(len(tokens) for tokens in self.state.values())
        return DrafterStats((DrafterSegmentStats(self.segment, num_tokens, 10 * num_tokens, len(self.state)),),
                            len(self.state))
