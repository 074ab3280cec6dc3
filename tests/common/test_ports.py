"""Ports below the kernel's ephemeral range (never given to outgoing connections): bind_free binds one, free_port
picks one; services report what they bound (announce_ports)."""
import socket

import common.ports as ports


def test_a_picked_port_is_free_and_below_the_ephemeral_range():
    start = ports._ephemeral_start()
    picked = {ports.free_port() for _ in range(20)}
    assert all(20000 <= port < start for port in picked)
    assert len(picked) > 1  # at random, not one port every time
    for port in picked:
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", port))


def test_a_port_held_by_another_socket_is_skipped(monkeypatch):
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        taken = held.getsockname()[1]
        draws, randrange = [], ports.random.SystemRandom.randrange

        def draw(rng, low, high):  # the held port twice, then at random
            draws.append(taken if len(draws) < 2 else randrange(rng, low, high))
            return draws[-1]

        monkeypatch.setattr(ports.random.SystemRandom, "randrange", draw)
        picked = ports.free_port()
    assert draws[:2] == [taken, taken] and picked == draws[-1] != taken


def test_without_room_below_the_range_the_kernel_picks(monkeypatch):
    monkeypatch.setattr(ports, "_ephemeral_start", lambda: 20500)
    port = ports.free_port()
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", port))


def test_bind_free_holds_the_first_port_it_can_bind(monkeypatch):
    """Race-free: the port is held from the bind that found it free, a held one skipped, below the range."""
    with socket.socket() as held, socket.socket() as sock:
        held.bind(("127.0.0.1", 0))
        held.listen()
        taken = held.getsockname()[1]
        candidates = iter([taken, 0])
        monkeypatch.setattr(ports, "_candidates", lambda: candidates)
        tried = []

        def bind(port):
            tried.append(port)
            try:
                sock.bind(("127.0.0.1", port))
            except OSError:
                return 0
            return sock.getsockname()[1]

        bound = ports.bind_free(bind)
        assert tried == [taken, 0] and bound == sock.getsockname()[1] != taken


def test_servers_asked_for_port_0_bind_below_the_ephemeral_range():
    """A gRPC service's (common/health.py) and the router's HTTP socket: a port a restart finds free again."""
    import asyncio

    import grpc

    from common.health import Serving, start_serving
    from common.tls import EXCLUSIVE_PORT
    from router.server import http_socket

    async def grpc_port() -> int:
        server = grpc.aio.server(options=[EXCLUSIVE_PORT])
        port = await start_serving(server, Serving(["test"]), "127.0.0.1:0", None, "the test server")
        await server.stop(None)
        return port

    start = ports._ephemeral_start()
    with http_socket("127.0.0.1") as sock:
        assert 20000 <= sock.getsockname()[1] < start
    assert 20000 <= asyncio.run(grpc_port()) < start


def test_announced_ports_are_read_whole_and_merged(monkeypatch, tmp_path):
    path = tmp_path / "router.json"
    assert ports.read_ports(path) is None
    ports.announce_ports(port=1234)  # no variable: nothing is written
    assert not path.exists()
    monkeypatch.setenv(ports.PORTS_FILE_VAR, str(path))
    ports.announce_ports(grpc_port=1235)
    ports.announce_ports(port=1234)
    assert ports.read_ports(path) == {"grpc_port": 1235, "port": 1234}
    assert list(tmp_path.iterdir()) == [path]
