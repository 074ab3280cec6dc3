"""Protobuf <-> dataclasses at the Scheduler service's edge, with request validation.

In: GenerateRequest. Out: GenerateResponse events, SchedulerStats. Nothing
past this module (and worker_client) sees a protobuf object.
"""

from __future__ import annotations

from dataclasses import dataclass

from protos.segserve.v1 import common_pb2, scheduler_pb2
from scheduler.engine import EngineStats
from scheduler.outputs import RequestError, RequestOutput
from scheduler.sequence import SamplingParams, SequenceStatus, StoppingCriteria
from scheduler.spec_policy import SegmentStats
from scheduler.worker_client import WorkerInfo


class InvalidRequest(ValueError):
    """A GenerateRequest that breaks the contract; the message names the field."""


@dataclass(frozen=True)
class GenerateArgs:
    request_id: str
    prompt_token_ids: list[int]
    sampling: SamplingParams
    stopping: StoppingCriteria


_FINISH_REASONS = {
    SequenceStatus.FINISHED_EOS_TOKEN: scheduler_pb2.FINISH_REASON_EOS_TOKEN,
    SequenceStatus.FINISHED_STOP_TOKEN: scheduler_pb2.FINISH_REASON_STOP_TOKEN,
    SequenceStatus.FINISHED_LENGTH: scheduler_pb2.FINISH_REASON_LENGTH,
    SequenceStatus.FINISHED_CONTEXT_LENGTH: scheduler_pb2.FINISH_REASON_CONTEXT_LENGTH,
}


def _require(condition: bool, message: str) -> None:
    if not condition:
        raise InvalidRequest(message)


def sampling_from_pb(pb: common_pb2.SamplingParams, vocab_size: int) -> SamplingParams:
    _require(pb.temperature > 0, f"sampling.temperature must be > 0 (got {pb.temperature})")
    _require(0 < pb.top_p <= 1, f"sampling.top_p must be in (0, 1] (got {pb.top_p})")
    _require(0 < pb.typical_p <= 1, f"sampling.typical_p must be in (0, 1] (got {pb.typical_p})")
    _require(pb.repetition_penalty > 0, f"sampling.repetition_penalty must be > 0 (got {pb.repetition_penalty})")
    _require(pb.top_k < vocab_size, f"sampling.top_k must be < the vocabulary size {vocab_size} (got {pb.top_k})")
    _require(pb.num_top_logprobs <= vocab_size, f"sampling.num_top_logprobs must be <= {vocab_size}")
    return SamplingParams(
        do_sample=pb.do_sample, temperature=pb.temperature, top_k=pb.top_k, top_p=pb.top_p,
        typical_p=pb.typical_p, repetition_penalty=pb.repetition_penalty,
        frequency_penalty=pb.frequency_penalty, presence_penalty=pb.presence_penalty,
        seed=pb.seed if pb.HasField("seed") else None, num_top_logprobs=pb.num_top_logprobs,
        watermark=pb.watermark)


def generate_args_from_pb(pb: scheduler_pb2.GenerateRequest, info: WorkerInfo) -> GenerateArgs:
    """Validate a GenerateRequest against the model's limits; an absent `sampling` means greedy defaults."""
    _require(pb.request_id != "", "request_id must not be empty")
    prompt = list(pb.prompt_token_ids)
    _require(len(prompt) > 0, "prompt_token_ids must not be empty")
    _require(len(prompt) < info.max_model_len,
             f"prompt_token_ids has {len(prompt)} tokens; it must be shorter than max_model_len "
             f"{info.max_model_len}")
    _require(max(prompt) < info.vocab_size,
             f"prompt_token_ids holds id {max(prompt)}, outside the vocabulary of {info.vocab_size}")
    _require(pb.stopping.max_new_tokens > 0,
             f"stopping.max_new_tokens must be > 0 (got {pb.stopping.max_new_tokens})")
    sampling = sampling_from_pb(pb.sampling, info.vocab_size) if pb.HasField("sampling") else SamplingParams()
    stopping = StoppingCriteria(max_new_tokens=pb.stopping.max_new_tokens,
                                stop_token_ids=tuple(pb.stopping.stop_token_ids),
                                ignore_eos=pb.stopping.ignore_eos)
    return GenerateArgs(pb.request_id, prompt, sampling, stopping)


def event_to_pb(event: RequestOutput | RequestError) -> list[scheduler_pb2.GenerateResponse]:
    """One engine event as stream messages: a chunk, then `complete` when it is the last one."""
    if isinstance(event, RequestError):
        return [scheduler_pb2.GenerateResponse(error=scheduler_pb2.GenerateError(code=event.code,
                                                                                 message=event.message))]
    messages = []
    if event.token_ids:
        chunk = scheduler_pb2.TokenChunk(
            token_ids=event.token_ids, scores=event.scores,
            top_logprobs=[common_pb2.TopLogprobs(token_ids=t.token_ids, logprobs=t.logprobs)
                          for t in event.top_logprobs],
            batch_size=event.metrics.max_batch_size if event.metrics else 0,
            queue_wait_us=event.metrics.queue_wait_us if event.metrics else 0)
        messages.append(scheduler_pb2.GenerateResponse(chunk=chunk))
    if event.finish_status is not None:
        metrics = event.metrics
        complete = scheduler_pb2.GenerateComplete(
            finish_reason=_FINISH_REASONS.get(event.finish_status, scheduler_pb2.FINISH_REASON_UNSPECIFIED),
            num_prompt_tokens=event.num_prompt_tokens, num_generated_tokens=event.num_generated_tokens,
            queue_wait_us=metrics.queue_wait_us if metrics else 0,
            first_token_us=metrics.first_token_us if metrics else 0,
            decode_us=metrics.decode_us if metrics else 0,
            max_batch_size=metrics.max_batch_size if metrics else 0)
        messages.append(scheduler_pb2.GenerateResponse(complete=complete))
    return messages


def stats_to_pb(stats: EngineStats) -> scheduler_pb2.SchedulerStats:
    return scheduler_pb2.SchedulerStats(
        num_running=stats.num_running, num_waiting=stats.num_waiting,
        num_used_kv_blocks=stats.num_used_kv_blocks, num_total_kv_blocks=stats.num_total_kv_blocks,
        num_preemptions=stats.num_preemptions, num_steps=stats.num_steps, spec=_spec_to_pb("", stats.spec),
        spec_segments=[_spec_to_pb(name, segment) for name, segment in sorted(stats.spec_segments.items())])


def _spec_to_pb(segment: str, stats: SegmentStats) -> scheduler_pb2.SpecStats:
    return scheduler_pb2.SpecStats(
        segment=segment, num_verified=stats.num_verified, num_draft_tokens=stats.num_draft_tokens,
        num_accepted_tokens=stats.num_accepted_tokens, acceptance_rate_by_depth=stats.acceptance_rate_by_depth,
        num_accepted_by_depth=stats.num_accepted_by_depth)
