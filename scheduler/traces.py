"""The scheduler's spans: a request's admission and its wait in the queue, and every engine step.

In: a traced request's W3C context (GenerateRequest.trace_context: its router.request span, common/tracing.py).
Out, under that span:
- scheduler.admission: the request's checks and its admission to the waiting queue (`admission`; a refusal
  marks it failed, with the reason);
- scheduler.queue: its arrival until its first step (emitted by the step that schedules it first);
- scheduler.step: one engine step, schedule -> draft -> worker step -> postprocess (`start_step` .. `end_step`).
  A step serves many requests but has one parent: the oldest traced request in its batch; it links to the
  others' spans (at most MAX_STEP_LINKS), so a request alone in the stack yields one connected tree, and a
  request in a shared step still finds its steps. The step's context goes to the worker in the StepRequest
  (trace_context: its forward and sample spans hang under it) and, while the drafter is asked (`drafting`),
  to the Draft call's metadata.
A request without a sampled context, and every step without one, costs a check: no span, nothing sent.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

from protos.segserve.v1.generate import GenerateRequest
from common import tracing

if TYPE_CHECKING:
    from scheduler.step_plan import StepPlan

MAX_STEP_LINKS = 32
"""Links of a step span to the traced requests of its batch that are not its parent."""


@dataclass(slots=True)
class RequestTrace:
    """A traced request's hold on its trace, on its Sequence."""

    parent: object
    """The router's span of the request (an OpenTelemetry Context): the parent of its scheduler spans."""
    traceparent: str
    """That span's W3C traceparent: the n generations of one router request share it."""
    is_queue_traced: bool = False
    """Its scheduler.queue span went out (at its first step)."""


def request_trace(request: GenerateRequest) -> RequestTrace | None:
    """The trace of a request that carries a sampled context; None otherwise (and while tracing is off)."""
    if not request.trace_context or not tracing.is_enabled():
        return None
    parent = tracing.extract(request.trace_context)
    return None if parent is None else RequestTrace(parent, dict(request.trace_context)["traceparent"])


def admission(request: GenerateRequest):
    """A context manager around a request's checks and admission: its scheduler.admission span (an exception
    leaving it, a refusal, marks it failed); nothing for an untraced request."""
    if not request.trace_context or not tracing.is_enabled():
        return tracing.NO_SPAN
    return tracing.span("scheduler.admission", tracing.extract(request.trace_context),
                        attributes={"segserve.request_id": request.request_id, "segserve.tenant": request.tenant})


def start_step(plan: StepPlan, started_s: float | None = None) -> None:
    """Open the step span of `plan` (started at `started_s`, a time.perf_counter() reading; None = now) when some
    request of it is traced, emit the queue spans of the requests it schedules first, and give the StepRequest
    the span's context."""
    if not tracing.is_enabled():
        return
    traced = [seq for seq in plan.seqs if seq.trace is not None]
    if not traced:
        return
    for seq in traced:
        if not seq.trace.is_queue_traced:
            seq.trace.is_queue_traced = True
            queued = tracing.start_span("scheduler.queue", seq.trace.parent,
                                        attributes={"segserve.request_id": seq.request_id},
                                        start_ns=tracing.epoch_ns(seq.arrival_time))
            tracing.end_span(queued, end_ns=tracing.epoch_ns(seq.first_scheduled_time or time.monotonic()))
    oldest = min(traced, key=lambda seq: seq.arrival_time)
    others = {seq.trace.traceparent: seq.trace.parent for seq in traced}  # one link per router span
    others.pop(oldest.trace.traceparent)
    links = list(others.values())[:MAX_STEP_LINKS]
    request = plan.request
    attributes = {"segserve.num_seqs": len(request.sequences), "segserve.num_tokens": request.num_scheduled_tokens,
                  "segserve.num_traced_seqs": len(traced), "segserve.is_ahead": plan.is_ahead}
    start_ns = None if started_s is None else tracing.epoch_ns(started_s, time.perf_counter)
    plan.trace_span = tracing.start_span("scheduler.step", oldest.trace.parent, attributes=attributes, links=links,
                                         start_ns=start_ns)
    tracing.inject(request.trace_context, tracing.context_of(plan.trace_span))


def drafting(plan: StepPlan):
    """A context manager making the step span current while the drafter is asked about the step (the Draft call
    carries it in its metadata); nothing for an untraced step."""
    return tracing.attached(None if plan.trace_span is None else tracing.context_of(plan.trace_span))


def end_step(plan: StepPlan, error: str = "") -> None:
    """Close the step span (a no-op for an untraced step, or one closed already); `error` marks it failed."""
    if plan.trace_span is not None:
        plan.trace_span.set_attribute("segserve.num_draft_tokens", plan.request.num_draft_tokens)
        tracing.end_span(plan.trace_span, error)
        plan.trace_span = None
