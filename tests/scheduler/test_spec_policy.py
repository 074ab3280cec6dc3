"""The speculation policy as pure logic: cost model, acceptance stats, and when speculation pays (the gate)."""

from __future__ import annotations

import random

import pytest

from scheduler.spec_policy import (
    AcceptanceStats,
    SegmentStats,
    SpecPolicy,
    StepCostModel,
    budget_options,
)
from scheduler.spec_gate import SpeculationGate

# Measured on the 2-core CPU with gemma-3-270m (NOTES.md): the output head dominates.
CPU_COSTS = {1: 0.050, 4: 0.131, 16: 0.148, 64: 0.294}
GPU_LIKE_COSTS = {1: 0.020, 4: 0.0201, 16: 0.0203, 64: 0.021}


def fitted(costs: dict[int, float]) -> StepCostModel:
    model = StepCostModel()
    for num_tokens, seconds in costs.items():
        model.observe(num_tokens, seconds)
    return model


def policy_with(rate: float, costs: dict[int, float], max_nodes: int = 16, depth: int = 16, **kwargs) -> SpecPolicy:
    """A policy whose "code" segment accepts each depth with the given rate."""
    policy = SpecPolicy(max_nodes, cost=fitted(costs), **kwargs)
    policy.acceptance.segments["code"] = SegmentStats(num_verified=100, max_num_nodes=max_nodes,
                                                      ema_rate_by_depth=[rate ** d for d in range(1, depth + 1)])
    return policy


def test_cost_model_interpolates_and_extrapolates_from_measurements():
    model = fitted(CPU_COSTS)
    assert model.estimate(4) == pytest.approx(0.131)
    assert model.estimate(10) == pytest.approx(0.131 + (0.148 - 0.131) * 6 / 12)
    assert model.estimate(128) == pytest.approx(0.294 + (0.294 - 0.148) / 48 * 64)
    one_point = fitted({10: 0.1})
    assert one_point.estimate(40) == pytest.approx(0.1)  # flat: bigger trees get tried, then measured
    assert one_point.estimate(5) == pytest.approx(0.05)  # proportional: plain steps look cheap, get measured
    model.observe(4, 0.231)  # an EMA, not the last value
    assert 0.131 < model.estimate(4) < 0.231


def test_segment_stats_rates_by_depth_and_expected_accepted():
    stats = SegmentStats()
    stats.record(tree_depth=3, num_nodes=4, num_accepted=2)
    stats.record(tree_depth=2, num_nodes=2, num_accepted=0)
    assert stats.num_offered_by_depth == [2, 2, 1] and stats.num_accepted_by_depth == [1, 1, 0]
    assert stats.acceptance_rate_by_depth == [0.5, 0.5, 0.0]
    assert (stats.num_verified, stats.num_draft_tokens, stats.num_accepted_tokens) == (2, 6, 2)
    # A mean with the prior (0.5, worth one observation) while observations are few: one miss is no verdict.
    assert stats.ema_rate_by_depth == pytest.approx([0.5, 0.5, 0.25])
    assert stats.expected_accepted(2) == pytest.approx(1.0) and stats.expected_accepted(4) == pytest.approx(1.25)
    assert stats.expected_accepted(8) == pytest.approx(1.25 + 0.25 * (1 - 0.5 ** 5))  # 8 > any tree tried
    assert SegmentStats().expected_accepted(1) == 0.5 and SegmentStats().expected_accepted(16) > 0.99
    acceptance = AcceptanceStats()
    acceptance.record("code", 2, 2, 2)
    assert acceptance.of("code").num_verified == 1 and acceptance.of("never-seen") is acceptance.total


def test_good_acceptance_on_one_sequence_speculates_and_poor_acceptance_does_not():
    assert policy_with(0.9, CPU_COSTS).choose({"code": 1}, 1, 255)["code"] >= 4
    assert policy_with(0.3, CPU_COSTS).choose({"code": 1}, 1, 255)["code"] == 0


def test_cheap_verification_allows_bigger_trees_than_a_cpu():
    cpu = policy_with(0.8, CPU_COSTS).choose({"code": 1}, 1, 255)["code"]
    gpu = policy_with(0.8, GPU_LIKE_COSTS).choose({"code": 1}, 1, 255)["code"]
    assert gpu >= cpu and gpu == 16


def test_a_large_batch_turns_speculation_off_that_a_single_stream_would_use():
    costs = {1: 0.05, 8: 0.14, 16: 0.15, 32: 0.2, 64: 0.4, 128: 0.8, 256: 1.6}
    assert policy_with(0.6, costs).choose({"code": 1}, 1, 255)["code"] > 0
    assert policy_with(0.6, costs).choose({"code": 64}, 64, 192)["code"] == 0


def test_segments_are_budgeted_separately_and_the_token_room_is_respected():
    policy = policy_with(0.9, GPU_LIKE_COSTS)
    policy.acceptance.segments["prose"] = SegmentStats(num_verified=100, max_num_nodes=16,
                                                       ema_rate_by_depth=[0.01] * 4)
    budgets = policy.choose({"code": 2, "prose": 2}, 4, 255)
    assert budgets["code"] > 0 and budgets["prose"] < budgets["code"]
    budgets = policy.choose({"code": 3}, 3, 13)
    assert 3 * budgets["code"] <= 13


def test_unfitted_policy_measures_plain_steps_first_and_a_fixed_policy_always_uses_the_max():
    assert SpecPolicy(8).choose({"code": 2}, 2, 100) == {"code": 0}
    assert SpecPolicy(8, is_adaptive=False).choose({"code": 2}, 2, 100) == {"code": 8}


def test_switched_off_segments_are_probed_every_interval():
    policy = policy_with(0.05, CPU_COSTS, probe_interval=5)
    choices = [policy.choose({"code": 1}, 1, 255)["code"] for _ in range(10)]
    assert choices == [0, 0, 0, 0, 4, 0, 0, 0, 0, 4]


def test_draft_call_latency_counts_against_speculation():
    policy = policy_with(0.7, GPU_LIKE_COSTS)
    assert policy.choose({"code": 1}, 1, 255)["code"] > 0
    policy.observe_draft_call(1.0)  # a drafter far slower than the worker
    assert policy.choose({"code": 1}, 1, 255)["code"] == 0


def test_budget_options():
    assert budget_options(16) == [0, 1, 2, 4, 8, 16]
    assert budget_options(6) == [0, 1, 2, 4, 6]
    assert budget_options(0) == [0]


def run_gate(gate: SpeculationGate, groups: dict[str, int], steps: int, goodput, start: int = 0) -> list[dict]:
    """Decisions of `steps` steps; each step generates 100 tokens at goodput(step, allowed) tokens/s.

    Returns per step {segment: (allowed, state)}: what the gate let the kind do, and the kind's state then.
    """
    history = []
    for step in range(start, start + steps):
        decision = gate.decide(groups)
        history.append({s: (decision.allowed[s], gate.last_segments[s][1]) for s in groups})
        gate.observe(decision, 100, 100 / goodput(step, decision.allowed))
    return history


def allowed_of(history: list[dict], segment: str) -> list[bool]:
    return [step[segment][0] for step in history]


def num_flips(history: list[dict], segment: str) -> int:
    return sum(a[segment][1] != b[segment][1] for a, b in zip(history, history[1:]))


def test_gate_tries_both_arms_then_keeps_the_faster_and_explores_the_other():
    gate = SpeculationGate(min_steps=2, explore_interval=8, max_explore_interval=8)  # no backing off
    history = run_gate(gate, {"code": 1}, 24, lambda step, allowed: 20 if allowed["code"] else 10)
    decisions = allowed_of(history, "code")
    assert decisions[:4] == [True, False, True, False]  # warm-up: drafting first, then each arm in turn
    assert decisions[4:] == [k % 8 != 4 for k in range(5, 25)]  # every 8th step after the warm-up explores
    assert gate.last_segments == {"code": (1, True)} and gate.last_decision == (1, True)


def explorations(history: list[dict], segment: str) -> list[int]:
    """The steps where the kind did other than its state."""
    return [i for i, step in enumerate(history) if step[segment][0] != step[segment][1]]


def test_explorations_that_confirm_the_state_come_ever_less_often_up_to_a_bound():
    gate = SpeculationGate(min_steps=2, explore_interval=8, max_explore_interval=32)
    history = run_gate(gate, {"code": 1}, 120, lambda step, allowed: 20 if allowed["code"] else 10)
    assert explorations(history[4:], "code") == [7, 23, 55, 87]  # after the warm-up: 8, 16, 32, 32 steps apart
    assert gate.states[("code", 1)].is_open and gate.states[("code", 1)].num_flips == 0


def test_requests_not_yet_classified_are_explored_at_the_base_pace_while_a_named_kind_backs_off():
    """The drafter names a request's segment only in answer to a step that drafts for it: the kind "" (not named
    yet) keeps exploring every 8 steps, so new requests still learn their segment soon."""
    gate = SpeculationGate(min_steps=2, explore_interval=8, max_explore_interval=64)
    history = run_gate(gate, {"": 1, "prose": 1}, 300, lambda step, allowed: 100 - 20 * sum(allowed.values()))
    assert not gate.states[("", 2)].is_open and not gate.states[("prose", 2)].is_open
    unnamed, prose = explorations(history[100:], ""), explorations(history[100:], "prose")
    assert all(8 <= b - a <= 9 for a, b in zip(unnamed, unnamed[1:])) and len(unnamed) >= 20
    assert gate.states[("prose", 2)].explore_interval == 64 and len(prose) <= 4


def test_an_exploration_that_contradicts_the_state_brings_the_next_one_at_the_base_interval():
    """Drafting paid, then stops paying (the plain arm now does 10% better): the first exploration after the
    change finds the plain arm better, so the next ones come every 8 steps again until the state closes."""
    gate = SpeculationGate(min_steps=2, explore_interval=8, max_explore_interval=64, min_dwell=0)
    run_gate(gate, {"code": 1}, 100, lambda step, allowed: 20 if allowed["code"] else 10)
    state = gate.states[("code", 1)]
    assert state.is_open and state.explore_interval == 64
    history = run_gate(gate, {"code": 1}, 200, lambda step, allowed: 10 if allowed["code"] else 11, 100)
    closed = next(i for i, step in enumerate(history) if not step["code"][1])
    explored = [i for i in explorations(history, "code") if i < closed]
    assert len(explored) >= 2 and all(b - a == 8 for a, b in zip(explored, explored[1:]))
    assert state.num_flips == 1 and not state.is_open
    assert closed <= explored[0] + 8 * len(explored)  # each exploration at the base pace, then the flip


def test_each_segment_kind_is_gated_apart_in_the_same_batch():
    """Code's drafts pay, prose's cost more than they give: code keeps drafting, prose stops, in the same steps."""
    gate = SpeculationGate()
    history = run_gate(gate, {"code": 4, "prose": 4}, 200,
                       lambda step, allowed: 100 * (1 + 0.3 * allowed["code"] - 0.2 * allowed["prose"]))
    assert gate.last_segments == {"code": (8, True), "prose": (8, False)}
    late = history[100:]
    assert sum(allowed_of(late, "code")) >= 100 - 100 // 16 - 1  # all but its exploring steps
    assert sum(allowed_of(late, "prose")) <= 100 // 16 + 1  # only its exploring steps
    # One factor at a time: at most one kind differs from its state in a step.
    assert all(sum(allowed != state for allowed, state in step.values()) <= 1 for step in history)
    assert gate.states[("code", 8)].advantage > 0.05 > -0.05 > gate.states[("prose", 8)].advantage


def test_the_gate_keeps_its_state_per_batch_size_too():
    gate = SpeculationGate(min_steps=2, explore_interval=8)
    at_sixteen = run_gate(gate, {"code": 16}, 40, lambda step, allowed: 100 if allowed["code"] else 130)
    assert sum(allowed_of(at_sixteen, "code")[8:]) <= 4  # only exploring steps draft
    at_one = run_gate(gate, {"code": 1}, 20, lambda step, allowed: 20 if allowed["code"] else 10)
    assert sum(allowed_of(at_one, "code")[4:]) >= 14  # the bucket of one sequence is measured apart
    assert gate.states[("code", 16)].is_open is False and gate.states[("code", 1)].is_open is True
    assert SpeculationGate.bucket(12) == SpeculationGate.bucket(16) == 16 != SpeculationGate.bucket(17)


def test_goodput_near_parity_does_not_flap_the_gate():
    """Drafting 1% better, each step +-10% noise: the hysteretic gate keeps its state over 200 steps; a gate
    without margin and dwell (otherwise the same) flips with the noise."""
    def goodput(rng):
        return lambda step, allowed: 100 * (1 + 0.01 * allowed["code"]) * rng.uniform(0.9, 1.1)

    num_twitches = 0
    for seed in range(4):
        steady = run_gate(SpeculationGate(), {"code": 2}, 200, goodput(random.Random(seed)))
        assert num_flips(steady[8:], "code") == 0  # after the first verdict (warm-up: 4 steps per arm)
        twitchy = run_gate(SpeculationGate(margin=0.0, min_dwell=0), {"code": 2}, 200, goodput(random.Random(seed)))
        num_twitches += num_flips(twitchy[8:], "code")
    assert num_twitches >= 10


def test_goodput_oscillating_inside_the_margin_does_not_flap_the_gate():
    gate = SpeculationGate()
    run_gate(gate, {"code": 2}, 16, lambda step, allowed: 100)  # warm-up and first verdict
    for period in (20, 40, 64, 100):
        history = run_gate(gate, {"code": 2}, 200,
                           lambda step, allowed: 100 * (1 + (0.03 if step // (period // 2) % 2 else -0.03)
                                                        * allowed["code"]))
        assert num_flips(history, "code") == 0 and gate.states[("code", 2)].num_flips == 0


def test_a_closed_kind_reopens_once_drafting_clearly_pays():
    gate = SpeculationGate()
    run_gate(gate, {"code": 2}, 100, lambda step, allowed: 100 * (1 - 0.2 * allowed["code"]))
    assert gate.last_segments["code"] == (2, False)
    history = run_gate(gate, {"code": 2}, 300, lambda step, allowed: 100 * (1 + 0.3 * allowed["code"]), 100)
    reopened = next(i for i, step in enumerate(history) if step["code"][1])
    assert reopened <= 200 and num_flips(history, "code") == 1  # reopens by exploring, and stays open
    assert allowed_of(history, "code")[reopened:].count(False) <= (300 - reopened) // 16 + 1  # explorations


def test_two_open_decisions_are_each_observed_for_their_own_step():
    """With async scheduling a step is decided before the one in flight is measured: each measurement goes
    to the arm of its own step's decision."""
    gate = SpeculationGate(min_steps=1)
    first = gate.decide({"code": 1})
    gate.observe(first, 10, 1.0)
    second, third = gate.decide({"code": 1}), gate.decide({"code": 1})  # both explore the plain arm
    assert first.allowed == {"code": True} and second.allowed == third.allowed == {"code": False}
    gate.observe(second, 50, 1.0)
    gate.observe(third, 40, 1.0)
    state = gate.states[("code", 1)]
    assert (state.arms[True].num_steps, state.arms[False].num_steps) == (1, 2)
    assert state.arms[True].tokens_per_s == 10 and state.is_decided and not state.is_open


def test_the_gate_tells_ahead_of_deciding_whether_it_keeps_every_kind_off():
    gate = SpeculationGate(min_steps=1, explore_interval=4, min_dwell=0)
    assert not gate.keeps_off({"prose": 1})  # never measured: open
    first = gate.decide({"prose": 1})
    gate.observe(first, 50, 1.0)
    second = gate.decide({"prose": 1})  # explores the plain arm, which measures faster: prose closes
    gate.observe(second, 100, 1.0)
    state = gate.states[("prose", 1)]
    assert state.is_decided and not state.is_open
    checks = []
    for _ in range(6):
        is_off = gate.keeps_off({"prose": 1})
        assert gate.keeps_off({"prose": 1}) == is_off  # asking changes nothing
        decision = gate.decide({"prose": 1})
        assert is_off == (not any(decision.allowed.values()) and decision.exploring is None)
        checks.append(is_off)
        gate.observe(decision, 100 if is_off else 50, 1.0)
    assert checks.count(False) == 1  # the exploration step, every fourth
    assert not gate.keeps_off({"prose": 1, "code": 1})  # code was never measured at bucket 2


def test_the_gate_rejects_a_setting_that_cannot_work():
    with pytest.raises(ValueError, match="explore_interval"):
        SpeculationGate(explore_interval=1)
    with pytest.raises(ValueError, match="max_explore_interval"):
        SpeculationGate(explore_interval=16, max_explore_interval=8)
    with pytest.raises(ValueError, match="margin"):
        SpeculationGate(margin=-0.1)


def test_a_policy_whose_model_says_speculate_stops_when_the_stack_measured_otherwise():
    policy = policy_with(0.9, GPU_LIKE_COSTS)
    assert policy.choose({"code": 1}, 1, 255)["code"] > 0
    policy.observe_cycle(policy.last_gate_decision, 3, 1.0)
    for _ in range(8):  # whole steps: speculating is 3x slower
        is_speculating = policy.choose({"code": 1}, 1, 255)["code"] > 0
        policy.observe_cycle(policy.last_gate_decision, 3 if is_speculating else 10, 1.0)
    assert [policy.choose({"code": 1}, 1, 255)["code"] for _ in range(15)].count(0) >= 14
    fixed = SpecPolicy(8, is_adaptive=False)
    assert fixed.choose({"code": 1}, 1, 100) == {"code": 8} and fixed.last_gate_decision is None
    fixed.observe_cycle(None, 1, 10.0)
    assert fixed.choose({"code": 1}, 1, 100) == {"code": 8}


def test_a_policy_drafts_for_the_kind_that_pays_and_not_for_the_one_the_gate_closed():
    """Both kinds look worth drafting to the cost model; the stack measured prose's drafting slower."""
    policy = policy_with(0.9, GPU_LIKE_COSTS)
    policy.acceptance.segments["prose"] = policy.acceptance.segments["code"]
    groups = {"code": 2, "prose": 2}
    assert all(policy.choose(groups, 4, 255).values())
    policy.observe_cycle(policy.last_gate_decision, 10, 1.0)
    budgets = []
    for _ in range(100):
        budget = policy.choose(groups, 4, 255)
        policy.observe_cycle(policy.last_gate_decision, round(100 * (1 + 0.3 * (budget["code"] > 0)
                                                                    - 0.2 * (budget["prose"] > 0))), 1.0)
        budgets.append(budget)
    assert sum(b["code"] == 0 for b in budgets[-32:]) <= 2 and sum(b["prose"] > 0 for b in budgets[-32:]) <= 2
    assert not any(b["code"] == 0 and b["prose"] > 0 for b in budgets[-32:])  # one kind explores at a time
    assert policy.gate.last_segments == {"code": (4, True), "prose": (4, False)}


def test_the_latest_budget_per_segment_and_the_gates_decision_are_kept_for_the_stats():
    policy = policy_with(0.9, GPU_LIKE_COSTS)
    policy.acceptance.segments["prose"] = SegmentStats(num_verified=100, max_num_nodes=16,
                                                       ema_rate_by_depth=[0.01] * 4)
    assert policy.last_budgets == {} and policy.gate.last_decision is None and policy.gate.last_segments == {}
    budgets = policy.choose({"code": 2, "prose": 2}, 4, 255)
    assert policy.last_budgets == budgets and budgets["code"] > 0 and budgets["prose"] == 0
    assert policy.gate.last_decision == (4, True)  # bucket of 4 sequences, first steps speculate
    assert policy.gate.last_segments == {"code": (4, True), "prose": (4, True)}  # the gate lets the model decide
    policy.choose({"code": 1}, 1, 255)
    assert policy.last_budgets["prose"] == 0 and policy.gate.last_decision[0] == 1  # prose kept from before
    assert policy.gate.last_segments == {"code": (1, True), "prose": (4, True)}


def test_a_budget_past_every_tree_tried_is_priced_at_the_decay_measured_between_the_deepest_depths():
    """Learned text accepted nearly whole at every depth tried (8): the depths past it are expected to go on so,
    not to halve at each, and a 16-node budget wins over 8 on the step costs of the 2-core CPU's default model
    (a 9-token step 115 ms against 95 ms for one token, so 17 tokens about 135 ms)."""
    learned = SegmentStats(num_verified=100, max_num_nodes=8, ema_rate_by_depth=[0.98 ** d for d in range(1, 9)])
    assert learned.expected_accepted(16) == pytest.approx(sum(0.98 ** d for d in range(1, 17)))
    policy = SpecPolicy(16, cost=fitted({1: 0.095, 9: 0.115}))
    policy.acceptance.segments["default"] = learned
    assert policy.choose({"default": 1}, 1, 255)["default"] == 16
    # A steep fall between the two deepest depths decays as steeply past them; one measured depth keeps the prior.
    steep = SegmentStats(num_verified=100, max_num_nodes=2, ema_rate_by_depth=[0.8, 0.2])
    assert steep.expected_accepted(4) == pytest.approx(0.8 + 0.2 + 0.05 + 0.0125)
    assert SegmentStats(num_verified=1, max_num_nodes=1, ema_rate_by_depth=[0.8]).expected_accepted(3) == \
        pytest.approx(0.8 + 0.4 + 0.2)


def test_a_draft_token_is_priced_at_what_it_adds_to_the_step_in_accepted_tokens():
    linear = {8: 0.1 + 8 * 0.005, 16: 0.1 + 16 * 0.005, 64: 0.1 + 64 * 0.005}  # 100 ms + 5 ms a token
    policy = policy_with(0.9, linear)
    budgets = {"code": 4}
    expected_tokens = 8 * (1 + policy.acceptance.of("code").expected_accepted(4))
    seconds = 0.1 + (8 + 32) * 0.005  # no draft call measured: no overhead
    assert policy.node_price(budgets, {"code": 8}, 8) == pytest.approx(expected_tokens / seconds * 0.005)
    # bound by the weights: a token more costs (nearly) nothing, so no node is too unlikely to verify
    assert policy_with(0.9, GPU_LIKE_COSTS).node_price({"code": 4}, {"code": 1}, 1) < 0.01
    assert policy.node_price({"code": 0}, {"code": 8}, 8) == 0.0
    assert SpecPolicy(16).node_price(budgets, {"code": 8}, 8) == 0.0  # nothing measured yet
    assert policy_with(0.9, linear, is_adaptive=False).node_price(budgets, {"code": 8}, 8) == 0.0  # drafts the max
    steep = policy_with(0.9, {8: 0.1, 16: 1.0, 64: 20.0})
    assert steep.node_price(budgets, {"code": 2}, 8) == pytest.approx(0.9), "capped: a sure node always pays"


def test_what_a_sequence_costs_is_told_apart_from_what_a_token_costs_and_a_draft_token_pays_only_its_own():
    """Measured on two cores: a plain step of 8 sequences takes about twice one of 1, while 8 sequences' draft
    tokens add a few ms each. A model of tokens alone would price a draft token at a sequence's cost."""
    model = StepCostModel()
    for _ in range(4):
        for num_seqs in range(1, 9):
            for drafts_each in (0, 1, 2, 4):
                num_tokens = num_seqs * (1 + drafts_each)
                model.observe(num_tokens, 0.1 + 0.018 * num_seqs + 0.004 * num_tokens, num_seqs)
    assert model.per_seq_s == pytest.approx(0.018, rel=1e-3)
    assert model.estimate(24, 8) - model.estimate(8, 8) == pytest.approx(16 * 0.004, rel=1e-3)
    assert model.estimate(3, 3) == pytest.approx(0.1 + 3 * 0.022, rel=1e-3)
    policy = SpecPolicy(16, cost=model)
    policy.acceptance.segments["code"] = SegmentStats(num_verified=100, max_num_nodes=16,
                                                      ema_rate_by_depth=[0.9 ** d for d in range(1, 17)])
    rate = policy._tokens_per_s({"code": 2}, {"code": 8}, 8)
    assert policy.node_price({"code": 2}, {"code": 8}, 8) == pytest.approx(rate * 0.004, rel=1e-2)
    # plain steps alone cannot tell a sequence from a token: every second is the tokens' (as before)
    plain = StepCostModel()
    for num_seqs in range(1, 9):
        plain.observe(num_seqs, 0.1 + 0.022 * num_seqs, num_seqs)
    assert plain.per_seq_s == pytest.approx(0.0, abs=1e-9)
    assert plain.estimate(6) == pytest.approx(0.1 + 0.022 * 6)


def test_a_draft_token_is_priced_at_the_tokens_per_second_the_decode_steps_delivered_once_measured():
    linear = {8: 0.1 + 8 * 0.005, 16: 0.1 + 16 * 0.005, 64: 0.1 + 64 * 0.005}
    policy = policy_with(0.9, linear)
    expected = policy.node_price({"code": 4}, {"code": 8}, 8)
    assert expected == pytest.approx(policy._tokens_per_s({"code": 4}, {"code": 8}, 8) * 0.005)
    decision = policy.gate.decide({"code": 8})
    for _ in range(30):
        policy.observe_cycle(decision, 12, 0.3)  # 40 tokens/s delivered, well below what the model expects
    assert policy.node_price({"code": 4}, {"code": 8}, 8) == pytest.approx(40 * 0.005)
    assert policy.node_price({"code": 4}, {"code": 8}, 8) < expected
    policy.observe_cycle(None, 100, 0.01)  # a step without decode sequences tells nothing
    assert policy.node_price({"code": 4}, {"code": 8}, 8) == pytest.approx(40 * 0.005)


def test_the_round_trip_that_drafting_adds_once_is_not_priced_into_each_draft_token():
    # a plain step of 8 tokens goes ahead (0.1 s); any drafting step is a round trip (+0.1 s), then 5 ms a token
    costs = {8: 0.1, 12: 0.2 + 12 * 0.005, 24: 0.2 + 24 * 0.005, 48: 0.2 + 48 * 0.005}
    policy = policy_with(0.9, costs)
    rate = policy._tokens_per_s({"code": 2}, {"code": 8}, 8)
    assert policy.node_price({"code": 2}, {"code": 8}, 8) == pytest.approx(rate * 0.005)
