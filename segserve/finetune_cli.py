"""The `segserve` command's fine-tuning subcommands: `segments annotate|synth|eval` and `finetune`.

The work lives in segserve/annotate.py, finetune_data.py, finetune_eval.py and finetune.py; this module
turns flags into their calls, importing each only when its command runs.
"""

from __future__ import annotations

import argparse

from segserve.flags import add_dataclass_args, from_args


def _rules(pairs: list[str]) -> dict[str, str]:
    rules = {}
    for pair in pairs:
        segment, sep, rule = pair.partition("=")
        if not sep or not segment or not rule:
            raise ValueError(f"--rule takes SEGMENT=RULE, got {pair!r}")
        rules[segment] = rule
    return rules


def _segments_annotate_command(args: argparse.Namespace) -> int:
    from segserve.annotate import annotate
    from common.checkpoint import resolve_model

    if not args.files and not args.from_reflow:
        raise SystemExit("segments annotate needs JSONL files or --from-reflow DIR")
    summary = annotate(args.files, args.out, resolve_model(args.tokenizer), args.segments_config,
                       _rules(args.rule), args.from_reflow)
    print(f"{summary['num_samples']} samples annotated into {args.out}: segments {summary['segments']}, "
          f"new tokens {summary['added_tokens']}")
    return 0


def _segments_synth_command(args: argparse.Namespace) -> int:
    from segserve.finetune_data import write_synthetic

    train, heldout = write_synthetic(args.out, args.num_train, args.num_heldout, args.seed)
    print(f"{args.num_train} samples in {train}, {args.num_heldout} in {heldout}")
    return 0


def _segments_eval_command(args: argparse.Namespace) -> int:
    import json

    from common.checkpoint import resolve_model
    from segserve.finetune_eval import evaluate

    report = evaluate(resolve_model(args.model), resolve_model(args.base_model), args.files, args.out,
                      args.segments_config, _rules(args.rule), args.tolerance, args.num_samples)
    print(json.dumps({name: {k: v for k, v in r.items() if k != "model"} for name, r in report["models"].items()},
                     indent=1))
    return 0


def _finetune_command(args: argparse.Namespace) -> int:
    from common.checkpoint import resolve_model
    from segserve.finetune import FinetuneConfig, finetune

    summary = finetune(args.data, resolve_model(args.model), args.out, from_args(FinetuneConfig, args))
    print(f"{summary['num_steps']} steps, label loss {summary['first_loss']:.3f} -> {summary['last_loss']:.3f}; "
          f"checkpoint in {args.out}")
    return 0


def add_finetune_commands(commands) -> None:
    """`segments annotate|synth|eval` and `finetune`, on the `segserve` command's subparsers."""
    from segserve.finetune import FinetuneConfig

    segments = commands.add_parser("segments", help="segment markers in fine-tuning data")
    segment_commands = segments.add_subparsers(dest="segments", required=True)
    rule_help = ("SEGMENT=RULE: the boundary rule of a segment kind (repeatable; rules: code_fence, json_value, "
                 "quoted_context, reasoning_block; default: by kind name, code/json/quote/think)")
    config_help = "segments TOML naming the markers (default: segserve/finetune_segments.toml, <seg:code> ...)"
    annotate = segment_commands.add_parser("annotate", help="insert segment markers into samples' label text")
    annotate.add_argument("files", nargs="*", help="JSONL: {prompt, completion} or {messages} per line")
    annotate.add_argument("--from-reflow", action="append", default=[], metavar="DIR",
                          help="a reflow consumer's log directory (repeatable): its chat examples")
    annotate.add_argument("--out", required=True, help="output directory: samples.jsonl and tokenizer/")
    annotate.add_argument("--tokenizer", default=None, help="the tokenizer's model: a catalog name or a "
                                                            "transformers model directory (default model)")
    annotate.add_argument("--segments-config", default=None, help=config_help)
    annotate.add_argument("--rule", action="append", default=[], help=rule_help)
    annotate.set_defaults(func=_segments_annotate_command)
    synth = segment_commands.add_parser("synth", help="a synthetic set of code / JSON / quote answers")
    synth.add_argument("--out", required=True, help="output directory: train.jsonl and heldout.jsonl")
    synth.add_argument("--num-train", type=int, default=256, help="training samples (default: 256)")
    synth.add_argument("--num-heldout", type=int, default=40, help="held-out samples (default: 40)")
    synth.add_argument("--seed", type=int, default=0, help="random seed (default: 0)")
    synth.set_defaults(func=_segments_synth_command)
    evaluate = segment_commands.add_parser("eval", help="marker precision / recall, fine-tuned vs base model")
    evaluate.add_argument("files", nargs="+", help="held-out JSONL samples")
    evaluate.add_argument("--model", required=True, help="the fine-tuned model directory")
    evaluate.add_argument("--base-model", default=None, help="the model it was tuned from: a catalog name or a "
                                                             "transformers model directory (default model)")
    evaluate.add_argument("--out", required=True, help="JSON report")
    evaluate.add_argument("--tolerance", type=int, default=1,
                          help="tokens a marker may be off its true position and still count (default: 1)")
    evaluate.add_argument("--num-samples", type=int, default=0, help="use the first N samples (default: all)")
    evaluate.add_argument("--segments-config", default=None, help=config_help)
    evaluate.add_argument("--rule", action="append", default=[], help=rule_help)
    evaluate.set_defaults(func=_segments_eval_command)

    finetune = commands.add_parser("finetune", help="fine-tune a model to emit segment markers")
    finetune.add_argument("--data", required=True, help="an annotation directory (segments annotate --out)")
    finetune.add_argument("--model", default=None, help="the model to tune: a catalog name or a transformers "
                                                        "model directory (default model)")
    finetune.add_argument("--out", required=True, help="output checkpoint directory")
    add_dataclass_args(finetune, FinetuneConfig)
    finetune.set_defaults(func=_finetune_command)
