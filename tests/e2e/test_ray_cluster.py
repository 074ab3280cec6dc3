"""The whole stack on a Ray cluster started with `ray start --head`, joined through --ray-address: the scheduler
and two workers of two tensor-parallel ranks each run there as Ray actors, each worker's ranks in a placement group
of their own. A scheduler whose Ray start hangs exits instead."""

from __future__ import annotations

import os
import secrets
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import psutil

from common.ports import free_port


def cluster_env(tmp_path: Path) -> dict[str, str]:
    """Token authentication, as `ray start` turns it on: the head and every process that joins share one token."""
    token = tmp_path / "ray-auth-token"
    token.write_text(secrets.token_hex(32))
    return {"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN_PATH": str(token), "RAY_USAGE_STATS_ENABLED": "0"}


def ray_head(tmp_path: Path, env: dict[str, str]) -> tuple[subprocess.Popen, str]:
    """`ray start --head --block` in its own process group; returns it and its GCS address once it answers."""
    port = free_port()
    ray = str(Path(sys.executable).with_name("ray"))
    log = open(tmp_path / "ray-head.log", "ab")
    process = subprocess.Popen(
        [ray, "start", "--head", f"--port={port}", "--num-cpus=1",
         "--include-dashboard=false", "--disable-usage-stats", "--block"],
        stdout=log, stderr=subprocess.STDOUT, env={**os.environ, **env}, start_new_session=True)
    address = f"127.0.0.1:{port}"
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        assert process.poll() is None, (tmp_path / "ray-head.log").read_text()
        if "Ray runtime started" in (tmp_path / "ray-head.log").read_text():
            return process, address
        time.sleep(0.5)
    stop_group(process)
    raise TimeoutError("ray start --head did not come up")


def stop_group(process: subprocess.Popen) -> None:
    """Stop the head and everything it started (they share its process group)."""
    try:
        os.killpg(process.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    process.wait(timeout=30)


def scheduler_stats(address: str):
    import grpc

    from protos.segserve.v1 import scheduler_pb2, scheduler_pb2_grpc

    with grpc.insecure_channel(address) as channel:
        return scheduler_pb2_grpc.SchedulerStub(channel).GetStats(scheduler_pb2.StatsRequest(), timeout=10)


def test_the_stack_runs_on_a_ray_start_head_cluster(tiny_gemma3_dir, tmp_path):
    """`segserve serve --ray-address ... --ray-workers --workers 2`, as its own process (a Ray driver of its own:
    joining a cluster leaves process-wide Ray state behind, which the test process must not carry)."""
    env = {**os.environ, **cluster_env(tmp_path)}
    head, address = ray_head(tmp_path, env)
    port, scheduler_port = free_port(), free_port()
    log = open(tmp_path / "serve.log", "ab")
    serve = subprocess.Popen(
        [sys.executable, "-m", "segserve.cli", "serve", "--model", str(tiny_gemma3_dir), "--port", str(port),
         "--scheduler-port", str(scheduler_port), "--ray-address", address, "--ray-workers", "--workers", "2", "--tensor-parallel-size", "2",
         "--no-speculation", "--num-kv-blocks", "64", "--log-dir", str(tmp_path)],
        stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    base_url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 240
        while not _is_up(base_url + "/ready"):
            assert serve.poll() is None, (tmp_path / "serve.log").read_text()[-3000:]
            assert time.monotonic() < deadline, "segserve serve on the Ray cluster did not become ready"
            time.sleep(0.5)
        model = httpx.get(base_url + "/v1/models", timeout=30).json()["data"][0]["id"]
        body = {"model": model, "prompt": "Hello", "max_tokens": 5, "temperature": 0}
        response = httpx.post(base_url + "/v1/completions", json=body, timeout=120)
        assert response.status_code == 200 and response.json()["usage"]["completion_tokens"] == 5
        assert response.json()["choices"][0]["text"] == greedy_text(tiny_gemma3_dir, "Hello", 5)
        assert scheduler_stats(f"127.0.0.1:{scheduler_port}").num_live_workers == 2  # both worker actors serve
        probe = subprocess.run(
            [sys.executable, "-c",
             "import ray, sys; ray.init(address=sys.argv[1], logging_level='ERROR'); "
             "print([a['name'] for a in ray.util.list_named_actors(all_namespaces=True)])", address],
            capture_output=True, text=True, timeout=120, env=env)
        assert "segserve-scheduler-" in probe.stdout, probe.stderr  # the actors run on the cluster
        assert probe.stdout.count("segserve-worker-") == 2
        assert probe.stdout.count("segserve-rank-") == 2  # each worker's rank 1, in its placement group
        assert "scheduler serving on" in (tmp_path / "scheduler.log").read_text()
    finally:
        serve.send_signal(signal.SIGTERM)
        try:
            serve.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(serve.pid, signal.SIGKILL)
            serve.wait()
        stop_group(head)


def greedy_text(model_dir: Path, prompt: str, max_tokens: int) -> str:
    from transformers import AutoTokenizer

    from tests.e2e.test_stack import reference_completion

    tokens = reference_completion(model_dir, prompt, max_tokens)
    return AutoTokenizer.from_pretrained(model_dir).decode(tokens, skip_special_tokens=True)


def _is_up(url: str) -> bool:
    try:
        return httpx.get(url, timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


def test_a_scheduler_whose_ray_start_hangs_exits_for_its_supervisor(tmp_path):
    """A cluster address that accepts connections and never answers holds ray.init up for minutes (Ray retries
    its GCS); the scheduler gives up after start_timeout_s and exits with code 1, naming the setting."""
    with socket.socket() as silent:
        silent.bind(("127.0.0.1", 0))
        silent.listen(16)
        start = time.monotonic()
        scheduler = subprocess.run(
            [sys.executable, "-m", "segserve.cli", "scheduler", "--port", "0", "--start-timeout-s", "3",
             "--ray-address", "127.0.0.1:%d" % silent.getsockname()[1]],
            capture_output=True, text=True, timeout=120, env={**os.environ, **cluster_env(tmp_path)})
    assert scheduler.returncode == 1, scheduler.stdout + scheduler.stderr
    assert "did not start within start_timeout_s (3 s)" in scheduler.stdout + scheduler.stderr
    assert time.monotonic() - start < 60


def test_a_scheduler_giving_up_its_start_kills_every_process_it_started():
    """As Ray's raylet and the agents it starts, which outlive it: a child, and the child's own child."""
    script = ("import subprocess\n"
              "from scheduler.main import _give_up_start\n"
              "child = subprocess.Popen(['sh', '-c', 'sleep 300 & echo $!; wait'], stdout=subprocess.PIPE, text=True)\n"
              "print(child.pid, child.stdout.readline().strip(), flush=True)\n"
              "_give_up_start(7)\n")
    scheduler = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert scheduler.returncode == 1, scheduler.stderr
    assert "did not start within start_timeout_s (7 s)" in scheduler.stderr
    pids = [int(pid) for pid in scheduler.stdout.split()]
    assert len(pids) == 2
    deadline = time.monotonic() + 10
    while any(_is_running(pid) for pid in pids):
        assert time.monotonic() < deadline, "a process the scheduler started outlived it"
        time.sleep(0.1)


def _is_running(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False
