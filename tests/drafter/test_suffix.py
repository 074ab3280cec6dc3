"""The suffix backend (drafter/suffix.py): SuffixDecoding's trees behind the Draft interface.

What SuffixDecoding is meant to do, through the drafter's own request states and gRPC
service: a request drafts from its own prompt, and from the responses of requests that
ended before it (the global tree), never from an unfinished request's prompt; drafts
stay within the node budget and grow with the match length; the global tree keeps at
most max_cached_requests responses. Greedy and sampled losslessness through the whole
engine: tests/e2e/test_spec_lossless.py.
"""

from __future__ import annotations

import pytest

from drafter.config import DrafterConfig
from drafter.proposer import Proposer
from drafter.segments import parse_segments
from drafter.server import build_servicer, start_server
from drafter.state import RequestStates
from drafter.suffix import SEGMENT, SuffixPlanner
from protos.segserve.v1 import drafter_pb2, drafter_pb2_grpc
from protos.segserve.v1.stats import DrafterStats
from protos.segserve.v1.tree import CandidateTree
from segserve.cli import build_parser

RAW = {"default": {"max_nodes": 6},
       "segment": [{"name": "code", "start": 1, "end": 1, "max_nodes": 8, "max_depth": 8}]}
SEGMENTS = parse_segments(RAW)
RESPONSE = [40, 41, 42, 43, 44, 45, 46, 47, 48, 49]


def states() -> RequestStates:
    return RequestStates(SEGMENTS, on_segment_closed=lambda *args, **kwargs: None)


@pytest.mark.parametrize("backend", ["segserve", "suffix"])
def test_each_backend_serves_through_the_one_proposer_interface(backend):
    servicer = build_servicer(DrafterConfig(backend=backend), SEGMENTS)
    assert isinstance(servicer.planner, Proposer) and servicer.planner.backend == backend
    assert servicer.stats().backend == backend


def test_a_request_drafts_from_its_own_prompt_and_grows_the_draft_with_the_match():
    planner, requests = SuffixPlanner(SEGMENTS), states()
    prompt = [7, 8, *RESPONSE, 9, 9]
    short = requests.update("a", [*prompt, 40], len(prompt) + 1, len(prompt))
    tree, segment = planner.draft(short, 16)
    assert segment == "default" and tree.token_ids[:1] == (41,)
    longer = requests.update("a", [41, 42, 43], len(prompt) + 4, len(prompt))
    deeper, _ = planner.draft(longer, 16)
    # max_spec_factor 1: a 1-token match drafts 1 token deep, a 4-token match 4.
    assert (tree.max_depth, deeper.max_depth) == (1, 4) and deeper.token_ids[:4] == (44, 45, 46, 47)


def test_ended_requests_teach_later_ones_and_a_running_prompt_teaches_nobody():
    planner, requests = SuffixPlanner(SEGMENTS), states()
    prompt = [5, 6, 7]
    running = requests.update("running", [*prompt, *RESPONSE[:3]], 6, 3)
    planner.draft(running, 8)  # its response so far is in the global tree; its prompt is its own
    other = requests.update("other", [3, 5, 6, 7], 4, 4)
    assert planner.draft(other, 8)[0] == CandidateTree()  # another request's prompt is not drafted from
    final = requests.finish("running", RESPONSE[3:], 13, 3)
    planner.release("running", final)
    assert planner.num_learned_tokens[SEGMENT] == len(RESPONSE)
    later = requests.update("later", [3, 2, 40, 41, 42, 43, 44], 7, 7)
    tree, segment = planner.draft(later, 3)
    assert segment == "default" and tree.token_ids == (45, 46, 47)  # a 5-token match, within the budget of 3


def test_the_global_tree_keeps_the_latest_max_cached_requests_responses():
    """A running request's response takes a slot too: starting one pushes the oldest response out."""
    planner = SuffixPlanner(SEGMENTS, DrafterConfig(suffix_max_cached_requests=3))
    for i in range(3):
        planner.learn("default", [10 + i, 20 + i, 30 + i, 40 + i])
    requests = states()
    assert planner.draft(requests.update("q0", [10, 20], 2, 2), 4)[0] == CandidateTree()  # the first one left
    assert planner.draft(requests.update("q2", [12, 22], 2, 2), 4)[0].token_ids[:1] == (32,)
    entries, num_bytes = planner.corpus_sizes()
    assert entries[SEGMENT] == 3 and num_bytes[SEGMENT] > 0


def test_trees_are_labelled_with_the_requests_segment_kind():
    planner = SuffixPlanner(SEGMENTS)
    planner.learn("code", [1, 60, 61, 62, 63, 1])
    requests = states()
    inside = requests.update("c", [9, 1, 60, 61], 4, 2)
    tree, segment = planner.draft(inside, 8)
    assert segment == "code" and tree.token_ids[:2] == (62, 63)


def test_stale_requests_are_stopped_past_max_requests():
    planner, requests = SuffixPlanner(SEGMENTS, DrafterConfig(max_requests=2)), states()
    for name in "abc":
        planner.draft(requests.update(name, [1, 2, 3], 3, 3), 4)
    assert set(planner.cache.active_requests) == {"b", "c"}


async def test_the_suffix_backend_serves_draft_and_get_stats_over_grpc():
    import grpc

    servicer = build_servicer(DrafterConfig(port=0, backend="suffix"), SEGMENTS)
    server, port = await start_server(servicer, "127.0.0.1", 0)
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            stub = drafter_pb2_grpc.DrafterStub(channel)
            final = drafter_pb2.DraftQuery(request_id="done", new_token_ids=[5, 6, *RESPONSE], num_tokens=12,
                                           num_prompt_tokens=2, is_final=True)
            await stub.Draft(drafter_pb2.DraftRequest(queries=[final]))
            query = drafter_pb2.DraftQuery(request_id="next", new_token_ids=[8, 42, 43, 44, 45], num_tokens=5,
                                           num_prompt_tokens=1, max_nodes=4)
            (reply,) = (await stub.Draft(drafter_pb2.DraftRequest(queries=[query]))).replies
            stats = DrafterStats.from_pb(await stub.GetStats(drafter_pb2.DrafterStatsRequest()))
    finally:
        await server.stop(None)
    assert CandidateTree.from_pb(reply.tree).token_ids == (46, 47, 48, 49) and reply.segment == "default"
    (suffix,) = [s for s in stats.segments if s.segment == SEGMENT]
    assert (stats.backend, stats.num_draft_calls, suffix.num_learned_tokens) == ("suffix", 2, len(RESPONSE) + 4)
    assert suffix.num_corpus_entries == 2 and suffix.num_corpus_bytes > 0


def test_the_backend_is_chosen_by_a_flag_and_checked():
    args = build_parser().parse_args(["serve", "--drafter-backend", "suffix", "--suffix-min-token-prob", "0.2"])
    assert (args.drafter_backend, args.suffix_min_token_prob) == ("suffix", 0.2)
    with pytest.raises(ValueError, match="backend must be one of segserve, suffix"):
        DrafterConfig(backend="medusa")
    with pytest.raises(ValueError, match="min_token_prob"):
        DrafterConfig(suffix_min_token_prob=1.5)
