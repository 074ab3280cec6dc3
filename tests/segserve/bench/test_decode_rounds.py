"""`segserve bench throughput --decode-rounds N` (segserve/bench/decode_rounds.py): one stream through the router
and one generate(), back to back, the order swapped every round, and the ratio of their decode rates."""

from __future__ import annotations

import argparse

import pytest

from segserve.bench import decode_rounds, report, throughput
from tests.segserve.bench.test_throughput import fake_server  # noqa: F401 (the fixture)


def test_rounds_swap_the_order_every_round_and_give_each_rounds_ratio():
    calls = []
    generate = iter([100.0, 200.0, 50.0])
    ours = iter([90.0, 100.0, 60.0])

    def generate_rate():
        calls.append("generate")
        return next(generate)

    def segserve_level():
        calls.append("segserve")
        return {"decode_tokens_per_s_median": next(ours), "num_errors": 0}

    rounds = decode_rounds.run(3, generate_rate, segserve_level)
    assert calls == ["generate", "segserve", "segserve", "generate", "generate", "segserve"]
    assert [r["ratio"] for r in rounds] == pytest.approx([0.9, 0.5, 1.2])
    summary = decode_rounds.summarize(rounds)
    assert summary["median"] == pytest.approx(0.9) and summary["min"] == pytest.approx(0.5)
    assert summary["max"] == pytest.approx(1.2) and summary["num_errors"] == 0
    assert decode_rounds.goal(summary)["passed"] is True  # the median, 0.9x, meets the 0.9x goal
    assert decode_rounds.goal({**summary, "median": 0.89})["passed"] is False
    assert decode_rounds.goal(None) == {"name": decode_rounds.NAME, "target": ">= 0.9x", "measured": None,
                                        "passed": None}


def test_a_round_without_a_rate_has_no_ratio_and_no_round_gives_no_summary():
    rounds = decode_rounds.run(2, lambda: None, lambda: {"decode_tokens_per_s_median": 80.0, "num_errors": 1})
    assert [r["ratio"] for r in rounds] == [None, None]
    assert decode_rounds.summarize(rounds) is None and decode_rounds.summarize([]) is None
    assert report.decode_rounds_table(None) == []


def test_decode_rounds_stream_one_request_at_a_time_through_the_router(fake_server):  # noqa: F811
    # The fake OpenAI server stands in for the router: 10 ms per token, so about 100 decode tokens/s.
    fake, url = fake_server
    config = throughput.ThroughputConfig(concurrency=(1, 3), max_tokens=10, requests_per_stream=2,
                                         router_overhead=False, grpc_api=False, decode_rounds=2)
    rates = iter([25.0, 400.0])
    systems = throughput.bench_router_and_scheduler(config, None, url, "127.0.0.1:1",
                                                    generate_rate=lambda: next(rates))
    rounds = systems["segserve"]["decode_rounds"]
    assert [r["round"] for r in rounds] == [0, 1] and all(r["num_errors"] == 0 for r in rounds)
    assert all(50 < r["segserve_decode_tokens_per_s"] < 110 for r in rounds)
    assert rounds[0]["ratio"] > 2 and rounds[1]["ratio"] < 0.3
    measured = [body for body in fake.bodies if body["max_tokens"] == 10]  # the warm-ups ask for 4 and 8 tokens
    assert len(measured) == 2 * (1 + 3) + 2 * 2  # the two levels, then two rounds of one stream's two requests
    assert fake.max_active <= 3 and all(body.get("ignore_eos") for body in measured)
    summary = decode_rounds.summarize(rounds)
    table = report.markdown_table({"systems": systems, "decode_rounds": summary})
    assert "alternated rounds: median [min-max]" in table
    assert f"| {summary['median']:.2f}x [{summary['min']:.2f}-{summary['max']:.2f}] |" in table


def test_decode_rounds_and_decode_steps_flags():
    parser = argparse.ArgumentParser()
    throughput.add_throughput_args(parser)
    assert throughput.config_from_args(parser.parse_args([])).decode_rounds == 0
    assert throughput.config_from_args(parser.parse_args(["--decode-rounds", "5"])).decode_rounds == 5
    defaults = throughput.config_from_args(parser.parse_args([]))
    assert defaults.decode_steps_ms is None and defaults.num_decode_steps is None  # the scheduler's own
    assert throughput.config_from_args(parser.parse_args(["--decode-steps-ms", "12.5"])).decode_steps_ms == 12.5
    with pytest.raises(ValueError, match="decode_rounds"):
        throughput.ThroughputConfig(decode_rounds=-1)
