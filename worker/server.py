"""The worker's gRPC service: GetInfo, Step (a call per step, or StepStream: one stream of them) and Health over
a ModelRunner.

Protobuf is converted here and nowhere else, with the contract types' from_pb / to_pb
(protos/segserve/v1/step.py, step_result.py, info.py). A step that may take long runs in a thread, so that the event
loop keeps answering Health meanwhile; a short one runs on the loop itself (common/blocking.py: the
hand-off cost a one-stream decode step of the tiny model 0.6-0.9 ms of its 2.5-2.8). Steps are
serialized (the runner and its KV cache are single-threaded), and a step ahead runs after the step it
follows (worker/step_order.py). A failure of one sequence is an error in its SequenceOutput, not a
status; exceptions (a failure of the whole step) become gRPC status codes in one place,
`_abort`: a malformed step is INVALID_ARGUMENT, out of memory RESOURCE_EXHAUSTED (the scheduler
preempts and retries with a smaller batch), anything else INTERNAL. A step that carries its scheduler span's
trace context (StepRequest.trace_context) runs under it: the runner's forward and sample spans are its children.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from concurrent.futures import ThreadPoolExecutor

import grpc
import torch

from protos.segserve.v1 import worker_pb2, worker_pb2_grpc
from protos.segserve.v1.info import Health
from protos.segserve.v1.sampling import InvalidParameter
from protos.segserve.v1.step import MalformedStep, StepRequest
from protos.segserve.v1.step_result import StepResult
from common import tracing
from common.blocking import CallCost, in_thread, run_blocking
from common.health import Serving, start_serving, status_errors
from common.heap import freeze_startup_heap
from common.ports import announce_ports
from common.tls import EXCLUSIVE_PORT, TlsFiles, internal_tls
from worker.config import WorkerConfig
from worker.model_runner import ModelRunner
from worker.ranks import Launch, launch_process
from worker.step_order import StepOrder
from worker.threads import bind_compute_thread, parse_cpu_list
from worker.validation import InvalidRequest

logger = logging.getLogger(__name__)


class NotReady(RuntimeError):
    """The model is still loading (or failed to load)."""


async def _abort(context: grpc.aio.ServicerContext, what: str, exc: Exception) -> None:
    """End the call with the status code `exc` maps to: bad requests are INVALID_ARGUMENT, never a crash."""
    if isinstance(exc, InvalidRequest):
        await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
    if isinstance(exc, NotReady):
        await context.abort(grpc.StatusCode.UNAVAILABLE, str(exc))
    if isinstance(exc, torch.OutOfMemoryError):
        logger.warning("worker %s ran out of memory: %s", what, exc)
        await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, f"out of memory: {exc}")
    logger.error("worker %s failed", what, exc_info=exc)
    await context.abort(grpc.StatusCode.INTERNAL, f"{type(exc).__name__}: {exc}")


async def _read_into(request_iterator, received: asyncio.Queue) -> None:
    """Every request of a stream into `received`, then None (its end, or a broken stream)."""
    try:
        async for request in request_iterator:
            received.put_nowait(request)
    except Exception as exc:  # the stream broke (its scheduler went away): the handler ends with it
        logger.debug("a step stream broke: %s", exc)
    finally:
        received.put_nowait(None)


_status_errors = status_errors(_abort)
"""A unary method whose exceptions become status codes (_abort)."""


class WorkerServicer(worker_pb2_grpc.WorkerServicer):
    """Serves a ModelRunner once `attach` has handed over a warmed-up one."""

    def __init__(self, runner: ModelRunner | None = None):
        self._runner: ModelRunner | None = None
        self._detail = "loading the model"
        self._step_lock = asyncio.Lock()
        self.cost = CallCost()
        """Where steps run (common/blocking.py), by scheduled tokens."""
        self.compute = ThreadPoolExecutor(1, thread_name_prefix="compute")
        """The one thread that loads the model and runs every long step. Each thread that runs torch's parallel ops
        gets an OpenMP team of intra-op threads of its own, and asyncio's default executor hands successive steps
        to whichever of its threads is free: with it, the default model's worker at one stream on the 2-core CPU
        computed on four threads (two teams taking turns, 9-13 CPU-s each over a 256-token request), with this
        one on two."""
        self.order = StepOrder()
        """A step ahead (async scheduling) runs after the step it follows, whichever RPC came first."""
        self.serving = Serving([worker_pb2.DESCRIPTOR.services_by_name["Worker"].full_name])
        """The standard grpc.health.v1 status: SERVING only once the model is loaded and warmed up."""
        if runner is not None:
            self.attach(runner)

    def attach(self, runner: ModelRunner) -> None:
        """Start serving `runner`; it must have passed its warm-up forward."""
        if not runner.is_ready:
            raise ValueError("attach a runner only after warm_up() succeeded")
        self._runner = runner

    @property
    def is_ready(self) -> bool:
        return self._runner is not None

    def mark_failed(self, detail: str) -> None:
        self._detail = detail

    def _ready_runner(self) -> ModelRunner:
        if self._runner is None:
            raise NotReady(f"worker not ready: {self._detail}")
        return self._runner

    @_status_errors
    async def GetInfo(self, request, context):
        return dataclasses.replace(self._ready_runner().info(), packed_steps=True, step_stream=True).to_pb()

    @_status_errors
    async def Step(self, request, context):
        return await self._step(request)

    async def StepStream(self, request_iterator, context):
        """Steps in the order they come, a response each; the first that fails ends the stream with its status
        (the scheduler opens a new one for its next step). The stream is read ahead while a step runs, so that
        a step sent ahead (async scheduling) has arrived when the step before it ends: gRPC receives a message
        only once it is asked for one."""
        received: asyncio.Queue = asyncio.Queue()
        reader = asyncio.ensure_future(_read_into(request_iterator, received))
        try:
            while (request := await received.get()) is not None:
                try:
                    response = await self._step(request)
                except Exception as exc:
                    await _abort(context, "StepStream", exc)
                yield response
        finally:
            reader.cancel()

    async def _step(self, request: worker_pb2.StepRequest) -> worker_pb2.StepResponse:
        with self.order.handling(request.step_id):
            runner = self._ready_runner()
            try:
                step = StepRequest.from_pb(request)
            except (MalformedStep, InvalidParameter) as exc:  # e.g. a structured_output of an unknown kind
                raise InvalidRequest(str(exc)) from exc
            await self.order.after(step.follows_step_id)
            async with self._step_lock:
                num_tokens = step.num_scheduled_tokens * step.num_steps
                with tracing.attached(tracing.extract(step.trace_context)):  # the forward and sample spans' parent
                    outputs, seconds = await run_blocking(self.cost, num_tokens, runner.step, step,
                                                          executor=self.compute)
        return StepResult(outputs, int(seconds * 1e6)).to_pb(packed=request.HasField("packed_sequences"))

    @_status_errors
    async def Health(self, request, context):
        if self._runner is None:
            return Health(is_ready=False, detail=self._detail).to_pb()
        return Health(is_ready=True).to_pb()


async def start_server(servicer: WorkerServicer, host: str, port: int,
                       tls: TlsFiles | None = None) -> tuple[grpc.aio.Server, int]:
    """Bind and start a grpc.aio server for `servicer`; returns it and the bound port (port 0 = any free one).
    With `tls` (common.tls.internal_tls of the config), clients must present a certificate its CA signed."""
    server = grpc.aio.server(options=[
        EXCLUSIVE_PORT,
        ("grpc.max_receive_message_length", 64 * 2**20),
        ("grpc.max_send_message_length", 64 * 2**20),
    ])
    worker_pb2_grpc.add_WorkerServicer_to_server(servicer, server)
    bound = await start_serving(server, servicer.serving, f"{host}:{port}", tls, "the worker")
    await servicer.serving.set(servicer.is_ready)
    return server, bound


def load_runner(config: WorkerConfig, launch: Launch = launch_process) -> ModelRunner:
    """Load the model and run the warm-up forward (blocking; call in a thread); `launch` starts the other
    tensor-parallel ranks (worker/ranks.py)."""
    runner = ModelRunner(config, launch=launch)
    runner.warm_up()
    return runner


async def serve(config: WorkerConfig) -> None:
    """Bind first (Health answers "not ready" while loading), load and warm up, then serve until stopped. With
    compute_cpus, this thread (the event loop's, which runs short steps) is bound to them once gRPC's threads
    have started, so that the threads loading the model and running long steps, started after, are too."""
    servicer = WorkerServicer()
    tls = internal_tls(config)
    tracing.setup("worker", config)
    server, port = await start_server(servicer, config.host, config.port, tls)
    announce_ports(port=port)
    if config.compute_cpus:
        bind_compute_thread(parse_cpu_list(config.compute_cpus))
    logger.info("worker listening on %s:%d%s, loading the model", config.host, port, " (mutual TLS)" if tls else "")
    try:
        runner = await in_thread(servicer.compute, load_runner, config)
    except Exception as exc:
        servicer.mark_failed(f"model failed to load: {exc}")
        await server.stop(grace=None)
        raise
    servicer.attach(runner)
    freeze_startup_heap()  # the model and torch stay out of every later collection
    await servicer.serving.set(True)
    info = runner.info()
    logger.info("worker ready: %s, %d KV blocks of %d tokens on %s/%s", info.model_name, info.num_kv_blocks,
                info.block_size, info.device, info.dtype)
    try:
        await server.wait_for_termination()
    finally:
        await servicer.serving.set(False)
        await server.stop(grace=1.0)
        tracing.shutdown()
