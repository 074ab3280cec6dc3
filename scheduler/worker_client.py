"""The scheduler's gRPC client to the worker; protobuf is converted here (by the contract types) only.

In: a StepRequest. Out: WorkerInfo, StepResult and Health (protos/segserve/v1).
Every RPC failure surfaces as WorkerError carrying the gRPC status name; the
engine decides from it whether the step is retried (worker/engine faults) or
its requests fail (the worker unreachable).
"""

from __future__ import annotations

import grpc

from protos.segserve.v1 import common_pb2, worker_pb2_grpc
from protos.segserve.v1.info import Health, WorkerInfo
from protos.segserve.v1.step import MalformedStep, StepRequest, StepResult
from segserve.tls import TlsFiles, open_channel

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

    async def get_info(self, timeout_s: float = 10.0) -> WorkerInfo:
        try:
            info = WorkerInfo.from_pb(await self._stub.GetInfo(common_pb2.WorkerInfoRequest(), timeout=timeout_s))
        except grpc.aio.AioRpcError as exc:
            raise _rpc_error("GetInfo", exc) from exc
        self.is_packed = info.packed_steps
        return info

    async def step(self, request: StepRequest) -> StepResult:
        """The worker's answer, unchecked (Scheduler.postprocess checks it against the request)."""
        try:
            response = await self._stub.Step(request.to_pb(packed=self.is_packed), timeout=self.step_timeout_s)
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
        await self._channel.close()
