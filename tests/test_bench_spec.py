"""`segserve bench spec` parts: workloads, numbers and goals, the systems' adapters, a whole run on fakes.

The real benchmark is never run here: fakes stand in for systems, HF `generate()`
runs on the tiny random model, and segserve's HTTP + GetStats adapter talks to a
mock transport and a fake stub.
"""

from __future__ import annotations

import contextlib
import json

import httpx
import pytest

from protos.segserve.v1 import scheduler_pb2
from segserve.bench import spec, spec_report, spec_systems
from segserve.bench.spec_report import LOOKUP, OFF, PLAIN, SPEC
from segserve.bench.spec_workloads import KINDS, Workload, build_workloads, structured_prompt
from segserve.cli import build_parser


def test_workloads_cover_the_four_kinds_in_order_with_structured_warmup():
    workloads = build_workloads(num_structured=5, num_structured_warmup=2)
    assert [w.kind for w in workloads] == list(KINDS)
    structured = workloads[2]
    assert len(structured.prompts) == 5 and structured.num_warmup == 2
    assert all(w.num_warmup == 0 and len(w.prompts) == 1 for w in workloads if w.kind != "structured")
    # Every structured request shares the earlier records and begins a different new one in a json fence.
    assert len(set(structured.prompts)) == 5
    assert all(p.count("```json\n") == 3 and p.endswith('"department": "') for p in structured.prompts)
    assert '"id": 3,' in structured_prompt(0) and '"id": 7,' in structured_prompt(4)
    code, grounded = workloads[0].prompts[0], workloads[1].prompts[0]
    assert code.count("def circle_area(radius):") == 2  # the file, then the begun copy
    assert grounded.split("Passage:\n")[1].startswith(grounded.rsplit('"', 1)[1])  # the answer quotes it


def test_workloads_reject_bad_shapes():
    assert [w.kind for w in build_workloads(kinds=("grounded", "open_ended"))] == ["grounded", "open_ended"]
    with pytest.raises(ValueError):
        build_workloads(num_structured=2, num_structured_warmup=2)
    with pytest.raises(ValueError):
        Workload("poetry", ("x",))
    with pytest.raises(ValueError):
        Workload("structured", ("a",), num_warmup=1)


def _request(num_tokens: int, wall_s: float, text: str = "t", steps: int | None = None, accepted: int = 0) -> dict:
    counters = None
    if steps is not None:
        counters = {"num_steps": steps, "num_verified": steps - 1, "num_draft_tokens": 4 * (steps - 1),
                    "num_accepted_tokens": accepted, "segments": {}}  # fmt: skip
    return {"num_tokens": num_tokens, "wall_s": wall_s, "text": text, "spec": counters}


def test_summarize_uses_the_steady_state_after_warmup():
    requests = [_request(10, 10.0, steps=10, accepted=0), _request(10, 1.0, steps=2, accepted=8),
                _request(10, 1.0, steps=2, accepted=8)]  # fmt: skip
    summary = spec_report.summarize(requests, num_warmup=1)
    assert summary["tokens_per_s"] == pytest.approx(10.0)  # 20 tokens / 2 s, the slow first one left out
    assert summary["tokens_per_s_all"] == pytest.approx(30 / 12)
    assert summary["tokens_per_step"] == pytest.approx(5.0)  # 20 tokens / 4 steps
    assert summary["accepted_per_verify"] == pytest.approx(8.0)  # 16 accepted / 2 verifying steps
    assert "spec" not in spec_report.summarize([_request(4, 1.0)], 0)
    rows = spec_report.progression(requests)
    assert [r["tokens_per_step"] for r in rows] == [1.0, 5.0, 5.0]


def _summaries(rates: dict[str, dict[str, float]]) -> dict:
    return {system: {kind: {"tokens_per_s": rate} for kind, rate in per.items()} for system, per in rates.items()}


def test_speedups_and_goals_from_synthetic_numbers():
    rates = {PLAIN: {"code_edit": 10.0, "grounded": 10.0, "open_ended": 10.0},
             LOOKUP: {"code_edit": 14.0, "grounded": 28.0, "open_ended": 8.6},
             OFF: {"code_edit": 9.0, "grounded": 9.0, "open_ended": 9.0},
             SPEC: {"code_edit": 30.0, "grounded": 30.0, "open_ended": 9.8}}  # fmt: skip
    table = spec_report.speedups(_summaries(rates))
    assert table["code_edit"][f"{SPEC}_vs_plain"] == pytest.approx(3.0)
    assert table["code_edit"][f"{SPEC}_vs_lookup"] == pytest.approx(30 / 14)
    assert table["grounded"][f"{LOOKUP}_vs_plain"] == pytest.approx(2.8)
    goals = {g["name"]: g["passed"] for g in spec_report.evaluate_goals(table)}
    assert goals["code_edit: spec on vs plain"] and goals["code_edit: spec on vs prompt lookup"]
    assert goals["grounded: spec on vs plain"] is False  # 3.0x < 3.3x
    assert goals["grounded: spec on vs prompt lookup"] is False  # 1.07x < 1.2x
    assert goals["open_ended: spec on vs plain"] and goals["open_ended: spec on vs prompt lookup"]
    assert not any(name.startswith("structured") for name in goals)  # not measured, not listed
    assert list(table) == ["code_edit", "grounded", "open_ended"]  # the workloads' order, not alphabetical


def test_speedup_spread_over_rounds_has_each_value_the_median_and_the_range(tmp_path):
    rounds = [{"speedups": spec_report.speedups(_summaries({PLAIN: {"grounded": 10.0, "open_ended": 10.0},
                                                              SPEC: {"grounded": rate, "open_ended": 9.0}}))}
              for rate in (30.0, 50.0, 40.0)]
    spread = spec_report.speedup_spread(rounds)
    assert spread["grounded"][SPEC] == {"values": [3.0, 5.0, 4.0], "median": 4.0, "min": 3.0, "max": 5.0}
    assert spread["open_ended"][SPEC]["median"] == pytest.approx(0.9) and LOOKUP not in spread["grounded"]
    path = spec_report.plot_speedup_spread(tmp_path / "speedup.png", {"model": "/m/tiny", "speedups": spread})
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_a_missing_system_leaves_its_goals_unmeasured():
    table = spec_report.speedups(_summaries({PLAIN: {"structured": 10.0}, SPEC: {"structured": 40.0}}))
    goals = {g["name"]: g for g in spec_report.evaluate_goals(table)}
    assert goals["structured: spec on vs plain"]["passed"] is True
    assert goals["structured: spec on vs prompt lookup"]["passed"] is None


def test_mismatches_name_the_system_request_and_first_differing_char():
    texts = {PLAIN: {"grounded": ["abcdef"]}, SPEC: {"grounded": ["abcXef"]}, OFF: {"grounded": ["abcdef"]}}
    found = spec_report.mismatches(texts)
    assert [(m["system"], m["kind"], m["index"], m["first_diff_char"]) for m in found] == [(SPEC, "grounded", 0, 3)]
    assert spec_report.mismatches({PLAIN: {"x": ["ab"]}, SPEC: {"x": ["abc"]}})[0]["first_diff_char"] == 2


class FakeStub:
    """GetStats answers that advance by one request's worth every call."""

    def __init__(self):
        self.calls = 0

    def GetStats(self, request, timeout=None):  # noqa: N802 (gRPC method name)
        n = self.calls
        self.calls += 1
        segment = scheduler_pb2.SpecStats(segment="json", num_verified=3 * n, num_draft_tokens=12 * n,
                                          num_accepted_tokens=9 * n)  # fmt: skip
        return scheduler_pb2.SchedulerStats(num_steps=4 * n, spec=scheduler_pb2.SpecStats(
            num_verified=3 * n, num_draft_tokens=12 * n, num_accepted_tokens=9 * n), spec_segments=[segment])


def test_complete_http_sends_a_greedy_ignore_eos_request_and_takes_counter_deltas():
    bodies = []

    def handler(request: httpx.Request) -> httpx.Response:
        bodies.append(json.loads(request.content))
        return httpx.Response(200, json={"choices": [{"text": " hello"}], "usage": {"completion_tokens": 12}})

    with httpx.Client(transport=httpx.MockTransport(handler), base_url="http://127.0.0.1:1") as client:
        result = spec_systems.complete_http(client, FakeStub(), "prompt", 12)
    assert bodies == [{"prompt": "prompt", "max_tokens": 12, "temperature": 0.0, "ignore_eos": True}]
    assert result["num_tokens"] == 12 and result["text"] == " hello" and result["wall_s"] > 0
    assert result["spec"] == {"num_steps": 4, "num_verified": 3, "num_draft_tokens": 12, "num_accepted_tokens": 9,
                              "segments": {"json": {"num_verified": 3, "num_draft_tokens": 12,
                                                    "num_accepted_tokens": 9}}}  # fmt: skip

    def refuse(request: httpx.Request) -> httpx.Response:
        return httpx.Response(400, json={"error": "bad"})

    with httpx.Client(transport=httpx.MockTransport(refuse), base_url="http://127.0.0.1:1") as client:
        with pytest.raises(RuntimeError, match="HTTP 400"):
            spec_systems.complete_http(client, None, "prompt", 4)


def _fake(rate: float, text_of=lambda prompt: prompt[-5:], steps_per_request: int | None = None, fail=False):
    @contextlib.contextmanager
    def factory():
        if fail:
            raise RuntimeError("stack would not start")

        def complete(prompt: str, max_tokens: int) -> dict:
            return _request(max_tokens, max_tokens / rate, text_of(prompt), steps_per_request,
                            accepted=max_tokens - (steps_per_request or 0))  # fmt: skip

        yield complete

    return factory


def test_a_run_on_fakes_writes_json_png_goals_and_reports_mismatches(tmp_path, capsys):
    config = spec.SpecBenchConfig(max_tokens=8, num_structured=3, out=str(tmp_path))
    factories = {PLAIN: _fake(10.0), LOOKUP: _fake(20.0), OFF: _fake(9.5, steps_per_request=8),
                 SPEC: _fake(40.0, text_of=lambda prompt: "different", steps_per_request=2)}  # fmt: skip
    results = spec.run_benchmark(config, factories, tmp_path, {"command": "segserve bench spec"})
    spec.print_results(results)
    saved = json.loads((tmp_path / "spec.json").read_text())
    assert (tmp_path / "spec.png").stat().st_size > 1000
    assert saved["command"] == "segserve bench spec" and set(saved["systems"]) == {PLAIN, LOOKUP, OFF, SPEC}
    assert len(saved["systems"][SPEC]["workloads"]["structured"]) == 3
    assert saved["speedups"]["code_edit"][f"{SPEC}_vs_plain"] == pytest.approx(4.0)
    assert saved["summaries"][SPEC]["grounded"]["tokens_per_step"] == pytest.approx(4.0)
    assert all(goal["passed"] for goal in saved["goals"])  # 4x plain, 2x prompt lookup everywhere
    assert len(saved["progression"][SPEC]) == 3
    assert {m["system"] for m in saved["mismatches"]} == {SPEC} and len(saved["mismatches"]) == 6
    printed = capsys.readouterr().out
    assert "| code_edit |" in printed and "MISMATCH: segserve_spec" in printed
    assert printed.index("| code_edit |") < printed.index("| structured |") < printed.index("| open_ended |")


def test_every_system_is_warmed_up_before_its_measured_requests():
    prompts = []

    @contextlib.contextmanager
    def recording():
        yield lambda prompt, max_tokens: prompts.append((prompt, max_tokens)) or _request(max_tokens, 1.0)

    workloads = build_workloads(kinds=("grounded",))
    system = spec.run_system("x", recording, workloads, max_tokens=32)
    assert prompts[:2] == [(spec.WARMUP_PROMPT, 16)] * 2 and prompts[2] == (workloads[0].prompts[0], 32)
    assert list(system["workloads"]) == ["grounded"] and len(system["workloads"]["grounded"]) == 1


def test_a_system_that_fails_is_reported_and_the_rest_still_run(tmp_path, capsys):
    config = spec.SpecBenchConfig(max_tokens=4, kinds=("grounded",), out=str(tmp_path))
    factories = {PLAIN: _fake(10.0), LOOKUP: _fake(12.0), OFF: _fake(10.0), SPEC: _fake(1.0, fail=True)}
    results = spec.run_benchmark(config, factories, tmp_path)
    spec.print_results(results)
    assert "stack would not start" in results["systems"][SPEC]["error"]
    assert results["speedups"]["grounded"][f"{LOOKUP}_vs_plain"] == pytest.approx(1.2)
    assert {g["passed"] for g in results["goals"]} == {None}
    assert "ERROR RuntimeError: stack would not start" in capsys.readouterr().out


def test_hf_systems_on_the_tiny_model_run_to_max_tokens_and_agree(tiny_gemma3_dir):
    prompt = build_workloads(kinds=("grounded",))[0].prompts[0]
    with spec_systems.hf_system(tiny_gemma3_dir) as plain:
        expected = plain(prompt, 12)
    with spec_systems.hf_system(tiny_gemma3_dir, prompt_lookup_num_tokens=10) as lookup:
        got = lookup(prompt, 12)
    assert expected["num_tokens"] == got["num_tokens"] == 12  # EOS never ends a run early
    assert got["text"] == expected["text"] and expected["spec"] is None


def test_cli_parses_bench_spec_and_the_config_validates():
    args = build_parser().parse_args(["bench", "spec", "--max-tokens", "24", "--systems", "hf_plain,segserve_spec",
                                      "--kinds", "grounded", "--out", "x"])  # fmt: skip
    config = spec.config_from_args(args)
    assert config.systems == (PLAIN, SPEC) and config.kinds == ("grounded",) and config.max_tokens == 24
    assert args.func.__name__ == "_bench_spec_command"
    with pytest.raises(ValueError):
        spec.SpecBenchConfig(systems=("vllm",))
    with pytest.raises(ValueError):
        spec.SpecBenchConfig(num_structured=1, num_structured_warmup=1)
    with pytest.raises(ValueError):
        spec.SpecBenchConfig(rounds=0)
    assert spec.config_from_args(build_parser().parse_args(["bench", "spec", "--rounds", "3"])).rounds == 3
