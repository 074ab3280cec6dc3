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
copy. The results differ from `F.linear` only by float rounding order. Whether a
row's output is bit-identical whatever else is in the batch depends on the CPU:
oneDNN picks its kernel by the row count too (on CI's AMD EPYC gemma-3-270m's
down projection gave a row other bits alone than among others; on an Intel Xeon
every shape did below 16 rows). The worker probes that at load and hands the rows
over padded or in blocks where needed (worker/row_blocks.py, `RowPolicy`).

Sibling linears that read the same input share one packed weight: attention's
q, k and v projections, the MLP's gate and up (`MERGED_SIBLINGS`), as vLLM's
QKV and gate-up layers do. transformers calls them one after another on the same
tensor, so the first call computes all of them in one oneDNN call and the others
take their slices (`MergedLinearPart`). A part called on an input the product was
not made from (or twice on one) computes a new product, so it always returns its
own linear of its own input. Measured on the
2-core CPU, one thread, two runners in one process, alternated rounds of 10
decode steps, merged against separate (the same tokens):
- gemma-3-270m at one row: 84.1-87.1 ms per forward against 90.1-93.6 (8 rounds),
  and medians of 92.8 against 98.0 ms in a second run; at 16 rows, 143.4 against
  144.8 ms (the output head dominates there);
- the tiny Gemma3 at one row: medians of 3.05 against 3.26 ms and 2.84 against
  2.99 (12 rounds each); at 64 rows, 5.10 against 5.26 (within the spread).

Cost: the packed copy is a second copy of each weight; the original stays,
because tied embeddings and code that inspects `.weight` read it.

Small weights stay torch's (`PACKING_MIN_WEIGHTS`): a oneDNN call costs 10-16 us
whatever the weight, against 2-5 us for `F.linear` at one to four rows of the
tiny Gemma3's 64-wide weights (one thread, this 2-core CPU). From gemma-3-270m's
640x1024 up, packing is 1.3-2.1x faster from four rows on. Merged siblings of
small weights are merged still, on torch's linear.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch
from torch import nn
from torch.nn import functional as F

from worker.row_blocks import PROBE_MAX_FEATURES, PolicyOf, RowPolicy, choose_policy, fixed_policy, in_row_blocks

PACKED_DTYPES = (torch.float32, torch.bfloat16)
PACKING_ROWS = 32
"""Row count the packed layout is chosen for; measured 16-128 within noise of each other at 1-32 rows."""
PACKING_MIN_WEIGHTS = 1 << 16
"""Weights with fewer elements are not packed. Measured per call, one thread, packed against `F.linear` (us):
64x64 at 1, 4 and 64 rows 16/2.8, 17/3.1, 13/7.1; 400x64 11/3.2, 13/5.2, 25/36; 640x1024 41/37, 92/117,
411/867; 4096x640 165/152, 345/667, 1951/4049."""
MERGED_SIBLINGS = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))
"""Children of one module that transformers' causal LMs (Llama, Gemma, Qwen, Mistral...) call on one input."""


def is_packing_supported(device: torch.device, dtype: torch.dtype) -> bool:
    """oneDNN packs fp32 on any x86 CPU torch runs on, bf16 where the CPU has the instructions."""
    if device.type != "cpu" or dtype not in PACKED_DTYPES or not torch.backends.mkldnn.is_available():
        return False
    return dtype != torch.bfloat16 or torch.ops.mkldnn._is_mkldnn_bf16_supported()


class PackedLinear(nn.Module):
    """Drop-in for a CPU nn.Linear; shares its parameters (tied embeddings stay tied)."""

    def __init__(self, linear: nn.Linear, policy: RowPolicy = RowPolicy()):
        super().__init__()
        self.policy = policy  # how rows reach oneDNN (worker/row_blocks.py)
        self.weight = linear.weight  # [N, K]
        self.bias = linear.bias
        self.in_features, self.out_features = linear.in_features, linear.out_features
        bias = None if linear.bias is None else linear.bias.detach()
        self._linear = linear_of(linear.weight.detach(), bias, is_packed=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return in_row_blocks(self._linear, x, self.policy)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"


def is_worth_packing(weight: torch.Tensor, min_weights: int | None = None) -> bool:
    """Whether the worker packs this weight: oneDNN supports its device and dtype, and it has at least
    min_weights elements (PACKING_MIN_WEIGHTS unless given)."""
    min_weights = PACKING_MIN_WEIGHTS if min_weights is None else min_weights
    return is_packing_supported(weight.device, weight.dtype) and weight.numel() >= min_weights


def linear_of(weight: torch.Tensor, bias: torch.Tensor | None, is_packed: bool
              ) -> Callable[[torch.Tensor], torch.Tensor]:
    """x -> x W^T + b: oneDNN's linear on a packed copy of the weight (is_packed), else torch's."""
    if not is_packed:
        return functools.partial(F.linear, weight=weight, bias=bias)
    packed = torch.ops.mkldnn._reorder_linear_weight(weight, PACKING_ROWS)
    return lambda x: torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], None)


class MergedProduct:
    """The weight of sibling linears stacked [W_1; W_2; ...] (packed where worth it), and the last product,
    handed out by parts."""

    def __init__(self, linears: list[nn.Linear], policy: RowPolicy = RowPolicy(), min_weights: int | None = None):
        self.policy = policy
        self.sizes = [linear.out_features for linear in linears]
        weight = torch.cat([linear.weight.detach() for linear in linears])
        bias = None if linears[0].bias is None else torch.cat([linear.bias.detach() for linear in linears])
        self.is_packed = is_worth_packing(weight, min_weights)
        self._linear = linear_of(weight, bias, self.is_packed)
        self._input: torch.Tensor | None = None
        self._parts: list[torch.Tensor | None] = []

    def part(self, index: int, x: torch.Tensor) -> torch.Tensor:
        """Linear `index` of x: a slice of the product of x, computed unless this part of it is still unclaimed."""
        if x is not self._input or self._parts[index] is None:
            product = in_row_blocks(self._linear, x, self.policy)
            self._input, self._parts = x, list(product.split_with_sizes(self.sizes, -1))
        out, self._parts[index] = self._parts[index], None
        if all(part is None for part in self._parts):
            self._input = None  # every part claimed: hold no tensor between forwards
        return out


class MergedLinearPart(nn.Module):
    """Drop-in for one of the sibling linears of a MergedProduct; shares its parameters."""

    def __init__(self, linear: nn.Linear, product: MergedProduct, index: int):
        super().__init__()
        self.weight, self.bias = linear.weight, linear.bias
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self._product, self._index = product, index

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._product.part(self._index, x)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, merged part {self._index}"


def pack_linears(model: nn.Module, is_merged: bool = True, policy_of: PolicyOf = fixed_policy(0),
                 min_weights: int | None = None) -> int:
    """Replace every nn.Linear of a CPU model whose weight is worth packing (is_worth_packing: oneDNN supports
    its dtype, and it has at least min_weights elements) with a PackedLinear, and siblings (MERGED_SIBLINGS)
    with parts of one MergedProduct, packed where their stacked weight is worth it, unless not is_merged (a
    compiled model: a part finds its product by the input's identity, which tracing does not keep); returns how
    many were replaced (0 on a GPU or an unsupported dtype). Every product hands its rows over as its shape's
    policy says (worker/row_blocks.py); the linears left alone get theirs from block_linears."""
    count = 0
    for parent in list(model.modules()):
        for names in MERGED_SIBLINGS if is_merged else ():
            siblings = [getattr(parent, name, None) for name in names]
            if _is_mergeable(siblings):
                shape = (sum(linear.out_features for linear in siblings), siblings[0].in_features)
                product = MergedProduct(siblings, policy_of(shape), min_weights)
                for index, (name, linear) in enumerate(zip(names, siblings)):
                    setattr(parent, name, MergedLinearPart(linear, product, index))
                count += len(names)
        for name, child in list(parent.named_children()):
            if type(child) is nn.Linear and is_worth_packing(child.weight, min_weights):
                setattr(parent, name, PackedLinear(child, policy_of(tuple(child.weight.shape))))
                count += 1
    return count


def _is_mergeable(siblings: list) -> bool:
    """Plain packable linears on one input size, dtype and device, with a bias each or none."""
    first = siblings[0]
    return (all(type(s) is nn.Linear for s in siblings)
            and is_packing_supported(first.weight.device, first.weight.dtype)
            and all(s.in_features == first.in_features and s.weight.dtype == first.weight.dtype
                    and s.weight.device == first.weight.device and (s.bias is None) == (first.bias is None)
                    for s in siblings))


def choose_row_policies(model: nn.Module, is_packed: bool, min_weights: int | None = None
                        ) -> dict[tuple[int, ...], RowPolicy]:
    """Each distinct linear weight shape of the model ([N, K]; merged siblings' too) -> the cheapest RowPolicy
    under which this machine's product at that shape keeps every row's bits whatever the batch
    (worker/row_blocks.py's probe, on at most PROBE_MAX_FEATURES outputs), computed as the worker will: packed
    where pack_linears packs (is_packed, and the whole weight is worth packing), else by torch."""
    weights = {}
    for parent in model.modules():
        for names in MERGED_SIBLINGS if is_packed else ():
            siblings = [getattr(parent, name, None) for name in names]
            if _is_mergeable(siblings):
                merged = torch.cat([linear.weight.detach() for linear in siblings])
                weights.setdefault(tuple(merged.shape), merged)
        for child in parent.children():
            if type(child) is nn.Linear:
                weights.setdefault(tuple(child.weight.shape), child.weight.detach())
    policies = {}
    for shape, weight in weights.items():
        linear = linear_of(weight[:PROBE_MAX_FEATURES], None, is_packed and is_worth_packing(weight, min_weights))
        policies[shape] = choose_policy(linear, weight.shape[1], weight.device, weight.dtype)
    return policies
