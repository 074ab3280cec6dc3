"""Recording at the router: every inference request on every exit path becomes exactly one
record, with the finish state of how it ended and the text the client received.

A real router (uvicorn) records into a SQLite queue in front of the fake scheduler;
after it shuts down, `consume` drains the queue and the logs are read back.
"""

from __future__ import annotations

import contextlib
import json
import threading
import time

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from router.config import RouterConfig
from router.reflow.gateway import client_id, state_for_status
from router.reflow.chunks import FinishState
from segserve.reflow.config import ConsumerConfig
from segserve.reflow.consumer import consume
from tests.support.fake_scheduler import OUTPUT_TEXT, WORKER_ERROR_MESSAGE, start_fake_scheduler
from tests.support.reflow_helpers import read_logs
from tests.support.router_server import serve_router
from tests.router.test_server import MODEL, _free_port

pytestmark = pytest.mark.timeout(120)


@pytest.fixture
def router(tiny_gemma3_dir, tmp_path):
    """(base URL, stop()) of a recording router; stop() shuts it down, which flushes the recorder."""
    from transformers import AutoTokenizer

    server_grpc, _, grpc_port = start_fake_scheduler(AutoTokenizer.from_pretrained(str(tiny_gemma3_dir)),
                                                     model_name=MODEL)
    config = RouterConfig(model=str(tiny_gemma3_dir), scheduler_address=f"127.0.0.1:{grpc_port}",
                          port=_free_port(), scheduler_wait_s=10, request_timeout_s=1.0,
                          reflow_queue_url=f"sqlite:///{tmp_path}/queue.db", reflow_spill_dir=str(tmp_path / "spill"))
    with contextlib.ExitStack() as stack:
        url = stack.enter_context(serve_router(config))
        yield url, stack.close  # closing shuts the router down, which flushes the recorder
    server_grpc.stop(grace=None)


def _records(tmp_path) -> dict[str, list[dict]]:
    consume(ConsumerConfig(queue_url=f"sqlite:///{tmp_path}/queue.db", sink_dir=str(tmp_path / "logs"),
                           is_drain=True))
    by_id: dict[str, list[dict]] = {}
    for session in read_logs(tmp_path / "logs"):
        for record in session:
            by_id.setdefault(record["request_id"], []).append(record)
    return by_id


def _stream_text(response: httpx.Response) -> str:
    text = ""
    for line in response.iter_lines():
        if line.startswith("data: {"):
            event = json.loads(line[6:])
            text += "".join(c.get("text") or c.get("delta", {}).get("content") or "" for c in event.get("choices", []))
    return text


def test_every_exit_path_yields_exactly_one_record(router, tmp_path, tiny_gemma3_dir):
    url, stop = router
    completion = {"model": MODEL, "prompt": "The answer:", "max_tokens": 64, "temperature": 0}
    with httpx.Client(base_url=url, timeout=30) as http:
        with http.stream("POST", "/v1/completions", json={**completion, "stream": True},
                         headers={"X-Request-Id": "streamed", "Authorization": "Bearer secret-key"}) as response:
            streamed_text = _stream_text(response)
        chat = http.post("/v1/chat/completions", headers={"X-Request-Id": "chat", "X-Session-Id": "s-1"},
                         json={"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 64})
        assert chat.status_code == 200
        invalid = http.post("/v1/completions", json={**completion, "max_tokens": -1}, headers={"X-Request-Id": "bad"})
        assert invalid.status_code == 400
        overloaded = http.post("/v1/completions", json={**completion, "prompt": "OVERLOAD"},
                               headers={"X-Request-Id": "overloaded"})
        assert overloaded.status_code == 429
        with http.stream("POST", "/v1/completions", json={**completion, "prompt": "FAIL_MID", "stream": True},
                         headers={"X-Request-Id": "failed"}) as response:
            assert "error" in response.read().decode()
        with http.stream("POST", "/v1/completions", json={**completion, "prompt": "WORKER_ERROR", "stream": True},
                         headers={"X-Request-Id": "worker-error"}) as response:
            assert '"finish_reason":"error"' in response.read().decode().replace(" ", "")
        with http.stream("POST", "/v1/completions", json={**completion, "prompt": "SLOW", "stream": True,
                                                          "max_tokens": 200},
                         headers={"X-Request-Id": "deadline"}) as response:
            assert "timeout" in response.read().decode()
        with http.stream("POST", "/v1/completions", json={**completion, "prompt": "SLOW", "stream": True,
                                                          "max_tokens": 200},
                         headers={"X-Request-Id": "gone"}) as response:
            next(response.iter_lines())  # the client leaves after the first event
        v2 = http.post(f"/v2/models/{MODEL}/generate", json={"text_input": "Hi", "parameters": {"max_new_tokens": 64}},
                       headers={"X-Request-Id": "v2"})
        assert v2.status_code == 200
        metrics = {f.name: f for f in text_string_to_metric_families(http.get("/metrics").text)}
    assert "segserve:reflow_queue_depth" in metrics and "segserve:reflow_chunks_dropped" in metrics
    time.sleep(0.5)  # the disconnected stream's cancellation reaches the router
    stop()

    records = _records(tmp_path)
    expected = {"streamed": "complete", "chat": "complete", "bad": "rejected", "overloaded": "rejected",
                "failed": "error", "worker-error": "error", "deadline": "deadline", "gone": "cancelled", "v2": "complete"}
    assert {rid: [r["finish"] for r in records.get(rid, [])] for rid in expected} == {
        rid: [state] for rid, state in expected.items()}
    assert records["streamed"][0]["response_text"] == streamed_text == OUTPUT_TEXT
    assert records["streamed"][0]["client_id"] == client_id({"authorization": "Bearer secret-key"})
    assert "secret-key" not in json.dumps(records)
    assert records["chat"][0]["session_id"] == "s-1"
    assert records["chat"][0]["response_text"] == chat.json()["choices"][0]["message"]["content"]
    assert records["v2"][0]["response_text"] == v2.json()["text_output"]
    # Every delta's generated token ids are recorded (the EOS token too, though it has no text).
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(tiny_gemma3_dir))
    output_ids = tokenizer(OUTPUT_TEXT, add_special_tokens=False).input_ids
    assert records["streamed"][0]["response_token_ids"] == output_ids + [tokenizer.eos_token_id]
    assert tokenizer.decode(records["chat"][0]["response_token_ids"], skip_special_tokens=True) == \
        records["chat"][0]["response_text"]
    assert records["v2"][0]["response_token_ids"] == output_ids + [tokenizer.eos_token_id]
    assert records["streamed"][0]["usage"]["completion_tokens"] > 0
    assert records["bad"][0]["request"]["max_tokens"] == -1  # the request as sent
    # A request that alone failed in the worker keeps the text it got and says why.
    assert records["worker-error"][0]["error"] == WORKER_ERROR_MESSAGE
    assert records["worker-error"][0]["response_text"]


def test_every_choice_of_every_prompt_is_recorded(router, tmp_path):
    url, stop = router
    body = {"model": MODEL, "prompt": ["The answer:", "Another"], "n": 2, "max_tokens": 6, "temperature": 0}
    with httpx.Client(base_url=url, timeout=30) as http:
        plain = http.post("/v1/completions", json=body, headers={"X-Request-Id": "batch"})
        assert plain.status_code == 200
        with http.stream("POST", "/v1/chat/completions", headers={"X-Request-Id": "chat-n"},
                         json={"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "n": 3,
                               "max_tokens": 6, "stream": True}) as response:
            texts: dict[int, str] = {}
            for line in response.iter_lines():
                if line.startswith("data: {"):
                    for choice in json.loads(line[6:])["choices"]:
                        texts[choice["index"]] = texts.get(choice["index"], "") + (choice["delta"].get("content") or "")
    stop()

    records = _records(tmp_path)
    (batch,), (chat,) = records["batch"], records["chat-n"]
    answer = [c["text"] for c in sorted(plain.json()["choices"], key=lambda c: c["index"])]
    assert batch["response_text"] == answer[0] and batch["response_token_ids"]
    assert [(c["index"], c["text"]) for c in batch["other_choices"]] == [(1, answer[1]), (2, answer[2]), (3, answer[3])]
    assert all(c["token_ids"] for c in batch["other_choices"])
    assert chat["response_text"] == texts[0]
    assert [(c["index"], c["text"]) for c in chat["other_choices"]] == [(1, texts[1]), (2, texts[2])]


def test_status_and_client_id_rules():
    assert [state_for_status(s) for s in (200, 400, 404, 429, 499, 500, 504, None)] == [
        FinishState.COMPLETE, FinishState.REJECTED, FinishState.REJECTED, FinishState.REJECTED,
        FinishState.CANCELLED, FinishState.ERROR, FinishState.DEADLINE, FinishState.CANCELLED]
    assert client_id({"x-client-id": "team-a", "authorization": "Bearer k"}) == "team-a"
    assert client_id({}) == "anonymous"
    assert client_id({"authorization": "Bearer k1"}) != client_id({"authorization": "Bearer k2"})


def test_kill_9_of_the_router_loses_no_finished_stream(tiny_gemma3_dir, tmp_path):
    """Streams that finished before a SIGKILL are recorded complete, once; those in flight, incomplete.

    "Before" leaves the recorder's flush interval (20 ms) plus a margin: chunks still in
    the router's memory when it dies are the one window recording does not cover.
    """
    import signal
    import subprocess
    import sys
    from concurrent.futures import ThreadPoolExecutor

    from transformers import AutoTokenizer

    server_grpc, _, grpc_port = start_fake_scheduler(AutoTokenizer.from_pretrained(str(tiny_gemma3_dir)),
                                                     model_name=MODEL)
    port = _free_port()
    command = [sys.executable, "-m", "segserve.cli", "router", "--model", str(tiny_gemma3_dir),
               "--scheduler-address", f"127.0.0.1:{grpc_port}", "--port", str(port),
               "--reflow-queue-url", f"sqlite:///{tmp_path}/queue.db", "--reflow-spill-dir", str(tmp_path / "spill")]

    def start_router() -> subprocess.Popen:
        process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 60
        while True:
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                    return process
            except httpx.HTTPError:
                pass
            assert process.poll() is None and time.monotonic() < deadline, "router did not start"
            time.sleep(0.2)

    received: dict[str, str] = {}
    first_event = {f"slow-{i}": threading.Event() for i in range(4)}

    def stream(request_id: str, prompt: str, max_tokens: int) -> None:
        body = {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True}
        text = ""
        try:
            with httpx.stream("POST", f"http://127.0.0.1:{port}/v1/completions", json=body, timeout=30,
                              headers={"X-Request-Id": request_id}) as response:
                for line in response.iter_lines():
                    if line.startswith("data: {"):
                        text += "".join(c.get("text") or "" for c in json.loads(line[6:])["choices"])
                        if request_id in first_event:
                            first_event[request_id].set()
        except httpx.HTTPError:
            return  # an in-flight stream when the router died
        received[request_id] = text

    router_process = start_router()
    try:
        with ThreadPoolExecutor(max_workers=12) as pool:
            for request_id in first_event:
                pool.submit(stream, request_id, "SLOW", 200)  # 5 s of tokens: in flight at the kill
            finished = [pool.submit(stream, f"done-{i}", f"The answer {i}:", 64) for i in range(8)]
            for future in finished:
                future.result()
            assert all(event.wait(10) for event in first_event.values())
            time.sleep(0.3)
            router_process.send_signal(signal.SIGKILL)
            router_process.wait()
        router_process = start_router()  # the restarted router shares the queue
    finally:
        router_process.terminate()
        router_process.wait(timeout=20)
        server_grpc.stop(grace=None)

    records = _records(tmp_path)
    done = [f"done-{i}" for i in range(8)]
    assert all(rid in received for rid in done), sorted(received)
    for rid in done:
        assert [(r["finish"], r["response_text"]) for r in records.get(rid, [])] == [("complete", received[rid])]
    for rid in first_event:
        assert [r["finish"] for r in records.get(rid, [])] == ["incomplete"]
        assert records[rid][0]["response_text"]
