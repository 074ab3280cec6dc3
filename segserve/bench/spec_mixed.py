"""The mixed mode of `segserve bench spec` (--mixed-concurrency N): every workload's requests interleaved at N
streams, as a shared server sees them.

In: one system (a factory of `complete` callables, spec_systems.py) and the workloads. Out: one `mixed` record:
the held-out requests' tokens and wall time measured together, the servers' counter deltas, the greedy
workloads' outputs joined in order (what the mismatch check compares), and every request's output, warm-ups too
(what `segserve bench spec-replay` replays through drafters). Each workload's requests carry its tenant.
"""

from __future__ import annotations

import itertools
import sys
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from contextlib import AbstractContextManager

from segserve.bench.spec_workloads import MIXED, WARMUP_PROMPT, Workload

SystemFactory = Callable[[], AbstractContextManager]


def run_mixed(name: str, factory: SystemFactory, workloads: list[Workload], max_tokens: int,
              concurrency: int) -> dict:  # fmt: skip
    """The mixed mode: every workload's warm-up requests interleaved at `concurrency` streams (they teach the
    drafters), then the held-out ones, measured together: one `mixed` record of their tokens, wall time, counter
    deltas (the servers' own), the greedy workloads' outputs joined in order (what mismatches compare) and every
    request's output, warm-ups too; a system that fails is reported."""
    warmup, heldout = _interleaved(workloads, max_tokens)
    try:
        with factory() as complete:
            for _ in range(2):
                complete(WARMUP_PROMPT, min(16, max_tokens))
            warmed = _side_by_side(complete, warmup, concurrency)
            counters = getattr(complete, "counters", lambda: None)
            before = counters()
            started_at = time.perf_counter()
            results = _side_by_side(complete, heldout, concurrency)
            wall_s = time.perf_counter() - started_at
            after = counters()
    except Exception as exc:  # a benchmark reports a system that would not run; it does not crash
        return {"name": name, "error": f"{type(exc).__name__}: {exc}", "workloads": {}}
    from segserve.bench.spec_systems import counter_delta

    texts = [r["text"] for r, (workload, *_) in zip(results, heldout) if workload.is_greedy]
    record = {"num_tokens": sum(r["num_tokens"] for r in results), "wall_s": wall_s, "text": "\n\x1e\n".join(texts),
              "spec": counter_delta(before, after) if before and after else None, "concurrency": concurrency,
              "requests": [{"kind": w.kind, "index": i, "num_tokens": r["num_tokens"], "wall_s": r["wall_s"],
                            "text": r["text"]} for r, (w, i, *_) in zip(results, heldout)],
              "warmup": [{"kind": w.kind, "index": i, "text": r["text"]} for r, (w, i, *_) in zip(warmed, warmup)]}
    print(f"[bench spec] {name} {MIXED} at {concurrency} streams: {record['num_tokens'] / wall_s:.1f} tok/s",
          file=sys.stderr, flush=True)
    return {"name": name, "workloads": {MIXED: [record]}}


def _interleaved(workloads: list[Workload], max_tokens: int) -> tuple[list[tuple], list[tuple]]:
    """(workload, index, prompt, max_tokens, seed) of every warm-up request, then of every held-out one, one from
    each workload in turn."""
    def requests(workload: Workload, warm: bool) -> list[tuple]:
        indices = range(workload.num_warmup) if warm else range(workload.num_warmup, len(workload.prompts))
        return [(workload, i, workload.prompts[i], workload.max_tokens or max_tokens,
                 None if workload.is_greedy else workload.seed + i) for i in indices]

    def merged(warm: bool) -> list[tuple]:
        columns = itertools.zip_longest(*(requests(w, warm) for w in workloads))
        return [request for column in columns for request in column if request is not None]

    return merged(True), merged(False)


def _side_by_side(complete, requests: list[tuple], concurrency: int) -> list[dict]:
    """Every request, `concurrency` at a time, each under its workload's tenant; results in the requests' order."""
    def send(request: tuple) -> dict:
        workload, _, prompt, length, seed = request
        return complete(prompt, length, workload.temperature, seed, tenant=workload.tenant or workload.kind,
                        is_measured=False)

    with ThreadPoolExecutor(concurrency) as pool:
        return list(pool.map(send, requests))
