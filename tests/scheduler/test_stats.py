"""The drafting state per segment kind, the gate's decision and the drafter replicas, from the engines to the
router's SchedulerLoad: merged over a scheduler's workers (EngineGroup), through SchedulerStats on the wire
(stats_to_pb, load_from_pb), and added up over several schedulers (the router's pool)."""

from __future__ import annotations

from types import SimpleNamespace

from protos.segserve.v1 import scheduler_pb2
from protos.segserve.v1.stats import DrafterReplicaStats, DrafterSegmentStats, DrafterStats
from router.scheduler_client import load_from_pb
from router.scheduler_pool import _total
from scheduler.config import SchedulerConfig
from scheduler.convert import stats_to_pb
from scheduler.engine import EngineStats
from scheduler.group import EngineGroup
from scheduler.spec_policy import SegmentStats

DRAFTERS = (DrafterReplicaStats("d1:50071", True, DrafterStats((DrafterSegmentStats("code", 7, 1960, 1),), 1)),
            DrafterReplicaStats("d2:50071", False))


def group_of(*parts: EngineStats) -> EngineGroup:
    group = EngineGroup(SchedulerConfig(worker_address="w0:1"), make_worker=None)
    group.engines = {f"w{i}:1": SimpleNamespace(stats=lambda p=p: p, is_connected=True) for i, p in enumerate(parts)}
    return group


def test_a_segment_drafts_and_the_gate_is_open_where_any_worker_says_so():
    a = EngineStats(spec_budgets={"code": 8, "default": 0}, gate_decision=(16, False))
    b = EngineStats(spec_budgets={"code": 0, "json": 4}, gate_decision=(1, True))
    merged = group_of(a, b).stats()
    assert merged.spec_budgets == {"code": 8, "default": 0, "json": 4}
    assert merged.gate_decision == (1, True)
    assert group_of(a, EngineStats()).stats().gate_decision == (16, False)
    assert group_of(EngineStats(), EngineStats()).stats().gate_decision is None


def test_drafting_state_and_drafters_reach_the_router_through_the_wire():
    stats = EngineStats(spec=SegmentStats(num_verified=3, num_draft_tokens=12, num_accepted_tokens=5),
                        spec_segments={"code": SegmentStats(num_verified=3, num_draft_tokens=12,
                                                            num_accepted_tokens=5)},
                        spec_budgets={"code": 6, "default": 0}, gate_decision=(4, True))
    pb = scheduler_pb2.SchedulerStats.FromString(stats_to_pb(stats, DRAFTERS).SerializeToString())
    load = load_from_pb(pb)
    # "default" was given a budget (0) but never verified: it shows, with zero counts.
    assert [(s.segment, s.num_drafts, s.is_drafting, s.num_budget_nodes) for s in load.segments] == [
        ("code", 3, True, 6), ("default", 0, False, 0)]
    assert (load.spec.gate_batch_bucket, load.spec.is_gate_open) == (4, True)
    assert load.drafters == DRAFTERS
    undecided = load_from_pb(stats_to_pb(EngineStats()))
    assert (undecided.spec.gate_batch_bucket, undecided.spec.is_gate_open, undecided.drafters) == (0, False, ())


def test_the_router_pool_adds_up_drafting_state_and_lists_each_drafter_once():
    one = load_from_pb(stats_to_pb(EngineStats(spec_budgets={"code": 0}, gate_decision=(16, False)), DRAFTERS))
    two = load_from_pb(stats_to_pb(EngineStats(spec_budgets={"code": 4}, gate_decision=(2, True)), DRAFTERS[:1]))
    total = _total([one, two])
    assert [(s.segment, s.num_budget_nodes) for s in total.segments] == [("code", 4)]
    assert (total.spec.is_gate_open, total.spec.gate_batch_bucket) == (True, 2)
    assert [d.address for d in total.drafters] == ["d1:50071", "d2:50071"]


def test_the_gates_state_per_segment_kind_is_merged_and_reaches_the_router():
    a = EngineStats(gate_segments={"code": (16, False), "prose": (16, False)})
    b = EngineStats(gate_segments={"code": (2, True), "json": (4, False)})
    merged = group_of(a, b).stats()  # open where any worker's gate is open, else the largest bucket
    assert merged.gate_segments == {"code": (2, True), "prose": (16, False), "json": (4, False)}
    load = load_from_pb(scheduler_pb2.SchedulerStats.FromString(stats_to_pb(merged).SerializeToString()))
    assert [(s.segment, s.gate_batch_bucket, s.is_gate_open, s.num_drafts) for s in load.segments] == [
        ("code", 2, True, 0), ("json", 4, False, 0), ("prose", 16, False, 0)]  # gated, never verified: shown
    other = load_from_pb(stats_to_pb(EngineStats(gate_segments={"prose": (8, True), "json": (8, False)})))
    total = _total([load, other])
    assert [(s.segment, s.gate_batch_bucket, s.is_gate_open) for s in total.segments] == [
        ("code", 2, True), ("json", 8, False), ("prose", 8, True)]
