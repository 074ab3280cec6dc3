"""A tensor-parallel worker's follower rank (worker/ranks.py): `python -m worker.follower`, started by rank 0.

In: on stdin, JSON of the worker's config, this rank and rank 0's RankAddress. Out: nothing; it runs each call rank 0
sends on its own shard of the model, until rank 0 says stop or is gone.
"""

from __future__ import annotations

import json
import logging
import os
import sys
import threading
import time
from multiprocessing.connection import Client

import torch

from worker.config import WorkerConfig
from worker.loading import resolve_device_dtype
from worker.model_runner import ModelRunner
from worker.ranks import RankAddress, rank_device
from worker.tensor_parallel import RankGroup
from worker.validation import InvalidRequest

logger = logging.getLogger(__name__)


def follow(config: WorkerConfig, rank: int, address: RankAddress, parent: int | None = None,
           device: torch.device | None = None) -> None:
    """A follower's life: connect to rank 0, join the group, load its shard, then run each call rank 0 sends until
    it says stop or its channel ends. parent: rank 0's pid, when it is this process's parent; device: the rank's
    own (None: this machine's device number `rank`)."""
    channel = Client((address.host, address.channel_port), authkey=bytes.fromhex(address.authkey))
    channel.send(rank)
    if parent is not None:
        threading.Thread(target=_exit_with_parent, args=(parent,), name="parent-watch", daemon=True).start()
    device = device or rank_device(resolve_device_dtype(config)[0], rank)
    group = RankGroup.join(address.host, address.store_port, rank, config.tensor_parallel_size, device)
    runner = ModelRunner(config, group, seed=address.seed)
    while True:
        try:
            call = channel.recv()
        except (EOFError, OSError):
            return
        if call[0] == "stop":
            return
        try:
            getattr(runner, call[0])(*call[1:])
        except InvalidRequest:  # rank 0 refuses the same request, before any collective
            continue
        except Exception:
            # Out of memory on this device, say: rank 0 may not have failed, and would wait in the next collective
            # for a rank that left the step. Ending the rank ends the worker instead (worker/ranks.py).
            logger.exception("rank %d: %s failed; the rank stops", rank, call[0])
            os._exit(1)


def _exit_with_parent(parent: int) -> None:
    """A local follower outlives no rank 0, even one stuck in a collective when it died."""
    while os.getppid() == parent:
        time.sleep(0.5)
    os._exit(1)


def main() -> None:
    spec = json.loads(sys.stdin.read())
    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s rank {spec['rank']} %(levelname)s %(name)s: "
                                                   "%(message)s")
    follow(WorkerConfig(**spec["config"]), spec["rank"], RankAddress(**spec["address"]), spec.get("parent"))


if __name__ == "__main__":
    main()
