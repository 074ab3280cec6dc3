"""The step contract's answer, from the worker to the scheduler (worker.proto's StepResponse). Torch-free.

The worker answers a `StepRequest` (step.py) with a `StepResult` (one
`SequenceOutput` per sampled sequence). `output_problem()` is the one check that
an answer fits the work it answers. Protobuf is converted here, at either side's
edge.

The worker answers a packed step packed: outputs of only tokens and one score per
token go as one message of columns (worker.proto's PackedOutputs), the rest one
message each; from_pb reads either form. The columns are cut with step.py's
helpers, which raise step.py's MalformedStep for columns that disagree.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from protos.segserve.v1 import common_pb2, worker_pb2
from protos.segserve.v1.step import ScheduledSequence, runs, as_tuple

MAX_FORCED_TOKENS = 16
"""The most tokens of a forced span a worker returns (SequenceOutput.forced_token_ids)."""


@dataclass(frozen=True)
class TopLogprobs:
    """The most likely alternatives at one position, most likely first."""

    token_ids: tuple[int, ...]
    logprobs: tuple[float, ...]

    def __post_init__(self) -> None:
        object.__setattr__(self, "token_ids", tuple(self.token_ids))
        object.__setattr__(self, "logprobs", tuple(self.logprobs))

    def to_pb(self) -> common_pb2.TopLogprobs:
        return common_pb2.TopLogprobs(token_ids=self.token_ids, logprobs=self.logprobs)

    @classmethod
    def from_pb(cls, pb: common_pb2.TopLogprobs) -> TopLogprobs:
        return cls(tuple(pb.token_ids), tuple(pb.logprobs))


@dataclass(frozen=True)
class PromptLogprobs:
    """Log-probabilities of prompt tokens start, start + 1, ... under the raw model distribution."""

    start: int
    """Index in the prompt of the first token covered (>= 1: the first prompt token has none)."""
    logprobs: tuple[float, ...]
    top_logprobs: tuple[TopLogprobs, ...] = ()
    """Per covered token, when num_prompt_logprobs > 0."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "logprobs", tuple(self.logprobs))
        object.__setattr__(self, "top_logprobs", tuple(self.top_logprobs))

    def to_pb(self) -> common_pb2.PromptLogprobs:
        return common_pb2.PromptLogprobs(start=self.start, logprobs=self.logprobs,
                                         top_logprobs=[t.to_pb() for t in self.top_logprobs])

    @classmethod
    def from_pb(cls, pb: common_pb2.PromptLogprobs) -> PromptLogprobs:
        return cls(pb.start, tuple(pb.logprobs), tuple(TopLogprobs.from_pb(t) for t in pb.top_logprobs))


@dataclass(slots=True)  # one per sequence per step (see ScheduledSequence)
class SequenceOutput:
    """What was sampled for one sequence in one step: one token per sample index, or for a tree the
    accepted drafts followed by the target's own token. `error` set = this sequence alone failed."""

    seq_id: str
    token_ids: tuple[int, ...] = ()
    scores: tuple[float, ...] = ()
    """Per token: the logit (greedy) or the log-probability (sampling)."""
    top_logprobs: tuple[TopLogprobs, ...] = ()
    """Per token, when the sequence asked for num_top_logprobs > 0."""
    prompt_logprobs: PromptLogprobs | None = None
    error: str = ""
    """Why this sequence failed (non-finite logits, a sampler failure, an invalid tree); no tokens then."""
    forced_token_ids: tuple[int, ...] = ()
    """A sequence announced with NewSequence.is_drafting_forced_spans: the tokens its grammar forces right after
    token_ids (at most MAX_FORCED_TOKENS; empty where the grammar leaves a choice). A draft, never output."""

    def __post_init__(self) -> None:  # as ScheduledSequence's
        self.token_ids = as_tuple(self.token_ids)
        self.scores = as_tuple(self.scores)
        self.top_logprobs = as_tuple(self.top_logprobs)
        self.forced_token_ids = as_tuple(self.forced_token_ids)

    def followed_by(self, then: SequenceOutput) -> SequenceOutput:
        """This output and `then`, of the next decode step of the same sequence, as one (multi-step decoding):
        their tokens, scores and top log-probabilities in order, and the forced span after the last of them."""
        return SequenceOutput(self.seq_id, self.token_ids + then.token_ids, self.scores + then.scores,
                              self.top_logprobs + then.top_logprobs, self.prompt_logprobs,
                              forced_token_ids=then.forced_token_ids)

    def to_pb(self) -> worker_pb2.SequenceOutput:
        # one per sequence per step: fields at their defaults are left out, not passed (each argument costs)
        pb = worker_pb2.SequenceOutput(seq_id=self.seq_id, token_ids=self.token_ids, scores=self.scores)
        if self.top_logprobs:
            pb.top_logprobs.extend(t.to_pb() for t in self.top_logprobs)
        if self.prompt_logprobs is not None:
            pb.prompt_logprobs.CopyFrom(self.prompt_logprobs.to_pb())
        if self.error:
            pb.error = self.error
        if self.forced_token_ids:
            pb.forced_token_ids.extend(self.forced_token_ids)
        return pb

    @classmethod
    def from_pb(cls, pb: worker_pb2.SequenceOutput) -> SequenceOutput:
        prompt = PromptLogprobs.from_pb(pb.prompt_logprobs) if pb.HasField("prompt_logprobs") else None
        top = tuple(TopLogprobs.from_pb(t) for t in pb.top_logprobs) if pb.top_logprobs else ()
        # lists: see ScheduledSequence
        return cls(pb.seq_id, pb.token_ids[:], pb.scores[:], top, prompt, pb.error, pb.forced_token_ids[:])


@dataclass
class StepResult:
    """The worker's answer to one StepRequest."""

    outputs: list[SequenceOutput] = field(default_factory=list)
    compute_us: int = 0
    """Wall time of the forward and sampling."""

    def to_pb(self, packed: bool = False) -> worker_pb2.StepResponse:
        """With `packed` (the answer to a packed step), outputs of only tokens and one score per token go as
        PackedOutputs, the rest one message each."""
        if not packed:
            return worker_pb2.StepResponse(outputs=[o.to_pb() for o in self.outputs], compute_us=self.compute_us)
        seq_ids, num_token_ids, token_ids, scores, others = [], [], [], [], []
        for output in self.outputs:
            if (output.top_logprobs or output.prompt_logprobs is not None or output.error or output.forced_token_ids
                    or len(output.scores) != len(output.token_ids)):
                others.append(output.to_pb())
                continue
            seq_ids.append(output.seq_id)
            num_token_ids.append(len(output.token_ids))
            token_ids += output.token_ids
            scores += output.scores
        return worker_pb2.StepResponse(
            outputs=others, compute_us=self.compute_us,
            packed_outputs=worker_pb2.PackedOutputs(seq_ids=seq_ids, num_token_ids=num_token_ids,
                                                    token_ids=token_ids, scores=scores))

    @classmethod
    def from_pb(cls, pb: worker_pb2.StepResponse) -> StepResult:
        """The outputs one message each first, then the packed ones. Raises MalformedStep for packed outputs
        whose columns disagree."""
        outputs = [SequenceOutput.from_pb(o) for o in pb.outputs]
        if pb.HasField("packed_outputs"):
            packed = pb.packed_outputs
            seq_ids = packed.seq_ids[:]
            token_ids = runs(packed.token_ids, packed.num_token_ids, len(seq_ids), "token_ids")
            scores = runs(packed.scores, packed.num_token_ids, len(seq_ids), "scores")
            outputs += [SequenceOutput(*output) for output in zip(seq_ids, token_ids, scores)]
        return cls(outputs, pb.compute_us)


def output_problem(work: ScheduledSequence, output: SequenceOutput | None, num_steps: int = 1) -> str | None:
    """Why `output` does not answer `work` in a step of `num_steps` decode steps (None when it does). An error
    output always does."""
    if output is None:
        return f"no output for sequence {work.seq_id!r}" if work.is_sampled else None
    if output.error:
        return None
    if len(output.scores) != len(output.token_ids):
        return f"{len(output.token_ids)} tokens but {len(output.scores)} scores for sequence {work.seq_id!r}"
    if work.draft is not None:
        if not 1 <= len(output.token_ids) <= work.draft.max_depth + 1 or not work.draft.is_path(output.token_ids):
            return f"{list(output.token_ids)} for sequence {work.seq_id!r} is not a path of its tree plus one token"
    elif len(output.token_ids) != len(work.sample_indices) * num_steps:
        return (f"{len(output.token_ids)} tokens for sequence {work.seq_id!r}, "
                f"expected {len(work.sample_indices) * num_steps}")
    return None
