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


def test_every_flag_has_an_environment_variable_and_the_command_line_wins(monkeypatch):
    from drafter.config import DrafterConfig

    monkeypatch.setenv("SEGSERVE_MAX_NUM_SEQS", "7")
    monkeypatch.setenv("SEGSERVE_PREFIX_CACHING", "off")
    monkeypatch.setenv("SEGSERVE_DRAFTER_ADDRESSES", "10.0.0.1:1, dns:///drafter:2")
    monkeypatch.setenv("SEGSERVE_WORKER_ADDRESS", "10.0.0.9:5")
    parser = build_parser()
    config = from_args(SchedulerConfig, parser.parse_args(["scheduler"]))
    assert (config.max_num_seqs, config.is_prefix_caching) == (7, False)
    assert config.drafter_addresses == ["10.0.0.1:1", "dns:///drafter:2"]
    assert config.worker_address == "10.0.0.9:5"
    assert from_args(SchedulerConfig, parser.parse_args(["scheduler", "--max-num-seqs", "3"])).max_num_seqs == 3
    monkeypatch.setenv("SEGSERVE_SNAPSHOT_INTERVAL_S", "2.5")
    assert from_args(DrafterConfig, parser.parse_args(["drafter"])).snapshot_interval_s == 2.5
    monkeypatch.setenv("SEGSERVE_DRAFTER_PORT", "7001")  # `segserve serve` renames the drafter's port
    assert from_args(DrafterConfig, parser.parse_args(["serve"]), {"port": "drafter_port"}).port == 7001
    monkeypatch.setenv("SEGSERVE_MAX_NUM_SEQS", "many")
    with pytest.raises(ValueError, match="SEGSERVE_MAX_NUM_SEQS='many'"):
        from_args(SchedulerConfig, parser.parse_args(["scheduler"]))
    monkeypatch.setenv("SEGSERVE_MAX_NUM_SEQS", "")
    monkeypatch.setenv("SEGSERVE_PREFIX_CACHING", "maybe")
    with pytest.raises(ValueError, match="SEGSERVE_PREFIX_CACHING"):
        from_args(SchedulerConfig, parser.parse_args(["scheduler"]))


def test_the_launcher_does_not_hand_its_flag_variables_to_the_services(monkeypatch, tmp_path):
    import subprocess

    from segserve.launcher import Stack, StackConfig

    monkeypatch.setenv("SEGSERVE_PORT", "9000")  # meant for the router of `segserve serve`
    monkeypatch.setenv("SEGSERVE_OTHER_SETTING", "kept")
    seen = {}
    monkeypatch.setattr(subprocess, "Popen", lambda argv, **kw: seen.update(argv=argv, env=kw["env"]))
    Stack(StackConfig(log_dir=str(tmp_path)))._spawn("worker", WorkerConfig(port=5))
    assert "SEGSERVE_PORT" not in seen["env"] and seen["env"]["SEGSERVE_OTHER_SETTING"] == "kept"
    assert seen["argv"][-2:] == ["--port", "5"]


def test_an_env_only_field_gets_no_flag_and_reaches_a_child_in_its_environment(monkeypatch):
    import argparse
    from dataclasses import dataclass, field

    from segserve.flags import ENV_ONLY, to_env

    @dataclass
    class Secretive:
        name: str = ""
        """A plain setting."""
        tokens: list[str] = field(default_factory=list, metadata={ENV_ONLY: True})
        """A secret."""

    parser = argparse.ArgumentParser()
    add_dataclass_args(parser, Secretive)
    assert "--tokens" not in parser.format_help()
    with pytest.raises(SystemExit):
        parser.parse_args(["--tokens", "t1"])
    config = Secretive(name="n", tokens=["t1", "t2"])
    assert to_argv(config) == ["--name", "n"] and to_env(config) == {"SEGSERVE_TOKENS": "t1,t2"}
    monkeypatch.setenv("SEGSERVE_TOKENS", to_env(config)["SEGSERVE_TOKENS"])
    assert from_args(Secretive, parser.parse_args(to_argv(config))) == config
    assert to_env(Secretive()) == {}
    with pytest.raises(ValueError, match="comma"):
        to_env(Secretive(tokens=["a,b"]))


def test_serve_takes_the_internal_tls_files_once_for_every_service():
    from drafter.config import DrafterConfig
    from segserve.cli import _SERVE_DRAFTER_RENAME, _SERVE_SCHEDULER_RENAME, _SERVE_WORKER_RENAME
    from common.tls import TlsFiles, internal_tls

    args = build_parser().parse_args(["serve", "--internal-tls-cert-file", "s.pem", "--internal-tls-key-file",
                                      "s.key", "--internal-tls-ca-file", "ca.pem"])
    configs = [from_args(WorkerConfig, args, _SERVE_WORKER_RENAME),
               from_args(SchedulerConfig, args, _SERVE_SCHEDULER_RENAME),
               from_args(DrafterConfig, args, _SERVE_DRAFTER_RENAME), from_args(RouterConfig, args)]
    assert [internal_tls(c) for c in configs] == [TlsFiles("s.pem", "s.key", "ca.pem")] * 4
    assert ["--internal-tls-cert-file", "s.pem"] == to_argv(configs[0])[-6:-4]  # how each process gets them


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
