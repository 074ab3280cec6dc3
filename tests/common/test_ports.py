"""free_port: a port nothing holds, below the kernel's ephemeral range (ports outgoing connections are given)."""
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
