"""The Drafter gRPC servicer: batched Draft (state updates + trees), Health and GetStats.

Protobuf is converted here only, through the contracts the scheduler uses too
(protos/segserve/v1/draft.py): queries arrive as DraftQuery, the proposer's trees leave
in a DraftReply, and Health answers with protos.segserve.v1.info.Health. A tree that fails
CandidateTree.problem() is never sent: the reply carries an empty tree. A batch
expected to take long runs in a worker thread (corpus lookups and any draft model are
CPU work) so that Health stays responsive, a short one on the event loop
(common/blocking.py: the hand-off to a thread costs more than a short batch);
batches are serialized because request states are
single-threaded, and each holds the corpora still (planner.reading()) while the
learner's thread adds learned segments between batches, a slice at a time
(drafter/learner.py). A batch with no tree to build (final updates of ended
requests, or state updates only) is split into pieces of at most
_UPDATE_PIECE_TOKENS tokens, each under the lock on its own, so that a Draft
batch behind it waits for one piece, not for all of them. A Draft call whose metadata
carries a scheduler step's trace context runs in a drafter.draft span under it.
"""

from __future__ import annotations

import asyncio
import logging
import time

import grpc

from drafter.memory import SharedMemory
from drafter.proposer import Proposer
from drafter.state import RequestStates
from protos.segserve.v1 import drafter_pb2, drafter_pb2_grpc
from protos.segserve.v1.draft import DraftQuery, DraftReply
from protos.segserve.v1.info import Health
from protos.segserve.v1.stats import DrafterSegmentStats, DrafterSourceStats, DrafterStats
from protos.segserve.v1.tree import CandidateTree
from common import tracing
from common.blocking import CallCost, run_blocking
from common.health import Serving, status_errors

logger = logging.getLogger(__name__)
_UPDATE_PIECE_TOKENS = 4096


async def _abort(context: grpc.aio.ServicerContext, what: str, exc: Exception) -> None:
    """Unexpected exceptions are INTERNAL (the scheduler then drafts nothing this step)."""
    logger.error("drafter %s failed", what, exc_info=exc)
    await context.abort(grpc.StatusCode.INTERNAL, f"{type(exc).__name__}: {exc}")


_status_errors = status_errors(_abort)


class DrafterServicer(drafter_pb2_grpc.DrafterServicer):
    """Serves a Proposer over per-request states."""

    def __init__(self, planner: Proposer, states: RequestStates,
                 memory: SharedMemory | None = None):
        self.planner = planner
        """The proposer: segment corpora (DraftPlanner), or SuffixDecoding's trees (SuffixPlanner)."""
        self.states = states
        self.memory = memory
        """The shared log and snapshots (drafter/memory.py); its learn() is the states' sink."""
        self._lock = asyncio.Lock()
        self.cost = CallCost()
        """Where draft calls run (common/blocking.py: on the loop when short), by queries."""
        self.serving = Serving([drafter_pb2.DESCRIPTOR.services_by_name["Drafter"].full_name])
        """The standard grpc.health.v1 status: SERVING while the server takes requests (start_server)."""
        self.num_draft_calls = 0

    async def set_serving(self, is_serving: bool) -> None:
        """Report the server and the Drafter as SERVING or NOT_SERVING."""
        await self.serving.set(is_serving)

    @_status_errors
    async def Draft(self, request, context):
        self.num_draft_calls += 1
        queries = [DraftQuery.from_pb(q) for q in request.queries]
        finished = list(request.finished_request_ids)
        replies = []
        parent = tracing.from_call(context)  # a traced step's scheduler span
        with tracing.span("drafter.draft", parent, attributes={"segserve.num_queries": len(queries)}):
            for piece, piece_finished in _pieces(queries, finished):
                async with self._lock:
                    piece_replies, _ = await run_blocking(self.cost, len(piece), self.draft_batch, piece,
                                                          piece_finished)
                replies += piece_replies
        return drafter_pb2.DraftResponse(replies=replies)

    @_status_errors
    async def Health(self, request, context):
        return Health(is_ready=True).to_pb()  # corpora and draft models load before the server starts

    @_status_errors
    async def GetStats(self, request, context):
        async with self._lock:  # the states and corpora change inside Draft's thread
            return self.stats().to_pb()

    def stats(self) -> DrafterStats:
        """Corpus sizes per segment kind (the schema kind's once it holds a corpus or a request), the tracked
        requests, Draft calls and the process's CPU time: counters, no corpus walk."""
        requests = self.states.count_by_segment()
        entries, num_bytes = self.planner.corpus_sizes()
        learned = self.planner.num_learned_tokens
        names = sorted({*entries, *requests})
        segments = tuple(DrafterSegmentStats(name, entries[name], num_bytes[name], requests[name], learned[name],
                                             tuple(DrafterSourceStats(role, judged, matched) for role, (judged, matched)
                                                   in self.planner.source_stats(name).items()))
                         for name in names)  # fmt: skip
        return DrafterStats(segments, len(self.states), self.num_draft_calls, time.process_time(),
                            self.planner.backend)

    async def sync_memory(self) -> int:
        """Apply what other replicas published (between Draft calls); returns the records read."""
        if self.memory is None:
            return 0
        async with self._lock:
            return await asyncio.to_thread(self.memory.poll)

    async def snapshot(self) -> None:
        """Snapshot the corpora and the log position (between Draft calls)."""
        if self.memory is not None:
            async with self._lock:
                await asyncio.to_thread(self.memory.snapshot)

    def draft_batch(self, queries: list[DraftQuery], finished: list[str]) -> list[drafter_pb2.DraftReply]:
        """Drop finished requests, then update and draft each query in order: one reply per query."""
        for request_id in finished:
            self.states.drop(request_id)
            self.planner.release(request_id)
        with self.planner.reading():
            return [self._finish_one(q) if q.is_final else self._draft_one(q) for q in queries]

    def _finish_one(self, query: DraftQuery) -> drafter_pb2.DraftReply:
        """A request's last tokens: learn what they close, forget the request."""
        final = self.states.finish(query.request_id, query.new_token_ids, query.num_tokens, query.num_prompt_tokens,
                                   query.num_known_tokens, query.tenant, query.corpus_key)
        self.planner.release(query.request_id, final)
        return DraftReply(needs_resync=final is None).to_pb(query.request_id)

    def _draft_one(self, query: DraftQuery) -> drafter_pb2.DraftReply:
        """Update the request's state, then its tree (or needs_resync with no tree)."""
        state = self.states.update(query.request_id, query.new_token_ids, query.num_tokens, query.num_prompt_tokens,
                                   query.num_known_tokens, query.tenant, query.corpus_key)
        if state is None:
            return DraftReply(needs_resync=True).to_pb(query.request_id)
        tree, segment = self.planner.draft(state, query.max_nodes, query.min_node_prob)
        problem = tree.problem(max_nodes=query.max_nodes)
        if problem is not None:  # never send garbage; an empty tree just means no speculation
            logger.error("dropping an invalid tree for %s: %s", query.request_id, problem)
            tree = CandidateTree()
        reply = DraftReply(tree, segment, marker_token_ids=self.planner.segments.marker_token_ids)
        return reply.to_pb(query.request_id)


def _pieces(queries: list[DraftQuery], finished: list[str]) -> list[tuple[list[DraftQuery], list[str]]]:
    """The batch as one piece when it asks for a tree; else pieces of at most _UPDATE_PIECE_TOKENS new tokens
    (a query is never split), the finished ids with the first."""
    if not queries or any(not q.is_update_only for q in queries):
        return [(queries, finished)]
    pieces: list[tuple[list[DraftQuery], list[str]]] = [([], finished)]
    num_tokens = 0
    for query in queries:
        if pieces[-1][0] and num_tokens + len(query.new_token_ids) > _UPDATE_PIECE_TOKENS:
            pieces.append(([], []))
            num_tokens = 0
        pieces[-1][0].append(query)
        num_tokens += len(query.new_token_ids)
    return pieces
