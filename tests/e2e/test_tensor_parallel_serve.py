"""`segserve serve --tensor-parallel-size 2`, as a user runs it: two workers of two ranks each (gloo between CPU
processes). Greedy streams with speculation are transformers' `generate` output; a follower rank SIGKILLed mid-run
takes its worker down as one unit, the scheduler moves that worker's requests, none fails, and the supervisor brings
the worker back with both its ranks. Stopping the stack leaves no rank running."""

from __future__ import annotations

import psutil
import pytest

from tests.e2e.test_scale_out import references  # noqa: F401 (fixture)
from tests.e2e.test_serve_supervision import Serve, streams_with_a_kill, until
from tests.e2e.test_stack import PROMPTS

pytestmark = pytest.mark.e2e


def followers(worker: psutil.Process) -> list[psutil.Process]:
    """The follower ranks a worker process started (`python -m worker.follower`)."""
    found = []
    for child in worker.children():
        try:
            if child.cmdline()[1:3] == ["-m", "worker.follower"] and child.status() != psutil.STATUS_ZOMBIE:
                found.append(child)
        except psutil.Error:
            continue
    return found


def test_a_killed_rank_fails_no_request_and_its_worker_comes_back(tiny_gemma3_dir, references,  # noqa: F811
                                                                  tmp_path):
    serve = Serve(tiny_gemma3_dir, tmp_path, "--workers", "2", "--tensor-parallel-size", "2")
    try:
        serve.wait_ready()
        client, model = serve.client()
        expected = [references[p] for p in PROMPTS * 2]
        workers = serve.services("worker")
        assert len(workers) == 2 and serve.stats().num_live_workers == 2
        assert all(len(followers(worker)) == 1 for worker in workers)

        victim = followers(workers[1])[0]
        texts, _, _ = streams_with_a_kill(client, model, victim)
        assert texts == expected
        until(lambda: not workers[1].is_running() or workers[1].status() == psutil.STATUS_ZOMBIE, 30,
              "rank 0's exit with its follower")
        assert serve.stats().num_moved_requests > 0

        def both_back() -> bool:
            live = serve.services("worker")
            stats = serve.stats()
            return (len(live) == 2 and all(len(followers(w)) == 1 for w in live) and stats is not None
                    and stats.num_live_workers == 2)

        until(both_back, 120, "the worker's return with both ranks")
        texts, _, _ = streams_with_a_kill(client, model, followers(serve.services("worker")[0])[0])
        assert texts == expected
        assert "tensor-parallel rank 1 died: the worker stops with it" in "".join(serve.output) + _logs(tmp_path)
    finally:
        children = psutil.Process(serve.process.pid).children(recursive=True)
        code = serve.stop()
    assert code == 0, "".join(serve.output)[-4000:]
    _, alive = psutil.wait_procs(children, timeout=30)
    assert not alive, f"left running after the stack stopped: {[p.cmdline()[:4] for p in alive]}"


def _logs(log_dir) -> str:
    return "".join(path.read_text(errors="replace") for path in log_dir.glob("*.log"))
