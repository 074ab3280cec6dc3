"""The Drafter over in-process gRPC: trees, resync, finished ids, online learning, GetStats; corpus files.

Replies carry the contract's CandidateTree (protos.segserve.v1.tree); Health the contract's Health.
"""

from __future__ import annotations

import grpc
import pytest

from drafter.build import build_corpus
from drafter.config import DrafterConfig
from drafter.segments import load_segments, parse_segments
from drafter.memory import corpus_path, load_corpora, save_corpora
from drafter.server import build_servicer, start_server
from drafter.trees import BUILDERS
from protos.segserve.v1 import common_pb2, drafter_pb2, drafter_pb2_grpc
from protos.segserve.v1.info import Health
from protos.segserve.v1.stats import DrafterSegmentStats, DrafterStats
from protos.segserve.v1.tree import CandidateTree

RAW = {
    "default": {"algorithm": "best_first", "max_nodes": 6},
    "segment": [{"name": "code", "start": 1, "end": 1, "algorithm": "multi_branch_dfs", "max_nodes": 8,
                 "max_depth": 8}],
}
PROMPT = [10, 11, 12, 13, 14, 15, 10, 11]


@pytest.fixture
def raw_segments():
    return RAW


@pytest.fixture
def servicer(raw_segments):
    return build_servicer(DrafterConfig(max_requests=16), parse_segments(raw_segments))


@pytest.fixture
async def stub(servicer):
    server, port = await start_server(servicer, "127.0.0.1", 0)
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        yield drafter_pb2_grpc.DrafterStub(channel)
    await server.stop(grace=None)


def _query(rid, new, num_tokens, num_prompt=0, max_nodes=8):
    return drafter_pb2.DraftQuery(request_id=rid, new_token_ids=new, num_tokens=num_tokens,
                                  num_prompt_tokens=num_prompt, max_nodes=max_nodes)


def _tree(reply: drafter_pb2.DraftReply, max_nodes: int = 8) -> CandidateTree:
    """The reply's tree off the wire, checked like its receiver checks it."""
    tree = CandidateTree.from_pb(reply.tree)
    assert tree.problem(max_nodes=max_nodes) is None
    if reply.needs_resync:
        assert len(tree) == 0
    return tree


async def test_a_taken_port_stops_a_second_drafter(servicer):
    first, port = await start_server(servicer, "127.0.0.1", 0)
    try:
        with pytest.raises(OSError, match=f"cannot bind the drafter to 127.0.0.1:{port}"):
            await start_server(servicer, "127.0.0.1", port)
    finally:
        await first.stop(grace=None)


async def test_health(stub):
    assert Health.from_pb(await stub.Health(common_pb2.HealthRequest())) == Health(is_ready=True)


async def test_the_standard_health_protocol_and_reflection_are_served(servicer):
    from grpc_health.v1 import health_pb2, health_pb2_grpc
    from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

    server, port = await start_server(servicer, "127.0.0.1", 0)
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        check = health_pb2_grpc.HealthStub(channel).Check
        for service in ("", "segserve.v1.Drafter"):
            reply = await check(health_pb2.HealthCheckRequest(service=service))
            assert reply.status == health_pb2.HealthCheckResponse.SERVING
        stream = reflection_pb2_grpc.ServerReflectionStub(channel).ServerReflectionInfo(
            iter([reflection_pb2.ServerReflectionRequest(list_services="")]))
        names = {s.name async for reply in stream for s in reply.list_services_response.service}
        assert {"segserve.v1.Drafter", "grpc.health.v1.Health"} <= names
        await servicer.set_serving(False)  # shutting down: load balancers stop sending
        reply = await check(health_pb2.HealthCheckRequest(service=""))
        assert reply.status == health_pb2.HealthCheckResponse.NOT_SERVING
    await server.stop(grace=None)


async def test_trees_follow_the_requests_history(stub):
    response = await stub.Draft(drafter_pb2.DraftRequest(queries=[
        _query("a", PROMPT, len(PROMPT), len(PROMPT)),
        _query("b", [20, 21], 2, 2),
    ]))
    a, b = response.replies
    assert (a.request_id, b.request_id) == ("a", "b")
    assert _tree(a).token_ids[:4] == (12, 13, 14, 15) and a.segment == "default"
    assert len(_tree(b)) == 0 and not b.needs_resync  # nothing to propose yet
    response = await stub.Draft(drafter_pb2.DraftRequest(queries=[_query("a", [12, 1], 10)]))
    assert response.replies[0].segment == "code"
    # the token of the code marker, in every reply: where it comes the segment may change
    assert [list(r.marker_token_ids) for r in (a, b, response.replies[0])] == [[1], [1], [1]]


def test_the_marker_tokens_are_every_token_of_every_kinds_start_and_end():
    segments = parse_segments({"default": {}, "segment": [{"name": "json", "start": [7, 8], "end": 7},
                                                          {"name": "turn", "start": 3, "end": 4}]})
    assert segments.marker_token_ids == (3, 4, 7, 8)
    assert parse_segments({"default": {}}).marker_token_ids == ()


async def test_resync_and_finished_ids(stub):
    await stub.Draft(drafter_pb2.DraftRequest(queries=[_query("a", PROMPT, 8, 8, max_nodes=0)]))
    (reply,) = (await stub.Draft(drafter_pb2.DraftRequest(queries=[_query("a", [12], 10)]))).replies
    assert reply.needs_resync and len(_tree(reply)) == 0  # 8 + 1 != 10
    (reply,) = (await stub.Draft(drafter_pb2.DraftRequest(queries=[_query("a", PROMPT + [12], 9, 8)]))).replies
    assert not reply.needs_resync and _tree(reply).token_ids[:2] == (13, 14)
    request = drafter_pb2.DraftRequest(queries=[_query("a", [13], 10)], finished_request_ids=["a", "zz"])
    (reply,) = (await stub.Draft(request)).replies  # dropped first, so the increment cannot apply
    assert reply.needs_resync


async def test_online_learning_over_grpc(servicer, stub):
    block = [1, 30, 31, 32, 33, 34, 35, 1]
    await stub.Draft(drafter_pb2.DraftRequest(queries=[_query("a", [10], 1, 1, max_nodes=0)]))
    await stub.Draft(drafter_pb2.DraftRequest(queries=[_query("a", block, 9, max_nodes=0)]))
    assert servicer.planner.wait_learned(10)  # learning runs in the background
    request = drafter_pb2.DraftRequest(queries=[_query("b", [20, 1, 30], 3, 1)], finished_request_ids=["a"])
    (reply,) = (await stub.Draft(request)).replies
    assert reply.segment == "code" and _tree(reply).token_ids[:5] == (31, 32, 33, 34, 35)


async def test_get_stats_counts_corpus_entries_and_requests_per_segment(servicer, stub):
    empty = DrafterStats.from_pb(await stub.GetStats(drafter_pb2.DrafterStatsRequest()))
    assert empty.segments == (DrafterSegmentStats("code"), DrafterSegmentStats("default"))
    assert (empty.num_requests, empty.num_draft_calls, empty.backend) == (0, 0, "segserve")
    assert empty.cpu_seconds > 0  # the process's, since it started
    block = [1, 30, 31, 32, 33, 34, 35, 1]
    await stub.Draft(drafter_pb2.DraftRequest(queries=[_query("a", [10], 1, 1, max_nodes=0)]))
    await stub.Draft(drafter_pb2.DraftRequest(queries=[_query("a", block, 9, max_nodes=0)]))  # learns the block
    assert servicer.planner.wait_learned(10)
    await stub.Draft(drafter_pb2.DraftRequest(queries=[_query("b", [20, 1, 30], 3, 1), _query("c", [5], 1, 1)]))
    stats = DrafterStats.from_pb(await stub.GetStats(drafter_pb2.DrafterStatsRequest()))
    code, default = stats.segments
    assert code.segment == "code" and code.num_corpus_entries == servicer.planner.corpora["code"].num_entries > 0
    assert code.num_corpus_bytes == servicer.planner.corpora["code"].num_bytes > 0
    assert code.num_corpus_entries == len(block)  # a corpus holds each learned token once
    assert code.num_learned_tokens == len(block) and stats.num_draft_calls == 3
    assert (default.segment, default.num_corpus_entries, default.num_learned_tokens) == ("default", 0, 0)
    # "b" is inside a code block; "a" (its block closed) and "c" are in the default segment.
    assert (stats.num_requests, code.num_requests, default.num_requests) == (3, 1, 2)
    await stub.Draft(drafter_pb2.DraftRequest(finished_request_ids=["a", "b", "c"]))
    after = DrafterStats.from_pb(await stub.GetStats(drafter_pb2.DrafterStatsRequest()))
    assert after.num_requests == 0 and after.segments[0].num_corpus_entries == code.num_corpus_entries


@pytest.mark.parametrize("raw_segments", [{"default": {"algorithm": name, "max_nodes": 6}}
                                          for name in sorted(BUILDERS)])
async def test_replies_round_trip_into_the_planners_trees(servicer, stub):
    tokens = [10, 11, 12, 13, 10, 11, 14, 15, 10, 11, 12, 16, 10, 11]
    request = drafter_pb2.DraftRequest(queries=[_query(rid, tokens, len(tokens), len(tokens), max_nodes=n)
                                                for rid, n in (("a", 8), ("b", 3), ("c", 0))])
    replies = (await stub.Draft(request)).replies
    assert [r.request_id for r in replies] == ["a", "b", "c"]
    for reply, max_nodes in zip(replies, (8, 3, 0)):
        tree = _tree(reply, max_nodes)
        expected, segment = servicer.planner.draft(servicer.states.update(reply.request_id, [], 14, 0), max_nodes)
        assert tree == expected and reply.segment == segment and not reply.needs_resync
        assert tree.to_pb() == reply.tree
    assert len(_tree(replies[0])) > 0 and len(_tree(replies[2])) == 0


@pytest.mark.parametrize("bad", [
    CandidateTree((12, 13), (-1, 1)),  # a parent that is not earlier
    CandidateTree((12, 13), (-1,)),  # fewer parents than tokens
    CandidateTree((12,) * 9, (-1,) * 9),  # over the query's budget of 8
])
async def test_an_invalid_tree_from_the_planner_is_never_sent(servicer, stub, bad):
    servicer.planner.draft = lambda state, max_nodes, min_node_prob: (bad, "default")
    request = drafter_pb2.DraftRequest(queries=[_query("a", PROMPT, len(PROMPT), len(PROMPT))])
    (reply,) = (await stub.Draft(request)).replies
    assert reply.request_id == "a" and reply.segment == "default" and not reply.needs_resync
    assert reply.HasField("tree") and CandidateTree.from_pb(reply.tree) == CandidateTree()


@pytest.mark.parametrize("price,applied", [(0.4, 0.4), (0.0, 0.0), (1.0, 0.0), (-0.5, 0.0), (float("nan"), 0.0)])
async def test_the_schedulers_price_reaches_the_planner_and_a_price_out_of_range_is_ignored(servicer, stub, price,
                                                                                         applied):
    asked = []
    servicer.planner.draft = lambda state, max_nodes, min_node_prob: (asked.append(min_node_prob), (
        CandidateTree(), "default"))[1]
    query = _query("a", PROMPT, len(PROMPT), len(PROMPT))
    query.min_node_prob = price
    (reply,) = (await stub.Draft(drafter_pb2.DraftRequest(queries=[query]))).replies
    assert not reply.needs_resync and asked == [pytest.approx(applied)]


def test_corpora_save_and_load_by_segment(tmp_path):
    segments = parse_segments(RAW)
    corpora = load_corpora(segments, tmp_path)  # nothing saved yet: empty corpora
    assert set(corpora) == {"default", "code"} and corpora["code"].num_entries == 0
    corpora["code"].add([1, 40, 41, 42, 1])
    save_corpora(corpora, tmp_path)
    assert corpus_path(tmp_path, "code").is_file()
    reloaded = load_corpora(segments, tmp_path)
    assert reloaded["code"].propose([1, 40], 3, 1)[0].token_ids == (41, 42, 1)


def test_build_corpus_from_text_files(tiny_gemma3_dir, tmp_path):
    from transformers import AutoTokenizer

    config = tmp_path / "segments.toml"
    config.write_text('[[segment]]\nname = "fence"\nstart = "<bos>"\nend = "<eos>"\n'
                      'corpus = { max_entries = 1000, max_depth = 12, max_key = 4, min_key = 1, decay = 0.5 }\n')
    text = tmp_path / "a.txt"
    text.write_text("The quick brown fox <bos>return a + b<eos> jumps over the lazy dog.")
    sizes = build_corpus([text], str(tiny_gemma3_dir), str(config), tmp_path / "out")
    assert sizes["fence"] > 0 and sizes["default"] > 0
    tokenizer = AutoTokenizer.from_pretrained(tiny_gemma3_dir)
    corpora = load_corpora(load_segments(config, tokenizer), tmp_path / "out")
    ret = tokenizer.encode("<bos>return", add_special_tokens=False)
    rest = tokenizer.encode(" a + b", add_special_tokens=False)
    assert corpora["fence"].propose(ret, 20, 1)[0].token_ids[: len(rest)] == tuple(rest)
    assert corpora["default"].propose(ret, 20, 1) == []  # segment text stays out of the default corpus
