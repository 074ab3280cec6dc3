"""The worker's gRPC tier, in process: GetInfo, Health, Steps, and bad requests as INVALID_ARGUMENT."""

from __future__ import annotations

import asyncio
import contextlib
import socket

import grpc
import numpy as np
import pytest

from protos.segserve.v1 import common_pb2, worker_pb2, worker_pb2_grpc
from worker.config import WorkerConfig
from worker.messages import InvalidRequest, ScheduledSequence, pack_mask, unpack_mask
from worker.model_runner import ModelRunner
from worker.server import WorkerServicer, serve, start_server

GREEDY = common_pb2.SamplingParams(temperature=1.0, top_p=1.0, typical_p=1.0, repetition_penalty=1.0)


@pytest.fixture(scope="module")
def runner(tiny_gemma3_dir):
    runner = ModelRunner(WorkerConfig(model=str(tiny_gemma3_dir), num_kv_blocks=32, block_size=4, dtype="float32"))
    runner.warm_up()
    return runner


@pytest.fixture
async def served():
    """A server with no model yet, and a stub talking to it over localhost."""
    servicer = WorkerServicer()
    server, port = await start_server(servicer, "127.0.0.1", 0)
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}")
    yield servicer, worker_pb2_grpc.WorkerStub(channel)
    await channel.close()
    await server.stop(grace=None)


def _new(seq_id: str, num_prompt: int, sampling=GREEDY) -> worker_pb2.NewSequence:
    return worker_pb2.NewSequence(seq_id=seq_id, sampling=sampling, num_prompt_tokens=num_prompt)


async def test_health_and_info_follow_loading(served, runner):
    servicer, stub = served
    health = await stub.Health(worker_pb2.HealthRequest())
    assert not health.ready and "loading" in health.detail
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await stub.GetInfo(worker_pb2.WorkerInfoRequest())
    assert err.value.code() == grpc.StatusCode.UNAVAILABLE
    servicer.attach(runner)
    assert (await stub.Health(worker_pb2.HealthRequest())).ready
    info = await stub.GetInfo(worker_pb2.WorkerInfoRequest())
    assert (info.num_kv_blocks, info.block_size, info.vocab_size, info.model_name) == (32, 4, 400,
                                                                                        runner.info().model_name)
    assert list(info.eos_token_ids) == list(runner.info().eos_token_ids)


async def test_steps_decode_and_match_in_process_runner(served, runner):
    servicer, stub = served
    servicer.attach(runner)
    prompt = [1, 40, 41, 42, 43, 44]
    first = worker_pb2.StepRequest(
        new_sequences=[_new("a", len(prompt))],
        sequences=[worker_pb2.ScheduledSequence(seq_id="a", token_ids=prompt, block_table=[3, 7], sample_indices=[5])],
    )
    reply = await stub.Step(first)
    assert [o.seq_id for o in reply.outputs] == ["a"] and reply.compute_us > 0
    tokens = list(reply.outputs[0].token_ids)
    for _ in range(3):
        step = worker_pb2.ScheduledSequence(seq_id="a", token_ids=[tokens[-1]], num_computed_tokens=len(prompt) +
                                            len(tokens) - 1, block_table=[3, 7, 9], sample_indices=[0])
        tokens += (await stub.Step(worker_pb2.StepRequest(sequences=[step]))).outputs[0].token_ids
    await stub.Step(worker_pb2.StepRequest(finished_seq_ids=["a"]))
    # A tree step over the wire: root plus two children, all sampled.
    mask = np.array([[1, 0, 0], [1, 1, 0], [1, 0, 1]], dtype=bool)
    tree = worker_pb2.ScheduledSequence(seq_id="b", token_ids=[5, 6, 7], block_table=[0], position_ids=[0, 1, 1],
                                        attention_mask=pack_mask(mask), sample_indices=[0, 1, 2])
    reply = await stub.Step(worker_pb2.StepRequest(new_sequences=[_new("b", 1)], sequences=[tree]))
    assert len(reply.outputs[0].token_ids) == 3 and len(reply.outputs[0].scores) == 3
    # Greedy decoding over gRPC equals the runner driven in process (stale state was dropped above).
    expected = _decode_in_process(runner, prompt, 4)
    assert tokens == expected


def _decode_in_process(runner: ModelRunner, prompt: list[int], num_new: int) -> list[int]:
    from worker.messages import NewSequence, StepRequest
    from worker.sampler import SamplingParams

    work = ScheduledSequence("c", prompt, 0, [20, 21, 22], sample_indices=[len(prompt) - 1])
    tokens = runner.step(StepRequest([work], [NewSequence("c", SamplingParams(), len(prompt))]))[0].token_ids
    while len(tokens) < num_new:
        work = ScheduledSequence("c", [tokens[-1]], len(prompt) + len(tokens) - 1, [20, 21, 22], sample_indices=[0])
        tokens += runner.step(StepRequest([work]))[0].token_ids
    runner.step(StepRequest(finished_seq_ids=["c"]))
    return tokens


@pytest.mark.parametrize("request_pb", [
    worker_pb2.StepRequest(sequences=[worker_pb2.ScheduledSequence(seq_id="ghost", token_ids=[1], block_table=[0])]),
    worker_pb2.StepRequest(new_sequences=[_new("s", 2)],
                           sequences=[worker_pb2.ScheduledSequence(seq_id="s", token_ids=[1, 2, 3, 4, 5],
                                                                   block_table=[0])]),
    worker_pb2.StepRequest(new_sequences=[_new("s", 2)],
                           sequences=[worker_pb2.ScheduledSequence(seq_id="s", token_ids=[1, 9999], block_table=[0])]),
    worker_pb2.StepRequest(new_sequences=[_new("s", 2)],
                           sequences=[worker_pb2.ScheduledSequence(seq_id="s", token_ids=[1, 2], block_table=[0],
                                                                   attention_mask=b"\x01\x02\x03")]),
    worker_pb2.StepRequest(new_sequences=[_new("s", 2, common_pb2.SamplingParams(temperature=0.0))]),
], ids=["unknown-seq", "short-block-table", "out-of-vocab", "bad-mask-size", "bad-sampling"])
async def test_bad_requests_are_invalid_argument(served, runner, request_pb):
    servicer, stub = served
    servicer.attach(runner)
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await stub.Step(request_pb)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert (await stub.Health(worker_pb2.HealthRequest())).ready


async def test_serve_binds_loads_and_becomes_ready(tiny_gemma3_dir):
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    config = WorkerConfig(model=str(tiny_gemma3_dir), num_kv_blocks=8, block_size=4, port=port)
    task = asyncio.create_task(serve(config))
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        stub = worker_pb2_grpc.WorkerStub(channel)
        for _ in range(300):
            with contextlib.suppress(grpc.aio.AioRpcError):
                if (await stub.Health(worker_pb2.HealthRequest(), timeout=1)).ready:
                    break
            assert not task.done(), task.exception()
            await asyncio.sleep(0.1)
        info = await stub.GetInfo(worker_pb2.WorkerInfoRequest())
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task
    assert (info.num_kv_blocks, info.block_size) == (8, 4)


def test_mask_packing_round_trips_and_checks_size():
    rng = np.random.default_rng(0)
    for n in (1, 3, 8, 11):
        mask = rng.random((n, n)) < 0.5
        packed = pack_mask(mask)
        assert len(packed) == (n * n + 7) // 8
        np.testing.assert_array_equal(unpack_mask(packed, n), mask)
    # bit [i][j] is bit (i * n + j), little-endian within each byte
    assert pack_mask(np.array([[True, False], [True, True]])) == bytes([0b1101])
    with pytest.raises(InvalidRequest):
        unpack_mask(b"\x00", 3)


def test_scheduled_sequence_survives_the_wire():
    tree_mask = np.array([[1, 0, 0], [1, 1, 0], [1, 0, 1]], dtype=bool)
    seq = ScheduledSequence("t", [4, 5, 6], 10, [2, 3], position_ids=[10, 11, 11], attention_mask=tree_mask,
                            sample_indices=[1, 2])
    back = ScheduledSequence.from_pb(worker_pb2.ScheduledSequence.FromString(seq.to_pb().SerializeToString()))
    assert (back.seq_id, back.token_ids, back.num_computed_tokens, back.block_table, back.position_ids,
            back.sample_indices) == ("t", [4, 5, 6], 10, [2, 3], [10, 11, 11], [1, 2])
    np.testing.assert_array_equal(back.attention_mask, seq.attention_mask)
    assert back.visible_tokens(2) == [4, 6]
