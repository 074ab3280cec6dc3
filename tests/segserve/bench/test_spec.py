"""`segserve bench spec` parts: workloads, numbers and goals, the systems' adapters, a whole run on fakes.

The real benchmark is never run here: fakes stand in for systems, HF `generate()`
runs on the tiny random model, segserve's HTTP + GetStats adapter talks to a
mock transport and a fake stub, and the prompt-lookup-only segments config is
checked on the drafter's own planner.
"""

from __future__ import annotations

import contextlib
import json

import httpx
import pytest

from protos.segserve.v1 import scheduler_pb2
from segserve.bench import peer_workloads, public_workloads, spec, spec_mixed, spec_report, spec_systems
from segserve.bench.spec_report import LOOKUP, OFF, PLAIN, SEG_LOOKUP, SPEC, SUFFIX, VLLM_PLAIN, VLLM_SUFFIX
from segserve.bench.spec_workloads import (EDIT_KINDS, KINDS, MIXED, MONTHS_JSON_REST, MONTHS_REST, SAMPLED_KINDS,
                                           Workload, build_workloads, load_file, structured_prompt)
from segserve.cli import build_parser


def test_workloads_cover_every_kind_in_order_with_structured_warmup():
    workloads = build_workloads(num_structured=5, num_structured_warmup=2)
    assert [w.kind for w in workloads] == list(KINDS)
    structured = workloads[2]
    assert len(structured.prompts) == 5 and structured.num_warmup == 2
    assert all(w.num_warmup == 0 and len(w.prompts) == 1 for w in workloads[:4] if w.kind != "structured")
    # Every structured request shares the earlier records and begins a different new one in a json fence.
    assert len(set(structured.prompts)) == 5
    assert all(p.count("```json\n") == 3 and p.endswith('"department": "') for p in structured.prompts)
    assert '"id": 3,' in structured_prompt(0) and '"id": 7,' in structured_prompt(4)
    code, grounded = workloads[0].prompts[0], workloads[1].prompts[0]
    assert code.count("def circle_area(radius):") == 2  # the file, then the begun copy
    assert grounded.split("Passage:\n")[1].startswith(grounded.rsplit('"', 1)[1])  # the answer quotes it


def test_edit_outputs_are_in_no_prompt_but_repeat_across_requests():
    workloads = {w.kind: w for w in build_workloads(num_edits=4)}
    for kind, shared in (("months_edit", MONTHS_REST), ("months_json", MONTHS_JSON_REST)):
        edit = workloads[kind]
        assert len(edit.prompts) == len(edit.expected) == 4 and edit.num_warmup == 1 and edit.is_greedy
        assert len(set(edit.prompts)) == 4  # a different file / project per request
        for prompt, expected in zip(edit.prompts, edit.expected):
            assert expected not in prompt and shared in expected  # the recurring block ...
            assert not any(line in prompt for line in shared.splitlines() if len(line) > 12)  # ... in no prompt
        # The recurring text fills most of each output, and the learned corpus has it from request 1 on.
        assert all(len(shared) > 0.5 * len(expected) for expected in edit.expected)
        sources = spec_report.output_sources(list(edit.prompts), list(edit.expected))
        assert sources["after_first"]["in_earlier_outputs_only"] > 0.5 and sources["per_request"][0]["new"] > 0.5
    for kind in SAMPLED_KINDS:
        sampled, greedy = workloads[kind], workloads[kind.removesuffix("_sampled")]
        assert sampled.temperature == 0.7 and not sampled.is_greedy and sampled.prompts == greedy.prompts


def test_output_sources_split_lines_by_where_they_come_from():
    prompts = ["x\nshared in prompt\n", "y\nshared in prompt\n"]
    outputs = ["shared in prompt\nlearned line\n", "learned line\nbrand new line\nshared in prompt\n"]
    rows = spec_report.output_sources(prompts, outputs)["per_request"]
    assert rows[0] == {"in_prompt": 16 / 28, "in_earlier_outputs_only": 0.0, "new": 12 / 28}
    assert rows[1] == {"in_prompt": 16 / 42, "in_earlier_outputs_only": 12 / 42, "new": 14 / 42}


def test_workloads_reject_bad_shapes():
    assert [w.kind for w in build_workloads(kinds=("grounded", "open_ended"))] == ["grounded", "open_ended"]
    with pytest.raises(ValueError):
        build_workloads(num_structured=2, num_structured_warmup=2)
    with pytest.raises(ValueError):
        Workload("", ("x",))
    with pytest.raises(ValueError):
        Workload(MIXED, ("x",))  # the mixed mode's own row
    with pytest.raises(ValueError):
        Workload("structured", ("a",), num_warmup=1)
    with pytest.raises(ValueError):
        Workload("months_edit", ("a", "b"), expected=("only one",))
    with pytest.raises(ValueError):
        build_workloads(num_edits=1)


def _request(num_tokens: int, wall_s: float, text: str = "t", steps: int | None = None, accepted: int = 0,
             drafter: dict | None = None) -> dict:  # fmt: skip
    counters = None
    if steps is not None:
        counters = {"num_steps": steps, "num_verified": steps - 1, "num_draft_tokens": 4 * (steps - 1),
                    "num_accepted_tokens": accepted, "segments": {}}  # fmt: skip
        if drafter is not None:
            counters["drafter"] = drafter
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


def test_ablation_speedups_and_the_edit_goal_compare_systems_on_the_same_engine():
    rates = {PLAIN: {"months_edit": 10.0}, LOOKUP: {"months_edit": 12.0}, OFF: {"months_edit": 12.0},
             SEG_LOOKUP: {"months_edit": 15.0}, SPEC: {"months_edit": 30.0}}  # fmt: skip
    row = spec_report.speedups(_summaries(rates))["months_edit"]
    assert row[f"{SPEC}_vs_{SEG_LOOKUP}"] == pytest.approx(2.0) and row[f"{SPEC}_vs_own_plain"] == pytest.approx(2.5)
    assert row[f"{SEG_LOOKUP}_vs_own_plain"] == pytest.approx(1.25) and row[f"{LOOKUP}_vs_own_plain"] == 1.2
    goals = {g["name"]: g for g in spec_report.evaluate_goals({"months_edit": row}, mismatches=[])}
    assert goals["months_edit: full segserve vs prompt lookup only"]["passed"] is True
    assert goals["greedy outputs equal plain decoding's"]["passed"] is True
    rates[SPEC]["months_edit"] = 18.0  # 1.2x lookup only: below the 1.3x goal
    row = spec_report.speedups(_summaries(rates))["months_edit"]
    goals = {g["name"]: g for g in spec_report.evaluate_goals({"months_edit": row}, mismatches=[{"x": 1}])}
    assert goals["months_edit: full segserve vs prompt lookup only"]["passed"] is False
    assert goals["greedy outputs equal plain decoding's"]["passed"] is False


def test_against_vllm_each_side_decodes_alike_plain_with_plain_and_full_segserve_with_suffix_decoding():
    rates = {OFF: {"agentic": 12.0}, SPEC: {"agentic": 30.0}, VLLM_PLAIN: {"agentic": 10.0},
             VLLM_SUFFIX: {"agentic": 27.0}}
    row = spec_report.speedups(_summaries(rates))["agentic"]
    assert row[f"{OFF}_vs_{VLLM_PLAIN}"] == pytest.approx(1.2)
    assert row[f"{SPEC}_vs_{VLLM_SUFFIX}"] == pytest.approx(30 / 27)
    assert row[f"{VLLM_SUFFIX}_vs_own_plain"] == pytest.approx(2.7)
    goals = {g["name"]: g["passed"] for g in spec_report.evaluate_goals({"agentic": row})}
    assert goals["agentic: segserve, spec off vs vLLM"] is True
    assert goals["agentic: segserve, full vs vLLM, SuffixDecoding"] is False  # 1.11x < 1.2x
    without_vllm = spec_report.evaluate_goals(spec_report.speedups(_summaries({OFF: {"agentic": 1.0}})))
    assert not any("vLLM" in goal["name"] for goal in without_vllm)
    assert spec.SpecBenchConfig().systems == spec_report.DEFAULT_SYSTEMS
    assert spec.SpecBenchConfig(systems=(SPEC, VLLM_SUFFIX)).systems == (SPEC, VLLM_SUFFIX)


def test_spread_gives_every_number_its_values_median_and_range():
    rounds = [{"grounded": {"tokens_per_s": rate, "tokens_per_step": None, "text": "x"}, "open_ended": {"n": 1}}
              for rate in (30.0, 50.0, 40.0)]  # fmt: skip
    rounds[1]["open_ended"]["n"] = 4
    table = spec_report.spread(rounds)
    assert table["grounded"] == {"tokens_per_s": {"values": [30.0, 50.0, 40.0], "median": 40.0, "min": 30.0,
                                                  "max": 50.0}}  # None and text leaves are dropped
    assert table["open_ended"]["n"]["median"] == 1 and table["open_ended"]["n"]["max"] == 4
    assert spec_report.spread([{"a": 1.0}, {"a": 3.0}])["a"]["median"] == 2.0  # even count: the mean of the two
    assert spec_report.medians(table) == {"grounded": {"tokens_per_s": 40.0}, "open_ended": {"n": 1}}


def test_a_missing_system_leaves_its_goals_unmeasured():
    table = spec_report.speedups(_summaries({PLAIN: {"structured": 10.0}, SPEC: {"structured": 40.0}}))
    goals = {g["name"]: g for g in spec_report.evaluate_goals(table)}
    assert goals["structured: spec on vs plain"]["passed"] is True
    assert goals["structured: spec on vs prompt lookup"]["passed"] is None


def test_mismatches_name_the_system_request_and_first_differing_char():
    texts = {PLAIN: {"grounded": ["abcdef"], "months_edit_sampled": ["a"]},
             SPEC: {"grounded": ["abcXef"], "months_edit_sampled": ["b"]},
             SEG_LOOKUP: {"grounded": ["abcdeY"]}, OFF: {"grounded": ["abcdef"]}}  # fmt: skip
    found = spec_report.mismatches(texts, greedy_kinds=("grounded",))  # sampled outputs are never compared
    assert [(m["system"], m["kind"], m["index"], m["first_diff_char"]) for m in found] == [
        (SEG_LOOKUP, "grounded", 0, 5), (SPEC, "grounded", 0, 3)]  # fmt: skip
    assert spec_report.mismatches({PLAIN: {"x": ["ab"]}, SPEC: {"x": ["abc"]}})[0]["first_diff_char"] == 2
    # Without HF plain, segserve's own plain decoding is the reference.
    found = spec_report.mismatches({OFF: {"x": ["ab"]}, SEG_LOOKUP: {"x": ["ab"]}, SPEC: {"x": ["aX"]}})
    assert [(m["system"], m["reference"]) for m in found] == [(SPEC, OFF)]


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

    with httpx.Client(transport=httpx.MockTransport(handler), base_url="http://127.0.0.1:1") as client:
        spec_systems.complete_http(client, None, "prompt", 12, temperature=0.7, seed=7)
    assert bodies[-1] == {"prompt": "prompt", "max_tokens": 12, "temperature": 0.7, "ignore_eos": True, "seed": 7}

    def refuse(request: httpx.Request) -> httpx.Response:
        return httpx.Response(400, json={"error": "bad"})

    with httpx.Client(transport=httpx.MockTransport(refuse), base_url="http://127.0.0.1:1") as client:
        with pytest.raises(RuntimeError, match="HTTP 400"):
            spec_systems.complete_http(client, None, "prompt", 4)


def _fake(rate: float, text_of=lambda prompt: prompt[-5:], steps_per_request: int | None = None, fail=False,
          calls: list | None = None, drafter: dict | None = None):  # fmt: skip
    @contextlib.contextmanager
    def factory():
        if fail:
            raise RuntimeError("stack would not start")

        def complete(prompt: str, max_tokens: int, temperature: float = 0.0, seed: int | None = None) -> dict:
            if calls is not None:
                calls.append((prompt, max_tokens, temperature, seed))
            return _request(max_tokens, max_tokens / rate, text_of(prompt), steps_per_request,
                            accepted=max_tokens - (steps_per_request or 0), drafter=drafter)  # fmt: skip

        yield complete

    return factory


def _round_rates(rates_by_round: list[dict[str, float]], **spec_fakes):
    """A make_factories whose systems run at each round's rates (rounds counted per model)."""
    counts: dict[str, int] = {}

    def make(label, model_dir, out):
        k = counts[label] = counts.get(label, -1) + 1
        rates = rates_by_round[k]
        return {name: _fake(rate, **spec_fakes.get(name, {})) for name, rate in rates.items()}

    return make


def test_a_run_on_fakes_writes_every_systems_numbers_with_spread_goals_and_mismatches(tmp_path, capsys):
    config = spec.SpecBenchConfig(max_tokens=8, num_structured=3, num_edits=3, rounds=3, out=str(tmp_path))
    rates = [{PLAIN: 10.0, LOOKUP: 20.0, OFF: 12.0, SEG_LOOKUP: 16.0, SUFFIX: 20.0, SPEC: spec_rate}
             for spec_rate in (40, 24, 32)]  # fmt: skip
    suffix_drafter = {"num_draft_calls": 4, "cpu_seconds": 0.002,
                      "memory": {"num_bytes": 800, "num_learned_tokens": 10}}
    spec_drafter = {"num_draft_calls": 2, "cpu_seconds": 0.002,
                    "memory": {"num_bytes": 1000, "num_learned_tokens": 10}}
    spec_fakes = {OFF: {"steps_per_request": 8}, SEG_LOOKUP: {"steps_per_request": 4},
                  SUFFIX: {"steps_per_request": 4, "drafter": suffix_drafter},
                  SPEC: {"text_of": lambda prompt: "different", "steps_per_request": 2, "drafter": spec_drafter}}
    results = spec.run_benchmark(config, _round_rates(rates, **spec_fakes), {"base": "/m/base"}, tmp_path,
                                 {"command": "segserve bench spec"})  # fmt: skip
    spec.print_results(results)
    saved = json.loads((tmp_path / "spec.json").read_text())
    assert (tmp_path / "spec.png").stat().st_size > 1000
    assert saved["command"] == "segserve bench spec" and saved["finetuned"].startswith("not measured")
    base = saved["models"]["base"]
    assert len(base["rounds"]) == 3 and (tmp_path / "round-2" / "base" / "spec.json").is_file()
    assert set(base["rounds"][0]["systems"]) == set(config.systems) == set(spec_report.DEFAULT_SYSTEMS)
    # The ablation systems wrote their numbers; every number has its spread over the rounds.
    full_vs_lookup = base["speedups"]["months_edit"][f"{SPEC}_vs_{SEG_LOOKUP}"]
    assert full_vs_lookup == {"values": [2.5, 1.5, 2.0], "median": 2.0, "min": 1.5, "max": 2.5}
    assert base["summaries"][SEG_LOOKUP]["months_json"]["tokens_per_s"]["median"] == pytest.approx(16.0)
    assert base["summaries"][SPEC]["grounded"]["tokens_per_step"]["median"] == pytest.approx(4.0)
    per_step = base["speedups"]["months_edit"][f"{SPEC}_vs_{SEG_LOOKUP}_tokens_per_step"]  # 4 vs 2 tokens per step
    assert per_step["median"] == pytest.approx(2.0) and per_step["min"] == per_step["max"]
    # The sampled workload reports acceptance for the speculative systems, and sends temperature and seeds.
    sampled = base["summaries"][SPEC]["months_edit_sampled"]
    assert {"draft_acceptance", "accepted_per_verify"} <= set(sampled) and sampled["draft_acceptance"]["median"] > 0
    assert "draft_acceptance" in base["summaries"][SEG_LOOKUP]["months_json_sampled"]
    goals = {g["name"]: g["passed"] for g in base["goals"]}
    assert goals["months_edit: full segserve vs prompt lookup only"] is True  # median 2.0x
    # Against SuffixDecoding: 32 / 20 tok/s and 4 / 2 tokens per step; the drafters' CPU per call and memory.
    assert base["speedups"]["grounded"][f"{SPEC}_vs_{SUFFIX}"]["median"] == pytest.approx(1.6)
    assert base["speedups"]["grounded"][f"{SPEC}_vs_{SUFFIX}_tokens_per_step"]["median"] == pytest.approx(2.0)
    assert base["summaries"][SUFFIX]["grounded"]["drafter_cpu_ms_per_call"]["median"] == pytest.approx(0.5)
    assert base["summaries"][SPEC]["grounded"]["drafter_bytes_per_learned_token"]["median"] == pytest.approx(100)
    assert goals["grounded: full segserve vs SuffixDecoding, tok/s"] is True  # 1.6x >= the 1.0x floor
    assert goals["drafter memory per learned token: SuffixDecoding / full segserve"] is False  # 80 vs 100 bytes
    assert goals["greedy outputs equal plain decoding's"] is False
    # Every greedy output of the full system differs, in every round; sampled ones are not compared.
    num_greedy = 1 + 1 + 3 + 1 + 3 + 3
    assert {m["system"] for m in base["mismatches"]} == {SPEC} and len(base["mismatches"]) == 3 * num_greedy
    assert set(base["output_sources"]) == set(EDIT_KINDS)
    printed = capsys.readouterr().out
    assert "| months_edit |" in printed and "MISMATCH: round 1 segserve_spec" in printed
    assert "against SuffixDecoding" in printed
    assert "| grounded | 20.0 (20.0-20.0) / 32.0 (24.0-40.0) | 1.60x (1.20-2.00) |" in printed
    assert "2.00x (1.50-2.50)" in printed  # full vs lookup only: median (min-max)


def test_a_finetuned_model_runs_the_same_systems_side_by_side(tmp_path):
    config = spec.SpecBenchConfig(max_tokens=4, kinds=("months_edit",), num_edits=2, rounds=2,
                                  systems=(OFF, SEG_LOOKUP, SPEC), out=str(tmp_path))  # fmt: skip
    seen = []

    def make(label, model_dir, out):
        seen.append((label, str(model_dir), out.relative_to(tmp_path).as_posix()))
        boost = 2.0 if label == "finetuned" else 1.0
        return {OFF: _fake(10.0), SEG_LOOKUP: _fake(12.0), SPEC: _fake(18.0 * boost)}

    results = spec.run_benchmark(config, make, {"base": "/m/base", "finetuned": "/m/ft"}, tmp_path)
    assert seen == [("base", "/m/base", "round-1/base"), ("finetuned", "/m/ft", "round-1/finetuned"),
                    ("base", "/m/base", "round-2/base"), ("finetuned", "/m/ft", "round-2/finetuned")]
    key = f"{SPEC}_vs_{SEG_LOOKUP}"
    assert results["models"]["base"]["speedups"]["months_edit"][key]["median"] == pytest.approx(1.5)
    assert results["models"]["finetuned"]["speedups"]["months_edit"][key]["median"] == pytest.approx(3.0)
    assert "finetuned" not in results  # no "not measured" note when it was measured


def test_every_system_is_warmed_up_then_sends_each_workloads_length_temperature_and_seed():
    calls = []
    workloads = build_workloads(kinds=("grounded", "months_json_sampled"), num_edits=2)
    system = spec.run_system("x", _fake(10.0, calls=calls), workloads, max_tokens=32)
    assert calls[:2] == [(spec.WARMUP_PROMPT, 16, 0.0, None)] * 2
    assert calls[2] == (workloads[0].prompts[0], 32, 0.0, None)
    sampled = workloads[1]
    assert calls[3:] == [(prompt, sampled.max_tokens, 0.7, sampled.seed + i)
                         for i, prompt in enumerate(sampled.prompts)]  # fmt: skip
    assert list(system["workloads"]) == ["grounded", "months_json_sampled"]


def test_a_system_that_fails_is_reported_and_the_rest_still_run(tmp_path, capsys):
    config = spec.SpecBenchConfig(max_tokens=4, kinds=("grounded",), rounds=1, out=str(tmp_path))
    factories = {PLAIN: _fake(10.0), LOOKUP: _fake(12.0), OFF: _fake(10.0), SEG_LOOKUP: _fake(11.0),
                 SUFFIX: _fake(11.0), SPEC: _fake(1.0, fail=True)}  # fmt: skip
    results = spec.run_benchmark(config, lambda label, model_dir, out: factories, {"base": "/m"}, tmp_path)
    spec.print_results(results)
    block = results["models"]["base"]
    assert block["errors"] == [{"round": 1, "system": SPEC, "error": "RuntimeError: stack would not start"}]
    assert block["speedups"]["grounded"][f"{LOOKUP}_vs_plain"]["median"] == pytest.approx(1.2)
    assert {g["passed"] for g in block["goals"] if g["name"].startswith("grounded")} == {None}
    assert "ERROR RuntimeError: stack would not start" in capsys.readouterr().out


def test_lookup_only_segments_config_drafts_one_chain_from_the_request_and_never_learns(tmp_path):
    from drafter.planner import DraftPlanner
    from drafter.segments import load_segments
    from drafter.state import RequestStates

    config = spec_systems.stack_config(tmp_path / "m", "float32", "lookup", tmp_path / "logs")
    assert config.is_speculative and config.drafter.segments_config
    segments = load_segments(config.drafter.segments_config)  # no markers, so no tokenizer is needed
    assert segments.kinds == () and segments.default.algorithm == "single_branch"
    learned = []
    states = RequestStates(segments, lambda name, token_ids, tenant: learned.append((name, list(token_ids))))
    planner = DraftPlanner(segments)
    tokens = [5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 5, 6]
    state = states.update("r", tokens, len(tokens), len(tokens))
    tree, segment = planner.draft(state, max_nodes=16)
    assert segment == "default" and list(tree.token_ids) == list(range(7, 17))  # the prompt's own continuation
    assert all(depth == i + 1 for i, depth in enumerate(tree.depths))  # one chain
    fence = [2717, 100, 2717]  # whatever markers the shipped config has, none is a segment here
    states.update("r", fence, len(tokens) + 3, len(tokens))
    assert learned == [] and planner.corpora["default"].propose(tokens + fence, 10, 8) == []
    assert states.finish("r", [20, 21], len(tokens) + 5, len(tokens))  # the output, outside every segment, is
    for name, token_ids in learned:  # learned, but a one-node corpus keeps nothing of it
        planner.learn(name, token_ids)
    assert learned and planner.corpora["default"].num_entries == 0
    assert not spec_systems.stack_config(tmp_path / "m", "float32", "off", tmp_path / "o").is_speculative
    full = spec_systems.stack_config(tmp_path / "m", "float32", "spec", tmp_path / "s")
    assert full.is_speculative and full.drafter.segments_config is None  # the shipped segments config
    with pytest.raises(ValueError, match="mode"):
        spec_systems.stack_config(tmp_path / "m", "float32", "tree", tmp_path / "t")


def test_hf_systems_on_the_tiny_model_run_to_max_tokens_and_agree(tiny_gemma3_dir):
    prompt = build_workloads(kinds=("grounded",))[0].prompts[0]
    with spec_systems.hf_system(tiny_gemma3_dir) as plain:
        expected = plain(prompt, 12)
    with spec_systems.hf_system(tiny_gemma3_dir, prompt_lookup_num_tokens=10) as lookup:
        got = lookup(prompt, 12)
    assert expected["num_tokens"] == got["num_tokens"] == 12  # EOS never ends a run early
    assert got["text"] == expected["text"] and expected["spec"] is None
    with spec_systems.hf_system(tiny_gemma3_dir) as plain:
        first, again = plain(prompt, 8, 0.7, 3), plain(prompt, 8, 0.7, 3)
    assert first["num_tokens"] == 8 and first["text"] == again["text"]  # sampled, reproducible by its seed


def test_cli_parses_bench_spec_and_the_config_validates():
    args = build_parser().parse_args(["bench", "spec", "--max-tokens", "24", "--systems", "hf_plain,segserve_lookup",
                                      "--kinds", "grounded", "--out", "x", "--finetuned-model", "/ft"])  # fmt: skip
    config = spec.config_from_args(args)
    assert config.systems == (PLAIN, SEG_LOOKUP) and config.kinds == ("grounded",) and config.max_tokens == 24
    assert config.finetuned_model == "/ft" and config.rounds == 3 and config.temperature == 0.7
    assert args.func.__name__ == "_bench_spec_command"
    with pytest.raises(ValueError):
        spec.SpecBenchConfig(systems=("vllm",))
    with pytest.raises(ValueError):
        spec.SpecBenchConfig(num_structured=1, num_structured_warmup=1)
    with pytest.raises(ValueError):
        spec.SpecBenchConfig(rounds=0)
    with pytest.raises(ValueError):
        spec.SpecBenchConfig(num_edits=1)
    with pytest.raises(ValueError):
        spec.SpecBenchConfig(temperature=0.0)
    assert spec.config_from_args(build_parser().parse_args(["bench", "spec", "--rounds", "5"])).rounds == 5
    with pytest.raises(SystemExit, match="systems must be a non-empty subset"):
        spec.run_spec(build_parser().parse_args(["bench", "spec", "--systems", "vllm"]))
    with pytest.raises(SystemExit, match="no config.json"):
        spec.run_spec(build_parser().parse_args(["bench", "spec", "--finetuned-model", "/nonexistent/ft"]))


def test_peer_goals_hold_full_segserve_to_each_workloads_target_and_a_floor_everywhere():
    rates = {SUFFIX: {"agentic": 10.0, "code_edits": 10.0, "chat": 10.0},
             SPEC: {"agentic": 11.0, "code_edits": 10.0, "chat": 9.4}}  # fmt: skip
    goals = {g["name"]: g for g in spec_report.evaluate_goals(spec_report.speedups(_summaries(rates)))}
    assert goals["agentic: full segserve vs SuffixDecoding, tok/s"]["passed"] is False  # 1.1x < 1.2x
    assert goals["code_edits: full segserve vs SuffixDecoding, tok/s"]["passed"] is True  # 1.0x >= 1.0x
    assert goals["chat: full segserve vs SuffixDecoding, tok/s"]["target"] == ">= 1.0x"
    assert goals["chat: full segserve vs SuffixDecoding, tok/s"]["passed"] is False  # 0.94x
    assert "agentic: full segserve vs SuffixDecoding, tokens/step" not in goals  # no steps measured: not listed


def test_rounds_rotate_the_systems_order():
    order = []

    def recording(name):
        @contextlib.contextmanager
        def factory():
            order.append(name)
            yield lambda prompt, max_tokens, temperature=0.0, seed=None: _request(max_tokens, 1.0)

        return factory

    config = spec.SpecBenchConfig(max_tokens=4, kinds=("grounded",), systems=(OFF, SUFFIX, SPEC))
    factories = {name: recording(name) for name in config.systems}
    workloads = build_workloads(kinds=config.kinds)
    for k in range(3):
        result = spec.run_round(config, factories, workloads, k)
        assert list(result["systems"]) == [OFF, SUFFIX, SPEC]  # reported in the configured order
    assert order == [OFF, SUFFIX, SPEC, SUFFIX, SPEC, OFF, SPEC, OFF, SUFFIX]


def test_peer_workloads_come_from_their_recorded_files_with_warmup_first():
    args = build_parser().parse_args(["bench", "spec", "--kinds", "peer", "--systems", "segserve_suffix,segserve_spec"])
    config = spec.config_from_args(args)
    assert config.kinds == spec.PEER_KINDS and config.systems == (SUFFIX, SPEC)
    for workload in build_workloads(kinds=config.kinds):
        requests = peer_workloads.load(workload.kind)
        assert workload.prompts == tuple(r["prompt"] for r in requests)
        assert workload.num_warmup == sum(r["split"] == "warmup" for r in requests) > 0
        assert all(r["split"] == "heldout" for r in requests[workload.num_warmup:])


def _write_jsonl(path, requests) -> str:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in requests))
    return str(path)


def test_a_workloads_file_gives_one_workload_per_application_warmup_first(tmp_path):
    path = _write_jsonl(tmp_path / "mine.jsonl", [
        {"kind": "triage", "split": "heldout", "prompt": "t2", "max_tokens": 8, "tenant": "support"},
        {"kind": "sql", "split": "warmup", "prompt": "s1", "max_tokens": 16, "temperature": 0.5, "seed": 9},
        {"kind": "triage", "split": "warmup", "prompt": "t1", "max_tokens": 12, "tenant": "support"},
        {"kind": "sql", "split": "heldout", "prompt": "s2", "max_tokens": 16, "temperature": 0.5, "seed": 9}])
    triage, sql = load_file(path)
    assert (triage.kind, triage.prompts, triage.num_warmup, triage.max_tokens, triage.tenant) == \
        ("triage", ("t1", "t2"), 1, 12, "support")
    assert (sql.kind, sql.prompts, sql.temperature, sql.seed, sql.is_greedy) == ("sql", ("s1", "s2"), 0.5, 9, False)
    for bad, message in (("not json", ":1: not JSON"), ({"kind": "x", "prompt": "p"}, ":1: a request needs the keys"),
                         ({"kind": "x", "split": "train", "prompt": "p", "max_tokens": 4}, ":1: split must be"),
                         ({"kind": "x", "split": "heldout", "prompt": "p", "max_tokens": "4"}, ":1: split must be")):
        with pytest.raises(ValueError, match=message):
            load_file(_write_jsonl(tmp_path / "bad.jsonl", [bad]))
    with pytest.raises(ValueError, match="only warm-up requests"):  # a workload needs something to measure
        load_file(_write_jsonl(tmp_path / "warm.jsonl", [{"kind": "x", "split": "warmup", "prompt": "p",
                                                          "max_tokens": 4}]))
    with pytest.raises(SystemExit, match="bad.jsonl:1"):  # named before any system starts
        spec.run_spec(build_parser().parse_args(["bench", "spec", "--workloads-file", str(tmp_path / "bad.jsonl")]))


def test_complete_http_sends_the_tenant_header():
    headers = []

    def handler(request: httpx.Request) -> httpx.Response:
        headers.append(request.headers.get(spec_systems.TENANT_HEADER))
        return httpx.Response(200, json={"choices": [{"text": "x"}], "usage": {"completion_tokens": 1}})

    with httpx.Client(transport=httpx.MockTransport(handler), base_url="http://127.0.0.1:1") as client:
        system = spec_systems.HttpSystem(client)
        system("p", 1, tenant="support")
        system("p", 1)
    assert headers == ["support", None] and system.counters() is None


class _Clock:
    """time.perf_counter for the mixed mode's phase: advanced by the fake systems' requests."""

    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def _mixed_fake(rate: float, calls: list, counters: list, clock: _Clock | None = None):
    """A server-like system: tenant and is_measured taken, counters() read around the measured phase; each request
    takes max_tokens / rate seconds of `clock`."""
    @contextlib.contextmanager
    def factory():
        class System:
            def __call__(self, prompt, max_tokens, temperature=0.0, seed=None, tenant="", is_measured=True):
                calls.append((prompt, tenant, is_measured))
                if clock is not None:
                    clock.now += max_tokens / rate
                return _request(max_tokens, max_tokens / rate, text=f"out of {prompt}")

            def counters(self):
                n = len(calls)
                counters.append(n)
                return {"num_steps": n, "num_verified": n, "num_draft_tokens": 4 * n, "num_accepted_tokens": 2 * n,
                        "segments": {}}

        yield System()

    return factory


def test_the_mixed_mode_interleaves_the_workloads_under_their_tenants_and_measures_them_together(monkeypatch):
    workloads = [Workload("agent", ("a0", "a1", "a2", "a3"), num_warmup=1, max_tokens=10),
                 Workload("json", ("j0", "j1"), num_warmup=1, max_tokens=20, tenant="team-j")]
    calls, counters = [], []
    system = spec_mixed.run_mixed("x", _mixed_fake(100.0, calls, counters), workloads, max_tokens=64, concurrency=1)
    sent = [(prompt, tenant) for prompt, tenant, _ in calls[2:]]  # after the two warm-up calls
    assert sent == [("a0", "agent"), ("j0", "team-j"), ("a1", "agent"), ("j1", "team-j"), ("a2", "agent"),
                    ("a3", "agent")]  # warm-ups first, then one request from each workload in turn
    assert not any(is_measured for _, _, is_measured in calls[2:])  # no counters around calls side by side
    (record,) = system["workloads"][MIXED]
    assert record["num_tokens"] == 10 + 20 + 10 + 10 and record["concurrency"] == 1
    assert record["text"].split("\n\x1e\n") == ["out of a1", "out of j1", "out of a2", "out of a3"]
    assert counters == [4, 8] and record["spec"]["num_steps"] == 4  # read before and after the held-out phase
    assert [r["kind"] for r in record["requests"]] == ["agent", "json", "agent", "agent"]
    assert [(r["kind"], r["text"]) for r in record["warmup"]] == [("agent", "out of a0"), ("json", "out of j0")]
    # A round in the mixed mode: one row, full segserve against SuffixDecoding, its 1.2x goal.
    config = spec.SpecBenchConfig(systems=(OFF, SUFFIX, SPEC), mixed_concurrency=4, rounds=1)
    clock = _Clock()
    monkeypatch.setattr(spec_mixed.time, "perf_counter", clock)  # the mixed runner times its calls
    ran = spec.run_round(config, {OFF: _mixed_fake(10.0, [], [], clock), SUFFIX: _mixed_fake(20.0, [], [], clock),
                                  SPEC: _mixed_fake(30.0, [], [], clock)}, workloads)
    assert set(ran["summaries"][SPEC]) == {MIXED} and ran["mismatches"] == []
    assert ran["speedups"][MIXED][f"{SPEC}_vs_{SUFFIX}"] == pytest.approx(1.5, rel=0.05)
    goals = {g["name"]: g for g in spec_report.evaluate_goals(ran["speedups"])}
    assert goals[f"{MIXED}: full segserve vs SuffixDecoding, tok/s"]["target"] == ">= 1.2x"
    with pytest.raises(ValueError, match="leave hf_plain"):
        spec.SpecBenchConfig(systems=(PLAIN, SPEC), mixed_concurrency=8)


def test_public_workloads_come_from_their_extracted_files_with_licences():
    args = build_parser().parse_args(["bench", "spec", "--kinds", "public,chat"])
    config = spec.config_from_args(args)
    assert config.kinds == (*public_workloads.PUBLIC_KINDS, "chat")
    workloads = {w.kind: w for w in build_workloads(kinds=config.kinds)}
    for kind in public_workloads.PUBLIC_KINDS:
        workload = workloads[kind]
        assert 0 < workload.num_warmup < len(workload.prompts) and workload.is_greedy
        assert all(prompt.startswith("<|im_start|>") for prompt in workload.prompts)  # the instruct model's chat
    assert all("<tools>" in p and "<tool_response>" in p for p in workloads["tau2_retail"].prompts[1:3])
    for licence in ("LICENSE-human-eval", "LICENSE-mt-bench", "LICENSE-tau2", "SOURCES.md"):
        assert (public_workloads.DATA_DIR / licence).stat().st_size > 0


def test_tau2_tool_schemas_read_the_tools_signatures_and_docstrings():
    source = '''
class Tools:
    @is_tool(ToolType.READ)
    def get_order_details(self, order_id: str, verbose: bool) -> Order:
        """
        Get the status and details of an order.

        Args:
            order_id: The order id, such as '#W0000000'.
            verbose: Whether to say more.
        """

    def _private(self, x: str) -> None:
        """Not a tool."""
'''
    (tool,) = public_workloads.tool_schemas(source)
    assert tool["function"]["name"] == "get_order_details"
    assert tool["function"]["description"] == "Get the status and details of an order."
    assert tool["function"]["parameters"]["properties"] == {
        "order_id": {"type": "string", "description": "The order id, such as '#W0000000'."},
        "verbose": {"type": "boolean", "description": "Whether to say more."}}


def test_each_sources_acceptance_is_taken_over_the_requests():
    def counters(judged, matched):
        return {"num_steps": 0, "num_verified": 0, "num_draft_tokens": 0, "num_accepted_tokens": 0, "segments": {},
                "drafter": {"num_draft_calls": 0, "cpu_seconds": 0.0, "backend": "segserve",
                            "memory": {"num_bytes": 0, "num_learned_tokens": 0},
                            "sources": {"default/history": [judged, matched]}}}

    first = spec_systems.counter_delta(counters(0, 0), counters(10, 8))
    second = spec_systems.counter_delta(counters(10, 8), counters(30, 10))
    assert second["drafter"]["sources"] == {"default/history": [20, 2]}
    requests = [{"num_tokens": 4, "wall_s": 1.0, "text": "", "spec": delta} for delta in (first, second)]
    assert spec_report.summarize(requests, 0)["source_acceptance"] == {"default/history": pytest.approx(10 / 30)}


def test_without_a_plain_decoding_system_no_output_is_said_to_be_compared(tmp_path, capsys):
    config = spec.SpecBenchConfig(systems=(SUFFIX, SPEC), kinds=("grounded",), rounds=1, out=str(tmp_path))
    results = spec.run_benchmark(config, _round_rates([{SUFFIX: 20.0, SPEC: 30.0}]), {"base": "m"}, tmp_path)
    block = results["models"]["base"]
    assert block["outputs_compared"] is False
    assert not any(g["name"] == "greedy outputs equal plain decoding's" for g in block["goals"])
    spec.print_results(results)
    assert "greedy outputs: not compared" in capsys.readouterr().out
