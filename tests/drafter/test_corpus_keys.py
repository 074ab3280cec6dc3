"""Corpora per corpus key (a structured output's schema): a keyed request's whole output is one segment of the
`schema` kind, learned into its key's corpus at the final query, scoped per tenant, bounded in keys per tenant and
in bytes; the key arrives in DraftQuery.corpus_key and travels through the shared log and snapshots."""

from __future__ import annotations

import grpc
import pytest

from drafter.config import DrafterConfig
from drafter.keyed import KEY_START, MAX_KEY_CHARS, KeyedCorpora
from drafter.memory import SharedMemory, load_keyed_corpora, restore
from drafter.planner import DraftPlanner
from drafter.segment_log import DirectorySegmentLog, LearnedSegment, RedisSegmentLog
from drafter.segments import SCHEMA_SEGMENT, CorpusLimits, parse_segments
from drafter.server import build_servicer, start_server
from drafter.state import RequestStates
from protos.segserve.v1 import drafter_pb2, drafter_pb2_grpc
from protos.segserve.v1.draft import DraftQuery
from protos.segserve.v1.stats import DrafterStats
from protos.segserve.v1.tree import CandidateTree
from tests.support.reflow_helpers import redis_server

# 1 = code fence (opens and closes); 10-19 prompt text. A JSON record {"name": <v>, "age": <v>}:
OPEN, NAME, COLON, COMMA, AGE, CLOSE = 40, 41, 42, 43, 44, 45
RAW = {"default": {"algorithm": "multi_branch_dfs", "max_nodes": 8, "max_depth": 8},
       "segment": [{"name": "code", "start": 1, "end": 1, "max_depth": 8}]}
PERSON = "schema:0123456789abcdef"
PET = "schema:fedcba9876543210"


def record(i: int) -> list[int]:
    """One output of the PERSON schema: fixed keys and punctuation, values that vary."""
    return [OPEN, NAME, COLON, 500 + i, COMMA, AGE, COLON, 600 + i, CLOSE]


def _setup(raw: dict = RAW, max_corpus_keys: int = 256):
    segments = parse_segments(raw)
    planner = DraftPlanner(segments, max_corpus_keys=max_corpus_keys)
    return planner, RequestStates(segments, planner.learn)


def _finish(states: RequestStates, request_id: str, output: list[int], tenant: str = "", key: str = PERSON,
            prompt: tuple[int, ...] = (10, 11, 12)) -> None:
    """A request that ends with `output`, its first query being its final one."""
    tokens = [*prompt, *output]
    assert states.finish(request_id, tokens, len(tokens), len(prompt), tenant=tenant, corpus_key=key)


def _learn_people(states: RequestStates, tenant: str = "", key: str = PERSON) -> None:
    for i in range(3):
        _finish(states, f"{tenant}-{key}-{i}", record(i), tenant, key)


def _draft(planner, states, output: list[int], tenant: str = "", key: str = PERSON,
           request_id: str = "new") -> tuple[CandidateTree, str]:
    """The tree for a new request whose output so far is `output` (prompt 10, 11, 13)."""
    tokens = [10, 11, 13, *output]
    state = states.update(request_id, tokens, len(tokens), 3, tenant=tenant, corpus_key=key)
    tree, segment = planner.draft(state, max_nodes=8)
    states.drop(request_id)
    return tree, segment


def _drafts(tree: CandidateTree, chain: list[int]) -> bool:
    """Whether the tree holds `chain` as a path from its root."""
    return tree.is_path([*chain, -1])


def test_a_keyed_request_drafts_its_schemas_fixed_continuation_and_others_do_not():
    planner, states = _setup()
    _learn_people(states)
    assert planner.corpora["default"].num_entries == 0  # the outputs went to the key's corpus alone
    tree, segment = _draft(planner, states, [OPEN])
    assert segment == SCHEMA_SEGMENT and _drafts(tree, [NAME, COLON])
    tree, _ = _draft(planner, states, [*record(7)[:4], COMMA, AGE])  # past a value never seen
    assert _drafts(tree, [COLON])
    for key in (PET, ""):
        tree, segment = _draft(planner, states, [OPEN], key=key)
        assert not _drafts(tree, [NAME]) and segment == (SCHEMA_SEGMENT if key else "default")


def test_the_tree_fails_without_learning_and_before_the_final_query():
    planner, states = _setup()
    tokens = [10, 11, 12, *record(0)]
    states.update("running", tokens, len(tokens), 3, corpus_key=PERSON)  # not ended: nothing learned yet
    assert planner.keyed.get("", PERSON) is None
    tree, _ = _draft(planner, states, [OPEN])
    assert not _drafts(tree, [NAME])
    assert states.finish("running", [], len(tokens), 3)  # the key was read with the first query
    assert _drafts(_draft(planner, states, [OPEN])[0], [NAME, COLON])


def test_a_keyed_output_is_one_segment_whatever_markers_it_holds():
    planner, states = _setup()
    fenced = [OPEN, NAME, COLON, 1, 30, 31, 32, 1, CLOSE]  # a code fence inside a string value
    for i in range(2):
        _finish(states, f"r{i}", fenced)
    assert planner.corpora["code"].num_entries == 0
    tree, segment = _draft(planner, states, fenced[:5])
    assert segment == SCHEMA_SEGMENT and _drafts(tree, [31, 32, 1, CLOSE])


def test_the_prompt_lookup_still_drafts_for_a_keyed_request():
    planner, states = _setup()
    prompt = [10, 70, 71, 72, 73, 74, 11]  # the output copies a value from the prompt
    tokens = [*prompt, OPEN, NAME, COLON, 70, 71]
    state = states.update("copy", tokens, len(tokens), len(prompt), corpus_key=PET)
    tree, segment = planner.draft(state, max_nodes=8)
    assert segment == SCHEMA_SEGMENT and _drafts(tree, [72, 73, 74])


def test_a_tenants_key_corpus_is_its_own_and_the_shared_one_reaches_every_tenant():
    planner, states = _setup()
    _learn_people(states, tenant="tenant-a")
    assert planner.keyed.get("", PERSON) is None and planner.keyed.get("tenant-a", PERSON) is not None
    assert _drafts(_draft(planner, states, [OPEN], tenant="tenant-a")[0], [NAME, COLON])
    assert not _drafts(_draft(planner, states, [OPEN], tenant="tenant-b")[0], [NAME])
    assert not _drafts(_draft(planner, states, [OPEN], tenant="")[0], [NAME])
    _learn_people(states, tenant="")  # the default tenant learns into the shared corpus of the key
    assert _drafts(_draft(planner, states, [OPEN], tenant="tenant-b")[0], [NAME, COLON])
    assert planner.keyed.get("tenant-b", PERSON) is None  # drafting made no corpus


def test_keys_past_the_bound_drop_the_least_recently_used_per_tenant():
    planner, states = _setup(max_corpus_keys=2)
    keys = ["schema:k1", "schema:k2", "schema:k3"]
    for key in keys[:2]:
        _finish(states, key, record(0), "tenant-a", key)
    _finish(states, "b", record(0), "tenant-b", "schema:k9")  # another tenant's keys are counted apart
    assert _drafts(_draft(planner, states, [OPEN], "tenant-a", "schema:k1")[0], [NAME])  # k1 used: k2 is oldest
    _finish(states, "k3", record(0), "tenant-a", "schema:k3")
    held = sorted(scope for scope, _ in planner.keyed.items())
    assert held == [("tenant-a", "schema:k1"), ("tenant-a", "schema:k3"), ("tenant-b", "schema:k9")]
    assert planner.keyed.num_dropped == 1
    assert not _drafts(_draft(planner, states, [OPEN], "tenant-a", "schema:k2")[0], [NAME])


def test_the_keyed_corpora_of_a_side_share_the_schema_kinds_byte_budget():
    one = KeyedCorpora(CorpusLimits())
    one.for_learning("t", "k").add([KEY_START, *record(0)])
    size = one.get("t", "k").num_bytes
    keyed = KeyedCorpora(CorpusLimits(max_bytes=int(size * 2.5)))
    for tenant, key in [("a", "k1"), ("b", "k2"), ("", "k3"), ("c", "k4")]:
        keyed.for_learning(tenant, key).add([KEY_START, *record(0)])
    assert len(keyed.lookup("a", "k1")) == 1  # drafted from: b's is now the least recently used
    keyed.for_learning("d", "k5")  # the tenants' three corpora pass 2.5 corpora's budget: b's goes
    # The shared corpus has a budget of its own.
    assert sorted(scope for scope, _ in keyed.items()) == [("", "k3"), ("a", "k1"), ("c", "k4"), ("d", "k5")]
    assert keyed.num_dropped == 1


def test_the_schema_section_configures_keyed_corpora_and_defaults_to_the_default_kind():
    inherited = parse_segments(RAW).schema
    assert (inherited.name, inherited.algorithm, inherited.max_nodes) == (SCHEMA_SEGMENT, "multi_branch_dfs", 8)
    own = parse_segments({**RAW, "schema": {"algorithm": "best_first", "corpus": {"max_bytes": 1 << 20}}}).schema
    assert (own.algorithm, own.max_depth, own.corpus.max_bytes) == ("best_first", 8, 1 << 20)
    raw_model = {"default": {"draft_model": {"kind": "model", "path": "x"}}}
    assert parse_segments(raw_model).schema.draft_model is None  # the default's draft model is not inherited
    for bad in [{"schema": {"start": 1, "end": 2}}, {"schema": {"draft_model": {"kind": "model", "path": "x"}}},
                {"segment": [{"name": SCHEMA_SEGMENT, "start": 1, "end": 2}]}]:
        with pytest.raises(ValueError):
            parse_segments(bad)
    with pytest.raises(ValueError, match="max_corpus_keys"):
        DrafterConfig(max_corpus_keys=0)


def test_a_key_past_its_length_bound_is_ignored():
    planner, states = _setup()
    long_key = "s" * (MAX_KEY_CHARS + 1)
    _finish(states, "long", record(0), key=long_key)
    assert len(planner.keyed) == 0
    assert _draft(planner, states, [OPEN], key=long_key)[1] == "default"


def test_the_corpus_key_round_trips_in_the_draft_query():
    pb = drafter_pb2.DraftQuery(request_id="r", new_token_ids=[1, 2], num_tokens=2, tenant="t", corpus_key=PERSON)
    wire = drafter_pb2.DraftQuery.FromString(pb.SerializeToString())
    assert wire.corpus_key == PERSON
    assert DraftQuery.from_pb(wire) == DraftQuery("r", [1, 2], 2, 0, 0, 0, False, "t", PERSON)
    assert DraftQuery.from_pb(drafter_pb2.DraftQuery(request_id="r")).corpus_key == ""


async def test_the_key_arrives_over_grpc_and_the_stats_count_the_schema_kind():
    servicer = build_servicer(DrafterConfig(max_requests=16), parse_segments(RAW))
    server, port = await start_server(servicer, "127.0.0.1", 0)

    def query(rid, tokens, key, is_final=False):
        return drafter_pb2.DraftQuery(request_id=rid, new_token_ids=tokens, num_tokens=len(tokens), num_prompt_tokens=3,
                                      max_nodes=8, is_final=is_final, corpus_key=key)

    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            stub = drafter_pb2_grpc.DrafterStub(channel)
            before = DrafterStats.from_pb(await stub.GetStats(drafter_pb2.DrafterStatsRequest()))
            assert [s.segment for s in before.segments] == ["code", "default"]  # as without keys
            finals = [query(f"r{i}", [10, 11, 12, *record(i)], PERSON, is_final=True) for i in range(3)]
            await stub.Draft(drafter_pb2.DraftRequest(queries=finals))
            assert servicer.planner.wait_learned(10)
            replies = (await stub.Draft(drafter_pb2.DraftRequest(queries=[
                query("a", [10, 11, 13, OPEN], PERSON), query("b", [10, 11, 13, OPEN], PET)]))).replies
            trees = {reply.request_id: CandidateTree.from_pb(reply.tree) for reply in replies}
            assert [reply.segment for reply in replies] == [SCHEMA_SEGMENT, SCHEMA_SEGMENT]
            assert _drafts(trees["a"], [NAME, COLON]) and not _drafts(trees["b"], [NAME])
            stats = DrafterStats.from_pb(await stub.GetStats(drafter_pb2.DrafterStatsRequest()))
            schema = next(s for s in stats.segments if s.segment == SCHEMA_SEGMENT)
            assert schema.num_requests == 2
            assert schema.num_corpus_entries == servicer.planner.keyed.get("", PERSON).num_entries > 0
    finally:
        await server.stop(grace=None)


def _memory(tmp_path, origin: str, snapshot_dir=None) -> SharedMemory:
    segments = parse_segments(RAW)
    corpora, cursor = restore(snapshot_dir, segments, "directory")
    planner = DraftPlanner(segments, corpora, keyed_corpora=load_keyed_corpora(segments.schema.corpus, snapshot_dir))
    return SharedMemory(planner, DirectorySegmentLog(tmp_path / "log", origin), snapshot_dir, origin, "directory",
                        cursor)


def _proposal(planner: DraftPlanner, tenant: str, key: str = PERSON) -> tuple[int, ...]:
    corpus = planner.keyed.get(tenant, key)
    found = corpus.propose([KEY_START, OPEN], 8, 1) if corpus is not None else []
    return found[0].token_ids if found else ()


WRITTEN = [LearnedSegment("w", SCHEMA_SEGMENT, (1, 2), "", PERSON), LearnedSegment("w", SCHEMA_SEGMENT, (3,), "t", PET),
           LearnedSegment("w", "code", (4,), "t"), LearnedSegment("w", "code", (5,))]
"""Records with a key (with and without a tenant) and without one."""


def test_the_redis_log_carries_the_key(tmp_path):
    with redis_server(tmp_path) as url:
        log = RedisSegmentLog(url, "test:keys")
        for segment in WRITTEN:
            log.append(segment)
        assert log.read(None, 10)[0] == WRITTEN
        log.close()


def test_the_shared_log_carries_the_key_and_reads_records_without_one(tmp_path):
    log = DirectorySegmentLog(tmp_path / "raw", "w")
    for segment in WRITTEN:
        log.append(segment)
    assert log.read(None, 10)[0] == WRITTEN
    a, b = _memory(tmp_path, "a"), _memory(tmp_path, "b")
    a.learn(SCHEMA_SEGMENT, record(0), "tenant-a", PERSON)
    assert b.poll() == 1
    assert _proposal(b.planner, "tenant-a")[:2] == (NAME, COLON)
    assert _proposal(b.planner, "") == () and b.planner.corpora["default"].num_entries == 0


def test_a_snapshot_keeps_the_keyed_corpora_and_forgets_dropped_ones(tmp_path):
    snapshots = tmp_path / "snap"
    a = _memory(tmp_path, "a", snapshots)
    a.learn(SCHEMA_SEGMENT, record(0), "", PERSON)
    a.learn(SCHEMA_SEGMENT, record(1), "tenant/odd", PET)
    a.snapshot()
    restarted = _memory(tmp_path / "elsewhere", "r", snapshots)
    assert _proposal(restarted.planner, "")[:2] == (NAME, COLON)
    assert _proposal(restarted.planner, "tenant/odd", PET)[:2] == (NAME, COLON)
    assert _proposal(restarted.planner, "tenant/odd") == ()
    a.planner.keyed._drop("tenant/odd", PET)  # as a bound would
    a.snapshot()
    assert sorted(load_keyed_corpora(CorpusLimits(), snapshots)) == [("", PERSON)]
