"""The container image's Dockerfile, checked without Docker: hadolint (the wheel the test extra installs) finds
nothing, and the image agrees with the CLI, the configs and the manifests that run it."""

from __future__ import annotations

import fnmatch
import json
import re
import subprocess
import sys
from pathlib import Path

from drafter.config import DrafterConfig
from router.config import RouterConfig
from scheduler.config import SchedulerConfig
from segserve.cli import build_parser
from tests.support.k8s_helpers import OVERLAYS, REPO, pod_spec, render, segserve_containers
from worker.config import WorkerConfig

DOCKERFILE = REPO / "Dockerfile"
HADOLINT = Path(sys.executable).parent / "hadolint"


def instructions(stage: str | None = None) -> list[tuple[str, str]]:
    """(INSTRUCTION, rest) of the Dockerfile's lines (continuations joined, comments left out): of one stage
    (`FROM ... AS stage` to the next FROM), or of all of them."""
    text = re.sub(r"\\\n\s*", " ", DOCKERFILE.read_text())
    parsed, current = [], None
    for line in (line.strip() for line in text.splitlines()):
        if not line or line.startswith("#"):
            continue
        word, _, rest = line.partition(" ")
        if word.upper() == "FROM":
            current = rest.split(" AS ")[-1].strip() if " AS " in rest else None
        if stage is None or current == stage:
            parsed.append((word.upper(), rest.strip()))
    return parsed


def test_hadolint_finds_nothing():
    out = subprocess.run([str(HADOLINT), "--format", "json", str(DOCKERFILE)], capture_output=True, text=True,
                         timeout=60)
    findings = json.loads(out.stdout or "[]")
    assert findings == [], "\n".join(f"{f['line']}: {f['level']} {f['code']} {f['message']}" for f in findings)
    assert out.returncode == 0


def test_one_image_runs_every_component_as_a_non_root_user():
    runtime = dict(instructions("runtime"))
    assert json.loads(runtime["ENTRYPOINT"]) == ["segserve"]
    build_parser().parse_args(json.loads(runtime["CMD"]))  # the default command is a real one
    uid, gid = (int(part) for part in runtime["USER"].split(":"))
    assert uid > 0 and gid > 0
    for overlay in OVERLAYS:
        for workload, container in segserve_containers(render(overlay)):
            assert pod_spec(workload)["securityContext"]["runAsUser"] == uid, workload["metadata"]["name"]
            assert container["image"].split("/")[-1].startswith("segserve:"), container["image"]
    stages = [rest.split(" AS ")[-1] for word, rest in instructions() if word == "FROM"]
    assert stages == ["build", "runtime", "baked"]
    assert ("RUN", "segserve prepare-model") in instructions("baked")


def test_the_exposed_ports_are_the_components_defaults():
    exposed = {int(port) for word, rest in instructions("runtime") if word == "EXPOSE" for port in rest.split()}
    assert exposed == {RouterConfig.port, RouterConfig.grpc_port, SchedulerConfig.port, WorkerConfig.port,
                       DrafterConfig.port}


def test_torch_is_pinned_as_the_makefile_pins_it_and_picked_by_a_build_arg():
    args = {rest.split("=")[0]: rest.split("=", 1)[1] for word, rest in instructions("build") if word == "ARG"}
    makefile_pin = re.search(r"TORCH_SPEC \?= torch==(\S+)", (REPO / "Makefile").read_text()).group(1)
    assert args["TORCH_VERSION"] == makefile_pin == "2.13.0"
    assert args["TORCH_VARIANT"] == "cpu" and "${TORCH_VARIANT}" in args["TORCH_INDEX_URL"]
    runs = " ".join(rest for word, rest in instructions("build") if word == "RUN")
    assert '"torch==${TORCH_VERSION}"' in runs and '--index-url "${TORCH_INDEX_URL}"' in runs
    assert not re.search(r"install[^&]*\btorch\b(?!==)", runs.replace('"torch==${TORCH_VERSION}"', "")), runs


def test_the_build_context_keeps_what_the_build_copies():
    patterns = [line.strip() for line in (REPO / ".dockerignore").read_text().splitlines()
                if line.strip() and not line.startswith("#")]
    copied = [source for word, rest in instructions("build") if word == "COPY" and "--from" not in rest
              for source in rest.split()[:-1]]
    assert set(copied) == {"pyproject.toml", "README.md", "protos", "common", "segserve", "router", "scheduler", "worker",
                           "drafter"}
    for source in copied:
        assert (REPO / source).exists(), source
        assert not any(fnmatch.fnmatch(source, p) for p in patterns), f"{source} is ignored by .dockerignore"
    for heavy in (".git", ".venv", "tests"):
        assert heavy in patterns


def test_a_cuda_image_gets_a_c_compiler_for_the_compiled_layers():
    """Triton builds its kernel launchers with one when a CUDA worker compiles its layers at start."""
    runtime = instructions("runtime")
    assert ("ARG", "TORCH_VARIANT=cpu") in runtime
    installs = [rest for word, rest in runtime if word == "RUN" and "apt-get install" in rest]
    assert len(installs) == 1 and '[ "${TORCH_VARIANT}" != "cpu" ]' in installs[0] and " gcc " in installs[0]
