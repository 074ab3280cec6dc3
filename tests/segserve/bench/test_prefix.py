"""`segserve bench prefix` on the tiny model with tiny sizes: both stacks run, the JSON has its shape.

The numbers themselves are not asserted (timing claims live in the benchmark's output, not in tests);
that the cache was used, and that the greedy answers agree with it on and off, is.
"""

from __future__ import annotations

import json

import pytest

from segserve.bench import prefix
from segserve.cli import build_parser

pytestmark = pytest.mark.e2e


def test_a_tiny_run_writes_json_and_png_with_per_turn_ttft_and_the_goal(tiny_gemma3_dir, tmp_path, capsys):
    out = tmp_path / "bench"
    args = build_parser().parse_args(["bench", "prefix", "--model", str(tiny_gemma3_dir), "--history-tokens", "80",
                                      "--max-tokens", "4", "--num-repetitions", "2", "--out", str(out)])
    assert args.func.__name__ == "_bench_prefix_command"
    prefix.run_prefix(args)
    results = json.loads((out / "prefix.json").read_text())
    assert (out / "prefix.png").stat().st_size > 0
    assert results["benchmark"] == "prefix" and results["config"]["num_turns"] == 3
    assert set(results["systems"]) == {prefix.ON, prefix.OFF}
    for name, system in results["systems"].items():
        assert len(system["conversations"]) == 2 and all(len(c) == 3 for c in system["conversations"])
        assert [s["turn"] for s in system["summary"]] == [1, 2, 3]
        for turn in system["summary"]:
            assert 0 < turn["ttft_ms_min"] <= turn["ttft_ms_median"] <= turn["ttft_ms_max"]
            assert turn["prompt_tokens"] >= 80
        cached = [turn["cached_tokens"] for turn in system["summary"]]
        assert cached == [0, 0, 0] if name == prefix.OFF else cached[0] == 0 < cached[1] < cached[2]
    assert results["last_turn_ttft_ratio"] > 0 and isinstance(results["goal"]["is_met"], bool)
    assert results["mismatches"] == []
    printed = capsys.readouterr().out
    assert "| turn |" in printed and "goal: turn-3 TTFT" in printed


def test_the_config_validates():
    with pytest.raises(ValueError):
        prefix.PrefixBenchConfig(num_turns=1)
    with pytest.raises(ValueError):
        prefix.PrefixBenchConfig(num_turns=4)
    with pytest.raises(ValueError):
        prefix.PrefixBenchConfig(history_tokens=0)
