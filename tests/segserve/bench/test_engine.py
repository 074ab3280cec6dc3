"""`segserve bench engine` on the tiny model: every part per batch size, parts that add up, the plot."""

from __future__ import annotations

import json
import statistics

import pytest

from segserve.bench.engine_report import PARTS
from segserve.cli import main


@pytest.mark.parametrize("extra", [[], ["--draft", "--repetition-penalty", "1.3"], ["--num-decode-steps", "4"],
                                   ["--cuda-graphs"], ["--compiled-layers"]],
                         ids=["plain", "draft-penalty", "decode-steps", "cuda-graphs", "compiled-layers"])
def test_engine_bench_reports_every_part_per_batch_size(tmp_path, capsys, extra):
    out = tmp_path / "engine"
    argv = ["bench", "engine", "--tiny", "--device", "cpu", "--batch-sizes", "1,4", "--steps", "3",
            "--warmup-steps", "1", "--repeats", "2", "--out", str(out), *extra]
    assert main(argv) == 0

    results = json.loads((out / "engine.json").read_text())
    assert (out / "engine.png").stat().st_size > 0
    # on the CPU the padded static steps run eagerly: nothing to capture
    assert results.get("graphs_captured") == (0 if "--cuda-graphs" in extra else None)
    assert results["compiled_layers"] is ("--compiled-layers" in extra)  # the worker's default: off on the CPU
    assert [b["batch_size"] for b in results["batches"]] == [1, 4]
    for batch in results["batches"]:
        assert set(batch["parts"]) == set(PARTS)
        for part in PARTS:
            stat = batch["parts"][part]
            assert len(stat["rounds_ms"]) == 2
            assert min(stat["rounds_ms"]) >= 0 and stat["min_ms"] <= stat["median_ms"] <= stat["max_ms"]
        for round_index, total in enumerate(batch["total"]["rounds_ms"]):
            parts_sum = sum(batch["parts"][part]["rounds_ms"][round_index] for part in PARTS)
            assert total > 0 and abs(parts_sum - total) <= 0.1 * total
        parts_sum = sum(batch["parts"][part]["median_ms"] for part in PARTS)
        assert abs(parts_sum - batch["total"]["median_ms"]) <= 0.1 * batch["total"]["median_ms"]
        excluding = batch["total"]["median_ms"] - batch["parts"]["forward"]["median_ms"]
        assert batch["excluding_forward"]["median_ms"] == pytest.approx(excluding)
        untimed = batch["untimed"]  # the steps other than the timed ones, whose parts were not timed
        assert len(untimed["rounds_ms"]) == 2 and min(untimed["rounds_ms"]) > 0
        assert batch["untimed_tokens_per_s"] == pytest.approx(1000 * batch["tokens_per_step"] / untimed["median_ms"])
        assert batch["tokens_per_step"] >= batch["batch_size"]  # one token per sequence, more with drafts
        if "--draft" not in extra:
            assert batch["parts"]["draft"]["max_ms"] == 0
            # one request of 4 decode steps gives every sequence 4 tokens
            assert batch["tokens_per_step"] == batch["batch_size"] * (4 if "--num-decode-steps" in extra else 1)
    table = capsys.readouterr().out
    assert "| batch |" in table and "excl. forward" in table and "untimed tok/s" in table
    assert ("one request of up to 4 decode steps" in table) is ("--num-decode-steps" in extra)
    assert [line.split("|")[1].strip() for line in table.splitlines() if line.startswith("| ")][1:] == ["1", "4"]


@pytest.mark.real_model
def test_random_weights_bench_the_default_models_shape(tmp_path, default_model_dir):
    from transformers import AutoConfig

    from segserve.bench.random_models import build_random_gemma3_270m

    built = AutoConfig.from_pretrained(build_random_gemma3_270m(tmp_path / "model", device="cpu"))
    real = AutoConfig.from_pretrained(default_model_dir)
    for field in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                  "num_key_value_heads", "head_dim", "query_pre_attn_scalar", "sliding_window", "layer_types",
                  "max_position_embeddings", "hidden_activation", "tie_word_embeddings", "rope_parameters",
                  "final_logit_softcapping", "attn_logit_softcapping", "eos_token_id"):
        assert getattr(built, field) == getattr(real, field), field
    assert built.rms_norm_eps == pytest.approx(real.rms_norm_eps)

    out = tmp_path / "engine"
    assert main(["bench", "engine", "--random-weights", "--device", "cpu", "--batch-sizes", "1", "--steps", "2",
                 "--warmup-steps", "0", "--repeats", "1", "--out", str(out)]) == 0
    results = json.loads((out / "engine.json").read_text())
    assert results["model"].startswith("gemma-3-270m's shape") and results["dtype"] == "float32"
    assert results["batches"][0]["tokens_per_step"] == 1


def test_steps_that_capture_a_cuda_graph_are_left_out_of_their_round():
    """A capture is a one-time cost per shape; the round keeps the other steps (all of them, should every one
    capture)."""
    from segserve.bench.engine import _uncaptured

    steps = [(({"total": float(index)}, 1), index in (1, 4)) for index in range(6)]
    assert [parts["total"] for parts, _ in _uncaptured(steps)] == [0, 2, 3, 5]
    every = [(step, True) for step, _ in steps]
    assert [parts["total"] for parts, _ in _uncaptured(every)] == [0, 1, 2, 3, 4, 5]


def test_a_round_needs_two_steps_one_timed_and_one_whole():
    from segserve.bench.engine_config import EngineBenchConfig

    with pytest.raises(ValueError, match="half of them are timed"):
        EngineBenchConfig(steps=1)


def test_half_the_steps_of_a_round_are_timed_and_not_always_the_same_ones():
    """Timed steps at random, not every other one: a fixed alternation lines up with periodic step costs."""
    import random

    from segserve.bench.engine import timed_steps

    rng = random.Random(0)
    rounds = [timed_steps(rng, 16) for _ in range(20)]
    assert all(len(steps) == 8 and steps <= set(range(16)) for steps in rounds)
    assert len({frozenset(steps) for steps in rounds}) > 1
    assert any(step % 2 for steps in rounds for step in steps)
    assert timed_steps(random.Random(0), 3) <= {0, 1, 2} and len(timed_steps(random.Random(0), 3)) == 2


SCHEMA = {"type": "object", "required": ["id", "kind", "owner", "tags"],
          "properties": {"id": {"type": "integer"}, "kind": {"enum": ["alpha", "beta"]},
                         "owner": {"type": "object", "properties": {"name": {"type": "string"}}, "required": ["name"]},
                         "tags": {"type": "array", "items": {"type": "string"}}}}


@pytest.mark.parametrize("extra", [[], ["--draft"]], ids=["plain", "draft"])
def test_engine_bench_with_a_json_schema_reports_the_grammars_cost(tmp_path, capsys, monkeypatch, extra):
    """--json-schema: every batch size runs plain and constrained (every row masked by the schema's grammar, each
    step), and grammar_ms is the constrained round's step minus the plain round's, per round pair."""
    from worker import model_runner

    masked_rows, num_trees, fill_masks = [], [], model_runner.fill_masks

    def counting_fill(works, constrained, *args):
        masked_rows.append(len(constrained))
        num_trees.append(sum(works[i].is_tree for i in constrained))
        return fill_masks(works, constrained, *args)

    monkeypatch.setattr(model_runner, "fill_masks", counting_fill)
    schema = tmp_path / "schema.json"
    schema.write_text(json.dumps(SCHEMA, indent=2))
    out = tmp_path / "engine"
    argv = ["bench", "engine", "--tiny", "--device", "cpu", "--batch-sizes", "1,4", "--steps", "3",
            "--warmup-steps", "1", "--repeats", "2", "--json-schema", str(schema), "--out", str(out), *extra]
    assert main(argv) == 0

    results = json.loads((out / "engine.json").read_text())
    assert results["config"]["json_schema"] == str(schema)
    # rows 1 then 4 at a time, a prefill, a warm-up step and 2 rounds of 3 steps each
    assert set(masked_rows) == {1, 4} and len(masked_rows) >= 2 * (1 + 1 + 2 * 3)
    assert (sum(num_trees) > 0) is ("--draft" in extra)  # with --draft, trees (the forced spans at least)
    for batch in results["batches"]:
        plain, constrained, grammar = batch, batch["constrained"], batch["grammar_ms"]
        assert constrained["batch_size"] == batch["batch_size"] and set(constrained["parts"]) == set(PARTS)
        assert constrained["tokens_per_step"] >= batch["batch_size"]
        differences = [c - p for p, c in zip(plain["total"]["rounds_ms"], constrained["total"]["rounds_ms"])]
        assert grammar["rounds_ms"] == pytest.approx(differences) and len(differences) == 2
        assert grammar["min_ms"] <= grammar["median_ms"] <= grammar["max_ms"]
        assert set(grammar["parts"]) == set(PARTS)
        forward = [c - p for p, c in zip(plain["parts"]["forward"]["rounds_ms"],
                                         constrained["parts"]["forward"]["rounds_ms"])]
        assert grammar["parts"]["forward"] == pytest.approx(statistics.median(forward))
    table = capsys.readouterr().out
    assert "| constrained ms/step | constrained tok/step | grammar ms (min-max) |" in table
    rows = [line.split("|") for line in table.splitlines() if line.startswith("| ") and "batch" not in line]
    assert [float(row[-2].split()[0]) for row in rows] == pytest.approx(
        [round(b["grammar_ms"]["median_ms"], 2) for b in results["batches"]], abs=0.006)


def test_the_json_schema_option_takes_json_text_or_a_file(tmp_path):
    from segserve.bench.engine_config import EngineBenchConfig

    schema = tmp_path / "schema.json"
    schema.write_text(json.dumps(SCHEMA, indent=2))
    compact = json.dumps(SCHEMA, separators=(",", ":"))
    assert EngineBenchConfig(json_schema=str(schema)).schema_spec() == compact
    assert EngineBenchConfig(json_schema=json.dumps(SCHEMA, indent=1)).schema_spec() == compact
    for bad in ("[1, 2]", "{not json", str(tmp_path / "missing.json")):
        with pytest.raises(ValueError, match="json_schema"):
            EngineBenchConfig(json_schema=bad)


def test_the_8b_shape_is_llama_3_1_8b():
    """Built on the meta device (no memory): Llama-3.1-8B's 8.03B parameters, 32 query heads over 8 key-value."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from segserve.bench.random_models import LLAMA_31_8B

    with torch.device("meta"):
        model = LlamaForCausalLM(LlamaConfig(**LLAMA_31_8B))
    assert sum(p.numel() for p in model.parameters()) == 8_030_261_248
    assert model.config.rope_parameters["rope_type"] == "llama3"


def test_the_engine_bench_runs_the_worker_on_two_ranks(tmp_path):
    out = tmp_path / "engine"
    assert main(["bench", "engine", "--tiny", "--device", "cpu", "--tensor-parallel-size", "2", "--batch-sizes", "1,4",
                 "--steps", "2", "--warmup-steps", "0", "--repeats", "1", "--out", str(out)]) == 0
    results = json.loads((out / "engine.json").read_text())
    assert results["config"]["tensor_parallel_size"] == 2
    assert [batch["batch_size"] for batch in results["batches"]] == [1, 4]
    assert all(batch["total"]["median_ms"] > 0 for batch in results["batches"])
