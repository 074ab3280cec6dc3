"""When speculation pays: acceptance stats, a measured step-cost model, and the node-budget policy.

In: per verified tree (segment, depth reached, nodes, accepted drafts) and per
worker step (tokens computed, seconds). Out: a node budget per segment kind
for the next step, chosen to maximise expected generated tokens per second,
and the acceptance metrics (per segment, per depth). Pure: no I/O, no clock.

Why: verifying N nodes on a CPU costs far more than one decode step (the
output head is memory-bound at one row and grows with rows), so a tree that
is accepted rarely, or a batch already large, makes decoding slower.

The model's cost estimate sees only the worker's step time; the drafter, the
scheduler's bookkeeping and the router's per-token work share the same cores,
and on the 2-core CI machine those errors decide the sign at 16 sequences
(the model predicted +7% from speculating, the stack measured -10%). So a
`SpeculationGate` (spec_gate.py) checks the model against what the stack
actually delivers: generated tokens per second of whole scheduler steps, with
and without drafting, per segment kind and batch size, with hysteresis.
"""

from __future__ import annotations

import bisect
import math
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass, field

import numpy as np

from scheduler.spec_gate import GateDecision, SpeculationGate

_EMA = 0.1  # weight of a new observation; ~10 observations of memory
_BUCKET_MEMORY = 32  # steps per bucket of token counts the cost model fits
_PER_SEQ_RIDGE = 1e-3  # how firmly the cost model holds per_seq at 0, per unit of its steps' weight
_MAX_SEQ_SHARE = 0.9  # the most of a bucket's mean time its sequences may take
_PRIOR_RATE = 0.5  # acceptance assumed before measuring, and its decay per unmeasured depth
_MAX_PRICE = 0.9  # the most a draft token is priced at (SpecPolicy.node_price)


def _ema(mean: float, value: float, is_first: bool) -> float:
    """A running latency: the first observation itself, then each new one weighted _EMA."""
    return value if is_first else mean + _EMA * (value - mean)


@dataclass
class SegmentStats:
    """Acceptance of one segment kind: cumulative counts for metrics, EMAs for the policy."""

    num_verified: int = 0
    """Sequence-steps that verified a non-empty tree."""
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    num_offered_by_depth: list[int] = field(default_factory=list)
    """[d - 1]: trees that reached depth d."""
    num_accepted_by_depth: list[int] = field(default_factory=list)
    """[d - 1]: of those, how many had a node at depth d accepted."""
    ema_rate_by_depth: list[float] = field(default_factory=list)
    """[d - 1]: recent acceptance at depth d, starting from a prior worth one observation."""
    ema_accepted_per_step: float = 0.0
    max_num_nodes: int = 0
    """Largest tree verified: bigger budgets have not been tried."""

    @property
    def acceptance_rate_by_depth(self) -> list[float]:
        return [a / o if o else 0.0 for a, o in zip(self.num_accepted_by_depth, self.num_offered_by_depth)]

    def record(self, tree_depth: int, num_nodes: int, num_accepted: int) -> None:
        self.num_verified += 1
        self.num_draft_tokens += num_nodes
        self.num_accepted_tokens += num_accepted
        for depth in range(1, tree_depth + 1):
            if depth > len(self.num_offered_by_depth):
                self.num_offered_by_depth.append(0)
                self.num_accepted_by_depth.append(0)
                self.ema_rate_by_depth.append(_PRIOR_RATE)
            is_accepted = depth <= num_accepted
            self.num_offered_by_depth[depth - 1] += 1
            self.num_accepted_by_depth[depth - 1] += is_accepted
            # The mean with the prior while observations are few, an EMA after.
            weight = max(_EMA, 1 / (self.num_offered_by_depth[depth - 1] + 1))
            self.ema_rate_by_depth[depth - 1] += weight * (is_accepted - self.ema_rate_by_depth[depth - 1])
        self.ema_accepted_per_step += max(_EMA, 1 / self.num_verified) * (num_accepted - self.ema_accepted_per_step)
        self.max_num_nodes = max(self.max_num_nodes, num_nodes)

    def expected_accepted(self, num_nodes: int) -> float:
        """Accepted drafts expected from a tree of num_nodes nodes: the sum of the depth rates.

        A tree of k nodes is at most k deep. Depths no tree reached so far
        count only when k exceeds every tree tried (a bigger budget may reach
        them), at a rate decaying geometrically from the deepest measured one,
        so an unexplored budget looks promising enough to be tried once. The
        decay per depth is the one measured between the two deepest depths
        (the chance that a draft accepted that deep is accepted one deeper),
        the prior's before two are measured: text the drafter has learned is
        accepted nearly whole however deep it drafts, and a fixed decay would
        keep its budget at the depth first tried.
        """
        rates = self.ema_rate_by_depth[:num_nodes]
        expected = sum(rates)
        if num_nodes > max(len(rates), self.max_num_nodes):
            rate = rates[-1] if rates else 1.0
            decay = min(1.0, rates[-1] / rates[-2]) if len(rates) >= 2 and rates[-2] > 0 else _PRIOR_RATE
            for _ in range(num_nodes - len(rates)):
                rate *= decay
                expected += rate
        return expected


class AcceptanceStats:
    """SegmentStats per segment kind, plus the global ones ("" = segment unknown)."""

    def __init__(self) -> None:
        self.total = SegmentStats()
        self.segments: dict[str, SegmentStats] = {}

    def record(self, segment: str, tree_depth: int, num_nodes: int, num_accepted: int) -> None:
        self.total.record(tree_depth, num_nodes, num_accepted)
        self.segments.setdefault(segment, SegmentStats()).record(tree_depth, num_nodes, num_accepted)

    def of(self, segment: str) -> SegmentStats:
        """The segment's stats, falling back to the global ones for a segment never verified."""
        stats = self.segments.get(segment)
        return stats if stats is not None and stats.num_verified else self.total


class StepCostModel:
    """Worker step time as a function of the tokens it computes and of the sequences they belong to, fitted from
    measured steps: seconds = g(tokens) + per_seq * sequences.

    g is piecewise linear between knots, one per bucket of token counts (exact up to 8 tokens, then powers of
    two) at the mean count measured in it; below the smallest knot it scales down with tokens (a pessimistic guess
    for speculation, so plain steps get measured), above the largest it extends the last slope (flat with one
    knot, so larger trees get tried). per_seq is what a sequence costs whatever its tokens (on a CPU its
    attention reads its own cache, and it is sampled on its own): on two cores, at 8 streams of the default
    model, a step took 78 ms + 17 ms a sequence + 5 ms a token, so a plain step of 8 sequences takes twice one of
    1. A model of tokens alone reads that first slope as every token's, and prices a draft token, which adds no
    sequence, several times over. The fit keeps each bucket's latest _BUCKET_MEMORY steps, a step _EMA less
    weighty per newer one in its bucket: per_seq is the sequences' coefficient of a straight line fitted to them
    all by least squares (held at 0 unless drafts tell sequences from tokens; never below 0, never most of a
    bucket's time), and g's knot in a bucket is its steps' mean time less their sequences' share.
    """

    def __init__(self) -> None:
        self._steps: dict[int, deque[tuple[float, float, float]]] = {}  # bucket -> (tokens, sequences, seconds)
        self._knots: list[tuple[float, float]] = []  # (tokens, g) ascending, after _fit()
        self._per_seq_s = 0.0
        self._is_stale = False

    @staticmethod
    def _bucket(num_tokens: int) -> int:
        return num_tokens if num_tokens <= 8 else 1 << (num_tokens - 1).bit_length()

    @property
    def is_fitted(self) -> bool:
        return bool(self._steps)

    def observe(self, num_tokens: int, seconds: float, num_seqs: int = 0) -> None:
        """A step of num_tokens tokens over num_seqs sequences (0: not counted) took seconds."""
        if num_tokens <= 0 or seconds <= 0:
            return
        steps = self._steps.setdefault(self._bucket(num_tokens), deque(maxlen=_BUCKET_MEMORY))
        steps.append((float(num_tokens), float(num_seqs), seconds))
        self._is_stale = True

    @property
    def per_seq_s(self) -> float:
        """Seconds a sequence adds to a step whatever its tokens; needs is_fitted."""
        if self._is_stale:
            self._fit()
        return self._per_seq_s

    def estimate(self, num_tokens: float, num_seqs: int = 0) -> float:
        """Seconds for a step of num_tokens over num_seqs sequences; needs is_fitted."""
        per_seq_s = self.per_seq_s  # refits the knots too, if steps came since
        return per_seq_s * num_seqs + self._g(num_tokens)

    def _g(self, num_tokens: float) -> float:
        knots = self._knots
        (x0, y0), (xn, yn) = knots[0], knots[-1]
        if num_tokens <= x0:
            return y0 * num_tokens / x0
        if num_tokens >= xn:
            if len(knots) == 1:
                return yn
            (xa, ya) = knots[-2]
            return yn + max(0.0, (yn - ya) / (xn - xa)) * (num_tokens - xn)
        index = bisect.bisect_left(knots, (num_tokens, -math.inf))
        (xa, ya), (xb, yb) = knots[index - 1], knots[index]
        return ya + (yb - ya) * (num_tokens - xa) / (xb - xa)

    def _fit(self) -> None:
        self._is_stale = False
        buckets = [np.array(self._steps[bucket]) for bucket in sorted(self._steps)]
        recency = [(1 - _EMA) ** np.arange(len(steps) - 1, -1, -1) for steps in buckets]
        steps, weights = np.concatenate(buckets), np.concatenate(recency)
        # per_seq: a straight line over every step (sequences, tokens, 1), held at 0 where nothing tells them apart
        root = np.sqrt(weights)
        features = np.vstack([np.column_stack([steps[:, 1], steps[:, 0], np.ones(len(steps))]) * root[:, None],
                              [math.sqrt(_PER_SEQ_RIDGE * weights.sum()), 0.0, 0.0]])
        targets = np.append(steps[:, 2] * root, 0.0)
        per_seq = max(float(np.linalg.lstsq(features, targets, rcond=None)[0][0]), 0.0)
        # g: each bucket's recent mean, its sequences' share taken out (never most of a bucket's time)
        means = [(w @ b[:, 0] / w.sum(), w @ b[:, 1] / w.sum(), w @ b[:, 2] / w.sum()) for b, w in zip(buckets, recency)]
        per_seq = min([per_seq, *(_MAX_SEQ_SHARE * y / n for _, n, y in means if n > 0)])
        self._per_seq_s = float(per_seq)
        self._knots = sorted((float(t), float(y - per_seq * n)) for t, n, y in means)


def budget_options(max_nodes: int) -> list[int]:
    """Node budgets the policy considers: 0, powers of two, and max_nodes."""
    options = {0, max_nodes}
    options.update(1 << i for i in range(max_nodes.bit_length()) if 1 << i <= max_nodes)
    return sorted(options)


@dataclass
class SpecPolicy:
    """Chooses each segment group's node budget per step (greedy ascent on expected tokens/s).

    Segments whose budget comes out 0 are switched off for the step; every
    probe_interval steps they get a small budget so their stats stay current.
    The gate switches a segment kind off, at the step's batch size, where its
    drafting has measured slower end to end; the ascent then budgets only the
    kinds it allows, and only those are probed.
    """

    max_nodes: int
    probe_interval: int = 64
    is_adaptive: bool = True
    acceptance: AcceptanceStats = field(default_factory=AcceptanceStats)
    cost: StepCostModel = field(default_factory=StepCostModel)
    gate: SpeculationGate = field(default_factory=SpeculationGate)
    draft_overhead_s: float = 0.0
    """EMA of the Draft call's latency: paid only by steps that speculate."""
    round_trip_extra_s: float = 0.0
    """EMA of a step's round trip less its compute time, over the steps not sent ahead (async scheduling)."""
    num_round_trips: int = 0
    cycle_tokens: float = 0.0
    """EMA of the tokens a whole decode step generated (observe_cycle), over cycle_seconds: its goodput."""
    cycle_seconds: float = 0.0
    num_steps: int = 0
    last_budgets: dict[str, int] = field(default_factory=dict)
    """Segment kind -> its budget at the latest step that had it (0 = drafting off for it), for the stats."""
    last_gate_decision: GateDecision | None = None
    """The gate's decision at the latest choose(), for observe_cycle() once that step is done (None: the gate
    was not asked: a fixed policy, or a cost model not fitted yet)."""

    def observe_step(self, num_tokens: int, compute_s: float, seconds: float | None, num_seqs: int = 0) -> None:
        """A worker step of `num_tokens` tokens over `num_seqs` sequences: its compute time at the worker and its
        round trip, or None for a step sent ahead, which waited at the worker for the step before it. The cost
        model prices steps as round trips (a drafting step always is one), so a step ahead counts as its compute
        time plus the rest of a round trip as measured on the steps that were not sent ahead."""
        if seconds is None:
            seconds = compute_s + self.round_trip_extra_s
        else:
            extra = max(seconds - compute_s, 0.0)
            self.round_trip_extra_s = _ema(self.round_trip_extra_s, extra, self.num_round_trips == 0)
            self.num_round_trips += 1
        self.cost.observe(num_tokens, seconds, num_seqs)

    def observe_cycle(self, decision: GateDecision | None, num_tokens: int, seconds: float) -> None:
        """A whole scheduler step (schedule, draft, worker, postprocess), the tokens it generated and the gate's
        decision for it (last_gate_decision after its choose()); the gate attributes the step to that decision.
        A step without decode sequences had no choose() and counts for nothing."""
        if decision is not None and seconds > 0:
            is_first = not self.cycle_seconds
            self.cycle_tokens = _ema(self.cycle_tokens, num_tokens, is_first)
            self.cycle_seconds = _ema(self.cycle_seconds, seconds, is_first)
        if self.is_adaptive and decision is not None:
            self.gate.observe(decision, num_tokens, seconds)

    def observe_draft_call(self, seconds: float) -> None:
        self.draft_overhead_s = _ema(self.draft_overhead_s, seconds, not self.draft_overhead_s)

    def choose(self, groups: Mapping[str, int], num_base_tokens: int, token_room: int) -> dict[str, int]:
        """Node budget per segment group.

        groups: segment -> number of decode sequences in it this step;
        num_base_tokens: tokens the step computes without drafts;
        token_room: draft tokens that still fit in the step's budget.
        """
        self.last_gate_decision = None
        budgets = self._choose(groups, num_base_tokens, token_room)
        self.last_budgets.update(budgets)
        return budgets

    def keeps_off(self, groups: Mapping[str, int]) -> bool:
        """Whether choose(groups, ...), called next, would draft for no kind because the gate keeps them all off
        (so it needs nothing measured in between). Changes nothing."""
        return self.is_adaptive and self.cost.is_fitted and self.gate.keeps_off(groups)

    def may_open_another_kind(self, groups: Mapping[str, int]) -> bool:
        """Whether a kind not in groups might draft at this batch size if one of its sequences turned out to be of
        it (SpeculationGate.opens_another_kind). A fixed policy drafts for every kind, so it asks the drafter
        anyway. Changes nothing."""
        return self.is_adaptive and self.cost.is_fitted and self.gate.opens_another_kind(groups)

    def _choose(self, groups: Mapping[str, int], num_base_tokens: int, token_room: int) -> dict[str, int]:
        self.num_steps += 1
        options = budget_options(self.max_nodes)
        if not self.is_adaptive:
            return {segment: self.max_nodes for segment in groups}
        budgets = {segment: 0 for segment in groups}
        if not self.cost.is_fitted:
            return budgets  # measure a plain step first
        self.last_gate_decision = self.gate.decide(groups)
        allowed = [segment for segment, is_allowed in self.last_gate_decision.allowed.items() if is_allowed]
        best = self._tokens_per_s(budgets, groups, num_base_tokens)
        while allowed:
            move = None
            for segment in allowed:
                # any higher: a cost step may hide behind the next
                for higher in (o for o in options if o > budgets[segment]):
                    trial = {**budgets, segment: higher}
                    if sum(groups[s] * b for s, b in trial.items()) > token_room:
                        break
                    rate = self._tokens_per_s(trial, groups, num_base_tokens)
                    if rate > best:
                        best, move = rate, trial
            if move is None:
                break
            budgets = move
        if self.num_steps % self.probe_interval == 0:  # refresh the stats of what is switched off
            probe = min(4, self.max_nodes)
            budgets.update((s, probe) for s in allowed if not budgets[s] and groups[s] * probe <= token_room)
        return budgets

    def node_price(self, budgets: Mapping[str, int], groups: Mapping[str, int], num_base_tokens: int) -> float:
        """What a draft token costs the step that choose() planned, in accepted tokens: tokens per second times the
        seconds one more draft token adds there. The tokens per second are what the recent decode steps delivered
        (observe_cycle), or before any is measured the step's expected: the model's sum of acceptance by depth,
        each measured on the trees that reached that depth, runs optimistic (at 8 streams on two cores it
        expected about twice what the steps delivered, and priced a draft token at 0.5 where it costs 0.2). A node
        less likely to be accepted than this
        slows the step down, whatever the budget: near 0 where a step is bound by reading the weights (one more
        token is free), higher in a batch that computes. The seconds are the cost model's slope across the
        planned drafts (from half of them to half again as many), within steps that draft: the step from none to
        some also pays a round trip (a drafting step is never sent ahead), once, whatever the tree's size, which
        is the budget's business (choose()), not a node's. At most _MAX_PRICE (a node nearly sure to be accepted
        always pays); 0 when nothing is drafted, nothing measured, or the policy is fixed (it drafts the maximum)."""
        num_draft_tokens = sum(groups[s] * b for s, b in budgets.items())
        if not num_draft_tokens or not self.cost.is_fitted or not self.is_adaptive:
            return 0.0
        half = max(1, num_draft_tokens // 2)
        low, high = num_base_tokens + half, num_base_tokens + num_draft_tokens + half
        slope = (self.cost.estimate(high) - self.cost.estimate(low)) / (high - low)  # the sequences' cost cancels
        if self.cycle_seconds:
            tokens_per_s = self.cycle_tokens / self.cycle_seconds
        else:
            tokens_per_s = self._tokens_per_s(budgets, groups, num_base_tokens)
        return min(max(tokens_per_s * slope, 0.0), _MAX_PRICE)

    def _tokens_per_s(self, budgets: Mapping[str, int], groups: Mapping[str, int], num_base_tokens: int) -> float:
        tokens = sum(groups[s] * (1.0 + self.acceptance.of(s).expected_accepted(b)) if b else groups[s]
                     for s, b in budgets.items())
        num_draft_tokens = sum(groups[s] * b for s, b in budgets.items())
        # the step's decode sequences (a prefill's sequence is left out: the same for every budget compared)
        seconds = self.cost.estimate(num_base_tokens + num_draft_tokens, sum(groups.values()))
        if num_draft_tokens:
            seconds += self.draft_overhead_s
        return tokens / seconds if seconds > 0 else 0.0
