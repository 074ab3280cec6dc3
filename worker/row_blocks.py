"""How a linear layer's rows reach the BLAS, so that a row's output never depends on the batch it came in
(batch invariance).

Lossless greedy speculation needs it: a sequence's logits must be bit-identical whether it decodes alone, beside
others, or as one node of a candidate tree. A BLAS chooses its kernel by the problem's shape, and kernels chosen
for different row counts add up a row's K products in different orders (other tiles, split-K). Measured with one
640 x 4096 linear, a row computed within fewer rows against within all 64 (or 256):
- an H100 (torch 2.11, cuBLAS), fp32 `F.linear`: rows differed in the last bits at 192 of 256 row counts, and at
  8 of 256 for the 640 x 262,144 output head; in bf16 at none of the three shapes probed;
- the H100 machine's Intel Xeon host, fp32, 1 to 16 threads: oneDNN's packed linear (worker/packed_linear.py)
  and `F.linear` both differed at 1 to 15 rows;
- CI's 2-core AMD EPYC: the packed linear at none of those, but gemma-3-270m's 2048 x 640 down projection gave
  one row alone other bits than among others; `F.linear` differed at up to 15 rows.

A `RowPolicy` says how rows are handed over: as they come, padded up to a minimum count (one call), or in blocks
of exactly `block_rows` rows, the last padded. Blocks hold by construction: every call has one shape and runs one
kernel, which sums each row in the same order wherever the row sits (no row differed at any count, on the H100 in
blocks of 64 and on the Xeon in blocks of 32). They cost padding and calls: a one-row step multiplies a whole
block and a larger step makes a call per block (gemma-3-270m on CI's CPU, blocks of 32: 124-133 ms per one-row
step against 42-51 ms as the rows come; on the H100 in blocks of 64: 22.1 against 14.8 ms at one row, 32.7
against 22.1 at 256). So the worker probes at load (`choose_policy`), each distinct shape of its model on its
own: computed as the worker will, on seeded random rows at every count up to 64 and samples up to 255, against
256. Each shape takes the cheapest policy under which no row differs: rows as they come, else padded up to 2,
4 ... 32 rows (the kernels of the smallest counts are the ones that differ on both CPUs), else blocks. A padding
only holds for the counts probed, which cover every decode batch up to 64 sequences and sample larger steps.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn
from torch.nn import functional as F

CUDA_BLOCK_ROWS = 64
"""Rows per call on a GPU: a whole decode batch of up to 64 sequences in one call."""
CPU_BLOCK_ROWS = 32
"""Rows per call on a CPU: the block the Xeon's probe was run with (and the row count oneDNN packs for)."""
MIN_ROWS_TRIED = (2, 4, 8, 16, 32)
"""Paddings a probe tries, cheapest first, before it falls back to blocks."""
PROBE_ROWS = 256
PROBE_COUNTS = (*range(1, 65), 96, 128, 192, 255)
"""A probe compares a row computed within each of these row counts against within PROBE_ROWS (seeded random
rows): every count of a decode batch, and samples up to a step of 256 tokens."""
PROBE_MAX_FEATURES = 8192
"""Output features a probe computes of a larger linear (the output head): the first ones of its weight."""


@dataclass(frozen=True)
class RowPolicy:
    """How a linear's rows are handed to the BLAS; the default hands them over as they come."""

    min_rows: int = 0
    """Pad a call of fewer rows up to this many (one call)."""
    block_rows: int = 0
    """Split the rows into calls of exactly this many, the last padded (0 = one call); overrides min_rows."""


def block_rows_for(device: torch.device) -> int:
    return CUDA_BLOCK_ROWS if device.type == "cuda" else CPU_BLOCK_ROWS


def in_row_blocks(linear: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor,
                  policy: RowPolicy = RowPolicy()) -> torch.Tensor:
    """linear(x) ([..., K] -> [..., N]) with x's rows handed over as the policy says."""
    rows = policy.block_rows or policy.min_rows
    if not rows:  # the default, on every call of most linears: no reshaping
        return linear(x)
    flat = x.reshape(-1, x.shape[-1])  # [M, K]
    num_rows = flat.shape[0]
    if not policy.block_rows and num_rows >= rows:
        return linear(x)
    num_blocks = max(1, -(-num_rows // rows)) if policy.block_rows else 1
    if num_blocks * rows != num_rows:
        # padding rows reach no real row's output (constant_pad_nd: F.pad without its Python wrapper)
        flat = torch.constant_pad_nd(flat, (0, 0, 0, num_blocks * rows - num_rows))
    if num_blocks == 1:
        out = linear(flat)
    else:
        out = torch.cat([linear(block) for block in flat.split(rows)])
    return out[:num_rows].view(*x.shape[:-1], out.shape[-1])


def varies_with_rows(linear: Callable[[torch.Tensor], torch.Tensor], in_features: int, device: torch.device,
                     dtype: torch.dtype, policy: RowPolicy = RowPolicy()) -> bool:
    """Whether linear, its rows handed over by the policy, gives some row other bits within one of PROBE_COUNTS
    rows than within PROBE_ROWS."""
    x = torch.randn(PROBE_ROWS, in_features, generator=torch.Generator().manual_seed(0)).to(device, dtype)
    with torch.inference_mode():
        full = in_row_blocks(linear, x, policy)
        return any(not torch.equal(in_row_blocks(linear, x[:rows], policy), full[:rows]) for rows in PROBE_COUNTS)


def choose_policy(linear: Callable[[torch.Tensor], torch.Tensor], in_features: int, device: torch.device,
                  dtype: torch.dtype) -> RowPolicy:
    """The cheapest policy under which the linear (this machine's product at one shape) does not vary with the
    row count in a probe: rows as they come, else padded up to a minimum, else fixed blocks, which hold by
    construction (every call then has one shape)."""
    for policy in (RowPolicy(), *(RowPolicy(min_rows=rows) for rows in MIN_ROWS_TRIED)):
        if not varies_with_rows(linear, in_features, device, dtype, policy):
            return policy
    return RowPolicy(block_rows=block_rows_for(device))


PolicyOf = Callable[[tuple[int, ...]], RowPolicy]
"""The policy of the linears whose weight has this shape ([N, K])."""


def fixed_policy(block_rows: int) -> PolicyOf:
    """Every linear in blocks of block_rows rows (0: rows as they come)."""
    return lambda shape: RowPolicy(block_rows=block_rows)


class RowBlockLinear(nn.Module):
    """Drop-in for an nn.Linear (one that torch computes: a GPU's, or a CPU's not packed for oneDNN); shares its
    parameters, so tied embeddings stay tied."""

    def __init__(self, linear: nn.Linear, policy: RowPolicy):
        super().__init__()
        self.weight, self.bias = linear.weight, linear.bias
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.policy = policy

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if torch.compiler.is_compiling():  # an opaque op: the policy's branches read the row count
            return torch.ops.segserve.row_block_linear(x, self.weight, self.bias, self.policy.min_rows,
                                                       self.policy.block_rows)
        return in_row_blocks(self._linear, x, self.policy)

    def _linear(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, "
                f"{self.policy}")


@torch.library.custom_op("segserve::row_block_linear", mutates_args=())
def row_block_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, min_rows: int,
                     block_rows: int) -> torch.Tensor:
    """F.linear(x, weight, bias) with x's rows handed over as RowPolicy(min_rows, block_rows) says: a RowBlockLinear
    inside compiled code (worker/compiled_layers.py), computed as in an eager step."""
    return in_row_blocks(lambda rows: F.linear(rows, weight, bias), x, RowPolicy(min_rows, block_rows))


@row_block_linear.register_fake
def _(x, weight, bias, min_rows, block_rows):
    return x.new_empty(*x.shape[:-1], weight.shape[0])


def block_linears(model: nn.Module, policy_of: PolicyOf) -> int:
    """Replace every plain nn.Linear of the model whose shape has a policy other than the default with a
    RowBlockLinear; returns how many were replaced."""
    count = 0
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if type(child) is nn.Linear and (policy := policy_of(tuple(child.weight.shape))) != RowPolicy():
                setattr(parent, name, RowBlockLinear(child, policy))
                count += 1
    return count
