"""`segserve top` in a real terminal: run under tmux (Debian's package; .ci/run and `make test` install it)
against a live stack on a tiny model, its screen read with `tmux capture-pane`."""

from __future__ import annotations

import shutil
import subprocess
import sys
import time
import uuid
from pathlib import Path

import httpx
import pytest

from tests.e2e_helpers import served_model_name, tiny_stack

pytestmark = pytest.mark.e2e

SEGSERVE = str(Path(sys.executable).with_name("segserve"))
REPEATING = "one two three one two three one two three one two three one two three"


def _screen(session: str) -> str:
    return subprocess.run(["tmux", "capture-pane", "-p", "-t", session], check=True, capture_output=True,
                          text=True).stdout


def _wait_for_screen(session: str, *needles: str, timeout_s: float = 30) -> str:
    deadline = time.monotonic() + timeout_s
    while True:
        screen = _screen(session)
        if all(needle in screen for needle in needles) or time.monotonic() > deadline:
            return screen
        time.sleep(0.2)


def test_segserve_top_shows_the_live_stack(tiny_gemma3_dir, tmp_path):
    assert shutil.which("tmux"), "install Debian's tmux (make test does, as root)"
    with tiny_stack(tiny_gemma3_dir, tmp_path, scheduler={"is_spec_adaptive": False}) as stack:
        model = served_model_name(stack)
        response = httpx.post(stack.base_url + "/v1/completions", timeout=120, json={
            "model": model, "prompt": REPEATING, "max_tokens": 48, "temperature": 0})
        assert response.status_code == 200
        status = httpx.get(stack.base_url + "/status", timeout=10).json()
        segments = [s for s in status["speculation"]["segments"] if s["num_accepted_tokens"] > 0]
        assert segments, status["speculation"]
        session = f"segserve-top-{uuid.uuid4().hex[:8]}"
        command = f"{SEGSERVE} top --url {stack.base_url} --interval-s 0.3"
        subprocess.run(["tmux", "new-session", "-d", "-s", session, "-x", "150", "-y", "40", command], check=True)
        try:
            screen = _wait_for_screen(session, "speculation per segment", segments[0]["segment"], "requests")
            assert f"segserve top · {stack.base_url} · {model}" in screen, screen
            lines = screen.splitlines()
            assert any("router" in line and "ok" in line for line in lines), screen
            assert any("scheduler" in line and "ready" in line for line in lines), screen
            assert any("workers" in line and "1/1 live" in line for line in lines), screen
            assert any("requests" in line and "0 running, 0 waiting" in line for line in lines), screen
            assert any("KV cache" in line and "blocks)" in line for line in lines), screen
            assert any("prefix cache" in line and "hit rate" in line for line in lines), screen
            assert any("reflow backlog" in line for line in lines), screen
            row = next(line for line in lines if line.strip("│ ").startswith(segments[0]["segment"]))
            assert str(segments[0]["num_accepted_tokens"]) in row, row
            # The view follows the stack: a second request shows in the segment's counts.
            httpx.post(stack.base_url + "/v1/completions", timeout=120, json={
                "model": model, "prompt": REPEATING, "max_tokens": 48, "temperature": 0})
            after = httpx.get(stack.base_url + "/status", timeout=10).json()["speculation"]["num_draft_tokens"]
            screen = _wait_for_screen(session, f" {after} ")
            assert f" {after} " in screen, screen
        finally:
            subprocess.run(["tmux", "kill-session", "-t", session], check=False)
