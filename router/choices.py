"""The choices of one request (n per prompt, for each of its prompts): independent generations merged into
one event stream.

In: one event stream per choice (generate_deltas', possibly through
stop_at_strings), each without keep-alives. Out: their Deltas interleaved as
they arrive, each tagged with its choice's `index`; every choice's last Delta
keeps its finish_reason, and the last one to finish carries the usage of all
(each prompt's tokens once, completion tokens summed), so a renderer sends
per-choice endings and one usage at the end. A failure of any choice ends the
whole stream (the other generations are cancelled), as does closing it.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
from collections.abc import AsyncIterator, Sequence

from protos.segserve.v1.generate import GenerateError
from protos.segserve.v1.usage import Usage
from router.generation import KEEPALIVE, Delta, KeepAlive

logger = logging.getLogger(__name__)

MAX_CHOICES = 16
MAX_GENERATIONS = 256
"""The most generations one request may start: its prompts times n."""


async def merge_choices(
    streams: Sequence[AsyncIterator], keepalive_s: float | None = None, prompts: Sequence[int] | None = None
) -> AsyncIterator[Delta | GenerateError | KeepAlive]:
    """Interleave `streams` (choice i = streams[i]); KEEPALIVE when none sent anything for keepalive_s.
    `prompts[i]` numbers choice i's prompt (all one prompt when None): the usage counts each prompt once."""
    queue: asyncio.Queue[tuple[int, Delta | GenerateError]] = asyncio.Queue()
    pumps = [asyncio.create_task(_pump(index, stream, queue)) for index, stream in enumerate(streams)]
    num_running = len(streams)
    num_completion_tokens = 0
    prompt_tokens: dict[int, int] = {}  # per prompt
    cached_tokens: dict[int, int] = {}  # per prompt, the most any of its choices took from the prefix cache
    try:
        while num_running:
            try:
                async with asyncio.timeout(keepalive_s):
                    index, event = await queue.get()
            except TimeoutError:
                yield KEEPALIVE
                continue
            if isinstance(event, GenerateError):
                yield event
                return
            usage = None
            if event.finish_reason is not None:
                num_running -= 1
                prompt = 0 if prompts is None else prompts[index]
                prompt_tokens[prompt] = event.usage.prompt_tokens
                num_completion_tokens += event.usage.completion_tokens
                cached_tokens[prompt] = max(cached_tokens.get(prompt, 0), event.usage.cached_tokens)
                if not num_running:
                    usage = Usage(sum(prompt_tokens.values()), num_completion_tokens, sum(cached_tokens.values()))
            yield dataclasses.replace(event, index=index, usage=usage)
    finally:
        for pump in pumps:
            pump.cancel()
        await asyncio.gather(*pumps, return_exceptions=True)


async def _pump(index: int, stream: AsyncIterator, queue: asyncio.Queue) -> None:
    """Move one choice's events to the shared queue; cancelling this closes the stream (and its gRPC call)."""
    try:
        async with contextlib.aclosing(stream):
            async for event in stream:
                if not isinstance(event, KeepAlive):
                    queue.put_nowait((index, event))
    except asyncio.CancelledError:
        raise
    except Exception as exc:  # a bug, not a scheduler answer: still end the merged stream
        logger.exception("choice %d failed", index)
        queue.put_nowait((index, GenerateError("internal", f"router: {type(exc).__name__}: {exc}")))
