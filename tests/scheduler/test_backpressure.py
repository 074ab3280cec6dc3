"""Back-pressure at admission: the waiting queue is bounded in requests and in prompt tokens.

Pure scheduler logic, no model: a refused add() raises QueueFull (the servicer's
RESOURCE_EXHAUSTED, the router's 429) and leaves the scheduler untouched.
"""

from __future__ import annotations

import pytest

from scheduler.config import SchedulerConfig
from scheduler.scheduler import QueueFull, RequestRejected, Scheduler
from tests.scheduler.test_scheduler import make_scheduler, make_seq


def fill(scheduler: Scheduler, prompt_lengths: list[int]) -> None:
    for index, length in enumerate(prompt_lengths):
        scheduler.add(make_seq(f"r{index}", list(range(1, length + 1))))


def test_the_token_bound_refuses_a_prompt_that_would_pass_it():
    scheduler = make_scheduler(max_num_waiting_tokens=100)
    fill(scheduler, [40, 50])
    assert scheduler.num_waiting_tokens == 90
    with pytest.raises(QueueFull, match="90 prompt tokens"):
        scheduler.add(make_seq("late", list(range(1, 12))))
    assert [seq.request_id for seq in scheduler.waiting] == ["r0", "r1"]
    assert "late" not in scheduler.requests
    scheduler.add(make_seq("fits", list(range(1, 11))))  # exactly at the bound
    assert scheduler.num_waiting_tokens == 100


def test_the_request_bound_refuses_at_max_num_waiting():
    scheduler = make_scheduler(max_num_waiting=2)
    fill(scheduler, [3, 3])
    with pytest.raises(QueueFull, match="2 requests"):
        scheduler.add(make_seq("late", [1, 2, 3]))


def test_an_empty_queue_admits_a_prompt_longer_than_the_token_bound():
    scheduler = make_scheduler(max_num_waiting_tokens=8)
    scheduler.add(make_seq("long", list(range(1, 30))))
    with pytest.raises(QueueFull):
        scheduler.add(make_seq("next", [1]))


def test_scheduling_frees_room_in_the_queue():
    scheduler = make_scheduler(max_num_waiting_tokens=50, max_num_batched_tokens=64)
    fill(scheduler, [30, 20])
    with pytest.raises(QueueFull):
        scheduler.add(make_seq("late", [1, 2]))
    scheduler.schedule()  # both prompts start running: nothing waits any more
    assert scheduler.num_waiting_tokens == 0
    scheduler.add(make_seq("late", [1, 2]))


def test_aborting_a_waiting_request_frees_its_tokens():
    scheduler = make_scheduler(max_num_waiting_tokens=50)
    fill(scheduler, [30, 20])
    assert scheduler.abort("r0")
    assert scheduler.num_waiting_tokens == 20
    scheduler.add(make_seq("late", list(range(1, 31))))


def test_a_request_that_can_never_run_is_rejected_even_when_the_queue_is_full():
    scheduler = make_scheduler(max_num_waiting=1)
    fill(scheduler, [3])
    with pytest.raises(RequestRejected, match="prompt_token_ids"):
        scheduler.add(make_seq("too-long", [1] * 300))  # more than the whole KV cache


def test_config_validates_the_token_bound():
    assert SchedulerConfig().max_num_waiting_tokens > 0
    with pytest.raises(ValueError, match="max_num_waiting_tokens"):
        SchedulerConfig(max_num_waiting_tokens=0)
