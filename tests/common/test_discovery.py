"""common/discovery.py's replica-set helpers: targets from a flag, who joined and left, placement with slack."""

from __future__ import annotations

import pytest

import common.discovery as discovery
from common.discovery import affinity_key, membership_changes, parse_targets, place, rendezvous

PROMPT = list(range(100, 180))


def test_a_prompt_goes_to_its_affinity_replica_until_it_is_busier_than_the_slack_allows():
    addresses = ["a:1", "b:1", "c:1"]
    preferred = rendezvous(affinity_key(PROMPT), addresses)
    other = next(a for a in addresses if a != preferred)
    loads = {a: (2,) for a in addresses}
    assert place(PROMPT, loads, slack=4) == preferred
    loads[preferred] = (6,)  # 4 more than the least busy: still within the slack
    assert place(PROMPT, loads, slack=4) == preferred
    loads[preferred], loads[other] = (7,), (1,)
    assert place(PROMPT, loads, slack=4) == other
    assert place(PROMPT, {}, slack=4) is None


def test_the_least_loaded_is_chosen_by_the_whole_load_requests_first():
    addresses = ["a:1", "b:1", "c:1"]
    preferred = rendezvous(affinity_key(PROMPT), addresses)
    first, second = (a for a in addresses if a != preferred)
    loads = {preferred: (9, 0), first: (3, -5), second: (3, -50)}  # (requests, -free KV blocks)
    assert place(PROMPT, loads, slack=0) == second


def test_targets_come_from_the_flag_and_an_empty_one_is_refused():
    assert parse_targets(" a:1,dns:///s:2 ,", "--worker-address") == ["a:1", "dns:///s:2"]
    with pytest.raises(ValueError, match="--worker-address"):
        parse_targets(",", "--worker-address")


async def test_a_refresh_says_who_joined_with_its_name_and_who_left(monkeypatch):
    async def resolved(targets):
        assert targets == ["dns:///svc:9", "10.0.0.9:9"]
        return {"10.0.0.2:9": "svc", "10.0.0.3:9": "svc", "10.0.0.9:9": None}

    monkeypatch.setattr(discovery, "resolve_names", resolved)
    joined, left = await membership_changes(["dns:///svc:9", "10.0.0.9:9"], {"10.0.0.1:9": 0, "10.0.0.2:9": 0})
    assert joined == {"10.0.0.3:9": "svc", "10.0.0.9:9": None} and left == ["10.0.0.1:9"]
