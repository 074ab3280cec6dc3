"""The scheduler's gRPC client to the worker; protobuf is converted here and nowhere deeper.

In: SchedulerOutput (plain dataclasses). Out: WorkerInfo, {seq_id: SampledTokens}
and health, all plain dataclasses. Every RPC failure surfaces as WorkerError.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import grpc

from protos.segserve.v1 import common_pb2, worker_pb2, worker_pb2_grpc
from scheduler.draft_trees import is_tree_path, max_depth_of
from scheduler.outputs import SampledTokens, SchedulerOutput, TopLogprobs
from scheduler.sequence import SamplingParams

_CHANNEL_OPTIONS = [("grpc.max_send_message_length", 64 << 20), ("grpc.max_receive_message_length", 64 << 20)]


class WorkerError(RuntimeError):
    """The worker could not be reached or answered something unusable."""


@dataclass(frozen=True)
class WorkerInfo:
    """The worker's static facts (the wire's WorkerInfo)."""

    model_name: str
    num_kv_blocks: int
    block_size: int
    max_model_len: int
    vocab_size: int
    eos_token_ids: tuple[int, ...]
    device: str = ""
    dtype: str = ""


@dataclass(frozen=True)
class WorkerHealth:
    is_ready: bool
    detail: str = ""


def info_from_pb(pb: worker_pb2.WorkerInfo) -> WorkerInfo:
    return WorkerInfo(pb.model_name, pb.num_kv_blocks, pb.block_size, pb.max_model_len, pb.vocab_size,
                      tuple(pb.eos_token_ids), pb.device, pb.dtype)


def info_to_pb(info: WorkerInfo) -> worker_pb2.WorkerInfo:
    return worker_pb2.WorkerInfo(
        model_name=info.model_name, num_kv_blocks=info.num_kv_blocks, block_size=info.block_size,
        max_model_len=info.max_model_len, vocab_size=info.vocab_size, eos_token_ids=info.eos_token_ids,
        device=info.device, dtype=info.dtype)


def sampling_to_pb(params: SamplingParams) -> common_pb2.SamplingParams:
    return common_pb2.SamplingParams(
        do_sample=params.do_sample, temperature=params.temperature, top_k=params.top_k, top_p=params.top_p,
        typical_p=params.typical_p, repetition_penalty=params.repetition_penalty,
        frequency_penalty=params.frequency_penalty, presence_penalty=params.presence_penalty,
        seed=params.seed, num_top_logprobs=params.num_top_logprobs, watermark=params.watermark)


def step_request_to_pb(output: SchedulerOutput) -> worker_pb2.StepRequest:
    return worker_pb2.StepRequest(
        new_sequences=[
            worker_pb2.NewSequence(seq_id=new.seq_id, sampling=sampling_to_pb(new.sampling),
                                   num_prompt_tokens=new.num_prompt_tokens)
            for new in output.new_sequences],
        sequences=[
            worker_pb2.ScheduledSequence(
                seq_id=work.seq_id, token_ids=work.token_ids, num_computed_tokens=work.num_computed_tokens,
                block_table=work.block_table, position_ids=work.position_ids,
                attention_mask=work.attention_mask, sample_indices=work.sample_indices,
                draft_parents=work.draft_parents)
            for work in output.scheduled],
        finished_seq_ids=output.finished_seq_ids,
    )


def step_response_from_pb(response: worker_pb2.StepResponse, output: SchedulerOutput) -> dict[str, SampledTokens]:
    """Sampled tokens per sequence, checked against what was asked (one token per sample index, or a
    path of the candidate tree plus one token)."""
    sampled = {
        out.seq_id: SampledTokens(
            token_ids=list(out.token_ids), scores=list(out.scores),
            top_logprobs=[TopLogprobs(list(t.token_ids), list(t.logprobs)) for t in out.top_logprobs])
        for out in response.outputs}
    _check_sampled(sampled, output)
    return sampled


def _check_sampled(sampled: Mapping[str, SampledTokens], output: SchedulerOutput) -> None:
    for work in output.scheduled:
        if not work.is_sampled:
            continue
        sample = sampled.get(work.seq_id)
        if sample is None:
            raise WorkerError(f"worker step returned no output for sequence {work.seq_id!r}")
        if len(sample.scores) != len(sample.token_ids):
            raise WorkerError(f"worker step returned {len(sample.token_ids)} tokens but {len(sample.scores)} "
                              f"scores for sequence {work.seq_id!r}")
        if work.draft_parents:
            if not 1 <= len(sample.token_ids) <= max_depth_of(work.draft_parents) + 1 or not is_tree_path(
                    sample.token_ids, work.token_ids[1:], work.draft_parents):
                raise WorkerError(f"worker step returned {sample.token_ids} for sequence {work.seq_id!r}: "
                                  f"not a path of its candidate tree plus one token")
        elif len(sample.token_ids) != len(work.sample_indices):
            raise WorkerError(
                f"worker step returned {len(sample.token_ids)} tokens for sequence {work.seq_id!r}, "
                f"expected {len(work.sample_indices)}")


def _rpc_error(what: str, exc: grpc.aio.AioRpcError) -> WorkerError:
    return WorkerError(f"worker {what} failed: {exc.code().name}: {exc.details()}")


class WorkerClient:
    """One grpc.aio channel to the worker; create it on the event loop that uses it."""

    def __init__(self, address: str, step_timeout_s: float | None = None):
        self.address = address
        self.step_timeout_s = step_timeout_s
        self._channel = grpc.aio.insecure_channel(address, options=_CHANNEL_OPTIONS)
        self._stub = worker_pb2_grpc.WorkerStub(self._channel)

    async def get_info(self, timeout_s: float = 10.0) -> WorkerInfo:
        try:
            return info_from_pb(await self._stub.GetInfo(worker_pb2.WorkerInfoRequest(), timeout=timeout_s))
        except grpc.aio.AioRpcError as exc:
            raise _rpc_error("GetInfo", exc) from exc

    async def step(self, output: SchedulerOutput) -> dict[str, SampledTokens]:
        try:
            response = await self._stub.Step(step_request_to_pb(output), timeout=self.step_timeout_s)
        except grpc.aio.AioRpcError as exc:
            raise _rpc_error("Step", exc) from exc
        return step_response_from_pb(response, output)

    async def health(self, timeout_s: float = 5.0) -> WorkerHealth:
        """The worker's readiness; unreachable counts as not ready (never raises for RPC errors)."""
        try:
            response = await self._stub.Health(worker_pb2.HealthRequest(), timeout=timeout_s)
        except grpc.aio.AioRpcError as exc:
            return WorkerHealth(False, f"worker at {self.address} unreachable: {exc.code().name}")
        return WorkerHealth(response.ready, response.detail)

    async def close(self) -> None:
        await self._channel.close()
