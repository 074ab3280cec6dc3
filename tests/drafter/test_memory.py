"""The drafters' shared memory: the segment log (directory and Redis), snapshots, and real replicas sharing it."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import grpc
import pytest

from drafter.config import DrafterConfig
from drafter.memory import MANIFEST, SharedMemory, restore
from drafter.planner import DraftPlanner
from drafter.segment_log import LOG_SUFFIX, DirectorySegmentLog, LearnedSegment, RedisSegmentLog
from drafter.segments import parse_segments
from protos.segserve.v1 import common_pb2, drafter_pb2, drafter_pb2_grpc
from protos.segserve.v1.tree import CandidateTree
from tests.support.reflow_helpers import redis_server
from common.ports import free_port

RAW = {"segment": [{"name": "code", "start": 1, "end": 1, "max_depth": 8}]}
SEGMENT = [1, 30, 31, 32, 33, 34, 35, 1]
OTHER = [1, 50, 51, 52, 53, 1]


def proposal(planner: DraftPlanner, context: list[int]) -> tuple[int, ...]:
    """The code corpus's best continuation of context ( () when it knows none)."""
    found = planner.corpora["code"].propose(context, 8, 1)
    return found[0].token_ids if found else ()


def memory(tmp_path, origin: str, snapshot_dir=None, cursor=None) -> SharedMemory:
    segments = parse_segments(RAW)
    corpora, saved_cursor = restore(snapshot_dir, segments, "directory")
    return SharedMemory(DraftPlanner(segments, corpora), DirectorySegmentLog(tmp_path / "log", origin), snapshot_dir,
                        origin, "directory", cursor if cursor is not None else saved_cursor)


def test_the_directory_log_reads_every_writer_from_its_cursor_and_never_half_a_record(tmp_path):
    a, b = DirectorySegmentLog(tmp_path, "a"), DirectorySegmentLog(tmp_path, "b")
    a.append(LearnedSegment("a", "code", (1, 2, 3)))
    b.append(LearnedSegment("b", "json", (4,)))
    records, cursor = a.read(None, 100)
    assert sorted(records, key=lambda r: r.origin) == [LearnedSegment("a", "code", (1, 2, 3)),
                                                       LearnedSegment("b", "json", (4,))]
    assert a.read(cursor, 100) == ([], cursor)
    with open(tmp_path / f"b{LOG_SUFFIX}", "ab") as f:  # a writer caught in the middle of a record
        f.write(b"\x20\x00\x00\x00\x05")
    assert a.read(cursor, 100)[0] == []
    records, cursor = a.read(cursor, 1)
    a.append(LearnedSegment("a", "code", (9,) * 1000))
    records, cursor = a.read(cursor, 100)
    assert records == [LearnedSegment("a", "code", (9,) * 1000)]


def test_the_redis_log_reads_from_its_cursor(tmp_path):
    with redis_server(tmp_path) as url:
        one, two = RedisSegmentLog(url, "test:segments"), RedisSegmentLog(url, "test:segments")
        one.append(LearnedSegment("a", "code", (1, 2)))
        two.append(LearnedSegment("b", "code", (3,)))
        records, cursor = two.read(None, 1)
        assert records == [LearnedSegment("a", "code", (1, 2))]
        records, cursor = two.read(cursor, 10)
        assert records == [LearnedSegment("b", "code", (3,))]
        assert two.read(cursor, 10) == ([], cursor)


def test_a_segment_learned_by_one_replica_is_proposed_by_the_other(tmp_path):
    a, b = memory(tmp_path, "a"), memory(tmp_path, "b")
    a.learn("code", SEGMENT)
    assert proposal(a.planner, [1, 30]) == (31, 32, 33, 34, 35, 1)  # at once where it was learned
    assert proposal(b.planner, [1, 30]) == ()
    assert b.poll() == 1 and b.num_applied == 1
    assert proposal(b.planner, [1, 30]) == (31, 32, 33, 34, 35, 1)
    entries = a.planner.corpora["code"].num_entries
    a.poll()  # its own record is not applied twice
    assert a.num_applied == 0 and a.planner.corpora["code"].num_entries == entries


def test_a_restart_gets_the_snapshot_back_and_replays_the_log_after_it(tmp_path):
    snapshots = tmp_path / "snap"
    a = memory(tmp_path, "a", snapshots)
    a.learn("code", SEGMENT)
    a.poll()
    a.snapshot()
    assert (snapshots / MANIFEST).is_file() and not list(snapshots.glob(".*.tmp"))
    a.learn("code", OTHER)  # after the snapshot: only the log has it
    restarted = memory(tmp_path, "a-restarted", snapshots)  # a was killed: no snapshot at exit
    assert proposal(restarted.planner, [1, 30]) == (31, 32, 33, 34, 35, 1)
    assert proposal(restarted.planner, [1, 50]) == ()
    restarted.catch_up()
    assert proposal(restarted.planner, [1, 50]) == (51, 52, 53, 1)
    once = memory(tmp_path / "fresh", "x")
    once.learn("code", SEGMENT)
    once.learn("code", OTHER)
    # the snapshot's segment was not replayed on top of it
    assert restarted.planner.corpora["code"].num_entries == once.planner.corpora["code"].num_entries


def test_a_segment_that_could_not_be_published_is_retried(tmp_path):
    class FlakyLog(DirectorySegmentLog):
        failures = 1

        def append(self, record):
            if self.failures:
                self.failures -= 1
                raise ConnectionError("log down")
            super().append(record)

    segments = parse_segments(RAW)
    a = SharedMemory(DraftPlanner(segments), FlakyLog(tmp_path, "a"), None, "a", "directory")
    b = memory(tmp_path / "..", "b")
    b.log = DirectorySegmentLog(tmp_path, "b")
    a.learn("code", SEGMENT)  # the append fails; drafting and local learning go on
    assert proposal(a.planner, [1, 30]) and b.poll() == 0
    a.poll()
    assert b.poll() == 1 and proposal(b.planner, [1, 30]) == (31, 32, 33, 34, 35, 1)


# --- real drafter processes ---------------------------------------------------------------------------------------

def start_drafter(tiny_gemma3_dir, tmp_path, name: str, **flags) -> tuple[subprocess.Popen, str]:
    segments = tmp_path / "segments.toml"
    segments.write_text('[[segment]]\nname = "code"\nstart = 1\nend = 1\nmax_depth = 8\n')
    port = free_port()
    argv = [sys.executable, "-m", "segserve.cli", "drafter", "--port", str(port), "--tokenizer", str(tiny_gemma3_dir),
            "--segments-config", str(segments), "--replica-name", name]
    for flag, value in flags.items():
        argv += [f"--{flag.replace('_', '-')}", str(value)]
    log = open(tmp_path / f"{name}.log", "ab")
    process = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT)
    address = f"127.0.0.1:{port}"
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        try:
            with grpc.insecure_channel(address) as channel:
                drafter_pb2_grpc.DrafterStub(channel).Health(common_pb2.HealthRequest(), timeout=1)
            return process, address
        except grpc.RpcError:
            assert process.poll() is None, (tmp_path / f"{name}.log").read_text()
            time.sleep(0.1)
    process.kill()
    raise TimeoutError(f"drafter {name} did not start")


def draft(address: str, request_id: str, new: list[int], num_tokens: int, num_prompt: int = 0,
          finished: tuple[str, ...] = ()) -> CandidateTree:
    query = drafter_pb2.DraftQuery(request_id=request_id, new_token_ids=new, num_tokens=num_tokens,
                                   num_prompt_tokens=num_prompt, max_nodes=8)
    with grpc.insecure_channel(address) as channel:
        reply = drafter_pb2_grpc.DrafterStub(channel).Draft(
            drafter_pb2.DraftRequest(queries=[query], finished_request_ids=list(finished)), timeout=5).replies[0]
    return CandidateTree.from_pb(reply.tree)


def learn_through(address: str, request_id: str, segment: list[int]) -> None:
    """A request whose generated tokens close `segment` on the drafter at `address`."""
    draft(address, request_id, [10], 1, 1)
    draft(address, request_id, segment, 1 + len(segment))


def seconds_until_proposed(address: str, request_id: str, segment: list[int], limit_s: float) -> float:
    """Ask `address` again and again for a continuation of segment's first two tokens; seconds until it proposes
    the rest of the segment."""
    start = time.monotonic()
    while time.monotonic() - start < limit_s:
        tree = draft(address, request_id, [20, *segment[:2]], 3, 1, finished=(request_id,))
        if tree.token_ids[:len(segment) - 2] == tuple(segment[2:]):
            return time.monotonic() - start
        time.sleep(0.05)
    raise AssertionError(f"{address} did not propose {segment} within {limit_s} s")


def stop(process: subprocess.Popen) -> None:
    if process.poll() is None:
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(timeout=20)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


@pytest.mark.parametrize("log", ["directory", "redis"])
def test_a_segment_learned_on_drafter_a_is_proposed_by_drafter_b_within_a_second(tiny_gemma3_dir, tmp_path, log):
    with redis_server(tmp_path) as url:
        shared = {"redis_url": url} if log == "redis" else {"shared_log_dir": tmp_path / "log"}
        a, address_a = start_drafter(tiny_gemma3_dir, tmp_path, "a", **shared)
        b, address_b = start_drafter(tiny_gemma3_dir, tmp_path, "b", **shared)
        try:
            learn_through(address_a, "r1", SEGMENT)
            assert seconds_until_proposed(address_b, "r2", SEGMENT, limit_s=1.0) < 1.0
        finally:
            stop(a)
            stop(b)


def test_a_drafter_killed_with_sigkill_gets_its_snapshot_and_its_log_back(tiny_gemma3_dir, tmp_path):
    flags = {"corpus_dir": tmp_path / "corpora", "snapshot_interval_s": 0.3}
    process, address = start_drafter(tiny_gemma3_dir, tmp_path, "a", **flags)
    try:
        learn_through(address, "r1", SEGMENT)
        manifest = tmp_path / "corpora" / MANIFEST
        deadline = time.monotonic() + 10
        while not manifest.is_file() and time.monotonic() < deadline:
            time.sleep(0.05)
        time.sleep(0.7)  # at least one snapshot after the segment was learned
        learn_through(address, "r2", OTHER)  # only the log has this one when the replica dies
        os.kill(process.pid, signal.SIGKILL)
        process.wait(timeout=10)
        process, address = start_drafter(tiny_gemma3_dir, tmp_path, "a", **flags)
        assert seconds_until_proposed(address, "r3", SEGMENT, limit_s=0.5) < 0.5
        assert seconds_until_proposed(address, "r4", OTHER, limit_s=0.5) < 0.5
        # the snapshot held the first segment: only the second one was replayed from the log
        starts = [line for line in (tmp_path / "a.log").read_text().splitlines() if "drafter listening" in line]
        assert len(starts) == 2 and "(1 log records replayed)" in starts[-1]
    finally:
        stop(process)


def test_the_drafter_config_refuses_bad_intervals():
    with pytest.raises(ValueError, match="interval"):
        DrafterConfig(snapshot_interval_s=0)
