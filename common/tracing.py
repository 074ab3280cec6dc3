"""Distributed traces with OpenTelemetry: one TracerProvider per process, W3C trace context between the services.

A leaf module (OpenTelemetry and stdlib only), so every service may import it. Off unless a service's config
names an OTLP endpoint (FIELDS, the same two fields in every service's config): `setup` then builds this
process's provider (resource service.name `segserve-<service>`, sampler ParentBased(TraceIdRatioBased(ratio)),
a BatchSpanProcessor exporting over OTLP gRPC), and `shutdown` flushes what is still queued on the way out.

Only the router starts traces (a request's span, or a child of the client's `traceparent`); the scheduler,
workers and drafters only continue one: their spans need a parent that came with the call (`span`, `extract`),
so an untraced request or step costs them nothing. The context travels as W3C `traceparent` (and `tracestate`),
written and read by OpenTelemetry's TraceContextTextMapPropagator: in a message field (`inject` / `extract`,
where one call carries many requests or steps: GenerateRequest.trace_context, StepRequest.trace_context) or
in a unary call's gRPC metadata (`grpc_metadata` / `from_call`: Draft). Only sampled spans are propagated.

While tracing is off, each function the services call per request or step returns at its first line (no span
object, nothing injected): the hot paths pay a call of tens of nanoseconds where they ask.
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, MutableMapping
from dataclasses import dataclass, fields
from urllib.parse import urlparse

from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

logger = logging.getLogger(__name__)



@dataclass
class TracingFields:
    """Tracing: fields every service's config has (it derives from this class)."""

    otlp_traces_endpoint: str = ""
    """OTLP gRPC endpoint this service's spans go to (e.g. http://localhost:4317); empty = no tracing.
    http://host:port is plaintext, https://host:port TLS (OTEL_EXPORTER_OTLP_CERTIFICATE names a CA)."""
    trace_sample_ratio: float = 1.0
    """Share of the traces this service starts, in [0, 1] (with otlp_traces_endpoint). The router starts one per
    request (a request with a `traceparent` follows its sampled flag instead); the other services continue the
    router's (ParentBased), so the router's ratio is the one that counts."""


FIELDS = tuple(field.name for field in fields(TracingFields))
"""TracingFields' fields."""

SERVICE_PREFIX = "segserve-"
"""A process's service.name is this and its service: segserve-router, -scheduler, -worker, -drafter."""

_PROPAGATOR = TraceContextTextMapPropagator()
NO_SPAN = contextlib.nullcontext()
"""What the context managers here return when there is nothing to trace: a block run as it is."""


@dataclass(frozen=True)
class TraceSettings:
    """One process's tracing: where spans go and how many traces are kept."""

    endpoint: str
    """OTLP gRPC endpoint, http://host:port (plaintext) or https://host:port (TLS)."""
    sample_ratio: float
    """Share of new traces kept (ParentBased: a continued trace keeps its parent's decision)."""


def settings_of(config: object) -> TraceSettings | None:
    """The tracing of a service's config (its FIELDS): None when off (no endpoint); ValueError naming the field
    for an endpoint that is not an http(s)://host:port URL or a ratio outside [0, 1]."""
    endpoint, ratio = (getattr(config, name) for name in FIELDS)
    if not 0.0 <= ratio <= 1.0:
        raise ValueError(f"trace_sample_ratio must be in [0, 1] (got {ratio})")
    if not endpoint:
        return None
    url = urlparse(endpoint)
    if url.scheme not in ("http", "https") or not url.hostname or url.path not in ("", "/"):
        raise ValueError(f"otlp_traces_endpoint must be http://host:port (plaintext) or https://host:port (TLS), "
                         f"e.g. http://localhost:4317 (got {endpoint!r})")
    try:
        url.port
    except ValueError:
        raise ValueError(f"otlp_traces_endpoint has no valid port: {endpoint!r}") from None
    return TraceSettings(endpoint, ratio)


_provider = None
"""This process's TracerProvider while tracing is on."""
_tracer: trace.Tracer | None = None
"""Its tracer; None = tracing is off."""


def setup(service: str, config: object) -> bool:
    """Start tracing this process as segserve-`service` when `config` names an endpoint; True if it did. The
    standard OTEL_EXPORTER_OTLP_* variables (certificate, headers, timeout) and OTEL_RESOURCE_ATTRIBUTES apply."""
    global _provider, _tracer
    settings = settings_of(config)
    if settings is None:
        return False
    from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor
    from opentelemetry.sdk.trace.sampling import ParentBased, TraceIdRatioBased

    shutdown()
    resource = Resource.create({"service.name": SERVICE_PREFIX + service,
                                "service.instance.id": f"{socket.gethostname()}:{os.getpid()}"})
    provider = TracerProvider(resource=resource, sampler=ParentBased(TraceIdRatioBased(settings.sample_ratio)))
    exporter = OTLPSpanExporter(endpoint=settings.endpoint, insecure=urlparse(settings.endpoint).scheme == "http")
    provider.add_span_processor(BatchSpanProcessor(exporter))
    _provider, _tracer = provider, provider.get_tracer("segserve")
    logger.info("tracing on: spans of %s%s go to %s (sample ratio %g)", SERVICE_PREFIX, service, settings.endpoint,
                settings.sample_ratio)
    return True


def shutdown() -> None:
    """Export the spans still queued and stop tracing (a no-op when it is off)."""
    global _provider, _tracer
    provider, _provider, _tracer = _provider, None, None
    if provider is not None:
        provider.shutdown()  # flushes the BatchSpanProcessor


def force_flush(timeout_ms: int = 5000) -> bool:
    """Export the spans queued so far now; True when they went (or tracing is off)."""
    return _provider is None or _provider.force_flush(timeout_ms)


def is_enabled() -> bool:
    return _tracer is not None


def start_span(name: str, parent: otel_context.Context | None, *, kind: trace.SpanKind = trace.SpanKind.INTERNAL,
               attributes: Mapping[str, object] | None = None, links: Iterable[otel_context.Context] = (),
               start_ns: int | None = None) -> trace.Span | None:
    """A span under `parent` (None: a new trace), linked to the spans of `links`; None when tracing is off.
    End it with `end_span`."""
    if _tracer is None:
        return None
    span_links = [trace.Link(trace.get_current_span(link).get_span_context()) for link in links]
    return _tracer.start_span(name, parent if parent is not None else otel_context.Context(), kind, attributes,
                              span_links, start_ns)


def end_span(span: trace.Span | None, error: str = "", end_ns: int | None = None) -> None:
    """End `span` (None: nothing), with an error status when `error` says what failed."""
    if span is None:
        return
    if error:
        set_error(span, error)
    span.end(end_ns)


def set_error(span: trace.Span, error: str) -> None:
    """Mark `span` failed, `error` saying how."""
    span.set_status(trace.Status(trace.StatusCode.ERROR, error))


def context_of(span: trace.Span) -> otel_context.Context:
    """The context whose current span is `span`: a child's parent."""
    return trace.set_span_in_context(span, otel_context.Context())


def span(name: str, parent: otel_context.Context | None = None, *, kind: trace.SpanKind = trace.SpanKind.INTERNAL,
         attributes: Mapping[str, object] | None = None):
    """A context manager running its block in a span under `parent` (None: the current span), which it makes
    current; an exception leaving the block marks it failed. Nothing when tracing is off or there is no sampled
    parent: below the router, a span continues a trace and never starts one."""
    if _tracer is None:
        return NO_SPAN
    if not trace.get_current_span(parent).get_span_context().trace_flags.sampled:
        return NO_SPAN
    return _tracer.start_as_current_span(name, parent, kind, attributes)


def root_span(name: str, carrier: Mapping[str, str], *, kind: trace.SpanKind = trace.SpanKind.SERVER,
              attributes: Mapping[str, object] | None = None):
    """A context manager running its block in a span made current: a child of the W3C context in `carrier` (a
    client's `traceparent`), or a new trace's root when it has none. Nothing when tracing is off."""
    if _tracer is None:
        return NO_SPAN
    return _tracer.start_as_current_span(name, _PROPAGATOR.extract(carrier), kind, attributes)


def attached(parent: otel_context.Context | None):
    """A context manager making `parent` the current context for its block (None: nothing)."""
    if parent is None:
        return NO_SPAN
    return _attached(parent)


@contextlib.contextmanager
def _attached(parent: otel_context.Context) -> Iterator[None]:
    token = otel_context.attach(parent)
    try:
        yield
    finally:
        otel_context.detach(token)


def current_span() -> trace.Span | None:
    """The current span when it records (tracing on, sampled), else None."""
    if _tracer is None:
        return None
    current = trace.get_current_span()
    return current if current.is_recording() else None


def inject(carrier: MutableMapping[str, str], parent: otel_context.Context | None = None) -> None:
    """Write the W3C context of `parent` (None: the current context) into `carrier` (a dict, a protobuf map
    field); nothing when tracing is off or its span is not sampled."""
    if _tracer is None:
        return
    if trace.get_current_span(parent).get_span_context().trace_flags.sampled:
        _PROPAGATOR.inject(carrier, parent)


def extract(carrier: Mapping[str, str] | Iterable[tuple[str, str]]) -> otel_context.Context | None:
    """The context a carrier (a mapping, or (key, value) pairs) holds, None when tracing is off or it holds no
    valid span context."""
    if _tracer is None or not carrier:
        return None
    found = _PROPAGATOR.extract(carrier if isinstance(carrier, Mapping) else dict(carrier))
    return found if trace.get_current_span(found).get_span_context().is_valid else None


def grpc_metadata() -> tuple[tuple[str, str], ...] | None:
    """The current context as a unary call's gRPC metadata (`traceparent`, `tracestate`); None when tracing is
    off or there is no sampled span (gRPC then sends no metadata of ours)."""
    if _tracer is None:
        return None
    carrier: dict[str, str] = {}
    inject(carrier)
    return tuple(carrier.items()) or None


def from_call(context) -> otel_context.Context | None:
    """The trace context a unary call's metadata carries (`context`: its grpc servicer context); None when
    tracing is off or none came."""
    if _tracer is None:
        return None
    metadata = context.invocation_metadata() or ()
    return extract({key: value for key, value in metadata if isinstance(value, str) and key in _PROPAGATOR.fields})


def epoch_ns(clock_s: float, clock: Callable[[], float] = time.monotonic) -> int:
    """The wall-clock time in ns (what spans are stamped with) of `clock_s`, a reading of `clock`."""
    return time.time_ns() - round((clock() - clock_s) * 1e9)
