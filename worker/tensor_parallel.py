"""Tensor parallelism inside one worker: the model's layers split over N ranks the Megatron way.

Each rank holds 1/N of every large weight, cut from transformers' own modules (worker/sharded_load.py reads only
that slice of each checkpoint tensor):
- attention: the query, key and value projections column-parallel (each rank computes its own heads), the output
  projection row-parallel (each rank multiplies its heads' columns; the partial sums are all-reduced);
- the MLP: gate and up column-parallel, down row-parallel;
- the embedding and the LM head vocabulary-parallel: each rank holds a contiguous 1/N of the vocabulary's rows
  (the last padded with zero rows to the same count); an embedding row is looked up on the rank that holds it and
  all-reduced (the others add exact zeros), and each rank's logits are all-gathered into the whole vocabulary.
- the KV cache by heads: a rank stores its own key and value heads. A model with fewer key-value heads than ranks
  (gemma-3-270m: one) gives each rank the key-value head its query heads read, as vLLM does: N must then be a
  multiple of the key-value heads.

Norms, rotary embeddings and everything else are whole on every rank. Two all-reduces per layer (after the output
and the down projections) and one all-gather per forward is all the ranks exchange; everything in between runs on
a rank's own heads and columns. A row-parallel sum adds the same products in another order than one device does,
so logits differ from one device's in the last bits (tests/worker/test_tensor_parallel.py: within 1e-5 in fp32).

The collectives run on a process group of the ranks' own (`RankGroup`), not torch's default one: NCCL on GPUs,
gloo on the CPU.
"""

from __future__ import annotations

import datetime
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from torch.nn import functional as F

COLLECTIVE_TIMEOUT = datetime.timedelta(minutes=10)
"""How long a collective waits for a rank before failing (a dead rank is seen sooner: worker/ranks.py)."""


class RankGroup:
    """This rank's place among its worker's N ranks and the collectives the sharded layers call."""

    def __init__(self, rank: int, size: int, group: dist.ProcessGroup | None):
        self.rank = rank
        self.size = size
        self.group = group
        self.key = len(_GROUPS)
        """This group's number for the opaque ops compiled code calls (segserve::all_reduce, all_gather_last)."""
        _GROUPS.append(self)

    @classmethod
    def join(cls, host: str, port: int, rank: int, size: int, device: torch.device) -> RankGroup:
        """Meet the other ranks at rank 0's store (host, port) and form the group: NCCL on CUDA, gloo elsewhere."""
        store = dist.TCPStore(host, port, size, rank == 0, timeout=COLLECTIVE_TIMEOUT, wait_for_workers=False)
        return cls.on_store(store, rank, size, device)

    @classmethod
    def on_store(cls, store: dist.Store, rank: int, size: int, device: torch.device) -> RankGroup:
        if device.type == "cuda":
            torch.cuda.set_device(device)  # NCCL's communicator binds to the current device
            options = dist.ProcessGroupNCCL.Options()
            options._timeout = COLLECTIVE_TIMEOUT
            group = dist.ProcessGroupNCCL(store, rank, size, options)
        else:
            group = dist.ProcessGroupGloo(store, rank, size, COLLECTIVE_TIMEOUT)
        return cls(rank, size, group)

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """x summed over the ranks: in place (x contiguous) when eager; compiled code (worker/compiled_layers.py)
        calls it as an opaque op on a copy, so that the code around it still compiles as one graph."""
        if torch.compiler.is_compiling():
            return torch.ops.segserve.all_reduce(x, self.key)
        self.group.allreduce([x]).wait()
        return x

    def all_gather_last(self, x: torch.Tensor) -> torch.Tensor:
        """Every rank's x joined along the last dimension, rank 0's first. x: [..., K] -> [..., N * K]."""
        if torch.compiler.is_compiling():
            return torch.ops.segserve.all_gather_last(x, self.key)
        parts = [torch.empty_like(x) for _ in range(self.size)]
        self.group.allgather([parts], [x.contiguous()]).wait()
        return torch.cat(parts, dim=-1)


_GROUPS: list[RankGroup] = []
"""Every RankGroup of this process, by key."""


@torch.library.custom_op("segserve::all_reduce", mutates_args=())
def _all_reduce(x: torch.Tensor, key: int) -> torch.Tensor:
    return _GROUPS[key].all_reduce(x.contiguous().clone())


@_all_reduce.register_fake
def _(x, key):
    return torch.empty_like(x, memory_format=torch.contiguous_format)


@torch.library.custom_op("segserve::all_gather_last", mutates_args=())
def _all_gather_last(x: torch.Tensor, key: int) -> torch.Tensor:
    return _GROUPS[key].all_gather_last(x)


@_all_gather_last.register_fake
def _(x, key):
    return x.new_empty(*x.shape[:-1], x.shape[-1] * _GROUPS[key].size)


@dataclass(frozen=True)
class Shard:
    """The rows (dim 0) or columns (dim 1) of a checkpoint tensor a rank holds: [start, stop), padded with zero rows
    to `size` (vocabulary shards)."""

    dim: int
    start: int
    stop: int
    size: int


def even_shard(total: int, rank: int, size: int, dim: int = 0) -> Shard:
    """Rank's 1/size of `total` (which size divides) along dim."""
    part = total // size
    return Shard(dim, rank * part, (rank + 1) * part, part)


def vocab_shard(vocab_size: int, rank: int, size: int) -> Shard:
    """Rank's contiguous rows of the vocabulary, ceil(V / size) each, the last short (padded)."""
    part = -(-vocab_size // size)
    start = min(rank * part, vocab_size)
    return Shard(0, start, min(start + part, vocab_size), part)


@dataclass(frozen=True)
class HeadLayout:
    """How a model's attention heads fall on N ranks."""

    num_heads: int
    num_kv_heads: int
    head_dim: int
    size: int

    def check(self, intermediate_size: int, model_type: str) -> None:
        """ValueError naming what N does not divide."""
        problems = []
        if self.num_heads % self.size:
            problems.append(f"its {self.num_heads} attention heads")
        if self.num_kv_heads % self.size and self.size % self.num_kv_heads:
            problems.append(f"its {self.num_kv_heads} key-value heads (nor is N a multiple of them)")
        if intermediate_size % self.size:
            problems.append(f"its MLP's {intermediate_size} columns")
        if problems:
            raise ValueError(f"tensor_parallel_size={self.size} cannot split {model_type}: it does not divide "
                             + " or ".join(problems))

    @property
    def local_heads(self) -> int:
        return self.num_heads // self.size

    @property
    def local_kv_heads(self) -> int:
        return max(1, self.num_kv_heads // self.size)

    def query_rows(self, rank: int) -> Shard:
        rows = self.local_heads * self.head_dim
        return Shard(0, rank * rows, (rank + 1) * rows, rows)

    def kv_rows(self, rank: int) -> Shard:
        """Rank's key-value heads: its 1/N of them, or (fewer heads than ranks) the one its query heads read."""
        first = rank * self.num_kv_heads // self.size
        rows = self.local_kv_heads * self.head_dim
        return Shard(0, first * self.head_dim, first * self.head_dim + rows, rows)


class RowParallelLinear(nn.Module):
    """A linear whose input columns are split over the ranks: each rank's partial product, all-reduced, then the
    bias (once). `linear` is the rank's columns, without bias (the worker may repack it: worker/packed_linear.py)."""

    def __init__(self, linear: nn.Linear, bias: torch.Tensor | None, ranks: RankGroup):
        super().__init__()
        self.linear = linear
        self.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)
        self.ranks = ranks

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.ranks.all_reduce(self.linear(x).contiguous())
        return out if self.bias is None else out + self.bias


class VocabParallelEmbedding(nn.Module):
    """An embedding whose rows are split over the ranks; `scale` is the class's own (Gemma3 scales its embeddings by
    sqrt(hidden size)), applied before the all-reduce so that the sum adds exact zeros to the one rank's row."""

    def __init__(self, weight: torch.Tensor, shard: Shard, num_embeddings: int, scale: torch.Tensor | None,
                 ranks: RankGroup):
        super().__init__()
        self.weight = nn.Parameter(weight, requires_grad=False)  # [shard.size, E]
        self.start, self.stop = shard.start, shard.stop
        self.num_embeddings = num_embeddings
        """The whole vocabulary's rows (what ids may be)."""
        self.register_buffer("scale", scale, persistent=False)
        self.ranks = ranks

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        is_here = (input_ids >= self.start) & (input_ids < self.stop)  # [1, T]
        local = torch.where(is_here, input_ids - self.start, 0)
        out = F.embedding(local, self.weight) * is_here.unsqueeze(-1).to(self.weight.dtype)  # [1, T, E]
        if self.scale is not None:
            out = out * self.scale.to(out.dtype)
        return self.ranks.all_reduce(out)


class VocabParallelHead(nn.Module):
    """The LM head over the vocabulary rows of each rank: local logits, all-gathered, the padding cut off."""

    def __init__(self, linear: nn.Linear, vocab_size: int, ranks: RankGroup):
        super().__init__()
        self.linear = linear
        self.vocab_size = vocab_size
        self.ranks = ranks

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = self.ranks.all_gather_last(self.linear(hidden))  # [..., N * ceil(V / N)]
        return logits[..., :self.vocab_size]
