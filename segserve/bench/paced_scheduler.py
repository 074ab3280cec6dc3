"""A benchmark fixture: a Scheduler gRPC service that streams tokens at a fixed pace, no model.

`segserve bench reflow` puts the real router in front of it to measure what the
router itself adds (recording on vs off) without a model's ~100 ms of noisy
compute per token drowning a 1 ms effect. It is not a test double of the
scheduler's behaviour: every Generate, whatever its sampling, answers
`max_tokens` tokens of a fixed English text (EOS ignored, one token per
chunk, as plain decoding sends them), the first after one interval (a "prefill")
and each next one on an absolute schedule (start + k * interval), so that a slow
reader never shifts the pace. GetInfo/Health/GetStats answer what the router
needs to start and serve /metrics. GenerateStreams (the router's path) paces all
of a call's streams on one clock, as an engine's steps do: every tick sends one
message holding the next token of every stream on the call (a stream's first
token comes with the first tick after it arrived), and a reader slower than the
ticks gets the tokens it missed together in the next message.

In: the tokenizer's model directory, a port, the interval. Out: a grpc.aio
server. Run alone (the bench starts it as its own process, so that the load
generator never shares its GIL):

    python -m segserve.bench.paced_scheduler --model DIR --port 50090 --token-interval-ms 20
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import time
from dataclasses import dataclass

import grpc
from tokenizers import Tokenizer

from protos.segserve.v1 import scheduler_pb2, scheduler_pb2_grpc
from protos.segserve.v1.generate import (
    CancelStream,
    FinishReason,
    GenerateComplete,
    GenerateError,
    GenerateEvent,
    GenerateRequest,
    StartStream,
    TokenChunk,
    stream_action_from_pb,
    stream_events_to_pb,
)
from protos.segserve.v1.info import Health, WorkerInfo

TEXT = ("The river runs past the old mill and under the stone bridge, where the town keeps its market "
        "on every second Saturday of the month, and people come from the villages in the hills to sell "
        "apples, cheese, wool and bread. ")
MODEL_NAME = "paced"
_EOS_TOKENS = ("<eos>", "</s>", "<|endoftext|>")


class PacedScheduler(scheduler_pb2_grpc.SchedulerServicer):
    """Streams a fixed text's tokens, one every `token_interval_s`, to every caller at once."""

    def __init__(self, tokenizer: Tokenizer, token_interval_s: float, max_model_len: int = 8192) -> None:
        if token_interval_s <= 0:
            raise ValueError("token_interval_s must be > 0")
        self.token_interval_s = token_interval_s
        self.max_model_len = max_model_len
        self.vocab_size = tokenizer.get_vocab_size(with_added_tokens=True)
        eos_ids = [tokenizer.token_to_id(token) for token in _EOS_TOKENS]
        self.eos_token_id = next((i for i in eos_ids if i is not None), 0)
        self.text_ids: list[int] = tokenizer.encode(TEXT, add_special_tokens=False).ids
        self.num_running = 0
        self.num_steps = 0

    async def Generate(self, request: scheduler_pb2.GenerateRequest, context: grpc.aio.ServicerContext):
        generate = GenerateRequest.from_pb(request)
        num_tokens = generate.stopping.max_tokens
        started_s = time.monotonic()
        self.num_running += 1
        try:
            for k in range(num_tokens):
                await asyncio.sleep(max(0.0, started_s + (k + 1) * self.token_interval_s - time.monotonic()))
                yield self._token(k).to_pb()
        finally:
            self.num_running -= 1
        yield self._complete(generate, started_s, self.num_running + 1).to_pb()

    def _token(self, k: int) -> TokenChunk:
        """A stream's token k: one token of TEXT (counted as a step)."""
        self.num_steps += 1
        return TokenChunk((self.text_ids[k % len(self.text_ids)],), (0.0,))

    def _complete(self, request: GenerateRequest, started_s: float, batch_size: int) -> GenerateComplete:
        """A stream's end: all its max_tokens, the first after one interval."""
        return GenerateComplete(
            FinishReason.LENGTH, num_prompt_tokens=len(request.prompt_token_ids),
            num_generated_tokens=request.stopping.max_tokens, first_token_us=round(self.token_interval_s * 1e6),
            decode_us=round((time.monotonic() - started_s) * 1e6), max_batch_size=batch_size)

    async def GenerateStreams(self, request_iterator, context: grpc.aio.ServicerContext):
        await context.send_initial_metadata(())  # the router's client sends nothing before
        clock = _Clock(time.monotonic(), self.token_interval_s)
        streams: dict[str, _PacedStream] = {}
        has_streams = asyncio.Event()
        is_packed = asyncio.Event()  # the client reads packed chunks (it said so): they go packed, as from the scheduler
        reader = asyncio.create_task(self._read_actions(request_iterator, clock, streams, has_streams, is_packed))
        try:
            while streams or not reader.done():
                if not streams:
                    has_streams.clear()
                    waiter = asyncio.ensure_future(has_streams.wait())
                    await asyncio.wait((reader, waiter), return_when=asyncio.FIRST_COMPLETED)
                    waiter.cancel()
                    continue
                events = self._tick(clock.tick(time.monotonic()), streams)
                if events:
                    yield stream_events_to_pb(events, packed=is_packed.is_set())
                await asyncio.sleep(max(0.0, clock.start_of(clock.tick(time.monotonic()) + 1) - time.monotonic()))
        finally:
            reader.cancel()
            self.num_running -= len(streams)

    async def _read_actions(self, request_iterator, clock: _Clock, streams: dict[str, _PacedStream],
                            has_streams: asyncio.Event, is_packed: asyncio.Event) -> None:
        with contextlib.suppress(grpc.RpcError):  # the call broke: the handler's end follows
            async for pb in request_iterator:
                if pb.packed_chunks:
                    is_packed.set()
                action = stream_action_from_pb(pb)
                if isinstance(action, StartStream):
                    now_s = time.monotonic()
                    deadline_s = now_s + action.timeout_s if action.timeout_s else None
                    streams[action.request.request_id] = _PacedStream(action.request, clock.tick(now_s) + 1, now_s,
                                                                      deadline_s)
                    self.num_running += 1
                    has_streams.set()
                elif isinstance(action, CancelStream) and action.request_id in streams:
                    del streams[action.request_id]
                    self.num_running -= 1

    def _tick(self, tick: int, streams: dict[str, _PacedStream]) -> list[tuple[str, GenerateEvent]]:
        """Every token of every stream due by `tick` (one per tick each), and the ends reached."""
        events: list[tuple[str, GenerateEvent]] = []
        now_s = time.monotonic()
        for request_id, stream in list(streams.items()):
            num_due = min(stream.num_tokens, tick - stream.first_tick + 1)
            events += [(request_id, self._token(k)) for k in range(stream.num_sent, num_due)]
            stream.num_sent = max(stream.num_sent, num_due)
            if stream.num_sent == stream.num_tokens:
                events.append((request_id, self._complete(stream.request, stream.started_s, len(streams))))
            elif stream.deadline_s is not None and now_s >= stream.deadline_s:
                events.append((request_id, GenerateError("timeout", "the request passed its deadline")))
            else:
                continue
            del streams[request_id]
            self.num_running -= 1
        return events

    async def GetInfo(self, request, context):
        return scheduler_pb2.SchedulerInfo(worker=WorkerInfo(
            model_name=MODEL_NAME, num_kv_blocks=1024, block_size=16, max_model_len=self.max_model_len,
            vocab_size=self.vocab_size, eos_token_ids=(self.eos_token_id,), device="none", dtype="none").to_pb())

    async def GetStats(self, request, context):
        return scheduler_pb2.SchedulerStats(num_running=self.num_running, num_steps=self.num_steps,
                                            num_total_kv_blocks=1024)

    async def Health(self, request, context):
        return Health(True).to_pb()


@dataclass(frozen=True)
class _Clock:
    """Ticks of one GenerateStreams call: tick n starts at start_s + n * interval_s."""

    start_s: float
    interval_s: float

    def tick(self, now_s: float) -> int:
        # 0.1 ms early counts: a sleep until a tick's start may wake a clock resolution before it.
        return int((now_s - self.start_s + 1e-4) // self.interval_s)

    def start_of(self, tick: int) -> float:
        return self.start_s + tick * self.interval_s


@dataclass
class _PacedStream:
    request: GenerateRequest
    first_tick: int
    """The tick of its first token: the one after it arrived."""
    started_s: float
    deadline_s: float | None
    num_sent: int = 0

    @property
    def num_tokens(self) -> int:
        return self.request.stopping.max_tokens


def load_tokenizer(model: str | None) -> Tokenizer:
    """The model directory's tokenizer.json, read with `tokenizers` alone (no torch import: starts in a second)."""
    from common.checkpoint import resolve_model

    return Tokenizer.from_file(str(resolve_model(model) / "tokenizer.json"))


async def serve(model: str | None, port: int, token_interval_s: float, host: str = "127.0.0.1") -> None:
    server = grpc.aio.server()
    scheduler_pb2_grpc.add_SchedulerServicer_to_server(PacedScheduler(load_tokenizer(model), token_interval_s), server)
    server.add_insecure_port(f"{host}:{port}")
    await server.start()
    await server.wait_for_termination()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="the tokenizer's model: a catalog name or a "
                                                       "transformers model directory (default model if unset)")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--token-interval-ms", type=float, default=20.0)
    args = parser.parse_args(argv)
    try:
        asyncio.run(serve(args.model, args.port, args.token_interval_ms / 1000.0))
    except KeyboardInterrupt:
        pass


if __name__ == "__main__":
    main()
