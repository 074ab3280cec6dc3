"""A tensor-parallel worker's ranks: rank 0 serves gRPC and sends every step to the others, which follow.

Rank 0 (the worker process) starts ranks 1..N-1 as processes of their own (`python -m worker.follower`; on a Ray
cluster, actors in the worker's placement group: worker/actor.py), and each connects back over a channel
(multiprocessing.connection, authenticated) and joins the ranks' process group (worker/tensor_parallel.py). From
then on rank 0 sends each call that runs the model (`step`, `forward`) down the channel before running it itself,
and every rank runs the same call on the same request: the same forward with its collectives, the same sampling
(all ranks seed torch's RNG alike and see the same all-gathered logits), the same state. Rank 0 alone answers.

A rank that dies takes the worker down as one unit: a follower's channel closes when its process ends (SIGKILL
included), rank 0 sees that and exits, and the scheduler moves the worker's requests as it does for any dead worker
(its supervisor starts the worker again). A follower whose rank 0 is gone reads the end of its channel and exits.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import secrets
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from multiprocessing.connection import Connection, Listener, wait

import torch
import torch.distributed as dist

from worker.config import WorkerConfig
from worker.tensor_parallel import COLLECTIVE_TIMEOUT, RankGroup

logger = logging.getLogger(__name__)
CONNECT_TIMEOUT_S = 120.0
"""How long rank 0 waits for the other ranks to connect (they import torch and transformers first)."""


@dataclass(frozen=True)
class RankAddress:
    """Where the followers meet rank 0: its channel's port and key, its process group's store, the RNG seed."""

    host: str
    channel_port: int
    authkey: str
    store_port: int
    seed: int


def rank_device(device: torch.device, rank: int) -> torch.device:
    """The device of `rank` on this machine: cuda:rank on CUDA (ValueError when there are fewer devices), else the
    same device."""
    if device.type != "cuda":
        return device
    if rank >= torch.cuda.device_count():
        raise ValueError(f"tensor_parallel_size={rank + 1} or more, but this machine has "
                         f"{torch.cuda.device_count()} CUDA devices")
    return torch.device("cuda", rank)


Launch = Callable[[WorkerConfig, int, RankAddress], object]
"""Starts follower `rank` of a worker; returns a handle Followers.close() stops (a Popen, a Ray actor)."""


def launch_process(config: WorkerConfig, rank: int, address: RankAddress) -> subprocess.Popen:
    """Follower `rank` as a child process, its output the worker's; what it needs goes through its stdin, out of
    sight of other users' `ps` (the channel's key among it)."""
    spec = json.dumps({"config": dataclasses.asdict(config), "rank": rank, "address": dataclasses.asdict(address),
                       "parent": os.getpid()})
    process = subprocess.Popen([sys.executable, "-m", "worker.follower"], stdin=subprocess.PIPE, text=True)
    process.stdin.write(spec)
    process.stdin.close()
    return process


def _die(rank: int) -> None:
    logger.error("tensor-parallel rank %d died: the worker stops with it", rank)
    os._exit(1)


class Followers:
    """Rank 0's side: the other ranks, their channels, and the watch that stops the worker when one dies."""

    def __init__(self, config: WorkerConfig, device: torch.device, launch: Launch = launch_process,
                 on_death: Callable[[int], None] = _die, host: str = "127.0.0.1"):
        size = config.tensor_parallel_size
        if launch is launch_process:  # ranks on this machine's devices (a Ray actor sees its own device alone)
            for rank in range(size):
                rank_device(device, rank)  # ValueError before anything starts
        key = secrets.token_bytes(16)
        listener = Listener((host, 0), authkey=key)
        store = dist.TCPStore(host, 0, size, True, timeout=COLLECTIVE_TIMEOUT, wait_for_workers=False)
        address = RankAddress(host, listener.address[1], key.hex(), store.port, secrets.randbits(62))
        self.seed = address.seed
        self._on_death = on_death
        self._closing = False
        self._handles = [launch(config, rank, address) for rank in range(1, size)]
        try:
            self._channels = _accept(listener, size - 1, self._handles)
        finally:
            listener.close()
        self.group = RankGroup.on_store(store, 0, size, device)
        self._store = store
        self._watch = threading.Thread(target=self._watch_channels, name="rank-watch", daemon=True)
        self._watch.start()

    def send(self, *call) -> None:
        """Have every follower run runner.<call[0]>(*call[1:])."""
        for channel in self._channels:
            channel.send(call)

    def check(self, timeout_s: float = 0.5) -> None:
        """After a failed call: a collective fails when a rank has died, often before the watch sees the rank's
        channel close. Give the channels timeout_s to show that, and stop the worker if one does, rather than
        answer the call's error while it still looks alive."""
        ranks = {channel: rank for rank, channel in enumerate(self._channels, start=1)}
        ended = wait(list(ranks), timeout_s)
        if ended and not self._closing:
            self._on_death(ranks[ended[0]])

    def close(self, timeout_s: float = 10.0) -> None:
        """Stop the followers (they leave their loop), waiting up to timeout_s before killing a process."""
        self._closing = True
        for channel in self._channels:
            try:
                channel.send(("stop",))
                channel.close()
            except OSError:
                pass
        deadline = time.monotonic() + timeout_s
        for handle in self._handles:
            if isinstance(handle, subprocess.Popen):
                try:
                    handle.wait(max(0.1, deadline - time.monotonic()))
                except subprocess.TimeoutExpired:
                    handle.kill()

    def _watch_channels(self) -> None:
        """A follower never writes: its channel turns readable only when it closes, i.e. the rank is gone."""
        ranks = {channel: rank for rank, channel in enumerate(self._channels, start=1)}
        ended = wait(list(ranks))
        if not self._closing:
            self._on_death(ranks[ended[0]])


def _accept(listener: Listener, count: int, handles: list) -> list[Connection]:
    """The channels of `count` followers in rank order, accepting on a thread so that a follower that exits
    before it connects fails the start (RuntimeError) instead of hanging it."""
    channels: dict[int, Connection] = {}

    def accept() -> None:
        for _ in range(count):
            channel = listener.accept()
            channels[channel.recv()] = channel

    thread = threading.Thread(target=accept, name="rank-accept", daemon=True)
    thread.start()
    deadline = time.monotonic() + CONNECT_TIMEOUT_S
    while thread.is_alive():
        thread.join(0.1)
        dead = [h.args for h in handles if isinstance(h, subprocess.Popen) and h.poll() is not None]
        if dead or time.monotonic() > deadline:
            raise RuntimeError("a tensor-parallel rank " + ("exited" if dead else "did not connect") + " at start-up")
    return [channels[rank] for rank in sorted(channels)]
