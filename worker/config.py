"""The worker's typed configuration; CLI flags derive from these fields."""

from __future__ import annotations

from dataclasses import dataclass

from common.tls import InternalTlsFields, internal_tls
from common.tracing import TracingFields, settings_of
from worker.threads import parse_cpu_list


@dataclass
class WorkerConfig(InternalTlsFields, TracingFields):
    model: str | None = None
    """A catalog name (qwen2.5-coder-0.5b-instruct, gemma-3-270m: common/catalog.py) or a transformers
    causal-LM directory; None serves the default model, qwen2.5-coder-0.5b-instruct."""
    served_model_name: str | None = None
    """Name the model is served under; defaults to the directory name."""
    device: str = "auto"
    """torch device: "auto" picks cuda when present, else cpu."""
    dtype: str = "auto"
    """torch dtype: "auto" is bfloat16 on cuda and float32 on cpu."""
    block_size: int = 16
    """Tokens per KV-cache block."""
    kv_cache_gb: float = 1.0
    """Memory given to the KV cache, in GiB; sets the number of blocks."""
    num_kv_blocks: int = 0
    """Exact number of KV blocks; overrides kv_cache_gb when > 0 (tests use it to run short of memory)."""
    max_model_len: int = 0
    """Longest sequence served; 0 = the model's max_position_embeddings."""
    num_threads: int = 0
    """torch intra-op threads on cpu; 0 = torch's default capped by the CPUs this process may use (its affinity
    and its cgroup's CPU quota: worker/threads.py). The local stack gives its worker all CPUs but one."""
    compute_cpus: str = ""
    """CPUs the compute threads are bound to, as a CPU list ("1-3,6"). The list is written as taskset -c and cpusets
    write it (worker/threads.py, bind_compute_thread); the compute threads are the thread that runs the steps and the
    threads it starts, torch's among them. Its other threads (gRPC's) keep the process's CPUs, so the next step is
    received while this one computes. Empty = no binding. A local stack binds its CPU workers to the CPUs their threads
    use (segserve/launcher.py)."""
    is_packed_linear: bool = True
    """On cpu, pack the large linear weights once for oneDNN. Every weight of at least 2**16 elements is packed
    (worker/packed_linear.py; smaller ones stay torch's, cheaper per call), the q/k/v and gate/up siblings as one weight
    each: about twice the decode throughput at 16 rows, for a second copy of the linear weights in memory."""
    linear_block_rows: int = -1
    """How the linears get their rows; -1 = probed. A row's output must not depend on its batch, so that greedy
    speculation stays lossless (worker/row_blocks.py): -1 = probe this machine at load and give each weight shape the
    cheapest way that holds (as they come, padded to a few rows, or blocks); N > 0 = blocks of exactly N rows
    everywhere; 0 = as they come (a BLAS then picks its kernel by the row count, and rows may differ in the last bits
    between batch sizes: measured on an H100 in fp32, on an Intel Xeon, and at one shape of gemma-3-270m on CI's
    CPU)."""
    is_compiled: bool = False
    """Run the decoder compiled by torch.compile. It compiles (worker/compiled.py) static shapes, one per power of two
    of the tokens in a step, compiled during the warm-up up to compile_max_tokens (seconds to half a minute each
    on a CPU; the log says how long). Fewer, fused ops per forward; its numerics differ from the eager forward's
    in the last bits, so every step of the worker runs compiled."""
    is_lean_decoder: bool = True
    """Run the eager forward without transformers' wrappers. For Gemma3, Llama, Mistral, Qwen2 and Qwen3, the forward
    skips transformers' per-call wrappers and mask building (worker/lean_decoder.py): the same modules and ops,
    bit-identical logits, less Python per step. Other models, and a compiled decoder, run transformers' forward either
    way."""
    is_cuda_graphs: bool | None = None
    """Replay decode steps from CUDA graphs. Decode steps (one token per sequence, up to 256 sequences) run on static
    buffers, replayed from CUDA graphs captured per batch size and key length (worker/decode_graphs.py), so that a step
    is one launch instead of one per kernel. Needs a lean decoder (is_lean_decoder, not is_compiled, one of its
    architectures). None (the default): on where the worker runs on CUDA with a lean decoder, off elsewhere. True on the
    CPU runs the same padded steps eagerly, with nothing to capture: what the tests check it with."""
    is_compiled_layers: bool | None = None
    """Compile the lean decoder's layers around their attention. Each layer runs as two regions compiled by
    torch.compile around its eager paged attention (worker/compiled_layers.py): the norms, casts, rotary embedding,
    activations and residuals fused into a few kernels per layer, one compile for every layer and token count (seconds,
    during the warm-up), for every step. Needs a lean decoder. Its numerics differ from the eager layers' in the last
    bits; the linears stay unpacked. None (the default): on where the worker runs on CUDA with a lean decoder, off
    elsewhere."""
    compile_max_tokens: int = 256
    """Largest step bucket compiled in the warm-up, with is_compiled. The buckets up to this many tokens (1, 2, 4, ...)
    are compiled before the worker is ready; a larger step compiles its bucket when it first comes. The scheduler's
    max_num_batched_tokens (256 by default) is the most a step holds."""
    is_self_check: bool = True
    """Check the worker's logits against transformers' at start-up (--no-self-check: skip it, for operators who
    have checked the model's output themselves). The self-check (worker/self_check.py) runs a prompt, decode steps
    and a draft tree through the worker's path and transformers' eager forward; logits apart beyond the dtype's
    tolerance refuse the start, naming why."""
    tensor_parallel_size: int = 1
    """Ranks the model is split over (tensor parallelism). Its attention heads, MLP columns, vocabulary and KV cache
    are divided among N processes (worker/tensor_parallel.py), one device each (cuda:0..N-1 on a GPU machine, gloo between
    CPU processes), which run every step together; the scheduler sees one worker. Rank 0 serves gRPC and starts the
    others (on a Ray cluster: actors packed on one node). Needs a lean decoder's architecture, and N dividing the
    attention heads, the MLP columns and the key-value heads (or a multiple of them)."""
    host: str = "127.0.0.1"
    """Address the gRPC server binds to (localhost by default)."""
    port: int = 50061
    """gRPC port."""

    def uses_cuda_graphs(self, device_type: str, has_lean_decoder: bool) -> bool:
        """is_cuda_graphs with its default resolved, for a worker on `device_type` whose model has a lean decoder
        or not: None means on CUDA with a lean decoder."""
        return _on_cuda_with_lean(self.is_cuda_graphs, device_type, has_lean_decoder)

    def uses_compiled_layers(self, device_type: str, has_lean_decoder: bool) -> bool:
        """is_compiled_layers with its default resolved, as uses_cuda_graphs resolves is_cuda_graphs."""
        return _on_cuda_with_lean(self.is_compiled_layers, device_type, has_lean_decoder)

    def __post_init__(self) -> None:
        if self.block_size <= 0:
            raise ValueError("block_size must be > 0")
        if self.kv_cache_gb <= 0 and self.num_kv_blocks <= 0:
            raise ValueError("kv_cache_gb or num_kv_blocks must be > 0")
        if self.compile_max_tokens <= 0:
            raise ValueError("compile_max_tokens must be > 0")
        parse_cpu_list(self.compute_cpus)  # ValueError naming the field
        if self.num_kv_blocks < 0 or self.max_model_len < 0 or self.num_threads < 0:
            raise ValueError("num_kv_blocks, max_model_len and num_threads must be >= 0")
        if self.linear_block_rows < -1:
            raise ValueError("linear_block_rows must be >= 0, or -1 for the device's default")
        if self.is_cuda_graphs and (self.is_compiled or not self.is_lean_decoder):
            raise ValueError("cuda_graphs needs the lean decoder: not with is_compiled or without is_lean_decoder")
        if self.is_compiled_layers and (self.is_compiled or not self.is_lean_decoder):
            raise ValueError("compiled_layers needs the lean decoder: not with is_compiled or without is_lean_decoder")
        if self.tensor_parallel_size < 1:
            raise ValueError("tensor_parallel_size must be >= 1")
        if self.tensor_parallel_size > 1 and (self.is_compiled or not self.is_lean_decoder):
            raise ValueError("tensor_parallel_size > 1 runs the lean decoder: not with is_compiled or without "
                             "is_lean_decoder")
        if self.dtype not in ("auto", "float32", "bfloat16", "float16"):
            raise ValueError(f"unsupported dtype {self.dtype!r}")
        internal_tls(self)  # ValueError naming the fields when only some are given
        settings_of(self)  # ValueError naming the field for a bad endpoint or ratio


def _on_cuda_with_lean(value: bool | None, device_type: str, has_lean_decoder: bool) -> bool:
    """A setting whose None default means on CUDA with a lean decoder, resolved."""
    if value is None:
        return device_type == "cuda" and has_lean_decoder
    return value
