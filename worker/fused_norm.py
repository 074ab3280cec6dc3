"""RMSNorm as one torch call (`F.rms_norm`) in place of transformers' Python modules.

transformers computes an RMSNorm in Python, six to eight tensor ops per call (casts, pow, mean, add, rsqrt,
multiplications); gemma-3-270m calls one 109 times per forward (six per layer, and the final norm), the tests'
4-layer tiny Gemma3 25 times. `F.rms_norm` is one call into torch's C++ (on CUDA, a fused kernel where torch's
build has one; no GPU measured it here). Measured on the 2-core CPU, fp32, one thread, hidden size 64: a call
took 10-15 us against 19-35 us for transformers' module, from one row to 256; the tiny model's whole forward at
one token took 1.44-1.64 ms against 1.53-1.79 ms, in five of six runs of alternated pairs
(tests/worker/test_fused_norm.py checks the outputs, not the speed).

Only classes whose formula is known are replaced, each by the same formula:
- Gemma's (GemmaRMSNorm, Gemma2RMSNorm, Gemma3RMSNorm): normalize in float32, multiply by (1 + weight) in
  float32, cast back. (1 + weight) is computed once, here: the worker never changes weights once loaded.
- Llama's (LlamaRMSNorm, MistralRMSNorm, Qwen2RMSNorm, Qwen3RMSNorm, Phi3RMSNorm): normalize in float32,
  cast back, multiply by the weight.
On the CPU the outputs are bit-identical to transformers' (tests/worker/test_fused_norm.py). Each row is normalized on
its own, so a row's output does not depend on the rest of the batch (batch invariance, which greedy speculation
relies on, is tested on the test device).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

GEMMA_NORMS = frozenset({"GemmaRMSNorm", "Gemma2RMSNorm", "Gemma3RMSNorm"})
LLAMA_NORMS = frozenset({"LlamaRMSNorm", "MistralRMSNorm", "Qwen2RMSNorm", "Qwen3RMSNorm", "Phi3RMSNorm"})
_KNOWN_NORMS = GEMMA_NORMS | LLAMA_NORMS


class FusedRMSNorm(nn.Module):
    """Drop-in for one of transformers' RMSNorm modules; shares its weight."""

    def __init__(self, norm: nn.Module):
        super().__init__()
        self.is_gemma = type(norm).__name__ in GEMMA_NORMS
        self.weight = norm.weight
        self.eps = norm.eps if self.is_gemma else norm.variance_epsilon
        self.shape = (norm.weight.shape[-1],)
        scale = 1.0 + norm.weight.detach().float() if self.is_gemma else None
        self.register_buffer("scale", scale, persistent=False)  # Gemma's float32 (1 + weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.is_gemma:
            return F.rms_norm(x.float(), self.shape, self.scale, self.eps).type_as(x)
        if x.dtype == torch.float32 and self.weight.dtype == torch.float32:
            return F.rms_norm(x, self.shape, self.weight, self.eps)  # weight * y and y * weight are equal
        return self.weight * F.rms_norm(x.float(), self.shape, None, self.eps).to(x.dtype)

    def extra_repr(self) -> str:
        return f"{self.shape}, eps={self.eps}, gemma={self.is_gemma}"


class StackedRMSNorm(nn.Module):
    """Several RMSNorms of one formula and size, each over its own heads of one tensor, in one normalization.

    For a layer's query and key norms: x is [..., H1 + H2 + ..., D], the first H1 heads normed by the first norm,
    and so on. The rows are normalized together without a weight, then each head's row is multiplied by its own
    norm's weight, which is what F.rms_norm with a weight computes on the CPU (tests/worker/test_fused_norm.py checks it
    bit for bit against each norm on its own heads; a CUDA build's one-kernel F.rms_norm may round otherwise). One
    call in place of one per norm, and the rows stay independent."""

    def __init__(self, norms_and_heads: list[tuple[nn.Module, int]]):
        super().__init__()
        fused = [(norm if isinstance(norm, FusedRMSNorm) else FusedRMSNorm(norm), heads)
                 for norm, heads in norms_and_heads]
        first = fused[0][0]
        if any((norm.is_gemma, norm.eps, norm.shape) != (first.is_gemma, first.eps, first.shape) for norm, _ in fused):
            raise ValueError("stacked norms need one formula, epsilon and size")
        self.is_gemma, self.eps, self.shape = first.is_gemma, first.eps, first.shape
        weights = [(norm.scale if norm.is_gemma else norm.weight.detach()).expand(heads, -1) for norm, heads in fused]
        self.register_buffer("weight", torch.cat(weights), persistent=False)  # [H1 + H2 + ..., D]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.is_gemma:
            return (F.rms_norm(x.float(), self.shape, None, self.eps) * self.weight).type_as(x)
        if x.dtype == torch.float32 and self.weight.dtype == torch.float32:
            return F.rms_norm(x, self.shape, None, self.eps) * self.weight
        return self.weight * F.rms_norm(x.float(), self.shape, None, self.eps).to(x.dtype)


def is_known_norm(module: nn.Module) -> bool:
    """One of transformers' own RMSNorm classes whose formula FusedRMSNorm reproduces (not a namesake)."""
    cls = type(module)
    return cls.__module__.startswith("transformers.") and cls.__name__ in _KNOWN_NORMS


def fuse_rms_norms(model: nn.Module) -> int:
    """Replace every RMSNorm module of a known class with a FusedRMSNorm; returns how many were replaced."""
    count = 0
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if is_known_norm(child):
                setattr(parent, name, FusedRMSNorm(child))
                count += 1
    return count
