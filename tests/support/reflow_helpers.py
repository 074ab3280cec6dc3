"""Helpers of the reflow tests: a throwaway redis-server, and recorded chat traffic."""

from __future__ import annotations

import contextlib
import json
import shutil
import socket
import subprocess
import time
from pathlib import Path
from typing import Iterator

import pytest

from router.reflow.chunks import FinishState
from router.reflow.recorder import Recorder


@contextlib.contextmanager
def redis_server(tmp_dir: Path) -> Iterator[str]:
    """A redis-server on a free port, no persistence, stopped afterwards; yields its URL."""
    binary = shutil.which("redis-server")
    if binary is None:
        pytest.skip("redis-server is not installed (.ci/run installs it)")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    process = subprocess.Popen([binary, "--port", str(port), "--bind", "127.0.0.1", "--dir", str(tmp_dir),
                                "--save", "", "--appendonly", "no"], stdout=subprocess.DEVNULL)
    try:
        import redis

        client = redis.Redis(port=port)
        for _ in range(200):
            try:
                client.ping()
                break
            except redis.ConnectionError:
                time.sleep(0.02)
        yield f"redis://127.0.0.1:{port}/0"
    finally:
        process.terminate()
        process.wait(timeout=10)


def record_chats(recorder: Recorder, num_sessions: int, num_turns: int, prefix: str = "r") -> dict[str, list[str]]:
    """Chats recorded turn by turn, sessions interleaved; returns each session's request ids in order.

    Every follow-up resends the history, as chat clients do, and carries no session id:
    the recorder must derive it. All sessions share one system prompt.
    """
    histories = {s: [{"role": "system", "content": "You are terse."}] for s in range(num_sessions)}
    request_ids: dict[int, list[str]] = {s: [] for s in range(num_sessions)}
    for turn in range(num_turns):
        for session in range(num_sessions):
            request_id = f"{prefix}-{session}-{turn}"
            histories[session].append({"role": "user", "content": f"question {turn} of chat {session}"})
            body = json.dumps({"model": "m", "messages": histories[session], "stream": True}).encode()
            recording = recorder.start_request(request_id, "client-a", "m", body)
            reply = f"answer {turn} to chat {session}, in several words"
            for index, word in enumerate(reply.split(" ")):
                recording.delta(word if index == 0 else " " + word, [index])
            recording.finish(FinishState.COMPLETE, usage={"completion_tokens": len(reply.split(" "))})
            histories[session].append({"role": "assistant", "content": reply})
            request_ids[session].append(request_id)
    return {ids[0]: ids for ids in request_ids.values()}


def read_logs(sink_dir: Path) -> list[list[dict]]:
    """Every session log in a JSONL sink directory."""
    return [[json.loads(line) for line in path.read_text().splitlines()] for path in sorted(sink_dir.glob("*.jsonl"))]
