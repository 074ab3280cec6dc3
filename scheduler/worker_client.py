"""The scheduler's gRPC client to the worker; protobuf is converted here (by the contract types) only.

In: a StepRequest. Out: WorkerInfo, StepResult and Health (protos/segserve/v1).
Every RPC failure surfaces as WorkerError carrying the gRPC status name; the
engine decides from it whether the step is retried (worker/engine faults) or
its requests fail (the worker unreachable).

Steps go over one Worker.StepStream where the worker serves it (WorkerInfo.step_stream), else a Step call
each. A call costs more than a message on a stream: in a scratch loop of 2,000 round trips of a 300-byte
message between two grpc.aio processes on the 2-core CPU, 460-580 us a call (290-370 us of the server's CPU)
against 190-260 us a message (120-150 us). On the stream, responses come in request order and are matched to
their steps by that order (_StepStream); a step that fails, times out or is lost with the worker ends the
stream, and every step still on it fails with its error; the next step opens a new stream.
"""

from __future__ import annotations

import asyncio
import collections

import grpc

from protos.segserve.v1 import common_pb2, worker_pb2, worker_pb2_grpc
from protos.segserve.v1.info import Health, WorkerInfo
from protos.segserve.v1.step import MalformedStep, StepRequest
from protos.segserve.v1.step_result import StepResult
from common.tls import TlsFiles, open_channel

_CHANNEL_OPTIONS = [("grpc.max_send_message_length", 64 << 20), ("grpc.max_receive_message_length", 64 << 20)]
_UNREACHABLE_CODES = frozenset({"UNAVAILABLE", "DEADLINE_EXCEEDED", "CANCELLED"})


class WorkerError(RuntimeError):
    """The worker could not be reached or failed a call. `code`: the gRPC status name ("" = unknown)."""

    def __init__(self, message: str, code: str = "") -> None:
        super().__init__(message)
        self.code = code

    @property
    def is_unreachable(self) -> bool:
        """The worker did not answer (down, restarting, past the deadline): its state is unknown."""
        return self.code in _UNREACHABLE_CODES


def _rpc_error(what: str, exc: grpc.aio.AioRpcError) -> WorkerError:
    return WorkerError(f"worker {what} failed: {exc.code().name}: {exc.details()}", exc.code().name)


def _stream_error(exc: Exception) -> WorkerError:
    """What a StepStream call that broke (a read or a write raised `exc`) surfaces as."""
    if isinstance(exc, grpc.aio.AioRpcError):
        return _rpc_error("StepStream", exc)
    if isinstance(exc, asyncio.InvalidStateError):  # the call had ended (end() cancelled it)
        return WorkerError("worker StepStream ended", "CANCELLED")
    # the call broke some other way: the worker's state is unknown
    return WorkerError(f"worker StepStream failed: {type(exc).__name__}: {exc}", "UNAVAILABLE")


def _fail(answer: asyncio.Future, error: WorkerError) -> None:
    answer.set_exception(error)
    answer.exception()  # its caller may be gone (a step ahead dropped): no "never retrieved" log


class _StepStream:
    """One Worker.StepStream call: steps written one at a time, each answered in turn. Create it on the loop
    that uses it."""

    def __init__(self, stub: worker_pb2_grpc.WorkerStub):
        self._call = stub.StepStream()
        self._answers: collections.deque[asyncio.Future] = collections.deque()
        """One future per step written and not yet answered, in the order written."""
        self._write_lock = asyncio.Lock()
        self.error: WorkerError | None = None
        """Why the stream ended; every later step fails with it."""
        self._reader = asyncio.ensure_future(self._read())

    @property
    def is_open(self) -> bool:
        return self.error is None

    async def step(self, request: worker_pb2.StepRequest, timeout_s: float | None) -> worker_pb2.StepResponse:
        answer = asyncio.get_running_loop().create_future()
        # shielded: a caller cancelled mid-write must not leave a step on the wire without its future (the
        # answers after it would go to the wrong steps)
        await asyncio.shield(self._write(request, answer))
        try:
            async with asyncio.timeout(timeout_s):  # not wait_for, which can drop a cancellation (engine.py)
                return await answer
        except TimeoutError:
            self.end(WorkerError(f"worker Step over the stream timed out after {timeout_s} s", "DEADLINE_EXCEEDED"))
            raise self.error from None

    async def _write(self, request: worker_pb2.StepRequest, answer: asyncio.Future) -> None:
        async with self._write_lock:
            if self.error is not None:
                _fail(answer, self.error)
                return
            self._answers.append(answer)
            try:
                await self._call.write(request)
            except Exception as exc:
                self.end(_stream_error(exc))

    async def _read(self) -> None:
        try:
            while True:
                response = await self._call.read()
                if response is grpc.aio.EOF:
                    self.end(WorkerError("worker StepStream ended without a status", "UNAVAILABLE"))
                    return
                if not self._answers:
                    self.end(WorkerError("worker StepStream answered a step it was not sent", "INTERNAL"))
                    return
                answer = self._answers.popleft()
                if not answer.done():  # done: its caller gave up on it (cancelled)
                    answer.set_result(response)
        except Exception as exc:
            self.end(_stream_error(exc))

    def end(self, error: WorkerError) -> None:
        """End the stream: the steps still on it, and every later one, fail with `error` (the first error
        given wins)."""
        if self.error is None:
            self.error = error
        while self._answers:
            answer = self._answers.popleft()
            if not answer.done():
                _fail(answer, self.error)
        self._call.cancel()
        if self._reader is not asyncio.current_task():
            self._reader.cancel()


class WorkerClient:
    """One grpc.aio channel to the worker; create it on the event loop that uses it. With `tls`, mutual TLS
    (server_name: the DNS name the worker's certificate carries when `address` is one it resolved to)."""

    def __init__(self, address: str, step_timeout_s: float | None = None, tls: TlsFiles | None = None,
                 server_name: str | None = None):
        self.address = address
        self.step_timeout_s = step_timeout_s
        self._channel = open_channel(address, tls, _CHANNEL_OPTIONS, server_name)
        self._stub = worker_pb2_grpc.WorkerStub(self._channel)
        self.is_packed = False
        """Steps go packed (step.py): the worker said at its last GetInfo that it reads them."""
        self.is_streamed = False
        """Steps go over a StepStream: the worker said at its last GetInfo that it serves one."""
        self._stream: _StepStream | None = None

    async def get_info(self, timeout_s: float = 10.0) -> WorkerInfo:
        try:
            info = WorkerInfo.from_pb(await self._stub.GetInfo(common_pb2.WorkerInfoRequest(), timeout=timeout_s))
        except grpc.aio.AioRpcError as exc:
            raise _rpc_error("GetInfo", exc) from exc
        self.is_packed = info.packed_steps
        self.is_streamed = info.step_stream
        return info

    async def step(self, request: StepRequest) -> StepResult:
        """The worker's answer, unchecked (Scheduler.postprocess checks it against the request)."""
        pb = request.to_pb(packed=self.is_packed)
        if self.is_streamed:
            if self._stream is None or not self._stream.is_open:
                self._stream = _StepStream(self._stub)
            response = await self._stream.step(pb, self.step_timeout_s)
        else:
            try:
                response = await self._stub.Step(pb, timeout=self.step_timeout_s)
            except grpc.aio.AioRpcError as exc:
                raise _rpc_error("Step", exc) from exc
        try:
            return StepResult.from_pb(response)
        except MalformedStep as exc:
            raise WorkerError(f"worker Step answered a malformed result: {exc}", "INTERNAL") from exc

    async def health(self, timeout_s: float = 5.0) -> Health:
        """The worker's readiness; unreachable counts as not ready (never raises for RPC errors)."""
        try:
            return Health.from_pb(await self._stub.Health(common_pb2.HealthRequest(), timeout=timeout_s))
        except grpc.aio.AioRpcError as exc:
            return Health(False, f"worker at {self.address} unreachable: {exc.code().name}")

    async def close(self) -> None:
        if self._stream is not None:
            self._stream.end(WorkerError("the worker client closed", "CANCELLED"))
        await self._channel.close()
