"""The output projection with its matmul layout chosen by measurement.

The lm_head of a small model with a large vocabulary dominates a CPU decode step
(gemma-3-270m: a 262,144 x 640 fp32 weight, 671 MB read per step). How fast
MKL runs it depends on the layout of the call and on the number of rows M:
measured on the 2-core CI machine, `F.linear(x, W)` took 60 ms at M = 1 and
124 ms at M = 16, while `W @ x.T` (with M padded to at least 2) took 21 ms and
85 ms. Which layout wins is a property of the machine and the BLAS build, so the
worker times both at warm-up for a few row counts and keeps the faster per bucket.
Both compute the same dot products; results differ only by float rounding order.
"""

from __future__ import annotations

import time

import torch
import torch.nn.functional as F
from torch import nn

TUNED_ROWS = (1, 2, 4, 8, 16, 32, 64)
LINEAR, WEIGHT_MAJOR = "linear", "weight_major"


def _bucket(num_rows: int) -> int:
    """The tuned row count that stands for num_rows: the next power of two, capped at the largest."""
    return min(1 << max(num_rows - 1, 0).bit_length(), TUNED_ROWS[-1])


class TunedLinear(nn.Module):
    """Drop-in for an nn.Linear output head; shares its weight (so tied embeddings stay tied)."""

    def __init__(self, linear: nn.Linear):
        super().__init__()
        self.weight = linear.weight  # [V, K]
        self.bias = linear.bias
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.strategy: dict[int, str] = {}  # bucket -> LINEAR | WEIGHT_MAJOR; empty = always LINEAR

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        lead = x.shape[:-1]
        rows = x.reshape(-1, x.shape[-1])  # [M, K]
        out = self._project(rows, self.strategy.get(_bucket(rows.shape[0]), LINEAR))  # [M, V]
        return out.reshape(*lead, self.out_features)

    def _project(self, rows: torch.Tensor, strategy: str) -> torch.Tensor:
        if strategy == LINEAR or rows.shape[0] == 0:
            return F.linear(rows, self.weight, self.bias)
        num_rows = rows.shape[0]
        if num_rows == 1:  # a single row takes a slow gemv path; two rows take the fast gemm one
            rows = torch.cat([rows, rows])
        out = (self.weight @ rows.t()).t()[:num_rows].contiguous()  # [M, V]
        return out + self.bias if self.bias is not None else out

    @torch.inference_mode()
    def tune(self, repeats: int = 2) -> dict[int, str]:
        """Time both layouts at every tuned row count; keep the faster one per bucket."""
        for num_rows in TUNED_ROWS:
            rows = torch.randn(num_rows, self.in_features, dtype=self.weight.dtype, device=self.weight.device)
            timings = {}
            for strategy in (LINEAR, WEIGHT_MAJOR):
                self._project(rows, strategy)  # first call allocates and warms caches
                start = time.perf_counter()
                for _ in range(repeats):
                    self._project(rows, strategy)
                timings[strategy] = time.perf_counter() - start
            self.strategy[num_rows] = min(timings, key=timings.get)
        return dict(self.strategy)


def install_tuned_head(model: nn.Module) -> TunedLinear | None:
    """Replace the model's output head with a TunedLinear (CPU only; GPUs' BLAS needs no help)."""
    head = model.get_output_embeddings()
    if not isinstance(head, nn.Linear) or head.weight.device.type != "cpu":
        return None
    tuned = TunedLinear(head)
    model.set_output_embeddings(tuned)
    return tuned
