"""What every benchmark's JSON records about the machine it ran on."""

from __future__ import annotations

import os
import platform


def machine_info() -> dict:
    import torch
    import transformers

    return {
        "platform": platform.platform(),
        "processor": platform.processor() or platform.machine(),
        "python": platform.python_version(),
        "cpu_count": os.cpu_count(),
        "usable_cpus": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None,
        "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(),
        "cuda": torch.cuda.is_available(),
        "transformers": transformers.__version__,
        "loadavg_start": list(os.getloadavg()),
    }
