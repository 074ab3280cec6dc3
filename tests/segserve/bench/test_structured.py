"""`segserve bench structured`: workloads, validity, goals and mismatches on synthetic numbers, a whole run on
fakes, and one tiny real run (HF + xgrammar and fresh segserve stacks on the tiny random Gemma3) through the CLI.

Timings are never judged here: the numbers of a tiny random model on a shared CPU prove nothing. What the real
run checks is that every output is written with its structure, that validity is counted on real outputs, that
greedy outputs agree across the segserve systems, and that the goals are evaluated.
"""

from __future__ import annotations

import contextlib
import json

import jsonschema
import pytest
import xgrammar as xgr

from common.grammar import JSON_SCHEMA_OPTIONS
from segserve.bench import structured, structured_report, structured_systems
from segserve.bench.structured_report import HF, NO_GRAMMAR, OFF, SPEC
from segserve.bench.structured_workloads import (CHATS, EXTRACTIONS, TOOL_ANSWERS, TOOL_SCHEMAS, TOOLS, Turn,
                                                 call_schemas, follow_up, schema_requests, tool_body, tool_chats)
from segserve.cli import build_parser


def _keywords(schema: dict) -> set[str]:
    """Every keyword used anywhere in `schema`, with "nested object" for an object inside another."""
    found = set(schema)
    for child in (schema.get("properties") or {}).values():
        found |= _keywords(child) | ({"nested object"} if child.get("type") == "object" else set())
    if isinstance(schema.get("items"), dict):
        found |= _keywords(schema["items"])
    return found


def test_schemas_cover_the_features_and_compile_as_the_worker_compiles_them():
    assert len(EXTRACTIONS) >= 12 and len({e.name for e in EXTRACTIONS}) == len(EXTRACTIONS)
    used = set().union(*(_keywords(e.schema) for e in EXTRACTIONS))
    assert {"enum", "nested object", "maxItems", "minimum", "maximum", "pattern", "maxLength", "required"} <= used
    for extraction in EXTRACTIONS:
        jsonschema.Draft202012Validator.check_schema(extraction.schema)
        xgr.Grammar.from_json_schema(json.dumps(extraction.schema), **JSON_SCHEMA_OPTIONS)
        assert len(extraction.records) == 4 and extraction.schema["additionalProperties"] is False
        body = extraction.body(1)
        assert body["messages"][0]["content"].endswith(extraction.records[1])
        assert body["response_format"]["json_schema"]["schema"] == extraction.schema
    for schema in TOOL_SCHEMAS.values():
        jsonschema.Draft202012Validator.check_schema(schema)


def test_schema_requests_go_schema_by_schema_and_reject_bad_sizes():
    order = [(e.name, i) for e, i in schema_requests(num_schemas=2, num_records=3)]
    assert order == [("person", 0), ("person", 1), ("person", 2), ("product", 0), ("product", 1), ("product", 2)]
    with pytest.raises(ValueError):
        schema_requests(num_schemas=len(EXTRACTIONS) + 1)
    with pytest.raises(ValueError):
        schema_requests(num_records=0)
    with pytest.raises(ValueError):
        tool_chats(num_chats=len(CHATS) + 1)


def test_a_tool_turn_forces_one_call_and_the_loop_carries_calls_and_answers_forward():
    turns = tool_chats(num_chats=1, num_turns=3)[0]
    assert [t.tool_choice for t in turns] == ["required", "search_flights", "required"]
    body = tool_body([{"role": "user", "content": "hi"}], turns[1])
    assert body["tool_choice"] == {"type": "function", "function": {"name": "search_flights"}}
    assert body["parallel_tool_calls"] is False and body["tools"] == list(TOOLS)
    assert tool_body([], turns[0])["tool_choice"] == "required"
    assert set(call_schemas(turns[0])) == set(TOOL_SCHEMAS) and list(call_schemas(turns[1])) == ["search_flights"]

    bodies = []

    def chat(body: dict, max_tokens: int) -> dict:
        bodies.append(json.loads(json.dumps(body)))  # a copy: the loop goes on appending to its history
        call = {"name": "get_weather", "arguments": '{"city": "Paris", "unit": "celsius"}'}
        return {"num_tokens": 9, "wall_s": 0.1, "text": "", "calls": [call], "finish_reason": "tool_calls",
                "spec": None}  # fmt: skip

    config = structured.StructuredBenchConfig(num_chats=2, num_turns=3, kinds=("tool_loop",))
    records = structured.run_tool_loop(chat, config)
    assert len(records) == len(bodies) == 6
    assert [(r["group"], r["index"]) for r in records[:4]] == [("chat-0", 0), ("chat-0", 1), ("chat-0", 2),
                                                              ("chat-1", 0)]  # fmt: skip
    # get_weather is valid where any tool may be called, not where the turn names search_flights.
    assert [r["is_valid"] for r in records[:3]] == [True, False, True]
    third = bodies[2]["messages"]
    assert [m["role"] for m in third] == ["user", "assistant", "tool", "user", "assistant", "tool", "user"]
    assert third[1]["tool_calls"][0]["id"] == third[2]["tool_call_id"] == "call_0_0_0"
    assert third[2]["content"] == TOOL_ANSWERS["get_weather"] and third[-1]["content"] == turns[2].user
    assert [m["role"] for m in bodies[3]["messages"]] == ["user"]  # a new chat starts over
    assert follow_up("c", "cut sho", []) == [{"role": "assistant", "content": "cut sho"}]


def _record(kind: str = "schema", finish_reason: str = "stop", text: str = "", calls=(), num_tokens: int = 10,
            wall_s: float = 1.0, steps: int | None = None, accepted: int = 0, index: int = 0) -> dict:  # fmt: skip
    spec = None
    if steps is not None:
        spec = {"num_steps": steps, "num_verified": steps, "num_draft_tokens": 2 * accepted or 1,
                "num_accepted_tokens": accepted, "segments": {}}  # fmt: skip
    record = {"num_tokens": num_tokens, "wall_s": wall_s, "text": text, "calls": list(calls),
              "finish_reason": finish_reason, "spec": spec, "group": "g", "index": index}  # fmt: skip
    return record


PERSON = EXTRACTIONS[0].schema
GOOD_PERSON = json.dumps({"name": "Ada", "age": 36, "email": "ada.lovelace@acme.com", "role": "engineer",
                          "skills": ["math"]})  # fmt: skip


def test_validity_needs_a_finished_output_that_validates_against_its_schema():
    judge = structured_report.judge
    assert judge(_record(text=GOOD_PERSON), "schema", PERSON) == (True, True)
    assert judge(_record(finish_reason="length", text=GOOD_PERSON), "schema", PERSON) == (False, False)
    bad_email = GOOD_PERSON.replace("ada.lovelace@acme.com", "ada@acme")  # breaks the pattern
    extra = GOOD_PERSON[:-1] + ', "x": 1}'  # additionalProperties false
    for text in (bad_email, extra, GOOD_PERSON.replace("engineer", "pilot"), GOOD_PERSON[:-1], ""):
        assert judge(_record(text=text), "schema", PERSON) == (True, False)
    weather = {"name": "get_weather", "arguments": '{"city": "Rome", "unit": "celsius"}'}
    tools = call_schemas(Turn("", "required"))
    assert judge(_record(finish_reason="tool_calls", calls=[weather]), "tool_loop", tools) == (True, True)
    assert judge(_record(finish_reason="stop", calls=[weather]), "tool_loop", tools) == (False, False)
    assert judge(_record(finish_reason="tool_calls", calls=[weather, weather]), "tool_loop", tools)[1] is False
    kelvin = {**weather, "arguments": '{"city": "Rome", "unit": "kelvin"}'}
    assert judge(_record(finish_reason="tool_calls", calls=[kelvin]), "tool_loop", tools)[1] is False
    named = call_schemas(Turn("", "convert_currency"))
    assert judge(_record(finish_reason="tool_calls", calls=[weather]), "tool_loop", named)[1] is False


def test_summaries_count_validity_and_rates_and_keep_the_later_requests_apart():
    records = []
    for index, (finish, text, steps) in enumerate([("stop", GOOD_PERSON, 10), ("stop", "{}", 2),
                                                   ("length", GOOD_PERSON, 2), ("stop", GOOD_PERSON, 2)]):  # fmt: skip
        record = _record(finish_reason=finish, text=text, steps=steps, accepted=8, index=index)
        finished, valid = structured_report.judge(record, "schema", PERSON)
        records.append({**record, "is_finished": finished, "is_valid": valid})
    summary = structured_report.summarize(records)
    assert (summary["num_requests"], summary["num_finished"], summary["num_valid"]) == (4, 3, 2)
    assert summary["validity"] == 0.5 and summary["finished_validity"] == pytest.approx(2 / 3)
    assert summary["tokens_per_s"] == pytest.approx(10.0) and summary["tokens_per_step"] == pytest.approx(40 / 16)
    assert summary["draft_acceptance"] == pytest.approx(0.5)
    assert summary["later"]["tokens_per_step"] == pytest.approx(5.0)  # the first request's 10 steps left out
    nothing = structured_report.summarize([{**records[2], "is_finished": False, "is_valid": False}])
    assert nothing["validity"] == 0.0 and nothing["finished_validity"] is None
    assert "tokens_per_step" not in structured_report.summarize([{**records[0], "spec": None}])


def _summaries(per_system: dict[str, dict]) -> dict:
    return {system: {"schema": numbers} for system, numbers in per_system.items()}


def _spread_of(value: float) -> dict:
    return {"values": [value], "median": value, "min": value, "max": value}


def test_goals_pass_and_fail_on_synthetic_numbers():
    summaries = _summaries({HF: {"tokens_per_s": 10.0}, NO_GRAMMAR: {"tokens_per_s": 15.0, "tokens_per_step": 2.0},
                            SPEC: {"tokens_per_s": 25.0, "tokens_per_step": 3.2}})  # fmt: skip
    ratios = structured_report.ratios(summaries)["schema"]
    assert ratios[f"{SPEC}_vs_{NO_GRAMMAR}_tokens_per_step"] == pytest.approx(1.6)
    assert ratios[f"{SPEC}_vs_{HF}"] == pytest.approx(2.5) and ratios[f"{SPEC}_vs_{OFF}"] is None
    validity = {system: {"schema": {"finished_validity": _spread_of(1.0)}} for system in (OFF, NO_GRAMMAR, SPEC)}
    goals = {g["name"]: g["passed"] for g in structured_report.evaluate_goals(validity, {"schema": ratios}, [])}
    assert goals["schema: full tokens/step vs no grammar drafts"] is True
    assert goals["schema: full tok/s vs HF + xgrammar"] is True
    assert goals["schema: segserve, full finished outputs valid"] is True
    assert goals["greedy outputs equal among segserve systems"] is True

    summaries[SPEC]["schema"] = {"tokens_per_s": 19.0, "tokens_per_step": 2.9}  # 1.45x and 1.9x: both short
    ratios = structured_report.ratios(summaries)["schema"]
    validity[NO_GRAMMAR]["schema"]["finished_validity"] = {"values": [1.0, 0.9], "median": 0.95, "min": 0.9,
                                                           "max": 1.0}  # one round had an invalid output
    goals = {g["name"]: g for g in structured_report.evaluate_goals(validity, {"schema": ratios}, [{"x": 1}])}
    assert goals["schema: full tokens/step vs no grammar drafts"]["passed"] is False
    assert goals["schema: full tok/s vs HF + xgrammar"]["passed"] is False
    assert goals["schema: segserve, no grammar drafts finished outputs valid"]["measured"] == 0.9
    assert goals["schema: segserve, no grammar drafts finished outputs valid"]["passed"] is False
    assert goals["greedy outputs equal among segserve systems"]["passed"] is False
    # Nothing measured: listed, neither passed nor failed.
    goals = {g["name"]: g["passed"] for g in structured_report.evaluate_goals({OFF: {}}, {}, [])}
    assert goals["schema: full tok/s vs HF + xgrammar"] is None
    assert goals["greedy outputs equal among segserve systems"] is None  # one segserve system: nothing compared


def test_mismatches_compare_segserve_systems_with_spec_off_and_hf_only_when_asked():
    outputs = {HF: {"schema": ['{"a": 9}']}, OFF: {"schema": ['{"a": 1}', '{"b": 2}'], "tool_loop": ["[1]"]},
               NO_GRAMMAR: {"schema": ['{"a": 1}', '{"b": 3}'], "tool_loop": ["[1]"]},
               SPEC: {"schema": ['{"a": 1}', '{"b": 2}'], "tool_loop": ["[2]"]}}  # fmt: skip
    found = structured_report.mismatches(outputs)
    assert [(m["system"], m["kind"], m["index"], m["first_diff_char"], m["reference"]) for m in found] == [
        (NO_GRAMMAR, "schema", 1, 6, OFF), (SPEC, "tool_loop", 0, 1, OFF)]  # fmt: skip
    hf = structured_report.mismatches(outputs, systems=(HF,), reference=OFF)
    assert [(m["system"], m["index"]) for m in hf] == [(HF, 0)]
    # Without spec off, the first segserve system that ran is the reference.
    found = structured_report.mismatches({SPEC: {"schema": ["ab"]}, NO_GRAMMAR: {"schema": ["a"]}})
    assert [(m["system"], m["reference"], m["first_diff_char"]) for m in found] == [(SPEC, NO_GRAMMAR, 1)]
    calls = _record(calls=[{"name": "f", "arguments": "{}"}], text="ignored")
    assert structured_report.output_of(calls) == '[["f", "{}"]]'
    assert structured_report.output_of(_record(text="x")) == "x"


def test_each_segserve_system_gets_its_stack_config(tmp_path):
    from scheduler.config import SchedulerConfig

    config = structured_systems.structured_stack_config
    off = config(tmp_path / "m", "float32", OFF, tmp_path / "o")
    spec = config(tmp_path / "m", "float32", SPEC, tmp_path / "s", scheduler={"num_decode_steps": 1})
    assert not off.is_speculative and spec.is_speculative and spec.drafter.segments_config is None
    assert spec.scheduler.num_decode_steps == 1 and off.scheduler.num_decode_steps == SchedulerConfig().num_decode_steps
    no_grammar = config(tmp_path / "m", "float32", NO_GRAMMAR, tmp_path / "n")
    assert no_grammar.is_speculative and no_grammar.scheduler.is_grammar_drafts is False
    assert spec.scheduler.is_grammar_drafts is True
    with pytest.raises(ValueError, match="system"):
        config(tmp_path / "m", "float32", HF, tmp_path / "h")


VALID_ARGUMENTS = {"get_weather": '{"city": "Rome", "unit": "celsius"}',
                   "search_flights": '{"origin": "LHR", "destination": "CDG", "date": "2026-05-14"}',
                   "convert_currency": '{"amount": 250, "from": "GBP", "to": "EUR"}'}


def _fake(rate: float, steps_per_request: int | None = None, fail: bool = False, text: str = GOOD_PERSON):
    @contextlib.contextmanager
    def factory():
        if fail:
            raise RuntimeError("stack would not start")

        def chat(body: dict, max_tokens: int) -> dict:
            num_tokens = 20
            if "tools" in body:
                choice = body["tool_choice"]
                name = "get_weather" if choice == "required" else choice["function"]["name"]
                call = {"name": name, "arguments": VALID_ARGUMENTS[name]}
                return {**_record("tool_loop", "tool_calls", "", [call], num_tokens, num_tokens / rate,
                                  steps_per_request, accepted=4)}  # fmt: skip
            return _record("schema", "stop", text, (), num_tokens, num_tokens / rate, steps_per_request, accepted=4)

        yield chat

    return factory


def test_a_run_on_fakes_writes_every_number_with_spread_goals_and_mismatches(tmp_path, capsys):
    config = structured.StructuredBenchConfig(num_schemas=1, num_records=4, num_chats=1, num_turns=2, rounds=3,
                                              out=str(tmp_path))  # fmt: skip
    spec_rates = iter([50.0, 30.0, 40.0])

    def make(model_dir, out):
        return {HF: _fake(10.0), OFF: _fake(12.0, 20), NO_GRAMMAR: _fake(15.0, 10, text=GOOD_PERSON + " "),
                SPEC: _fake(next(spec_rates), 5)}  # fmt: skip

    results = structured.run_benchmark(config, make, "/m/tiny", tmp_path, {"command": "segserve bench structured"})
    structured.print_results(results)
    saved = json.loads((tmp_path / "structured.json").read_text())
    assert (tmp_path / "structured.png").stat().st_size > 1000 and (tmp_path / "round-3" / "structured.json").is_file()
    assert saved["command"] == "segserve bench structured" and saved["config"]["rounds"] == 3
    assert len(saved["rounds"]) == 3 and set(saved["rounds"][0]["systems"]) == set(structured.SYSTEMS)
    assert saved["workloads"]["schema"][:2] == [{"schema": "person", "record": 0}, {"schema": "person", "record": 1}]
    assert saved["summaries"][SPEC]["schema"]["tokens_per_s"] == {"values": [50.0, 30.0, 40.0], "median": 40.0,
                                                                  "min": 30.0, "max": 50.0}  # fmt: skip
    assert saved["summaries"][SPEC]["tool_loop"]["tokens_per_step"]["median"] == pytest.approx(4.0)
    assert "tokens_per_step" not in saved["summaries"][HF]["schema"]
    assert saved["summaries"][SPEC]["tool_loop"]["validity"]["median"] == 1.0
    ratios = saved["ratios"]["schema"]
    assert ratios[f"{SPEC}_vs_{NO_GRAMMAR}_tokens_per_step"]["median"] == pytest.approx(2.0)
    assert ratios[f"{SPEC}_vs_{HF}"]["median"] == pytest.approx(4.0)
    goals = {g["name"]: g["passed"] for g in saved["goals"]}
    assert goals["schema: full tokens/step vs no grammar drafts"] is True
    assert goals["schema: full tok/s vs HF + xgrammar"] is True
    assert goals["schema: segserve, full finished outputs valid"] is True
    # The no-grammar system's JSON has a trailing blank: valid, but not what spec off wrote, in every round.
    assert goals["greedy outputs equal among segserve systems"] is False
    assert {(m["system"], m["kind"]) for m in saved["mismatches"]} == {(NO_GRAMMAR, "schema")}
    assert len(saved["mismatches"]) == 3 * 4 and saved["hf_mismatches"] == []
    printed = capsys.readouterr().out
    assert "MISMATCH: round 1 segserve_no_grammar_drafts schema[0]" in printed
    assert "| schema | segserve, full | 1.00 (1.00-1.00) | 1.00 (1.00-1.00) | 40.0 (30.0-50.0) |" in printed


def test_a_system_that_fails_is_reported_and_the_rest_still_run(tmp_path, capsys):
    config = structured.StructuredBenchConfig(num_schemas=1, num_records=1, kinds=("schema",), rounds=1,
                                              systems=(HF, OFF, SPEC), out=str(tmp_path))  # fmt: skip
    factories = {HF: _fake(10.0), OFF: _fake(12.0, 20), SPEC: _fake(1.0, fail=True)}
    results = structured.run_benchmark(config, lambda model_dir, out: factories, "/m", tmp_path)
    structured.print_results(results)
    assert results["errors"] == [{"round": 1, "system": SPEC, "error": "RuntimeError: stack would not start"}]
    assert results["summaries"][OFF]["schema"]["num_valid"]["median"] == 1
    goals = {g["name"]: g["passed"] for g in results["goals"]}
    assert goals["schema: full tok/s vs HF + xgrammar"] is None
    assert "ERROR RuntimeError: stack would not start" in capsys.readouterr().out


def test_cli_parses_bench_structured_and_the_config_validates():
    args = build_parser().parse_args(["bench", "structured", "--systems", "hf_xgrammar,segserve_spec", "--kinds",
                                      "tool_loop", "--num-records", "2", "--num-decode-steps", "1"])  # fmt: skip
    config = structured.config_from_args(args)
    assert config.systems == (HF, SPEC) and config.kinds == ("tool_loop",) and config.num_records == 2
    assert config.num_decode_steps == 1 and config.rounds == 3 and config.max_tokens == 256
    assert config.out == "bench-results/structured" and config.num_schemas == len(EXTRACTIONS)
    assert args.func.__name__ == "_bench_structured_command"
    for bad in ({"systems": ("vllm",)}, {"kinds": ("poetry",)}, {"rounds": 0}, {"num_records": 9},
                {"num_turns": 0}, {"num_decode_steps": 0}):  # fmt: skip
        with pytest.raises(ValueError):
            structured.StructuredBenchConfig(**bad)
    with pytest.raises(SystemExit, match="systems must be a non-empty subset"):
        structured.run_structured(build_parser().parse_args(["bench", "structured", "--systems", "vllm"]))


def _strictly_valid(text: str, schema: dict) -> bool:
    """Strict JSON (RFC 8259: no raw control characters in strings) that jsonschema accepts."""
    try:
        jsonschema.validate(json.loads(text), schema, cls=jsonschema.Draft202012Validator)
    except (ValueError, jsonschema.ValidationError):
        return False
    return True


def test_a_tiny_real_run_writes_json_and_png_and_counts_validity_and_mismatches(tiny_gemma3_dir, tmp_path, capsys):
    # Three systems keep the test under a minute and a half (each stack takes ~20 s to start on a busy 2-core
    # CPU). Spec off's stack is bench spec's own; the one without grammar drafts is new, so it runs here (and
    # is the reference of greedy equality).
    reference = NO_GRAMMAR
    systems = [HF, reference, SPEC]
    out = tmp_path / "out"
    args = build_parser().parse_args([
        "bench", "structured", "--model", str(tiny_gemma3_dir), "--rounds", "1", "--num-schemas", "1",
        "--num-records", "2", "--num-chats", "1", "--num-turns", "2", "--max-tokens", "256",
        "--systems", ",".join(systems), "--out", str(out)])  # fmt: skip
    results = structured.run_structured(args)

    assert (out / "structured.png").stat().st_size > 1000
    assert json.loads((out / "structured.json").read_text()) == json.loads(json.dumps(results))
    assert results["errors"] == [] and results["machine"]["loadavg_end"] and results["command"]
    assert set(results["summaries"]) == set(systems)
    ran = results["rounds"][0]["systems"]
    schemas = {"schema": [EXTRACTIONS[0].schema] * 2,
               "tool_loop": [call_schemas(turn) for turn in tool_chats(num_chats=1, num_turns=2)[0]]}
    num_finished = 0
    for system in systems:
        for kind, records in ran[system]["workloads"].items():
            summary = results["summaries"][system][kind]
            assert summary["num_requests"]["median"] == len(records) == 2 and summary["tokens_per_s"]["median"] > 0
            assert ("tokens_per_step" in summary) == (system != HF)  # HF has no scheduler steps
            for record, schema in zip(records, schemas[kind]):
                assert record["is_finished"] == (record["finish_reason"] == structured_report.FINISHED[kind])
                if kind == "schema":
                    is_valid = _strictly_valid(record["text"], schema)
                else:  # one call, of a tool the turn allows
                    calls = record["calls"]
                    is_valid = (len(calls) == 1 and calls[0]["name"] in schema
                                and _strictly_valid(calls[0]["arguments"], schema[calls[0]["name"]]))
                assert record["is_valid"] == (record["is_finished"] and is_valid)
                num_finished += record["is_finished"]
            assert summary["num_valid"]["median"] == sum(r["is_valid"] for r in records)
    assert num_finished, "the tiny model finished nothing: validity was never judged on a real output"
    differing = [(kind, i) for kind, records in ran[SPEC]["workloads"].items() for i, (got, want) in
                 enumerate(zip(records, ran[reference]["workloads"][kind]))
                 if structured_report.output_of(got) != structured_report.output_of(want)]  # fmt: skip
    assert [(m["kind"], m["index"]) for m in results["mismatches"]] == differing
    goals = {g["name"]: g["passed"] for g in results["goals"]}
    assert goals["greedy outputs equal among segserve systems"] is (not differing)
    assert goals["schema: full tok/s vs HF + xgrammar"] in (True, False)  # evaluated; its value is the machine's
    assert goals["schema: full tokens/step vs no grammar drafts"] in ((True, False) if reference == NO_GRAMMAR
                                                                      else (None,))  # fmt: skip
    table = capsys.readouterr().out
    assert "| schema | segserve, full |" in table and "| goal | target |" in table
