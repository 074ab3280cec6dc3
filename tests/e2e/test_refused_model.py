"""A model the worker would serve wrong, given to `segserve serve` as a user runs it: the command stops at start-up
with the worker's reason as its last line, and leaves no process behind."""

from __future__ import annotations

import contextlib
import time

import psutil
import pytest

from tests.e2e.test_serve_supervision import Serve
from tests.support.architectures import build_architecture

pytestmark = pytest.mark.e2e


def test_serve_refuses_a_model_it_would_serve_wrong_saying_why(tmp_path):
    serve = Serve(build_architecture("falcon_h1", tmp_path / "falcon_h1"), tmp_path / "logs")
    children: dict[psutil.Process, list[str]] = {}  # every service the command started, with its argv
    try:
        deadline = time.monotonic() + 180
        while serve.process.poll() is None and time.monotonic() < deadline:
            with contextlib.suppress(psutil.Error):
                for child in psutil.Process(serve.process.pid).children():
                    children.setdefault(child, child.cmdline())
            time.sleep(0.05)
        assert serve.process.poll() == 1
    finally:
        serve.stop()
    last = "".join(serve.output).strip().splitlines()[-1]
    assert last.startswith("segserve: worker exited with code 1 during start-up"), last
    assert ("SelfCheckFailed: FalconH1ForCausalLM is not served: it keeps state besides attention's keys and "
            "values (Conv1d, FalconH1Mixer)") in last
    assert any(argv[1:4] == ["-m", "segserve.cli", "worker"] for argv in children.values())
    assert not [child for child in children if child.is_running() and child.status() != psutil.STATUS_ZOMBIE]
