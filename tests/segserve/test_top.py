"""`segserve top` in a real terminal: run under tmux (Debian's package; .ci/run and `make test` install it)
against a live stack on a tiny model, its screen read with `tmux capture-pane`; and one screen rendered directly."""

from __future__ import annotations

import shutil
import subprocess
import sys
import time
import uuid
from pathlib import Path

import httpx
import pytest
from rich.console import Console

from drafter.corpus import LookupCorpus
from drafter.memory import save_corpora
from segserve.top import render
from tests.support.e2e_helpers import served_model_name, tiny_stack

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
    corpus = LookupCorpus()
    corpus.add(range(100, 200))  # 100 learned tokens
    save_corpora({"code": corpus}, tmp_path / "corpora")
    # a Draft deadline a loaded machine meets: one missed deadline backs the drafter off for the whole answer
    with tiny_stack(tiny_gemma3_dir, tmp_path, scheduler={"is_spec_adaptive": False, "draft_timeout_ms": 2000},
                    drafter={"corpus_dir": str(tmp_path / "corpora")}) as stack:
        model = served_model_name(stack)
        response = httpx.post(stack.base_url + "/v1/completions", timeout=120, json={
            "model": model, "prompt": REPEATING, "max_tokens": 48, "temperature": 0})
        assert response.status_code == 200
        status = httpx.get(stack.base_url + "/status", timeout=10).json()
        segments = [s for s in status["speculation"]["segments"] if s["num_accepted_tokens"] > 0]
        assert segments, status["speculation"]
        session = f"segserve-top-{uuid.uuid4().hex[:8]}"
        # The pane's own size, not a COLUMNS=80 / LINES the test process may carry into tmux's environment.
        command = f"env -u COLUMNS -u LINES {SEGSERVE} top --url {stack.base_url} --interval-s 0.3"
        subprocess.run(["tmux", "new-session", "-d", "-s", session, "-x", "150", "-y", "60", command], check=True)
        try:
            screen = _wait_for_screen(session, "speculation per segment", segments[0]["segment"], "requests",
                                      "drafters", "corpus entries")
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
            # The fixed policy drafts every segment kind with the full budget; the gate never decides for it.
            assert "on, 16 nodes" in row, row
            assert "gate: no decision yet" in screen, screen
            # The drafters table: the one replica, live, with the code corpus it loaded (100 tokens, its bytes).
            (drafter,) = status["drafters"]
            assert drafter["is_live"] and drafter["is_answering"], status["drafters"]
            code = next((line for line in lines if " code " in line and "KiB" in line), screen)
            assert " 100 " in code and f"{corpus.num_bytes / 1024:.1f} KiB" in code, code
            assert any(drafter["address"] in line and "live" in line for line in lines), screen
            # The view follows the stack: a second request shows in the segment's counts.
            httpx.post(stack.base_url + "/v1/completions", timeout=120, json={
                "model": model, "prompt": REPEATING, "max_tokens": 48, "temperature": 0})
            after = httpx.get(stack.base_url + "/status", timeout=10).json()["speculation"]["num_draft_tokens"]
            screen = _wait_for_screen(session, f" {after} ")
            assert f" {after} " in screen, screen
        finally:
            subprocess.run(["tmux", "kill-session", "-t", session], check=False)


def test_the_screen_shows_drafting_off_the_gate_per_segment_and_its_decision_and_a_silent_drafter():
    status = {"model": "m", "components": {"router": "ok", "scheduler": "ready", "workers": "1/1 live"},
              "speculation": {"num_drafts": 0, "num_draft_tokens": 0, "num_accepted_tokens": 0, "acceptance": None,
                              "gate": {"batch_bucket": 16, "is_open": False},
                              "segments": [{"segment": "json", "num_drafts": 0, "num_draft_tokens": 0,
                                            "num_accepted_tokens": 0, "acceptance": None,
                                            "accepted_per_draft": None, "is_drafting": False, "budget_nodes": 0,
                                            "gate": {"batch_bucket": 16, "is_open": False}},
                                           {"segment": "code", "num_drafts": 9, "num_draft_tokens": 36,
                                            "num_accepted_tokens": 27, "acceptance": 0.75,
                                            "accepted_per_draft": 3.0, "is_drafting": True, "budget_nodes": 4,
                                            "gate": {"batch_bucket": 16, "is_open": True}},
                                           {"segment": "prose", "num_drafts": 0, "num_draft_tokens": 0,
                                            "num_accepted_tokens": 0, "acceptance": None,
                                            "accepted_per_draft": None, "is_drafting": False, "budget_nodes": 0,
                                            "gate": None}]},
              "drafters": [{"address": "10.0.0.2:50071", "is_live": False, "is_answering": False,
                            "num_requests": None, "segments": []},
                           {"address": "10.0.0.3:50071", "is_live": True, "is_answering": True, "num_requests": 1,
                            "segments": [{"segment": "json", "corpus_entries": 5000, "corpus_bytes": 3 * 2**20,
                                          "num_requests": 1}]}]}
    console = Console(width=150, record=True)
    console.print(render(status, "http://x"))
    lines = console.export_text().splitlines()
    assert any("json" in line and "off" in line and "closed (9-16 seqs)" in line for line in lines), lines
    assert any("code" in line and "on, 4 nodes" in line and "open (9-16 seqs)" in line for line in lines), lines
    assert any("prose" in line and "off" in line and "open" not in line and "closed" not in line
               for line in lines), lines  # the gate has not decided for it yet
    assert any("gate: speculation off for batches of 9-16 sequences" in line for line in lines), lines
    assert any("10.0.0.2:50071" in line and "backing off" in line and "no stats" in line for line in lines), lines
    assert any("10.0.0.3:50071" in line and "live" in line and "5000" in line and "3.0 MiB" in line
               for line in lines), lines
