"""Whether drafting pays, per segment kind: the speculation gate, from whole-step goodput, with hysteresis.

In: per scheduler step, the decode sequences per segment kind (`decide`), then,
with the decision it returned, the tokens the step generated and its seconds end
to end (`observe`). Out: per segment kind, whether the policy may draft for it
this step, and each kind's state for the stats. Pure: no I/O, no clock.

A decision is handed back with its step's measurement rather than remembered:
with async scheduling the step after one is decided before that one's result
is back, so two decisions can be open at once.

Why: the policy's cost model sees only the worker's step time; the drafter,
the scheduler's bookkeeping and the router's per-token work share the same
cores, and on the 2-core CI machine those errors decide the sign at 16
sequences (the model predicted +7% from speculating, the stack measured
-10%). Whether drafting pays also differs between segment kinds: code whose
drafts are accepted gains where prose in the same batch loses.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

_EMA = 0.1  # weight of a new observation; ~10 observations of memory


@dataclass
class _Arm:
    """EMAs of one arm's generated tokens and seconds per scheduler step."""

    num_steps: int = 0
    ema_tokens: float = 0.0
    ema_seconds: float = 0.0

    def observe(self, num_tokens: int, seconds: float) -> None:
        self.num_steps += 1
        weight = max(_EMA, 1 / self.num_steps)
        self.ema_tokens += weight * (num_tokens - self.ema_tokens)
        self.ema_seconds += weight * (seconds - self.ema_seconds)

    @property
    def tokens_per_s(self) -> float:
        return self.ema_tokens / self.ema_seconds if self.ema_seconds > 0 else 0.0


@dataclass
class GateState:
    """The gate for one segment kind at one batch-size bucket."""

    explore_interval: int
    """Steps of the state between two explorations of the other arm, now (SpeculationGate: backing off)."""
    is_open: bool = True
    """Drafting allowed (outside exploration); open until measured, so speculation is tried first."""
    is_decided: bool = False
    """Both arms have been measured min_steps times and the first verdict is in."""
    arms: dict[bool, _Arm] = field(default_factory=lambda: {True: _Arm(), False: _Arm()})
    """True: steps where this kind was allowed to draft; False: steps where it was not."""
    num_steps_since_flip: int = 0
    num_steps_since_explore: int = 0
    num_flips: int = 0
    """State changes after the first verdict."""

    @property
    def advantage(self) -> float | None:
        """Goodput with drafting over goodput without, minus 1; None until both arms have a measurement."""
        on, off = self.arms[True], self.arms[False]
        if not on.num_steps or not off.num_steps or off.tokens_per_s <= 0:
            return None
        return on.tokens_per_s / off.tokens_per_s - 1


@dataclass(frozen=True)
class GateDecision:
    """What the gate let one step do; observe() takes it back with that step's measurement."""

    bucket: int
    allowed: dict[str, bool]
    """Segment kind -> whether the policy may draft for it in the step."""
    exploring: str | None
    """The one segment kind whose decision differs from its state this step (None: all follow their states)."""


@dataclass
class SpeculationGate:
    """Lets a segment kind draft at a batch size only while that measurably delivers more tokens per second.

    State per (segment kind, batch-size bucket), the bucket a power of two of
    the step's decode sequences (all kinds together: the batch sets the cost).

    Estimator. The quantity is the goodput of whole scheduler steps (tokens
    generated / seconds end to end), and a step counts as
    evidence about kind s only when s is the one kind whose decision may
    differ from the states: a step where every kind follows its state counts
    for each present kind's state arm; a step that explores flips exactly one
    kind and counts for that kind's other arm alone. So the two arms of s
    differ in s's drafting only, with the other kinds at their settled states
    (one factor at a time, paired against the same background); the mix of
    kinds per step varies alike in both arms and averages out in the EMAs. A
    kind whose drafts pay thus stays open while another kind of the same
    batch, which does not, is closed. The contrast is measured on the whole
    step, so a kind with few sequences in a large batch moves goodput little
    and keeps its first verdict unless its effect clears the margin. The arms
    are "allowed" and "not allowed": the policy may still give an allowed kind
    0 nodes, and such a step counts as allowed (what is measured is letting the
    policy draft for the kind, against not).

    Warm-up: open, and the kind's plain arm is explored every other step
    until both arms have min_steps measurements; the first verdict then takes
    the better arm. Hysteresis: after that the state flips only when the
    advantage (with / without - 1) crosses the margin against it (open ->
    closed at <= -margin, closed -> open at >= +margin), and no sooner than
    min_dwell steps of that state after the last flip; so goodput oscillating
    around parity inside the margin does not flap it. Exploration: every
    explore_interval steps of a state the other arm runs once, at most one
    kind per step (the one waiting longest), so a closed kind can reopen.

    Backing off: an exploration costs more than its step. It cannot be sent
    ahead (its drafts need the tokens of the step before it), so the worker
    waits for the scheduler's round trip and the drafter's answer; on the
    2-core CPU, one stream of the tiny model whose drafts never came, the
    explorations of two closed kinds every 16 steps cost 16% of its tokens per
    second. So an exploration whose step did worse than the state's own arm
    (it confirms the state) doubles the state's interval, up to
    max_explore_interval; one that did better (the state may be wrong), and a
    flip, set it back to explore_interval, so evidence against a state is
    followed up at the base pace. Except base_pace_kinds: "" holds the requests
    whose segment the drafter has not named yet, which it names only in answer
    to a step that drafts, so its explorations are how new requests are
    classified (scheduler/speculator.py) and keep the base pace.
    """

    min_steps: int = 4
    explore_interval: int = 16
    max_explore_interval: int = 256
    """The longest interval backing off reaches: how long a settled state may go unexamined."""
    base_pace_kinds: frozenset[str] = frozenset({""})
    """Kinds that never back off."""
    margin: float = 0.05
    """Relative goodput difference a flip needs (0.05: 5% better to open, 5% worse to close)."""
    min_dwell: int = 32
    """Steps of a state before it may flip again."""
    states: dict[tuple[str, int], GateState] = field(default_factory=dict)
    last_decision: tuple[int, bool] | None = None
    """(batch-size bucket, whether any kind may draft) of the latest decide; None before the first."""
    last_segments: dict[str, tuple[int, bool]] = field(default_factory=dict)
    """Segment kind -> (bucket, is_open) of its state at the latest step that had it, for the stats."""

    def __post_init__(self) -> None:
        if (self.min_steps < 1 or self.explore_interval < 2 or self.max_explore_interval < self.explore_interval
                or self.margin < 0 or self.min_dwell < 0):
            raise ValueError("min_steps >= 1, 2 <= explore_interval <= max_explore_interval, margin >= 0 and "
                             "min_dwell >= 0 are needed")

    @staticmethod
    def bucket(num_sequences: int) -> int:
        return 1 << max(num_sequences - 1, 0).bit_length()

    def decide(self, groups: Mapping[str, int]) -> GateDecision:
        """Whether each segment kind present (segment -> its decode sequences) may draft this step."""
        bucket = self.bucket(sum(groups.values()))
        present = {segment: self.states.setdefault((segment, bucket), GateState(explore_interval=self.explore_interval))
                   for segment in sorted(groups)}
        for state in present.values():
            state.num_steps_since_flip += 1
            state.num_steps_since_explore += 1
        due = [segment for segment, state in present.items() if self._is_due(state)]
        exploring = max(due, key=lambda s: present[s].num_steps_since_explore) if due else None
        if exploring is not None:
            present[exploring].num_steps_since_explore = 0
        allowed = {segment: state.is_open != (segment == exploring) for segment, state in present.items()}
        self.last_decision = (bucket, any(allowed.values()))
        self.last_segments.update((segment, (bucket, state.is_open)) for segment, state in present.items())
        return GateDecision(bucket, allowed, exploring)

    def keeps_off(self, groups: Mapping[str, int]) -> bool:
        """Whether decide(groups), called next, would let no kind draft: every kind present is closed at the
        batch's bucket and none is due to explore. Changes nothing."""
        bucket = self.bucket(sum(groups.values()))
        for segment in groups:
            state = self.states.get((segment, bucket))
            if state is None or state.is_open:  # a closed state is a decided one
                return False
            if state.num_steps_since_explore + 1 >= state.explore_interval:  # decide() counts this step first
                return False
        return True

    def opens_another_kind(self, groups: Mapping[str, int]) -> bool:
        """Whether some kind not present in `groups` is open at the batch's bucket: a sequence whose kind is not
        known yet ("") may turn out to be of it. Changes nothing."""
        bucket = self.bucket(sum(groups.values()))
        return any(state.is_open for (segment, state_bucket), state in self.states.items()
                   if state_bucket == bucket and segment not in groups)

    def observe(self, decision: GateDecision, num_tokens: int, seconds: float) -> None:
        """The step `decision` was made for, finished: tokens it generated, seconds end to end."""
        if seconds <= 0:
            return
        for segment, is_allowed in decision.allowed.items():
            if decision.exploring in (None, segment):
                state = self.states[(segment, decision.bucket)]
                if segment == decision.exploring and state.is_decided and segment not in self.base_pace_kinds:
                    self._back_off(state, is_confirmed=num_tokens / seconds < state.arms[state.is_open].tokens_per_s)
                state.arms[is_allowed].observe(num_tokens, seconds)
                self._update(state)
        self.last_segments.update((segment, (decision.bucket, self.states[(segment, decision.bucket)].is_open))
                                  for segment in decision.allowed)

    def _is_due(self, state: GateState) -> bool:
        """Whether the state's other arm should run this step."""
        if not state.is_decided:
            other, own = state.arms[not state.is_open], state.arms[state.is_open]
            return other.num_steps < self.min_steps and other.num_steps < own.num_steps
        return state.num_steps_since_explore >= state.explore_interval

    def _back_off(self, state: GateState, is_confirmed: bool) -> None:
        """After an exploration of a decided state: wait twice as long for the next one if it confirmed the
        state, else explore again at the base interval."""
        state.explore_interval = (min(2 * state.explore_interval, self.max_explore_interval) if is_confirmed
                                  else self.explore_interval)

    def _update(self, state: GateState) -> None:
        if min(arm.num_steps for arm in state.arms.values()) < self.min_steps:
            return
        advantage = state.advantage
        if advantage is None:
            return
        if not state.is_decided:
            state.is_decided, state.is_open, state.num_steps_since_flip = True, advantage >= 0, 0
            return
        is_against = advantage <= -self.margin if state.is_open else advantage >= self.margin
        if is_against and state.num_steps_since_flip >= self.min_dwell:
            state.is_open, state.num_steps_since_flip = not state.is_open, 0
            state.num_flips += 1
            state.explore_interval = self.explore_interval
