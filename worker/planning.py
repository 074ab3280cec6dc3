"""From a StepRequest to the work of one forward: sequence state, validation, expansion.

In: a `StepRequest` (protos/segserve/v1/step.py) and the worker's sequence states.
Out: a `ForwardPlan` (the `Work`s to run, their prompt log-probability plans, the sequences left out
with the reason) and the new states. A sequence that fails its checks is left out with its state
untouched; a step malformed as a whole raises InvalidRequest and changes nothing.

Per-sequence state: the sampling parameters, the number of prompt tokens, a random generator,
the token history, which after every step is `history[:num_computed_tokens] + token_ids`
(so a recompute after preemption simply overwrites it), and for a structured output its grammar's
matcher (worker/grammar.py), whose grammar starts compiling, off the step, when the sequence
arrives; once that compile has failed, every work of the sequence is refused with the reason (a
work that ran while it compiled fails in its own step, where its mask needed the grammar). A
structured output's candidate tree is cut here, before the forward, to the nodes its grammar allows (GrammarState.prune): the
nodes it drops take no row of the forward, and the KV slots the scheduler gave them are simply not
written (its answer's accepted path is a path of the tree it sent, which trims them as any rejected
node's).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field

import torch

from protos.segserve.v1.sampling import SamplingParams, StructuredOutput
from protos.segserve.v1.step import CONTINUATION_REFUSED, ScheduledSequence, StepRequest
from worker.attention_plan import StepLayout, step_layout
from worker.block_tables import BlockTables
from worker.grammar import GrammarError, GrammarState
from worker.prompt_logprobs import PromptLogprobState, PromptPlan, plan
from worker.sampler import SampleRow, make_generator
from worker.validation import InvalidRequest, StepLimits, constrained_problem, has_overlapping_slots, sequence_problem
from worker.work import Work, expand


@dataclass
class SequenceState:
    """What the worker remembers about a live sequence between steps."""

    params: SamplingParams
    num_prompt_tokens: int
    generator: torch.Generator | None
    history: list[int] = field(default_factory=list)
    """Every token of the sequence up to the end of its last step (prompt, output, step tokens)."""
    prompt: PromptLogprobState | None = None
    """Set when the sequence asked for prompt log-probabilities."""
    last_sampled: int | None = None
    """The token the sequence's last step sampled at its end, which a continuation (async scheduling) computes
    next; None when that step sampled nothing there or failed."""
    plain_row: SampleRow | None = None
    """The sequence's SampleRow without history, made once, for parameters that read none (no penalty,
    no watermark)."""
    grammar: GrammarState | None = None
    """A structured output's matcher (worker/grammar.py); None = unconstrained."""
    refusal: str | None = None
    """Why every work of the sequence is refused (a structured_output its grammar engine did not compile)."""
    is_drafting_forced_spans: bool = False
    """Its outputs carry the span its grammar forces next (NewSequence.is_drafting_forced_spans)."""


@dataclass
class ForwardPlan:
    """One step, validated: what runs, and what was left out."""

    works: list[Work] = field(default_factory=list)
    prompt_plans: list[PromptPlan | None] = field(default_factory=list)
    """Per work: the prompt tokens it scores (None: it asked for none, or computes none)."""
    rejected: dict[str, str] = field(default_factory=dict)
    """seq_id -> why that sequence was left out of the forward."""
    seq_ids: list[str] = field(default_factory=list)
    """Every scheduled sequence, in request order (the order of the outputs)."""
    layout: StepLayout | None = None
    """Where the works sit in the block tables and the packed row (None when nothing runs)."""
    non_finite_tokens: torch.Tensor | None = None
    """[T] bool on the device, set by the forward (ModelRunner.execute): the new tokens whose keys or values
    were not finite."""
    constrained: list[int] = field(default_factory=list)
    """Indices of the works that sample under a grammar, in order: one row at their last token, or every node of
    their tree (already cut to what the grammar allows)."""
    grammar_masks: Future | None = None
    """The constrained rows' masks being filled while the forward runs (worker/grammar_masks.py's fill_masks),
    started by ModelRunner.execute; None when no row is constrained or it has not started."""

    @property
    def num_sample_rows(self) -> int:
        return sum(len(work.sample_indices) for work in self.works)


GrammarStarter = Callable[[StructuredOutput], GrammarState]
"""A new sequence's matcher for its structured output (GrammarEngine.start: its compile starts); raises
GrammarError where it cannot have one."""


def plan_step(request: StepRequest, states: dict[str, SequenceState], limits: StepLimits, tables: BlockTables,
              start_grammar: GrammarStarter | None = None) -> tuple[dict[str, SequenceState], ForwardPlan]:
    """Forget finished sequences, register new ones, check every sequence, then record the tokens
    of those that run. Returns the new states (`states` itself is not modified) and the plan.

    `tables` takes the block tables of the sequences that pass their checks, whether or not the
    step as a whole is then refused (the caller drops the rows of sequences it does not keep).
    `start_grammar` makes the matchers of new sequences with a structured output (None: they are refused)."""
    states = dict(states)
    for seq_id in request.finished_seq_ids:
        states.pop(seq_id, None)
        tables.release(seq_id)
    for new in request.new_sequences:
        if any(t >= limits.input_vocab_size for t in new.prompt_token_ids):
            raise InvalidRequest(
                f"sequence {new.seq_id!r}: prompt_token_ids must be in [0, {limits.input_vocab_size})")
        prompt = None if new.sampling.num_prompt_logprobs is None else PromptLogprobState(
            new.sampling.num_prompt_logprobs)
        # The prompt starts the history: a first step may start past a cached prefix (prefix caching).
        states[new.seq_id] = SequenceState(new.sampling, new.num_prompt_tokens,
                                           make_generator(new.sampling.seed, tables.device),
                                           list(new.prompt_token_ids),
                                           prompt=prompt, is_drafting_forced_spans=new.is_drafting_forced_spans)
        if new.sampling.structured_output is not None:
            _start_grammar(new.seq_id, states[new.seq_id], new.sampling.structured_output, start_grammar)
    seq_ids = [seq.seq_id for seq in request.sequences]
    if len(set(seq_ids)) != len(seq_ids):
        twice = next(s for s in seq_ids if seq_ids.count(s) > 1)
        raise InvalidRequest(f"sequence {twice!r} is scheduled twice in one step")
    forward = ForwardPlan(seq_ids=seq_ids)
    runnable = []
    for seq in request.sequences:
        state = states.get(seq.seq_id)
        problem = None
        if seq.block_table_start and state is not None:  # (an unknown sequence gets sequence_problem's message)
            problem = tables.resolve(seq)
            problem = None if problem is None else f"sequence {seq.seq_id!r}: {problem}"
        if seq.is_continuation and problem is None:
            seq, problem = _continued(seq, state)
        problem = problem or sequence_problem(seq, None if state is None else len(state.history), limits)
        if problem is None and (state.grammar is not None or state.refusal is not None):
            problem = state.refusal or _compile_refusal(seq.seq_id, state) or constrained_problem(seq)
        if problem is None:
            problem = tables.stage(seq, -(-seq.num_tokens // limits.block_size))
            problem = None if problem is None else f"sequence {seq.seq_id!r}: {problem}"
        if problem is None and seq.draft is not None and state.grammar is not None:
            seq, problem = _pruned(seq, state)
        if problem is None:
            runnable.append(seq)
        else:
            forward.rejected[seq.seq_id] = problem
    tables.flush()
    for seq in runnable:
        state = states[seq.seq_id]
        prompt_plan = None if state.prompt is None else plan(seq, state.num_prompt_tokens, state.prompt)
        if state.grammar is not None and seq.is_sampled:  # at its last token, or every node of its tree
            forward.constrained.append(len(forward.works))
        forward.works.append(expand(seq, () if prompt_plan is None else prompt_plan.offsets))
        forward.prompt_plans.append(prompt_plan)
    if runnable:
        forward.layout = step_layout(forward.works, [tables.row(seq.seq_id) for seq in runnable], tables.host,
                                       limits.block_size)
        if has_overlapping_slots(forward.layout.slots):
            raise InvalidRequest("two scheduled tokens would write the same KV-cache slot (overlapping block tables)")
    for seq in runnable:  # the step is accepted: record its tokens
        state = states[seq.seq_id]
        del state.history[seq.num_computed_tokens:]
        state.history.extend(seq.token_ids)
        state.last_sampled = None  # until this step samples
    return states, forward


def _start_grammar(seq_id: str, state: SequenceState, structured: StructuredOutput,
                   start_grammar: GrammarStarter | None) -> None:
    """Give a new sequence its matcher, or the reason its works are refused."""
    try:
        if start_grammar is None:
            raise GrammarError("this worker has no grammar engine for structured_output")
        state.grammar = start_grammar(structured)
    except GrammarError as exc:
        state.refusal = f"sequence {seq_id!r}: {exc}"


def _compile_refusal(seq_id: str, state: SequenceState) -> str | None:
    """Why the sequence's grammar did not compile, once its compile has ended (None while it runs)."""
    problem = state.grammar.compile_problem() if state.grammar is not None else None
    return None if problem is None else f"sequence {seq_id!r}: {problem}"


def _pruned(seq: ScheduledSequence, state: SequenceState) -> tuple[ScheduledSequence, str | None]:
    """A tree step of a constrained sequence with its tree cut to the nodes its grammar allows after the output and
    the root (GrammarState.prune; the matcher is left after the root), or why its output breaks its grammar (or
    its grammar did not compile: a tree waits for the compile here, before the forward)."""
    root, num_computed, start = seq.token_ids[0], seq.num_computed_tokens, state.num_prompt_tokens
    output = state.history[start:num_computed] + [root] if num_computed >= start else []
    try:
        problem = state.grammar.sync(output)
    except GrammarError as exc:
        problem = str(exc)
    if problem is not None:
        return seq, f"sequence {seq.seq_id!r}: {problem}"
    tree = state.grammar.prune(root, seq.draft)
    if not tree:  # nothing left to verify: the root's row alone, as a plain step samples it
        return dataclasses.replace(seq, sample_indices=(0,), draft=None), None
    return (seq if tree is seq.draft else dataclasses.replace(seq, draft=tree)), None


def _continued(seq: ScheduledSequence, state: SequenceState | None) -> tuple[ScheduledSequence, str | None]:
    """A continuation with its placeholder replaced by the token the sequence's previous step sampled, or why
    it cannot be (it must follow that step directly: one token, at the end of the history, sampled there)."""
    if (state is None or state.last_sampled is None or len(seq.token_ids) != 1 or seq.draft is not None
            or seq.num_computed_tokens != len(state.history)):
        return seq, f"sequence {seq.seq_id!r}: {CONTINUATION_REFUSED}"
    # the constructor, not dataclasses.replace: 0.4 us against 1.4 per sequence, every step ahead
    return ScheduledSequence(seq.seq_id, (state.last_sampled,), seq.num_computed_tokens, seq.block_table,
                             seq.sample_indices), None
