"""CLI flags come from the config dataclasses, and the launcher's argv round-trips through them."""

import pytest

from router.config import RouterConfig
from scheduler.config import SchedulerConfig
from segserve.cli import build_parser
from segserve.flags import add_dataclass_args, field_docs, from_args, to_argv
from worker.config import WorkerConfig


@pytest.mark.parametrize("config", [
    WorkerConfig(model="/models/x", port=1234, num_kv_blocks=7, dtype="float32"),
    SchedulerConfig(worker_address="10.0.0.1:9", max_num_seqs=3),
    RouterConfig(port=0, served_model_name="m"),
])
def test_to_argv_round_trips(config):
    import argparse

    parser = argparse.ArgumentParser()
    add_dataclass_args(parser, type(config))
    assert from_args(type(config), parser.parse_args(to_argv(config))) == config


def test_every_config_field_is_documented():
    for cls in (WorkerConfig, SchedulerConfig, RouterConfig):
        fields = set(cls.__dataclass_fields__)
        assert fields == set(field_docs(cls)), f"{cls.__name__} has fields without a docstring"


def test_serve_takes_every_service_flag_without_clashes():
    args = build_parser().parse_args(
        ["serve", "--model", "/m", "--port", "9000", "--worker-port", "9001", "--scheduler-port", "9002",
         "--max-num-seqs", "4", "--num-kv-blocks", "10"])
    assert from_args(WorkerConfig, args, {"host": "worker_host", "port": "worker_port"}).port == 9001
    assert from_args(SchedulerConfig, args, {"host": "scheduler_host", "port": "scheduler_port"}).max_num_seqs == 4
    assert from_args(RouterConfig, args).port == 9000


@pytest.mark.parametrize("argv", [["serve", "--model", "/m"], ["scheduler"]])
def test_prefix_caching_is_on_by_default_and_no_prefix_caching_turns_it_off(argv):
    parser = build_parser()
    rename = {"host": "scheduler_host", "port": "scheduler_port"} if argv[0] == "serve" else {}
    assert from_args(SchedulerConfig, parser.parse_args(argv), rename).is_prefix_caching is True
    for flag in ("--no-prefix-caching", "--no-is-prefix-caching"):
        assert from_args(SchedulerConfig, parser.parse_args(argv + [flag]), rename).is_prefix_caching is False
    off = SchedulerConfig(is_prefix_caching=False)  # the launcher's argv for the scheduler process
    assert from_args(SchedulerConfig, parser.parse_args(["scheduler", *to_argv(off)])) == off


def test_invalid_config_values_are_rejected():
    with pytest.raises(ValueError, match="block_size"):
        WorkerConfig(block_size=0)
    with pytest.raises(ValueError, match="max_num_seqs"):
        SchedulerConfig(max_num_seqs=0)


def test_corpus_build_writes_per_segment_corpora(tiny_gemma3_dir, tmp_path):
    from segserve.cli import main

    text = tmp_path / "code.md"
    text.write_text("Here is code:\n```\nfor i in range(10):\n    print(i)\n```\nand more text.\n" * 3)
    segments = tmp_path / "segments.toml"
    segments.write_text(_TINY_SEGMENTS)
    out = tmp_path / "corpora"
    assert main(["corpus", "build", str(text), "--out", str(out), "--tokenizer", str(tiny_gemma3_dir),
                 "--segments-config", str(segments)]) == 0
    from transformers import AutoTokenizer

    from drafter.corpus import LookupCorpus
    from drafter.memory import corpus_path

    code = LookupCorpus.load(corpus_path(out, "code"))
    tokenizer = AutoTokenizer.from_pretrained(tiny_gemma3_dir)
    fenced = tokenizer.encode("```\nfor i in range(10):\n    print(i)\n```", add_special_tokens=False)
    context, expected = fenced[:5], fenced[5:9]
    best = code.propose(context, max_len=len(expected), max_candidates=4)[0]
    assert list(best.token_ids) == expected


_TINY_SEGMENTS = """
[default]
algorithm = "best_first"

[[segment]]
name = "code"
start = "```"
end = "```"
algorithm = "multi_branch_dfs"
"""
