"""Linear layers with their matmul layout chosen by measurement.

On a CPU, how fast MKL runs `y = x W^T` depends on the layout of the call and
on the number of rows M. For gemma-3-270m's output head (262,144 x 640 fp32,
671 MB read per step), measured on the 2-core CI machine, `F.linear(x, W)` took
60 ms at M = 1 and 124 ms at M = 16, while `W @ x.T` (M padded to at least 2)
took 21 ms and 85 ms; the layers inside the decoder show smaller but similar
differences, but timing a small layer on its own (its weight hot in cache)
does not predict its speed inside the model: tuning them all made a 1-row
gemma-3-270m step slower (63 -> 67-79 ms). So only weights too large for any
cache are tuned (MIN_TUNED_BYTES). Which layout wins is a property of the
machine, the BLAS build and the weight's shape, so the worker times both at
warm-up, once per distinct weight shape and row-count bucket, and keeps the
faster. Both compute the same dot products; results differ only by float
rounding order.
"""

from __future__ import annotations

import time

import torch
import torch.nn.functional as F
from torch import nn

TUNED_ROWS = (1, 2, 4, 8, 16, 32, 64)
LINEAR, WEIGHT_MAJOR = "linear", "weight_major"
MIN_TUNED_BYTES = 64 * 2**20  # weights this large stream from memory whatever the cache
_MIN_TIMING_S = 0.01  # time each candidate for at least this long (small layers take ~0.1 ms a call)


def _bucket(num_rows: int) -> int:
    """The tuned row count that stands for num_rows: the next power of two, capped at the largest."""
    return min(1 << max(num_rows - 1, 0).bit_length(), TUNED_ROWS[-1])


class TunedLinear(nn.Module):
    """Drop-in for nn.Linear that shares its parameters (tied embeddings stay tied)."""

    def __init__(self, linear: nn.Linear):
        super().__init__()
        self.weight = linear.weight  # [N, K]
        self.bias = linear.bias
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.strategy: dict[int, str] = {}  # bucket -> LINEAR | WEIGHT_MAJOR; empty = always LINEAR

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        lead = x.shape[:-1]
        rows = x.reshape(-1, x.shape[-1])  # [M, K]
        out = self._project(rows, self.strategy.get(_bucket(rows.shape[0]), LINEAR))  # [M, N]
        return out.reshape(*lead, self.out_features)

    def _project(self, rows: torch.Tensor, strategy: str) -> torch.Tensor:
        if strategy == LINEAR or rows.shape[0] == 0:
            return F.linear(rows, self.weight, self.bias)
        num_rows = rows.shape[0]
        if num_rows == 1:  # a single row takes a slow gemv path; two rows take the fast gemm one
            rows = torch.cat([rows, rows])
        out = _transpose(self.weight @ rows.t(), num_rows)  # [N, M'] -> [M, N]
        return out + self.bias if self.bias is not None else out

    @torch.inference_mode()
    def tune(self) -> dict[int, str]:
        """Time both layouts at every tuned row count; keep the faster one per bucket."""
        for num_rows in TUNED_ROWS:
            rows = torch.randn(num_rows, self.in_features, dtype=self.weight.dtype, device=self.weight.device)
            self.strategy[num_rows] = min((LINEAR, WEIGHT_MAJOR), key=lambda s: self._seconds_per_call(rows, s))
        return dict(self.strategy)

    def _seconds_per_call(self, rows: torch.Tensor, strategy: str) -> float:
        self._project(rows, strategy)  # the first call allocates and warms caches
        calls, start = 0, time.perf_counter()
        while calls < 2 or time.perf_counter() - start < _MIN_TIMING_S:
            self._project(rows, strategy)
            calls += 1
        return (time.perf_counter() - start) / calls


def _transpose(columns: torch.Tensor, num_rows: int, chunk: int = 16384) -> torch.Tensor:
    """[N, M'] -> contiguous [M, N] (first num_rows columns), copied in cache-sized chunks:
    a plain strided .contiguous() of a 16 x 262,144 result took twice as long."""
    out = columns.new_empty(num_rows, columns.shape[0])
    for start in range(0, columns.shape[0], chunk):
        out[:, start:start + chunk].copy_(columns[start:start + chunk, :num_rows].t())
    return out


def install_tuned_linears(model: nn.Module, min_bytes: int = MIN_TUNED_BYTES) -> list[TunedLinear]:
    """Replace every CPU nn.Linear whose weight has at least min_bytes with a TunedLinear."""
    tuned = []
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            weight = getattr(child, "weight", None)
            if (type(child) is nn.Linear and weight.device.type == "cpu"
                    and weight.numel() * weight.element_size() >= min_bytes):
                replacement = TunedLinear(child)
                setattr(parent, name, replacement)
                tuned.append(replacement)
    return tuned


def tune_all(layers: list[TunedLinear]) -> dict[tuple[int, int], dict[int, str]]:
    """Tune once per distinct weight shape and dtype; layers of the same shape share the choice."""
    choices: dict[tuple, dict[int, str]] = {}
    for layer in layers:
        key = (layer.out_features, layer.in_features, layer.weight.dtype)
        if key not in choices:
            choices[key] = layer.tune()
        layer.strategy = dict(choices[key])
    return {key[:2]: choice for key, choice in choices.items()}
