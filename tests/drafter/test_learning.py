"""Learning off the Draft path: the background learner, eviction to 90% of a byte budget, history bounded in
bytes, and final updates (segments closing in a request's last step, or never drafted)."""

from __future__ import annotations

import random
import time

import grpc
import pytest

from drafter.config import DrafterConfig
from drafter.corpus import LookupCorpus
from drafter.history import ITEM_BYTES, HistorySource
from drafter.learner import Learner
from drafter.segments import CorpusLimits, parse_segments
from drafter.server import build_servicer, start_server
from drafter.state import RequestStates
from protos.segserve.v1 import drafter_pb2, drafter_pb2_grpc

LIMITS = {"max_depth": 24, "max_key": 12, "min_key": 2}
RAW = {"default": {"max_nodes": 6},
       "segment": [{"name": "code", "start": 1, "end": 1, "max_nodes": 8, "max_depth": 8, "corpus": LIMITS}]}


def _random_tokens(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(2, 262_144) for _ in range(n)]


def _query(rid, new, num_tokens, num_prompt=0, max_nodes=8, **fields):
    return drafter_pb2.DraftQuery(request_id=rid, new_token_ids=new, num_tokens=num_tokens,
                                  num_prompt_tokens=num_prompt, max_nodes=max_nodes, **fields)


async def test_a_draft_call_waits_for_at_most_one_slice_while_a_5000_token_segment_is_learned():
    """Learning is off the Draft path: the call that closes a 5,000-token segment returns with the segment still
    queued, the learner takes the corpora's lock only for the slice that swaps the built arrays in, and every Draft
    call beside it gets the lock after at most one slice. Slices are counted by the guard, not timed; the learner
    pauses 50 ms between slices here, so that Draft calls surely run beside it."""
    body = _random_tokens(random.Random(0), 5000)
    servicer = build_servicer(DrafterConfig(), parse_segments(RAW))
    learner = servicer.planner.learner
    learner.pause_s = 0.05
    server, port = await start_server(servicer, "127.0.0.1", 0)
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            draft = drafter_pb2_grpc.DrafterStub(channel).Draft
            probe = [10, 11, 12, 13, 10, 11]
            await draft(drafter_pb2.DraftRequest(queries=[_query("probe", probe, len(probe), len(probe))]))
            seq = [5, 1, *body]
            await draft(drafter_pb2.DraftRequest(queries=[_query("long", seq, len(seq), 1, max_nodes=0)]))
            await draft(drafter_pb2.DraftRequest(queries=[_query("long", [1], len(seq) + 1, max_nodes=0)]))
            pending_after_close = learner.num_pending  # learning it takes 0.1-0.3 s; this is read at once
            num_calls_beside = 0
            while learner.num_pending:
                probe.append(12)
                (reply,) = (await draft(drafter_pb2.DraftRequest(queries=[_query("probe", [12], len(probe))]))).replies
                num_calls_beside += 1
                assert not reply.needs_resync
            assert servicer.planner.wait_learned(10)
            (reply,) = (await draft(drafter_pb2.DraftRequest(queries=[_query("new", [7, 1, *body[:3]], 5, 1)]))).replies
    finally:
        await server.stop(None)
    assert pending_after_close == 1  # queued for the learner, not learned on the closing call's path
    assert num_calls_beside >= 3  # Draft calls did run while the segment was learned
    assert learner.guard.num_slices >= 2  # the learner's first slice and its swap, each under the lock
    assert learner.guard.most_slices_waited <= 1
    assert list(reply.tree.token_ids[:5]) == body[3:8]  # and then it is learned


def test_eviction_keeps_about_90_percent_of_the_byte_budget_never_a_cliff():
    max_bytes = 30_000  # about 1,500 learned tokens
    corpus = LookupCorpus(CorpusLimits(max_bytes=max_bytes, max_depth=16, max_key=8))
    rng = random.Random(1)
    frequent = [100, 101, 102, 103, 104, 105]
    for _ in range(30):
        corpus.add(frequent)
        num_evictions = corpus.num_evictions
        corpus.add(_random_tokens(rng, 100))
        assert corpus.num_bytes <= max_bytes
        if corpus.num_evictions > num_evictions:  # it evicted: down to ~90% of the budget, not far below
            assert 0.8 * max_bytes <= corpus.num_bytes <= 0.95 * max_bytes, corpus.num_bytes / max_bytes
    assert corpus.num_evictions >= 3
    assert corpus.propose([100, 101], max_len=4, max_candidates=1)[0].token_ids == (102, 103, 104, 105)


def test_max_entries_still_bounds_the_tokens_and_loads_evict_to_the_budget(tmp_path):
    corpus = LookupCorpus(CorpusLimits(max_entries=500, max_depth=8, max_key=4))
    for start in range(0, 2000, 50):
        corpus.add(list(range(start, start + 50)))
        assert corpus.num_entries <= 500
    assert corpus.num_entries >= 400
    path = tmp_path / "c.corpus.npz"
    corpus.save(path)
    fewer = LookupCorpus.load(path, CorpusLimits(max_entries=200, max_depth=8, max_key=4))
    assert fewer.num_entries == 150  # the newest three sequences: 90% of 200 tokens holds three of 50
    assert fewer.propose([1990, 1991], 3, 1)[0].token_ids == (1992, 1993, 1994)
    assert fewer.propose([1840, 1841], 3, 1) == []  # the fourth newest went
    max_bytes = corpus.num_bytes // 2
    smaller = LookupCorpus.load(path, CorpusLimits(max_bytes=max_bytes, max_depth=8, max_key=4))
    assert 0.8 * max_bytes <= smaller.num_bytes <= 0.9 * max_bytes


def test_the_background_learner_evicts_to_the_budget_too():
    max_bytes = 40_000  # about 2,000 learned tokens
    corpus = LookupCorpus(CorpusLimits(max_bytes=max_bytes, max_depth=16, max_key=8))
    learner = Learner()
    rng = random.Random(2)
    for _ in range(40):
        learner.submit(corpus, _random_tokens(rng, 100))
    assert learner.wait_idle(30)
    learner.close()
    assert learner.num_learned == 40 and corpus.num_evictions >= 1 and 0.8 * max_bytes <= corpus.num_bytes <= max_bytes


def test_a_reader_waits_for_at_most_one_slice_of_the_learner():
    corpus = LookupCorpus(CorpusLimits(**LIMITS))
    learner = Learner(pause_s=0.0)  # no pause between slices: the guard alone lets readers in
    rng = random.Random(3)
    for _ in range(200):
        learner.submit(corpus, _random_tokens(rng, 100))
    sizes = set()
    while learner.num_pending:
        with learner.guard.reading():
            sizes.add(corpus.num_entries)
        time.sleep(0.001)
    learner.close()
    assert len(sizes) >= 3  # the corpus grew between reads: the reads interleaved with the learning
    assert corpus.num_entries == 200 * 100
    assert learner.guard.num_slices >= 2 * 200  # each job's first slice and its swap, not all jobs under one lock
    assert learner.guard.most_slices_waited <= 1


def test_history_is_bounded_in_bytes_and_keeps_the_recent_tokens():
    history = HistorySource(max_key=4, min_key=2, max_bytes=1000 * ITEM_BYTES)
    rng = random.Random(4)
    tokens = [rng.randrange(1000, 100_000) for _ in range(20_000)]
    for start in range(0, len(tokens), 100):
        history.extend(tokens[start:start + 100])
        assert history.num_bytes <= history.max_bytes
    assert history.num_bytes >= history.max_bytes // 2
    recent, old = tokens[-300:-296], tokens[100:104]
    assert history.propose(recent[:2], 2, 1)[0].token_ids == tuple(recent[2:4])
    assert history.propose(old[:2], 2, 1) == []  # out of the search array: its bytes went
    assert len(history.tokens) == 20_000


@pytest.mark.parametrize("max_bytes", [0, ITEM_BYTES * 9, 3 << 30])
def test_a_history_budget_that_cannot_hold_a_key_or_passes_the_total_is_refused(max_bytes):
    with pytest.raises(ValueError, match="history_max_bytes"):
        DrafterConfig(history_max_key=8, history_max_bytes=max_bytes, history_total_bytes=2 << 30)
    DrafterConfig(history_max_key=8, history_max_bytes=ITEM_BYTES * 10)  # a key and a token after it fit


def test_request_states_drop_the_least_recent_past_the_total_history_bytes():
    per_request = 300 * ITEM_BYTES
    states = RequestStates(parse_segments(RAW), lambda name, tokens, tenant: None,
                           history_factory=lambda: HistorySource(max_bytes=per_request),
                           max_history_bytes=2 * per_request)
    for rid in "abc":  # 200 tokens: the search array grows to its bound, 300 slots (the key's padding included)
        states.update(rid, list(range(10, 210)), 200, 200)
        assert states.num_history_bytes <= 2 * per_request
    assert "a" not in states and "b" in states and "c" in states
    states.drop("b")
    states.drop("c")
    assert states.num_history_bytes == 0


def test_final_updates_learn_what_closes_and_nothing_twice():
    learned = []
    states = RequestStates(parse_segments(RAW), lambda name, tokens, tenant: learned.append((name, list(tokens))))
    block = [1, 30, 31, 1]
    # Known request: the last step's tokens close a segment; the state goes.
    states.update("a", [9, 1, 30], 3, 1)
    assert states.finish("a", [31, 1], 5, 0)
    assert learned == [("code", block)] and "a" not in states
    # Never seen (drafting was off): the whole sequence, learned past the prompt and the known tokens.
    assert states.finish("b", [9, *block, 7, *block], 10, 1, num_known_tokens=6)
    assert learned == [("code", block)] * 2  # the first block closed within the known tokens
    # A resync learns only what closed after the tokens a drafter already received.
    states.update("c", [9, *block, 7, *block], 10, 1, num_known_tokens=10)
    assert learned == [("code", block)] * 2
    # Without the state and without the whole sequence there is nothing to learn from.
    assert not states.finish("d", [31, 1], 9, 0)


async def test_final_updates_over_grpc_learn_and_release():
    servicer = build_servicer(DrafterConfig(), parse_segments(RAW))
    server, port = await start_server(servicer, "127.0.0.1", 0)
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            draft = drafter_pb2_grpc.DrafterStub(channel).Draft
            finals = [_query(f"r{i}", [9, 1, 40 + i, 41 + i, 42 + i, 1], 6, 1, max_nodes=0, is_final=True)
                      for i in range(3)]
            replies = (await draft(drafter_pb2.DraftRequest(queries=finals))).replies
            assert [r.request_id for r in replies] == ["r0", "r1", "r2"]
            assert not any(r.needs_resync or len(r.tree.token_ids) for r in replies)
            assert len(servicer.states) == 0
            assert servicer.planner.wait_learned(10)
            (reply,) = (await draft(drafter_pb2.DraftRequest(queries=[_query("new", [8, 1, 41], 3, 1)]))).replies
    finally:
        await server.stop(None)
    assert reply.segment == "code" and list(reply.tree.token_ids[:3]) == [42, 43, 1]



def test_generated_text_outside_every_segment_is_learned_into_the_default_kind_a_run_at_a_time():
    """A run of generated tokens outside every segment is learned when a marker opens a segment, and the last one
    when the request ends; prompt tokens and runs shorter than two tokens are not learned."""
    learned = []
    states = RequestStates(parse_segments(RAW), on_segment_closed=lambda *args, **kw: learned.append(args[:2]))
    states.update("a", [7, 8, 9], 3, 3)  # the prompt: never learned
    states.update("a", [20, 21, 22, 1, 30, 31, 1], 10, 3)  # a run, then a code block
    assert learned == [("default", [20, 21, 22]), ("code", [1, 30, 31, 1])]
    assert states.finish("a", [40, 41, 42], 13, 3)
    assert learned[-1] == ("default", [40, 41, 42])
    learned.clear()
    states.update("b", [7], 1, 1)
    assert states.finish("b", [50, 1, 60, 1], 5, 1)  # a one-token run before the block: nothing of it
    assert learned == [("code", [1, 60, 1])]


def test_segments_still_open_when_the_request_ends_are_learned_as_if_they_closed_there():
    """A code block cut by max_tokens is learned; so is a segment the prompt opened, from its marker on; one with
    fewer than two generated tokens is not."""
    learned = []
    states = RequestStates(parse_segments(RAW), on_segment_closed=lambda *args, **kw: learned.append(args[:2]))
    states.update("a", [7, 8], 2, 2)
    assert states.finish("a", [20, 1, 30, 31, 32], 7, 2)  # a run, then a block the request ends inside
    assert learned == [("code", [1, 30, 31, 32])]  # the one-token run before it teaches nothing
    learned.clear()
    assert states.finish("b", [7, 1, 40, 41, 42], 5, 2)  # never seen: the prompt opened the block
    assert learned == [("code", [1, 40, 41, 42])]
    learned.clear()
    assert states.finish("c", [7, 1, 40, 43], 4, 3)  # one generated token in the open block: nothing
    assert learned == []
