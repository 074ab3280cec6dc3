"""The systems `segserve bench spec` compares, each behind one call: (prompt, max_tokens, ...) -> request dict.

- `hf_system(model_dir, dtype, **generate_kwargs)`: in-process `model.generate`
  (EOS never stops it); plain, or with `prompt_lookup_num_tokens=10`.
- `segserve_system(model_dir, dtype, mode, ...)`: a whole local stack
  (`segserve.launcher.Stack`), non-streamed `POST /v1/completions` with
  `ignore_eos`, and the scheduler's GetStats counters read around every request.
  Modes: "off" (plain decoding, no drafter), "lookup" (prompt lookup only: the
  drafter gets LOOKUP_ONLY_SEGMENTS, so it drafts one chain from the request's
  own prompt and output and its corpus keeps nothing), "suffix" (the drafter's
  SuffixDecoding backend: its global and per-request suffix trees, the same
  engine, gate and verification) and "spec" (the shipped segments config:
  segment corpora learned online, trees).
- `vllm_system(model_dir, dtype, speculative_config, ...)`: `vllm serve` from `make vllm`'s venv
  (segserve.bench.peers.VllmServe), plain or with its SuffixDecoding (VLLM_SUFFIX_CONFIG), fresh each
  time, the same non-streamed requests with `ignore_eos`; no counters.

Each is a context manager factory yielding `complete(prompt, max_tokens,
temperature=0.0, seed=None) -> {"num_tokens", "wall_s", "text", "spec"}` (spec:
counter deltas, the drafter's among them, or None). The servers' (`HttpSystem`) also
take `tenant` (sent in TENANT_HEADER, which segserve's router trusts here) and
`is_measured=False` (no counters around the call: calls running side by side), and
have `counters()` for the deltas of a whole phase.
"""

from __future__ import annotations

import contextlib
import copy
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx

from segserve.bench.spec_report import SPEC_COUNTERS

Complete = Callable[..., dict]
TENANT_HEADER = "X-Segserve-Tenant"
"""The header a request's tenant travels in (the bench's segserve stacks trust it)."""
VLLM_SUFFIX_CONFIG = {"method": "suffix", "num_speculative_tokens": 5}
"""vLLM's SuffixDecoding as its docs start it."""
SEGSERVE_MODES = ("off", "lookup", "suffix", "spec")

# Prompt lookup only, on the same engine: no segment kinds, so the tracker never leaves the default segment and
# no segment ever closes; the generated text the default kind learns goes to a corpus capped at one node, which
# keeps none of it; one chain of up to 10 tokens from the request's own history, as HF's
# prompt_lookup_num_tokens=10.
LOOKUP_ONLY_SEGMENTS = """\
# Written by segserve bench spec: prompt lookup only (the request's own tokens), no corpora, no trees.
[default]
algorithm = "single_branch"
max_nodes = 10
max_depth = 10
max_candidates = 1
corpus = { max_entries = 1, max_depth = 2, max_key = 1, min_key = 1, decay = 0.5 }
"""


@contextlib.contextmanager
def hf_system(model_dir: Path, dtype: str = "float32", **generate_kwargs) -> Iterator[Complete]:
    """Single-stream `generate()`, greedy unless a call's temperature > 0; `generate_kwargs` e.g.
    prompt_lookup_num_tokens=10."""
    import torch

    from segserve.bench.peers import load_model

    model, tokenizer = load_model(model_dir, dtype)
    config = copy.deepcopy(model.generation_config)
    config.eos_token_id = None  # run to max_new_tokens, as segserve does with ignore_eos
    config.pad_token_id = tokenizer.pad_token_id
    config.do_sample = False

    def complete(prompt: str, max_tokens: int, temperature: float = 0.0, seed: int | None = None) -> dict:
        encoded = tokenizer(prompt, return_tensors="pt").to(model.device)  # input_ids: [1, L]
        call_config = copy.deepcopy(config)  # one config object: generate() deprecates config + kwargs
        call_config.update(max_new_tokens=max_tokens, **generate_kwargs)
        if temperature > 0:  # plain temperature sampling, as segserve's defaults (no top-k / top-p)
            call_config.update(do_sample=True, temperature=temperature, top_k=None, top_p=1.0)
            torch.manual_seed(seed or 0)
        started_at = time.perf_counter()
        with torch.inference_mode():
            output = model.generate(**encoded, generation_config=call_config)  # output: [1, L + T]
        wall_s = time.perf_counter() - started_at
        token_ids = output[0, encoded["input_ids"].shape[1] :].tolist()
        text = tokenizer.decode(token_ids, skip_special_tokens=True)
        return {"num_tokens": len(token_ids), "wall_s": wall_s, "text": text, "spec": None}

    try:
        yield complete
    finally:
        del model


def read_counters(stub) -> dict:
    """Scheduler counters now: num_steps, the spec totals, and per segment kind."""
    from protos.segserve.v1 import scheduler_pb2

    stats = stub.GetStats(scheduler_pb2.StatsRequest(), timeout=10.0)
    counters = {name: getattr(stats.spec, name) for name in SPEC_COUNTERS if name != "num_steps"}
    counters["num_steps"] = stats.num_steps
    counters["segments"] = {s.segment: {"num_verified": s.num_verified, "num_draft_tokens": s.num_draft_tokens,
                                        "num_accepted_tokens": s.num_accepted_tokens}
                            for s in stats.spec_segments}  # fmt: skip
    drafters = [replica.stats for replica in stats.drafters if replica.HasField("stats")]
    if drafters:  # one drafter per bench stack
        drafter = drafters[0]
        counters["drafter"] = {"num_draft_calls": drafter.num_draft_calls, "cpu_seconds": drafter.cpu_seconds,
                               "memory": {"num_bytes": sum(s.num_corpus_bytes for s in drafter.segments),
                                          "num_learned_tokens": sum(s.num_learned_tokens for s in drafter.segments)},
                               "sources": {f"{s.segment}/{source.source}": [source.num_judged, source.num_matched]
                                           for s in drafter.segments for source in s.sources},
                               "backend": drafter.backend}  # fmt: skip
    return counters


def counter_delta(before: dict, after: dict) -> dict:
    """after - before, per counter and per segment kind (segments new since `before` count from 0)."""
    delta = {name: after[name] - before[name] for name in SPEC_COUNTERS}
    delta["segments"] = {}
    for segment, values in after["segments"].items():
        old = before["segments"].get(segment, {})
        change = {name: value - old.get(name, 0) for name, value in values.items()}
        if any(change.values()):
            delta["segments"][segment] = change
    if "drafter" in before and "drafter" in after:  # CPU and calls over the request; memory at its end
        delta["drafter"] = {name: after["drafter"][name] - before["drafter"][name]
                            for name in ("num_draft_calls", "cpu_seconds")}  # fmt: skip
        old = before["drafter"].get("sources", {})
        delta["drafter"]["sources"] = {key: [judged - old.get(key, [0, 0])[0], matched - old.get(key, [0, 0])[1]]
                                       for key, (judged, matched) in after["drafter"].get("sources", {}).items()}
        delta["drafter"].update(memory=after["drafter"]["memory"], backend=after["drafter"]["backend"])
    return delta


def stack_config(model_dir: Path, dtype: str, mode: str, log_dir: Path, startup_timeout_s: float = 300.0):
    """The StackConfig of one segserve system; mode "lookup" writes LOOKUP_ONLY_SEGMENTS under log_dir."""
    from drafter.config import DrafterConfig
    from router.config import RouterConfig
    from scheduler.config import SchedulerConfig
    from segserve.launcher import StackConfig
    from worker.config import WorkerConfig

    if mode not in SEGSERVE_MODES:
        raise ValueError(f"mode must be one of {SEGSERVE_MODES}, got {mode!r}")
    drafter = DrafterConfig(port=0, backend="suffix" if mode == "suffix" else "segserve")
    if mode == "lookup":
        log_dir.mkdir(parents=True, exist_ok=True)
        segments = log_dir / "segments-lookup-only.toml"
        segments.write_text(LOOKUP_ONLY_SEGMENTS)
        drafter = DrafterConfig(port=0, segments_config=str(segments))
    return StackConfig(
        worker=WorkerConfig(model=str(model_dir), dtype=dtype, port=0),
        scheduler=SchedulerConfig(port=0),
        router=RouterConfig(port=0, grpc_port=0, tenant_header=TENANT_HEADER),  # port 0: the launcher picks
        drafter=drafter,
        is_speculative=mode != "off",
        startup_timeout_s=startup_timeout_s,
        log_dir=str(log_dir),
    )


@contextlib.contextmanager
def segserve_system(model_dir: Path, dtype: str, mode: str, log_dir: Path,
                    startup_timeout_s: float = 300.0, request_timeout_s: float = 600.0) -> Iterator[Complete]:  # fmt: skip
    """A fresh local stack (fresh corpora too), measured one request at a time."""
    import grpc

    from protos.segserve.v1 import scheduler_pb2_grpc
    from segserve.launcher import Stack

    config = stack_config(model_dir, dtype, mode, log_dir, startup_timeout_s)
    with Stack(config) as stack, grpc.insecure_channel(stack.config.router.scheduler_address) as channel:
        stub = scheduler_pb2_grpc.SchedulerStub(channel)
        # trust_env=False: a proxy configured for package registries must never see loopback traffic.
        with httpx.Client(base_url=stack.base_url, timeout=request_timeout_s, trust_env=False) as client:
            yield HttpSystem(client, stub)


@contextlib.contextmanager
def vllm_system(model_dir: Path, dtype: str, speculative_config: dict | None, log_dir: Path,
                startup_timeout_s: float = 300.0, request_timeout_s: float = 600.0) -> Iterator[Complete]:
    """A fresh `vllm serve` (its compile cache is kept between starts), measured one request at a time."""
    from segserve.bench.peers import VllmServe

    log_dir.mkdir(parents=True, exist_ok=True)
    server = VllmServe(model_dir, dtype=dtype, speculative_config=speculative_config,
                       startup_timeout_s=max(startup_timeout_s, 900.0), log_path=log_dir / "vllm.log")
    with server, httpx.Client(base_url=server.base_url, timeout=request_timeout_s, trust_env=False) as client:
        yield HttpSystem(client, None, model=server.model_name)


@dataclass
class HttpSystem:
    """A server's `complete` (see the module docstring); httpx's client may be shared by threads."""

    client: httpx.Client
    stub: object | None = None
    """The scheduler's stub for counters (segserve), or None."""
    model: str | None = None
    """The body's model field, for a server that needs one."""

    def __call__(self, prompt: str, max_tokens: int, temperature: float = 0.0, seed: int | None = None,
                 tenant: str = "", is_measured: bool = True) -> dict:  # fmt: skip
        return complete_http(self.client, self.stub if is_measured else None, prompt, max_tokens, temperature, seed,
                             self.model, tenant)

    def counters(self) -> dict | None:
        """The scheduler's counters now, or None for a server without them."""
        return read_counters(self.stub) if self.stub else None


def complete_http(client: httpx.Client, stub, prompt: str, max_tokens: int, temperature: float = 0.0,
                  seed: int | None = None, model: str | None = None, tenant: str = "") -> dict:  # fmt: skip
    """One completion, EOS ignored, greedy or sampled with `seed`; `stub` (a SchedulerStub or None) gives the
    counter deltas; `model`: the body's model field, for a server that needs one; `tenant` goes in
    TENANT_HEADER."""
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": temperature, "ignore_eos": True}
    if model is not None:
        body["model"] = model
    if temperature > 0 and seed is not None:
        body["seed"] = seed
    before = read_counters(stub) if stub else None
    started_at = time.perf_counter()
    response = client.post("/v1/completions", json=body, headers={TENANT_HEADER: tenant} if tenant else None)
    wall_s = time.perf_counter() - started_at
    if response.status_code != 200:
        raise RuntimeError(f"the server answered HTTP {response.status_code}: {response.text[:300]}")
    data = response.json()
    spec = counter_delta(before, read_counters(stub)) if stub else None
    return {"num_tokens": data["usage"]["completion_tokens"], "wall_s": wall_s,
            "text": data["choices"][0]["text"], "spec": spec}  # fmt: skip
