"""Host-side step metadata goes to the model's device without making the host wait.

The runner collects every integer array a step needs on the device (input ids, positions, the
rows to keep, the attention metadata) and `upload` concatenates them into one int64 buffer and
copies it once. On CUDA the buffer is pinned (torch's caching host allocator reuses pinned blocks
and keeps each one until the copies reading it are done) and copied asynchronously, so the host
goes on while the copy runs; a plain copy from pageable memory would wait for the device. On the
CPU the arrays are used where they are, with no copy at all.
"""

from __future__ import annotations

import numpy as np
import torch


def to_device(host: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A host tensor on `device`; on CUDA through pinned memory, without blocking the host."""
    if device.type != "cuda":
        return host.to(device)
    return host.pin_memory().to(device, non_blocking=True)


def upload(arrays: list[np.ndarray], device: torch.device) -> list[torch.Tensor]:
    """Each array (any integer or bool dtype, any shape) as an int64 tensor of its shape on `device`, in one copy."""
    if not arrays:
        return []
    flat = np.concatenate([a.reshape(-1).astype(np.int64, copy=False) for a in arrays])
    on_device = to_device(torch.from_numpy(flat), device)
    return [part.view(a.shape) for part, a in zip(on_device.split([a.size for a in arrays]), arrays)]
