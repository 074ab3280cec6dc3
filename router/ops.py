"""The router's operations surface: liveness, readiness, Prometheus metrics, API keys, body size.

In: the app's RouterState (state.py). Out: `router`, an APIRouter with
- GET /health: liveness, 200 while this process serves.
- GET /ready: 200 once the scheduler reports its worker loaded and warmed up by a
  real forward (the worker's Health), else 503 with the reason; 503 from the
  router's SIGTERM on (drain.py).
- GET /metrics: Prometheus text under vLLM's names, so existing dashboards work.
  Request histograms and counters are observed where the router reads the
  scheduler's stream (`MeteredClient`, under every endpoint), labelled with the
  protocol the request came in on (`protocol`: "http", or "grpc" for the public
  gRPC API); load gauges, speculation counters, the drafting budget and the
  gate's state per segment kind, the gate's latest decision and each drafter's
  corpus sizes come from the scheduler's GetStats at scrape time.
And `RequestGuard`, the middleware create_app puts in front of every route: 401
on /v1 and /v2 without one of `config.api_keys`, 413 for a body over
`config.max_request_body_bytes`, both answered before the body is parsed or any
work starts (`is_authorized` is the key check the gRPC API shares); with `metrics_require_key`, /metrics and
/status want a key too. It also sets the request's tenant (router/tenants.py: from its key, or a trusted tenant
header; 400 for an invalid one). `RouterMetrics` and `MeteredClient`,
which create_app puts in the state.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Iterator

import grpc
from fastapi import APIRouter
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from protos.segserve.v1.generate import FinishReason, GenerateComplete, GenerateEvent, GenerateRequest, TokenChunk
from router.errors import INVALID_REQUEST, error_body
from router.scheduler_client import SchedulerClient, SchedulerLoad
from router.scheduler_streams import RequestStream, open_stream, stream_events
from router.state import StateDep
from router.tenants import InvalidTenant, current_tenant, matching_key, tenant_for

# vLLM's buckets, so percentiles line up with its dashboards.
_TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
_ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                40.0, 80.0)
_REQUEST_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0,
                    240.0, 480.0, 960.0, 1920.0, 7680.0)
# vLLM's `finished_reason` label values; "abort" is a request whose client went away.
_FINISHED_REASON = {
    FinishReason.EOS_TOKEN: "stop",
    FinishReason.STOP_TOKEN: "stop",
    FinishReason.LENGTH: "length",
    FinishReason.CONTEXT_LENGTH: "length",
    FinishReason.UNSPECIFIED: "stop",
    FinishReason.ERROR: "error",
}


class SchedulerStatsCollector:
    """Exposes the scheduler's latest GetStats; `load` is refreshed by the /metrics route before each scrape."""

    def __init__(self, model_name: str) -> None:
        self.model_name = model_name
        self.load: SchedulerLoad | None = None
        """None when the scheduler did not answer: its series are left out rather than shown stale."""

    def collect(self) -> Iterator[Metric]:
        up = GaugeMetricFamily("segserve:scheduler_up", "1 if the scheduler answered GetStats at this scrape.",
                               labels=["model_name"])
        up.add_metric([self.model_name], float(self.load is not None))
        yield up
        if self.load is None:
            return
        load, spec = self.load, self.load.spec
        usage = load.num_used_kv_blocks / load.num_total_kv_blocks if load.num_total_kv_blocks else 0.0
        yield self._family(GaugeMetricFamily, "vllm:num_requests_running", "Requests in the running batch.",
                           load.num_running)
        yield self._family(GaugeMetricFamily, "vllm:num_requests_waiting", "Requests waiting to be scheduled.",
                           load.num_waiting)
        yield self._family(GaugeMetricFamily, "vllm:kv_cache_usage_perc", "Fraction of KV-cache blocks in use (0-1).",
                           usage)
        yield self._family(CounterMetricFamily, "vllm:num_preemptions", "Requests preempted (KV freed, recomputed).",
                           load.num_preemptions)
        yield self._family(CounterMetricFamily, "vllm:prefix_cache_queries",
                           "Tokens looked up in the prefix cache.", load.num_prefix_cache_queries)
        yield self._family(CounterMetricFamily, "vllm:prefix_cache_hits",
                           "Tokens looked up in the prefix cache and found cached.", load.num_prefix_cache_hits)
        yield self._family(CounterMetricFamily, "vllm:spec_decode_num_drafts", "Candidate trees verified.",
                           spec.num_drafts)
        yield self._family(CounterMetricFamily, "vllm:spec_decode_num_draft_tokens", "Draft tokens verified.",
                           spec.num_draft_tokens)
        yield self._family(CounterMetricFamily, "vllm:spec_decode_num_accepted_tokens", "Draft tokens accepted.",
                           spec.num_accepted_tokens)
        per_position = CounterMetricFamily("vllm:spec_decode_num_accepted_tokens_per_pos",
                                           "Drafts whose accepted path reached depth position + 1.",
                                           labels=["model_name", "position"])
        for position, count in enumerate(spec.num_accepted_by_position):
            per_position.add_metric([self.model_name, str(position)], count)
        yield per_position
        yield from self._drafting(load)

    def _drafting(self, load: SchedulerLoad) -> Iterator[Metric]:
        """The policy's budget and the gate's state per segment kind, the gate's decision, each replica's corpus."""
        budget = GaugeMetricFamily("segserve:spec_decode_budget_nodes",
                                   "The policy's latest draft-node budget per segment kind (0 = drafting off).",
                                   labels=["model_name", "segment"])
        for segment in load.segments:
            budget.add_metric([self.model_name, segment.segment], segment.num_budget_nodes)
        yield budget
        yield self._family(GaugeMetricFamily, "segserve:spec_decode_gate_open",
                           "1 if the speculation gate's latest decision was to speculate.",
                           float(load.spec.is_gate_open))
        gate = GaugeMetricFamily("segserve:spec_decode_segment_gate_open",
                                 "1 if the speculation gate lets the segment kind draft at the batch-size bucket "
                                 "of its latest step (0: its drafting measured slower; it only explores).",
                                 labels=["model_name", "segment"])
        for segment in load.segments:
            if segment.gate_batch_bucket:  # the gate has decided for it
                gate.add_metric([self.model_name, segment.segment], float(segment.is_gate_open))
        yield gate
        live = GaugeMetricFamily("segserve:drafter_live", "1 if drafts go to the replica (0: backing off).",
                                 labels=["model_name", "address"])
        entries = GaugeMetricFamily("segserve:drafter_corpus_entries", "Trie nodes in a replica's corpus.",
                                    labels=["model_name", "address", "segment"])
        num_bytes = GaugeMetricFamily("segserve:drafter_corpus_bytes", "Estimated memory of a replica's corpus.",
                                      labels=["model_name", "address", "segment"])
        for replica in load.drafters:
            live.add_metric([self.model_name, replica.address], float(replica.is_live))
            for segment in replica.stats.segments if replica.stats is not None else ():
                labels = [self.model_name, replica.address, segment.segment]
                entries.add_metric(labels, segment.num_corpus_entries)
                num_bytes.add_metric(labels, segment.num_corpus_bytes)
        yield from (live, entries, num_bytes)

    def _family(self, kind: type, name: str, documentation: str, value: float) -> Metric:
        family = kind(name, documentation, labels=["model_name"])
        family.add_metric([self.model_name], value)
        return family


class RouterMetrics:
    """One app's registry (not the global one, so tests can build many apps): request metrics + scheduler stats."""

    def __init__(self, model_name: str) -> None:
        self.registry = CollectorRegistry()

        def histogram(name: str, documentation: str, buckets: tuple[float, ...]):
            return Histogram(name, documentation, ["model_name", "protocol"], registry=self.registry,
                             buckets=buckets)

        def counter(name: str, documentation: str):
            return Counter(name, documentation, ["model_name", "protocol"], registry=self.registry)

        self.time_to_first_token = histogram(
            "vllm:time_to_first_token_seconds", "From sending a request to the scheduler to its first token.",
            _TTFT_BUCKETS)
        self.inter_token_latency = histogram(
            "vllm:inter_token_latency_seconds", "Between two consecutive token chunks of one request.", _ITL_BUCKETS)
        self.e2e_request_latency = histogram(
            "vllm:e2e_request_latency_seconds", "From sending a request to the scheduler to its end.",
            _REQUEST_BUCKETS)
        self.request_queue_time = histogram(
            "vllm:request_queue_time_seconds", "Time a request waited in the scheduler's queue.", _REQUEST_BUCKETS)
        self.prompt_tokens = counter("vllm:prompt_tokens", "Prompt tokens of finished requests.")
        self.generation_tokens = counter("vllm:generation_tokens", "Tokens generated by finished requests.")
        self.request_success = Counter("vllm:request_success", "Requests ended, by finish reason.",
                                       ["model_name", "protocol", "finished_reason"], registry=self.registry)
        self.request_failure = Counter("segserve:request_failure", "Requests failed, by failure code.",
                                       ["model_name", "protocol", "code"], registry=self.registry)
        self.model_name = model_name
        self.scheduler = SchedulerStatsCollector(model_name)
        self.registry.register(self.scheduler)

    async def render(self, client: SchedulerClient) -> bytes:
        """The exposition text, with the scheduler's stats read now."""
        try:
            self.scheduler.load = await client.get_stats()
        except (grpc.aio.AioRpcError, ConnectionError):  # one scheduler, or every scheduler of a pool, is down
            self.scheduler.load = None
        return generate_latest(self.registry)


class ProtocolMetrics:
    """RouterMetrics' request series of one protocol ("http" or "grpc"), label values bound once."""

    def __init__(self, metrics: RouterMetrics, protocol: str) -> None:
        labels = (metrics.model_name, protocol)
        self.labels = labels
        self.time_to_first_token = metrics.time_to_first_token.labels(*labels)
        self.inter_token_latency = metrics.inter_token_latency.labels(*labels)
        self.e2e_request_latency = metrics.e2e_request_latency.labels(*labels)
        self.request_queue_time = metrics.request_queue_time.labels(*labels)
        self.prompt_tokens = metrics.prompt_tokens.labels(*labels)
        self.generation_tokens = metrics.generation_tokens.labels(*labels)
        self.request_success = metrics.request_success
        self.request_failure = metrics.request_failure


class RequestTracker:
    """One request's timeline as the router reads it off the scheduler's stream."""

    def __init__(self, metrics: ProtocolMetrics, started_s: float) -> None:
        self.metrics = metrics
        self.started_s = started_s
        self.last_chunk_s: float | None = None
        self.is_ended = False

    def observe(self, event: GenerateEvent, now_s: float) -> None:
        m = self.metrics
        if isinstance(event, TokenChunk):
            if self.last_chunk_s is None:
                m.time_to_first_token.observe(now_s - self.started_s)
            else:
                m.inter_token_latency.observe(now_s - self.last_chunk_s)
            self.last_chunk_s = now_s
            return
        self.is_ended = True
        if isinstance(event, GenerateComplete):
            m.e2e_request_latency.observe(now_s - self.started_s)
            m.request_queue_time.observe(event.queue_wait_us / 1e6)
            m.prompt_tokens.inc(event.num_prompt_tokens)
            m.generation_tokens.inc(event.num_generated_tokens)
            m.request_success.labels(*m.labels, _FINISHED_REASON[event.finish_reason]).inc()
        else:
            m.request_failure.labels(*m.labels, event.code).inc()

    def close(self) -> None:
        if not self.is_ended:  # the stream was closed early: the client went away
            self.metrics.request_success.labels(*self.metrics.labels, "abort").inc()


class MeteredClient:
    """The scheduler client a protocol's handlers use: every generate() stream feeds the request metrics
    (labelled with `protocol`) on its way."""

    def __init__(self, client: SchedulerClient, metrics: RouterMetrics, protocol: str = "http") -> None:
        self.client = client
        self.metrics = metrics
        self.protocol_metrics = ProtocolMetrics(metrics, protocol)

    def open(self, request: GenerateRequest, timeout_s: float | None = None) -> RequestStream:
        return _MeteredStream(open_stream(self.client, request, timeout_s),
                              RequestTracker(self.protocol_metrics, time.monotonic()))

    def generate(self, request: GenerateRequest, timeout_s: float | None = None) -> AsyncIterator[GenerateEvent]:
        return stream_events(self.open, request, timeout_s)

    async def close(self) -> None:
        await self.client.close()


class _MeteredStream:
    """A request's stream whose events feed its RequestTracker as they are taken."""

    __slots__ = ("stream", "tracker")

    def __init__(self, stream: RequestStream, tracker: RequestTracker) -> None:
        self.stream = stream
        self.tracker = tracker

    async def take(self, timeout_s: float | None = None) -> list[GenerateEvent]:
        events = await self.stream.take(timeout_s)
        if events:
            now_s = time.monotonic()
            tracker = self.tracker
            for event in events:
                tracker.observe(event, now_s)
        return events

    async def close(self) -> None:
        try:
            await self.stream.close()
        finally:
            self.tracker.close()


class RequestGuard:
    """ASGI middleware: API keys on /v1, /v2 and /(de)tokenize and the body-size limit, checked before any route
    runs."""

    def __init__(self, app: ASGIApp, api_keys: list[str], max_body_bytes: int, tenant_header: str = "",
                 is_metrics_key_required: bool = False) -> None:
        self.app = app
        self.api_keys = [key.encode() for key in api_keys]
        self.max_body_bytes = max_body_bytes
        self.tenant_header = tenant_header.lower()
        """A header whose value is the tenant when no keys are configured ("" = none trusted; router/tenants.py)."""
        self.is_metrics_key_required = is_metrics_key_required
        """/metrics and /status want a key too."""

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = {name.decode("latin-1").lower(): value for name, value in scope["headers"]}
        path = scope["path"]
        is_keyed = _is_api_path(path) or (self.is_metrics_key_required and _is_ops_path(path))
        if self.api_keys and is_keyed and not self._is_authorized(headers):
            error = JSONResponse(
                error_body("Missing or invalid API key: send `Authorization: Bearer <key>`.", INVALID_REQUEST,
                           code="invalid_api_key"),
                status_code=401, headers={"WWW-Authenticate": "Bearer"})
            await error(scope, receive, send)
            return
        try:  # the API route's GenerateRequests carry it (router/scheduler_client.py)
            if _is_api_path(path):
                current_tenant.set(tenant_for(headers.get("authorization", b""), self.api_keys,
                                              headers.get(self.tenant_header) if self.tenant_header else None))
        except InvalidTenant as exc:
            await JSONResponse(error_body(str(exc), INVALID_REQUEST, code="invalid_tenant"),
                               status_code=400)(scope, receive, send)
            return
        declared = headers.get("content-length")
        if declared is not None and declared.isdigit():
            if int(declared) > self.max_body_bytes:
                await self._too_large(scope, receive, send)
                return
            await self.app(scope, receive, send)  # the server holds the body to its declared length
            return
        # No declared length (chunked): read the body here, bounded, then replay it to the app.
        messages: list[Message] = []
        num_bytes = 0
        while not messages or messages[-1].get("more_body", False):
            message = await receive()
            if message["type"] != "http.request":
                return  # the client left mid-body
            num_bytes += len(message.get("body", b""))
            if num_bytes > self.max_body_bytes:
                await self._too_large(scope, receive, send)
                return
            messages.append(message)

        async def replay() -> Message:
            return messages.pop(0) if messages else await receive()

        await self.app(scope, replay, send)

    def _is_authorized(self, headers: dict[str, bytes]) -> bool:
        return is_authorized(headers.get("authorization", b""), self.api_keys)

    async def _too_large(self, scope: Scope, receive: Receive, send: Send) -> None:
        error = JSONResponse(
            error_body(f"The request body is larger than {self.max_body_bytes} bytes.", INVALID_REQUEST,
                       code="request_too_large"),
            status_code=413)
        await error(scope, receive, send)


def is_authorized(authorization: bytes, api_keys: list[bytes]) -> bool:
    """Whether an `Authorization` header (HTTP) or metadata value (gRPC) is `Bearer <one of api_keys>`."""
    return matching_key(authorization, api_keys) is not None


def _is_api_path(path: str) -> bool:
    return path.startswith(("/v1/", "/v2/")) or path in ("/v1", "/v2", "/tokenize", "/detokenize")


def _is_ops_path(path: str) -> bool:
    """What operators read: /metrics and /status (a key is asked for with is_metrics_key_required)."""
    return path in ("/metrics", "/status") or path.startswith(("/metrics/", "/status/"))


router = APIRouter()


@router.get("/health")
async def health() -> dict:
    return {"status": "ok"}


@router.get("/ready", responses={503: {"description": "Not ready yet", "content": {"application/json": {"schema": {
    "type": "object", "properties": {"status": {"const": "not_ready"}, "reason": {"type": "string"}},
    "required": ["status", "reason"]}}}}})
async def ready(state: StateDep) -> JSONResponse:
    if state.drain.is_draining:
        return JSONResponse({"status": "not_ready", "reason": "shutting down"}, status_code=503)
    health = await state.scheduler.health()
    if health.is_ready:
        return JSONResponse({"status": "ready"})
    return JSONResponse({"status": "not_ready", "reason": health.detail or "the worker is not ready"},
                        status_code=503)


@router.get("/metrics", response_class=PlainTextResponse)
async def metrics_text(state: StateDep) -> Response:
    return Response(await state.metrics.render(state.scheduler), media_type=CONTENT_TYPE_LATEST)
