"""The step contract between the scheduler and the worker (worker.proto's Step): the request. Torch-free.

The scheduler builds a `StepRequest` (new sequences, each sequence's work, ended
sequences); the worker answers with a `StepResult`, which step_result.py holds with
the rest of the answer's side. Protobuf is converted here, at either side's edge.

A step's sequences travel one message each, or packed: one message of columns for
the whole step (worker.proto's PackedSequences), which costs a fraction of
hundreds of small messages to build and read. A scheduler packs only for a worker
that says it reads packed steps (WorkerInfo.packed_steps); from_pb reads either
form. The packed columns' helpers (`runs`, `unless_default`, `per_entry`) and
`as_tuple` are shared: step_result.py and generate.py import them from here.

Block tables travel as deltas to a worker that keeps them (WorkerInfo.block_table_deltas): a sequence's
`block_table` then holds only the entries from `block_table_start` on, which the worker appends to the ones it
kept from the steps before; a decoding sequence mostly sends none.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from itertools import accumulate

from protos.segserve.v1 import worker_pb2
from protos.segserve.v1.sampling import SamplingParams
from protos.segserve.v1.tree import CandidateTree


class MalformedStep(ValueError):
    """A packed step or answer whose columns do not fit together (lengths that disagree, an index out of range)."""


def as_tuple(values) -> tuple:
    """`values` as a tuple, the object itself when it is one (contract fields take lists from callers)."""
    return values if type(values) is tuple else tuple(values)


@dataclass(frozen=True)
class NewSequence:
    """A sequence the worker has not seen: sent once, before its first work.

    A preempted sequence is not re-announced: it comes back with num_computed_tokens = 0.
    """

    seq_id: str
    sampling: SamplingParams
    num_prompt_tokens: int
    """Penalties that look at "the output" start here, and so does the output a structured output's grammar
    matches (a moved sequence's prompt_token_ids carry its output after them)."""
    prompt_token_ids: tuple[int, ...] = ()
    """The sequence's tokens so far (empty = not sent): the prompt, followed by the output already generated
    when the sequence moved here from a lost worker. The worker's token history starts from them, so a first
    step may start at num_computed_tokens = a cached prefix's length (prefix caching)."""
    is_drafting_forced_spans: bool = False
    """A structured output under speculation: the worker answers each step that samples the sequence with the
    span its grammar forces next (SequenceOutput.forced_token_ids), which the scheduler drafts."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "prompt_token_ids", tuple(self.prompt_token_ids))

    def to_pb(self) -> worker_pb2.NewSequence:
        return worker_pb2.NewSequence(seq_id=self.seq_id, sampling=self.sampling.to_pb(),
                                      num_prompt_tokens=self.num_prompt_tokens, prompt_token_ids=self.prompt_token_ids,
                                      is_drafting_forced_spans=self.is_drafting_forced_spans)

    @classmethod
    def from_pb(cls, pb: worker_pb2.NewSequence) -> NewSequence:
        return cls(pb.seq_id, SamplingParams.from_pb(pb.sampling), pb.num_prompt_tokens, tuple(pb.prompt_token_ids),
                   pb.is_drafting_forced_spans)


MAX_DECODE_STEPS = 64
"""The most decode steps one StepRequest may ask for (StepRequest.num_steps)."""

CONTINUATION_REFUSED = "a continuation must directly follow a step that sampled the sequence's next token"
"""The end of the error a worker answers for a continuation it cannot resolve (a step out of order): the
scheduler recomputes such a sequence rather than failing its request."""


@dataclass(slots=True)  # one per sequence per step: a frozen dataclass's __init__ costs ~5x a plain one's
class ScheduledSequence:
    """One sequence's work in one step."""

    seq_id: str
    token_ids: tuple[int, ...]
    """Tokens to compute (a prefill chunk or the last sampled token), from position num_computed_tokens."""
    num_computed_tokens: int
    """Tokens already in the KV cache (0 = start over, e.g. after a preemption)."""
    block_table: tuple[int, ...]
    """The entries from block_table_start on of the table, which covers num_computed_tokens + len(token_ids) +
    len(draft) positions."""
    sample_indices: tuple[int, ...] = ()
    """Indices into token_ids whose next token is sampled; empty for a prefill chunk short of the end
    and for a tree step."""
    draft: CandidateTree | None = None
    """A candidate tree to verify after token_ids (then exactly one token, the root). A sequence with a structured
    output has the nodes its grammar forbids dropped by the worker before the forward."""
    is_continuation: bool = False
    """Async scheduling: token_ids is one placeholder for the token the worker sampled for this sequence in its
    previous step, which the worker puts in its place (worker.proto)."""
    block_table_start: int = 0
    """The worker has the table's entries before this index from the steps before (0: block_table is whole);
    only for a worker with WorkerInfo.block_table_deltas."""

    def __post_init__(self) -> None:  # runs for every sequence every step: no loop over field names
        self.token_ids = as_tuple(self.token_ids)
        self.block_table = as_tuple(self.block_table)
        self.sample_indices = as_tuple(self.sample_indices)

    @property
    def is_sampled(self) -> bool:
        """Whether the worker returns tokens for this work (a sampled position or a tree)."""
        return bool(self.sample_indices or self.draft)

    @property
    def num_draft_tokens(self) -> int:
        return 0 if self.draft is None else len(self.draft)

    @property
    def num_tokens(self) -> int:
        """Tokens in the KV cache once this step has run (draft nodes included)."""
        return self.num_computed_tokens + len(self.token_ids) + self.num_draft_tokens

    def to_pb(self) -> worker_pb2.ScheduledSequence:
        # one per sequence per step: fields at their defaults are left out, not passed (each argument costs)
        pb = worker_pb2.ScheduledSequence(seq_id=self.seq_id, token_ids=self.token_ids,
                                          num_computed_tokens=self.num_computed_tokens, block_table=self.block_table,
                                          sample_indices=self.sample_indices)
        if self.draft is not None:
            pb.draft.CopyFrom(self.draft.to_pb())
        if self.is_continuation:
            pb.is_continuation = True
        if self.block_table_start:
            pb.block_table_start = self.block_table_start
        return pb

    @classmethod
    def from_pb(cls, pb: worker_pb2.ScheduledSequence) -> ScheduledSequence:
        draft = CandidateTree.from_pb(pb.draft) if pb.HasField("draft") and pb.draft.token_ids else None
        # a slice of a repeated field is a list, which __post_init__ makes a tuple: ~2x faster than tuple(field)
        return cls(pb.seq_id, pb.token_ids[:], pb.num_computed_tokens, pb.block_table[:], pb.sample_indices[:],
                   draft, pb.is_continuation, pb.block_table_start)


@dataclass
class StepRequest:
    """Everything the worker does in one step."""

    sequences: list[ScheduledSequence] = field(default_factory=list)
    new_sequences: list[NewSequence] = field(default_factory=list)
    finished_seq_ids: list[str] = field(default_factory=list)
    """Sequences that ended: the worker drops their sampling state."""
    step_id: int = 0
    """Set by a scheduler that sends steps ahead (0 = none), so that a step ahead can name the step it follows."""
    follows_step_id: int = 0
    """A step ahead: the step whose sampled tokens its continuations compute; the worker runs it after that one
    (0 = it follows none)."""
    num_steps: int = 1
    """Multi-step decoding: decode steps the worker runs back to back, each sequence computing the token it
    sampled in the one before; every sequence is then answered with num_steps tokens (multi_step_problem)."""
    trace_context: dict[str, str] = field(default_factory=dict)
    """The W3C trace context of the scheduler's span of this step; empty = not traced."""

    @property
    def num_scheduled_tokens(self) -> int:
        return sum(len(s.token_ids) + s.num_draft_tokens for s in self.sequences)

    @property
    def num_draft_tokens(self) -> int:
        return sum(s.num_draft_tokens for s in self.sequences)

    def to_pb(self, packed: bool = False) -> worker_pb2.StepRequest:
        """With `packed`, the sequences go as PackedSequences (for a worker with WorkerInfo.packed_steps)."""
        sequences = {"packed_sequences": _pack_sequences(self.sequences)} if packed else {
            "sequences": [s.to_pb() for s in self.sequences]}
        pb = worker_pb2.StepRequest(new_sequences=[n.to_pb() for n in self.new_sequences],
                                    finished_seq_ids=self.finished_seq_ids, step_id=self.step_id,
                                    follows_step_id=self.follows_step_id,
                                    num_steps=self.num_steps if self.num_steps != 1 else 0, **sequences)
        if self.trace_context:
            pb.trace_context.update(self.trace_context)
        return pb

    @classmethod
    def from_pb(cls, pb: worker_pb2.StepRequest) -> StepRequest:
        """Raises MalformedStep for packed sequences whose columns disagree."""
        if pb.HasField("packed_sequences"):
            if pb.sequences:
                raise MalformedStep("a step has sequences both packed and one message each")
            sequences = _unpack_sequences(pb.packed_sequences)
        else:
            sequences = [ScheduledSequence.from_pb(s) for s in pb.sequences]
        return cls(sequences, [NewSequence.from_pb(n) for n in pb.new_sequences], list(pb.finished_seq_ids),
                   pb.step_id, pb.follows_step_id, pb.num_steps or 1,
                   dict(pb.trace_context) if pb.trace_context else {})


def multi_step_problem(request: StepRequest) -> str | None:
    """Why `request`'s num_steps cannot be run (None when it can): more than MAX_DECODE_STEPS, or a step of
    several whose sequences do not all decode one token sampled at its end without a tree. Whether each block
    table covers every step's position is each sequence's own check."""
    if not 1 <= request.num_steps <= MAX_DECODE_STEPS:
        return f"num_steps={request.num_steps} is outside [1, {MAX_DECODE_STEPS}]"
    if request.num_steps > 1:
        for seq in request.sequences:
            if len(seq.token_ids) != 1 or seq.sample_indices != (0,) or seq.draft is not None:
                return (f"num_steps={request.num_steps}, but sequence {seq.seq_id!r} does not decode one token "
                        "sampled at its end (a prefill chunk or a tree runs in a step of its own)")
    return None


def _pack_sequences(sequences: list[ScheduledSequence]) -> worker_pb2.PackedSequences:
    seq_ids, num_computed, num_token_ids, token_ids, num_blocks, block_tables = [], [], [], [], [], []
    num_sample_indices, sample_indices, continuations, drafted, drafts = [], [], [], [], []
    block_table_starts = []
    for index, seq in enumerate(sequences):  # one loop of appends: 2x faster than a comprehension per column
        seq_ids.append(seq.seq_id)
        num_computed.append(seq.num_computed_tokens)
        num_token_ids.append(len(seq.token_ids))
        token_ids += seq.token_ids
        num_blocks.append(len(seq.block_table))
        block_tables += seq.block_table
        block_table_starts.append(seq.block_table_start)
        num_sample_indices.append(len(seq.sample_indices))
        sample_indices += seq.sample_indices
        if seq.is_continuation:
            continuations.append(index)
        if seq.draft is not None:
            drafted.append(index)
            drafts.append(seq.draft.to_pb())
    return worker_pb2.PackedSequences(
        seq_ids=seq_ids, num_computed_tokens=num_computed, num_token_ids=num_token_ids, token_ids=token_ids,
        num_blocks=num_blocks, block_tables=block_tables, num_sample_indices=num_sample_indices,
        sample_indices=sample_indices, continuations=continuations, drafted=drafted, drafts=drafts,
        block_table_starts=unless_default(block_table_starts))


def _unpack_sequences(pb: worker_pb2.PackedSequences) -> list[ScheduledSequence]:
    seq_ids = pb.seq_ids[:]
    num_computed = pb.num_computed_tokens[:]
    if len(num_computed) != len(seq_ids):
        raise MalformedStep(f"{len(num_computed)} num_computed_tokens for {len(seq_ids)} packed sequences")
    token_ids = runs(pb.token_ids, pb.num_token_ids, len(seq_ids), "token_ids")
    block_tables = runs(pb.block_tables, pb.num_blocks, len(seq_ids), "block_tables")
    sample_indices = runs(pb.sample_indices, pb.num_sample_indices, len(seq_ids), "sample_indices")
    continuations = set(_indices(pb.continuations, len(seq_ids), "continuations"))
    drafted = _indices(pb.drafted, len(seq_ids), "drafted")
    if len(drafted) != len(pb.drafts):
        raise MalformedStep(f"{len(pb.drafts)} drafts for {len(drafted)} drafted sequences")
    drafts = {index: CandidateTree.from_pb(tree) for index, tree in zip(drafted, pb.drafts) if tree.token_ids}
    starts = per_entry(pb.block_table_starts, len(seq_ids), "block_table_starts", 0)
    return [ScheduledSequence(seq_id, tokens, computed, blocks, samples, drafts.get(index), index in continuations,
                              start)
            for index, (seq_id, tokens, computed, blocks, samples, start)
            in enumerate(zip(seq_ids, token_ids, num_computed, block_tables, sample_indices, starts))]


def runs(values, lengths, num_entries: int, name: str) -> list[tuple]:
    """A packed column cut into its entries' runs: `values` at `lengths`. The runs are tuples (slices of a
    tuple), which the contract types' __post_init__ keep as they are."""
    lengths = lengths[:]
    if len(lengths) != num_entries:
        raise MalformedStep(f"{len(lengths)} lengths of {name} for {num_entries} packed entries")
    values = tuple(values[:])
    ends = list(accumulate(lengths))
    if (ends[-1] if ends else 0) != len(values):
        raise MalformedStep(f"{name} holds {len(values)} values, its lengths sum to {ends[-1] if ends else 0}")
    return [values[end - length:end] for length, end in zip(lengths, ends)]


def unless_default(column: list) -> list | None:
    """A packed per-entry column, or None (left empty) when every entry has the field's default."""
    return column if any(column) else None


def per_entry(column, num_entries: int, name: str, default, error: type[ValueError] = MalformedStep) -> list:
    """A packed per-entry column's values (unless_default's inverse: an empty one is every entry's default);
    `error` when it has neither 0 nor num_entries values."""
    values = column[:]
    if not values:
        return [default] * num_entries
    if len(values) != num_entries:
        raise error(f"{len(values)} {name} for {num_entries} packed entries")
    return values


def _indices(indices, num_sequences: int, name: str) -> list[int]:
    indices = indices[:]
    if any(b <= a for a, b in zip(indices, indices[1:])) or (indices and indices[-1] >= num_sequences):
        raise MalformedStep(f"{name} must be ascending indices below {num_sequences}")
    return indices
