"""CLI flags come from the config dataclasses, and the launcher's argv round-trips through them."""

import dataclasses
import re
import textwrap
import typing

import pytest

from drafter.config import DrafterConfig
from router.config import RouterConfig
from scheduler.config import SchedulerConfig
from segserve.cli import build_parser
from segserve.flags import add_dataclass_args, field_docs, from_args, to_argv
from segserve.reflow.config import ConsumerConfig
from worker.config import WorkerConfig


@pytest.mark.parametrize("config", [
    WorkerConfig(model="/models/x", port=1234, num_kv_blocks=7, dtype="float32"),
    SchedulerConfig(worker_address="10.0.0.1:9", max_num_seqs=3),
    RouterConfig(port=0, served_model_name="m"),
    WorkerConfig(is_packed_linear=False, is_compiled=True, is_lean_decoder=False, is_cuda_graphs=False,
                 is_compiled_layers=False),
    SchedulerConfig(is_spec_adaptive=False, is_async_scheduling=False, is_prefix_caching=False,
                    drafter_addresses=["a:1", "b:2"]),
    RouterConfig(is_grpc_api=False, is_strip_segment_markers=False),
    DrafterConfig(redact_corpora=True, snapshot_interval_s=2.5),
    ConsumerConfig(is_drain=True, redact=True, claim_batch=5),
])
def test_to_argv_round_trips(config):
    import argparse

    parser = argparse.ArgumentParser()
    add_dataclass_args(parser, type(config))
    assert from_args(type(config), parser.parse_args(to_argv(config))) == config
    assert not [arg for arg in to_argv(config) if arg.startswith(("--is-", "--no-is-"))]


@pytest.mark.parametrize("command, config", [
    ("worker", WorkerConfig(is_packed_linear=False, is_lean_decoder=True, is_cuda_graphs=True, port=5)),
    ("scheduler", SchedulerConfig(is_prefix_caching=False, is_spec_adaptive=False, max_num_seqs=3)),
    ("router", RouterConfig(is_grpc_api=False, is_strip_segment_markers=False, port=0)),
    ("drafter", DrafterConfig(redact_corpora=True)),
])
def test_the_launchers_argv_parses_with_the_service_command_into_the_same_config(command, config):
    args = build_parser().parse_args([command, *to_argv(config)])  # what Stack._spawn runs
    assert from_args(type(config), args) == config


_BOOLEANS = [(cls, field.name) for cls in (WorkerConfig, SchedulerConfig, RouterConfig, DrafterConfig,
                                           ConsumerConfig)
             for field in dataclasses.fields(cls) if typing.get_type_hints(cls)[field.name] in (bool, bool | None)]


@pytest.mark.parametrize("cls, name", _BOOLEANS, ids=[f"{cls.__name__}.{name}" for cls, name in _BOOLEANS])
def test_a_boolean_has_one_spelling_and_its_variable_takes_on_or_off(cls, name, monkeypatch):
    import argparse

    monkeypatch.setenv("SEGSERVE_API_KEYS", "key-1")  # what the router's metrics_require_key needs
    parser = argparse.ArgumentParser()
    add_dataclass_args(parser, cls)
    yes, no = "--" + name.removeprefix("is_").replace("_", "-"), "--no-" + name.removeprefix("is_").replace("_", "-")
    variable = "SEGSERVE_" + name.removeprefix("is_").upper()
    assert getattr(from_args(cls, parser.parse_args([yes])), name) is True
    assert getattr(from_args(cls, parser.parse_args([no])), name) is False
    if name.startswith("is_"):  # the prefix stays in the code only
        for old in ("--" + name.replace("_", "-"), "--no-" + name.replace("_", "-")):
            with pytest.raises(SystemExit):
                parser.parse_args([old])
    for text, value in (("on", True), ("off", False), ("ON", True), ("true", True), ("0", False)):
        monkeypatch.setenv(variable, text)
        assert getattr(from_args(cls, parser.parse_args([])), name) is value
    monkeypatch.setenv(variable, "on")
    assert getattr(from_args(cls, parser.parse_args([no])), name) is False  # the command line wins
    monkeypatch.setenv(variable, "off")
    assert getattr(from_args(cls, parser.parse_args([yes])), name) is True
    monkeypatch.setenv(variable, "maybe")
    with pytest.raises(ValueError, match=f"{variable}='maybe': expected on or off"):
        from_args(cls, parser.parse_args([]))


def _help(monkeypatch, capsys, *command) -> str:
    monkeypatch.setenv("COLUMNS", "80")  # argparse wraps to the terminal; the limits are for 80 columns
    with pytest.raises(SystemExit):
        build_parser().parse_args([*command, "--help"])
    return capsys.readouterr().out


def _sections(help_text: str) -> dict[str, list[list[str]]]:
    """A help text's groups: title -> its options, each the lines it takes."""
    sections, options = {}, None
    for line in help_text.splitlines():
        if line and not line[0].isspace() and line.endswith(":"):
            options = sections.setdefault(line[:-1], [])
        elif options is not None and line.startswith("  -"):
            options.append([line])
        elif options is not None and line.startswith("   ") and options:
            options[-1].append(line)
    return sections


def _flags(option: list[str]) -> set[str]:
    return set(re.findall(r"(?<![\w-])--[a-z][a-z0-9-]*", option[0].strip().split("  ")[0]))


def test_serve_help_is_short_grouped_by_config_class_with_two_lines_a_flag(monkeypatch, capsys):
    from segserve.cli import (_SERVE_DRAFTER_RENAME, _SERVE_DRAFTER_SKIP, _SERVE_ROUTER_SKIP, _SERVE_SCHEDULER_RENAME,
                              _SERVE_SCHEDULER_SKIP, _SERVE_SHARED, _SERVE_WORKER_RENAME)
    from segserve.flags import flag, is_env_only
    from common.tls import INTERNAL_FIELDS
    from common.tracing import FIELDS as TRACING_FIELDS

    help_text = _help(monkeypatch, capsys, "serve")
    assert len(help_text.splitlines()) < 250
    sections = _sections(help_text)
    for cls, skip, rename in ((WorkerConfig, _SERVE_SHARED, _SERVE_WORKER_RENAME),
                              (SchedulerConfig, _SERVE_SCHEDULER_SKIP, _SERVE_SCHEDULER_RENAME),
                              (DrafterConfig, _SERVE_DRAFTER_SKIP, _SERVE_DRAFTER_RENAME),
                              (RouterConfig, _SERVE_ROUTER_SKIP, {})):
        title = f"{cls.__name__.removesuffix('Config').lower()} ({cls.__name__})"
        shown = set().union(*map(_flags, sections[title]))
        expected = {flag(rename.get(f.name, f.name)) for f in dataclasses.fields(cls)
                    if f.name not in skip and not is_env_only(f)}
        assert shown >= expected, f"{title} lacks {expected - shown}"
    tls = next(options for title, options in sections.items() if title.startswith("internal TLS"))
    tracing = next(options for title, options in sections.items() if title.startswith("tracing"))
    assert set().union(*map(_flags, tls)) == {flag(name) for name in INTERNAL_FIELDS}
    assert set().union(*map(_flags, tracing)) == {flag(name) for name in TRACING_FIELDS}
    assert _SERVE_SHARED == {*INTERNAL_FIELDS, *TRACING_FIELDS}


@pytest.mark.parametrize("command", [["serve"], ["worker"], ["scheduler"], ["router"], ["drafter"],
                                     ["reflow", "consume"], ["finetune"]])
def test_no_help_offers_an_is_flag_and_every_config_flag_has_at_most_two_lines(command, monkeypatch, capsys):
    help_text = _help(monkeypatch, capsys, *command)
    assert "--is-" not in help_text and "--no-is-" not in help_text
    assert "…" not in help_text, "a field's first sentence is too long for two lines of help: shorten it"
    assert command[0] not in ("worker", "scheduler", "router", "drafter") or len(help_text.splitlines()) < 100
    for title, options in _sections(help_text).items():
        for option in options:
            is_help_on_first_line = bool(re.match(r"  -\S.*?\s{2,}\S", option[0]))  # flags, 2+ spaces, help
            assert is_help_on_first_line + len(option) - 1 <= 2, (title, option)


def test_summary_keeps_the_first_sentence_within_two_lines():
    from segserve.flags import HELP_LINES, HELP_WIDTH, summary

    assert summary("Tokens per KV-cache block. More.", " (default: 16)") == "Tokens per KV-cache block (default: 16)"
    assert summary("A header (e.g. X-Tenant) is its tenant. Else none.") == "A header (e.g. X-Tenant) is its tenant"
    long = "Run decode steps (one token each) on static buffers, " + "replayed from graphs " * 10 + "instead. Then."
    short = summary(long, " (default: on)")
    assert len(textwrap.wrap(short, HELP_WIDTH)) <= HELP_LINES
    assert short.endswith("… (default: on)") and "(one token each)" not in short


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
    for flag in ("--no-prefix-caching",):
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


def test_serve_takes_tracing_once_for_every_service():
    from drafter.config import DrafterConfig
    from segserve.cli import _SERVE_DRAFTER_RENAME, _SERVE_SCHEDULER_RENAME, _SERVE_WORKER_RENAME
    from common.tracing import TraceSettings, settings_of

    args = build_parser().parse_args(["serve", "--otlp-traces-endpoint", "http://collector:4317",
                                      "--trace-sample-ratio", "0.1"])
    configs = [from_args(WorkerConfig, args, _SERVE_WORKER_RENAME),
               from_args(SchedulerConfig, args, _SERVE_SCHEDULER_RENAME),
               from_args(DrafterConfig, args, _SERVE_DRAFTER_RENAME), from_args(RouterConfig, args)]
    assert [settings_of(c) for c in configs] == [TraceSettings("http://collector:4317", 0.1)] * 4
    for config in configs:  # how each process gets them
        argv = to_argv(config)
        assert argv[argv.index("--otlp-traces-endpoint"):][:4] == ["--otlp-traces-endpoint", "http://collector:4317",
                                                                   "--trace-sample-ratio", "0.1"]
    assert [settings_of(c) for c in (from_args(RouterConfig, build_parser().parse_args(["serve"])),)] == [None]
    with pytest.raises(ValueError, match="trace_sample_ratio"):
        from_args(RouterConfig, build_parser().parse_args(["serve", "--trace-sample-ratio", "1.5"]))


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
