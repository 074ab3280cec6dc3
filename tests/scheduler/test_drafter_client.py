"""The scheduler's drafter client over several replicas: rendezvous placement, re-hashing, discovery."""

from __future__ import annotations

import pytest

from drafter.config import DrafterConfig
from drafter.segments import parse_segments
from drafter.server import build_servicer, start_server
from common.discovery import rendezvous, resolve
from protos.segserve.v1.draft import DraftQuery
from scheduler.drafter_client import DrafterClient

RAW = {"default": {"algorithm": "best_first", "max_nodes": 6}, "segment": [{"name": "code", "start": 1, "end": 1}]}
PROMPT = [10, 11, 12, 13, 14, 15, 10, 11]


def test_a_third_replica_takes_about_a_third_of_the_requests_and_nobody_else_moves():
    keys = [f"request-{i}" for i in range(3000)]
    two = {key: rendezvous(key, ["a:1", "b:1"]) for key in keys}
    three = {key: rendezvous(key, ["a:1", "b:1", "c:1"]) for key in keys}
    moved = [key for key in keys if two[key] != three[key]]
    assert all(three[key] == "c:1" for key in moved)
    assert 0.28 < len(moved) / len(keys) < 0.39
    assert 0.4 < sum(owner == "a:1" for owner in two.values()) / len(keys) < 0.6
    after_loss = {key: rendezvous(key, ["a:1", "c:1"]) for key in keys}  # b left: only its keys move
    assert all(after_loss[key] == three[key] for key in keys if three[key] != "b:1")


async def test_dns_targets_resolve_to_every_address_and_plain_ones_stay_as_written():
    assert {"10.0.0.7:5", "127.0.0.1:50071"} <= set(await resolve(["10.0.0.7:5", "dns:///localhost:50071"]))
    assert await resolve(["dns:///no-such-host.invalid:1"]) == []
    with pytest.raises(ValueError, match="host:port"):
        await resolve(["dns:///no-port"])


def spread_ids(addresses: list[str], count: int) -> list[str]:
    """`count` request ids placed on every one of `addresses` (the servers' ports are random, so a fixed list of ids
    could all hash onto one replica)."""
    ids, owners = [], set()
    for i in range(10_000):
        request_id = f"r{i}"
        owner = rendezvous(request_id, addresses)
        if len(ids) < count - (len(addresses) - len(owners | {owner})):
            ids.append(request_id)
            owners.add(owner)
        if len(ids) == count:
            return ids
    raise AssertionError("no spread")


def query(request_id: str, tokens: list[int], num_tokens: int, num_prompt: int = 0) -> DraftQuery:
    return DraftQuery(request_id, tokens, num_tokens, num_prompt, max_nodes=8)


async def test_requests_of_a_dead_replica_move_to_a_live_one_and_resync_there():
    servers = {}
    for _ in range(2):
        servicer = build_servicer(DrafterConfig(), parse_segments(RAW))
        server, port = await start_server(servicer, "127.0.0.1", 0)
        servers[f"127.0.0.1:{port}"] = (server, servicer)
    client = DrafterClient(list(servers), timeout_s=5.0, retry_s=60.0)
    try:
        ids = spread_ids(list(servers), 12)
        replies = await client.draft([query(i, PROMPT, len(PROMPT), len(PROMPT)) for i in ids], [])
        assert all(not r.needs_resync and r.tree.token_ids[:2] == (12, 13) for r in replies.values())
        assert {r.marker_token_ids for r in replies.values()} == {(1,)}  # RAW's code fence
        owners = {i: client.owner_of(i) for i in ids}
        assert set(owners.values()) == set(servers)  # spread over both
        dead = owners[ids[0]]
        await servers[dead][0].stop(grace=None)
        lost = [i for i in ids if owners[i] == dead]
        await client.draft([query(i, [12], len(PROMPT) + 1) for i in ids], [])  # the dead one fails this step
        replies = await client.draft([query(i, [13], len(PROMPT) + 2) for i in ids], [])
        assert {client.owner_of(i) for i in ids} == set(servers) - {dead}
        assert all(replies[i].needs_resync for i in lost)  # the survivor has no state for them
        assert not any(replies[i].needs_resync for i in ids if i not in lost)
        assert client.num_moved == len(lost)
        resent = await client.draft([query(i, PROMPT + [12, 13], len(PROMPT) + 2, len(PROMPT)) for i in lost], [])
        assert all(not r.needs_resync and r.tree.token_ids[:2] == (14, 15) for r in resent.values())
        await client.draft([], ids)  # ended: each owner drops its requests
        survivor = servers[next(a for a in servers if a != dead)][1]
        assert not any(i in survivor.states for i in ids)
    finally:
        await client.close()
        for server, _ in servers.values():
            await server.stop(grace=None)


async def test_a_dns_target_is_resolved_again_and_a_new_replica_joins(monkeypatch):
    import common.discovery as discovery

    answers = [["10.0.0.1:9"], ["10.0.0.1:9", "10.0.0.2:9"]]

    async def fake_resolve_names(targets):
        assert targets == ["dns:///drafter:9"]
        return dict.fromkeys(answers[0] if len(answers) == 1 else answers.pop(0), "drafter")

    now = [0.0]
    monkeypatch.setattr(discovery, "resolve_names", fake_resolve_names)
    client = DrafterClient(["dns:///drafter:9"], timeout_s=0.01, clock=lambda: now[0], refresh_s=10.0)
    assert client.is_available() and client.addresses == []
    await client.draft([], [])
    assert client.addresses == ["10.0.0.1:9"]
    now[0] = 5.0
    await client.draft([], [])
    assert client.addresses == ["10.0.0.1:9"]  # not yet time to resolve again
    now[0] = 11.0
    await client.draft([], [])
    assert client.addresses == ["10.0.0.1:9", "10.0.0.2:9"]
    await client.close()


async def test_final_updates_reach_the_replica_holding_the_state_which_forgets_the_request():
    servers = {}
    for _ in range(2):
        servicer = build_servicer(DrafterConfig(), parse_segments(RAW))
        server, port = await start_server(servicer, "127.0.0.1", 0)
        servers[f"127.0.0.1:{port}"] = (server, servicer)
    client = DrafterClient(list(servers), timeout_s=5.0)
    try:
        ids = spread_ids(list(servers), 8)
        await client.draft([query(i, PROMPT, len(PROMPT), len(PROMPT)) for i in ids], [])
        assert {client.owner_of(i) for i in ids} == set(servers)
        finals = [DraftQuery(i, [12, 13], len(PROMPT) + 2, len(PROMPT), 0, is_final=True) for i in ids]
        replies = await client.draft(finals, [])
        assert set(replies) == set(ids) and not any(r.needs_resync or r.tree for r in replies.values())
        assert all(client.owner_of(i) is None for i in ids)
        assert all(len(servicer.states) == 0 for _, servicer in servers.values())
    finally:
        await client.close()
        for server, _ in servers.values():
            await server.stop(grace=None)


async def test_a_call_that_asks_for_no_tree_runs_under_the_longer_update_deadline():
    from protos.segserve.v1 import drafter_pb2_grpc
    from tests.support.fake_drafter import FakeDrafter
    from tests.support.fake_services import FakeDrafterServicer, serve
    from tests.support.fakes import positional

    fake = FakeDrafter(positional(97), 97)
    fake.delay_s = 0.2
    server = await serve(drafter_pb2_grpc.add_DrafterServicer_to_server, FakeDrafterServicer(fake))
    client = DrafterClient([f"127.0.0.1:{server.bound_port}"], timeout_s=0.05, retry_s=0.01, update_timeout_s=5.0)
    try:
        final = DraftQuery("a", [5, 6], 2, 1, 0, is_final=True)
        assert not (await client.draft([final], []))["a"].needs_resync
        assert client.num_failures == 0 and fake.finals == {"a": [5, 6]}
        assert await client.draft([query("b", [5, 6], 2, 1)], []) == {}  # a tree is asked for: 50 ms
        assert client.num_failures == 1
    finally:
        await client.close()
        await server.stop(None)
