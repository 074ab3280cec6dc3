"""Run a rendered overlay's containers as local processes, as a kubelet would run them, and run their probes.

Each replica of a workload becomes a `LocalPod`: its container's command and args, with its environment (the
manifest's env over the image's ENV), its mounts materialized under a directory of its own (ConfigMaps and Secrets
as files, emptyDirs and volume claims empty), and every address rewritten to this machine: the pod's own ports and
`--host=0.0.0.0` to 127.0.0.1 and free ports, and each Service name (`dns:///segserve-drafter:50071`,
`redis://segserve-redis:6379`) to the local ports of the replicas behind it.
"""

from __future__ import annotations

import re
import signal
import subprocess
import sys
import typing
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import httpx
from grpc_health.v1 import health_pb2, health_pb2_grpc

from common.ports import free_port
from tests.support.k8s_helpers import REPO, config_class, container_env, localize, pod_labels, pod_spec, selects

SERVICE_TARGET = re.compile(r"(dns:///)?(segserve-[a-z-]+):(\d+)")


def image_env() -> dict[str, str]:
    """The runtime image's ENV (Dockerfile), but PATH and HOME, which stay this machine's."""
    text = re.sub(r"\\\n\s*", " ", (REPO / "Dockerfile").read_text())
    runtime = text.split(" AS runtime", 1)[1].split(" AS baked", 1)[0]
    env = {}
    for line in runtime.splitlines():
        if line.startswith("ENV "):
            env.update(pair.split("=", 1) for pair in line[4:].split())
    return {k: v for k, v in env.items() if k not in ("PATH", "HOME")}


@dataclass
class LocalPod:
    """One replica of a workload's first container, on this machine."""

    name: str
    workload: dict
    ports: dict[int, int]
    """containerPort -> the local port this replica listens on."""
    root: Path
    process: subprocess.Popen | None = None
    log_path: Path | None = None
    argv: list[str] = field(default_factory=list)
    env: dict[str, str] = field(default_factory=dict)

    @property
    def container(self) -> dict:
        return pod_spec(self.workload)["containers"][0]

    def prepare(self, objects, services: dict[tuple[str, int], list[int]]) -> None:
        """Work out argv and env: mounts under root, own ports and Service names to local addresses."""
        container = self.container
        command = [*container.get("command", []), *container.get("args", [])]
        command = localize(command, self.workload, container, objects, self.root)
        env = container_env(container, objects)
        env = dict(zip(env, localize(list(env.values()), self.workload, container, objects, self.root)))
        list_flags = _list_flags(command[1:]) if command[0] == "segserve" else set()
        self.argv = [arg for value in command for arg in self._local(value, services, list_flags)]
        for i, arg in enumerate(self.argv[1:], 1):  # `--port N` as two arguments (redis-server's style)
            if self.argv[i - 1] == "--port" and arg.isdigit() and int(arg) in self.ports:
                self.argv[i] = str(self.ports[int(arg)])
        self.env = {k: self._local(v, services, set())[0] for k, v in env.items()}

    def _local(self, value: str, services, list_flags: set[str]) -> list[str]:
        flag, sep, text = value.partition("=") if value.startswith("--") else ("", "", value)
        if flag in ("--port", "--grpc-port") and text.isdigit() and int(text) in self.ports:
            return [f"{flag}={self.ports[int(text)]}"]
        if flag == "--host" and text == "0.0.0.0":
            return [f"{flag}=127.0.0.1"]

        def addresses(match: re.Match) -> str:
            ports = services[(match.group(2), int(match.group(3)))]
            return ",".join(f"127.0.0.1:{port}" for port in ports)

        text = SERVICE_TARGET.sub(addresses, text)
        if flag in list_flags:
            return [flag, *text.split(",")]
        return [flag + sep + text] if flag else [text]

    def start(self, env_base: dict[str, str], cwd: Path) -> None:
        argv = list(self.argv)
        if argv[0] == "segserve":  # the image's entry point: this interpreter's segserve
            argv[0] = str(Path(sys.executable).parent / "segserve")
        self.log_path = cwd / f"{self.name}.log"
        log = open(self.log_path, "ab")
        self.process = subprocess.Popen(argv, env={**env_base, **self.env}, stdout=log, stderr=subprocess.STDOUT,
                                        cwd=cwd)
        log.close()

    def stop(self, timeout_s: float) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()

    def probe(self, kind: str) -> bool:
        """Run the container's probe of `kind` once, as the kubelet does; True when it passes."""
        probe = self.container[kind]
        timeout = probe.get("timeoutSeconds", 1)
        if "grpc" in probe:
            address = f"127.0.0.1:{self.ports[probe['grpc']['port']]}"
            with grpc.insecure_channel(address) as channel:
                request = health_pb2.HealthCheckRequest(service=probe["grpc"].get("service", ""))
                try:
                    reply = health_pb2_grpc.HealthStub(channel).Check(request, timeout=timeout)
                except grpc.RpcError:
                    return False
                return reply.status == health_pb2.HealthCheckResponse.SERVING
        if "httpGet" in probe:
            url = f"http://127.0.0.1:{self.ports[probe['httpGet']['port']]}{probe['httpGet']['path']}"
            try:
                return 200 <= httpx.get(url, timeout=timeout).status_code < 400
            except httpx.HTTPError:
                return False
        command = [self._local(arg, {}, set())[0] for arg in probe["exec"]["command"]]
        command = [str(self.ports.get(int(arg), arg)) if arg.isdigit() else arg for arg in command]
        return subprocess.run(command, capture_output=True, timeout=timeout + 5).returncode == 0


def _list_flags(argv: list[str]) -> set[str]:
    """The flags of list fields in the config `segserve <argv>` builds (they take one value per address)."""
    cls = config_class(argv)
    if cls is None:
        return set()
    hints = typing.get_type_hints(cls)
    return {"--" + name.replace("_", "-") for name, hint in hints.items() if typing.get_origin(hint) is list}


def pods_of(workload: dict, num_replicas: int, root: Path) -> list[LocalPod]:
    name = workload["metadata"]["name"]
    container_ports = [p["containerPort"] for p in pod_spec(workload)["containers"][0].get("ports", [])]
    return [LocalPod(f"{name}-{i}", workload, {port: free_port() for port in container_ports}, root / f"{name}-{i}")
            for i in range(num_replicas)]


def service_ports(objects, pods: list[LocalPod]) -> dict[tuple[str, int], list[int]]:
    """(Service name, its port) -> the local ports of the replicas it selects, on the port it targets."""
    services = {}
    for service in (o for o in objects if o["kind"] == "Service"):
        selected = [p for p in pods if selects(service["spec"]["selector"], pod_labels(p.workload))]
        for port in service["spec"]["ports"]:
            named = {p["name"]: p["containerPort"] for p in selected[0].container["ports"]} if selected else {}
            target = named.get(port["targetPort"], port["targetPort"])
            services[(service["metadata"]["name"], port["port"])] = [p.ports[target] for p in selected]
    return services
