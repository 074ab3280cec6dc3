"""Graceful shutdown with real processes, as a pod's SIGTERM does it: readiness goes false at once, new requests
are refused, the streams under way finish whole, and the process exits by itself within its drain time.

Streams are long (ignore_eos, hundreds of tokens, many at once) so that they are still running when the
signal lands; each test checks that they were.
"""

from __future__ import annotations

import json
import signal
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import grpc
import httpx
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from protos.segserve.v1 import generation_pb2, generation_pb2_grpc
from tests.support.e2e_helpers import served_model_name, tiny_stack

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(240)]

NUM_STREAMS = 12
MAX_TOKENS = 400
DRAIN_TIMEOUT_S = 60.0
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


REFUSAL_RETRY_S = 1.0


def draining_stack(model_dir, log_dir):
    stack = tiny_stack(model_dir, log_dir, is_speculative=False, scheduler={"drain_timeout_s": DRAIN_TIMEOUT_S})
    stack.config.router.drain_timeout_s = DRAIN_TIMEOUT_S
    # A request refused by the draining scheduler is retried this long before it is answered (503 here: nobody
    # restarts the scheduler); the supervision's test checks that a restarted one takes it.
    stack.config.router.scheduler_retry_s = REFUSAL_RETRY_S
    return stack


def chat_body(model: str) -> dict:
    return {"model": model, "messages": [{"role": "user", "content": "Count slowly."}], "stream": True,
            "max_tokens": MAX_TOKENS, "ignore_eos": True, "stream_options": {"include_usage": True}}


class Streams:
    """NUM_STREAMS chat streams in threads; `started` is set once every one has its first content delta."""

    def __init__(self, base_url: str, model: str) -> None:
        self.base_url, self.model = base_url, model
        self.started = threading.Event()
        self._num_started = 0
        self._lock = threading.Lock()
        self.pool = ThreadPoolExecutor(NUM_STREAMS)
        self.futures = [self.pool.submit(self._run) for _ in range(NUM_STREAMS)]

    def _run(self) -> dict:
        num_deltas, num_tokens, finish_reason, is_done = 0, 0, None, False
        with httpx.stream("POST", self.base_url + "/v1/chat/completions", json=chat_body(self.model),
                          timeout=120) as response:
            assert response.status_code == 200
            for line in response.iter_lines():
                if line == "data: [DONE]":
                    is_done = True
                elif line.startswith("data: "):
                    event = json.loads(line[6:])
                    if event.get("usage"):
                        num_tokens = event["usage"]["completion_tokens"]
                    if not event["choices"]:
                        continue
                    choice = event["choices"][0]
                    num_deltas += bool(choice["delta"].get("content"))
                    finish_reason = choice.get("finish_reason") or finish_reason
                    if num_deltas == 1:
                        with self._lock:
                            self._num_started += 1
                            if self._num_started == NUM_STREAMS:
                                self.started.set()
        return {"num_tokens": num_tokens, "finish_reason": finish_reason, "is_done": is_done}

    def results(self) -> list[dict]:
        try:
            return [future.result(timeout=120) for future in self.futures]
        finally:
            self.pool.shutdown()


def health_status(address: str) -> int | grpc.StatusCode:
    """grpc.health.v1's overall status, or the call's error code when the server refuses it."""
    with grpc.insecure_channel(address) as channel:
        try:
            return health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5).status
        except grpc.RpcError as exc:
            return exc.code()


def assert_whole(results: list[dict]) -> None:
    for result in results:
        assert result == {"num_tokens": MAX_TOKENS, "finish_reason": "length", "is_done": True}


def test_sigterm_drains_the_router(tiny_gemma3_dir, tmp_path):
    log_dir = tmp_path
    with draining_stack(tiny_gemma3_dir, log_dir) as stack:
        model = served_model_name(stack)
        router = stack.processes["router"]
        streams = Streams(stack.base_url, model)
        assert streams.started.wait(60), "the streams did not start"
        router.send_signal(signal.SIGTERM)
        signalled = time.monotonic()
        deadline = signalled + 5
        while httpx.get(stack.base_url + "/ready", timeout=5).status_code != 503:
            assert time.monotonic() < deadline, "/ready stayed 200 after SIGTERM"
            time.sleep(0.02)
        refused = httpx.post(stack.base_url + "/v1/chat/completions", json={**chat_body(model), "stream": False},
                             timeout=10)
        assert refused.status_code == 503 and refused.headers["retry-after"] == "1"
        assert refused.json()["error"]["code"] == "shutting_down"
        with grpc.insecure_channel(stack.grpc_address) as channel:  # the public gRPC API refuses new calls too
            with pytest.raises(grpc.RpcError) as refusal:
                generation_pb2_grpc.GenerationStub(channel).Generate(
                    generation_pb2.GenerationRequest(model=model, prompt="hi"), timeout=5)
            assert refusal.value.code() == grpc.StatusCode.UNAVAILABLE
        assert health_status(stack.grpc_address) in (NOT_SERVING, grpc.StatusCode.UNAVAILABLE)
        assert router.poll() is None, "the router left before its streams finished"
        assert_whole(streams.results())
        # uvicorn re-raises the signal once its shutdown is done, so the exit is the signal's, not a crash's.
        assert router.wait(timeout=DRAIN_TIMEOUT_S) in (0, -signal.SIGTERM)
        assert time.monotonic() - signalled < DRAIN_TIMEOUT_S
        assert "Traceback" not in (log_dir / "router.log").read_text()


def test_sigterm_drains_the_scheduler(tiny_gemma3_dir, tmp_path):
    with draining_stack(tiny_gemma3_dir, tmp_path) as stack:
        model = served_model_name(stack)
        scheduler = stack.processes["scheduler"]
        address = stack.config.router.scheduler_address
        streams = Streams(stack.base_url, model)
        assert streams.started.wait(60), "the streams did not start"
        scheduler.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + 5
        while health_status(address) != NOT_SERVING:
            assert time.monotonic() < deadline, "the scheduler stayed SERVING after SIGTERM"
            time.sleep(0.02)
        refused = httpx.post(stack.base_url + "/v1/chat/completions", json={**chat_body(model), "stream": False},
                             timeout=10 + REFUSAL_RETRY_S)
        assert refused.status_code == 503, refused.text  # the router's only scheduler refuses new requests
        assert scheduler.poll() is None, "the scheduler left before its streams finished"
        assert_whole(streams.results())
        assert scheduler.wait(timeout=30) == 0
        assert "Traceback" not in (tmp_path / "scheduler.log").read_text()
        assert httpx.get(stack.base_url + "/ready", timeout=5).status_code == 503


def test_sigterm_stops_the_worker_cleanly(tiny_gemma3_dir, tmp_path):
    with draining_stack(tiny_gemma3_dir, tmp_path) as stack:
        worker = stack.processes["worker"]
        worker.send_signal(signal.SIGTERM)
        assert worker.wait(timeout=15) == 0  # its shutdown ran: NOT_SERVING, the step under way finished
        log = (tmp_path / "worker.log").read_text()
        assert "Traceback" not in log
