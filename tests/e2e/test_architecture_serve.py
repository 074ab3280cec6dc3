"""Architectures beyond the lean decoders given to `segserve serve` as a user runs it. LFM2 and Jamba (state besides
the KV cache: short convolutions, Mamba mixers) are served, drafters and all, as transformers' greedy output, the
same prompt twice (no prefix shared). A model the worker would serve wrong (Bloom) stops the command at start-up
with the worker's reason as its last line, and leaves no process behind."""

from __future__ import annotations

import contextlib
import time

import psutil
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from tests.e2e.test_serve_supervision import Serve
from tests.support.architectures import build_architecture

pytestmark = pytest.mark.e2e


def test_serve_refuses_a_model_it_would_serve_wrong_saying_why(tmp_path):
    serve = Serve(build_architecture("bloom", tmp_path / "bloom"), tmp_path / "logs")
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
    assert ("SelfCheckFailed: BloomForCausalLM is not served: its attention never calls the attention interface, "
            "so it would run unmasked") in last
    assert any(argv[1:4] == ["-m", "segserve.cli", "worker"] for argv in children.values())
    assert not [child for child in children if child.is_running() and child.status() != psutil.STATUS_ZOMBIE]


@pytest.mark.parametrize(("name", "stateful"), [("lfm2", "[0] (Lfm2ShortConv)"), ("jamba", "[0] (JambaMambaMixer)")])
def test_serve_serves_a_model_with_sequence_state_as_transformers_greedy_output(name, stateful, tmp_path):
    model_dir = build_architecture(name, tmp_path / name)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    prompt = "def add(a, b):"
    ids = tokenizer(prompt, return_tensors="pt").input_ids
    with torch.inference_mode():
        generated = model.generate(ids, do_sample=False, max_new_tokens=12)[0, ids.shape[1]:]
    expected = tokenizer.decode(generated, skip_special_tokens=True)
    serve = Serve(model_dir, tmp_path / "logs")
    services: list[psutil.Process] = []
    try:
        serve.wait_ready()
        client, served = serve.client()
        for _ in range(2):
            completion = client.completions.create(model=served, prompt=prompt, max_tokens=12, temperature=0)
            assert completion.choices[0].text == expected
        services = psutil.Process(serve.process.pid).children(recursive=True)
        assert serve.process.poll() is None
    finally:
        assert serve.stop() == 0
    assert services and not [p for p in services if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
    scheduler_log = (tmp_path / "logs" / "scheduler.log").read_text()
    assert f"no shared prefixes for {name}: its layers {stateful} keep a state" in scheduler_log
