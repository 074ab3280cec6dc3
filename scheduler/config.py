"""The scheduler's typed configuration; CLI flags derive from these fields."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from protos.segserve.v1.step import MAX_DECODE_STEPS
from common.tls import InternalTlsFields, internal_tls
from common.tracing import TracingFields, settings_of

AUTO_MAX_NUM_SEQS_RANGE = (16, 256)
"""The least and the most sequences the automatic max_num_seqs picks: the top is vLLM's default max_num_seqs;
the floor keeps a small pool batching short requests (the scheduler admits only what fits, so a cap above
what the pool holds costs nothing but preemptions)."""
TYPICAL_SEQ_LEN = 1024
"""Tokens of a typical running sequence (a prompt with its history and the answer so far), for sizing the batch."""


def auto_max_num_seqs(num_kv_blocks: int, block_size: int, max_model_len: int) -> int:
    """As many sequences as the worker's KV pool holds at a typical length: num_kv_blocks // the blocks of
    min(TYPICAL_SEQ_LEN, max_model_len) tokens, clamped to AUTO_MAX_NUM_SEQS_RANGE ([16, 256]).

    E.g. 1,820 blocks of 16 tokens (gemma-3-270m, fp32, 1 GiB) hold 28 sequences of 1,024 tokens; a
    pool that holds 256 such sequences or more gets 256. Sequences that grow past the typical length are
    handled as always: the scheduler admits only what fits and preempts when the pool runs out."""
    if num_kv_blocks <= 0 or block_size <= 0:
        raise ValueError("num_kv_blocks and block_size must be > 0")
    seq_len = min(TYPICAL_SEQ_LEN, max_model_len) if max_model_len > 0 else TYPICAL_SEQ_LEN
    blocks_per_seq = -(-seq_len // block_size)
    low, high = AUTO_MAX_NUM_SEQS_RANGE
    return max(low, min(high, num_kv_blocks // blocks_per_seq))


@dataclass
class SchedulerConfig(InternalTlsFields, TracingFields):
    worker_address: str = "127.0.0.1:50061"
    """gRPC address of the worker; several comma-separated (data parallel: each has its own KV pool), or
    dns:///name:port for every address a name resolves to, re-resolved every 10 s."""
    max_num_seqs: int | None = None
    """Most sequences in one step; None (unset) = automatic, from the worker's KV memory once it answers: as
    many sequences as its KV blocks hold at 1,024 tokens each (or max_model_len when shorter), from 16 to 256
    (`auto_max_num_seqs`; the scheduler logs the value)."""
    max_num_batched_tokens: int = 256
    """Token budget of one step (prefill chunks, decode and draft tokens together)."""
    host: str = "127.0.0.1"
    """Address the gRPC server binds to (localhost by default)."""
    port: int = 50051
    """gRPC port (0 = any free port)."""
    max_num_waiting: int = 1024
    """Most requests queued but not running; more are refused (RESOURCE_EXHAUSTED, HTTP 429)."""
    max_num_waiting_tokens: int = 262144
    """Most prompt tokens queued but not running; a request that would pass it is refused like a full queue
    (an empty queue admits any request that fits the model)."""
    worker_step_timeout_s: float = 120.0
    """Deadline of one worker step; a step past it fails the requests it carried."""
    max_failed_steps: int = 8
    """Failed worker steps in a row before a request ends with an error. A failed step is a whole step that ran out
    of memory, hit an internal error or got a malformed answer; the request then ends with FINISH_REASON_ERROR.
    Each failed step is retried by preemption at half the batch size."""
    drafter_addresses: list[str] = field(default_factory=list)
    """gRPC addresses of the drafter replicas (requests are hashed over them); empty = no speculation."""
    draft_timeout_ms: float = 20.0
    """Deadline of the one batched Draft call per step; past it the step runs without speculation."""
    max_draft_nodes: int = 16
    """Most draft nodes (root excluded) in one sequence's candidate tree."""
    is_spec_adaptive: bool = True
    """Choose the node budget per step from measured step times and acceptance (False = always the max)."""
    is_grammar_drafts: bool = True
    """Draft the spans a grammar forces for free. With speculation on, the span a structured output's grammar
    forces next (keys, punctuation, the rest of an enum) is drafted at no drafter cost; off, constrained requests
    get the drafter's trees only."""
    spec_probe_interval: int = 64
    """Steps between probes of a speculation setting the policy has turned off (its stats go stale)."""
    drafter_retry_s: float = 1.0
    """First backoff after a drafter replica fails; it doubles per failure up to 60 s."""
    is_async_scheduling: bool = True
    """Send the next decode step while the worker runs one (vLLM's async scheduling). The worker fills in
    the tokens it is sampling, so it never waits for the scheduler's round trip between steps. Only in the
    steady decode state (no request waiting, no prefill) and while nothing is drafted, since a tree needs each
    step's tokens first; greedy output is the same either way."""
    num_decode_steps: int = 8
    """Most decode steps in one request to the worker (multi-step decoding). They are taken while nobody waits
    and nothing is drafted (scheduler/decode_steps.py), within decode_steps_ms. Fewer round trips per token, at
    the price of tokens reaching a stream several at a time; 1 = one step per request. Capped by the worker's
    WorkerInfo.max_decode_steps. worker_step_timeout_s bounds the whole request, all of its steps."""
    decode_steps_ms: float = 25.0
    """Longest the decode steps of one request may take together, in ms. It is judged by the worker's recent compute
    time per step: a stream's tokens come at least this often (40 times a second at 25 ms), and a request that arrives
    waits at most about this long (twice, behind a step ahead) for its prefill. Where a step takes longer than half of
    it, every request is one step. 0 = no bound: always num_decode_steps."""
    is_prefix_caching: bool = True
    """Automatic prefix caching: share the KV blocks of common prefixes. Full KV blocks are kept (LRU) after their
    request ends and shared by any request whose tokens start with the same blocks (chat turns, shared system
    prompts, n > 1 choices)."""
    drain_timeout_s: float = 10.0
    """Seconds the requests under way get to finish after SIGTERM. Meanwhile health is NOT_SERVING and new
    Generate calls are refused with UNAVAILABLE (a router retries them on another scheduler); a pod's
    terminationGracePeriodSeconds must cover it."""
    ray_address: str | None = None
    """Ray cluster to run the scheduler actor on (e.g. 10.0.0.5:6379 of `ray start --head`, or "auto");
    None = a private Ray instance on this machine."""
    start_timeout_s: float = 120.0
    """Seconds for Ray's start and the scheduler actor's (placed, serving gRPC); past them the process exits with
    code 1, for its supervisor (the launcher, Kubernetes) to start it again, rather than hang unready. Raise it
    for a cluster that must first scale up to place the actor."""

    def __post_init__(self) -> None:
        if self.max_num_seqs is not None and self.max_num_seqs <= 0:
            raise ValueError("max_num_seqs must be > 0 (or unset for automatic)")
        if self.max_num_batched_tokens <= 0:
            raise ValueError("max_num_batched_tokens must be > 0")
        if self.max_num_waiting <= 0:
            raise ValueError("max_num_waiting must be > 0")
        if self.max_num_waiting_tokens <= 0:
            raise ValueError("max_num_waiting_tokens must be > 0")
        if not 0 <= self.port < 65536:
            raise ValueError("port must be in 0..65535")
        if self.worker_step_timeout_s <= 0:
            raise ValueError("worker_step_timeout_s must be > 0")
        if self.max_failed_steps <= 0:
            raise ValueError("max_failed_steps must be > 0")
        self.drafter_addresses = [a for a in self.drafter_addresses if a]
        if self.draft_timeout_ms <= 0:
            raise ValueError("draft_timeout_ms must be > 0")
        if self.max_draft_nodes < 0:
            raise ValueError("max_draft_nodes must be >= 0")
        if self.spec_probe_interval <= 0:
            raise ValueError("spec_probe_interval must be > 0")
        if self.drafter_retry_s <= 0:
            raise ValueError("drafter_retry_s must be > 0")
        if self.drain_timeout_s < 0:
            raise ValueError("drain_timeout_s must be >= 0")
        if not 1 <= self.num_decode_steps <= MAX_DECODE_STEPS:
            raise ValueError(f"num_decode_steps must be in 1..{MAX_DECODE_STEPS}")
        if not (math.isfinite(self.decode_steps_ms) and self.decode_steps_ms >= 0):
            raise ValueError("decode_steps_ms must be a finite number >= 0")
        if self.start_timeout_s <= 0:
            raise ValueError("start_timeout_s must be > 0")
        internal_tls(self)  # ValueError naming the fields when only some are given
        settings_of(self)  # ValueError naming the field for a bad endpoint or ratio

    def resolve_max_num_seqs(self, num_kv_blocks: int, block_size: int, max_model_len: int) -> int:
        """max_num_seqs when set, else the automatic value for the worker's KV pool (`auto_max_num_seqs`)."""
        if self.max_num_seqs is not None:
            return self.max_num_seqs
        return auto_max_num_seqs(num_kv_blocks, block_size, max_model_len)
