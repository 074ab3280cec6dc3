"""The scheduler's own statistics as protobuf (scheduler.proto's SchedulerStats), at the service's edge.

Requests and events need no code here: they are the contract's types
(GenerateRequest.from_pb, TokenChunk/GenerateComplete/GenerateError.to_pb).
"""

from __future__ import annotations

from collections.abc import Sequence

from protos.segserve.v1 import scheduler_pb2
from protos.segserve.v1.stats import DrafterReplicaStats
from scheduler.engine import EngineStats
from scheduler.spec_policy import SegmentStats


def stats_to_pb(stats: EngineStats, drafters: Sequence[DrafterReplicaStats] = ()) -> scheduler_pb2.SchedulerStats:
    """Every segment kind that was verified, given a budget or gated gets a SpecStats; `drafters`: each replica."""
    spec = _spec_to_pb("", stats.spec)
    if stats.gate_decision is not None:
        spec.gate_batch_bucket, spec.is_drafting = stats.gate_decision
    names = sorted(set(stats.spec_segments) | set(stats.spec_budgets) | set(stats.gate_segments))
    return scheduler_pb2.SchedulerStats(
        num_running=stats.num_running, num_waiting=stats.num_waiting,
        num_used_kv_blocks=stats.num_used_kv_blocks, num_total_kv_blocks=stats.num_total_kv_blocks,
        num_preemptions=stats.num_preemptions, num_steps=stats.num_steps, spec=spec,
        spec_segments=[_spec_to_pb(name, stats.spec_segments.get(name, SegmentStats()), stats.spec_budgets.get(name, 0),
                                   stats.gate_segments.get(name, (0, False))) for name in names],
        num_prefix_cache_queries=stats.num_prefix_cache_queries, num_prefix_cache_hits=stats.num_prefix_cache_hits,
        num_workers=stats.num_workers, num_live_workers=stats.num_live_workers,
        num_moved_requests=stats.num_moved_requests, drafters=[d.to_pb() for d in drafters])


def _spec_to_pb(segment: str, stats: SegmentStats, budget: int = 0,
                gate: tuple[int, bool] = (0, False)) -> scheduler_pb2.SpecStats:
    return scheduler_pb2.SpecStats(
        segment=segment, num_verified=stats.num_verified, num_draft_tokens=stats.num_draft_tokens,
        num_accepted_tokens=stats.num_accepted_tokens, acceptance_rate_by_depth=stats.acceptance_rate_by_depth,
        num_accepted_by_depth=stats.num_accepted_by_depth, is_drafting=budget > 0, num_budget_nodes=budget,
        gate_batch_bucket=gate[0], is_gate_open=gate[1])
