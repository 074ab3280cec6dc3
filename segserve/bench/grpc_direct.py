"""The scheduler's gRPC called directly: the reference the router's own overhead is measured against.

`segserve bench throughput` drives the scheduler of the stack it launched, in the
same run as the HTTP levels: the same prompts tokenized as the router tokenizes a
/v1/completions prompt, the same max_tokens, greedy, ignore_eos, the same
concurrency levels and the same closed loop (`loadgen.run_closed_loop`). Each
request fills a loadgen `RequestRecord`: event times are the arrivals of
non-empty `TokenChunk`s (one chunk per scheduler step, like one SSE event),
num_tokens is the scheduler's num_generated_tokens. Requests and events are the
generation contract's types (protos/segserve/v1/generate.py).
"""

from __future__ import annotations

import itertools
import time
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

from protos.segserve.v1.generate import GenerateComplete, GenerateEvent, GenerateRequest, TokenChunk
from protos.segserve.v1.sampling import SamplingParams, StoppingCriteria
from router.scheduler_client import SchedulerClient
from segserve.bench import loadgen, report

if TYPE_CHECKING:
    from segserve.bench.throughput_config import ThroughputConfig


@dataclass
class GrpcLoadSpec:
    """One level of load against one scheduler."""

    address: str
    """The scheduler's host:port (loopback only)."""
    prompt_token_ids: list[list[int]]
    """Tokenized prompts, cycled over requests."""
    max_tokens: int
    """max_tokens of every request (EOS ignored, greedy)."""
    concurrency: int
    """Number of streams running at once."""
    requests_per_stream: int = 1
    """Requests each stream sends back to back."""
    request_timeout_s: float = 120.0
    """Longest one request may take."""
    time_limit_s: float = 600.0
    """Longest the whole level may take."""

    def __post_init__(self) -> None:
        loadgen.check_loopback(f"grpc://{self.address}")
        if not self.prompt_token_ids or not all(self.prompt_token_ids):
            raise ValueError("prompt_token_ids must hold non-empty prompts")
        if self.max_tokens <= 0 or self.concurrency <= 0 or self.requests_per_stream <= 0:
            raise ValueError("max_tokens, concurrency and requests_per_stream must be > 0")


def apply_event(record: loadgen.RequestRecord, event: GenerateEvent, now: float) -> None:
    """Fold one scheduler event into `record`, as loadgen.apply_event does for an SSE event."""
    if isinstance(event, TokenChunk):
        if event.token_ids:
            record.event_times.append(now)
    elif isinstance(event, GenerateComplete):
        record.num_tokens = event.num_generated_tokens
        record.finish_reason = event.finish_reason.value
    else:
        record.error = f"{event.code}: {event.message}"


async def run_load(spec: GrpcLoadSpec) -> loadgen.LoadRun:
    """Run one level: `concurrency` closed-loop gRPC streams on one channel, bounded by `time_limit_s`."""
    client = SchedulerClient(spec.address)
    sampling, stopping = SamplingParams(), StoppingCriteria(max_tokens=spec.max_tokens, ignore_eos=True)
    request_numbers = itertools.count()

    async def send(prompt_number: int, record: loadgen.RequestRecord) -> None:
        prompt = spec.prompt_token_ids[prompt_number % len(spec.prompt_token_ids)]
        request = GenerateRequest(f"bench-grpc-{next(request_numbers)}", prompt, sampling, stopping)
        async for event in client.generate(request):
            apply_event(record, event, time.perf_counter())

    try:
        return await loadgen.run_closed_loop(
            spec.concurrency, spec.requests_per_stream, spec.request_timeout_s, spec.time_limit_s, send
        )
    finally:
        await client.close()


def tokenize_prompts(model_dir, prompts: list[str]) -> list[list[int]]:
    """The prompts as the router tokenizes a /v1/completions prompt (its tokenizer, its function)."""
    from router.prompts import completion_prompt_ids
    from router.server import load_tokenizer

    tokenizer = load_tokenizer(str(model_dir))
    return [completion_prompt_ids(tokenizer, prompt) for prompt in prompts]


def bench_grpc(address: str, prompt_token_ids: list[list[int]], config: ThroughputConfig) -> dict:
    """Warm up like `throughput.bench_http`, then run every level against the scheduler directly."""
    spec = level_spec(address, prompt_token_ids, config, 1)
    system = {"name": "segserve scheduler gRPC (direct)", "kind": "grpc-direct", "address": address, "levels": []}
    warmup = loadgen.run(run_load(replace(spec, max_tokens=4, requests_per_stream=1)))
    if warmup.records[0].error:
        return {**system, "error": f"warm-up request failed: {warmup.records[0].error}"}
    loadgen.run(run_load(replace(spec, concurrency=min(4, config.concurrency[-1]),
                                 max_tokens=min(8, config.max_tokens), requests_per_stream=1)))
    for concurrency in config.concurrency:
        system["levels"].append(grpc_level(address, prompt_token_ids, config, concurrency))
    return system


def level_spec(address: str, prompt_token_ids: list[list[int]], config: ThroughputConfig,
               concurrency: int) -> GrpcLoadSpec:
    """A level of `concurrency` streams as `config` sets it (the warm-ups replace its sizes)."""
    return GrpcLoadSpec(address=address, prompt_token_ids=prompt_token_ids, concurrency=concurrency,
                        max_tokens=config.max_tokens, requests_per_stream=config.requests_per_stream,
                        request_timeout_s=config.request_timeout_s, time_limit_s=config.level_time_limit_s)


def grpc_level(address: str, prompt_token_ids: list[list[int]], config: ThroughputConfig, concurrency: int) -> dict:
    """One level against the scheduler directly (no warm-up)."""
    run = loadgen.run(run_load(level_spec(address, prompt_token_ids, config, concurrency)))
    return report.level_result(concurrency, run.records, run.started_at, run.finished_at)
