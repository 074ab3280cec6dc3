"""Tenant isolation in the drafter: learned corpora per (tenant, segment kind), a shared seeded corpus, the
shared log and snapshots keeping the scope, and the tenant arriving over gRPC in the DraftQuery."""

from __future__ import annotations

import grpc

from drafter.config import DrafterConfig
from drafter.memory import SharedMemory, load_tenant_corpora, restore
from drafter.planner import DraftPlanner
from drafter.segment_log import DirectorySegmentLog, LearnedSegment
from drafter.segments import parse_segments
from drafter.server import build_servicer, start_server
from drafter.state import RequestStates
from protos.segserve.v1 import drafter_pb2, drafter_pb2_grpc
from protos.segserve.v1.tree import CandidateTree

# 1 = code fence (opens and closes); >= 10 text.
RAW = {"segment": [{"name": "code", "start": 1, "end": 1, "algorithm": "multi_branch_dfs", "max_nodes": 8,
                    "max_depth": 8}]}
SECRET = [1, 30, 31, 32, 33, 34, 35, 1]
"""A code block one tenant's request generates."""
ASKS = [20, 1, 30]
"""A later prompt that opens a code block with SECRET's first token."""
SECRET_PATH = [31, 32, 33, 34, 35, 1]


def _setup():
    segments = parse_segments(RAW)
    planner = DraftPlanner(segments)
    return planner, RequestStates(segments, planner.learn)


def _proposes_secret(planner, states, request_id: str, tenant: str) -> bool:
    state = states.update(request_id, ASKS, len(ASKS), len(ASKS), tenant=tenant)
    tree, segment = planner.draft(state, max_nodes=8)
    assert segment == "code"
    return tree.is_path(SECRET_PATH)


def _generate_secret(states, tenant: str) -> None:
    """A request of `tenant` whose output closes SECRET."""
    states.update("gen", [10], 1, 1, tenant=tenant)
    states.update("gen", SECRET, 1 + len(SECRET), 1)
    states.drop("gen")


def test_a_tenants_learned_segment_is_proposed_to_that_tenant_only():
    planner, states = _setup()
    _generate_secret(states, "tenant-a")
    assert ("tenant-a", "code") in planner.tenant_corpora
    assert planner.corpora["code"].num_entries == 0  # nothing reached the shared corpus
    assert _proposes_secret(planner, states, "a-later", "tenant-a")
    assert not _proposes_secret(planner, states, "b", "tenant-b")
    assert not _proposes_secret(planner, states, "default", "")


def test_the_default_tenant_learns_into_the_shared_corpus_as_before():
    planner, states = _setup()
    _generate_secret(states, "")
    assert planner.tenant_corpora == {} and planner.corpora["code"].num_entries > 0
    assert _proposes_secret(planner, states, "again", "")


def test_a_seeded_shared_corpus_is_proposed_to_every_tenant():
    planner, states = _setup()
    planner.learn("code", SECRET)  # what an operator seeds (segserve corpus build, a snapshot)
    assert _proposes_secret(planner, states, "a", "tenant-a")
    assert _proposes_secret(planner, states, "b", "tenant-b")
    _generate_secret(states, "tenant-a")  # a tenant's own corpus adds to the shared one, not replaces it
    assert _proposes_secret(planner, states, "b2", "tenant-b")


def test_a_final_update_learns_for_the_requests_tenant():
    planner, states = _setup()
    tokens = [10, *SECRET]
    assert states.finish("ended", tokens, len(tokens), 1, tenant="tenant-a")
    assert _proposes_secret(planner, states, "a", "tenant-a")
    assert not _proposes_secret(planner, states, "b", "tenant-b")


def _memory(tmp_path, origin: str, snapshot_dir=None) -> SharedMemory:
    segments = parse_segments(RAW)
    corpora, cursor = restore(snapshot_dir, segments, "directory")
    planner = DraftPlanner(segments, corpora, tenant_corpora=load_tenant_corpora(segments, snapshot_dir))
    return SharedMemory(planner, DirectorySegmentLog(tmp_path / "log", origin), snapshot_dir, origin, "directory",
                        cursor)


def _proposal(planner: DraftPlanner, tenant: str) -> tuple[int, ...]:
    corpus = planner.corpus_for("code", tenant)
    found = corpus.propose([1, 30], 8, 1) if corpus is not None else []
    return found[0].token_ids if found else ()


def test_the_shared_log_carries_the_tenant_and_another_replica_stays_scoped(tmp_path):
    log = DirectorySegmentLog(tmp_path / "raw", "w")
    log.append(LearnedSegment("w", "code", (1, 2), "tenant-a"))
    log.append(LearnedSegment("w", "code", (3,)))
    assert log.read(None, 10)[0] == [LearnedSegment("w", "code", (1, 2), "tenant-a"),
                                     LearnedSegment("w", "code", (3,), "")]
    a, b = _memory(tmp_path, "a"), _memory(tmp_path, "b")
    a.learn("code", SECRET, "tenant-a")
    assert b.poll() == 1
    assert _proposal(b.planner, "tenant-a") == tuple(SECRET_PATH)
    assert _proposal(b.planner, "tenant-b") == () and _proposal(b.planner, "") == ()


def test_a_snapshot_keeps_each_tenants_corpora(tmp_path):
    snapshots = tmp_path / "snap"
    a = _memory(tmp_path, "a", snapshots)
    a.learn("code", SECRET, "tenant/with odd chars")  # the id never becomes a path as it is
    a.learn("code", [1, 50, 51, 52, 1])
    a.snapshot()
    restarted = _memory(tmp_path / "elsewhere", "r", snapshots)
    assert _proposal(restarted.planner, "tenant/with odd chars") == tuple(SECRET_PATH)
    assert _proposal(restarted.planner, "") == ()  # the shared corpus holds only the default tenant's
    assert restarted.planner.corpora["code"].propose([1, 50], 8, 1)[0].token_ids == (51, 52, 1)


async def test_the_tenant_travels_in_the_draft_query_over_grpc():
    servicer = build_servicer(DrafterConfig(max_requests=16), parse_segments(RAW))
    server, port = await start_server(servicer, "127.0.0.1", 0)

    def query(rid, new, num_tokens, num_prompt, tenant, max_nodes=8, is_final=False):
        return drafter_pb2.DraftQuery(request_id=rid, new_token_ids=new, num_tokens=num_tokens,
                                      num_prompt_tokens=num_prompt, max_nodes=max_nodes, tenant=tenant,
                                      is_final=is_final)

    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            stub = drafter_pb2_grpc.DrafterStub(channel)
            tokens = [10, *SECRET]
            await stub.Draft(drafter_pb2.DraftRequest(queries=[query("gen", tokens, len(tokens), 1, "tenant-a",
                                                                     is_final=True)]))
            assert servicer.planner.wait_learned(10)
            replies = (await stub.Draft(drafter_pb2.DraftRequest(queries=[
                query("a", ASKS, 3, 3, "tenant-a"), query("b", ASKS, 3, 3, "tenant-b")]))).replies
            trees = {reply.request_id: CandidateTree.from_pb(reply.tree) for reply in replies}
            assert trees["a"].is_path(SECRET_PATH) and not trees["b"].is_path(SECRET_PATH)
            stats = servicer.stats()  # a tenant's corpus counts in its kind's size
            code = next(s for s in stats.segments if s.segment == "code")
            assert code.num_corpus_entries == servicer.planner.tenant_corpora[("tenant-a", "code")].num_entries > 0
    finally:
        await server.stop(grace=None)


class _WireDrafter:
    """The Drafter servicer's batch logic behind the speculator, each query through its protobuf form."""

    def __init__(self, segments: dict):
        self.servicer = build_servicer(DrafterConfig(), parse_segments(segments))

    async def draft(self, queries, finished_ids):
        from protos.segserve.v1.draft import DraftQuery, DraftReply

        replies = self.servicer.draft_batch([DraftQuery.from_pb(q.to_pb()) for q in queries], list(finished_ids))
        return {reply.request_id: DraftReply.from_pb(reply) for reply in replies}

    def proposal(self, context: list[int], tenant: str) -> list[int]:
        from protos.segserve.v1.draft import DraftQuery

        assert self.servicer.planner.wait_learned(10)
        (reply,) = self.servicer.draft_batch([DraftQuery("later", context, len(context), 1, 8, tenant=tenant)], [])
        return list(reply.tree.token_ids)


async def test_the_scheduler_sends_the_generate_requests_tenant_to_the_drafter():
    from protos.segserve.v1.generate import GenerateRequest
    from protos.segserve.v1.sampling import StoppingCriteria
    from scheduler.sequence import Sequence
    from scheduler.spec_policy import SpecPolicy
    from scheduler.speculator import Speculator
    from tests.support.fakes import FakeWorker
    from tests.scheduler.test_spec import EOS, RULE, VOCAB, make_scheduler, step
    from tests.scheduler.test_speculator_learning import MAX_TOKENS, OUTPUT, PROMPT, SEGMENTS

    drafter = _WireDrafter(SEGMENTS)
    speculator = Speculator(drafter, SpecPolicy(6, is_adaptive=False), VOCAB)
    scheduler = make_scheduler(speculator)
    request = GenerateRequest("a", tuple(PROMPT), stopping=StoppingCriteria(MAX_TOKENS), tenant="tenant-a")
    scheduler.add(Sequence.of(request))
    worker, results = FakeWorker(RULE, VOCAB, [EOS]), {}
    while scheduler.has_work:
        await step(scheduler, speculator, worker, results)
    await speculator.wait_finals_sent()
    assert results["a"][0] == OUTPUT
    segment = OUTPUT[1:]  # markers included
    assert drafter.proposal([9, *segment[:2]], "tenant-a")[:6] == segment[2:8]
    assert segment[2:8] != drafter.proposal([9, *segment[:2]], "tenant-b")[:6]
    assert drafter.servicer.planner.corpora["code"].num_entries == 0


def test_the_generate_request_carries_a_plain_tenant_over_the_wire():
    import pytest

    from protos.segserve.v1.generate import GenerateRequest, validate_request
    from protos.segserve.v1.info import WorkerInfo
    from protos.segserve.v1.sampling import InvalidParameter

    request = GenerateRequest("r", (1, 2), tenant="0123abcd")
    assert GenerateRequest.from_pb(request.to_pb()) == request
    info = WorkerInfo(model_name="m", num_kv_blocks=4, block_size=4, max_model_len=16, vocab_size=10,
                      eos_token_ids=(0,))
    validate_request(request, info)
    with pytest.raises(InvalidParameter, match="tenant"):
        validate_request(GenerateRequest("r", (1, 2), tenant="a/b"), info)


def test_the_tenants_corpora_of_a_kind_share_its_budget_and_the_least_recent_go_first(tmp_path):
    one = DraftPlanner(parse_segments(RAW))
    one.learn("code", SECRET, "t")
    size = one.tenant_corpora[("t", "code")].num_bytes  # one tenant's corpus after one segment
    raw = {"segment": [{**RAW["segment"][0], "corpus": {"max_bytes": int(size * 2.5), "max_depth": 8,
                                                        "max_key": 4}}]}
    segments = parse_segments(raw)
    corpora, cursor = restore(None, segments, "directory")
    memory = SharedMemory(DraftPlanner(segments, corpora), None, tmp_path / "snap", "o", "directory", cursor)
    memory.learn("code", SECRET, "tenant-a")
    memory.learn("code", SECRET, "tenant-b")
    memory.snapshot()
    memory.learn("code", SECRET, "tenant-a")  # a learned again: b is now the least recent
    memory.learn("code", SECRET, "tenant-c")  # three corpora pass 2.5 corpora's budget: b goes
    planner = memory.planner
    assert sorted(tenant for tenant, _ in planner.tenant_corpora) == ["tenant-a", "tenant-c"]
    assert planner.num_tenant_corpora_dropped == 1
    assert _proposal(planner, "tenant-a") == tuple(SECRET_PATH) and _proposal(planner, "tenant-b") == ()
    memory.snapshot()  # the dropped tenant's file goes too: a restart does not bring it back
    assert sorted(tenant for tenant, _ in load_tenant_corpora(segments, tmp_path / "snap")) == ["tenant-a",
                                                                                                "tenant-c"]
