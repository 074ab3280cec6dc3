"""The scheduler's gRPC client to the drafter replicas; protobuf is converted here and nowhere deeper.

In: DraftQuery dataclasses and ended request ids. Out: {request_id: DraftReply}
for the queries some replica answered in time. Requests are spread over the
replicas by a stable hash of their id, so one replica keeps a request's state.
A replica that fails, runs past the deadline or answers out of shape is left
out of that step and retried after a doubling backoff; failures are logged
once per `_LOG_EVERY`. Nothing here raises to the step loop.
"""

from __future__ import annotations

import asyncio
import logging
import time
import zlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import grpc

from protos.segserve.v1 import drafter_pb2, drafter_pb2_grpc
from protos.segserve.v1.tree import CandidateTree

logger = logging.getLogger(__name__)

_LOG_EVERY = 100
_MAX_BACKOFF_S = 60.0
_MAX_PENDING_FINISHED = 4096


@dataclass(frozen=True)
class DraftQuery:
    """One request's state update and its ask for a tree (drafter.proto's DraftQuery)."""

    request_id: str
    new_token_ids: list[int]
    num_tokens: int
    num_prompt_tokens: int
    max_nodes: int

    def to_pb(self) -> drafter_pb2.DraftQuery:
        return drafter_pb2.DraftQuery(request_id=self.request_id, new_token_ids=self.new_token_ids,
                                      num_tokens=self.num_tokens, num_prompt_tokens=self.num_prompt_tokens,
                                      max_nodes=self.max_nodes)


@dataclass(frozen=True)
class DraftReply:
    """A replica's answer for one query (drafter.proto's DraftReply): a tree, or a request to resend
    the whole sequence. The tree is unchecked: call tree.problem() before using it."""

    tree: CandidateTree
    segment: str = ""
    """The segment kind the request is in."""
    needs_resync: bool = False

    @classmethod
    def from_pb(cls, pb: drafter_pb2.DraftReply) -> DraftReply:
        return cls(CandidateTree.from_pb(pb.tree), pb.segment, pb.needs_resync)


def replica_of(request_id: str, num_replicas: int) -> int:
    """The replica holding request_id's state: stable across processes and restarts."""
    return zlib.crc32(request_id.encode()) % num_replicas


class _Replica:
    def __init__(self, address: str):
        self.address = address
        self.channel = grpc.aio.insecure_channel(address)
        self.stub = drafter_pb2_grpc.DrafterStub(self.channel)
        self.num_failures = 0
        self.num_consecutive_failures = 0
        self.retry_at = 0.0
        self.pending_finished: list[str] = []


class DrafterClient:
    """One channel per replica; create it on the event loop that uses it."""

    def __init__(self, addresses: Sequence[str], timeout_s: float, retry_s: float = 1.0,
                 clock: Callable[[], float] = time.monotonic):
        if not addresses:
            raise ValueError("DrafterClient needs at least one address")
        self.timeout_s = timeout_s
        self.retry_s = retry_s
        self.clock = clock
        self._replicas = [_Replica(address) for address in addresses]

    @property
    def num_failures(self) -> int:
        return sum(r.num_failures for r in self._replicas)

    def is_available(self) -> bool:
        """Whether any replica is out of its backoff."""
        return any(self.clock() >= r.retry_at for r in self._replicas)

    async def draft(self, queries: Sequence[DraftQuery], finished_ids: Sequence[str]) -> dict[str, DraftReply]:
        """One batched call per replica (concurrently), each under the deadline."""
        by_replica: list[list[DraftQuery]] = [[] for _ in self._replicas]
        for query in queries:
            by_replica[replica_of(query.request_id, len(self._replicas))].append(query)
        for request_id in finished_ids:
            replica = self._replicas[replica_of(request_id, len(self._replicas))]
            replica.pending_finished = (replica.pending_finished + [request_id])[-_MAX_PENDING_FINISHED:]
        now = self.clock()
        calls = [self._call(replica, mine) for replica, mine in zip(self._replicas, by_replica)
                 if now >= replica.retry_at and (mine or replica.pending_finished)]
        replies: dict[str, DraftReply] = {}
        for answered in await asyncio.gather(*calls):
            replies.update(answered)
        return replies

    async def _call(self, replica: _Replica, queries: list[DraftQuery]) -> dict[str, DraftReply]:
        finished, replica.pending_finished = replica.pending_finished, []
        request = drafter_pb2.DraftRequest(queries=[q.to_pb() for q in queries], finished_request_ids=finished)
        try:
            response = await replica.stub.Draft(request, timeout=self.timeout_s)
            replies = _replies_from_pb(response, queries)
        except (grpc.aio.AioRpcError, ValueError) as exc:
            replica.pending_finished = (finished + replica.pending_finished)[-_MAX_PENDING_FINISHED:]
            self._record_failure(replica, exc)
            return {}
        replica.num_consecutive_failures = 0
        return replies

    def _record_failure(self, replica: _Replica, exc: Exception) -> None:
        replica.num_failures += 1
        replica.num_consecutive_failures += 1
        backoff = min(_MAX_BACKOFF_S, self.retry_s * 2 ** (replica.num_consecutive_failures - 1))
        replica.retry_at = self.clock() + backoff
        if replica.num_failures % _LOG_EVERY == 1:
            what = f"{exc.code().name}: {exc.details()}" if isinstance(exc, grpc.aio.AioRpcError) else str(exc)
            logger.warning("drafter %s failed (%d failures so far; decoding goes on without it, retry in %.1f s): %s",
                           replica.address, replica.num_failures, backoff, what)

    async def close(self) -> None:
        for replica in self._replicas:
            await replica.channel.close()


def _replies_from_pb(response: drafter_pb2.DraftResponse, queries: list[DraftQuery]) -> dict[str, DraftReply]:
    """Replies by request id; ValueError when the response does not answer the queries one for one."""
    if len(response.replies) != len(queries):
        raise ValueError(f"drafter answered {len(response.replies)} replies for {len(queries)} queries")
    replies = {}
    for query, reply in zip(queries, response.replies):
        if reply.request_id != query.request_id:
            raise ValueError(f"drafter answered request {reply.request_id!r} in the place of {query.request_id!r}")
        replies[query.request_id] = DraftReply.from_pb(reply)
    return replies
