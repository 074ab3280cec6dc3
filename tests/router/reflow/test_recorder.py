"""The recorder: the hot path never blocks or raises, bounds hold, every drop is counted."""

from __future__ import annotations

import asyncio
import json
import threading
import time

import pytest

from router.reflow.chunks import Chunk, FinishState
from router.reflow.config import RecorderConfig
from router.reflow.queue import ChunkQueue, SqliteQueue
from router.reflow.recorder import Recorder


class StalledQueue(ChunkQueue):
    """put() blocks until released (a hung disk or broker); then behaves like a list."""

    def __init__(self, is_failing: bool = False):
        self.release = threading.Event()
        self.is_failing = is_failing
        self.payloads: list[bytes] = []

    def put(self, payloads):
        if self.is_failing:
            raise ConnectionError("queue down")
        self.release.wait()
        self.payloads += payloads

    def claim(self, max_items):
        return []

    def ack(self, delivery_ids):
        pass

    def depth(self):
        return len(self.payloads)

    def oldest_age_s(self):
        return 0.0


def _config(tmp_path, **overrides) -> RecorderConfig:
    return RecorderConfig(spill_dir=str(tmp_path / "spill"), flush_interval_s=0.005, **overrides)


def _chunks(payloads) -> list[Chunk]:
    return [Chunk.from_bytes(p) for p in payloads]


def test_request_and_deltas_become_bounded_tagged_chunks(tmp_path):
    queue = SqliteQueue(tmp_path / "q.db")
    recorder = Recorder(queue, _config(tmp_path, max_chunk_bytes=32)).start()
    body = json.dumps({"model": "m", "messages": [{"role": "user", "content": "x" * 100}]}).encode()
    with recorder.start_request("r1", "client", "m", body, headers={"X-Session-Id": "sess"}) as recording:
        recording.delta("Hel", [1])
        recording.delta("lo", [2])
        recording.finish(FinishState.COMPLETE, usage={"completion_tokens": 2})
    recorder.close()
    chunks = _chunks(d.payload for d in SqliteQueue(tmp_path / "q.db").claim(100))
    requests = [c for c in chunks if c.direction == "request"]
    assert all(len(c.text.encode()) <= 32 for c in requests)
    assert "".join(c.text for c in requests).encode() == body
    assert [c.seq for c in requests] == list(range(len(requests)))
    assert {(c.request_id, c.client_id, c.service_id, c.session_id) for c in chunks} == {("r1", "client", "m", "sess")}
    final = chunks[-1]
    assert (final.seq, final.finish, final.num_request_chunks, final.usage) == (
        2, FinishState.COMPLETE, len(requests), {"completion_tokens": 2})


@pytest.mark.parametrize("exc, state", [(asyncio.CancelledError, FinishState.CANCELLED),
                                        (TimeoutError, FinishState.DEADLINE),
                                        (RuntimeError, FinishState.ERROR)])
def test_every_exit_path_gives_one_final_chunk(tmp_path, exc, state):
    queue = StalledQueue()
    queue.release.set()
    recorder = Recorder(queue, _config(tmp_path)).start()
    with pytest.raises(exc):
        with recorder.start_request("r1", "c", "m", b"{}") as recording:
            recording.delta("a")
            raise exc()
    recording.finish(FinishState.COMPLETE)  # a later finish() is ignored
    recorder.close()
    finals = [c for c in _chunks(queue.payloads) if c.finish is not None]
    assert [c.finish for c in finals] == [state]


def test_hot_path_never_blocks_and_counts_drops_when_the_writer_is_stalled(tmp_path):
    queue = StalledQueue()
    recorder = Recorder(queue, _config(tmp_path, max_chunk_bytes=1024, max_buffer_bytes=64 * 1024)).start()
    recording = recorder.start_request("r1", "c", "m", b'{"prompt": "p"}')
    slowest = 0.0
    for index in range(5000):
        started = time.perf_counter()
        recording.delta("token %d " % index, [index])
        slowest = max(slowest, time.perf_counter() - started)
        assert recorder.stats().buffered_bytes <= 64 * 1024
    recording.finish(FinishState.COMPLETE)
    stats = recorder.stats()
    # A blocked put would hold the caller for good (the queue never takes), and a put with a timeout for at
    # least its timeout; the bound leaves room for a loaded machine descheduling this thread.
    assert slowest < 1.0
    assert stats.num_chunks_dropped["buffer_full"] > 0
    assert stats.num_chunks_recorded + stats.num_chunks_dropped["buffer_full"] == 5000 + 2
    queue.release.set()
    recorder.close()
    final = _chunks(queue.payloads)[-1]
    assert final.finish == FinishState.COMPLETE  # the final chunk had reserved room
    assert final.num_dropped == stats.num_chunks_dropped["buffer_full"]
    assert len(queue.payloads) == stats.num_chunks_recorded


def test_queue_outage_spills_to_disk_and_replays(tmp_path):
    queue = StalledQueue(is_failing=True)
    queue.release.set()
    recorder = Recorder(queue, _config(tmp_path)).start()
    recording = recorder.start_request("r1", "c", "m", b"{}")
    for index in range(50):
        recording.delta(str(index))
    recording.finish(FinishState.COMPLETE)
    deadline = time.monotonic() + 5
    while recorder.stats().buffered_bytes and time.monotonic() < deadline:
        time.sleep(0.01)
    assert recorder.stats().spill_bytes > 0 and queue.payloads == []
    queue.is_failing = False
    deadline = time.monotonic() + 5
    while recorder.stats().spill_bytes and time.monotonic() < deadline:
        time.sleep(0.05)
    recorder.close()
    assert sorted(c.seq for c in _chunks(queue.payloads) if c.direction == "response") == list(range(51))
    assert recorder.stats().num_chunks_dropped == {"buffer_full": 0, "spill_full": 0, "internal_error": 0}


def test_spill_full_drops_are_counted(tmp_path):
    queue = StalledQueue(is_failing=True)
    recorder = Recorder(queue, _config(tmp_path, max_spill_bytes=0)).start()
    recorder.start_request("r1", "c", "m", b"{}").finish(FinishState.REJECTED)
    recorder.close()
    assert recorder.stats().num_chunks_dropped["spill_full"] == 2


def test_unserializable_values_are_counted_not_raised(tmp_path):
    queue = StalledQueue()
    queue.release.set()
    recorder = Recorder(queue, _config(tmp_path)).start()
    recording = recorder.start_request("r1", "c", "m", b"{}")
    recording.finish(FinishState.COMPLETE, usage={"tokens": object()})
    recorder.close()
    assert recorder.stats().num_chunks_dropped["internal_error"] == 1
