"""The router's operations surface through real HTTP: /health, /ready, /metrics, API keys, body limit, 429s.

The router runs under uvicorn with API keys and a small body limit, in front of
the fake scheduler, extended here with a settable Health and GetStats.
"""

from __future__ import annotations

import argparse
import contextlib
from concurrent import futures

import grpc
import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families
from transformers import AutoTokenizer

from protos.segserve.v1 import scheduler_pb2, scheduler_pb2_grpc
from protos.segserve.v1.info import Health, WorkerInfo
from protos.segserve.v1.stats import DrafterReplicaStats, DrafterSegmentStats, DrafterStats
from router.app import create_app
from router.config import RouterConfig
from router.scheduler_client import SchedulerClient
from segserve.flags import add_dataclass_args, from_args
from tests.support.fake_scheduler import FakeScheduler
from tests.support.router_server import serve_router
from tests.router.test_server import _free_port

MODEL = "tiny-test"
KEY = "sk-test-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
HTTP = ("protocol", "http")
"""The label of the request metrics of requests that came over HTTP."""
MAX_BODY = 16 * 1024
STATS = scheduler_pb2.SchedulerStats(
    num_running=3, num_waiting=2, num_used_kv_blocks=16, num_total_kv_blocks=64, num_preemptions=1,
    num_prefix_cache_queries=900, num_prefix_cache_hits=640,
    spec=scheduler_pb2.SpecStats(num_verified=10, num_draft_tokens=40, num_accepted_tokens=12,
                                 num_accepted_by_depth=[8, 3, 1], is_drafting=True, gate_batch_bucket=4),
    spec_segments=[scheduler_pb2.SpecStats(segment="code", num_verified=10, num_draft_tokens=40,
                                           num_accepted_tokens=12, is_drafting=True, num_budget_nodes=8,
                                           gate_batch_bucket=4, is_gate_open=True),
                   scheduler_pb2.SpecStats(segment="default", gate_batch_bucket=4),
                   scheduler_pb2.SpecStats(segment="json")],
    drafters=[DrafterReplicaStats("10.0.0.1:50071", True, DrafterStats(
                  (DrafterSegmentStats("code", 1234, 345520, 2), DrafterSegmentStats("default", 50, 14000, 1)), 3)
              ).to_pb(),
              DrafterReplicaStats("10.0.0.2:50071", False).to_pb()])


class OpsFakeScheduler(FakeScheduler):
    """The fake scheduler, with a worker that may be not ready yet and stats that may be unavailable."""

    is_ready = True
    has_stats = True

    def Health(self, request, context):
        return Health(self.is_ready, "" if self.is_ready else "warming up").to_pb()

    def GetStats(self, request, context):
        if not self.has_stats:
            context.abort(grpc.StatusCode.UNAVAILABLE, "stats are off")
        return STATS


@pytest.fixture(scope="module")
def tokenizer(tiny_gemma3_dir):
    return AutoTokenizer.from_pretrained(str(tiny_gemma3_dir))


@pytest.fixture(scope="module")
def scheduler(tokenizer):
    fake = OpsFakeScheduler(tokenizer, model_name=MODEL)
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=8))
    scheduler_pb2_grpc.add_SchedulerServicer_to_server(fake, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    yield fake, port
    server.stop(grace=None)


@pytest.fixture(scope="module")
def router_url(scheduler, tiny_gemma3_dir):
    _, grpc_port = scheduler
    config = RouterConfig(model=str(tiny_gemma3_dir), scheduler_address=f"127.0.0.1:{grpc_port}",
                          port=_free_port(), scheduler_wait_s=10, api_keys=[KEY, "sk-other"],
                          max_request_body_bytes=MAX_BODY)
    with serve_router(config) as url:
        yield url


@contextlib.contextmanager
def worker_ready(fake: OpsFakeScheduler, is_ready: bool):
    fake.is_ready = is_ready
    try:
        yield
    finally:
        fake.is_ready = True


def scrape(router_url: str) -> dict[tuple[str, tuple], float]:
    """/metrics as {(sample name, sorted labels without model_name): value}."""
    reply = httpx.get(f"{router_url}/metrics")
    assert reply.status_code == 200 and reply.headers["content-type"].startswith("text/plain")
    samples = {}
    for family in text_string_to_metric_families(reply.text):
        for sample in family.samples:
            assert sample.labels.get("model_name") == MODEL, sample
            labels = tuple(sorted((k, v) for k, v in sample.labels.items() if k != "model_name"))
            samples[(sample.name, labels)] = sample.value
    return samples


def test_health_is_liveness_and_ready_waits_for_the_worker(router_url, scheduler):
    fake, _ = scheduler
    with worker_ready(fake, False):
        assert httpx.get(f"{router_url}/health").json() == {"status": "ok"}
        not_ready = httpx.get(f"{router_url}/ready")
        assert not_ready.status_code == 503
        assert not_ready.json() == {"status": "not_ready", "reason": "warming up"}
    ready = httpx.get(f"{router_url}/ready")
    assert ready.status_code == 200 and ready.json() == {"status": "ready"}


@pytest.mark.parametrize("headers", [{}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY},
                                     {"Authorization": f"Basic {KEY}"}])
def test_api_routes_need_a_key(router_url, headers):
    for method, path, body in [("GET", "/v1/models", None), ("POST", "/v1/completions", {"prompt": "hi"}),
                               ("POST", f"/v2/models/{MODEL}/generate", {"text_input": "hi"}),
                               ("POST", "/tokenize", {"prompt": "hi"}), ("POST", "/detokenize", {"tokens": [1]})]:
        reply = httpx.request(method, f"{router_url}{path}", json=body, headers=headers)
        assert reply.status_code == 401, path
        assert reply.headers["www-authenticate"] == "Bearer"
        assert reply.json()["error"]["code"] == "invalid_api_key"


def test_a_valid_key_opens_every_api_and_ops_routes_stay_open(router_url):
    assert httpx.get(f"{router_url}/v1/models", headers={"Authorization": "Bearer sk-other"}).status_code == 200
    reply = httpx.post(f"{router_url}/v2/models/{MODEL}/generate", json={"text_input": "hi"}, headers=AUTH)
    assert reply.status_code == 200 and reply.json()["text_output"]
    client = openai.OpenAI(base_url=f"{router_url}/v1", api_key=KEY, max_retries=0)
    assert client.completions.create(model=MODEL, prompt="hi", max_tokens=4).choices[0].text
    for path in ("/health", "/ready", "/metrics", "/openapi.json"):
        assert httpx.get(f"{router_url}{path}").status_code == 200, path


def test_the_openapi_document_lists_the_routes(router_url):
    paths = httpx.get(f"{router_url}/openapi.json").json()["paths"]
    for path in ("/v1/completions", "/v1/chat/completions", "/v1/models", f"/v2/models/{{model}}/generate",
                 "/health", "/ready", "/metrics"):
        assert path in paths, path


def test_a_body_over_the_limit_gets_413_before_parsing(router_url, scheduler):
    fake, _ = scheduler
    num_requests = len(fake.requests)
    big = b'{"prompt": "' + b"x" * MAX_BODY + b'"}'

    def chunks():
        for start in range(0, len(big), 4096):
            yield big[start:start + 4096]

    for content in (big, chunks()):  # a declared Content-Length, then a chunked body
        reply = httpx.post(f"{router_url}/v1/completions", content=content,
                           headers={**AUTH, "Content-Type": "application/json"})
        assert reply.status_code == 413
        assert reply.json()["error"]["code"] == "request_too_large"
    small = httpx.post(f"{router_url}/v1/completions", content=iter([b'{"prompt": "hi", ', b'"max_tokens": 2}']),
                       headers={**AUTH, "Content-Type": "application/json"})
    assert small.status_code == 200 and small.json()["usage"]["completion_tokens"] == 2
    assert len(fake.requests) == num_requests + 1


def test_an_overloaded_scheduler_gives_429_with_retry_after(router_url):
    before = scrape(router_url)
    for stream in (False, True):
        reply = httpx.post(f"{router_url}/v1/completions", json={"prompt": "OVERLOAD", "stream": stream},
                           headers=AUTH)
        assert reply.status_code == 429 and reply.headers["retry-after"] == "1"
        assert reply.json()["error"]["type"] == "rate_limit_error"
    for suffix in ("generate", "generate_stream"):
        reply = httpx.post(f"{router_url}/v2/models/{MODEL}/{suffix}", json={"text_input": "OVERLOAD"},
                           headers=AUTH)
        assert reply.status_code == 429 and reply.headers["retry-after"] == "1"
    failures = ("segserve:request_failure_total", (("code", "overloaded"), HTTP))
    assert scrape(router_url)[failures] - before.get(failures, 0) == 4


def test_metrics_observe_requests_with_vllm_names(router_url, scheduler):
    fake, _ = scheduler
    before = scrape(router_url)
    client = openai.OpenAI(base_url=f"{router_url}/v1", api_key=KEY, max_retries=0)
    client.completions.create(model=MODEL, prompt="hello there", max_tokens=200)  # stops at EOS
    list(client.completions.create(model=MODEL, prompt="hello", max_tokens=3, stream=True))
    after = scrape(router_url)

    def delta(name: str, *labels: tuple[str, str]) -> float:
        key = (name, tuple(sorted((*labels, HTTP))))  # requests over HTTP are labelled so
        return after[key] - before.get(key, 0.0)

    for histogram in ("vllm:time_to_first_token_seconds", "vllm:e2e_request_latency_seconds",
                      "vllm:request_queue_time_seconds"):
        assert delta(f"{histogram}_count") == 2, histogram
    assert delta("vllm:inter_token_latency_seconds_count") >= 2  # the long answer comes in many chunks
    assert delta("vllm:request_success_total", ("finished_reason", "stop")) == 1
    assert delta("vllm:request_success_total", ("finished_reason", "length")) == 1
    num_prompt_tokens = sum(len(r.prompt_token_ids) for r in fake.requests[-2:])
    assert delta("vllm:prompt_tokens_total") == num_prompt_tokens
    assert delta("vllm:generation_tokens_total") == len(fake.output_ids) + 1 + 3


def test_metrics_report_the_schedulers_load_and_speculation(router_url, scheduler):
    fake, _ = scheduler
    samples = scrape(router_url)
    assert samples[("segserve:scheduler_up", ())] == 1
    assert samples[("vllm:num_requests_running", ())] == 3
    assert samples[("vllm:num_requests_waiting", ())] == 2
    assert samples[("vllm:kv_cache_usage_perc", ())] == 0.25
    assert samples[("vllm:num_preemptions_total", ())] == 1
    assert samples[("vllm:prefix_cache_queries_total", ())] == 900
    assert samples[("vllm:prefix_cache_hits_total", ())] == 640
    assert samples[("vllm:spec_decode_num_drafts_total", ())] == 10
    assert samples[("vllm:spec_decode_num_draft_tokens_total", ())] == 40
    assert samples[("vllm:spec_decode_num_accepted_tokens_total", ())] == 12
    per_position = [samples[("vllm:spec_decode_num_accepted_tokens_per_pos_total", (("position", str(p)),))]
                    for p in range(3)]
    assert per_position == [8, 3, 1]
    assert samples[("segserve:spec_decode_budget_nodes", (("segment", "code"),))] == 8
    assert samples[("segserve:spec_decode_budget_nodes", (("segment", "default"),))] == 0
    assert samples[("segserve:spec_decode_gate_open", ())] == 1
    assert samples[("segserve:drafter_live", (("address", "10.0.0.1:50071"),))] == 1
    assert samples[("segserve:drafter_live", (("address", "10.0.0.2:50071"),))] == 0
    code = (("address", "10.0.0.1:50071"), ("segment", "code"))
    assert samples[("segserve:drafter_corpus_entries", code)] == 1234
    assert samples[("segserve:drafter_corpus_bytes", code)] == 345520
    assert not any(name.startswith("segserve:drafter_corpus") and ("address", "10.0.0.2:50071") in labels
                   for name, labels in samples)  # a replica that did not answer has no sizes
    fake.has_stats = False
    try:
        samples = scrape(router_url)
    finally:
        fake.has_stats = True
    assert samples[("segserve:scheduler_up", ())] == 0
    assert ("vllm:num_requests_running", ()) not in samples
    assert ("vllm:time_to_first_token_seconds_count", (HTTP,)) in samples  # the router's own metrics stay


def test_apps_have_their_own_metrics_registries(tokenizer):
    info = WorkerInfo(model_name=MODEL, num_kv_blocks=64, block_size=16, max_model_len=256,
                      vocab_size=len(tokenizer), eos_token_ids=(1,))
    for _ in range(2):  # a second app would clash in prometheus_client's global registry
        create_app(RouterConfig(), SchedulerClient("127.0.0.1:1"), tokenizer, info)


def test_api_keys_come_from_the_environment_or_a_file_never_a_flag(monkeypatch, tmp_path):
    parser = argparse.ArgumentParser()
    add_dataclass_args(parser, RouterConfig)
    assert "--api-keys" not in parser.format_help()  # a flag would show the keys in `ps`
    with pytest.raises(SystemExit):
        parser.parse_args(["--api-keys", "a"])
    key_file = tmp_path / "keys"
    key_file.write_text("# rotated in May\nsk-c\n\n  sk-d  # the batch jobs' key\nsk-a\n")
    monkeypatch.setenv("SEGSERVE_API_KEYS", "sk-a, sk-b")
    config = from_args(RouterConfig, parser.parse_args(["--api-key-file", str(key_file),
                                                         "--max-request-body-bytes", "99"]))
    assert config.api_keys == ["sk-a", "sk-b", "sk-c", "sk-d"] and config.max_request_body_bytes == 99
    monkeypatch.delenv("SEGSERVE_API_KEYS")
    assert from_args(RouterConfig, parser.parse_args([])).api_keys == []
    assert RouterConfig().api_keys == [] and RouterConfig().max_request_body_bytes == 4 * 1024 * 1024
    with pytest.raises(ValueError, match="max_request_body_bytes"):
        RouterConfig(max_request_body_bytes=0)
    with pytest.raises(ValueError, match="api_keys: a key holds no whitespace or comma"):
        RouterConfig(api_keys=["sk a"])


def test_a_missing_unreadable_or_empty_key_file_stops_the_start_up(tmp_path, capsys):
    from segserve.cli import main

    comments_only = tmp_path / "empty-keys"
    comments_only.write_text("# no key yet\n\n")
    for path, error in [(tmp_path / "missing", "cannot be read: No such file or directory"),
                        (tmp_path, "cannot be read: Is a directory"), (comments_only, "holds no key")]:
        assert main(["router", "--api-key-file", str(path)]) == 2
        assert f"segserve: error: api_key_file '{path}' {error}" in capsys.readouterr().err


def test_the_launcher_gives_the_router_its_keys_in_the_environment_not_its_command_line(monkeypatch, tmp_path):
    import subprocess

    from segserve.launcher import Stack, StackConfig

    monkeypatch.setenv("SEGSERVE_API_KEYS", "sk-of-the-parent")  # already read into the configs
    seen = {}
    monkeypatch.setattr(subprocess, "Popen", lambda argv, **kw: seen.update(argv=argv, env=kw["env"]))
    stack = Stack(StackConfig(log_dir=str(tmp_path)))
    stack._spawn("router", RouterConfig(api_keys=[KEY, "sk-other"]))
    assert not any(KEY in arg for arg in seen["argv"]) and seen["env"]["SEGSERVE_API_KEYS"] == f"{KEY},sk-other"
    stack._spawn("router", RouterConfig())
    assert "SEGSERVE_API_KEYS" not in seen["env"]
