"""`segserve serve` keeps serving while its own processes die, as a user runs it: the command itself, as a process.

Two workers and two drafters under 16 greedy streams: one worker is SIGKILLed, then (under 16 more) one drafter.
No request fails, every output is its solo greedy reference, and the supervisor brings each one back. Then the
scheduler and the router are SIGKILLed in turn, and new requests are served again. A service that exits more often
than --max-restarts allows stops the stack, which names it. The times (kill to rejoin, the longest stall of a
stream) go to <tmp>/supervision.json for the record: timings are the benchmark's business, not asserted here.
"""

from __future__ import annotations

import concurrent.futures as futures
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import grpc
import httpx
import psutil
import pytest
from openai import OpenAI

from protos.segserve.v1 import scheduler_pb2, scheduler_pb2_grpc
from common.ports import free_port
from tests.e2e.test_scale_out import references, timed_stream  # noqa: F401 (fixture)
from tests.e2e.test_stack import PROMPTS

pytestmark = pytest.mark.e2e


class Serve:
    """A `segserve serve` process, its output collected, its services found among its children."""

    def __init__(self, model_dir: Path, log_dir: Path, *flags: str):
        self.port, self.scheduler_port = free_port(), free_port()
        self.base_url = f"http://127.0.0.1:{self.port}"
        self.output: list[str] = []
        self.process = subprocess.Popen(
            [sys.executable, "-m", "segserve.cli", "serve", "--model", str(model_dir), "--device", "cpu",
             "--port", str(self.port), "--no-grpc-api", "--scheduler-port", str(self.scheduler_port),
             "--max-num-seqs", "16", "--max-num-batched-tokens", "128", "--log-dir", str(log_dir), *flags],
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
        threading.Thread(target=lambda: self.output.extend(self.process.stdout), daemon=True).start()

    def wait_ready(self, timeout_s: float = 300) -> None:
        deadline = time.monotonic() + timeout_s
        while not any("segserve is ready" in line for line in self.output):
            assert self.process.poll() is None, "".join(self.output)[-4000:]
            assert time.monotonic() < deadline, "segserve serve did not get ready"
            time.sleep(0.2)

    def client(self) -> tuple[OpenAI, str]:
        """An OpenAI client of the stack (no retries) and the served model's name."""
        client = OpenAI(base_url=self.base_url + "/v1", api_key="unused", max_retries=0, timeout=120)
        return client, client.models.list().data[0].id

    def services(self, role: str) -> list[psutil.Process]:
        """The live processes of one service's replicas (`segserve.cli <role>`), by port flag."""
        found = []
        for child in psutil.Process(self.process.pid).children():
            try:
                argv = child.cmdline()
            except psutil.Error:
                continue
            if argv[1:4] == ["-m", "segserve.cli", role] and child.status() != psutil.STATUS_ZOMBIE:
                found.append(child)
        return found

    def stats(self) -> scheduler_pb2.SchedulerStats | None:
        try:
            with grpc.insecure_channel(f"127.0.0.1:{self.scheduler_port}") as channel:
                return scheduler_pb2_grpc.SchedulerStub(channel).GetStats(scheduler_pb2.StatsRequest(), timeout=5)
        except grpc.RpcError:
            return None

    def stop(self, timeout_s: float = 60) -> int:
        """SIGTERM, as a user's `kill` or a container runtime sends it; SIGKILL the group if it outlives timeout_s."""
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
        try:
            return self.process.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait()
            raise


def until(predicate, timeout_s: float, what: str) -> float:
    """Poll until predicate() is true; the time it took."""
    start = time.monotonic()
    while not predicate():
        assert time.monotonic() - start < timeout_s, f"{what} did not happen within {timeout_s:.0f} s"
        time.sleep(0.05)
    return time.monotonic() - start


def streams_with_a_kill(client: OpenAI, model: str, victim: psutil.Process) -> tuple[list[str], float, float]:
    """16 concurrent greedy streams, `victim` SIGKILLed at the first streamed event: (texts, the longest gap
    of any stream, when the kill happened)."""
    prompts = PROMPTS * 2
    streaming = threading.Event()
    killed_at = []

    def kill() -> None:
        if streaming.wait(60):
            victim.kill()
            killed_at.append(time.monotonic())

    killer = threading.Thread(target=kill)
    killer.start()
    with futures.ThreadPoolExecutor(len(prompts)) as pool:
        results = list(pool.map(lambda p: timed_stream(client, model, p, streaming), prompts))
    killer.join()
    assert killed_at, "nothing streamed"
    return [text for text, _ in results], max(gap for _, gap in results), killed_at[0]


def test_serve_survives_a_worker_a_drafter_the_scheduler_and_the_router_dying(tiny_gemma3_dir, references,  # noqa: F811
                                                                              tmp_path):
    serve = Serve(tiny_gemma3_dir, tmp_path, "--workers", "2", "--drafters", "2")
    record = {}
    try:
        serve.wait_ready()
        client, model = serve.client()
        expected = [references[p] for p in PROMPTS * 2]

        workers = serve.services("worker")
        assert len(workers) == 2 and serve.stats().num_live_workers == 2
        texts, record["worker_stall_max_s"], killed_at = streams_with_a_kill(client, model, workers[1])
        assert texts == expected
        until(lambda: len(serve.services("worker")) == 2 and (serve.stats() or scheduler_pb2.SchedulerStats())
              .num_live_workers == 2, 120, "the worker's rejoin")
        record["worker_kill_to_rejoin_s"] = time.monotonic() - killed_at
        assert serve.stats().num_moved_requests > 0  # the dead worker's requests did move

        drafters = serve.services("drafter")
        assert len(drafters) == 2
        texts, record["drafter_stall_max_s"], killed_at = streams_with_a_kill(client, model, drafters[0])
        assert texts == expected

        def drafters_back() -> bool:
            stats = serve.stats()
            return (len(serve.services("drafter")) == 2 and stats is not None and len(stats.drafters) == 2
                    and all(d.is_live and d.HasField("stats") for d in stats.drafters))

        until(drafters_back, 120, "the drafter's return")
        record["drafter_kill_to_rejoin_s"] = time.monotonic() - killed_at

        # The scheduler: a request sent once it is gone waits for the new one (the router retries it). Gone: its
        # Ray actor, which serves the port, ends a moment after the process that owns it.
        serve.services("scheduler")[0].kill()
        killed_at = time.monotonic()
        until(lambda: serve.stats() is None, 30, "the scheduler's end")
        again = client.completions.create(model=model, prompt=PROMPTS[0], max_tokens=48, temperature=0)
        assert again.choices[0].text == references[PROMPTS[0]]
        record["scheduler_kill_to_served_s"] = time.monotonic() - killed_at

        # The router: back on the same port.
        serve.services("router")[0].kill()
        record["router_kill_to_ready_s"] = until(lambda: _is_ready(serve.base_url), 120, "the router's return")
        with futures.ThreadPoolExecutor(8) as pool:
            texts = list(pool.map(lambda p: timed_stream(client, model, p)[0], PROMPTS))
        assert texts == [references[p] for p in PROMPTS]

        output = "".join(serve.output)
        for name in ("worker-1", "drafter", "scheduler", "router"):  # each death named, with its signal
            assert f"{name} exited unexpectedly (signal SIGKILL)" in output, output[-4000:]
        assert serve.process.poll() is None
    finally:
        children = psutil.Process(serve.process.pid).children(recursive=True)
        code = serve.stop()
    (tmp_path / "supervision.json").write_text(json.dumps(record))
    print(json.dumps(record))
    assert code == 0, "".join(serve.output)[-4000:]
    gone, alive = psutil.wait_procs(children, timeout=30)
    assert not alive, f"left running after the stack stopped: {[p.cmdline()[:4] for p in alive]}"


def _is_ready(base_url: str) -> bool:
    try:
        return httpx.get(base_url + "/ready", timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


def test_a_service_that_keeps_dying_stops_the_stack_with_its_name(tiny_gemma3_dir, tmp_path):
    """A lone drafter, restarted once, replays its log; killed again, past --max-restarts 1, it stops the stack."""
    serve = Serve(tiny_gemma3_dir, tmp_path, "--max-restarts", "1")
    try:
        serve.wait_ready()
        model = httpx.get(serve.base_url + "/v1/models", timeout=30).json()["data"][0]["id"]
        schema = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}
        body = {"model": model, "prompt": "A number as JSON:", "max_tokens": 16, "temperature": 0,
                "structured_outputs": {"json": schema}}  # its whole output is learned, for its schema's key
        assert httpx.post(serve.base_url + "/v1/completions", json=body, timeout=120).status_code == 200

        def learned() -> bool:  # the scheduler hands the drafter a finished request after its answer went out
            stats = serve.stats()
            return stats is not None and any(
                d.HasField("stats") and sum(s.num_learned_tokens for s in d.stats.segments) > 0 for d in stats.drafters)

        until(learned, 60, "the drafter's learning of the request")
        serve.services("drafter")[0].kill()
        until(lambda: "drafter is back" in "".join(serve.output), 120, "the drafter's restart")
        # the lone drafter replayed what it had learned before it died (from the log the stack gives it)
        replayed = re.findall(r"\((\d+) log records replayed\)", (tmp_path / "drafter.log").read_text())
        assert len(replayed) == 2 and int(replayed[1]) > 0, replayed
        children = psutil.Process(serve.process.pid).children(recursive=True)
        serve.services("drafter")[0].kill()  # its second exit: one more than --max-restarts 1 allows
        code = serve.process.wait(timeout=120)
    finally:
        serve.stop()
    output = "".join(serve.output)
    assert code == 1, output[-4000:]
    assert "segserve: stopping the stack: drafter exited (signal SIGKILL) after 1 restart(s)" in output, output[-4000:]
    gone, alive = psutil.wait_procs(children, timeout=30)
    assert not alive, f"left running after the stack stopped: {alive}"
