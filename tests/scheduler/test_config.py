"""max_num_seqs: automatic from the worker's KV pool unless set, and the flag that sets it."""

from __future__ import annotations

import argparse
import asyncio

import pytest

from protos.segserve.v1 import worker_pb2_grpc
from scheduler.config import SchedulerConfig, auto_max_num_seqs
from scheduler.servicer import start_server, stop_server
from segserve.flags import add_dataclass_args, from_args, to_argv
from tests.support.fake_services import FakeWorkerServicer, serve
from tests.support.fakes import FakeWorker, increment


def test_the_pool_of_the_default_model_on_cpu_holds_28_sequences_of_1024_tokens():
    # gemma-3-270m, fp32, 1 GiB of KV: 1,820 blocks of 16 tokens.
    assert auto_max_num_seqs(num_kv_blocks=1820, block_size=16, max_model_len=32768) == 28


def test_a_large_pool_is_capped_at_256_and_a_small_one_keeps_16():
    assert auto_max_num_seqs(num_kv_blocks=65536, block_size=16, max_model_len=512) == 256
    assert auto_max_num_seqs(num_kv_blocks=256 * 64, block_size=16, max_model_len=32768) == 256
    assert auto_max_num_seqs(num_kv_blocks=255 * 64, block_size=16, max_model_len=32768) == 255
    assert auto_max_num_seqs(num_kv_blocks=64, block_size=4, max_model_len=128) == 16
    assert auto_max_num_seqs(num_kv_blocks=1, block_size=16, max_model_len=32768) == 16


def test_a_model_shorter_than_the_typical_length_counts_sequences_of_its_max_model_len():
    # 128 tokens = 8 blocks of 16: 400 blocks hold 50 such sequences.
    assert auto_max_num_seqs(num_kv_blocks=400, block_size=16, max_model_len=128) == 50
    # A block size that does not divide the length: 1024 tokens need 74 blocks of 14.
    assert auto_max_num_seqs(num_kv_blocks=74 * 20, block_size=14, max_model_len=4096) == 20


def test_an_empty_pool_is_refused():
    with pytest.raises(ValueError, match="num_kv_blocks"):
        auto_max_num_seqs(num_kv_blocks=0, block_size=16, max_model_len=512)


def test_max_num_seqs_is_automatic_by_default_and_a_set_value_wins():
    assert SchedulerConfig().max_num_seqs is None
    assert SchedulerConfig().resolve_max_num_seqs(1820, 16, 32768) == 28
    assert SchedulerConfig(max_num_seqs=7).resolve_max_num_seqs(1820, 16, 32768) == 7
    with pytest.raises(ValueError, match="max_num_seqs"):
        SchedulerConfig(max_num_seqs=-1)


def test_the_flag_sets_a_number_and_unset_stays_automatic():
    parser = argparse.ArgumentParser()
    add_dataclass_args(parser, SchedulerConfig)
    assert from_args(SchedulerConfig, parser.parse_args(["--max-num-seqs", "64"])).max_num_seqs == 64
    assert from_args(SchedulerConfig, parser.parse_args([])).max_num_seqs is None
    # The launcher's argv for the scheduler process: a set value travels, automatic stays unset.
    assert to_argv(SchedulerConfig(max_num_seqs=5))[:2] == ["--max-num-seqs", "5"]
    assert "--max-num-seqs" not in to_argv(SchedulerConfig())
    assert from_args(SchedulerConfig, parser.parse_args(to_argv(SchedulerConfig(max_num_seqs=5)))).max_num_seqs == 5


async def _engine_max_num_seqs(worker: FakeWorker, **config) -> int:
    """The max_num_seqs the scheduler's engine runs with once it connected to `worker`."""
    worker_server = await serve(worker_pb2_grpc.add_WorkerServicer_to_server, FakeWorkerServicer(worker))
    server, engine = await start_server(SchedulerConfig(worker_address=f"127.0.0.1:{worker_server.bound_port}",
                                                        port=0, **config))
    try:
        for _ in range(500):
            if engine.is_connected:
                return engine.connected[0].scheduler.max_num_seqs
            await asyncio.sleep(0.01)
        raise AssertionError("the scheduler did not connect to the fake worker")
    finally:
        await stop_server(server, engine)
        await worker_server.stop(None)


async def test_the_engine_sizes_the_batch_from_the_workers_kv_pool_when_unset():
    worker = FakeWorker(increment(300), 300, [299], num_kv_blocks=4096, block_size=4, max_model_len=512)
    assert await _engine_max_num_seqs(worker) == 4096 // (512 // 4) == 32
    large = FakeWorker(increment(300), 300, [299], num_kv_blocks=65536, block_size=16, max_model_len=2048)
    assert await _engine_max_num_seqs(large) == 256
    assert await _engine_max_num_seqs(large, max_num_seqs=3) == 3
