"""The Drafter over in-process gRPC: trees, resync, finished ids, online learning; corpus files."""

from __future__ import annotations

import grpc
import pytest

from drafter.build import build_corpus
from drafter.config import DrafterConfig
from drafter.segments import load_segments, parse_segments
from drafter.server import build_servicer, corpus_path, load_corpora, save_corpora, start_server
from protos.segserve.v1 import drafter_pb2, drafter_pb2_grpc, worker_pb2

RAW = {
    "default": {"algorithm": "best_first", "max_nodes": 6},
    "segment": [{"name": "code", "start": 1, "end": 1, "algorithm": "multi_branch_dfs", "max_nodes": 8,
                 "max_depth": 8}],
}
PROMPT = [10, 11, 12, 13, 14, 15, 10, 11]


@pytest.fixture
async def stub():
    servicer = build_servicer(DrafterConfig(max_requests=16), parse_segments(RAW))
    server, port = await start_server(servicer, "127.0.0.1", 0)
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        yield drafter_pb2_grpc.DrafterStub(channel)
    await server.stop(grace=None)


def _query(rid, new, num_tokens, num_prompt=0, max_nodes=8):
    return drafter_pb2.DraftQuery(request_id=rid, new_token_ids=new, num_tokens=num_tokens,
                                  num_prompt_tokens=num_prompt, max_nodes=max_nodes)


def _assert_well_formed(tree):
    assert len(tree.token_ids) == len(tree.parents)
    assert all(-1 <= p < i for i, p in enumerate(tree.parents))
    if tree.needs_resync:
        assert not tree.token_ids


async def test_health(stub):
    assert (await stub.Health(worker_pb2.HealthRequest())).ready


async def test_trees_follow_the_requests_history(stub):
    response = await stub.Draft(drafter_pb2.DraftRequest(queries=[
        _query("a", PROMPT, len(PROMPT), len(PROMPT)),
        _query("b", [20, 21], 2, 2),
    ]))
    a, b = response.trees
    assert (a.request_id, b.request_id) == ("a", "b")
    for tree in response.trees:
        _assert_well_formed(tree)
    assert list(a.token_ids[:4]) == [12, 13, 14, 15] and a.segment == "default"
    assert not b.token_ids and not b.needs_resync  # nothing to propose yet
    response = await stub.Draft(drafter_pb2.DraftRequest(queries=[_query("a", [12, 1], 10)]))
    assert response.trees[0].segment == "code"


async def test_resync_and_finished_ids(stub):
    await stub.Draft(drafter_pb2.DraftRequest(queries=[_query("a", PROMPT, 8, 8, max_nodes=0)]))
    (tree,) = (await stub.Draft(drafter_pb2.DraftRequest(queries=[_query("a", [12], 10)]))).trees
    assert tree.needs_resync and not tree.token_ids  # 8 + 1 != 10
    (tree,) = (await stub.Draft(drafter_pb2.DraftRequest(queries=[_query("a", PROMPT + [12], 9, 8)]))).trees
    assert not tree.needs_resync and list(tree.token_ids[:2]) == [13, 14]
    request = drafter_pb2.DraftRequest(queries=[_query("a", [13], 10)], finished_request_ids=["a", "zz"])
    (tree,) = (await stub.Draft(request)).trees  # dropped first, so the increment cannot apply
    assert tree.needs_resync


async def test_online_learning_over_grpc(stub):
    block = [1, 30, 31, 32, 33, 34, 35, 1]
    await stub.Draft(drafter_pb2.DraftRequest(queries=[_query("a", [10], 1, 1, max_nodes=0)]))
    await stub.Draft(drafter_pb2.DraftRequest(queries=[_query("a", block, 9, max_nodes=0)]))
    request = drafter_pb2.DraftRequest(queries=[_query("b", [20, 1, 30], 3, 1)], finished_request_ids=["a"])
    (tree,) = (await stub.Draft(request)).trees
    _assert_well_formed(tree)
    assert tree.segment == "code" and list(tree.token_ids[:5]) == [31, 32, 33, 34, 35]


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
