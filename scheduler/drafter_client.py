"""The scheduler's gRPC client to the drafter replicas; protobuf is converted here and nowhere deeper.

In: DraftQuery dataclasses and ended request ids. Out: {request_id: DraftReply}
for the queries some replica answered in time.

Replicas: the targets are addresses or `dns:///name:port` names re-resolved every
`refresh_s` (scheduler/discovery.py), so replicas can join and leave while it runs.
Requests are placed by rendezvous hashing over the LIVE replicas (those not backing
off after a failure): a joining replica takes over about 1/n of the requests and
the others keep theirs. A request that lands on a replica without its state (it
moved, or the replica restarted) gets needs_resync, the speculator sends it all its
tokens again, and it decodes without speculation until then; the replica it left
is told to drop it. A replica that fails, runs past the deadline or answers out of
shape is left out and retried after a doubling backoff; failures are logged once
per `_LOG_EVERY`. Nothing here raises to the step loop.

A call that asks for no tree (state updates only, final updates of ended requests, sent off
the step's path) runs under the longer `update_timeout_s`. A final query goes to the replica
holding the request's state, which then forgets it (no finished id needed).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Sequence

import grpc

from protos.segserve.v1 import drafter_pb2, drafter_pb2_grpc
from protos.segserve.v1.draft import DraftQuery, DraftReply
from protos.segserve.v1.stats import DrafterReplicaStats, DrafterStats
from common import tracing
from common.backoff import Backoff
from common.discovery import is_dns_target, membership_changes, rendezvous
from common.tls import TlsFiles, open_channel

logger = logging.getLogger(__name__)

_LOG_EVERY = 100
_MAX_BACKOFF_S = 60.0
_MAX_PENDING_FINISHED = 4096


class _Replica:
    def __init__(self, address: str, tls: TlsFiles | None, server_name: str | None = None):
        self.address = address
        self.channel = open_channel(address, tls, server_name=server_name)
        self.stub = drafter_pb2_grpc.DrafterStub(self.channel)
        self.num_failures = 0
        self.num_consecutive_failures = 0
        self.retry_at = 0.0
        self.pending_finished: list[str] = []

    def release(self, request_ids: Sequence[str]) -> None:
        """Tell this replica, with its next call, that it may drop these requests."""
        self.pending_finished = (self.pending_finished + list(request_ids))[-_MAX_PENDING_FINISHED:]


class DrafterClient:
    """One channel per replica (mutual TLS with `tls`); create it on the event loop that uses it."""

    def __init__(self, targets: Sequence[str], timeout_s: float, retry_s: float = 1.0,
                 clock: Callable[[], float] = time.monotonic, refresh_s: float = 10.0, tls: TlsFiles | None = None,
                 update_timeout_s: float = 2.0):
        if not targets:
            raise ValueError("DrafterClient needs at least one address")
        self.targets = list(targets)
        self.timeout_s = timeout_s
        self.update_timeout_s = max(update_timeout_s, timeout_s)
        """Deadline of a call that asks for no tree (it is off the step's path)."""
        self.retry_s = retry_s
        self.backoff = Backoff(min(retry_s, _MAX_BACKOFF_S), _MAX_BACKOFF_S)
        """A failed replica's wait before it is tried again, doubling per consecutive failure."""
        self.clock = clock
        self.refresh_s = refresh_s
        self.tls = tls
        self._replicas: dict[str, _Replica] = {}
        self._next_refresh = 0.0
        if not any(is_dns_target(t) for t in self.targets):
            self._replicas = {a: _Replica(a, tls) for a in sorted(set(self.targets))}
            self._next_refresh = float("inf")  # nothing to resolve
        self._owners: dict[str, str] = {}
        """Request id -> the replica its last query went to (the one holding its state)."""
        self.num_moved = 0
        """Requests whose replica changed (a replica left, joined or backs off)."""

    @property
    def num_failures(self) -> int:
        return sum(r.num_failures for r in self._replicas.values())

    @property
    def addresses(self) -> list[str]:
        """The replicas known now."""
        return sorted(self._replicas)

    def is_available(self) -> bool:
        """Whether any replica is out of its backoff (before the first resolution: whether any target exists)."""
        if not self._replicas:
            return self._next_refresh <= self.clock()
        return any(self.clock() >= r.retry_at for r in self._replicas.values())

    def owner_of(self, request_id: str) -> str | None:
        """The replica holding request_id's state, as far as this client knows."""
        return self._owners.get(request_id)

    async def draft(self, queries: Sequence[DraftQuery], finished_ids: Sequence[str]) -> dict[str, DraftReply]:
        """One batched call per live replica (concurrently), each under the deadline."""
        await self._refresh()
        for request_id in finished_ids:
            owner = self._replicas.get(self._owners.pop(request_id, ""))
            if owner is not None:
                owner.release([request_id])
        now = self.clock()
        live = [address for address, replica in self._replicas.items() if now >= replica.retry_at]
        by_replica: dict[str, list[DraftQuery]] = {address: [] for address in live}
        if live:
            for query in queries:
                by_replica[self._place(query.request_id, live)].append(query)
                if query.is_final:  # the replica forgets it on its own
                    self._owners.pop(query.request_id, None)
        calls = [self._call(self._replicas[address], mine) for address, mine in by_replica.items()
                 if mine or self._replicas[address].pending_finished]
        replies: dict[str, DraftReply] = {}
        for answered in await asyncio.gather(*calls):
            replies.update(answered)
        return replies

    async def replica_stats(self, timeout_s: float = 0.5) -> list[DrafterReplicaStats]:
        """Every known replica by address: live or backing off, and its GetStats asked now (all at once, each
        under timeout_s; None where it did not answer). Only Draft calls decide backoff, never this."""
        replicas = sorted(self._replicas.items())
        answers = await asyncio.gather(*(_get_stats(replica, timeout_s) for _, replica in replicas))
        now = self.clock()
        return [DrafterReplicaStats(address, now >= replica.retry_at, stats)
                for (address, replica), stats in zip(replicas, answers)]

    def _place(self, request_id: str, live: list[str]) -> str:
        """The live replica for request_id; when it differs from the last one, the last one drops it."""
        address = rendezvous(request_id, live)
        previous = self._owners.get(request_id)
        if previous != address:
            if previous is not None:
                self.num_moved += 1
                if previous in self._replicas:
                    self._replicas[previous].release([request_id])
            self._owners[request_id] = address
        return address

    async def _refresh(self) -> None:
        """Resolve the targets again when it is time; add the new replicas, close the gone ones."""
        if self.clock() < self._next_refresh:
            return
        self._next_refresh = self.clock() + self.refresh_s
        joined, left = await membership_changes(self.targets, self._replicas)
        for address, name in joined.items():
            self._replicas[address] = _Replica(address, self.tls, name)
            logger.info("drafter replica %s joined (%d replicas)", address, len(self._replicas))
        for address in left:
            replica = self._replicas.pop(address)
            await replica.channel.close()
            logger.info("drafter replica %s left (%d replicas)", address, len(self._replicas))

    async def _call(self, replica: _Replica, queries: list[DraftQuery]) -> dict[str, DraftReply]:
        finished, replica.pending_finished = replica.pending_finished, []
        request = drafter_pb2.DraftRequest(queries=[q.to_pb() for q in queries], finished_request_ids=finished)
        is_update_only = all(q.is_update_only for q in queries)
        try:  # a traced step's span goes in the metadata (common/tracing.py; None: none)
            response = await replica.stub.Draft(request, timeout=self.update_timeout_s if is_update_only
                                                else self.timeout_s, metadata=tracing.grpc_metadata())
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
        backoff = self.backoff.delay_s(replica.num_consecutive_failures)
        replica.retry_at = self.clock() + backoff
        if replica.num_failures % _LOG_EVERY == 1:
            what = f"{exc.code().name}: {exc.details()}" if isinstance(exc, grpc.aio.AioRpcError) else str(exc)
            logger.warning("drafter %s failed (%d failures so far; decoding goes on without it, retry in %.1f s): %s",
                           replica.address, replica.num_failures, backoff, what)

    async def close(self) -> None:
        for replica in self._replicas.values():
            await replica.channel.close()


async def _get_stats(replica: _Replica, timeout_s: float) -> DrafterStats | None:
    try:
        return DrafterStats.from_pb(await replica.stub.GetStats(drafter_pb2.DrafterStatsRequest(), timeout=timeout_s))
    except grpc.aio.AioRpcError:
        return None


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
