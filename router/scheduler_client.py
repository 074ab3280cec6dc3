"""The router's gRPC client of the Scheduler service: the one place protobuf is touched.

Requests go out as a contract `GenerateRequest` (protos/segserve/v1/generate.py);
the response stream comes back as the contract's events (`TokenChunk`,
`GenerateComplete`, `GenerateError`), converted by its `event_from_pb`. gRPC
failures become a `GenerateError` too, so callers have a single error path.
Closing the `generate` iterator before the stream ended (the HTTP client went
away) cancels the request at the scheduler.

All requests of one client share one GenerateStreams call (opened lazily in the
running loop): requests go out as start/cancel actions, and each response holds
a whole step's events for every request, which one reader task hands to the
requests' inboxes (one gRPC message per step instead of one per request and
step). When that call fails, every request on it ends with the mapped error and
the next request opens a new call; a scheduler without GenerateStreams
(UNIMPLEMENTED) gets one Generate call per request from then on.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

import grpc

from protos.segserve.v1 import common_pb2, scheduler_pb2, scheduler_pb2_grpc
from protos.segserve.v1.generate import (
    CancelStream,
    GenerateError,
    GenerateEvent,
    GenerateRequest,
    StartStream,
    TokenChunk,
    event_from_pb,
)
from protos.segserve.v1.info import Health, WorkerInfo
from protos.segserve.v1.stats import DrafterReplicaStats
from router.tenants import current_tenant
from segserve.tls import TlsFiles, open_channel

# gRPC status -> the failure codes the router maps to HTTP statuses (errors.py).
_FAILURE_CODES = {
    grpc.StatusCode.INVALID_ARGUMENT: "invalid_request",
    grpc.StatusCode.RESOURCE_EXHAUSTED: "overloaded",
    grpc.StatusCode.UNAVAILABLE: "unavailable",
    grpc.StatusCode.DEADLINE_EXCEEDED: "timeout",
    grpc.StatusCode.CANCELLED: "cancelled",
}


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


class SchedulerClient:
    """Async client of one scheduler. The channel is opened lazily in the running event loop; with `tls`, mutual
    TLS (server_name: the DNS name the scheduler's certificate carries when `address` is one it resolved to)."""

    def __init__(self, address: str, tls: TlsFiles | None = None, server_name: str | None = None) -> None:
        self.address = address
        self.tls = tls
        self.server_name = server_name
        self._channel: grpc.aio.Channel | None = None
        self._stub: scheduler_pb2_grpc.SchedulerStub | None = None
        self._shared: _SharedCall | None = None
        self.is_per_request = False
        """The scheduler answered GenerateStreams with UNIMPLEMENTED: one Generate call per request."""

    def _get_stub(self) -> scheduler_pb2_grpc.SchedulerStub:
        if self._stub is None:
            self._channel = open_channel(self.address, self.tls, server_name=self.server_name)
            self._stub = scheduler_pb2_grpc.SchedulerStub(self._channel)
        return self._stub

    async def generate(
        self, request: GenerateRequest, timeout_s: float | None = None
    ) -> AsyncIterator[GenerateEvent]:
        """Stream one request's events; the last one is a GenerateComplete or a GenerateError. A request without a
        tenant gets the one its edge set (router/tenants.py)."""
        if not request.tenant:
            request = dataclasses.replace(request, tenant=current_tenant.get())
        if self.is_per_request:
            async with contextlib.aclosing(self._generate_per_request(request, timeout_s)) as events:
                async for event in events:
                    yield event
            return
        # On the shared call. The deadline is the scheduler's and this side's too (one timer), so that a stuck
        # connection still ends the request.
        if self._shared is None or self._shared.is_ended:
            self._shared = _SharedCall(self._get_stub(), self._on_shared_end)
        shared = self._shared
        request_id = request.request_id
        if request_id in shared.inboxes:
            yield GenerateError("invalid_request", f"request_id: {request_id!r} is already live")
            return
        loop = asyncio.get_running_loop()
        started_s = loop.time()
        inbox = shared.start(request, timeout_s)
        timer = loop.call_later(timeout_s, inbox.put, _DEADLINE) if timeout_s else None
        is_ended = False
        try:
            while True:
                for event in await inbox.take():
                    if isinstance(event, TokenChunk):
                        yield event
                        continue
                    if event is _UNIMPLEMENTED:  # nothing was sent for it: go on the old way
                        is_ended = True
                        remaining_s = max(0.001, timeout_s - (loop.time() - started_s)) if timeout_s else None
                        async with contextlib.aclosing(self._generate_per_request(request, remaining_s)) as events:
                            async for fallback_event in events:
                                yield fallback_event
                        return
                    if event is _DEADLINE:
                        yield GenerateError("timeout", f"scheduler: no result within the deadline of {timeout_s:g} s")
                        return
                    is_ended = True  # before the yield: a consumer that stops at the end cancels nothing
                    yield event
                    return
        finally:
            if timer is not None:
                timer.cancel()
            shared.forget(request_id, is_cancelled=not is_ended)

    def _on_shared_end(self, shared: _SharedCall, is_unimplemented: bool) -> None:
        if is_unimplemented:
            self.is_per_request = True
        if self._shared is shared:
            self._shared = None

    async def _generate_per_request(self, request: GenerateRequest, timeout_s: float | None
                                    ) -> AsyncIterator[GenerateEvent]:
        """The request as its own Generate call (a scheduler without GenerateStreams)."""
        call = self._get_stub().Generate(request.to_pb(), timeout=timeout_s or None)
        try:
            terminal: GenerateEvent | None = None
            # Read to the end of the stream before yielding the terminal event: a
            # consumer that stops right after it must not cancel a finished call.
            async for response in call:
                event = event_from_pb(response)
                if terminal is not None:
                    continue
                if isinstance(event, TokenChunk):
                    yield event
                else:
                    terminal = event
            yield terminal or GenerateError("internal", "the scheduler ended the stream without a result")
        except grpc.aio.AioRpcError as exc:
            code = _FAILURE_CODES.get(exc.code(), "internal")
            yield GenerateError(code, f"scheduler: {exc.details() or exc.code().name}")
        finally:
            if not call.done():
                call.cancel()

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


_UNIMPLEMENTED = object()
"""In an inbox: the scheduler has no GenerateStreams (nothing was sent for the request)."""
_DEADLINE = object()
"""In an inbox: the request's deadline passed on this side."""


class _Inbox:
    """One request's events from the shared call, handed over all at once: one future per wait."""

    __slots__ = ("events", "waiter")

    def __init__(self) -> None:
        self.events: list = []
        self.waiter: asyncio.Future | None = None

    def put(self, event) -> None:
        self.events.append(event)
        waiter = self.waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    async def take(self) -> list:
        """Every event not taken yet, waiting for one if there is none."""
        if not self.events:
            self.waiter = asyncio.get_running_loop().create_future()
            try:
                await self.waiter
            finally:
                self.waiter = None
        events, self.events = self.events, []
        return events


class _SharedCall:
    """One GenerateStreams call: actions go out through a queue that the call reads, and one reader task puts
    each response's events into their requests' inboxes. When the call ends, every request still on it gets
    the failure (or _UNIMPLEMENTED) and `on_end` is told."""

    def __init__(self, stub: scheduler_pb2_grpc.SchedulerStub,
                 on_end: Callable[[_SharedCall, bool], None]) -> None:
        self.inboxes: dict[str, _Inbox] = {}
        self.is_ended = False
        self._on_end = on_end
        self._actions: asyncio.Queue = asyncio.Queue()
        self._call = stub.GenerateStreams(self._send())
        self._reader = asyncio.get_running_loop().create_task(self._read(), name="segserve-scheduler-streams")

    def start(self, request: GenerateRequest, timeout_s: float | None) -> _Inbox:
        inbox = self.inboxes[request.request_id] = _Inbox()
        self._actions.put_nowait(StartStream(request, timeout_s).to_pb())
        return inbox

    def forget(self, request_id: str, is_cancelled: bool) -> None:
        """The request's consumer is done with it; `is_cancelled`: before its end, so abort it at the scheduler."""
        self.inboxes.pop(request_id, None)
        if is_cancelled and not self.is_ended:
            self._actions.put_nowait(CancelStream(request_id).to_pb())

    async def close(self) -> None:
        self._reader.cancel()
        await asyncio.gather(self._reader, return_exceptions=True)

    async def _send(self) -> AsyncIterator[scheduler_pb2.StreamsRequest]:
        # Nothing goes out before the scheduler's initial metadata (it sends them at once): a write racing a
        # scheduler that refuses the call (UNIMPLEMENTED) would turn its status into an INTERNAL error.
        await self._call.initial_metadata()
        if self._call.done():
            return
        while True:
            yield await self._actions.get()

    async def _read(self) -> None:
        failure: object = GenerateError("unavailable", "scheduler: the scheduler ended the call")
        try:
            async for response in self._call:
                inboxes = self.inboxes
                for pb in response.events:
                    inbox = inboxes.get(pb.request_id)
                    if inbox is not None:
                        inbox.put(event_from_pb(pb.event))
        except grpc.aio.AioRpcError as exc:
            if exc.code() == grpc.StatusCode.UNIMPLEMENTED:
                failure = _UNIMPLEMENTED
            else:
                failure = GenerateError(_FAILURE_CODES.get(exc.code(), "internal"),
                                        f"scheduler: {exc.details() or exc.code().name}")
        except asyncio.CancelledError:
            failure = GenerateError("unavailable", "scheduler: the client was closed")
            raise
        finally:
            self.is_ended = True
            self._call.cancel()
            self._on_end(self, failure is _UNIMPLEMENTED)
            for inbox in self.inboxes.values():
                inbox.put(failure)
