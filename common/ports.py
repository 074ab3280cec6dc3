"""Picking a free TCP port for a service that is about to be started."""
import random
import socket
from pathlib import Path

_LOWEST = 20000
"""Ports below this one are left alone: well-known and registered services' defaults, and Ray's worker ports
(10002-19999 by default)."""
_ATTEMPTS = 64


def _ephemeral_start() -> int:
    """The first port of the kernel's ephemeral range (Linux: /proc/sys/net/ipv4/ip_local_port_range)."""
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768  # Linux's default, and close to the BSDs' and Windows' ranges (49152 up)


def is_free(host: str, port: int, *, is_reuse_address: bool = False) -> bool:
    """Whether nothing on `host` holds `port` now. With is_reuse_address, as a server binds (SO_REUSEADDR, which
    gRPC and uvicorn set): connections of before, closed and waiting out TIME_WAIT, do not count."""
    with socket.socket() as sock:
        if is_reuse_address:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
        except OSError:
            return False
        return True


def free_port(host: str = "127.0.0.1") -> int:
    """A port nothing on `host` holds now, picked at random below the kernel's ephemeral range.

    A port from bind(0) is an ephemeral one: between this pick and the service's own bind, any outgoing connection
    on the machine (a gRPC client, Ray, a test's HTTP call) can be given it. Ports below the range are never handed
    out that way, so only another process picking ports the same way can take this one (random, so rarely); a
    launcher still picks again when its service reports the port taken."""
    start = _ephemeral_start()
    if start - _LOWEST >= 1024:
        rng = random.SystemRandom()  # not the module's generator: forked processes share its state
        for _ in range(_ATTEMPTS):
            port = rng.randrange(_LOWEST, start)
            if is_free(host, port):
                return port
    with socket.socket() as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]
