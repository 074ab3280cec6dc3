"""The cpu overlay runs: its containers started as local processes (tests/support/k8s_local.py) with their own commands,
arguments and environment, one replica of each and two drafters, Redis included, the model volume holding a tiny
random model where the init container would have converted the default one. Every probe the manifests define
passes, a chat completion goes through the router with the Secret's API key, and the reflow consumer writes it.
"""

from __future__ import annotations

import base64
import os
import shutil
import time
from pathlib import Path

import httpx
import pytest

from common.catalog import DEFAULT_MODEL
from tests.support.k8s_helpers import mounts, one, render
from tests.support.k8s_local import LocalPod, image_env, pods_of, service_ports

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(420)]

REPLICAS = {"segserve-redis": 1, "segserve-worker": 1, "segserve-drafter": 2, "segserve-scheduler": 1,
            "segserve-router": 1, "segserve-reflow-consumer": 1}
PROBES = ("startupProbe", "readinessProbe", "livenessProbe")
STARTUP_BUDGET_S = 240.0


def place_model(pod: LocalPod, model_dir: Path) -> None:
    """What the pod's prepare-model init container leaves: the model under its cache volume, models/<name>."""
    init = pod_spec_init(pod)
    if init is None:
        return
    cache = next(m for m in mounts(pod.workload, init) if m.volume["name"] == "models")
    target = pod.root / cache.path.strip("/") / "models" / DEFAULT_MODEL
    target.parent.mkdir(parents=True, exist_ok=True)
    target.symlink_to(model_dir, target_is_directory=True)


def pod_spec_init(pod: LocalPod) -> dict | None:
    inits = pod.workload["spec"]["template"]["spec"].get("initContainers", [])
    return next((c for c in inits if c["args"][:1] == ["prepare-model"]), None)


def wait_for_probe(pod: LocalPod, kind: str, deadline: float) -> None:
    while not pod.probe(kind):
        assert pod.process.poll() is None, f"{pod.name} exited with {pod.process.returncode}:\n{log_tail(pod)}"
        assert time.monotonic() < deadline, f"{pod.name}'s {kind} did not pass in time:\n{log_tail(pod)}"
        time.sleep(0.5)


def log_tail(pod: LocalPod) -> str:
    return pod.log_path.read_text(errors="replace")[-3000:] if pod.log_path and pod.log_path.exists() else ""


def api_key(objects) -> str:
    router = one(objects, "Deployment", "segserve-router")["spec"]["template"]["spec"]
    secret_name = next(v["secret"]["secretName"] for v in router["volumes"] if "secret" in v)
    text = base64.b64decode(one(objects, "Secret", secret_name)["data"]["api-keys"]).decode()
    return next(line.strip() for line in text.splitlines() if line.strip() and not line.startswith("#"))


def test_the_cpu_overlay_runs_serves_a_chat_and_passes_every_probe(tiny_gemma3_dir, tmp_path):
    if shutil.which("redis-server") is None:
        pytest.skip("redis-server is not installed (.ci/run installs it)")
    objects = render("cpu")
    pods = [pod for name, num in REPLICAS.items()
            for pod in pods_of(one(objects, "StatefulSet" if name == "segserve-redis" else "Deployment", name), num,
                               tmp_path / "pods")]
    services = service_ports(objects, pods)
    env_base = {k: v for k, v in os.environ.items() if not k.startswith("SEGSERVE_")} | image_env()
    try:
        for pod in pods:  # all at once, as a cluster starts them; each waits for its peers by itself
            pod.prepare(objects, services)
            place_model(pod, tiny_gemma3_dir)
            pod.start(env_base, tmp_path)
        deadline = time.monotonic() + STARTUP_BUDGET_S
        probed = [pod for pod in pods if "startupProbe" in pod.container]
        for pod in probed:
            for kind in PROBES:
                wait_for_probe(pod, kind, deadline)
        assert {pod.workload["metadata"]["name"] for pod in probed} == set(REPLICAS) - {"segserve-reflow-consumer"}

        router = next(pod for pod in pods if pod.name.startswith("segserve-router"))
        base_url = f"http://127.0.0.1:{router.ports[8000]}"
        body = {"model": DEFAULT_MODEL, "messages": [{"role": "user", "content": "Hello there"}], "max_tokens": 16}
        assert httpx.post(base_url + "/v1/chat/completions", json=body, timeout=60).status_code == 401
        reply = httpx.post(base_url + "/v1/chat/completions", json=body, timeout=120,
                           headers={"Authorization": f"Bearer {api_key(objects)}"})
        assert reply.status_code == 200, reply.text
        choice = reply.json()["choices"][0]
        assert choice["finish_reason"] in ("length", "stop") and reply.json()["usage"]["completion_tokens"] > 0

        for pod in probed:  # still ready and live with traffic behind them
            for kind in ("readinessProbe", "livenessProbe"):
                assert pod.probe(kind), f"{pod.name}'s {kind} failed after the chat:\n{log_tail(pod)}"

        consumer = next(pod for pod in pods if pod.name.startswith("segserve-reflow-consumer"))
        sink = Path(next(a.split("=", 1)[1] for a in consumer.argv if a.startswith("--sink-dir=")))
        deadline = time.monotonic() + 60
        while not (sink.is_dir() and any(sink.rglob("*.jsonl"))):
            assert consumer.process.poll() is None, log_tail(consumer)
            assert time.monotonic() < deadline, f"the reflow consumer wrote nothing:\n{log_tail(consumer)}"
            time.sleep(0.5)
        assert "Hello there" in "".join(path.read_text() for path in sink.rglob("*.jsonl"))
    finally:
        for pod in reversed(pods):
            pod.stop(timeout_s=20)
