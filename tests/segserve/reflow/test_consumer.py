"""The consumer: reassembly, session merge, idempotency, crash and sink-outage safety, redaction."""

from __future__ import annotations

import contextlib
import json
import os
import random
import signal
import subprocess
import sys
import time

import pytest

from router.reflow.chunks import FinishState
from router.reflow.config import RecorderConfig
from router.reflow.queue import SqliteQueue, open_queue
from router.reflow.recorder import Recorder
from segserve.reflow.config import ConsumerConfig
from segserve.reflow.consumer import Consumer
from segserve.reflow.sink import JsonlSink
from tests.support.reflow_helpers import read_logs, record_chats, redis_server


@pytest.fixture(params=["sqlite", "redis"])
def queue_url(request, tmp_path):
    if request.param == "sqlite":
        yield f"sqlite:///{tmp_path}/queue.db"
    else:
        with redis_server(tmp_path) as url:
            yield url


def _record(queue_url, tmp_path, num_sessions=4, num_turns=3) -> dict[str, list[str]]:
    recorder = Recorder(open_queue(queue_url), RecorderConfig(spill_dir=str(tmp_path / "spill"),
                                                              max_chunk_bytes=64)).start()
    expected = record_chats(recorder, num_sessions, num_turns)
    recorder.close()
    return expected


def _drain(queue_url, sink_dir, **config) -> Consumer:
    config = ConsumerConfig(queue_url=queue_url, sink_dir=str(sink_dir), is_drain=True, **config)
    queue = open_queue(queue_url, visibility_timeout_s=config.visibility_timeout_s)
    consumer = Consumer(queue, JsonlSink(sink_dir), config)
    consumer.run()
    queue.close()
    return consumer


def _assert_logs_match(sink_dir, expected: dict[str, list[str]]) -> None:
    logs = read_logs(sink_dir)
    assert sorted(tuple(t["request_id"] for t in turns) for turns in logs) == sorted(map(tuple, expected.values()))
    for turns in logs:
        assert len({t["session_id"] for t in turns}) == 1
        for turn in turns:
            assert turn["finish"] == "complete" and turn["num_missing_chunks"] == 0
            _, session, number = turn["request_id"].split("-")
            assert turn["response_text"] == f"answer {number} to chat {session}, in several words"
            assert turn["request"]["messages"][-1]["content"] == f"question {number} of chat {session}"


def test_sessions_merge_into_one_log_with_turns_in_order(queue_url, tmp_path):
    expected = _record(queue_url, tmp_path)
    consumer = _drain(queue_url, tmp_path / "logs")
    _assert_logs_match(tmp_path / "logs", expected)
    assert consumer.num_records_written == 12 and open_queue(queue_url).depth() == 0


def test_every_chunk_twice_and_shuffled_gives_identical_logs(tmp_path):
    expected = _record(f"sqlite:///{tmp_path}/recorded.db", tmp_path)
    payloads = [d.payload for d in SqliteQueue(tmp_path / "recorded.db").claim(10_000)]
    open_queue(f"sqlite:///{tmp_path}/once.db").put(payloads)
    doubled = payloads * 2
    random.Random(0).shuffle(doubled)
    open_queue(f"sqlite:///{tmp_path}/twice.db").put(doubled)
    _drain(f"sqlite:///{tmp_path}/once.db", tmp_path / "once")
    consumer = _drain(f"sqlite:///{tmp_path}/twice.db", tmp_path / "twice")
    assert read_logs(tmp_path / "twice") == read_logs(tmp_path / "once")
    assert consumer.assembler.num_duplicates == len(payloads)
    _assert_logs_match(tmp_path / "twice", expected)


def test_a_stream_cut_off_is_written_once_as_incomplete(tmp_path):
    url = f"sqlite:///{tmp_path}/queue.db"
    recorder = Recorder(open_queue(url), RecorderConfig(spill_dir=str(tmp_path / "spill"))).start()
    recording = recorder.start_request("cut", "c", "m", b'{"prompt": "p"}')
    recording.delta("partial")  # the router dies here: no finish()
    recorder.close()
    _drain(url, tmp_path / "logs", incomplete_after_s=0.1)
    [[turn]] = read_logs(tmp_path / "logs")
    assert (turn["request_id"], turn["finish"], turn["response_text"]) == ("cut", "incomplete", "partial")


class FlakySink(JsonlSink):
    def __init__(self, sink_dir):
        super().__init__(sink_dir)
        self.is_down = True

    def write(self, records):
        if self.is_down:
            raise OSError("sink unavailable")
        super().write(records)


def test_sink_outage_loses_nothing_holds_bounded_memory_and_drains_after(tmp_path):
    url = f"sqlite:///{tmp_path}/queue.db"
    expected = _record(url, tmp_path, num_sessions=10, num_turns=4)
    queue = open_queue(url, visibility_timeout_s=0.2)
    sink = FlakySink(tmp_path / "logs")
    consumer = Consumer(queue, sink, ConsumerConfig(claim_batch=50, max_held_chunks=200))
    for _ in range(30):
        consumer.step()
        assert consumer.assembler.num_held_deliveries <= 200
    assert consumer.num_sink_failures > 0 and read_logs(tmp_path / "logs") == []
    sink.is_down = False
    while queue.depth():
        consumer.step()
    _assert_logs_match(tmp_path / "logs", expected)


def test_redaction_happens_before_the_write(tmp_path):
    url = f"sqlite:///{tmp_path}/queue.db"
    recorder = Recorder(open_queue(url), RecorderConfig(spill_dir=str(tmp_path / "spill"))).start()
    body = json.dumps({"messages": [{"role": "user", "content": "I am bob@example.com, key sk-abcdefghijklmnop1234"}]})
    recording = recorder.start_request("r1", "c", "m", body.encode())
    recording.delta("Call +44 20 7946 0958", [5, 6])
    recording.delta("or mail carol@example.com", [7, 8], choice=1)
    recording.finish(FinishState.COMPLETE)
    recorder.close()
    _drain(url, tmp_path / "logs", redact=True)
    text = (tmp_path / "logs").joinpath(os.listdir(tmp_path / "logs")[0]).read_text()
    assert "bob@" not in text and "sk-abc" not in text and "7946" not in text and "carol@" not in text
    [[turn]] = read_logs(tmp_path / "logs")
    assert turn["request"]["messages"][0]["content"] == "I am [EMAIL], key [API_KEY]"
    assert (turn["response_text"], turn["response_token_ids"]) == ("Call [PHONE]", [])
    assert turn["other_choices"] == [{"index": 1, "text": "or mail [EMAIL]", "token_ids": []}]


@pytest.mark.parametrize("backend", ["sqlite", "redis"])
def test_killing_the_consumer_repeatedly_leaves_zero_duplicates(tmp_path, backend):
    sqlite_url = contextlib.nullcontext(f"sqlite:///{tmp_path}/queue.db")
    with redis_server(tmp_path) if backend == "redis" else sqlite_url as url:
        expected = _record(url, tmp_path, num_sessions=30, num_turns=6)
        queue = open_queue(url)
        command = [sys.executable, "-m", "segserve.cli", "reflow", "consume", "--queue-url", url,
                   "--sink-dir", str(tmp_path / "logs"), "--claim-batch", "20", "--visibility-timeout-s", "0.3",
                   "--drain"]
        num_kills = 0
        for _ in range(4):
            depth = queue.depth()
            process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            while process.poll() is None and queue.depth() >= depth - 100:
                time.sleep(0.005)
            if process.poll() is None:
                process.send_signal(signal.SIGKILL)
                num_kills += 1
            process.wait()
        assert num_kills >= 2
        subprocess.run(command, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, timeout=60)
        assert queue.depth() == 0
        queue.close()
    _assert_logs_match(tmp_path / "logs", expected)


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_the_consume_command_stops_on_sigterm_and_sigint_with_its_count(tmp_path, sig):
    """Not draining, it waits for more; the signal ends its loop between claims, and it says what it wrote."""
    url = f"sqlite:///{tmp_path}/queue.db"
    expected = _record(url, tmp_path, num_sessions=3, num_turns=2)
    queue = open_queue(url)
    command = [sys.executable, "-m", "segserve.cli", "reflow", "consume", "--queue-url", url,
               "--sink-dir", str(tmp_path / "logs")]
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    try:
        deadline = time.monotonic() + 60
        while queue.depth() > 0:
            assert process.poll() is None and time.monotonic() < deadline
            time.sleep(0.05)
        process.send_signal(sig)
        out, _ = process.communicate(timeout=10)
    finally:
        process.kill()
        queue.close()
    assert process.returncode == 0
    assert out.strip().endswith(f"{sum(map(len, expected.values()))} records written")
    _assert_logs_match(tmp_path / "logs", expected)
