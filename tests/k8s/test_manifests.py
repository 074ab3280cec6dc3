"""The Kubernetes manifests, checked without a cluster: every overlay renders with kubectl's kustomize, every
rendered object passes kubernetes-validate's strict schemas, and the objects agree with the code they run:
command lines parse with the real CLI into valid configs, every variable set is one a config reads, ports,
probes, Services, HPAs, PDBs and NetworkPolicies point at what exists, and every pod is locked down.
"""

from __future__ import annotations

import dataclasses
import math
import re

import kubernetes_validate
import pytest

from common.catalog import DEFAULT_MODEL
from segserve.cli import build_parser
from segserve.flags import env_names, from_args
from tests.support.k8s_helpers import (K8S, OVERLAYS, PLUMBING_ENV, REPO, config_class, container_env, find,
                                       localize, one, pod_labels, pod_spec, render, segserve_argv,
                                       segserve_containers, selects, workloads)

KUBERNETES_VERSION = "1.37.0"
"""The newest API version kubernetes-validate ships schemas for (the test extra pins it at >= 1.37)."""
COMPONENTS = ("router", "scheduler", "worker", "drafter")
ADDRESS = re.compile(r"(?:dns:///|redis://)?(segserve-[a-z-]+):(\d+)")


@pytest.fixture(params=OVERLAYS)
def objects(request):
    return render(request.param)


def build_config(argv, env, workload, container, objects, tmp_path, monkeypatch):
    """The config `segserve <argv>` builds in this container: flags parsed by the real parser, its SEGSERVE_*
    variables set, mounted files materialized under tmp_path."""
    cls = config_class(argv)
    argv = localize(argv, workload, container, objects, tmp_path)
    for name, value in zip(env, localize(list(env.values()), workload, container, objects, tmp_path)):
        monkeypatch.setenv(name, value)
    args = build_parser().parse_args(argv)
    return from_args(cls, args)


def component_config(objects, component, tmp_path, monkeypatch):
    workload = one(objects, "Deployment", f"segserve-{component}")
    container = pod_spec(workload)["containers"][0]
    env = container_env(container, objects)
    return workload, container, build_config(segserve_argv(container), env, workload, container, objects, tmp_path,
                                             monkeypatch)


@pytest.mark.parametrize("overlay", ("base", *OVERLAYS))
def test_every_overlay_renders_and_passes_the_strict_schemas(overlay):
    objects = render(overlay)
    kinds = {o["kind"] for o in objects}
    assert {"Deployment", "Service", "ConfigMap", "Secret", "StatefulSet", "HorizontalPodAutoscaler",
            "PodDisruptionBudget", "NetworkPolicy", "PersistentVolumeClaim", "Namespace"} <= kinds
    for obj in objects:
        try:
            kubernetes_validate.validate(obj, KUBERNETES_VERSION, strict=True)
        except kubernetes_validate.ValidationError as exc:
            pytest.fail(f"{obj['kind']}/{obj['metadata']['name']} in {overlay}: {exc.message} at {list(exc.path)}")


def test_every_segserve_command_line_parses_with_the_cli_into_a_valid_config(objects, tmp_path, monkeypatch):
    commands = set()
    for workload, container in segserve_containers(objects):
        argv = segserve_argv(container)
        env = container_env(container, objects)
        commands.add(tuple(argv[:2]) if argv[0] == "reflow" else argv[0])
        if config_class(argv) is None:
            assert build_parser().parse_args(argv).func.__name__ == "_prepare_model_command", argv
            continue
        with monkeypatch.context() as patch:
            config = build_config(argv, env, workload, container, objects, tmp_path / container["name"], patch)
        assert dataclasses.is_dataclass(config)
    assert commands == {*COMPONENTS, ("reflow", "consume"), "prepare-model"}


def test_every_variable_a_container_sets_is_read_by_its_config(objects):
    for workload, container in segserve_containers(objects):
        argv = segserve_argv(container)
        cls = config_class(argv)
        read = (env_names(cls) if cls else set()) | PLUMBING_ENV
        unread = set(container_env(container, objects)) - read
        assert not unread, f"{workload['metadata']['name']}/{container['name']} sets {unread}, which nothing reads"


SERVICE_NAMES = {component: f"segserve.v1.{component.capitalize()}" for component in ("worker", "scheduler", "drafter")}
"""The internal gRPC service each of these components serves."""


def test_ports_and_probes_agree_with_the_configs(objects, tmp_path, monkeypatch):
    from router.ops import router as ops_routes

    http_paths = {route.path for route in ops_routes.routes}
    for component in COMPONENTS:
        _, container, config = component_config(objects, component, tmp_path / component, monkeypatch)
        expected = {config.port} | ({config.grpc_port} if component == "router" else set())
        ports = {p["containerPort"] for p in container["ports"]}
        assert ports == expected, component
        assert config.host == "0.0.0.0", f"{component} must listen on the pod's address"
        for kind in ("startupProbe", "readinessProbe", "livenessProbe"):
            probe = container[kind]
            if "grpc" in probe:
                grpc_port = config.grpc_port if component == "router" else config.port
                # the overall status (the process is up), or for readiness a named service's (it can serve)
                services = ("", SERVICE_NAMES.get(component, "")) if kind == "readinessProbe" else ("",)
                assert probe["grpc"]["port"] == grpc_port and probe["grpc"].get("service", "") in services, (
                    component, kind)
            else:
                assert component == "router" and probe["httpGet"]["port"] == config.port, (component, kind)
                assert probe["httpGet"]["path"] in http_paths, (component, kind)
    router = component_config(objects, "router", tmp_path / "router-probes", monkeypatch)[1]
    assert router["readinessProbe"]["httpGet"]["path"] == "/ready", "readiness must follow drains and the worker"
    scheduler = component_config(objects, "scheduler", tmp_path / "scheduler-probes", monkeypatch)[1]
    assert scheduler["readinessProbe"]["grpc"].get("service") == SERVICE_NAMES["scheduler"], (
        "a scheduler without a live worker must leave the routers' endpoints")


def test_every_address_names_a_service_whose_pods_listen_on_that_port(objects):
    for workload, container in segserve_containers(objects):
        values = segserve_argv(container) + list(container_env(container, objects).values())
        for value in values:
            for match in ADDRESS.finditer(value):
                name, port = match.group(1), int(match.group(2))
                service = one(objects, "Service", name)
                assert port in {p["port"] for p in service["spec"]["ports"]}, value
                # dns:/// resolves to the pods' own addresses: the port must be the containers' port itself.
                pods = [w for w in workloads(objects) if selects(service["spec"]["selector"], pod_labels(w))]
                assert len(pods) == 1, f"{name} selects {len(pods)} workloads"
                container_ports = {p["containerPort"] for c in pod_spec(pods[0])["containers"] for p in c["ports"]}
                assert port in container_ports, f"{value}: {name}'s pods do not listen on {port}"
                if match.group(0).startswith("dns:///"):
                    assert service["spec"].get("clusterIP") == "None", f"{name} must be headless for {value}"


def test_services_select_one_workload_and_target_its_named_ports(objects):
    for service in find(objects, "Service"):
        selected = [w for w in workloads(objects) if selects(service["spec"]["selector"], pod_labels(w))]
        assert len(selected) == 1, f"Service {service['metadata']['name']} selects {len(selected)} workloads"
        named = {p["name"]: p["containerPort"] for c in pod_spec(selected[0])["containers"] for p in c["ports"]}
        for port in service["spec"]["ports"]:
            assert named.get(port["targetPort"]) == port["port"], (service["metadata"]["name"], port)
    for name in ("segserve-worker", "segserve-drafter", "segserve-scheduler"):
        assert one(objects, "Service", name)["spec"]["clusterIP"] == "None", f"{name} must be headless"


def test_hpas_pdbs_and_network_policies_point_at_real_pods(objects):
    hpas = {h["metadata"]["name"]: h for h in find(objects, "HorizontalPodAutoscaler")}
    assert set(hpas) == {"segserve-drafter", "segserve-router"}
    for hpa in hpas.values():
        target = hpa["spec"]["scaleTargetRef"]
        one(objects, target["kind"], target["name"])
        assert 1 <= hpa["spec"]["minReplicas"] <= hpa["spec"]["maxReplicas"]
    assert hpas["segserve-drafter"]["spec"]["minReplicas"] >= 2, "the drafters are scaled out"
    for budget in find(objects, "PodDisruptionBudget"):
        assert any(selects(budget["spec"]["selector"], pod_labels(w)) for w in workloads(objects)), budget
    policies = find(objects, "NetworkPolicy")
    for policy in policies:
        assert any(selects(policy["spec"]["podSelector"], pod_labels(w)) for w in workloads(objects)), policy


def test_only_the_router_takes_traffic_from_outside(objects):
    policies = find(objects, "NetworkPolicy")
    for workload in workloads(objects):
        labels = pod_labels(workload)
        applying = [p for p in policies if selects(p["spec"]["podSelector"], labels)]
        assert applying, f"{workload['metadata']['name']} has no NetworkPolicy"
        open_rules = [rule for p in applying for rule in p["spec"].get("ingress", []) if not rule.get("from")]
        if labels["app.kubernetes.io/component"] == "router":
            assert {port["port"] for rule in open_rules for port in rule["ports"]} == {8000, 8001}
            continue
        assert not open_rules, f"{workload['metadata']['name']} takes traffic from anywhere"
        for rule in (rule for p in applying for rule in p["spec"].get("ingress", [])):
            for peer in rule["from"]:
                assert set(peer) == {"podSelector"}, peer  # the app's own pods, no namespace or IP block
                assert peer["podSelector"]["matchLabels"] == {"app.kubernetes.io/name": "segserve"}


def test_every_pod_is_locked_down_and_sized(objects):
    for workload in workloads(objects):
        spec, name = pod_spec(workload), workload["metadata"]["name"]
        security = spec["securityContext"]
        assert security["runAsNonRoot"] is True and security["runAsUser"] > 0, name
        assert security["seccompProfile"] == {"type": "RuntimeDefault"}, name
        assert spec["automountServiceAccountToken"] is False, name
        for container in spec.get("initContainers", []) + spec["containers"]:
            where = f"{name}/{container['name']}"
            assert container["securityContext"]["allowPrivilegeEscalation"] is False, where
            assert container["securityContext"]["readOnlyRootFilesystem"] is True, where
            assert container["securityContext"]["capabilities"]["drop"] == ["ALL"], where
            resources = container["resources"]
            assert resources["requests"]["cpu"] and resources["requests"]["memory"], where
            assert resources["limits"]["memory"], where
            if container.get("command", [None])[0] == "segserve":
                writable = {m["mountPath"] for m in container.get("volumeMounts", []) if not m.get("readOnly")}
                assert "/tmp" in writable, f"{where}: a read-only root needs a writable /tmp"


def test_every_server_is_probed_and_drains_within_its_grace_period(objects):
    for component in COMPONENTS:
        workload = one(objects, "Deployment", f"segserve-{component}")
        spec = pod_spec(workload)
        container = spec["containers"][0]
        startup = container["startupProbe"]
        assert {"startupProbe", "readinessProbe", "livenessProbe"} <= set(container), component
        if component in ("worker", "drafter"):  # model and corpora loading: minutes, not seconds
            assert startup["periodSeconds"] * startup["failureThreshold"] >= 300, component
        env = container_env(container, objects)
        pre_stop = container.get("lifecycle", {}).get("preStop", {}).get("sleep", {}).get("seconds", 0)
        drain = float(env.get("SEGSERVE_DRAIN_TIMEOUT_S", 0))
        if component in ("router", "scheduler"):
            assert drain > 0 and pre_stop > 0, f"{component} drains its streams after the endpoints drop it"
        assert spec["terminationGracePeriodSeconds"] >= pre_stop + drain + 5, component


def test_the_gpu_overlay_puts_workers_on_gpus_in_bf16():
    objects = render("gpu")
    worker = one(objects, "Deployment", "segserve-worker")
    spec = pod_spec(worker)
    container = spec["containers"][0]
    assert container["resources"]["limits"]["nvidia.com/gpu"] == 1
    assert spec["nodeSelector"] and any(t["key"] == "nvidia.com/gpu" for t in spec["tolerations"])
    env = container_env(container, objects)
    assert env["SEGSERVE_DTYPE"] == "bfloat16" and env["SEGSERVE_DEVICE"] == "cuda"
    assert all(c["image"].endswith("-cuda") for _, c in segserve_containers(objects))
    cpu_env = container_env(pod_spec(one(render("cpu"), "Deployment", "segserve-worker"))["containers"][0],
                            render("cpu"))
    assert cpu_env["SEGSERVE_DEVICE"] == "cpu" and cpu_env["SEGSERVE_DTYPE"] == "float32"


def test_the_tensor_parallel_overlay_gives_each_worker_one_gpu_per_rank():
    objects = render("gpu-tp")
    container = pod_spec(one(objects, "Deployment", "segserve-worker"))["containers"][0]
    size = int(container_env(container, objects)["SEGSERVE_TENSOR_PARALLEL_SIZE"])
    assert size > 1
    assert container["resources"]["requests"]["nvidia.com/gpu"] == container["resources"]["limits"]["nvidia.com/gpu"]
    assert container["resources"]["limits"]["nvidia.com/gpu"] == size


def test_the_model_comes_from_a_volume_the_init_container_fills(objects):
    for component in ("router", "worker", "drafter"):
        spec = pod_spec(one(objects, "Deployment", f"segserve-{component}"))
        init = [c for c in spec["initContainers"] if segserve_argv(c) == ["prepare-model", DEFAULT_MODEL]]
        assert len(init) == 1, component
        cache = {m["name"]: m["mountPath"] for m in init[0]["volumeMounts"]}["models"]
        assert container_env(init[0], objects)["SEGSERVE_CACHE_DIR"] == cache
        argv = segserve_argv(spec["containers"][0])
        model = [a.split("=", 1)[1] for a in argv if a.startswith(("--model=", "--tokenizer="))]
        assert model == [f"{cache}/models/{DEFAULT_MODEL}"], component


def test_the_api_keys_come_from_a_secret_file_never_from_arguments(objects):
    router = pod_spec(one(objects, "Deployment", "segserve-router"))
    container = router["containers"][0]
    key_file = next(a.split("=", 1)[1] for a in segserve_argv(container) if a.startswith("--api-key-file="))
    mount = next(m for m in container["volumeMounts"] if key_file.startswith(m["mountPath"] + "/"))
    volume = next(v for v in router["volumes"] if v["name"] == mount["name"])
    secret = one(objects, "Secret", volume["secret"]["secretName"])
    assert key_file.rsplit("/", 1)[1] in secret["data"]
    for _, c in segserve_containers(objects):
        assert not any("api-keys=" in a or "--api-keys" in a for a in segserve_argv(c))


def test_the_segments_configmap_is_the_served_models_shipped_config():
    shipped = (REPO / "drafter" / "segments" / f"{DEFAULT_MODEL}.toml").read_text()
    assert (K8S / "base" / "config" / "segments.toml").read_text() == shipped
    drafter = pod_spec(one(render("cpu"), "Deployment", "segserve-drafter"))
    volume = next(v for v in drafter["volumes"] if v["name"] == "segments")
    assert one(render("cpu"), "ConfigMap", volume["configMap"]["name"])["data"]["segments.toml"] == shipped


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_the_worker_runs_as_many_torch_threads_as_the_cpus_it_requests(overlay):
    objects = render(overlay)
    container = pod_spec(one(objects, "Deployment", "segserve-worker"))["containers"][0]
    threads = int(container_env(container, objects)["SEGSERVE_NUM_THREADS"])
    assert threads == math.ceil(float(container["resources"]["requests"]["cpu"]))
