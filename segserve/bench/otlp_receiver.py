"""A minimal OTLP/gRPC trace receiver (opentelemetry.proto's TraceService): it keeps what it is sent.

For measuring and checking segserve's traces without a collector: `segserve bench router --tracing` runs one in
a process of its own (`python -m segserve.bench.otlp_receiver --port N --out FILE`, which writes its counts to
FILE when SIGTERM stops it), and the end-to-end tracing test starts one in its process (`start_receiver`) and
reads the spans back (`SpanCollector.spans`).
"""

from __future__ import annotations

import argparse
import json
import signal
import threading
from concurrent import futures
from dataclasses import dataclass
from pathlib import Path

import grpc
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc
from opentelemetry.proto.common.v1 import common_pb2


@dataclass(frozen=True)
class ReceivedSpan:
    """One exported span, ids in hex ("" for no parent)."""

    service: str
    """Its resource's service.name."""
    name: str
    trace_id: str
    span_id: str
    parent_span_id: str
    attributes: dict
    links: tuple[tuple[str, str], ...]
    """(trace id, span id) of each span it links to."""
    is_error: bool
    """Its status is ERROR."""


def _value(value: common_pb2.AnyValue):
    kind = value.WhichOneof("value")
    return getattr(value, kind) if kind in ("string_value", "bool_value", "int_value", "double_value") else None


class SpanCollector(trace_service_pb2_grpc.TraceServiceServicer):
    """The TraceService: every ExportTraceServiceRequest it receives, kept in order (thread-safe)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._requests: list[trace_service_pb2.ExportTraceServiceRequest] = []

    def Export(self, request, context):
        with self._lock:
            self._requests.append(request)
        return trace_service_pb2.ExportTraceServiceResponse()

    @property
    def num_exports(self) -> int:
        with self._lock:
            return len(self._requests)

    def spans(self) -> list[ReceivedSpan]:
        """Every span received so far."""
        with self._lock:
            requests = list(self._requests)
        spans = []
        for request in requests:
            for resource_spans in request.resource_spans:
                resource = {a.key: _value(a.value) for a in resource_spans.resource.attributes}
                for scope_spans in resource_spans.scope_spans:
                    for span in scope_spans.spans:
                        spans.append(ReceivedSpan(
                            resource.get("service.name", ""), span.name, span.trace_id.hex(), span.span_id.hex(),
                            span.parent_span_id.hex(), {a.key: _value(a.value) for a in span.attributes},
                            tuple((link.trace_id.hex(), link.span_id.hex()) for link in span.links),
                            span.status.code == span.status.STATUS_CODE_ERROR))
        return spans


def start_receiver(host: str = "127.0.0.1", port: int = 0) -> tuple[grpc.Server, int, SpanCollector]:
    """A started receiver on host:port (0 = a free port): the server, the bound port and its collector."""
    collector = SpanCollector()
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
    trace_service_pb2_grpc.add_TraceServiceServicer_to_server(collector, server)
    bound = server.add_insecure_port(f"{host}:{port}")
    if bound == 0:
        raise OSError(f"cannot bind the OTLP receiver to {host}:{port}")
    server.start()
    return server, bound, collector


def counts(collector: SpanCollector) -> dict:
    """What a run received: exports, spans, spans per service."""
    spans = collector.spans()
    services: dict[str, int] = {}
    for span in spans:
        services[span.service] = services.get(span.service, 0) + 1
    return {"num_exports": collector.num_exports, "num_spans": len(spans), "services": services}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--out", required=True, help="JSON file the counts are written to on SIGTERM or SIGINT")
    args = parser.parse_args()
    server, _, collector = start_receiver(args.host, args.port)
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    stop.wait()
    server.stop(grace=2.0).wait()
    Path(args.out).write_text(json.dumps(counts(collector)))


if __name__ == "__main__":
    main()
