"""common/tracing.py: the tracing fields every config validates, nothing at all while tracing is off, and the W3C
context carried through a message field or a call's metadata into child spans while it is on."""

from __future__ import annotations

import time
from types import SimpleNamespace

import pytest

from common import tracing
from drafter.config import DrafterConfig
from router.config import RouterConfig
from scheduler.config import SchedulerConfig
from tests.support.traces import PARENT_ID, TRACE_ID, TRACEPARENT, traced
from worker.config import WorkerConfig

CONFIGS = (RouterConfig, SchedulerConfig, WorkerConfig, DrafterConfig)


@pytest.mark.parametrize("cls", CONFIGS)
@pytest.mark.parametrize("fields, message", [
    ({"trace_sample_ratio": -0.1}, "trace_sample_ratio"),
    ({"trace_sample_ratio": 1.5}, "trace_sample_ratio"),
    ({"trace_sample_ratio": float("nan")}, "trace_sample_ratio"),
    ({"otlp_traces_endpoint": "localhost:4317"}, "otlp_traces_endpoint"),
    ({"otlp_traces_endpoint": "grpc://localhost:4317"}, "otlp_traces_endpoint"),
    ({"otlp_traces_endpoint": "http://localhost:port"}, "otlp_traces_endpoint"),
    ({"otlp_traces_endpoint": "http://localhost:4318/v1/traces"}, "otlp_traces_endpoint"),
    ({"otlp_traces_endpoint": "http://:4317"}, "otlp_traces_endpoint"),
])
def test_every_config_refuses_a_bad_endpoint_or_ratio_at_construction(cls, fields, message):
    with pytest.raises(ValueError, match=message):
        cls(**fields)


@pytest.mark.parametrize("cls", CONFIGS)
def test_tracing_is_off_by_default_and_on_with_an_endpoint(cls):
    assert tracing.settings_of(cls()) is None
    assert tracing.settings_of(cls(trace_sample_ratio=0.0)) is None
    on = cls(otlp_traces_endpoint="https://collector.example:4317", trace_sample_ratio=0.25)
    assert tracing.settings_of(on) == tracing.TraceSettings("https://collector.example:4317", 0.25)
    assert tracing.FIELDS == ("otlp_traces_endpoint", "trace_sample_ratio")


class _Call:
    """A grpc servicer context's metadata."""

    def __init__(self, *metadata: tuple[str, str]) -> None:
        self.metadata = metadata

    def invocation_metadata(self):
        return self.metadata


def test_while_off_nothing_is_made_or_sent():
    assert not tracing.is_enabled()
    assert not tracing.setup("router", RouterConfig())
    carrier: dict[str, str] = {}
    tracing.inject(carrier)
    assert carrier == {}
    assert tracing.grpc_metadata() is None
    assert tracing.extract({"traceparent": TRACEPARENT}) is None
    assert tracing.from_call(_Call(("traceparent", TRACEPARENT))) is None
    assert tracing.start_span("x", None) is None
    assert tracing.current_span() is None
    assert tracing.span("x") is tracing.NO_SPAN
    assert tracing.root_span("x", {"traceparent": TRACEPARENT}) is tracing.NO_SPAN
    assert tracing.attached(None) is tracing.NO_SPAN


def test_a_root_span_continues_the_clients_trace_and_its_context_parents_spans_elsewhere():
    with traced("router") as spans:
        with tracing.root_span("router.request", {"traceparent": TRACEPARENT}, attributes={"segserve.api": "v2"}):
            carrier: dict[str, str] = {}
            tracing.inject(carrier)  # a message field (GenerateRequest.trace_context)
            metadata = tracing.grpc_metadata()  # a unary call's
        assert dict(metadata) == carrier and set(carrier) == {"traceparent"}
        with tracing.span("from.field", tracing.extract(carrier)):
            pass
        with tracing.span("from.metadata", tracing.from_call(_Call(*metadata, ("authorization", "Bearer k")))):
            pass
        received = {span.name: span for span in spans()}
    root = received["router.request"]
    assert root.service == "segserve-router" and root.trace_id == TRACE_ID and root.parent_span_id == PARENT_ID
    assert root.attributes == {"segserve.api": "v2"}
    assert carrier["traceparent"] == f"00-{TRACE_ID}-{root.span_id}-01"
    for name in ("from.field", "from.metadata"):
        assert received[name].trace_id == TRACE_ID and received[name].parent_span_id == root.span_id


def test_without_a_traceparent_the_router_starts_a_trace_and_below_it_nothing_starts_one():
    with traced() as spans:
        with tracing.root_span("router.request", {}):
            pass
        with tracing.span("orphan"):  # a service below the router, given no context
            pass
        with tracing.span("from.nothing", tracing.extract({"traceparent": "not a traceparent"})):
            pass
        (root,) = spans()
    assert root.name == "router.request" and root.parent_span_id == "" and len(root.trace_id) == 32


def test_an_unsampled_trace_makes_no_span_and_sends_no_context():
    with traced(ratio=0.0) as spans:
        with tracing.root_span("router.request", {}):
            carrier: dict[str, str] = {}
            tracing.inject(carrier)
            assert carrier == {} and tracing.grpc_metadata() is None and tracing.current_span() is None
        with tracing.root_span("router.request", {"traceparent": TRACEPARENT.removesuffix("01") + "00"}):
            assert tracing.current_span() is None  # the client's unsampled flag is followed
        with tracing.root_span("router.request", {"traceparent": TRACEPARENT}):
            assert tracing.current_span() is not None  # and so is its sampled one, whatever the ratio
        assert [span.trace_id for span in spans()] == [TRACE_ID]


def test_an_exception_marks_the_span_failed_and_end_span_takes_an_error():
    with traced() as spans:
        with pytest.raises(RuntimeError):
            with tracing.root_span("fails", {}):
                raise RuntimeError("boom")
        span = tracing.start_span("ends", None, start_ns=tracing.epoch_ns(time.monotonic() - 1.0))
        tracing.end_span(span, "dropped")
        received = {span.name: span for span in spans()}
    assert received["fails"].is_error and received["ends"].is_error


def test_epoch_ns_places_a_clock_reading_on_the_wall_clock():
    now_ns = time.time_ns()
    assert abs(tracing.epoch_ns(time.monotonic() - 2.0) - (now_ns - 2_000_000_000)) < 50_000_000
    assert abs(tracing.epoch_ns(time.perf_counter(), time.perf_counter) - now_ns) < 50_000_000


def test_shutdown_exports_what_is_queued(monkeypatch):
    monkeypatch.setenv("OTEL_BSP_SCHEDULE_DELAY", "600000")
    with traced() as spans:
        with tracing.root_span("queued", {}):
            pass
        tracing.shutdown()  # as a service stopping does
        assert not tracing.is_enabled()
        assert [span.name for span in spans()] == ["queued"]


def test_setup_names_the_service_and_refuses_a_bad_config():
    with pytest.raises(ValueError, match="trace_sample_ratio"):
        tracing.setup("router", SimpleNamespace(otlp_traces_endpoint="http://localhost:4317", trace_sample_ratio=2))
    assert not tracing.is_enabled()
