"""The whole stack on a Ray cluster started with `ray start --head`, joined through --ray-address: the scheduler
and two workers run there as Ray actors."""

from __future__ import annotations

import os
import secrets
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx

from tests.e2e_helpers import scheduler_stats, served_model_name, tiny_stack
from tests.router_server import free_port


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


def test_the_stack_runs_on_a_ray_start_head_cluster(tiny_gemma3_dir, tmp_path, monkeypatch):
    env = cluster_env(tmp_path)
    for name, value in env.items():
        monkeypatch.setenv(name, value)  # the launched scheduler joins with the cluster's token
    head, address = ray_head(tmp_path, env)
    try:
        with tiny_stack(tiny_gemma3_dir, tmp_path, is_speculative=False, scheduler={"ray_address": address},
                        num_workers=2, is_ray_workers=True) as stack:
            body = {"model": served_model_name(stack), "prompt": "Hello", "max_tokens": 5, "temperature": 0}
            response = httpx.post(stack.base_url + "/v1/completions", json=body, timeout=120)
            assert response.status_code == 200 and response.json()["usage"]["completion_tokens"] == 5
            assert scheduler_stats(stack).num_live_workers == 2  # both worker actors serve
            probe = subprocess.run(
                [sys.executable, "-c",
                 "import ray, sys; ray.init(address=sys.argv[1], logging_level='ERROR'); "
                 "print([a['name'] for a in ray.util.list_named_actors(all_namespaces=True)])", address],
                capture_output=True, text=True, timeout=120)
            assert "segserve-scheduler-" in probe.stdout, probe.stderr  # the actors run on the cluster
            assert probe.stdout.count("segserve-worker-") == 2 and not stack.processes.get("worker")
            log = (tmp_path / "scheduler.log").read_text()
            assert "scheduler serving on" in log and "Ray node " in log
    finally:
        stop_group(head)

