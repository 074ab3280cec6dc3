"""How many CPUs this process may really use: the size of torch's intra-op thread pool on a CPU.

torch sizes its pool from the machine's cores. In a container with a CPU quota (a Kubernetes
CPU limit) or a restricted affinity mask that is too many, and every parallel op then waits at
its barrier for threads the kernel is not running. The same happens when the worker shares a
small machine with the rest of the stack: measured on the 2-core CPU with another process busy
on one core, a tiny model's decode step took 80-310 ms with 2 threads against 3-10 ms with 1.
"""

from __future__ import annotations

import math
import os
from pathlib import Path

CGROUP_ROOT = Path("/sys/fs/cgroup")


def available_cpus(cgroup_root: Path = CGROUP_ROOT) -> int:
    """CPUs in this process's affinity mask, capped by its cgroup's CPU quota (rounded down, at least 1)."""
    count = len(os.sched_getaffinity(0))
    quota = cgroup_cpu_quota(cgroup_root)
    if quota is not None:
        count = min(count, math.floor(quota))
    return max(1, count)


def cgroup_cpu_quota(cgroup_root: Path = CGROUP_ROOT) -> float | None:
    """The cgroup's CPU quota in CPUs (cgroup v2 `cpu.max`, else v1 `cpu/cpu.cfs_quota_us` over
    `cpu/cpu.cfs_period_us`); None when there is none or it cannot be read."""
    try:
        quota, period = (cgroup_root / "cpu.max").read_text().split()[:2]
        return None if quota == "max" else int(quota) / int(period)
    except (OSError, ValueError):
        pass
    try:
        quota_us = int((cgroup_root / "cpu" / "cpu.cfs_quota_us").read_text())
        period_us = int((cgroup_root / "cpu" / "cpu.cfs_period_us").read_text())
    except (OSError, ValueError):
        return None
    return None if quota_us <= 0 or period_us <= 0 else quota_us / period_us


def parse_cpu_list(text: str) -> set[int]:
    """The CPUs of a CPU list such as "1-3,6" (as taskset -c and cpusets write it; "" = none)."""
    cpus: set[int] = set()
    for part in filter(None, (p.strip() for p in text.split(","))):
        first, dash, last = part.partition("-")
        try:
            low, high = int(first), int(last if dash else first)
        except ValueError:
            low, high = -1, -1
        if low < 0 or high < low:
            raise ValueError(f"compute_cpus: {part!r} in {text!r} is not a CPU number or a range of them")
        cpus.update(range(low, high + 1))
    return cpus


def format_cpu_list(cpus: set[int]) -> str:
    """`cpus` as a CPU list, one number each: {1, 2} -> "1,2"."""
    return ",".join(map(str, sorted(cpus)))


def bind_compute_thread(cpus: set[int]) -> None:
    """Bind the calling thread to `cpus`, and with it every thread it starts from now on (they inherit its mask):
    torch's intra-op threads and the threads that load the model and run long steps. Threads started before
    (gRPC's, which receive the next step while this one computes) keep the process's CPUs."""
    try:
        os.sched_setaffinity(0, cpus)  # 0: the calling thread, not the process
    except OSError as exc:
        allowed = format_cpu_list(os.sched_getaffinity(0))
        raise ValueError(f"compute_cpus {format_cpu_list(cpus)}: cannot bind to them (this process may use "
                         f"{allowed}): {exc}") from None


PARALLEL_MIN_WEIGHTS = 1 << 20
"""The elements of a decoder layer's largest linear weight from which a step's ops are worth more than one thread
(4 MiB in fp32). At one row a linear streams its weight once: each thread's share of a 4 MiB weight takes
~0.2 ms at a core's ~10 GB/s, against the ~10-50 us a thread barrier costs, while the test models' 32 KiB weights
take ~3 us, less than the barrier. Measured on the 2-core CPU, one engine step, 1 thread against 2: the default
Qwen2.5-Coder-0.5B (largest layer weight 4864 x 896) 152 against 94 ms at batch 1, 213 against 122 at 16, 675
against 426 at 64; the tiny Gemma3 (128 x 64) 2.0 against 2.4 ms at batch 1 and 4.7 against 5.3 at 64, and with
another process busy on a core up to 965 ms (`segserve bench engine --num-threads N`, 2026-11-29)."""


def threads_for(model, available: int) -> int:
    """The intra-op threads a CPU forward of `model` runs best on, out of `available`: all of them when its decoder
    layers' largest linear weight (the output head left out) has at least PARALLEL_MIN_WEIGHTS elements, else one."""
    import torch

    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    largest = max((module.weight.numel() for module in model.modules()
                   if isinstance(module, torch.nn.Linear) and module is not head), default=0)
    return available if largest >= PARALLEL_MIN_WEIGHTS else 1


def cpu_threads(requested: int) -> int:
    """torch intra-op threads for a CPU worker: `requested`, or with 0 torch's default capped by available_cpus()."""
    import torch

    return requested or min(torch.get_num_threads(), available_cpus())
