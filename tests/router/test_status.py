"""GET /status (router/status.py) and the playground's pages with API keys on: both open, the API not.

/status carries the drafting state and the gate's state per segment kind, the gate's decision and each drafter
replica; /metrics the gate's state per segment kind.

Through real HTTP against tests/router/test_ops.py's router (API keys on) and its fake scheduler.
"""

from __future__ import annotations

import httpx

from router.scheduler_client import SchedulerLoad, SegmentLoad, SpecTotals
from router.status import status_body
from tests.router.test_ops import router_url, scheduler, scrape, tokenizer  # noqa: F401


def test_the_playground_is_served_with_api_keys_on_and_the_api_still_asks_for_one(router_url):
    page = httpx.get(router_url + "/playground", timeout=10)
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    assert 'id="api-key"' in page.text and "/playground/playground.js" in page.text
    for name, kind in (("playground.js", "text/javascript"), ("playground.css", "text/css")):
        asset = httpx.get(f"{router_url}/playground/{name}", timeout=10)
        assert asset.status_code == 200 and asset.headers["content-type"].startswith(kind) and asset.text
    assert httpx.get(router_url + "/playground/../app.py", timeout=10).status_code == 404
    assert httpx.get(router_url + "/playground/app.py", timeout=10).status_code == 404
    assert httpx.get(router_url + "/v1/models", timeout=10).status_code == 401
    # Nothing on the page comes from anywhere but the router.
    assert "http://" not in page.text and "https://" not in page.text


def test_status_is_open_and_reports_the_scheduler(router_url):
    response = httpx.get(router_url + "/status", timeout=10)
    assert response.status_code == 200
    body = response.json()
    assert body["components"]["router"] == "ok" and body["components"]["scheduler"] == "ready"
    # test_ops.STATS, as the scheduler sent them
    assert body["requests"] == {"running": 3, "waiting": 2, "preemptions": 1}
    assert body["kv_cache"] == {"used_blocks": 16, "total_blocks": 64, "usage": 0.25}
    assert body["prefix_cache"] == {"queries": 900, "hits": 640, "hit_rate": 640 / 900}
    spec = body["speculation"]
    assert spec["acceptance"] == 12 / 40 and spec["gate"] == {"batch_bucket": 4, "is_open": True}
    assert [(s["segment"], s["is_drafting"], s["budget_nodes"], s["gate"]) for s in spec["segments"]] == [
        ("code", True, 8, {"batch_bucket": 4, "is_open": True}), ("default", False, 0, {"batch_bucket": 4,
                                                                                       "is_open": False}),
        ("json", False, 0, None)]  # json: the gate has not decided for it yet
    live, down = body["drafters"]
    assert (live["address"], live["is_live"], live["is_answering"], live["num_requests"]) == (
        "10.0.0.1:50071", True, True, 3)
    assert live["segments"][0] == {"segment": "code", "corpus_entries": 1234, "corpus_bytes": 345520,
                                   "num_requests": 2}
    assert (down["is_live"], down["is_answering"], down["num_requests"], down["segments"]) == (False, False, None, [])
    assert body["reflow"] is None


def test_metrics_show_the_gate_per_segment_kind(router_url):
    samples = scrape(router_url)
    assert samples[("segserve:spec_decode_segment_gate_open", (("segment", "code"),))] == 1
    assert samples[("segserve:spec_decode_segment_gate_open", (("segment", "default"),))] == 0
    assert ("segserve:spec_decode_segment_gate_open", (("segment", "json"),)) not in samples  # no decision yet
    assert samples[("segserve:spec_decode_gate_open", ())] == 1  # the latest step's, over every kind


def test_status_with_the_scheduler_down_still_answers(router_url, scheduler):
    fake, _ = scheduler
    fake.has_stats = False
    try:
        body = httpx.get(router_url + "/status", timeout=10).json()
    finally:
        fake.has_stats = True
    assert body["components"]["scheduler"] == "unreachable" and body["requests"] is None


def test_status_body_rates_per_segment_and_an_unreachable_scheduler():
    load = SchedulerLoad(2, 3, 16, 64, 1, SpecTotals(4, 40, 10, ()), num_prefix_cache_queries=100,
                         num_prefix_cache_hits=25, num_workers=2, num_live_workers=1,
                         segments=(SegmentLoad("code", 4, 40, 10, num_budget_nodes=6, gate_batch_bucket=2,
                                               is_gate_open=True),))
    body = status_body(load, True, "", False)
    assert body["components"] == {"router": "ok", "scheduler": "ready", "workers": "1/2 live"}
    assert body["requests"] == {"running": 2, "waiting": 3, "preemptions": 1}
    assert body["kv_cache"]["usage"] == 0.25 and body["prefix_cache"]["hit_rate"] == 0.25
    assert body["speculation"]["segments"] == [{"segment": "code", "num_drafts": 4, "num_draft_tokens": 40,
                                                "num_accepted_tokens": 10, "acceptance": 0.25,
                                                "accepted_per_draft": 2.5, "is_drafting": True,
                                                "budget_nodes": 6, "gate": {"batch_bucket": 2, "is_open": True}}]
    assert body["speculation"]["gate"] is None and body["drafters"] == []  # no decision yet, no drafter
    down = status_body(None, False, "scheduler unreachable: UNAVAILABLE", True)
    assert down["components"] == {"router": "draining", "scheduler": "unreachable", "workers": None}
    assert down["requests"] is None and down["detail"] == "scheduler unreachable: UNAVAILABLE"
