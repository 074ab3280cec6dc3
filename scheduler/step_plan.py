"""StepPlan: one worker step as the Scheduler decided it, from schedule() to postprocess().

Scheduler.schedule() makes one (the sequences chosen, and which of them the drafter is asked about);
the engine's draft stage asks the drafter (Speculator.draft); Scheduler.finish_plan() fits the trees into it
or lets it take several decode steps; the worker runs its request; Scheduler.postprocess() applies the result.
Scheduler.schedule_ahead() makes a final one at once, for the step after the one in flight (async scheduling).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple

from protos.segserve.v1.step import StepRequest
from scheduler.sequence import Sequence
from scheduler.spec_gate import GateDecision


class DraftChoice(NamedTuple):
    """Who decides about drafting (drafting.DraftChooser) answers with this for one step."""

    queries: tuple[tuple[Sequence, int], ...] = ()
    """The decode sequences the drafter is asked about, each with its node budget (0: for its segment kind only,
    no tree)."""
    is_drafting: bool = False
    """Whether some kind of the step was let draft, whether or not a tree comes: then the step takes one decode
    step, as a drafter that found no tree this step may find one at the next, which several would skip."""
    decision: GateDecision | None = None
    """The speculation gate's decision for the step (None: the gate was not asked)."""
    node_price: float = 0.0
    """What one more draft token costs the step, in accepted tokens (SpecPolicy.node_price): the drafter leaves
    out the nodes less likely to be accepted."""


NO_DRAFTS = DraftChoice()


@dataclass(eq=False)
class StepPlan:
    """One worker step: its request, and what the engine's stages around it need to know."""

    request: StepRequest
    """What the worker runs: final once finish_plan() has run (at once for a step ahead)."""
    seqs: list[Sequence] = field(default_factory=list)
    """The sequences the step runs, in request order."""
    queries: tuple[tuple[Sequence, int], ...] = ()
    """DraftChoice.queries: whom the drafter is asked about before the step goes."""
    is_drafting: bool = False
    """DraftChoice.is_drafting."""
    node_price: float = 0.0
    """DraftChoice.node_price."""
    decision: GateDecision | None = None
    """The gate's decision for the step, for the speculation policy's measure of whole cycles (None: the gate
    was not asked, or the drafter failed: the cycle is not the decision's)."""
    is_ahead: bool = False
    """Built by schedule_ahead(): sent before the step it follows answered, it waits at the worker for that one,
    so its round trip is not its cost."""
    forced_seq_ids: frozenset[str] = frozenset()
    """The sequences whose tree starts with their grammar's forced span (finish_plan): their acceptance is not the
    drafter's, so the speculation stats leave them out."""
    trace_span: object | None = None
    """The step's span while it runs, when a request of it is traced (scheduler/traces.py); else None."""
