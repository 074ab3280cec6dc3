"""An async, closed-loop load generator for any OpenAI-compatible server.

Each of `concurrency` streams sends `requests_per_stream` streamed
`POST /v1/completions` requests back to back (temperature 0, fixed prompts,
`max_tokens` N) and records, per request, when it was sent, when each SSE event
carrying text arrived, how many tokens it produced and how it ended. A level is
bounded in requests and in time; only loopback servers are accepted (this is a
local benchmark, not a load-testing tool for other people's hosts).

The closed loop itself (`run_closed_loop`) is transport-free: `grpc_direct`
drives the scheduler's gRPC through it into the same `RequestRecord`s.
Timings are `time.perf_counter()` seconds; statistics live in `report`.
"""

from __future__ import annotations

import asyncio
import atexit
import json
import time
from collections.abc import Awaitable, Callable, Coroutine
from dataclasses import asdict, dataclass, field
from typing import Any, TypeVar
from urllib.parse import urlsplit

import aiohttp

LOOPBACK_HOSTS = frozenset({"127.0.0.1", "localhost", "::1"})


@dataclass
class RequestRecord:
    """What one streamed request did."""

    stream_index: int
    """Which concurrent stream sent it (0..concurrency-1)."""
    started_at: float
    """perf_counter() when the request was sent."""
    finished_at: float = 0.0
    """perf_counter() when the stream ended (or failed)."""
    event_times: list[float] = field(default_factory=list)
    """perf_counter() of every SSE event that carried non-empty text (completions' `text`, chat's `delta.content`),
    in order."""
    num_tokens: int = 0
    """Completion tokens: usage.completion_tokens when the server sends it, else len(event_times)."""
    finish_reason: str | None = None
    """The server's finish_reason ("length", "stop", ...), None if it sent none."""
    error: str | None = None
    """Why the request failed (HTTP status, error event, timeout); None on success."""

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass
class LoadSpec:
    """One level of load against one server."""

    base_url: str
    """Server root, e.g. http://127.0.0.1:8000 (a trailing /v1 is accepted)."""
    prompts: list[str]
    """Prompts, cycled over requests."""
    max_tokens: int
    """max_tokens of every request."""
    concurrency: int
    """Number of streams running at once."""
    requests_per_stream: int = 1
    """Requests each stream sends back to back."""
    model: str | None = None
    """The `model` body field; None leaves it out."""
    extra_body: dict = field(default_factory=dict)
    """Extra body fields (e.g. {"ignore_eos": true}) merged into every request."""
    request_timeout_s: float = 120.0
    """Longest one request may take."""
    time_limit_s: float = 600.0
    """Longest the whole level may take; requests still running then fail with 'time limit'."""

    def __post_init__(self) -> None:
        check_loopback(self.base_url)
        if not self.prompts:
            raise ValueError("prompts must not be empty")
        if self.max_tokens <= 0 or self.concurrency <= 0 or self.requests_per_stream <= 0:
            raise ValueError("max_tokens, concurrency and requests_per_stream must be > 0")
        if self.request_timeout_s <= 0 or self.time_limit_s <= 0:
            raise ValueError("request_timeout_s and time_limit_s must be > 0")


@dataclass
class LoadRun:
    """All requests of one level and the wall-clock window they ran in."""

    records: list[RequestRecord]
    started_at: float
    finished_at: float


SendRequest = Callable[[int, RequestRecord], Awaitable[None]]
"""send(prompt_number, record): one request of a closed loop (HTTP here, gRPC in `grpc_direct`), filling record."""


T = TypeVar("T")
_runner: asyncio.Runner | None = None


def run(coroutine: Coroutine[Any, Any, T]) -> T:
    """Run a coroutine on the benchmark process's one event loop, kept open between calls (asyncio.run makes
    and closes one per call). grpc.aio binds its poller to the first loop a channel runs on; once that loop is
    closed, the poller's callbacks fail with "Event loop is closed" on every later one."""
    global _runner
    if _runner is None:
        _runner = asyncio.Runner()
        atexit.register(_runner.close)
    return _runner.run(coroutine)


def check_loopback(base_url: str) -> None:
    """Refuse any server that is not on this machine's loopback interface."""
    host = urlsplit(base_url).hostname
    if host not in LOOPBACK_HOSTS:
        raise ValueError(f"loadgen only targets loopback servers, not {host!r}")


def completions_url(base_url: str) -> str:
    root = base_url.rstrip("/")
    return root + ("/completions" if root.endswith("/v1") else "/v1/completions")


def request_body(spec: LoadSpec, prompt: str, max_tokens: int | None = None) -> dict:
    """The JSON body of one streamed completion request."""
    body = {
        "prompt": prompt,
        "max_tokens": max_tokens or spec.max_tokens,
        "temperature": 0.0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if spec.model is not None:
        body["model"] = spec.model
    body.update(spec.extra_body)
    return body


def parse_sse_line(line: str) -> dict | None:
    """One SSE line -> its JSON payload; None for comments, blanks, non-data fields and [DONE]."""
    if not line.startswith("data:"):
        return None
    payload = line[len("data:") :].strip()
    if not payload or payload == "[DONE]":
        return None
    return json.loads(payload)


def apply_event(record: RequestRecord, event: dict, now: float) -> None:
    """Fold one parsed SSE event into `record` (text arrival, usage, finish reason, errors)."""
    if "error" in event:
        record.error = f"error event: {event['error']}"
        return
    for choice in event.get("choices") or []:
        if choice.get("text") or (choice.get("delta") or {}).get("content"):
            record.event_times.append(now)
        if choice.get("finish_reason"):
            record.finish_reason = choice["finish_reason"]
    usage = event.get("usage")
    if usage and usage.get("completion_tokens") is not None:
        record.num_tokens = int(usage["completion_tokens"])


async def stream_one(client: aiohttp.ClientSession, url: str, body: dict, record: RequestRecord) -> None:
    """Send one streamed request and fill `record` as events arrive."""
    async with client.post(url, json=body) as response:
        if response.status != 200:
            detail = (await response.read()).decode(errors="replace")[:300]
            record.error = f"HTTP {response.status}: {detail}"
            return
        async for line in response.content:  # one SSE line each, with its newline
            event = parse_sse_line(line.decode())
            if event is not None:
                apply_event(record, event, time.perf_counter())
            if record.error:
                return
    if record.num_tokens == 0:
        record.num_tokens = len(record.event_times)


async def timed_request(request: Awaitable[None], record: RequestRecord, timeout_s: float) -> RequestRecord:
    """Await one request that fills `record`; a timeout or transport error becomes `record.error`."""
    try:
        await asyncio.wait_for(request, timeout=max(timeout_s, 0.001))
    except asyncio.TimeoutError:
        record.error = "time limit"
    except (aiohttp.ClientError, ValueError) as exc:  # ValueError: a bad JSON payload, or an oversized line
        record.error = f"{type(exc).__name__}: {exc}"
    record.finished_at = time.perf_counter()
    return record


def make_client(concurrency: int, request_timeout_s: float) -> aiohttp.ClientSession:
    """The streams' HTTP client. aiohttp, as vLLM's serving benchmark uses: it reads a token's SSE event for a
    fraction of the CPU that httpx takes, and the load generator shares the machine with what it measures.
    No proxy from the environment (a proxy configured for package registries must never see loopback traffic)."""
    return aiohttp.ClientSession(
        timeout=aiohttp.ClientTimeout(total=request_timeout_s, connect=10.0),
        connector=aiohttp.TCPConnector(limit=concurrency + 2),
        trust_env=False, read_bufsize=1 << 20)


async def run_closed_loop(
    concurrency: int, requests_per_stream: int, request_timeout_s: float, time_limit_s: float, send: SendRequest
) -> LoadRun:
    """`concurrency` streams, each sending `requests_per_stream` requests back to back, bounded by `time_limit_s`.

    Request r of stream i sends prompt number i + r * concurrency (callers take it modulo their prompts).
    """
    started_at = time.perf_counter()
    deadline = started_at + time_limit_s
    records: list[RequestRecord] = []

    async def stream(index: int) -> None:
        for round_index in range(requests_per_stream):
            now = time.perf_counter()
            if now >= deadline:
                return
            record = RequestRecord(stream_index=index, started_at=now)
            records.append(record)
            request = send(index + round_index * concurrency, record)
            await timed_request(request, record, min(request_timeout_s, deadline - now))

    await asyncio.gather(*(stream(i) for i in range(concurrency)))
    return LoadRun(records=records, started_at=started_at, finished_at=time.perf_counter())


async def run_load(spec: LoadSpec) -> LoadRun:
    """Run one level: `concurrency` closed-loop SSE streams, bounded by `time_limit_s`."""
    url = completions_url(spec.base_url)
    async with make_client(spec.concurrency, spec.request_timeout_s) as client:

        def send(prompt_number: int, record: RequestRecord) -> Awaitable[None]:
            body = request_body(spec, spec.prompts[prompt_number % len(spec.prompts)])
            return stream_one(client, url, body, record)

        return await run_closed_loop(
            spec.concurrency, spec.requests_per_stream, spec.request_timeout_s, spec.time_limit_s, send
        )


def with_cpu(level: Callable[..., dict], *args) -> tuple[dict, float]:
    """level(*args)'s summary and the CPU seconds this process (the load generator, every thread) spent on it. The
    load generator shares the machine with what it measures: what it spends reading a stream, more over HTTP/SSE
    than over gRPC, is CPU the server did not get, and shows in its latencies."""
    start = time.process_time()
    summary = level(*args)["summary"]
    return summary, time.process_time() - start


def cpu_ms_per_token(cpu_s: float, summary: dict) -> float | None:
    """CPU milliseconds per token the level streamed (None when it streamed none)."""
    return 1000 * cpu_s / summary["total_tokens"] if summary["total_tokens"] else None


async def probe(spec: LoadSpec, max_tokens: int = 4) -> RequestRecord:
    """Send one short request (warm-up, or to learn whether the server accepts `extra_body`)."""
    url = completions_url(spec.base_url)
    record = RequestRecord(stream_index=0, started_at=time.perf_counter())
    async with make_client(1, spec.request_timeout_s) as client:
        body = request_body(spec, spec.prompts[0], max_tokens=max_tokens)
        return await timed_request(stream_one(client, url, body, record), record, spec.request_timeout_s)


async def fetch_model_name(base_url: str, timeout_s: float = 10.0) -> str | None:
    """The first model id from GET /v1/models, or None when the server has no usable list."""
    check_loopback(base_url)
    root = base_url.rstrip("/").removesuffix("/v1")
    try:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=timeout_s)) as client:
            async with client.get(root + "/v1/models") as response:
                data = (await response.json()).get("data") if response.status == 200 else None
    except (aiohttp.ClientError, asyncio.TimeoutError, ValueError):
        return None
    return data[0].get("id") if data else None
