"""Ports: a service asked for port 0 binds a free one itself and reports it; nothing picks a port for another process.

`bind_free` binds a port by trying: at random below the kernel's ephemeral range first, then whatever bind(0)
gets. Trying is race-free (the bind that finds a port free holds it), and a port below the range is never given to
an outgoing connection, so a service restarted on the port it had finds it free again. Every segserve server takes
port 0 this way (common/health.py's start_serving for gRPC, router/server.py for HTTP).

`announce_ports` writes the ports a service bound to the file `$SEGSERVE_PORTS_FILE` names, when it names one; the
launcher (segserve/launcher.py) starts a service on port 0 with that variable set and reads the file (`read_ports`)
before it polls the service's health.

`free_port` remains for what starts a server it cannot ask (a test's or a bench's peer): it picks a port the same way
without holding it, so another process may take it in between.
"""

from __future__ import annotations

import json
import os
import random
import socket
from collections.abc import Callable, Iterator
from pathlib import Path

_LOWEST = 20000
"""Ports below this one are left alone: well-known and registered services' defaults, and Ray's worker ports
(10002-19999 by default)."""
_ATTEMPTS = 64
PORTS_FILE_VAR = "SEGSERVE_PORTS_FILE"
"""The environment variable naming the file a service reports its bound ports in (announce_ports)."""


def _ephemeral_start() -> int:
    """The first port of the kernel's ephemeral range (Linux: /proc/sys/net/ipv4/ip_local_port_range)."""
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768  # Linux's default, and close to the BSDs' and Windows' ranges (49152 up)


def _candidates() -> Iterator[int]:
    """Up to _ATTEMPTS ports at random below the ephemeral range (none when it leaves no room), then 0."""
    start = _ephemeral_start()
    if start - _LOWEST >= 1024:
        rng = random.SystemRandom()  # not the module's generator: forked processes share its state
        for _ in range(_ATTEMPTS):
            yield rng.randrange(_LOWEST, start)
    yield 0


def bind_free(bind: Callable[[int], int]) -> int:
    """Bind a free port with `bind(port)`, which returns the port it bound (the kernel's pick for 0) or 0 when it
    could not; returns the port bound, 0 when even port 0 failed."""
    for port in _candidates():
        bound = bind(port)
        if bound:
            return bound
    return 0


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
    """A port nothing on `host` holds now, picked as bind_free picks, and let go: only for starting a process that
    cannot bind port 0 and report what it got (another may take the port before it binds)."""

    def check(port: int) -> int:
        if port:
            return port if is_free(host, port) else 0
        with socket.socket() as sock:
            sock.bind((host, 0))
            return sock.getsockname()[1]

    return bind_free(check)


def announce_ports(**ports: int) -> None:
    """Report the ports this service bound (name -> port: "port", and the router's "grpc_port") in the file
    $SEGSERVE_PORTS_FILE names, merged with what is there; nothing without the variable. Written whole (a
    temporary file renamed over it), so a reader never sees half of it."""
    path = os.environ.get(PORTS_FILE_VAR)
    if not path:
        return
    target = Path(path)
    merged = {**(read_ports(target) or {}), **ports}
    temporary = target.with_name(f"{target.name}.{os.getpid()}.tmp")
    temporary.write_text(json.dumps(merged))
    os.replace(temporary, target)


def read_ports(path: Path) -> dict[str, int] | None:
    """What announce_ports wrote to `path`; None before it wrote anything."""
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        return None
