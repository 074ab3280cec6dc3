"""Request states (resync, eviction), online learning and the planner's source choice."""

from __future__ import annotations

from drafter.planner import DraftPlanner
from drafter.segments import parse_segments
from drafter.state import RequestStates
from drafter.types import Continuation
from protos.segserve.v1.tree import CandidateTree

# 1 = code fence (opens and closes), 3 / 4 = turn markers; >= 10 text.
RAW = {
    "default": {"algorithm": "multi_branch_dfs", "max_nodes": 8, "max_depth": 8},
    "segment": [
        {"name": "code", "start": 1, "end": 1, "algorithm": "multi_branch_dfs", "max_nodes": 8, "max_depth": 8},
        {"name": "turn", "start": 3, "end": 4, "draft_model": {"kind": "model", "path": "x", "mode": "replace"}},
    ],
}
CODE_BLOCK = [1, 20, 21, 22, 23, 24, 25, 26, 27, 28, 29, 1]


def _setup(max_requests: int = 8):
    segments = parse_segments(RAW)
    planner = DraftPlanner(segments)
    learned: list[tuple[str, list[int]]] = []

    def sink(name, tokens, tenant):
        learned.append((name, list(tokens)))
        planner.learn(name, tokens, tenant)

    return planner, RequestStates(segments, sink, max_requests=max_requests), learned


def _accepted_per_step(planner, states, request_id, prompt, output) -> float:
    """Decode `output` with speculation: each step accepts the longest tree path that matches it, plus one."""
    state = states.update(request_id, prompt, len(prompt), len(prompt))
    done, steps = 0, 0
    while done < len(output):
        tree, _ = planner.draft(state, max_nodes=8)
        accepted = _longest_matching_path(tree, output[done:])
        new = output[done : done + accepted + 1]
        state = states.update(request_id, new, len(state.tokens) + len(new), 0)
        done += len(new)
        steps += 1
    return len(output) / steps


def _longest_matching_path(tree: CandidateTree, target: list[int]) -> int:
    depth_ok = {-1: 0}
    best = 0
    for i, (token_id, parent) in enumerate(zip(tree.token_ids, tree.parents)):
        d = depth_ok.get(parent)
        if d is not None and d < len(target) and target[d] == token_id:
            depth_ok[i] = d + 1
            best = max(best, d + 1)
    return best


def test_online_learning_speeds_up_the_next_request_of_the_same_segment():
    planner, states, learned = _setup()
    first = _accepted_per_step(planner, states, "a", [10, 11, 12], CODE_BLOCK + [13])
    assert learned == [("code", CODE_BLOCK)]
    second = _accepted_per_step(planner, states, "b", [14, 15, 16], CODE_BLOCK + [17])
    assert first < 1.5 and second > 3.0, (first, second)


def test_prompt_segments_are_not_learned():
    _, states, learned = _setup()
    prompt = [10, *CODE_BLOCK, 11]
    states.update("a", prompt, len(prompt), len(prompt))
    states.update("a", [1, 30, 1], len(prompt) + 3, 0)  # generated: learned
    assert learned == [("code", [1, 30, 1])]


def test_resync_rules():
    _, states, learned = _setup()
    assert states.update("a", [10, 11], 3, 2) is None  # new request without its whole sequence
    assert states.update("a", [10, 11], 2, 2).tokens == [10, 11]
    assert states.update("a", [12], 3, 0).tokens == [10, 11, 12]
    assert states.update("a", [13], 9, 0) is None  # count mismatch: state dropped
    assert "a" not in states
    state = states.update("a", [10, 11, 1, 12, 1], 5, 2, num_known_tokens=5)  # the whole sequence again
    assert state.tokens == [10, 11, 1, 12, 1] and state.segment == "default"
    assert learned == []  # a resync learns nothing a drafter already received
    assert states.update("a", [10, 11, 12, 13], 4, 2).tokens == [10, 11, 12, 13]  # a full resend replaces


def test_request_states_are_bounded_and_drop_finished():
    _, states, _ = _setup(max_requests=2)
    for rid in "abc":
        states.update(rid, [10], 1, 1)
    assert len(states) == 2 and "a" not in states
    states.update("b", [11], 2, 0)  # touching b makes c the oldest
    states.update("d", [10], 1, 1)
    assert "b" in states and "c" not in states
    states.drop("b")
    states.drop("unknown")
    assert "b" not in states and len(states) == 1


class _FixedSource:
    def __init__(self, tokens):
        self.tokens = tuple(tokens)

    def propose(self, context, max_len, max_candidates):
        return [Continuation(self.tokens[:max_len], 0.9)]


class _CachingSource(_FixedSource):
    """Stands for a draft model with per-request KV caches."""

    def __init__(self, tokens):
        super().__init__(tokens)
        self.calls: list[str] = []
        self.released: list[str] = []

    def propose_for(self, request_id, context, max_len, max_candidates):
        self.calls.append(request_id)
        return self.propose(context, max_len, max_candidates)

    def release(self, request_id):
        self.released.append(request_id)


def test_draft_model_replace_and_combine():
    planner, states, _ = _setup()
    planner.draft_models["turn"] = caching = _CachingSource([50, 51])
    planner.draft_models["code"] = _FixedSource([60])  # code has no draft_model spec: combined
    state = states.update("a", [10, 20, 21, 22, 3, 20, 21], 7, 7)
    tree, segment = planner.draft(state, max_nodes=8)
    assert segment == "turn"
    assert tree.token_ids == (50, 51)  # replace: history's (20, 21) -> 22 is ignored
    assert caching.calls == ["a"]  # the request-aware call, so its cache is reused
    state = states.update("a", [4, 1, 20, 21], 11, 0)
    tree, segment = planner.draft(state, max_nodes=8)
    assert segment == "code"
    assert set(tree.token_ids) >= {60, 22}
    planner.release("a")
    assert caching.released == ["a"]


def test_budget_is_the_smaller_of_query_and_segment():
    planner, states, _ = _setup()
    tokens = [10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 10, 11]
    state = states.update("a", tokens, len(tokens), len(tokens))
    assert len(planner.draft(state, max_nodes=3)[0]) == 3
    assert len(planner.draft(state, max_nodes=100)[0]) == 8
    assert len(planner.draft(state, max_nodes=0)[0]) == 0
