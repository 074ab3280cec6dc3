"""The throughput benchmark's parts: statistics, the load generator, peers, outputs.

The benchmark itself is never run here at full size; an in-process fake OpenAI
SSE server (FastAPI + uvicorn on a free loopback port) stands in for a server.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import threading
import time

import numpy as np
import psutil
import pytest
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse

from common.ports import free_port
from segserve.bench import grpc_direct, grpc_public, loadgen, peers, report, side_by_side, throughput
from segserve.bench.loadgen import LoadSpec, RequestRecord
from tests.support.fake_scheduler import start_fake_scheduler


class FakeOpenAI:
    """A tiny OpenAI-compatible completions server: one token every `token_delay_s`."""

    def __init__(self, token_delay_s: float = 0.01, accept_ignore_eos: bool = True, eos_after: int = 3):
        self.token_delay_s = token_delay_s
        self.accept_ignore_eos = accept_ignore_eos
        self.eos_after = eos_after
        self.bodies: list[dict] = []
        self.active = 0
        self.max_active = 0
        self.app = FastAPI()
        self.app.post("/v1/completions")(self.completions)
        self.app.get("/v1/models")(lambda: {"object": "list", "data": [{"id": "fake-model"}]})

    async def completions(self, request: Request):
        body = await request.json()
        self.bodies.append(body)
        if "ignore_eos" in body and not self.accept_ignore_eos:
            return JSONResponse({"error": {"message": "unknown field ignore_eos"}}, status_code=422)
        num_tokens = body["max_tokens"] if body.get("ignore_eos") else min(body["max_tokens"], self.eos_after)

        async def events():
            self.active += 1
            self.max_active = max(self.max_active, self.active)
            try:
                yield ": keep-alive\n\n"
                for i in range(num_tokens):
                    await asyncio.sleep(self.token_delay_s)
                    yield f'data: {json.dumps({"choices": [{"index": 0, "text": f" t{i}"}]})}\n\n'
                reason = "length" if num_tokens == body["max_tokens"] else "stop"
                final = {"choices": [{"index": 0, "text": "", "finish_reason": reason}],
                         "usage": {"completion_tokens": num_tokens}}  # fmt: skip
                yield f"data: {json.dumps(final)}\n\ndata: [DONE]\n\n"
            finally:
                self.active -= 1

        return StreamingResponse(events(), media_type="text/event-stream")


def _serve(fake: FakeOpenAI):
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(fake.app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 10
    while not server.started:
        assert time.monotonic() < deadline, "fake server did not start"
        time.sleep(0.02)
    return server, thread, f"http://127.0.0.1:{port}"


@pytest.fixture
def fake_server(request):
    fake = FakeOpenAI(**getattr(request, "param", {}))
    server, thread, url = _serve(fake)
    yield fake, url
    server.should_exit = True
    thread.join(timeout=10)


def _record(started_at: float, event_times: list[float], num_tokens: int | None = None, error=None) -> RequestRecord:
    count = len(event_times) if num_tokens is None else num_tokens
    end = event_times[-1] if event_times else started_at
    return RequestRecord(0, started_at, end, list(event_times), count, "length", error)


# ----- statistics -----


@pytest.mark.parametrize("q", [0, 1, 25, 50, 90, 99, 100])
def test_percentile_matches_numpy_linear(q):
    values = [0.3, 5.0, 1.2, 9.9, 2.2, 2.2, 7.1]
    assert report.percentile(values, q) == pytest.approx(float(np.percentile(values, q)))


def test_percentile_edges():
    assert report.percentile([], 50) is None
    assert report.percentile([4.0], 99) == 4.0
    with pytest.raises(ValueError):
        report.percentile([1.0], 101)


def test_summarize_from_synthetic_event_timings():
    # Two requests sent at t=0: tokens every 100 ms after a 500 ms TTFT, and every 200 ms after 1 s.
    fast = _record(0.0, [0.5, 0.6, 0.7, 0.8])
    slow = _record(0.0, [1.0, 1.2, 1.4])
    failed = _record(0.0, [], error="HTTP 500: boom")
    summary = report.summarize([fast, slow, failed], wall_s=2.0)
    assert summary["num_requests"] == 3 and summary["num_errors"] == 1
    assert summary["errors"] == ["HTTP 500: boom"]
    assert summary["total_tokens"] == 7
    assert summary["aggregate_tokens_per_s"] == pytest.approx(3.5)
    assert summary["ttft_ms_p50"] == pytest.approx(750.0)
    assert summary["ttft_ms_p99"] == pytest.approx(500 + 500 * 0.99)
    # gaps: 100, 100, 100, 200, 200 ms
    assert summary["itl_ms_p50"] == pytest.approx(100.0)
    assert summary["itl_ms_p99"] == pytest.approx(200.0)
    assert summary["decode_tokens_per_s_median"] == pytest.approx((10.0 + 5.0) / 2)


def test_summary_counts_usage_tokens_not_events():
    # A speculative server may put 3 tokens in one event: throughput follows usage, ITL follows events.
    record = _record(0.0, [0.1, 0.2], num_tokens=6)
    summary = report.summarize([record], wall_s=1.0)
    assert summary["aggregate_tokens_per_s"] == pytest.approx(6.0)
    assert report.decode_tokens_per_s(record) == pytest.approx(5 / 0.1)
    assert summary["itl_ms_p50"] == pytest.approx(100.0)


def test_router_overhead_is_router_minus_direct_per_level():
    # Through the router: TTFT 300 ms, 100 ms per token; direct: TTFT 250 ms, 90 ms per token.
    http = {"levels": [report.level_result(1, [_record(0.0, [0.3, 0.4, 0.5])], 0.0, 0.5)]}
    direct = {"levels": [report.level_result(1, [_record(0.0, [0.25, 0.34, 0.43])], 0.0, 0.43),
                         report.level_result(4, [_record(0.0, [0.1, 0.2])], 0.0, 0.2)]}  # fmt: skip
    assert http["levels"][0]["summary"]["tpot_ms_mean"] == pytest.approx(100.0)
    (level,) = report.router_overhead(http, direct)  # only the levels both ran
    assert level["concurrency"] == 1 and level["grpc"]["tpot_ms_mean"] == pytest.approx(90.0)
    assert level["overhead_ms_per_token"] == pytest.approx(10.0)
    assert level["ttft_ms_p50_difference"] == pytest.approx(50.0)
    table = "\n".join(report.overhead_table([level]))
    assert "| 1 | 300 / 250 | 300 / 250 | 100 / 90 | 100 / 90 | 100.0 / 90.0 | 10.00 | 50.0 |" in table
    assert report.overhead_table([]) == []


def test_summarize_wall_defaults_to_first_start_to_last_finish():
    records = [_record(1.0, [1.5, 2.0]), _record(1.2, [2.5, 3.0])]
    assert report.summarize(records)["wall_s"] == pytest.approx(2.0)


def _system(name: str, rates: dict[int, float], decode: float = 10.0) -> dict:
    return {"name": name, "levels": [
        {"concurrency": c, "summary": {"aggregate_tokens_per_s": r, "decode_tokens_per_s_median": decode}}
        for c, r in rates.items()]}  # fmt: skip


def test_goals_pass_and_fail():
    baseline = {"decode_tokens_per_s": 10.0}
    ours = _system("segserve", {1: 10.0, 16: 35.0}, decode=9.6)
    peer = _system("peer", {1: 8.0, 16: 40.0})
    goals = report.evaluate_goals(baseline, ours, peer, 1, 16)
    assert [g["passed"] for g in goals] == [True, True, False]
    assert [round(g["measured"], 3) for g in goals] == [0.96, 3.5, 0.875]
    slow = report.evaluate_goals(baseline, _system("segserve", {1: 10.0, 16: 20.0}, decode=9.0), None, 1, 16)
    assert [g["passed"] for g in slow] == [False, False, None]


def test_one_concurrency_level_leaves_the_scaling_goal_unmeasured():
    ours = _system("segserve", {1: 10.0}, decode=9.6)
    goals = report.evaluate_goals({"decode_tokens_per_s": 10.0}, ours, None, 1, 1)
    assert [g["passed"] for g in goals] == [True, None, None]
    assert goals[1]["measured"] is None and "not measured" in report.markdown_table({"systems": {}, "goals": goals})


# ----- load generator, pure parts -----


def test_sse_parsing_and_event_folding():
    assert loadgen.parse_sse_line(": keep-alive") is None
    assert loadgen.parse_sse_line("") is None
    assert loadgen.parse_sse_line("data: [DONE]") is None
    record = RequestRecord(0, 0.0)
    loadgen.apply_event(record, loadgen.parse_sse_line('data: {"choices":[{"text":"a"}]}'), 0.1)
    loadgen.apply_event(record, loadgen.parse_sse_line('data:{"choices":[{"text":""}]}'), 0.2)
    loadgen.apply_event(record, {"choices": [{"text": "", "finish_reason": "length"}],
                                 "usage": {"completion_tokens": 2}}, 0.3)  # fmt: skip
    assert record.event_times == [0.1] and record.num_tokens == 2 and record.finish_reason == "length"
    loadgen.apply_event(record, {"error": {"message": "deadline"}}, 0.4)
    assert record.error.startswith("error event")


def test_loadgen_refuses_non_loopback_hosts():
    with pytest.raises(ValueError, match="loopback"):
        LoadSpec(base_url="http://example.com:8000", prompts=["x"], max_tokens=4, concurrency=1)
    assert loadgen.completions_url("http://127.0.0.1:1/v1/") == "http://127.0.0.1:1/v1/completions"


# ----- load generator against a fake server -----


def test_loadgen_runs_concurrent_streams(fake_server):
    fake, url = fake_server
    spec = LoadSpec(base_url=url, prompts=["a", "b"], max_tokens=5, concurrency=3, requests_per_stream=2,
                    model="fake-model", extra_body={"ignore_eos": True})  # fmt: skip
    run = asyncio.run(loadgen.run_load(spec))
    assert len(run.records) == 6
    assert sorted(r.stream_index for r in run.records) == [0, 0, 1, 1, 2, 2]
    for record in run.records:
        assert record.error is None and record.num_tokens == 5 and len(record.event_times) == 5
        assert record.finish_reason == "length"
        assert record.event_times[0] - record.started_at >= fake.token_delay_s * 0.9
        assert record.event_times == sorted(record.event_times) and record.finished_at >= record.event_times[-1]
    assert fake.max_active == 3
    body = fake.bodies[0]
    assert body["stream"] is True and body["temperature"] == 0.0 and body["ignore_eos"] is True
    assert body["model"] == "fake-model" and body["stream_options"] == {"include_usage": True}
    summary = report.summarize(run.records, run.finished_at - run.started_at)
    assert summary["itl_ms_p50"] >= fake.token_delay_s * 1000 * 0.9


@pytest.mark.parametrize("fake_server", [{"token_delay_s": 0.5}], indirect=True)
def test_loadgen_level_is_bounded_in_time(fake_server):
    _, url = fake_server
    spec = LoadSpec(base_url=url, prompts=["a"], max_tokens=50, concurrency=2, requests_per_stream=3,
                    extra_body={"ignore_eos": True}, time_limit_s=0.4)  # fmt: skip
    started = time.monotonic()
    run = asyncio.run(loadgen.run_load(spec))
    assert time.monotonic() - started < 3.0
    assert len(run.records) == 2 and all(r.error == "time limit" for r in run.records)


@pytest.mark.parametrize("fake_server", [{"accept_ignore_eos": False}], indirect=True)
def test_bench_http_drops_refused_extra_body(fake_server):
    fake, url = fake_server
    assert asyncio.run(loadgen.fetch_model_name(url)) == "fake-model"
    refused = asyncio.run(loadgen.probe(LoadSpec(base_url=url, prompts=["a"], max_tokens=4, concurrency=1,
                                                 extra_body={"ignore_eos": True})))  # fmt: skip
    assert refused.error.startswith("HTTP 422")
    config = throughput.ThroughputConfig(concurrency=(1, 2), max_tokens=6, requests_per_stream=1)
    system = throughput.bench_http("fake", url, "fake-model", {"ignore_eos": True}, config)
    assert "error" not in system and system["extra_body"] == {} and "refused" in system["notes"][0]
    assert [level["concurrency"] for level in system["levels"]] == [1, 2]
    # Without ignore_eos the fake stops at its EOS: the records say so rather than hiding it.
    assert all(r["num_tokens"] == fake.eos_after and r["finish_reason"] == "stop"
               for level in system["levels"] for r in level["records"])  # fmt: skip


# ----- config and CLI flags -----


def test_throughput_flags_build_a_validated_config():
    parser = argparse.ArgumentParser()
    throughput.add_throughput_args(parser)
    args = parser.parse_args(["--concurrency", "16,1,4", "--max-tokens", "32", "--peer", "batched-generate"])
    config = throughput.config_from_args(args)
    assert config.concurrency == (1, 4, 16) and config.max_tokens == 32 and config.peer == "batched-generate"
    assert config.router_overhead is True and config.grpc_api is True and config.overhead_rounds == 0
    assert throughput.config_from_args(parser.parse_args(["--overhead-rounds", "3"])).overhead_rounds == 3
    assert throughput.config_from_args(parser.parse_args(["--no-router-overhead"])).router_overhead is False
    assert throughput.config_from_args(parser.parse_args(["--no-grpc-api"])).grpc_api is False
    assert parser.parse_args([]).out == "bench-results"
    with pytest.raises(ValueError):
        throughput.ThroughputConfig(concurrency=(0, 4))
    with pytest.raises(ValueError, match="loopback"):
        throughput.ThroughputConfig(segserve_url="http://10.0.0.1:8000")
    with pytest.raises(ValueError, match="overhead_rounds"):
        throughput.ThroughputConfig(overhead_rounds=-1)


# ----- peers -----


def test_ignore_eos_body_for_transformers_serve(tiny_gemma3_dir):
    body = peers.ignore_eos_body(tiny_gemma3_dir, 12)
    config = json.loads(body["generation_config"])
    assert config["eos_token_id"] == -1 and config["max_new_tokens"] == 12 and config["do_sample"] is False
    assert peers.offline_env()["HF_HUB_OFFLINE"] == "1"
    server = peers.TransformersServe(tiny_gemma3_dir, port=12345)
    assert server.base_url == "http://127.0.0.1:12345"
    command = peers.TransformersServe(tiny_gemma3_dir, extra_args=("--cb-num-blocks", "8")).command()
    assert command[command.index("serve") + 1 :][:2] == [str(tiny_gemma3_dir), "--continuous-batching"]
    assert command[-2:] == ["--cb-num-blocks", "8"] and "127.0.0.1" in command


def test_plain_and_batched_generate_on_tiny_model(tiny_gemma3_dir):
    model, tokenizer = peers.load_model(tiny_gemma3_dir)
    baseline = peers.measure_plain_generate(model, tokenizer, "The quick brown fox", 6, runs=2)
    assert len(baseline["runs"]) == 2 and baseline["tokens_per_s"] > 0 and baseline["decode_tokens_per_s"] > 0
    assert all(1 <= run["num_tokens"] <= 6 for run in baseline["runs"])
    records = peers.run_batched_generate(model, tokenizer, ["a b", "The quick brown fox", "def"], 3, 5, 2)
    assert len(records) == 6 and all(r.num_tokens == 5 and len(r.event_times) == 5 for r in records)
    assert records[3].started_at >= records[0].finished_at  # rounds run one after the other


def test_vllm_serve_runs_make_vllms_venv_offline_with_a_bounded_kv_cache(tmp_path):
    missing = peers.VllmServe(tmp_path / "model", venv=tmp_path / "no-venv")
    with pytest.raises(peers.PeerStartError, match="make vllm"):
        missing.command()
    (tmp_path / "venv" / "bin").mkdir(parents=True)
    (tmp_path / "venv" / "bin" / "vllm").write_text("")
    server = peers.VllmServe(tmp_path / "model", port=12345, venv=tmp_path / "venv",
                             speculative_config={"method": "suffix", "num_speculative_tokens": 5})
    command = server.command()
    assert command[:3] == [str(tmp_path / "venv" / "bin" / "vllm"), "serve", str(tmp_path / "model")]
    assert command[command.index("--served-model-name") + 1] == server.model_name == "model"
    assert json.loads(command[command.index("--speculative-config") + 1])["method"] == "suffix"
    assert server.name == "vLLM (suffix)" and server.base_url == "http://127.0.0.1:12345"
    assert server.env()["VLLM_CPU_KVCACHE_SPACE"] == "4" and server.env()["HF_HUB_OFFLINE"] == "1"
    assert "--speculative-config" not in peers.VllmServe(tmp_path / "model", venv=tmp_path / "venv").command()


class SleepingPeer(peers.PeerServer):
    """A "server" that starts a child of its own and never answers: what stop() must clean up."""

    name = "sleeper"

    def __init__(self, pid_file, **kwargs) -> None:
        super().__init__(pid_file.parent, **kwargs)
        self.pid_file = pid_file

    def command(self) -> list[str]:
        script = ("import subprocess, sys, time; child = subprocess.Popen([sys.executable, '-c', "
                  "'import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(600)']); "
                  f"open({str(self.pid_file)!r}, 'w').write(str(child.pid)); time.sleep(600)")
        return [sys.executable, "-c", script]


def test_a_peer_server_that_never_answers_is_a_start_error_and_stop_leaves_none_of_its_processes(tmp_path):
    server = SleepingPeer(tmp_path / "child.pid", startup_timeout_s=3, log_path=tmp_path / "peer.log")
    with pytest.raises(peers.PeerStartError, match="sleeper not ready after 3 s"):
        with server:
            pass
    child = int((tmp_path / "child.pid").read_text())
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline and psutil.pid_exists(child) and \
            psutil.Process(child).status() != psutil.STATUS_ZOMBIE:
        time.sleep(0.1)
    assert not psutil.pid_exists(child) or psutil.Process(child).status() == psutil.STATUS_ZOMBIE


def _level(concurrency: int, tokens_per_s: float, ttft_ms: float, decode: float) -> dict:
    return {"concurrency": concurrency, "summary": {"aggregate_tokens_per_s": tokens_per_s, "ttft_ms_p50": ttft_ms,
                                                    "decode_tokens_per_s_median": decode, "num_errors": 0,
                                                    "num_requests": 1}, "records": []}


def test_side_by_side_rounds_alternate_the_order_and_ratios_come_with_their_spread():
    calls = []

    def level(name, rates):
        def run(concurrency):
            calls.append((name, concurrency))
            return _level(concurrency, rates[len([c for c in calls if c[0] == name]) - 1], 100.0, 10.0)
        return run

    ran = side_by_side.alternated_rounds({"segserve": level("segserve", [12, 24, 9, 30]),
                                          "peer": level("peer", [10, 20, 10, 20])}, (1, 16), 2)
    assert calls == [("segserve", 1), ("peer", 1), ("peer", 16), ("segserve", 16),
                     ("segserve", 1), ("peer", 1), ("peer", 16), ("segserve", 16)]
    assert [level["round"] for level in ran["peer"]] == [0, 0, 1, 1]
    rows = side_by_side.ratios(ran["segserve"], ran["peer"])
    assert rows[0]["concurrency"] == 1 and rows[0]["aggregate_tokens_per_s"]["rounds"] == [1.2, 0.9]
    assert rows[1]["aggregate_tokens_per_s"] == {"rounds": [1.2, 1.5], "median": 1.35, "min": 1.2, "max": 1.5}
    assert rows[1]["ttft"]["median"] == 1.0
    assert [level["summary"]["aggregate_tokens_per_s"] for level in side_by_side.median_levels(ran["segserve"])] \
        == [9, 24]
    goals = side_by_side.goals(rows, "vLLM", {1: 1.2, 16: 1.2})
    assert [(goal["name"], goal["passed"]) for goal in goals] == [
        ("1-stream aggregate vs vLLM", False), ("1-stream TTFT p50, vLLM's over ours", True),
        ("16-stream aggregate vs vLLM", True), ("16-stream TTFT p50, vLLM's over ours", True)]
    assert "1.35x [1.20-1.50]" in "\n".join(side_by_side.markdown(rows, "vLLM"))


def test_bench_with_the_vllm_peer_not_installed_reports_it_and_does_not_start_segserve(tmp_path, monkeypatch):
    monkeypatch.setattr(peers, "VLLM_VENV", tmp_path / "no-venv")
    systems = throughput.bench_side_by_side(throughput.ThroughputConfig(peer="vllm"), tmp_path, tmp_path)
    assert list(systems) == ["peer"] and "make vllm" in systems["peer"]["error"]


# ----- the whole command, small -----


def test_run_throughput_writes_json_png_and_table(tiny_gemma3_dir, fake_server, tmp_path, capsys):
    fake, url = fake_server
    parser = argparse.ArgumentParser()
    throughput.add_throughput_args(parser)
    args = parser.parse_args(["--model", str(tiny_gemma3_dir), "--concurrency", "1,2", "--max-tokens", "4",
                              "--requests-per-stream", "1", "--baseline-runs", "1", "--segserve-url", url,
                              "--peer", "batched-generate", "--out", str(tmp_path / "out")])  # fmt: skip
    results = throughput.run_throughput(args)
    saved = json.loads((tmp_path / "out" / "throughput.json").read_text())
    assert saved["config"]["concurrency"] == [1, 2] and saved["command"]
    assert saved["machine"]["cpu_count"] >= 1 and saved["baseline"]["tokens_per_s"] > 0
    assert set(saved["systems"]) == {"segserve", "peer"} and saved["systems"]["peer"]["kind"] == "batched-generate"
    assert "router_overhead" not in saved and "no scheduler" in saved["systems"]["segserve"]["notes"][0]
    assert "no gRPC port" in saved["systems"]["segserve"]["notes"][1]
    ours = saved["systems"]["segserve"]["levels"]
    assert [level["summary"]["total_tokens"] for level in ours] == [4, 8]
    assert all(len(r["event_times"]) == 4 for level in ours for r in level["records"])
    assert len(saved["goals"]) == 3 and results["goals"] == saved["goals"]
    assert (tmp_path / "out" / "throughput.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    table = capsys.readouterr().out
    assert "| segserve | 1 |" in table and "| batched generate() | 2 |" in table and "plain generate()" in table


def test_router_overhead_against_the_schedulers_grpc(tiny_gemma3_dir, fake_server):
    # The fake HTTP server stands in for the router, the fake scheduler for the stack's scheduler.
    from transformers import AutoTokenizer

    _, url = fake_server
    server, scheduler, port = start_fake_scheduler(AutoTokenizer.from_pretrained(tiny_gemma3_dir))
    try:
        config = throughput.ThroughputConfig(concurrency=(1, 3), max_tokens=10, requests_per_stream=2,
                                             overhead_rounds=2)
        systems = throughput.bench_router_and_scheduler(config, tiny_gemma3_dir, url, f"127.0.0.1:{port}")
    finally:
        server.stop(grace=None)
    direct = systems["segserve_grpc"]
    assert direct["kind"] == "grpc-direct" and [level["concurrency"] for level in direct["levels"]] == [1, 3]
    measured = [request for request in scheduler.requests if request.stopping.max_tokens == 10]
    assert len(measured) == 3 * 2 * (1 + 3)  # the levels, then two rounds; the warm-up asks for 4 and 8 tokens
    # The rounds: each level through the router, then directly, back to back, round after round.
    assert [(r["round"], r["concurrency"]) for r in direct["overhead_rounds"]] == [(0, 1), (0, 3), (1, 1), (1, 3)]
    assert all(r["num_errors"] == 0 and r["router_tpot_ms"] > r["grpc_tpot_ms"] + 5 for r in direct["overhead_rounds"])
    # Each round also says what the load generator (this process) spent per token on each side.
    assert all(r["router_client_cpu_ms_per_token"] > 0 and r["grpc_client_cpu_ms_per_token"] > 0
               for r in direct["overhead_rounds"])
    rounds = report.overhead_rounds(direct["overhead_rounds"])
    assert [(level["concurrency"], len(level["overhead_ms_per_token"])) for level in rounds] == [(1, 2), (3, 2)]
    assert all(level["min"] <= level["median"] <= level["max"] and level["min"] > 5 for level in rounds)
    assert all(set(level["client_cpu_ms_per_token"]) == {"router", "grpc"} for level in rounds)
    table = report.markdown_table({"systems": systems, "router_overhead_rounds": rounds})
    assert "alternated rounds: median [min-max]" in table and f"| 3 | {rounds[1]['median']:.2f} [" in table
    cpu = rounds[1]["client_cpu_ms_per_token"]
    assert "load generator CPU ms/token, HTTP / gRPC" in table
    assert f"| {cpu['router']:.3f} / {cpu['grpc']:.3f} |" in table
    prompt_ids = grpc_direct.tokenize_prompts(tiny_gemma3_dir, throughput.PROMPTS)
    assert {tuple(r.prompt_token_ids) for r in measured} <= {tuple(ids) for ids in prompt_ids}
    assert all(r.stopping.ignore_eos and not r.sampling.do_sample for r in measured)
    for level in direct["levels"]:  # the fake sends two tokens per chunk
        assert level["summary"]["num_errors"] == 0 and level["summary"]["total_tokens"] == 10 * level["concurrency"] * 2
        assert all(len(r["event_times"]) == 5 and r["finish_reason"] == "length" for r in level["records"])
    overhead = report.router_overhead(systems["segserve"], direct)
    assert [level["concurrency"] for level in overhead] == [1, 3]
    for level in overhead:
        for side in ("router", "grpc"):
            assert all(level[side][key] > 0 for key in report.OVERHEAD_KEYS)
        # The fake router sleeps 10 ms per token; the fake scheduler does not sleep at all.
        assert level["overhead_ms_per_token"] > 5 and level["ttft_ms_p50_difference"] > 5


def test_a_levels_load_generator_cpu_is_this_processs_cpu_time_per_token():
    def level(burn_s: float, total_tokens: int) -> dict:
        start = time.process_time()
        while time.process_time() - start < burn_s:
            pass
        return {"summary": {"total_tokens": total_tokens}}

    summary, cpu_s = loadgen.with_cpu(level, 0.05, 10)
    assert summary == {"total_tokens": 10} and 0.05 <= cpu_s < 1.0
    assert loadgen.cpu_ms_per_token(cpu_s, summary) == pytest.approx(1000 * cpu_s / 10)
    assert loadgen.cpu_ms_per_token(cpu_s, {"total_tokens": 0}) is None  # nothing streamed: no figure
    rounds = report.overhead_rounds([
        {"round": 0, "concurrency": 4, "router_tpot_ms": 3.0, "grpc_tpot_ms": 2.0,
         "router_client_cpu_ms_per_token": 0.06, "grpc_client_cpu_ms_per_token": 0.02},
        {"round": 1, "concurrency": 4, "router_tpot_ms": 4.0, "grpc_tpot_ms": 2.0,
         "router_client_cpu_ms_per_token": 0.08, "grpc_client_cpu_ms_per_token": None},
        {"round": 2, "concurrency": 4, "router_tpot_ms": 3.5, "grpc_tpot_ms": 2.0},  # a run saved before the CPU
    ])
    assert rounds[0]["median"] == 1.5 and rounds[0]["client_cpu_ms_per_token"] == {"router": 0.07, "grpc": 0.02}


def test_grpc_api_level_through_a_real_router(tiny_gemma3_dir, tmp_path):
    # A real router (HTTP and its public gRPC API) in front of the fake scheduler: every level over HTTP, over
    # GenerateStream and straight to the scheduler, with the same prompts, tokens, greedy and ignore_eos.
    from transformers import AutoTokenizer

    from router.config import RouterConfig
    from tests.support.router_server import serve_router_and_grpc

    tokenizer = AutoTokenizer.from_pretrained(tiny_gemma3_dir)
    server, scheduler, port = start_fake_scheduler(tokenizer)
    router = RouterConfig(model=str(tiny_gemma3_dir), scheduler_address=f"127.0.0.1:{port}", port=free_port(),
                          grpc_port=0, scheduler_wait_s=10)  # fmt: skip
    config = throughput.ThroughputConfig(concurrency=(1, 3), max_tokens=10, requests_per_stream=2)
    try:
        with serve_router_and_grpc(router, tokenizer) as (url, grpc_address):
            systems = throughput.bench_router_and_scheduler(config, tiny_gemma3_dir, url, f"127.0.0.1:{port}",
                                                            grpc_address)  # fmt: skip
    finally:
        server.stop(grace=None)
    assert list(systems) == ["segserve", "segserve_grpc_api", "segserve_grpc"]
    api = systems["segserve_grpc_api"]
    assert api["kind"] == "grpc-api" and "error" not in api and [lv["concurrency"] for lv in api["levels"]] == [1, 3]
    measured = [request for request in scheduler.requests if request.stopping.max_tokens == 10]
    assert len(measured) == 3 * 2 * (1 + 3)  # HTTP, gRPC API, direct; the warm-ups ask for 4 and 8 tokens
    prompt_ids = {tuple(ids) for ids in grpc_direct.tokenize_prompts(tiny_gemma3_dir, throughput.PROMPTS)}
    assert {tuple(r.prompt_token_ids) for r in measured} <= prompt_ids
    assert all(r.stopping.ignore_eos and not r.sampling.do_sample for r in measured)
    for system in systems.values():
        for level in system["levels"]:
            summary = level["summary"]
            assert summary["num_errors"] == 0 and summary["total_tokens"] == 10 * level["concurrency"] * 2
            assert all(r["finish_reason"] == "length" and r["event_times"] for r in level["records"])
    # At most one text event per scheduler chunk (the fake sends two tokens per chunk).
    assert all(1 <= len(r["event_times"]) <= 5 for level in api["levels"] for r in level["records"])
    results = {"systems": systems, "model": "tiny",
               "router_overhead": report.router_overhead(systems["segserve"], systems["segserve_grpc"]),
               "grpc_api_overhead": report.router_overhead(api, systems["segserve_grpc"])}  # fmt: skip
    assert [level["concurrency"] for level in results["grpc_api_overhead"]] == [1, 3]
    assert all(level["overhead_ms_per_token"] is not None for level in results["grpc_api_overhead"])
    table = report.markdown_table(results)
    assert "| segserve gRPC API | 3 |" in table and "router overhead (gRPC API) ms/token" in table
    assert "TTFT p50 ms gRPC API / gRPC" in table and "TTFT p50 ms router / gRPC" in table
    assert report.plot(tmp_path / "t.png", results).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_grpc_api_load_refuses_non_loopback_and_counts_errors():
    with pytest.raises(ValueError, match="loopback"):
        grpc_public.PublicGrpcLoadSpec(address="10.0.0.1:8001", prompts=["x"], max_tokens=4, concurrency=1)
    spec = grpc_public.PublicGrpcLoadSpec(address=f"127.0.0.1:{free_port()}", prompts=["x"], max_tokens=4,
                                          concurrency=2, request_timeout_s=10)  # fmt: skip
    run = asyncio.run(grpc_public.run_load(spec))  # nothing listens there
    assert len(run.records) == 2 and all(r.error.startswith("UNAVAILABLE") for r in run.records)


@pytest.mark.e2e
def test_transformers_serve_peer_runs_offline_to_max_tokens(tiny_gemma3_dir, tmp_path):
    # Small explicit CB cache sizes: the automatic sizing costs ~15 s on the first request on this CPU.
    server = peers.TransformersServe(tiny_gemma3_dir, startup_timeout_s=120, log_path=tmp_path / "serve.log",
                                     extra_args=("--cb-num-blocks", "64", "--cb-max-batch-tokens", "256"))
    with server:
        spec = LoadSpec(base_url=server.base_url, prompts=["The quick brown fox"], max_tokens=12, concurrency=2,
                        model=server.model_name, extra_body=peers.ignore_eos_body(tiny_gemma3_dir, 12))  # fmt: skip
        run = asyncio.run(loadgen.run_load(spec))
    assert server._process is None
    assert [r.error for r in run.records] == [None, None]
    assert all(r.num_tokens == 12 and r.finish_reason == "length" and r.event_times for r in run.records)
