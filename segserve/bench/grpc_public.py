"""The router's public gRPC API under load: the same levels as HTTP, through GenerateStream.

`segserve bench throughput` drives the launched stack's router on its gRPC port
(segserve.v1.Generation) with segserve's own asyncio client (`segserve.client`,
retries off: a refused request is an error here, as over HTTP): the same prompts
as the HTTP levels (text, tokenized by the router), the same max_tokens, greedy,
ignore_eos, the same concurrency levels and the same closed loop
(`loadgen.run_closed_loop`), all streams on one channel. Each request fills a
loadgen `RequestRecord` as an SSE stream does: event times are the arrivals of
events carrying text, num_tokens is the usage's completion_tokens, so its time
per token compares with HTTP's and, against the scheduler's gRPC called directly
(`grpc_direct`), gives the router's overhead over gRPC.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

from segserve.bench import loadgen, report
from segserve.client import AsyncClient, RetryPolicy, SegserveError, StreamEvent

if TYPE_CHECKING:
    from segserve.bench.throughput_config import ThroughputConfig

NAME = "segserve gRPC API"


@dataclass
class PublicGrpcLoadSpec:
    """One level of load against the router's gRPC API."""

    address: str
    """The router's gRPC host:port (loopback only)."""
    prompts: list[str]
    """Prompts, cycled over requests."""
    max_tokens: int
    """max_tokens of every request (EOS ignored, greedy)."""
    concurrency: int
    """Number of streams running at once."""
    requests_per_stream: int = 1
    """Requests each stream sends back to back."""
    model: str = ""
    """The request's model; empty = the served one."""
    request_timeout_s: float = 120.0
    """Longest one request may take."""
    time_limit_s: float = 600.0
    """Longest the whole level may take."""

    def __post_init__(self) -> None:
        loadgen.check_loopback(f"grpc://{self.address}")
        if not self.prompts:
            raise ValueError("prompts must not be empty")
        if self.max_tokens <= 0 or self.concurrency <= 0 or self.requests_per_stream <= 0:
            raise ValueError("max_tokens, concurrency and requests_per_stream must be > 0")


def apply_event(record: loadgen.RequestRecord, event: StreamEvent, now: float) -> None:
    """Fold one stream event into `record`, as loadgen.apply_event does for an SSE event."""
    if event.text:
        record.event_times.append(now)
    if event.finish_reason:
        record.finish_reason = event.finish_reason
    if event.usage is not None:
        record.num_tokens = event.usage.completion_tokens


async def run_load(spec: PublicGrpcLoadSpec) -> loadgen.LoadRun:
    """Run one level: `concurrency` closed-loop GenerateStream calls on one channel, bounded by `time_limit_s`."""
    parameters = dict(max_tokens=spec.max_tokens, temperature=0, ignore_eos=True)
    async with AsyncClient(spec.address, retry=RetryPolicy(max_attempts=1)) as client:

        async def send(prompt_number: int, record: loadgen.RequestRecord) -> None:
            prompt = spec.prompts[prompt_number % len(spec.prompts)]
            try:
                async for event in client.stream(prompt, model=spec.model, timeout_s=spec.request_timeout_s,
                                                 **parameters):
                    apply_event(record, event, time.perf_counter())
            except SegserveError as exc:
                record.error = str(exc)
            if record.num_tokens == 0:
                record.num_tokens = len(record.event_times)

        return await loadgen.run_closed_loop(
            spec.concurrency, spec.requests_per_stream, spec.request_timeout_s, spec.time_limit_s, send
        )


def bench_public_grpc(address: str, prompts: list[str], model: str | None, config: ThroughputConfig) -> dict:
    """Warm up like `throughput.bench_http`, then run every level against the router's gRPC API."""
    spec = dict(address=address, prompts=prompts, model=model or "", request_timeout_s=config.request_timeout_s,
                time_limit_s=config.level_time_limit_s)  # fmt: skip
    system = {"name": NAME, "kind": "grpc-api", "address": address, "model": model, "levels": []}
    warmup = loadgen.run(run_load(PublicGrpcLoadSpec(concurrency=1, max_tokens=4, **spec)))
    if warmup.records[0].error:
        return {**system, "error": f"warm-up request failed: {warmup.records[0].error}"}
    warm_concurrency = min(4, config.concurrency[-1])
    loadgen.run(run_load(PublicGrpcLoadSpec(concurrency=warm_concurrency, max_tokens=min(8, config.max_tokens),
                                            **spec)))  # fmt: skip
    for concurrency in config.concurrency:
        level_spec = PublicGrpcLoadSpec(concurrency=concurrency, max_tokens=config.max_tokens,
                                        requests_per_stream=config.requests_per_stream, **spec)  # fmt: skip
        run = loadgen.run(run_load(level_spec))
        system["levels"].append(report.level_result(concurrency, run.records, run.started_at, run.finished_at))
    return system
