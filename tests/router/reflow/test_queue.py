"""The buffer queue's contract, run against both backends: SQLite (embedded) and a real redis-server."""

from __future__ import annotations

import time

import pytest

from router.reflow.queue import open_queue
from tests.support.reflow_helpers import redis_server


@pytest.fixture(params=["sqlite", "redis"])
def queue_url(request, tmp_path):
    if request.param == "sqlite":
        yield f"sqlite:///{tmp_path}/queue.db"
    else:
        with redis_server(tmp_path) as url:
            yield url + "#test-stream"


def test_put_claim_ack(queue_url):
    queue = open_queue(queue_url)
    queue.put([b"a", b"b", b"c"])
    assert queue.depth() == 3
    first = queue.claim(2)
    assert [d.payload for d in first] == [b"a", b"b"]
    assert [d.payload for d in queue.claim(10)] == [b"c"]
    assert queue.claim(10) == []  # all claimed, none timed out
    queue.ack([d.delivery_id for d in first])
    queue.ack([d.delivery_id for d in first])  # twice is harmless
    assert queue.depth() == 1
    queue.close()


def test_a_crashed_consumers_claims_are_delivered_again(queue_url):
    producer = open_queue(queue_url)
    producer.put([b"x", b"y"])
    crashed = open_queue(queue_url, "consumer-a", visibility_timeout_s=0.2)
    assert len(crashed.claim(10)) == 2  # then it dies without acking
    survivor = open_queue(queue_url, "consumer-b", visibility_timeout_s=0.2)
    assert survivor.claim(10) == []
    time.sleep(0.3)
    again = survivor.claim(10)
    assert sorted(d.payload for d in again) == [b"x", b"y"]
    survivor.ack([d.delivery_id for d in again])
    assert producer.depth() == 0
    for queue in (producer, crashed, survivor):
        queue.close()


def test_put_is_durable_across_reopening(queue_url):
    queue = open_queue(queue_url)
    queue.put([b"kept"])
    queue.close()
    reopened = open_queue(queue_url)
    assert [d.payload for d in reopened.claim(10)] == [b"kept"]
    reopened.close()


def test_oldest_age(queue_url):
    queue = open_queue(queue_url)
    assert queue.oldest_age_s() == 0.0
    queue.put([b"old"])
    time.sleep(0.05)
    assert 0.03 < queue.oldest_age_s() < 5
    queue.close()


def test_unknown_scheme_is_refused():
    with pytest.raises(ValueError):
        open_queue("kafka://x")
