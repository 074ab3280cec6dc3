"""The interface the routes reach schedulers through (`SchedulerApi`), and its gRPC client of one scheduler.

`SchedulerApi` is what create_app is given: `open` (the one way a request is sent), `health`, `get_stats` and
`close`. SchedulerClient (here: one scheduler) and SchedulerPool (scheduler_pool.py: several) implement it, and
so do the tests' doubles. What watches a request (metrics, the gRPC API's step sizes) is not a client: it is a
StreamObserver (scheduler_streams.py) that generation.generate_deltas tells what it takes from the stream.

Requests go out as a contract `GenerateRequest` (protos/segserve/v1/generate.py);
the response stream comes back as the contract's events (`TokenChunk`,
`GenerateComplete`, `GenerateError`), converted by its `event_from_pb`. gRPC
failures become a `GenerateError` too, so callers have a single error path.
`open` starts a request and returns its stream of events (scheduler_streams.py);
closing that stream, or the `generate` iterator, before the stream ended (the
HTTP client went away) cancels the request at the scheduler.

All requests of one client share one GenerateStreams call (scheduler_streams.py); a scheduler
without it gets one Generate call per request.
"""

from __future__ import annotations

import abc
import asyncio
import dataclasses
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass

import grpc

from protos.segserve.v1 import common_pb2, scheduler_pb2, scheduler_pb2_grpc
from protos.segserve.v1.generate import GenerateError, GenerateEvent, GenerateRequest, TokenChunk
from protos.segserve.v1.info import Health, WorkerInfo
from protos.segserve.v1.stats import DrafterReplicaStats
from router.scheduler_streams import (
    PumpStream,
    ReadyStream,
    RequestStream,
    SharedCall,
    SharedStream,
    generate_per_request,
)
from router.tenants import current_tenant
from router.traces import traced
from common import tracing
from common.tls import TlsFiles, open_channel


@dataclass(frozen=True)
class SpecTotals:
    """Speculative decoding since the scheduler started (all segment kinds together)."""

    num_drafts: int
    """Sequence-steps that verified a non-empty candidate tree."""
    num_draft_tokens: int
    num_accepted_tokens: int
    num_accepted_by_position: tuple[int, ...]
    """[p]: drafts whose accepted path reached depth p + 1."""
    gate_batch_bucket: int = 0
    """Batch-size bucket of the speculation gate's latest decision (0 = none yet)."""
    is_gate_open: bool = False
    """That decision: speculate at that batch size."""


@dataclass(frozen=True)
class SegmentLoad:
    """Speculative decoding of one segment kind since the scheduler started ("" = not yet known)."""

    segment: str
    num_drafts: int
    num_draft_tokens: int
    num_accepted_tokens: int
    num_budget_nodes: int = 0
    """The policy's latest node budget for the segment kind (0 = drafting off for it)."""
    gate_batch_bucket: int = 0
    """Batch-size bucket of the gate's latest decision for the kind (0 = none yet)."""
    is_gate_open: bool = False
    """The gate's state for the kind at that bucket: it may draft (else only its explorations do)."""

    @property
    def is_drafting(self) -> bool:
        return self.num_budget_nodes > 0


@dataclass(frozen=True)
class SchedulerLoad:
    """The scheduler's GetStats: current load, and counters since it started."""

    num_running: int
    num_waiting: int
    num_used_kv_blocks: int
    num_total_kv_blocks: int
    num_preemptions: int
    spec: SpecTotals
    num_prefix_cache_queries: int = 0
    """Tokens looked up in the prefix cache since start."""
    num_prefix_cache_hits: int = 0
    """Of those, tokens found cached."""
    num_workers: int = 0
    num_live_workers: int = 0
    """Workers the scheduler drives, and how many of them are connected."""
    segments: tuple[SegmentLoad, ...] = ()
    """Speculation per segment kind, by name."""
    drafters: tuple[DrafterReplicaStats, ...] = ()
    """Every drafter replica the scheduler knows, by address."""


def load_from_pb(stats: scheduler_pb2.SchedulerStats) -> SchedulerLoad:
    spec = SpecTotals(stats.spec.num_verified, stats.spec.num_draft_tokens, stats.spec.num_accepted_tokens,
                      tuple(stats.spec.num_accepted_by_depth), stats.spec.gate_batch_bucket, stats.spec.is_drafting)
    segments = tuple(SegmentLoad(s.segment, s.num_verified, s.num_draft_tokens, s.num_accepted_tokens,
                                 s.num_budget_nodes, s.gate_batch_bucket, s.is_gate_open)
                     for s in stats.spec_segments)
    return SchedulerLoad(stats.num_running, stats.num_waiting, stats.num_used_kv_blocks, stats.num_total_kv_blocks,
                         stats.num_preemptions, spec, stats.num_prefix_cache_queries, stats.num_prefix_cache_hits,
                         stats.num_workers, stats.num_live_workers, segments,
                         tuple(DrafterReplicaStats.from_pb(d) for d in stats.drafters))


class SchedulerApi(abc.ABC):
    """What the router reaches its schedulers through: one scheduler (SchedulerClient) or a pool of them
    (scheduler_pool.SchedulerPool)."""

    @abc.abstractmethod
    def open(self, request: GenerateRequest, timeout_s: float | None = None) -> RequestStream:
        """Start one request; its consumer takes its events (the last one a GenerateComplete or a GenerateError)
        from the returned stream and closes it, which cancels a request not ended yet."""

    @abc.abstractmethod
    async def health(self, timeout_s: float = 2.0) -> Health:
        """Readiness (GET /ready); an unreachable scheduler is simply not ready."""

    @abc.abstractmethod
    async def get_stats(self, timeout_s: float = 2.0) -> SchedulerLoad:
        """Current load and counters (GET /metrics, /status); raises when no scheduler answers."""

    @abc.abstractmethod
    async def close(self) -> None:
        """Release the connections; requests still open end with an error event."""

    async def generate(self, request: GenerateRequest, timeout_s: float | None = None
                       ) -> AsyncIterator[GenerateEvent]:
        """`open`'s events one by one, up to and with the terminal one (scripts and benchmarks). Closing the
        iterator before then cancels the request."""
        stream = self.open(request, timeout_s)
        try:
            while True:
                for event in await stream.take():
                    yield event
                    if not isinstance(event, TokenChunk):
                        return
        finally:
            await stream.close()


class SchedulerClient(SchedulerApi):
    """Async client of one scheduler. The channel is opened lazily in the running event loop; with `tls`, mutual
    TLS (server_name: the DNS name the scheduler's certificate carries when `address` is one it resolved to)."""

    def __init__(self, address: str, tls: TlsFiles | None = None, server_name: str | None = None) -> None:
        self.address = address
        self.tls = tls
        self.server_name = server_name
        self._channel: grpc.aio.Channel | None = None
        self._stub: scheduler_pb2_grpc.SchedulerStub | None = None
        self._shared: SharedCall | None = None
        self.is_per_request = False
        """The scheduler answered GenerateStreams with UNIMPLEMENTED: one Generate call per request."""

    def _get_stub(self) -> scheduler_pb2_grpc.SchedulerStub:
        if self._stub is None:
            self._channel = open_channel(self.address, self.tls, server_name=self.server_name)
            self._stub = scheduler_pb2_grpc.SchedulerStub(self._channel)
        return self._stub

    def open(self, request: GenerateRequest, timeout_s: float | None = None) -> RequestStream:
        """SchedulerApi.open; a request without a tenant gets the one its edge set (router/tenants.py), a traced
        one its span's context (router/traces.py)."""
        if not request.tenant:
            request = dataclasses.replace(request, tenant=current_tenant.get())
        if tracing.is_enabled():
            request = traced(request)
        if self.is_per_request:
            return PumpStream(self._generate_per_request(request, timeout_s), request.request_id)
        if self._shared is None or self._shared.is_ended:
            self._shared = SharedCall(self._get_stub(), self._on_shared_end)
        if request.request_id in self._shared.inboxes:
            return ReadyStream([GenerateError("invalid_request", f"request_id: {request.request_id!r} is already live")])
        return SharedStream(self._shared, request, timeout_s, self._generate_per_request)

    def _on_shared_end(self, shared: SharedCall, is_unimplemented: bool) -> None:
        if is_unimplemented:
            self.is_per_request = True
        if self._shared is shared:
            self._shared = None

    def _generate_per_request(self, request: GenerateRequest, timeout_s: float | None
                              ) -> AsyncIterator[GenerateEvent]:
        return generate_per_request(self._get_stub(), request, timeout_s)

    async def get_info(self, timeout_s: float = 5.0) -> WorkerInfo:
        """The served model's facts; raises grpc.aio.AioRpcError when the scheduler does not answer."""
        info = await self._get_stub().GetInfo(scheduler_pb2.SchedulerInfoRequest(), timeout=timeout_s)
        return WorkerInfo.from_pb(info.worker)

    async def get_stats(self, timeout_s: float = 2.0) -> SchedulerLoad:
        """Current load and counters; raises grpc.aio.AioRpcError when the scheduler does not answer."""
        return load_from_pb(await self._get_stub().GetStats(scheduler_pb2.StatsRequest(), timeout=timeout_s))

    async def health(self, timeout_s: float = 2.0) -> Health:
        """The scheduler's readiness; an unreachable scheduler is simply not ready."""
        try:
            reply = await self._get_stub().Health(common_pb2.HealthRequest(), timeout=timeout_s)
        except grpc.aio.AioRpcError as exc:
            return Health(False, f"scheduler unreachable: {exc.code().name}")
        return Health.from_pb(reply)

    async def wait_ready(self, timeout_s: float, retry_interval_s: float = 0.5) -> WorkerInfo:
        """Retry GetInfo until it answers; raise TimeoutError after `timeout_s`."""
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                return await self.get_info(timeout_s=max(0.1, min(5.0, deadline - time.monotonic())))
            except grpc.aio.AioRpcError as exc:
                if time.monotonic() + retry_interval_s >= deadline:
                    raise TimeoutError(
                        f"scheduler at {self.address} did not answer GetInfo within {timeout_s:.0f}s "
                        f"(last error: {exc.code().name})"
                    ) from exc
            await asyncio.sleep(retry_interval_s)

    async def close(self) -> None:
        if self._shared is not None:
            await self._shared.close()
            self._shared = None
        if self._channel is not None:
            await self._channel.close()
        self._channel = self._stub = None
