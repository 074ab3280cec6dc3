"""Benchmarks behind `segserve bench ...`.

`segserve bench throughput` measures segserve against a peer server on the same
model and writes what it measured:

- in: a catalog name or a model directory (None = the default model), concurrency levels,
  the output length and an output directory (CLI flags from `add_throughput_args`);
- out: `throughput.json` (every raw per-request timing, the config, machine info,
  the command line), `throughput.png` and a markdown table on stdout.

`segserve bench spec` compares speculative decoding, in one run, against HF
`generate()` plain and with prompt lookup, and against segserve's own plain
decoding and prompt lookup only (the same-engine ablation), on copy-from-prompt
workloads (code edit, grounded answer, JSON records), open-ended text, repeated
edits whose output recurs across requests but is in no prompt, and the edits
sampled at T = 0.7; over several rounds, optionally on a fine-tuned model too:

- in: a model directory, max_tokens, workload sizes, systems and kinds to run,
  rounds (CLI flags from `add_spec_args`);
- out: `spec.json` (raw per-request numbers per round, the median and spread of
  every number, scheduler spec counters and acceptance, greedy mismatches,
  command, machine), `spec.png`, markdown tables and the goals.

Modules: `spec_workloads` (prompts), `spec_systems` (HF and segserve adapters),
`spec_report` (numbers, goals, table, plot), `spec` (orchestration).
Throughput modules: `loadgen` (async OpenAI-SSE load generator, loopback only), `grpc_direct`
(the same closed loop straight to the scheduler's gRPC, for the router's overhead), `peers`
(`transformers serve`, plain and batched `generate()`), `report` (statistics,
goals, JSON, plot, table) and `throughput` (the orchestration the CLI calls).

`segserve bench structured` measures grammar-aware speculation on JSON-schema
extraction and a forced tool-call loop, against HF `generate()` under xgrammar's
logits processor, segserve without speculation and with speculation but without the
grammar's forced-span drafts: validity, tok/s, tokens per step, acceptance, greedy
equality, over rounds: `structured_workloads` (schemas, records, tools),
`structured_systems` (HF + xgrammar and segserve chat adapters), `structured_report`
(numbers, goals, table, plot), `structured` (orchestration); out: `structured.json`,
`structured.png`.

`segserve bench reflow` measures what data reflow's recording adds to the
router's TTFT and ITL (reflow on vs off, alternating rounds) and the consumer's
chunks/s: `reflow` (orchestration), `paced_scheduler` (the fixture: a model-free
Scheduler gRPC service streaming at a fixed pace), `reflow_report` (table, plot);
out: `reflow.json`, `reflow.png`.

`segserve bench engine` splits one engine step, in-process (the real Scheduler and
ModelRunner, no gRPC), into schedule, metadata, forward, sample, draft and output per
batch size, optionally beside HF `generate()` with a static cache + torch.compile:
`engine` (orchestration), `engine_report` (statistics, table, plot); out: `engine.json`,
`engine.png`.
"""

from segserve.bench.spec import add_spec_args, run_spec
from segserve.bench.throughput import add_throughput_args, run_throughput

__all__ = ["add_spec_args", "add_throughput_args", "run_spec", "run_throughput"]
