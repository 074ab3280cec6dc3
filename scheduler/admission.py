"""Admission to a scheduler's waiting queue: which new requests it takes.

In: a request that passed the contract's own checks (generate.validate_request). A request this scheduler can
never run is refused for good (RequestRejected: its id is live, or its prompt leaves no room for a generated
token within max_model_len and the KV cache); one that would only wait is refused for now (QueueFull,
back-pressure: a queue longer than max_num_waiting requests or max_num_waiting_tokens tokens only adds
latency, so the client retries later). An empty queue takes any request that fits, so that a long prompt is
not refused forever. (A sequence handed over from a lost worker's scheduler was admitted once already:
Scheduler.resume() only checks that its id is not live, see faults.py.)
"""

from __future__ import annotations

from collections import deque
from collections.abc import Container, Iterable

from protos.segserve.v1.sampling import InvalidParameter
from scheduler.sequence import Sequence


class RequestRejected(InvalidParameter):
    """A request this scheduler can never run (too long for its KV cache) or whose id is live."""


class QueueFull(RuntimeError):
    """The waiting queue is at its bound in requests or prompt tokens; the client should retry later."""


def num_waiting_tokens(waiting: Iterable[Sequence]) -> int:
    """Tokens the waiting sequences still have to compute (a preempted one recomputes all of its own)."""
    return sum(seq.num_uncomputed_tokens for seq in waiting)


def check_not_live(seq: Sequence, live_ids: Container[str]) -> None:
    """Raises RequestRejected if seq's request id is live already."""
    if seq.request_id in live_ids:
        raise RequestRejected("request_id", f"{seq.request_id!r} is already live")


def check_admission(seq: Sequence, live_ids: Container[str], waiting: deque[Sequence], *, max_len: int,
                    max_num_waiting: int, max_num_waiting_tokens: int) -> None:
    """Raises RequestRejected if seq can never run here (max_len: the longest sequence that can exist), QueueFull
    if the waiting queue has no room for it."""
    check_not_live(seq, live_ids)
    if seq.num_prompt_tokens >= max_len:
        raise RequestRejected(
            "prompt_token_ids", f"has {seq.num_prompt_tokens} tokens; at most {max_len - 1} fit "
            f"(max_model_len and KV-cache capacity leave room for one generated token)")
    if len(waiting) >= max_num_waiting:
        raise QueueFull(f"{len(waiting)} requests are already waiting; retry later")
    num_tokens = num_waiting_tokens(waiting)
    if waiting and num_tokens + seq.num_prompt_tokens > max_num_waiting_tokens:
        raise QueueFull(f"{num_tokens} prompt tokens are already waiting (at most "
                        f"{max_num_waiting_tokens}); retry later")

