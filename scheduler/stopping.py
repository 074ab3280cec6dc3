"""Appending sampled tokens to a sequence, one by one, up to the first stop condition.

In: a Sequence and what the worker returned for it (one token, or accepted
drafts plus the target's token). Out: the RequestOutput with the tokens kept
(everything after a stop is dropped) and, when it stopped, why. Pure.
"""

from __future__ import annotations

from collections.abc import Set

from scheduler.outputs import RequestOutput, SampledTokens
from scheduler.sequence import RequestMetrics, Sequence, SequenceStatus


def stop_status(seq: Sequence, token_id: int, eos_token_ids: Set[int], max_len: int) -> SequenceStatus | None:
    """Why seq stops after token_id was appended, or None."""
    if token_id in eos_token_ids and not seq.stopping.ignore_eos:
        return SequenceStatus.FINISHED_EOS_TOKEN
    if token_id in seq.stopping.stop_token_ids:
        return SequenceStatus.FINISHED_STOP_TOKEN
    if seq.num_output_tokens >= seq.stopping.max_new_tokens:
        return SequenceStatus.FINISHED_LENGTH
    if seq.num_tokens >= max_len:
        return SequenceStatus.FINISHED_CONTEXT_LENGTH
    return None


def append_sampled(seq: Sequence, sample: SampledTokens, now: float, eos_token_ids: Set[int],
                   max_len: int) -> RequestOutput:
    """Append sample's tokens until one stops seq; the output's finish_status says which (None = goes on)."""
    num_kept = 0
    status = None
    for token_id in sample.token_ids:
        seq.append_token(token_id, now)
        num_kept += 1
        status = stop_status(seq, token_id, eos_token_ids, max_len)
        if status is not None:
            break
    result = RequestOutput(
        request_id=seq.request_id,
        token_ids=list(sample.token_ids[:num_kept]),
        scores=list(sample.scores[:num_kept]),
        top_logprobs=list(sample.top_logprobs[:num_kept]),
        num_prompt_tokens=seq.num_prompt_tokens,
        num_generated_tokens=seq.num_output_tokens,
    )
    result.metrics = RequestMetrics.of(seq)
    if status is not None:
        result.finish_status = status
    return result
