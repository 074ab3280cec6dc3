"""Linear layers on weights packed once for oneDNN (CPU).

`F.linear` hands the BLAS the weight in PyTorch's row-major layout, and the
BLAS repacks it into its blocked layout inside every call. For gemma-3-270m's
output head (262,144 x 640 fp32, 671 MB) that repacking costs more than the
product itself. Measured on the 2-core CI machine: the head took 122 ms at 16
rows with `F.linear` and 31-39 ms on a prepacked weight (21-29 ms at one row,
which streams the weight once); a whole 16-row gemma-3-270m decode step went
from ~200 ms to ~95 ms, a one-row step from ~70 ms to ~60 ms.

So the worker packs every CPU `nn.Linear` weight once at load
(`torch.ops.mkldnn._reorder_linear_weight`, the packing torch's own compiler
applies when it freezes a CPU model) and calls oneDNN's linear on the packed
copy. Rows stay independent: a row's output is bit-identical whatever else is
in the batch, so batch invariance holds. The results differ from `F.linear`
only by float rounding order.

Cost: the packed copy is a second copy of each weight; the original stays,
because tied embeddings and code that inspects `.weight` read it.
"""

from __future__ import annotations

import torch
from torch import nn

PACKED_DTYPES = (torch.float32, torch.bfloat16)
PACKING_ROWS = 32
"""Row count the packed layout is chosen for; measured 16-128 within noise of each other at 1-32 rows."""


def is_packing_supported(device: torch.device, dtype: torch.dtype) -> bool:
    """oneDNN packs fp32 on any x86 CPU torch runs on, bf16 where the CPU has the instructions."""
    if device.type != "cpu" or dtype not in PACKED_DTYPES or not torch.backends.mkldnn.is_available():
        return False
    return dtype != torch.bfloat16 or torch.ops.mkldnn._is_mkldnn_bf16_supported()


class PackedLinear(nn.Module):
    """Drop-in for a CPU nn.Linear; shares its parameters (tied embeddings stay tied)."""

    def __init__(self, linear: nn.Linear):
        super().__init__()
        self.weight = linear.weight  # [N, K]
        self.bias = linear.bias
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self._packed = torch.ops.mkldnn._reorder_linear_weight(linear.weight.detach(), PACKING_ROWS)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        bias = self.bias.detach() if self.bias is not None else None
        return torch.ops.mkldnn._linear_pointwise(x, self._packed, bias, "none", [], "")

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"


def pack_linears(model: nn.Module) -> int:
    """Replace every nn.Linear of a CPU model with a PackedLinear when oneDNN supports its dtype;
    returns how many were replaced (0 on a GPU or an unsupported dtype)."""
    count = 0
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if type(child) is nn.Linear and is_packing_supported(child.weight.device, child.weight.dtype):
                setattr(parent, name, PackedLinear(child))
                count += 1
    return count
