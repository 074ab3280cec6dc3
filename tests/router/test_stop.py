"""Stop strings (router/stop.py): the pure matcher, and its adapter over a Delta stream."""

from __future__ import annotations

import random

import pytest

from protos.segserve.v1.generate import GenerateError
from protos.segserve.v1.usage import Usage
from router.generation import Delta, TokenLogprob
from router.stop import StopMatcher, stop_at_strings

TEXT = "Hello 🙂 東京 Übermäßig!\n    def add(a, b):\n        return a + b\n"


def _first_stop(text: str, stops: list[str]) -> int | None:
    found = [i for i in (text.find(s) for s in stops) if i >= 0]
    return min(found) if found else None


def _run(matcher: StopMatcher, pieces: list[str]) -> tuple[list[str], bool]:
    """(outputs per piece, plus the flush when no stop), is_stopped."""
    outs = [matcher.feed(piece) for piece in pieces]
    if not matcher.is_stopped:
        outs.append(matcher.flush())
    return outs, matcher.is_stopped


def _random_split(text: str, rng: random.Random) -> list[str]:
    cuts = sorted(rng.sample(range(1, len(text)), rng.randint(0, min(12, len(text) - 1))))
    return [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])]


@pytest.mark.parametrize("stops", [
    ["🙂"], ["lo 🙂 東"], ["\n"], ["add(a"], ["a + b\n"], ["Hello"], ["ab"], ["b):", "a, "], ["zzz"],
    ["Übermäßig!\n    def"], ["  return", "  def"], ["\n\n"], ["b\n", "a + b\n"],
])
def test_output_is_the_text_before_the_first_stop_for_any_split(stops):
    expected_end = _first_stop(TEXT, stops)
    expected = TEXT if expected_end is None else TEXT[:expected_end]
    rng = random.Random(0)
    splits = [[TEXT], list(TEXT)] + [_random_split(TEXT, rng) for _ in range(200)]
    for pieces in splits:
        matcher = StopMatcher(stops)
        outs, is_stopped = _run(matcher, pieces)
        assert "".join(outs) == expected, pieces
        assert is_stopped == (expected_end is not None)
        assert matcher.stop_start == expected_end
        assert matcher.num_emitted_chars == len(expected)


def test_nothing_that_could_start_a_stop_string_is_emitted_early():
    matcher = StopMatcher(["STOP"])
    assert matcher.feed("abc S") == "abc "
    assert matcher.feed("T") == ""
    assert matcher.feed("O") == ""
    assert matcher.feed("x") == "STOx", "a broken prefix is released at once"
    assert matcher.feed("ST") == ""
    assert matcher.feed("OP and more") == ""
    assert matcher.is_stopped and matcher.stop_start == len("abc STOx")
    assert matcher.feed("later") == "" and matcher.flush() == ""


def test_held_tail_is_released_at_the_end():
    matcher = StopMatcher(["</end>"])
    assert matcher.feed("text </e") == "text "
    assert matcher.flush() == "</e"
    assert not matcher.is_stopped


def test_the_earliest_stop_wins_over_list_order():
    matcher = StopMatcher(["world", "o w"])
    assert matcher.feed("hello world") == "hell"


def test_overlapping_prefixes_hold_the_longest_candidate():
    # "aab" is found even though the text first looked like a prefix "aa" then "a".
    matcher = StopMatcher(["aab"])
    assert matcher.feed("xaa") == "x"
    assert matcher.feed("ab") == "a"
    assert matcher.is_stopped


@pytest.mark.parametrize("stops", [[], [""], ["a", ""]])
def test_matcher_needs_non_empty_stops(stops):
    with pytest.raises(ValueError):
        StopMatcher(stops)


def _lp(token_id: int) -> TokenLogprob:
    return TokenLogprob(token_id, -0.5, [(token_id, -0.5)])


async def _stream(events):
    for event in events:
        yield event


class _Closable:
    """An event stream that records whether it was closed (the generation cancelled)."""

    def __init__(self, events) -> None:
        self._events = iter(events)
        self.is_closed = False

    def __aiter__(self):
        return self

    async def __anext__(self):
        if self.is_closed:
            raise StopAsyncIteration
        try:
            return next(self._events)
        except StopIteration:
            raise StopAsyncIteration from None

    async def aclose(self) -> None:
        self.is_closed = True


async def test_a_stop_ends_the_stream_closes_the_generation_and_counts_usage():
    deltas = [Delta("Hello ", [_lp(1)], num_tokens=1), Delta("wor", [_lp(2)], num_tokens=1),
              Delta("ld! more", [_lp(3), _lp(4)], num_tokens=2), Delta("never read", [_lp(5)], num_tokens=1)]
    source = _Closable(deltas)
    out = [d async for d in stop_at_strings(source, ["world"], num_prompt_tokens=7)]
    assert source.is_closed
    assert "".join(d.text for d in out) == "Hello "
    assert [d.finish_reason for d in out] == [None, None, "stop"]
    assert out[-1].usage == Usage(7, 4)
    # "wor" is where the stop string starts: its tokens made no emitted text, so their logprobs go too.
    assert [lp.token_id for d in out for lp in d.logprobs] == [1]


async def test_logprobs_wait_for_their_text_and_follow_it_out():
    deltas = [Delta("ab", [_lp(1)], num_tokens=1), Delta("</", [_lp(2)], num_tokens=1),
              Delta("x", [_lp(3)], num_tokens=1),
              Delta("", [], finish_reason="length", usage=Usage(3, 3))]
    out = [d async for d in stop_at_strings(_stream(deltas), ["</end>"], num_prompt_tokens=3)]
    assert [d.text for d in out] == ["ab", "", "</x", ""]
    assert [[lp.token_id for lp in d.logprobs] for d in out] == [[1], [], [2, 3], []]
    assert out[-1].finish_reason == "length" and out[-1].usage == Usage(3, 3)


async def test_a_stop_straddling_deltas_keeps_the_logprobs_of_text_before_it():
    deltas = [Delta("one two", [_lp(1), _lp(2)], num_tokens=2), Delta(" thr", [_lp(3)], num_tokens=1),
              Delta("ee", [_lp(4)], num_tokens=1)]
    out = [d async for d in stop_at_strings(_stream(deltas), ["two three"], num_prompt_tokens=1)]
    assert "".join(d.text for d in out) == "one "
    assert [lp.token_id for d in out for lp in d.logprobs] == [1, 2]
    assert out[-1].finish_reason == "stop" and out[-1].usage == Usage(1, 4)


async def test_a_stop_in_the_final_text_keeps_the_schedulers_usage():
    deltas = [Delta("abc", num_tokens=1), Delta("de END", finish_reason="stop", usage=Usage(2, 5))]
    out = [d async for d in stop_at_strings(_stream(deltas), ["END"], num_prompt_tokens=2)]
    assert "".join(d.text for d in out) == "abcde "
    assert out[-1].finish_reason == "stop" and out[-1].usage == Usage(2, 5)


async def test_failures_pass_through():
    failure = GenerateError("internal", "worker crashed")
    out = [d async for d in stop_at_strings(_stream([Delta("ab"), failure]), ["bz"], num_prompt_tokens=1)]
    assert [d.text for d in out[:-1]] == ["a"] and out[-1] is failure
