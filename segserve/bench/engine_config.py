"""`segserve bench engine`'s options: one dataclass, shared by the bench (engine.py) and its HF compiled
baseline (hf_compiled.py)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path


@dataclass
class EngineBenchConfig:
    model: str | None = None
    """A catalog name (qwen2.5-coder-0.5b-instruct, gemma-3-270m) or a transformers model directory; None = the default
    model (ignored with is_tiny or is_random_weights)."""
    is_tiny: bool = False
    """Build a tiny random 4-layer Gemma3 in a temporary directory and bench that."""
    is_random_weights: bool = False
    """Bench gemma-3-270m's shape with random weights, built in a temporary directory: for a machine without the
    default model's package (a GPU box that reaches no registry). Its speed is the real model's; its text is not."""
    random_shape: str = "gemma-3-270m"
    """Whose shape is_random_weights builds: gemma-3-270m or llama-3.1-8b (segserve/bench/random_models.py)."""
    tensor_parallel_size: int = 1
    """Ranks the worker's model is split over (WorkerConfig.tensor_parallel_size): cuda:0..N-1 on a GPU machine,
    gloo between CPU processes; HF compiled, with is_hf_compiled, runs on one device."""
    device: str = "auto"
    """auto (cuda when present), cpu or cuda."""
    dtype: str = "auto"
    """auto = bfloat16 on cuda, float32 on cpu."""
    batch_sizes: tuple[int, ...] = (1, 16, 64, 256)
    """Decode batch sizes, one measurement each."""
    steps: int = 16
    """Timed decode steps per round: half of them, at random, split into parts, the others whole ("untimed")."""
    warmup_steps: int = 3
    """Untimed decode steps after the prefill."""
    repeats: int = 3
    """Timed rounds per batch size (median and spread over them)."""
    prompt_len: int = 32
    """Tokens of every (random) prompt."""
    repetition_penalty: float = 1.0
    """Every sequence's repetition_penalty (1.0 = off); != 1.0 exercises the sampler's penalty path."""
    is_draft: bool = False
    """Draft with the drafter's planner in-process (own-history and corpus lookup) and verify trees."""
    max_draft_nodes: int = 8
    """Largest tree per sequence per step, with is_draft."""
    num_decode_steps: int = 1
    """Decode steps per request to the runner (multi-step decoding, scheduler/decode_steps.py); a "step" of the
    report is then one request of that many."""
    is_compiled: bool = False
    """Run the worker's decoder compiled (WorkerConfig.is_compiled); its buckets compile before the timing."""
    is_cuda_graphs: bool | None = None
    """Decode steps on static buffers, replayed from CUDA graphs on a GPU (WorkerConfig.is_cuda_graphs; None = the
    worker's default: on a GPU with a lean decoder); graphs are captured as their shapes first come, in the warm-up
    steps or the timed ones."""
    is_compiled_layers: bool | None = None
    """The lean decoder's layers compiled around their attention, in the warm-up (WorkerConfig.is_compiled_layers;
    None = the worker's default: on a GPU with a lean decoder)."""
    is_lean_decoder: bool = True
    """The worker's lean forward of Gemma3, Llama, Mistral, Qwen2 and Qwen3 (WorkerConfig.is_lean_decoder); False =
    transformers' forward."""
    linear_block_rows: int = -1
    """How the worker's linears get their rows (WorkerConfig.linear_block_rows): -1 = the probe's choice per
    weight shape, N > 0 = blocks of N rows, 0 = as they come."""
    is_hf_compiled: bool = False
    """Also time HF generate() with a static cache and torch.compile (slow to compile on a CPU)."""
    json_schema: str = ""
    """A JSON schema (its text, or a file holding it) on every sequence as its structured output: each batch size
    then runs plain and constrained, round by round, and reports the difference (grammar_ms); "" = plain only."""
    num_threads: int = 0
    """torch intra-op threads; 0 = torch's default."""
    seed: int = 0
    """Seed of the prompts and the tiny model's weights."""
    out: str = "bench-results/engine"
    """Directory for engine.json and engine.png."""

    def __post_init__(self) -> None:
        self.batch_sizes = tuple(self.batch_sizes)
        if not self.batch_sizes or min(self.batch_sizes) < 1:
            raise ValueError("batch_sizes must be a non-empty list of sizes >= 1")
        if self.steps < 2 or self.repeats < 1 or self.warmup_steps < 0 or self.prompt_len < 1:
            raise ValueError("steps must be >= 2 (half of them are timed), repeats and prompt_len >= 1, "
                             "warmup_steps >= 0")
        if self.repetition_penalty <= 0 or self.max_draft_nodes < 1 or self.num_threads < 0:
            raise ValueError("repetition_penalty must be > 0, max_draft_nodes >= 1, num_threads >= 0")
        from protos.segserve.v1.step import MAX_DECODE_STEPS

        if not 1 <= self.num_decode_steps <= MAX_DECODE_STEPS:
            raise ValueError(f"num_decode_steps must be in 1..{MAX_DECODE_STEPS}")
        if self.device not in ("auto", "cpu", "cuda") or self.dtype not in ("auto", "float32", "bfloat16", "float16"):
            raise ValueError(f"unsupported device {self.device!r} or dtype {self.dtype!r}")
        from segserve.bench.random_models import RANDOM_SHAPES

        if self.random_shape not in RANDOM_SHAPES or self.tensor_parallel_size < 1:
            raise ValueError(f"random_shape must be one of {', '.join(RANDOM_SHAPES)}; tensor_parallel_size >= 1")
        if self.json_schema:
            self.schema_spec()

    def schema_spec(self) -> str:
        """json_schema as compact JSON text (read from its file when it is not JSON text). Raises ValueError."""
        text = self.json_schema
        if not text.lstrip().startswith("{"):
            try:
                text = Path(text).read_text()
            except OSError as exc:
                raise ValueError(f"json_schema: neither a JSON object nor a readable file: {exc}") from None
        try:
            schema = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ValueError(f"json_schema is not JSON: {exc}") from None
        if not isinstance(schema, dict):
            raise ValueError("json_schema must be a JSON object")
        return json.dumps(schema, separators=(",", ":"), ensure_ascii=False)
