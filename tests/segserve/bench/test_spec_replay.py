"""`segserve bench spec-replay`: a mixed run's recorded traffic through drafters in-process.

Greedy verification is simulated against the recorded outputs: a tree's accepted drafts are its longest root path
along the output, and the target adds one token a step, so every measured output is generated exactly once
whatever the drafter proposed.
"""

from __future__ import annotations

import json

import pytest

from drafter.config import DrafterConfig
from drafter.segments import parse_segments
from drafter.server import build_servicer
from protos.segserve.v1.tree import CandidateTree
from segserve.bench import spec_replay
from segserve.cli import build_parser

SEGMENTS = parse_segments({"default": {"algorithm": "best_first", "max_nodes": 8, "max_depth": 8,
                                       "spec_factor": 1.0}})
OUTPUT = [11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22]


def _servicer():
    return build_servicer(DrafterConfig(max_requests=16), SEGMENTS)


def _requests(num_warmup: int, num_measured: int) -> list:
    prompt = [1, 2, 3, 4]
    return [spec_replay._Request(f"r{i}", "agent", "t", prompt, list(OUTPUT), is_measured=i >= num_warmup)
            for i in range(num_warmup + num_measured)]  # fmt: skip


def test_accepted_drafts_are_the_longest_root_path_along_the_output():
    tree = CandidateTree((5, 6, 7, 8, 9), (-1, 0, 1, -1, 3))  # 5-6-7 and 8-9
    assert spec_replay.accepted_length(tree, [5, 6, 7, 1]) == 3
    assert spec_replay.accepted_length(tree, [8, 9]) == 2
    assert spec_replay.accepted_length(tree, [5, 9]) == 1
    assert spec_replay.accepted_length(tree, [4]) == 0
    assert spec_replay.accepted_length(CandidateTree(), [5]) == 0


def test_a_learned_output_is_drafted_and_every_measured_token_is_generated_once():
    cold = spec_replay.replay(_servicer(), _requests(0, 1), budget=8, concurrency=1)
    warm = spec_replay.replay(_servicer(), _requests(1, 2), budget=8, concurrency=1)
    for run, num_measured in ((cold, 1), (warm, 2)):
        assert run["total"]["num_tokens"] == num_measured * len(OUTPUT)
        assert run["kinds"]["agent"]["num_tokens"] == num_measured * len(OUTPUT)
    assert cold["total"]["num_accepted"] == 0 and cold["total"]["tokens_per_step"] == 1.0  # nothing to look up
    assert warm["total"]["tokens_per_step"] > 2, "the warm-up's output is learned and drafted for the next ones"
    assert warm["total"]["num_accepted"] == warm["total"]["num_tokens"] - warm["total"]["num_steps"]
    assert warm["cpu_ms_per_query"] > 0


def test_the_schedulers_price_leaves_out_unlikely_nodes():
    # Two tenants' outputs differ after a shared start: the corpus's branches split its weight.
    other = spec_replay._Request("o", "agent", "t", [1, 2, 3, 4], [11, 12, 13, 99, 98, 97, 96, 95, 94], False)
    requests = [other, *_requests(1, 1)]
    free = spec_replay.replay(_servicer(), requests, budget=8, concurrency=1)
    priced = spec_replay.replay(_servicer(), requests, budget=8, concurrency=1, node_price=0.9)
    assert priced["total"]["num_draft_tokens"] < free["total"]["num_draft_tokens"]
    assert priced["total"]["num_tokens"] == free["total"]["num_tokens"] == len(OUTPUT)


def test_the_requests_come_from_a_mixed_record_in_the_order_they_were_sent(tmp_path):
    class Tokenizer:
        def encode(self, text, add_special_tokens=False):
            return [ord(c) for c in text]

    (tmp_path / "round-1" / "base").mkdir(parents=True)
    (tmp_path / "spec.json").write_text(json.dumps({"workloads": [
        {"kind": "agent", "prompts": ["p0", "p1"], "tenant": ""}, {"kind": "json", "prompts": ["q0", "q1"],
                                                                   "tenant": "team"}]}))
    mixed = {"warmup": [{"kind": "agent", "index": 0, "text": "a"}, {"kind": "json", "index": 0, "text": "b"}],
             "requests": [{"kind": "json", "index": 1, "text": "cd"}]}
    (tmp_path / "round-1" / "base" / "spec.json").write_text(json.dumps(
        {"model": "m", "systems": {"segserve_off": {"workloads": {"mixed": [mixed]}}}}))
    requests = spec_replay.load_requests(tmp_path, "segserve_off", Tokenizer())
    assert [(r.kind, r.tenant, r.prompt, r.output, r.is_measured) for r in requests] == [
        ("agent", "agent", [112, 48], [97], False), ("json", "team", [113, 48], [98], False),
        ("json", "team", [113, 49], [99, 100], True)]
    with pytest.raises(KeyError, match="segserve_spec"):
        spec_replay.load_requests(tmp_path, "segserve_spec", Tokenizer())
    args = build_parser().parse_args(["bench", "spec-replay", str(tmp_path), "--budgets", "4,8",
                                      "--node-prices", "0,0.5", "--backends", "segserve,suffix:0.3", "--kinds", "json"])
    assert (args.budgets, args.node_prices, args.backends) == ([4, 8], [0.0, 0.5], ["segserve", "suffix:0.3"])
    assert args.kinds == ["json"]
