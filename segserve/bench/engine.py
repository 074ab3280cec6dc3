"""`segserve bench engine`: where the time of one engine step goes, in-process (no gRPC transport, no HTTP).

Per batch size: the real Scheduler (scheduler/scheduler.py) and a real ModelRunner
(worker/model_runner.py) on one model; N sequences are added and prefilled (not
timed), a few decode steps warm up, then --repeats rounds of --steps decode steps
are timed. Each step is split into
  schedule  Scheduler.schedule(), and finish_plan(): the trees fitted into the step
            (scheduler/drafting.py), or its decode steps (scheduler/decode_steps.py)
  draft     with --draft: the drafter's state update and planner, in-process
  wire      the step's protobuf round trip, both ways, as the stack makes it between
            the scheduler and the worker (StepRequest to_pb, serialize, parse, from_pb;
            the same for StepResult), without the gRPC transport; the runner gets the
            request that came through it
  metadata  the runner's host-side preparation (state update, validation, expansion,
            attention metadata, input tensors): ModelRunner.timings
  forward   the model call
  sample    checks, sampling / tree verification, outputs
  output    Scheduler.postprocess(), and its events' way to the router: one
            GenerateStreams message (packed chunks) built, serialized, parsed
            and read back
A round's part is its mean over the round's steps; the report gives the median over
rounds and the spread (min, max). On CUDA the runner ends each part it times with a
device synchronize, so only half the steps of a round, chosen at random (seeded), are
split into parts; the others run as a worker's do, and "untimed" gives their whole
steps. (A fixed alternation lined up with periodic costs: with 8-token requests, every
other step's sliding windows read more keys than the steps between.) A step in
which the runner captured a CUDA graph (once per shape, as a compile is) is left out
of its round (graphs_captured and graph_capture_s count every capture). With
--hf-compiled, HF `generate()` with a static cache and torch.compile runs at the same
batch sizes in the same run (segserve/bench/hf_compiled.py).
With --json-schema, every batch size runs twice, on two sets of sequences held at once:
plain, and with that schema as every sequence's structured output (rows keep going past
the grammar's end: ignore_eos, where it allows only EOS); their rounds alternate (plain,
constrained, then constrained, plain, ...), and `grammar_ms` is the constrained round's
step minus the plain round's beside it, median and spread (with --draft the constrained
rows' trees are pruned and masked, and start with the span the grammar forces). A model
built on the fly (--tiny, --random-weights) gets a small byte-level BPE tokenizer for it.
Outputs under --out: engine.json (every number, the config, the command, the machine)
and engine.png (stacked bars per batch size); the table is printed.
"""

from __future__ import annotations

import argparse
import random
import shlex
import statistics
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import TYPE_CHECKING

from segserve.bench import engine_report as report
from segserve.bench.engine_config import EngineBenchConfig
from segserve.bench.harness import save
from segserve.bench.hf_compiled import bench_hf_compiled
from segserve.bench.random_models import RANDOM_SHAPES, build_tiny_gemma3
from common.heap import freeze_startup_heap

if TYPE_CHECKING:
    from scheduler.scheduler import Scheduler

PARTS = report.PARTS


def _sizes(text: str) -> tuple[int, ...]:
    return tuple(int(part) for part in text.split(",") if part.strip())


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    """Flags of `segserve bench engine`, one per EngineBenchConfig field."""
    d = EngineBenchConfig()
    parser.add_argument("--model", default=d.model,
                        help="catalog name or transformers model directory (default model if unset)")
    parser.add_argument("--tiny", dest="is_tiny", action="store_true", help="a tiny random Gemma3 built on the fly")
    parser.add_argument("--random-weights", dest="is_random_weights", action="store_true",
                        help="a model's shape with random weights (--random-shape), built on the fly (no model "
                        "package needed)")
    parser.add_argument("--random-shape", choices=tuple(RANDOM_SHAPES), default=d.random_shape,
                        help="whose shape --random-weights builds")
    parser.add_argument("--tensor-parallel-size", type=int, default=d.tensor_parallel_size,
                        help="ranks the worker's model is split over (HF compiled runs on one device)")
    parser.add_argument("--device", choices=("auto", "cpu", "cuda"), default=d.device)
    parser.add_argument("--dtype", choices=("auto", "float32", "bfloat16", "float16"), default=d.dtype)
    parser.add_argument("--batch-sizes", type=_sizes, default=d.batch_sizes, help="comma-separated (1,16,64,256)")
    parser.add_argument("--steps", type=int, default=d.steps,
                        help="timed decode steps per round (half of them, at random, split into parts)")
    parser.add_argument("--warmup-steps", type=int, default=d.warmup_steps)
    parser.add_argument("--repeats", type=int, default=d.repeats, help="timed rounds (median and spread)")
    parser.add_argument("--prompt-len", type=int, default=d.prompt_len)
    parser.add_argument("--repetition-penalty", type=float, default=d.repetition_penalty)
    parser.add_argument("--draft", dest="is_draft", action="store_true", help="draft in-process and verify trees")
    parser.add_argument("--max-draft-nodes", type=int, default=d.max_draft_nodes)
    parser.add_argument("--num-decode-steps", type=int, default=d.num_decode_steps,
                        help="decode steps per request to the runner (multi-step decoding; 1 = off)")
    parser.add_argument("--compiled", dest="is_compiled", action="store_true",
                        help="the worker's decoder compiled by torch.compile (buckets compiled before timing)")
    parser.add_argument("--cuda-graphs", dest="is_cuda_graphs", action=argparse.BooleanOptionalAction, default=None,
                        help="decode steps replayed from CUDA graphs (on the CPU: the same padded steps, eager; "
                        "default: the worker's, on a GPU with a lean decoder)")
    parser.add_argument("--compiled-layers", dest="is_compiled_layers", action=argparse.BooleanOptionalAction,
                        default=None, help="the lean decoder's layers compiled around their attention (default: the "
                        "worker's, on a GPU with a lean decoder)")
    parser.add_argument("--lean-decoder", dest="is_lean_decoder", action=argparse.BooleanOptionalAction,
                        default=d.is_lean_decoder, help="the worker's lean forward of Gemma3, Llama, Mistral, Qwen2 "
                        "and Qwen3 (--no-lean-decoder: transformers' forward)")
    parser.add_argument("--linear-block-rows", type=int, default=d.linear_block_rows,
                        help="the worker's linears on blocks of N rows (-1 = the probe's choice, 0 = as they come)")
    parser.add_argument("--hf-compiled", dest="is_hf_compiled", action="store_true",
                        help="also time HF generate() with a static cache + torch.compile")
    parser.add_argument("--json-schema", default=d.json_schema, metavar="FILE|JSON",
                        help="also run every batch size with this JSON schema on every row, and report grammar_ms")
    parser.add_argument("--num-threads", type=int, default=d.num_threads)
    parser.add_argument("--seed", type=int, default=d.seed)
    parser.add_argument("--out", default=d.out, help="output directory (default: bench-results/engine)")


def config_from_args(args: argparse.Namespace) -> EngineBenchConfig:
    return EngineBenchConfig(**{f.name: getattr(args, f.name) for f in fields(EngineBenchConfig)})


class InProcessDrafter:
    """The drafter's per-request state and planner, called directly (no gRPC): one tree per decode sequence."""

    def __init__(self, max_nodes: int):
        from drafter.planner import DraftPlanner
        from drafter.segments import parse_segments
        from drafter.state import RequestStates

        segments = parse_segments({"default": {"max_nodes": max_nodes}})
        self.planner = DraftPlanner(segments)
        self.states = RequestStates(segments, self.planner.learn)
        self.max_nodes = max_nodes
        self._num_sent: dict[str, int] = {}

    def propose(self, plan) -> dict:
        """A tree for each decode sequence of the plan (scheduler/step_plan.py), by request id."""
        from scheduler.drafting import draft_candidates

        trees = {}
        for seq in draft_candidates(plan.request, {seq.request_id: seq for seq in plan.seqs}):
            known = self._num_sent.get(seq.request_id, 0)
            state = self.states.update(seq.request_id, seq.token_ids[known:], seq.num_tokens, seq.num_prompt_tokens)
            if state is None:  # out of step: resync with every token
                state = self.states.update(seq.request_id, seq.token_ids, seq.num_tokens, seq.num_prompt_tokens)
            self._num_sent[seq.request_id] = seq.num_tokens
            tree, _ = self.planner.draft(state, self.max_nodes)
            if tree:
                trees[seq.request_id] = tree
        return trees


def _make_runner(config: EngineBenchConfig, model_dir: Path):
    """One ModelRunner for every batch size, its KV cache sized for the largest."""
    from protos.segserve.v1.step_result import MAX_FORCED_TOKENS
    from worker.config import WorkerConfig
    from worker.model_runner import ModelRunner

    block_size = 16
    max_nodes = max(config.max_draft_nodes, MAX_FORCED_TOKENS if config.json_schema else 0)  # a forced span's tree
    tokens_per_step = max(1 + (max_nodes if config.is_draft else 0), config.num_decode_steps)
    num_steps = config.warmup_steps + config.steps * config.repeats + 2
    max_tokens = config.prompt_len + num_steps * tokens_per_step + max_nodes + 1
    num_sets = 2 if config.json_schema else 1  # plain and constrained sequences, held at once
    num_blocks = num_sets * max(config.batch_sizes) * (-(-max_tokens // block_size) + 1) + 1
    runner = ModelRunner(WorkerConfig(model=str(model_dir), device=config.device, dtype=config.dtype,
                                      block_size=block_size, num_kv_blocks=num_blocks,
                                      num_threads=config.num_threads, is_compiled=config.is_compiled,
                                      is_lean_decoder=config.is_lean_decoder, is_cuda_graphs=config.is_cuda_graphs,
                                      is_compiled_layers=config.is_compiled_layers,
                                      linear_block_rows=config.linear_block_rows,
                                      tensor_parallel_size=config.tensor_parallel_size,
                                      compile_max_tokens=max(config.batch_sizes) * tokens_per_step))
    runner.warm_up()
    return runner, max_tokens


def _decode_step(scheduler, runner, drafter: InProcessDrafter | None) -> tuple[dict[str, float], int]:
    """One engine step (one request to the runner, of scheduler.num_decode_steps decode steps where they apply);
    (seconds per part, total seconds under "total"), tokens it produced."""
    from protos.segserve.v1 import scheduler_pb2, worker_pb2
    from protos.segserve.v1.generate import stream_events_from_pb, stream_events_to_pb
    from protos.segserve.v1.step import StepRequest
    from protos.segserve.v1.step_result import StepResult

    t0 = time.perf_counter()
    plan = scheduler.schedule()
    t1 = time.perf_counter()
    t2, trees = t1, {}  # no drafter: the draft part is 0
    if drafter is not None:
        trees = drafter.propose(plan)
        t2 = time.perf_counter()
    request = scheduler.finish_plan(plan, trees)  # scheduling, after the drafts: steps with a tree take one
    t2b = time.perf_counter()
    received = StepRequest.from_pb(worker_pb2.StepRequest.FromString(request.to_pb(packed=True).SerializeToString()))
    t3 = time.perf_counter()
    outputs = runner.step(received)
    t4 = time.perf_counter()
    result = StepResult.from_pb(
        worker_pb2.StepResponse.FromString(StepResult(outputs).to_pb(packed=True).SerializeToString()))
    t5 = time.perf_counter()
    events = scheduler.postprocess(request, result)
    stream_events_from_pb(scheduler_pb2.StreamsResponse.FromString(  # to the router, as GenerateStreams sends them
        stream_events_to_pb([(e.request_id, e.event) for e in events], packed=True).SerializeToString()))
    t6 = time.perf_counter()
    parts = {"schedule": (t1 - t0) + (t2b - t2), "draft": t2 - t1, "wire": (t3 - t2b) + (t5 - t4), "output": t6 - t5,
             "total": t6 - t0}
    for part in ("metadata", "forward", "sample"):  # 0 in an untimed step
        parts[part] = (runner.timings or {}).get(part, 0.0)
    return parts, sum(len(o.token_ids) for o in result.outputs)


def timed_steps(rng: random.Random, num_steps: int) -> set[int]:
    """The steps of a round that time the runner's parts (on CUDA each part then ends with a synchronize): half of
    them, at random, so that they line up with no periodic cost (every other step crossing a key-grid line, say)."""
    return set(rng.sample(range(num_steps), (num_steps + 1) // 2))


def _num_captured(runner) -> int:
    """The CUDA graphs the runner has captured so far (0 without graphs)."""
    return runner.path.graphs.num_captured if runner.path.graphs is not None else 0


def _uncaptured(steps: list[tuple[tuple[dict, int], bool]]) -> list[tuple[dict, int]]:
    """The steps (_decode_step's results, each with whether the runner captured a CUDA graph in it, a first-time
    cost per shape as a compile is) in which nothing was captured; all of them, should every one have captured."""
    return [step for step, is_captured in steps if not is_captured] or [step for step, _ in steps]


@dataclass
class BatchSet:
    """One set of a batch size's sequences, prefilled, on a scheduler of its own."""

    scheduler: Scheduler
    drafter: InProcessDrafter | None
    seq_ids: list[str]


def start_set(config: EngineBenchConfig, runner, batch_size: int, max_tokens: int, rng: random.Random, index: int,
              num_sets: int) -> BatchSet:
    """batch_size sequences of random prompts (set 1 of 2: under config.json_schema) added and prefilled; the set
    uses the index-th of num_sets equal shares of the runner's KV blocks (its scheduler holds the blocks before
    them), so two sets held at once never share a block."""
    from protos.segserve.v1.sampling import SamplingParams, StoppingCriteria, StructuredKind, StructuredOutput
    from protos.segserve.v1.step_result import StepResult
    from scheduler.scheduler import Scheduler
    from scheduler.sequence import Sequence

    info = runner.info()
    share = info.num_kv_blocks // num_sets
    is_constrained = index == 1
    scheduler = Scheduler(
        num_kv_blocks=share * (index + 1), block_size=info.block_size, max_model_len=info.max_model_len,
        eos_token_ids=info.eos_token_ids, max_num_seqs=batch_size,
        max_num_batched_tokens=max(2048, batch_size * (1 + config.max_draft_nodes)),
        max_num_waiting=batch_size, max_num_waiting_tokens=batch_size * config.prompt_len + 1,
        is_block_table_delta=info.block_table_deltas, num_decode_steps=config.num_decode_steps,
        is_drafting_forced_spans=is_constrained and config.is_draft)  # as the stack does with speculation on
    sampling = SamplingParams(repetition_penalty=config.repetition_penalty)
    stopping = StoppingCriteria(max_tokens=max_tokens, ignore_eos=True)
    if index:  # the shares before this set's stay with the sets they belong to
        scheduler.block_manager.allocate(Sequence("reserved", [0], sampling, stopping), share * index * info.block_size)
    if is_constrained:
        sampling = SamplingParams(repetition_penalty=config.repetition_penalty,
                                  structured_output=StructuredOutput(StructuredKind.JSON_SCHEMA, config.schema_spec()))
    label = "g" if is_constrained else "b"
    seq_ids = [f"{label}{batch_size}-{i}" for i in range(batch_size)]
    for seq_id in seq_ids:
        prompt = [rng.randrange(3, info.vocab_size) for _ in range(config.prompt_len)]
        scheduler.add(Sequence(seq_id, prompt, sampling, stopping))
    while scheduler.waiting or any(seq.num_uncomputed_tokens > 1 for seq in scheduler.running):  # prefill
        request = scheduler.schedule().request
        scheduler.postprocess(request, StepResult(runner.step(request)))
    drafter = InProcessDrafter(config.max_draft_nodes) if config.is_draft else None
    for _ in range(config.warmup_steps):
        _decode_step(scheduler, runner, drafter)
    return BatchSet(scheduler, drafter, seq_ids)


def time_round(config: EngineBenchConfig, runner, batch: BatchSet, rng: random.Random) -> dict[str, float]:
    """One timed round of config.steps decode steps of the set: the mean ms of every part, "total" and
    "tokens_per_step" over its timed steps, and "untimed", the mean ms of its other steps."""
    timed_and_untimed = ([], [])  # (_decode_step's result, whether the runner captured a graph in it)
    timed = timed_steps(rng, config.steps)
    try:
        for index in range(config.steps):
            runner.timings = {} if index in timed else None
            before = _num_captured(runner)
            step = _decode_step(batch.scheduler, runner, batch.drafter)
            timed_and_untimed[index not in timed].append((step, _num_captured(runner) > before))
    finally:
        runner.timings = None
    steps, untimed = (_uncaptured(part) for part in timed_and_untimed)
    if len(batch.scheduler.running) != len(batch.seq_ids):
        raise RuntimeError(f"{len(batch.seq_ids) - len(batch.scheduler.running)} sequences ended during the timed "
                           "steps")
    mean = {part: 1000 * statistics.fmean(p[part] for p, _ in steps) for part in (*PARTS, "total")}
    return mean | {"tokens_per_step": statistics.fmean(n for _, n in steps),
                   "untimed": 1000 * statistics.fmean(parts["total"] for parts, _ in untimed)}


def bench_batch(config: EngineBenchConfig, runner, batch_size: int, max_tokens: int) -> dict:
    """Prefill batch_size sequences, warm up, then time config.repeats rounds of config.steps decode steps; with
    config.json_schema, a constrained set as well, its rounds alternating with the plain set's."""
    from protos.segserve.v1.step import StepRequest

    rng = random.Random(config.seed + batch_size)
    num_sets = 2 if config.json_schema else 1
    sets: list[BatchSet] = []
    rounds: list[list[dict]] = [[] for _ in range(num_sets)]
    try:
        for index in range(num_sets):
            sets.append(start_set(config, runner, batch_size, max_tokens, rng, index, num_sets))
        for repeat in range(config.repeats):  # ABBA: neither set always runs first
            for index in (range(num_sets) if repeat % 2 == 0 else reversed(range(num_sets))):
                rounds[index].append(time_round(config, runner, sets[index], rng))
    finally:
        for batch in sets:
            for seq_id in batch.seq_ids:
                batch.scheduler.abort(seq_id)
        runner.step(StepRequest(finished_seq_ids=[seq_id for batch in sets for seq_id in batch.seq_ids]))
    summary = report.summarize_batch(batch_size, rounds[0])
    if num_sets == 2:
        summary |= report.summarize_grammar(batch_size, rounds[0], rounds[1])
    return summary


def run_benchmark(config: EngineBenchConfig, model_dir: Path, header: dict | None = None,
                  model_label: str | None = None) -> dict:
    """Every batch size (and HF compiled when asked); writes engine.json and engine.png under config.out."""
    import torch

    if config.num_threads:
        torch.set_num_threads(config.num_threads)
    runner, max_tokens = _make_runner(config, model_dir)
    freeze_startup_heap()  # as the worker does once loaded: full collections would land in random parts
    results = {"benchmark": "engine", **(header or {}), "config": asdict(config),
               "model": model_label or str(model_dir), "device": str(runner.device),
               "dtype": str(runner.dtype).removeprefix("torch."), "batches": []}
    try:
        for batch_size in config.batch_sizes:
            batch = bench_batch(config, runner, batch_size, max_tokens)
            results["batches"].append(batch)
            print(f"[bench engine] batch {batch_size}: {batch['total']['median_ms']:.2f} ms/step",
                  file=sys.stderr, flush=True)
    finally:
        runner.close()  # the other tensor-parallel ranks, before HF compiled takes their devices
    results["compiled_layers"] = runner.choice.is_compiled_layers
    if runner.path.graphs is not None:
        results["graphs_captured"] = runner.path.graphs.num_captured
        results["graph_capture_s"] = runner.path.graphs.capture_seconds
    if config.is_hf_compiled:
        hf = bench_hf_compiled(config, model_dir, runner)
        for batch in results["batches"]:
            batch["hf_compiled"] = hf.get(batch["batch_size"])
    out = Path(config.out)
    return save(results, out, "engine", report.plot)


_TOKENIZER_TEXT = ('{"id": 12, "kind": "alpha", "owner": {"name": "Ada Lovelace", "age": 36}, "tags": ["x", "y"]}\n'
                   '[{"key": "value", "count": 0, "ok": true, "none": null}, 3.25, -7] The quick brown fox.\n')


def save_bench_tokenizer(model_dir: Path) -> None:
    """A byte-level BPE tokenizer of up to 400 ids (<pad>, <bos>, <eos> first), trained on a few lines of JSON,
    saved beside a model built on the fly (which has none) for --json-schema: the worker's grammar needs one."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=["<pad>", "<bos>", "<eos>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tokenizer.train_from_iterator([_TOKENIZER_TEXT] * 4, trainer=trainer)
    PreTrainedTokenizerFast(tokenizer_object=tokenizer, bos_token="<bos>", eos_token="<eos>",
                            pad_token="<pad>").save_pretrained(model_dir)


def run_engine(args: argparse.Namespace) -> dict:
    """The CLI entry: run the benchmark, print the table, return the results."""
    from segserve.bench.machine import machine_info

    config = config_from_args(args)
    header = {"command": shlex.join(sys.argv), "machine": machine_info()}
    if config.is_tiny or config.is_random_weights:
        with tempfile.TemporaryDirectory(prefix="segserve-bench-model-") as tmp:
            if config.is_tiny:
                model_dir, label = build_tiny_gemma3(Path(tmp), config.seed), "tiny random Gemma3 (--tiny)"
            else:
                model_dir = RANDOM_SHAPES[config.random_shape](Path(tmp), config.seed, config.device, config.dtype)
                label = f"{config.random_shape}'s shape, random weights (--random-weights)"
            if config.json_schema:
                save_bench_tokenizer(model_dir)
            results = run_benchmark(config, model_dir, header, label)
    else:
        from common.checkpoint import resolve_model

        results = run_benchmark(config, resolve_model(config.model), header)
    print(report.markdown_table(results))
    return results
