"""`segserve bench router` end to end at a tiny size: a real router in front of the paced scheduler.

The numbers are not judged (a timed test proves nothing on a shared CPU); what
is checked is that every output is written and self-consistent: every token the
paced scheduler sent came through both endpoints, the CPU per token is the
router's CPU seconds over those tokens, and the rounds alternate.
"""

from __future__ import annotations

import json

import pytest

from segserve.bench.loadgen import RequestRecord, apply_event
from segserve.bench.router_cpu import request_body, run_router, summarize
from segserve.cli import build_parser


def test_request_bodies_stream_with_usage():
    chat = request_body("chat", "hi", 7)
    assert chat["messages"] == [{"role": "user", "content": "hi"}] and "prompt" not in chat
    completion = request_body("completions", "hi", 7)
    assert completion["prompt"] == "hi" and "messages" not in completion
    for body in (chat, completion):
        assert body["stream"] and body["stream_options"] == {"include_usage": True} and body["max_tokens"] == 7


def test_text_events_of_both_shapes_and_usage_are_counted():
    record = RequestRecord(stream_index=0, started_at=0.0)
    apply_event(record, {"choices": [{"delta": {"role": "assistant", "content": ""}}]}, 1.0)  # chat's opening chunk
    apply_event(record, {"choices": [{"delta": {"content": "a"}}]}, 2.0)
    apply_event(record, {"choices": [{"text": "b"}]}, 3.0)
    apply_event(record, {"choices": [{"text": "", "finish_reason": "length"}]}, 4.0)
    apply_event(record, {"choices": [], "usage": {"completion_tokens": 5}}, 5.0)
    assert (len(record.event_times), record.num_tokens, record.error) == (2, 5, None)
    apply_event(record, {"error": {"message": "boom"}}, 6.0)
    assert "boom" in record.error


def test_summarize_takes_median_and_spread_over_rounds():
    levels = [{"cpu_ms_per_token": v, "events_per_token": 1.0, "num_tokens": 10, "num_errors": 0} for v in (3, 1, 2)]
    summary = summarize(levels)
    assert (summary["cpu_ms_per_token_median"], summary["cpu_ms_per_token_min"],
            summary["cpu_ms_per_token_max"]) == (2, 1, 3)
    assert summary["num_tokens"] == 30


def test_bench_router_writes_sane_json_and_plot(tiny_gemma3_dir, tmp_path, capsys):
    out = tmp_path / "out"
    args = build_parser().parse_args([
        "bench", "router", "--model", str(tiny_gemma3_dir), "--concurrency", "3", "--max-tokens", "5",
        "--rounds", "2", "--token-interval-ms", "2", "--out", str(out)])
    results = run_router(args)

    assert (out / "router.png").stat().st_size > 0
    assert json.loads((out / "router.json").read_text()) == json.loads(json.dumps(results))
    assert [r["order"] for r in results["rounds"]] == [["completions", "chat"], ["chat", "completions"]]
    for rnd in results["rounds"]:
        for endpoint in ("completions", "chat"):
            level = rnd[endpoint]
            assert level["num_requests"] == 3 and level["num_errors"] == 0
            assert level["num_tokens"] == 3 * 5
            assert 0 < level["num_events"] <= level["num_tokens"]
            assert level["router_cpu_s"] >= 0 and level["client_cpu_s"] >= 0
            assert level["cpu_ms_per_token"] == pytest.approx(1000 * level["router_cpu_s"] / level["num_tokens"])
    for summary in results["endpoints"].values():
        assert summary["num_tokens"] == 2 * 3 * 5 and summary["num_errors"] == 0
    assert results["grpc_client_floor"]["num_tokens"] == 3 * 5
    table = capsys.readouterr().out
    assert "/v1/chat/completions" in table and "gRPC receive alone" in table


def test_bench_router_with_tracing_measures_a_traced_router_beside_and_its_spans_arrive(tiny_gemma3_dir, tmp_path,
                                                                                        capsys):
    out = tmp_path / "out"
    args = build_parser().parse_args([
        "bench", "router", "--model", str(tiny_gemma3_dir), "--concurrency", "3", "--max-tokens", "5",
        "--rounds", "2", "--token-interval-ms", "2", "--tracing", "--out", str(out)])
    results = run_router(args)

    assert json.loads((out / "router.json").read_text()) == json.loads(json.dumps(results))
    assert [r["router_order"] for r in results["rounds"]] == [["off", "tracing"], ["tracing", "off"]]
    for rnd in results["rounds"]:
        for endpoint in ("completions", "chat"):
            for level in (rnd[endpoint], rnd["tracing"][endpoint]):
                assert (level["num_requests"], level["num_errors"], level["num_tokens"]) == (3, 0, 3 * 5)
    traced = results["tracing"]
    for summary in traced["endpoints"].values():
        assert summary["num_tokens"] == 2 * 3 * 5 and summary["num_errors"] == 0
    # one router.request span per request to the traced router (warm-up included), all exported
    assert traced["num_requests"] == (2 + 2 * 2) * 3
    assert traced["received"]["services"] == {"segserve-router": traced["num_requests"]}
    table = capsys.readouterr().out
    assert "/v1/chat/completions, tracing on" in table and "/v1/completions, tracing off" in table
