"""Stop strings: cut the output before the first one, without ever letting any of it out.

In: text deltas (the detokenizer's, split at arbitrary token and chunk
boundaries). Out: the part of the text that can no longer belong to a stop
string, and whether one has completed. `StopMatcher` holds back the longest tail
that is still the beginning of some stop string and lets it go once the next text
rules that out, so a stop string split across deltas is caught before any of it
was emitted. It is pure; `stop_at_strings` applies it to a request's `Delta`
stream and, at a stop, ends the stream, which closes the generation below it
and so cancels the scheduler call (the slot is freed at once).

Logprobs (the choice made here): they are kept per delta, i.e. per scheduler
chunk of tokens, since the detokenizer does not split a chunk's text per token.
A delta's logprobs go out once all of its text is out. At a stop, the deltas
whose text began before the stop string go out (their tokens made emitted
text, the last one possibly also the stop string's start) and later ones are
dropped. Usage still counts every token generated up to the stop: they were
computed.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import AsyncIterator, Sequence

from protos.segserve.v1.generate import GenerateError
from protos.segserve.v1.usage import Usage
from router.generation import Delta, TokenLogprob

STOP_FINISH_REASON = "stop"


class StopMatcher:
    """Feed text piece by piece; get back the text that is safe to emit.

    Invariant: no stop string starts inside the text emitted so far, and the
    held-back tail is the longest suffix of what was fed that is a proper prefix
    of a stop string.
    """

    def __init__(self, stops: Sequence[str]) -> None:
        if not stops or not all(stops):
            raise ValueError("need at least one stop string, none empty")
        self._stops = tuple(stops)
        self._max_held = max(len(s) for s in self._stops) - 1
        self._prefixes = frozenset(stop[:size] for stop in self._stops for size in range(1, len(stop)))
        """Every proper prefix of a stop string: what a held-back tail can be."""
        self._held = ""
        self.num_emitted_chars = 0
        """Characters returned so far (positions in the fed text)."""
        self.stop_start: int | None = None
        """Where in the fed text the first stop string starts; None while none has completed."""

    @property
    def is_stopped(self) -> bool:
        return self.stop_start is not None

    def feed(self, text: str) -> str:
        """Add `text`; return what is now safe to emit (after a stop: the text before it, then "")."""
        if self.is_stopped:
            return ""
        pending = self._held + text
        found = [i for i in (pending.find(s) for s in self._stops) if i >= 0]
        if found:
            cut = min(found)
            self.stop_start = self.num_emitted_chars + cut
            self._held = ""
            return self._emit(pending[:cut])
        num_held = self._num_held(pending)
        self._held = pending[len(pending) - num_held:] if num_held else ""
        return self._emit(pending[:len(pending) - num_held])

    def flush(self) -> str:
        """The text ended without a stop string: return what was held back."""
        held, self._held = self._held, ""
        return self._emit(held)

    def _num_held(self, pending: str) -> int:
        """Length of the longest tail of `pending` that could still grow into a stop string."""
        prefixes = self._prefixes
        for size in range(min(len(pending), self._max_held), 0, -1):
            if pending[-size:] in prefixes:
                return size
        return 0

    def _emit(self, text: str) -> str:
        self.num_emitted_chars += len(text)
        return text


async def stop_at_strings(
    events: AsyncIterator, stops: Sequence[str], num_prompt_tokens: int
) -> AsyncIterator[Delta | GenerateError]:
    """`events` (generate_deltas') with the text cut at the first stop string.

    A stop ends the stream with a Delta whose finish_reason is "stop" and whose
    usage counts the tokens read so far; other events (keep-alives, failures)
    pass through. Logprobs follow the rule in the module docstring.
    """
    matcher = StopMatcher(stops)
    num_fed_chars = num_tokens = 0
    held_logprobs: list[tuple[int, int, list[TokenLogprob]]] = []  # (text start, text end, logprobs)
    async with contextlib.aclosing(events):
        async for event in events:
            if not isinstance(event, Delta):
                yield event
                continue
            num_tokens += event.num_tokens
            if event.logprobs:  # an entry without logprobs would add nothing below
                held_logprobs.append((num_fed_chars, num_fed_chars + len(event.text), event.logprobs))
            num_fed_chars += len(event.text)
            text = matcher.feed(event.text)
            if matcher.is_stopped:
                logprobs = [lp for start, _, lps in held_logprobs if start < matcher.stop_start for lp in lps]
                usage = event.usage or Usage(num_prompt_tokens, num_tokens)
                yield dataclasses.replace(event, text=text, logprobs=logprobs, finish_reason=STOP_FINISH_REASON,
                                          usage=usage)
                return  # leaving `aclosing` closes the generation, which cancels the scheduler call
            if event.finish_reason is not None:
                text += matcher.flush()
            logprobs = []
            if held_logprobs:
                num_out = matcher.num_emitted_chars
                logprobs = [lp for _, end, lps in held_logprobs if end <= num_out for lp in lps]
                held_logprobs = [entry for entry in held_logprobs if entry[1] > num_out]
            yield dataclasses.replace(event, text=text, logprobs=logprobs)
