"""A step's host-side metadata goes to the model's device in one copy.

The runner collects every integer array a step needs on the device (input ids, positions, the
rows to keep, the attention metadata) and `Uploader.upload` concatenates them into one int64
buffer and copies it once. On CUDA the buffer is pinned, reused from step to step and copied
asynchronously, so the host goes on preparing the forward while the copy runs; on the CPU the
arrays are used where they are, with no copy at all.
"""

from __future__ import annotations

import numpy as np
import torch


class Uploader:
    """Moves lists of host arrays to one device, one copy per call."""

    def __init__(self, device: torch.device):
        self.device = device
        self._pinned: torch.Tensor | None = None
        self._copied: torch.cuda.Event | None = None
        """Recorded after the last copy out of the pinned buffer; waited on before the buffer is refilled."""

    def upload(self, arrays: list[np.ndarray]) -> list[torch.Tensor]:
        """Each array (any integer or bool dtype, any shape) as an int64 tensor of its shape on the device."""
        sizes = [a.size for a in arrays]
        flat = np.concatenate([a.reshape(-1).astype(np.int64, copy=False) for a in arrays]) if arrays else \
            np.empty(0, dtype=np.int64)
        host = torch.from_numpy(flat)
        on_device = self._to_device(host) if self.device.type == "cuda" else host.to(self.device)
        return [part.view(a.shape) for part, a in zip(on_device.split(sizes), arrays)]

    def _to_device(self, host: torch.Tensor) -> torch.Tensor:
        """host [N] -> device [N] through the reused pinned buffer, without blocking the host."""
        if self._copied is not None:
            self._copied.synchronize()  # the previous copy has left the buffer
        if self._pinned is None or self._pinned.numel() < host.numel():
            self._pinned = torch.empty(max(host.numel(), 2 * (0 if self._pinned is None else self._pinned.numel())),
                                       dtype=torch.int64).pin_memory()
        staged = self._pinned[:host.numel()]
        staged.copy_(host)
        on_device = staged.to(self.device, non_blocking=True)
        self._copied = torch.cuda.Event()
        self._copied.record()
        return on_device
