"""Tracing on in the test's own process, exporting to an OTLP receiver there (segserve/bench/otlp_receiver.py)."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from types import SimpleNamespace

from common import tracing
from segserve.bench.otlp_receiver import ReceivedSpan, start_receiver

TRACE_ID, PARENT_ID = "4bf92f3577b34da6a3ce929d0e0e4736", "00f067aa0ba902b7"
"""A client's trace and span, as its `traceparent` names them."""
TRACEPARENT = f"00-{TRACE_ID}-{PARENT_ID}-01"


@contextlib.contextmanager
def traced(service: str = "test", ratio: float = 1.0) -> Iterator[Callable[[], list[ReceivedSpan]]]:
    """Tracing on as segserve-`service` for the block; yields `spans()`, which exports what is queued and returns
    every span received so far. Tracing is off again after the block."""
    server, port, collector = start_receiver()
    tracing.setup(service, SimpleNamespace(otlp_traces_endpoint=f"http://127.0.0.1:{port}", trace_sample_ratio=ratio))

    def spans() -> list[ReceivedSpan]:
        assert tracing.force_flush()
        return collector.spans()

    try:
        yield spans
    finally:
        tracing.shutdown()
        server.stop(None)
