"""The speculation policy as pure logic: cost model, acceptance stats, and when speculation pays."""

from __future__ import annotations

import pytest

from scheduler.spec_policy import (
    AcceptanceStats,
    SegmentStats,
    SpecPolicy,
    SpeculationGate,
    StepCostModel,
    budget_options,
)

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


def run_gate(gate: SpeculationGate, num_sequences: int, steps: int, spec_tokens_per_s: float,
             plain_tokens_per_s: float) -> list[bool]:
    """Decisions of `steps` steps, each observed at the arm's goodput (one-second steps)."""
    decisions = []
    for _ in range(steps):
        is_speculating = gate.should_speculate(num_sequences)
        rate = spec_tokens_per_s if is_speculating else plain_tokens_per_s
        gate.observe(num_sequences, is_speculating, round(rate), 1.0)
        decisions.append(is_speculating)
    return decisions


def test_gate_tries_both_arms_then_keeps_the_faster_and_explores_the_other():
    gate = SpeculationGate(min_steps=2, explore_interval=8)
    decisions = run_gate(gate, 1, 24, spec_tokens_per_s=20, plain_tokens_per_s=10)
    assert decisions[:4] == [True, False, True, False]
    assert decisions[4:] == [i % 8 != 0 for i in range(5, 25)]  # decision k (1-based) explores when k % 8 == 0


def test_gate_switches_speculation_off_where_it_measures_slower_per_batch_size():
    gate = SpeculationGate(min_steps=2, explore_interval=8)
    at_sixteen = run_gate(gate, 16, 40, spec_tokens_per_s=100, plain_tokens_per_s=130)
    assert sum(at_sixteen[8:]) == 4  # only the exploring steps speculate: 16, 24, 32, 40
    at_one = run_gate(gate, 1, 20, spec_tokens_per_s=20, plain_tokens_per_s=10)
    assert sum(at_one[4:]) == 14  # the bucket of one sequence is measured apart
    assert SpeculationGate.bucket(12) == SpeculationGate.bucket(16) == 16 != SpeculationGate.bucket(17)


def test_gate_follows_a_change_of_workload():
    gate = SpeculationGate(min_steps=2, explore_interval=4)
    run_gate(gate, 4, 40, spec_tokens_per_s=10, plain_tokens_per_s=30)
    later = run_gate(gate, 4, 80, spec_tokens_per_s=60, plain_tokens_per_s=30)
    assert all(later[-20:][i] for i in range(20) if (i + 101) % 4 != 0)


def test_a_policy_whose_model_says_speculate_stops_when_the_stack_measured_otherwise():
    policy = policy_with(0.9, GPU_LIKE_COSTS)
    assert policy.choose({"code": 1}, 1, 255)["code"] > 0
    for is_speculating, tokens in [(True, 3), (False, 10)] * 4:  # whole steps: speculating is 3x slower
        policy.observe_cycle(1, is_speculating, tokens, 1.0)
    assert [policy.choose({"code": 1}, 1, 255)["code"] for _ in range(15)].count(0) == 14
    fixed = SpecPolicy(8, is_adaptive=False)
    fixed.observe_cycle(1, True, 1, 10.0)
    assert fixed.choose({"code": 1}, 1, 100) == {"code": 8}


def test_the_latest_budget_per_segment_and_the_gates_decision_are_kept_for_the_stats():
    policy = policy_with(0.9, GPU_LIKE_COSTS)
    policy.acceptance.segments["prose"] = SegmentStats(num_verified=100, max_num_nodes=16,
                                                       ema_rate_by_depth=[0.01] * 4)
    assert policy.last_budgets == {} and policy.gate.last_decision is None
    budgets = policy.choose({"code": 2, "prose": 2}, 4, 255)
    assert policy.last_budgets == budgets and budgets["code"] > 0 and budgets["prose"] == 0
    assert policy.gate.last_decision == (4, True)  # bucket of 4 sequences, first steps speculate
    policy.choose({"code": 1}, 1, 255)
    assert policy.last_budgets["prose"] == 0 and policy.gate.last_decision[0] == 1  # prose kept from before
    for is_speculating, tokens in [(True, 3), (False, 10)] * 4:  # the stack measured speculation 3x slower
        policy.observe_cycle(1, is_speculating, tokens, 1.0)
    assert policy.choose({"code": 1}, 1, 255) == {"code": 0}
    assert policy.last_budgets["code"] == 0 and policy.gate.last_decision == (1, False)
