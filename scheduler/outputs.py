"""What the scheduler tells a request's stream: the contract's events, addressed by request id.

Scheduler.postprocess() (and the step-failure path) return RequestEvents; the
engine routes each to its request's stream; the servicer sends `event.to_pb()`.
The events themselves are protos/segserve/v1/generate.py's TokenChunk,
GenerateComplete and GenerateError: this module only builds them from a Sequence.
"""

from __future__ import annotations

from dataclasses import dataclass

from protos.segserve.v1.generate import FinishReason, GenerateComplete, GenerateEvent, TokenChunk
from protos.segserve.v1.step_result import PromptLogprobs, SequenceOutput
from protos.segserve.v1.tree import CandidateTree
from scheduler.sequence import RequestMetrics, Sequence


@dataclass(slots=True)  # one per token chunk: a frozen dataclass's __init__ costs ~5x a plain one's
class RequestEvent:
    """One event for one request's stream."""

    request_id: str
    event: GenerateEvent

    @property
    def is_terminal(self) -> bool:
        """A GenerateComplete or a GenerateError: the stream ends with it."""
        return not isinstance(self.event, TokenChunk)

    @property
    def num_tokens(self) -> int:
        return len(self.event.token_ids) if isinstance(self.event, TokenChunk) else 0


def token_chunk(seq: Sequence, output: SequenceOutput, num_kept: int,
                draft: CandidateTree | None = None) -> TokenChunk | None:
    """The first num_kept tokens of output and its not yet streamed prompt log-probabilities (None: nothing).

    With `draft` (the tree this step verified), the chunk says how big and deep it was and how many of its
    tokens are accepted drafts: all of output's tokens but the last (the target model's own), as far as kept.
    """
    prompt_logprobs = unsent_prompt_logprobs(seq, output.prompt_logprobs)
    if num_kept == 0 and prompt_logprobs is None:
        return None
    if num_kept == len(output.token_ids):  # the usual case: no copies
        token_ids, scores, top_logprobs = output.token_ids, output.scores, output.top_logprobs
    else:
        token_ids, scores = output.token_ids[:num_kept], output.scores[:num_kept]
        top_logprobs = output.top_logprobs[:num_kept]
    num_accepted = 0 if draft is None else min(num_kept, len(output.token_ids) - 1)
    return TokenChunk(token_ids, scores, top_logprobs, batch_size=seq.max_batch_size,
                      queue_wait_us=seq.queue_wait_us, prompt_logprobs=prompt_logprobs, segment=seq.segment,
                      num_draft_tokens=0 if draft is None else len(draft),
                      draft_depth=0 if draft is None else draft.max_depth, num_accepted_draft_tokens=num_accepted)


def unsent_prompt_logprobs(seq: Sequence, prompt: PromptLogprobs | None) -> PromptLogprobs | None:
    """The part of `prompt` past what seq has streamed already (a recomputed prompt repeats them)."""
    if prompt is None:
        return None
    skip = max(0, seq.next_prompt_logprob_index - prompt.start)
    if skip >= len(prompt.logprobs):
        return None
    seq.next_prompt_logprob_index = prompt.start + len(prompt.logprobs)
    if skip == 0:
        return prompt
    return PromptLogprobs(prompt.start + skip, prompt.logprobs[skip:], prompt.top_logprobs[skip:])


def completion(seq: Sequence) -> GenerateComplete:
    """The terminal event of a sequence that finished (finish_reason set)."""
    metrics = RequestMetrics.of(seq)
    return GenerateComplete(
        finish_reason=seq.finish_reason or FinishReason.UNSPECIFIED, num_prompt_tokens=seq.num_prompt_tokens,
        num_generated_tokens=seq.num_output_tokens, queue_wait_us=metrics.queue_wait_us,
        first_token_us=metrics.first_token_us, decode_us=metrics.decode_us, max_batch_size=metrics.max_batch_size,
        error_message=seq.error_message, num_cached_prompt_tokens=seq.num_cached_prompt_tokens or 0)
