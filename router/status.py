"""GET /status: the cluster at a glance as JSON, for people (`segserve top`) rather than for Prometheus.

In: the app's RouterState: the scheduler's (or every live scheduler's, added up)
Health and GetStats, read now, and the router's own reflow recorder. Out: one
JSON object (`status_body`): each component's health, running and waiting
requests, KV usage, the prefix cache's hit rate, acceptance and drafting state
(the policy's budget) and the speculation gate's state per segment kind, the gate's latest decision,
each drafter replica (live or backing off, corpus size per segment kind) and the
reflow backlog. Open like /metrics (the same numbers; no request content).
A scheduler that does not answer leaves its parts null; the route still answers 200.
"""

from __future__ import annotations

import time

import grpc
from fastapi import APIRouter

from protos.segserve.v1.stats import DrafterReplicaStats
from router.scheduler_client import SchedulerLoad
from router.state import StateDep

router = APIRouter()


@router.get("/status")
async def status(state: StateDep) -> dict:
    health = await state.scheduler.health()
    try:
        load = await state.scheduler.get_stats()
    except (grpc.aio.AioRpcError, ConnectionError):
        load = None
    recorder = state.recorder.stats() if state.recorder is not None else None
    body = status_body(load, health.is_ready, health.detail, state.drain.is_draining)
    body["model"] = state.served_name
    body["time"] = time.time()
    body["reflow"] = None if recorder is None else {
        "queue_depth": recorder.queue_depth, "oldest_chunk_age_s": recorder.queue_oldest_age_s,
        "buffered_chunks": recorder.buffered_chunks, "spill_bytes": recorder.spill_bytes,
        "num_chunks_recorded": recorder.num_chunks_recorded,
        "num_chunks_dropped": sum(recorder.num_chunks_dropped.values())}
    return body


def _ratio(part: int, whole: int) -> float | None:
    return part / whole if whole else None


def status_body(load: SchedulerLoad | None, is_ready: bool, detail: str, is_draining: bool) -> dict:
    """Everything but the reflow part; pure, so that it is tested without a stack."""
    components = {
        "router": "draining" if is_draining else "ok",
        "scheduler": "unreachable" if load is None else "ready" if is_ready else "not_ready",
        "workers": None if load is None else f"{load.num_live_workers}/{load.num_workers} live",
    }
    body = {"components": components, "detail": detail, "requests": None, "kv_cache": None, "prefix_cache": None,
            "speculation": None, "drafters": None}
    if load is None:
        return body
    body["requests"] = {"running": load.num_running, "waiting": load.num_waiting,
                        "preemptions": load.num_preemptions}
    body["kv_cache"] = {"used_blocks": load.num_used_kv_blocks, "total_blocks": load.num_total_kv_blocks,
                        "usage": _ratio(load.num_used_kv_blocks, load.num_total_kv_blocks)}
    body["prefix_cache"] = {"queries": load.num_prefix_cache_queries, "hits": load.num_prefix_cache_hits,
                            "hit_rate": _ratio(load.num_prefix_cache_hits, load.num_prefix_cache_queries)}
    spec = load.spec
    body["speculation"] = {
        "num_drafts": spec.num_drafts, "num_draft_tokens": spec.num_draft_tokens,
        "num_accepted_tokens": spec.num_accepted_tokens,
        "acceptance": _ratio(spec.num_accepted_tokens, spec.num_draft_tokens),
        "gate": None if not spec.gate_batch_bucket else {"batch_bucket": spec.gate_batch_bucket,
                                                         "is_open": spec.is_gate_open},
        "segments": [{"segment": s.segment, "num_drafts": s.num_drafts, "num_draft_tokens": s.num_draft_tokens,
                      "num_accepted_tokens": s.num_accepted_tokens,
                      "acceptance": _ratio(s.num_accepted_tokens, s.num_draft_tokens),
                      "accepted_per_draft": _ratio(s.num_accepted_tokens, s.num_drafts),
                      "is_drafting": s.is_drafting, "budget_nodes": s.num_budget_nodes,
                      "gate": None if not s.gate_batch_bucket else {"batch_bucket": s.gate_batch_bucket,
                                                                    "is_open": s.is_gate_open}}
                     for s in load.segments],
    }
    body["drafters"] = [_drafter(d) for d in load.drafters]
    return body


def _drafter(replica: DrafterReplicaStats) -> dict:
    stats = replica.stats
    return {"address": replica.address, "is_live": replica.is_live, "is_answering": stats is not None,
            "num_requests": None if stats is None else stats.num_requests,
            "segments": [] if stats is None else [
                {"segment": s.segment, "corpus_entries": s.num_corpus_entries, "corpus_bytes": s.num_corpus_bytes,
                 "num_requests": s.num_requests} for s in stats.segments]}
