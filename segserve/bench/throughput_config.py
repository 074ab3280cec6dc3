"""`segserve bench throughput`'s options: one dataclass, shared by the bench (throughput.py) and its gRPC
drivers (grpc_direct.py, grpc_public.py)."""

from __future__ import annotations

import json
from dataclasses import dataclass

from segserve.bench import loadgen

PEER_CHOICES = ("auto", "vllm", "transformers-serve", "batched-generate", "none")


@dataclass
class ThroughputConfig:
    model: str | None = None
    """A catalog name (qwen2.5-coder-0.5b-instruct, gemma-3-270m) or a transformers model directory; None = the default
    model. Every system runs this one."""
    concurrency: tuple[int, ...] = (1, 4, 16)
    """Concurrent stream counts; the lowest and highest are the ones the goals compare."""
    max_tokens: int = 64
    """Tokens generated per request (EOS is ignored where the server allows it)."""
    requests_per_stream: int = 2
    """Requests each stream sends back to back at every level."""
    peer: str = "auto"
    """auto (transformers serve, else batched generate()), vllm (`make vllm`'s, measured in alternated rounds beside
    segserve), transformers-serve, batched-generate or none."""
    peer_args: str = ""
    """Extra flags for the peer's server, e.g. "--cb-num-blocks 256" for `transformers serve`."""
    rounds: int = 3
    """With the vllm peer: alternated rounds of every level against both servers; ratios come with their spread."""
    vllm_speculative_config: str = '{"method": "suffix", "num_speculative_tokens": 5}'
    """vLLM's --speculative-config (JSON) when speculation is on: its SuffixDecoding by default."""
    segserve_url: str | None = None
    """Measure an already running segserve at this loopback URL instead of launching one."""
    skip_segserve: bool = False
    """Measure only the baseline and the peer."""
    router_overhead: bool = True
    """Also drive the launched stack's scheduler over gRPC directly, for the router's overhead per token."""
    overhead_rounds: int = 0
    """With router_overhead, this many more rounds after the levels: each runs every level through the router
    and then straight to the scheduler, back to back; the report gives each level's overhead per round, and
    their median and spread (this machine's speed drifts between the levels of one pass)."""
    decode_rounds: int = 0
    """This many rounds at one stream after the levels, each a generate() and one stream through the router back to
    back, for their decode rates' ratio, median and spread (segserve/bench/decode_rounds.py)."""
    grpc_api: bool = True
    """Also drive the launched stack's router through its public gRPC API (GenerateStream) at every level."""
    baseline_runs: int = 2
    """Measured runs of plain generate() (after one warm-up); the median is reported."""
    level_time_limit_s: float = 600.0
    """Longest one concurrency level may run."""
    request_timeout_s: float = 300.0
    """Longest one request may take."""
    startup_timeout_s: float = 300.0
    """Longest a server may take to become ready."""
    dtype: str = "auto"
    """Weights dtype for every system: auto = bfloat16 on cuda, float32 on cpu."""
    speculation: bool = True
    """Run the launched stack with drafters and speculative decoding (False: plain decoding, as the baseline)."""
    async_scheduling: bool = True
    """The launched scheduler's async scheduling (the next decode step sent while one runs; speculation off only)."""
    compiled: bool = False
    """The launched worker's decoder compiled (WorkerConfig.is_compiled); HF's baseline stays eager."""
    num_decode_steps: int | None = None
    """The launched scheduler's multi-step decoding (SchedulerConfig.num_decode_steps; 1 = off, None = its
    default)."""
    decode_steps_ms: float | None = None
    """The launched scheduler's time bound on one request's decode steps (SchedulerConfig; None = its default)."""
    out: str = "bench-results"
    """Directory for throughput.json, throughput.png and logs."""

    def __post_init__(self) -> None:
        self.concurrency = tuple(sorted(set(self.concurrency)))
        if not self.concurrency or min(self.concurrency) <= 0:
            raise ValueError("concurrency must list positive stream counts")
        if self.max_tokens < 2 or self.requests_per_stream <= 0 or self.baseline_runs <= 0:
            raise ValueError("max_tokens must be >= 2; requests_per_stream and baseline_runs > 0")
        if self.overhead_rounds < 0 or self.decode_rounds < 0 or self.rounds < 1:
            raise ValueError("overhead_rounds and decode_rounds must be >= 0, rounds >= 1")
        if not isinstance(_json_or_none(self.vllm_speculative_config), dict):
            raise ValueError("vllm_speculative_config must be a JSON object")
        if self.peer not in PEER_CHOICES:
            raise ValueError(f"peer must be one of {PEER_CHOICES}")
        if min(self.level_time_limit_s, self.request_timeout_s, self.startup_timeout_s) <= 0:
            raise ValueError("time limits must be > 0")
        if self.dtype not in ("auto", "float32", "bfloat16", "float16"):
            raise ValueError(f"unsupported dtype {self.dtype!r}")
        if self.segserve_url:
            loadgen.check_loopback(self.segserve_url)


def _json_or_none(text: str):
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return None
