"""The router's Prometheus metrics, under vLLM's names so existing dashboards work.

In: each request's stream of scheduler events, watched by a `RequestTracker` (a StreamObserver that
generation.generate_deltas tells what it takes, under every endpoint), and the scheduler's GetStats at scrape
time. Out: `RouterMetrics.registry`, rendered by GET /metrics (ops.py).

Request histograms and counters are labelled with the protocol the request came in on (`protocol`: "http", or
"grpc" for the public gRPC API: `ProtocolMetrics`); load gauges, speculation counters, the drafting budget and
the gate's state per segment kind, the gate's latest decision and each drafter's corpus sizes come from the
scheduler's GetStats (`SchedulerStatsCollector`).
"""

from __future__ import annotations

from collections.abc import Iterator

import grpc
from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from protos.segserve.v1.generate import GenerateComplete, GenerateEvent, TokenChunk
from router.generation import OPENAI_FINISH_REASONS
from router.scheduler_client import SchedulerApi, SchedulerLoad
from router.scheduler_streams import StreamObserver

# vLLM's buckets, so percentiles line up with its dashboards.
_TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
_ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                40.0, 80.0)
_REQUEST_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0,
                    240.0, 480.0, 960.0, 1920.0, 7680.0)


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
        entries = GaugeMetricFamily("segserve:drafter_corpus_entries", "Learned tokens held in a replica's corpus.",
                                    labels=["model_name", "address", "segment"])
        num_bytes = GaugeMetricFamily("segserve:drafter_corpus_bytes", "Memory of a replica's corpus arrays.",
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
        self.http = ProtocolMetrics(self, "http")
        """The HTTP routes' request series (the gRPC API binds its own, protocol="grpc")."""

    async def render(self, client: SchedulerApi) -> bytes:
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


class RequestTracker(StreamObserver):
    """One request's timeline as the router reads it off the scheduler's stream, observed into its protocol's
    series: time to first token, inter-token latency, end to end, queue time, tokens, and how it ended ("abort":
    closed before its end, the client went away)."""

    def __init__(self, metrics: ProtocolMetrics) -> None:
        self.metrics = metrics
        self.started_s = 0.0
        self.last_chunk_s: float | None = None
        self.is_ended = False

    def opened(self, now_s: float) -> None:
        self.started_s = now_s

    def took(self, events: list[GenerateEvent], now_s: float) -> None:
        for event in events:
            self._observe(event, now_s)

    def _observe(self, event: GenerateEvent, now_s: float) -> None:
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
            m.request_success.labels(*m.labels, OPENAI_FINISH_REASONS[event.finish_reason]).inc()
        else:
            m.request_failure.labels(*m.labels, event.code).inc()

    def closed(self) -> None:
        if not self.is_ended:  # the stream was closed early: the client went away
            self.metrics.request_success.labels(*self.metrics.labels, "abort").inc()
