"""An in-process fake Scheduler gRPC service for router tests.

It answers every Generate with the same deterministic tokens (a fixed text
encoded by the given tokenizer, two tokens per chunk) and records what it was
sent and which calls were cancelled. Words in the prompt pick a behaviour:
SLOW (a long stream, 50 ms per chunk), WAIT (1 s queued before the first token),
FAIL_MID (an error event after the first chunks), OVERLOAD (RESOURCE_EXHAUSTED
at once), REJECT (an invalid_request error event at once).
"""

from __future__ import annotations

import threading
import time
from concurrent import futures

import grpc

from protos.segserve.v1 import common_pb2, scheduler_pb2, scheduler_pb2_grpc, worker_pb2

OUTPUT_TEXT = "Hello 🙂 東京 Übermäßig!\n    def add(a, b):\n        return a + b\n"
GREEDY_LOGIT = 7.0  # what the fake reports as the score of a greedy token (a logit, not a logprob)
TOP_LOGPROB = -0.25  # the chosen token's logprob in the top list


class FakeScheduler(scheduler_pb2_grpc.SchedulerServicer):
    def __init__(self, tokenizer, model_name: str = "tiny-test", max_model_len: int = 256) -> None:
        self.tokenizer = tokenizer
        self.model_name = model_name
        self.max_model_len = max_model_len
        self.output_ids: list[int] = tokenizer(OUTPUT_TEXT, add_special_tokens=False).input_ids
        self.eos_token_id: int = tokenizer.eos_token_id
        self.requests: list[scheduler_pb2.GenerateRequest] = []
        self.cancelled: list[str] = []
        self.completed: list[str] = []
        self._lock = threading.Lock()

    def expected_ids(self, max_new_tokens: int) -> tuple[list[int], int]:
        """(tokens, finish reason) a plain request with this budget gets."""
        if max_new_tokens < len(self.output_ids) + 1:
            return self.output_ids[:max_new_tokens], scheduler_pb2.FINISH_REASON_LENGTH
        return self.output_ids + [self.eos_token_id], scheduler_pb2.FINISH_REASON_EOS_TOKEN

    def Generate(self, request, context):
        with self._lock:
            self.requests.append(request)
        prompt = self.tokenizer.decode(request.prompt_token_ids)
        if "OVERLOAD" in prompt:
            context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, "queue is full")
        if "REJECT" in prompt:
            yield _error("invalid_request", "prompt rejected by the scheduler")
            return
        arrived_s = time.monotonic()
        state = {"is_finished": False}
        context.add_callback(lambda: self._on_end(request.request_id, state))
        budget = request.stopping.max_new_tokens
        if "SLOW" in prompt:
            tokens = (self.output_ids * (budget // len(self.output_ids) + 1))[:budget]
            finish = scheduler_pb2.FINISH_REASON_LENGTH
        else:
            tokens, finish = self.expected_ids(budget)
        if "WAIT" in prompt:
            time.sleep(1.0)
        scheduled_s = first_token_s = time.monotonic()
        for start in range(0, len(tokens), 2):
            if "SLOW" in prompt:
                time.sleep(0.05)
            if not context.is_active():
                return
            if start == 0:
                first_token_s = time.monotonic()
            yield self._chunk(tokens[start:start + 2], request.sampling, _us(arrived_s, scheduled_s))
            if "FAIL_MID" in prompt and start >= 2:
                state["is_finished"] = True
                yield _error("internal", "worker crashed")
                return
        state["is_finished"] = True
        yield scheduler_pb2.GenerateResponse(complete=scheduler_pb2.GenerateComplete(
            finish_reason=finish, num_prompt_tokens=len(request.prompt_token_ids),
            num_generated_tokens=len(tokens), queue_wait_us=_us(arrived_s, scheduled_s),
            first_token_us=_us(arrived_s, first_token_s), decode_us=_us(first_token_s, time.monotonic()),
            max_batch_size=1))  # each request runs alone

    def _on_end(self, request_id: str, state: dict) -> None:
        with self._lock:
            (self.completed if state["is_finished"] else self.cancelled).append(request_id)

    def _chunk(self, token_ids: list[int], sampling, queue_wait_us: int = 0) -> scheduler_pb2.GenerateResponse:
        vocab = len(self.tokenizer)
        scores = [TOP_LOGPROB if sampling.do_sample else GREEDY_LOGIT] * len(token_ids)
        top = []
        if sampling.num_top_logprobs:
            for t in token_ids:
                ids = [t] + [(t + k) % vocab for k in range(1, sampling.num_top_logprobs)]
                top.append(common_pb2.TopLogprobs(
                    token_ids=ids, logprobs=[TOP_LOGPROB - k for k in range(len(ids))]))
        return scheduler_pb2.GenerateResponse(chunk=scheduler_pb2.TokenChunk(
            token_ids=token_ids, scores=scores, top_logprobs=top, batch_size=1, queue_wait_us=queue_wait_us))

    def GetInfo(self, request, context):
        return scheduler_pb2.SchedulerInfo(worker=worker_pb2.WorkerInfo(
            model_name=self.model_name, max_model_len=self.max_model_len, vocab_size=len(self.tokenizer),
            eos_token_ids=[self.eos_token_id], block_size=16, num_kv_blocks=64, device="cpu", dtype="float32"))

    def Health(self, request, context):
        return worker_pb2.HealthResponse(ready=True)

    def wait_cancelled(self, request_id_prefix: str = "", timeout_s: float = 5.0) -> list[str]:
        """Cancelled request ids (with the prefix), waiting up to timeout_s for at least one."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            with self._lock:
                found = [r for r in self.cancelled if r.startswith(request_id_prefix)]
            if found:
                return found
            time.sleep(0.02)
        return []


def _us(start_s: float, end_s: float) -> int:
    return round((end_s - start_s) * 1e6)


def _error(code: str, message: str) -> scheduler_pb2.GenerateResponse:
    return scheduler_pb2.GenerateResponse(error=scheduler_pb2.GenerateError(code=code, message=message))


def start_fake_scheduler(tokenizer, **kwargs) -> tuple[grpc.Server, FakeScheduler, int]:
    """Serve a FakeScheduler on a free localhost port: (server, fake, port)."""
    fake = FakeScheduler(tokenizer, **kwargs)
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=8))
    scheduler_pb2_grpc.add_SchedulerServicer_to_server(fake, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    return server, fake, port
