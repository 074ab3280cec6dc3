"""Benchmarks behind `segserve bench ...`.

`segserve bench throughput` measures segserve against a peer server on the same
model and writes what it measured:

- in: a model directory (None = the default gemma-3-270m), concurrency levels,
  the output length and an output directory (CLI flags from `add_throughput_args`);
- out: `throughput.json` (every raw per-request timing, the config, machine info,
  the command line), `throughput.png` and a markdown table on stdout.

Modules: `loadgen` (async OpenAI-SSE load generator, loopback only), `peers`
(`transformers serve`, plain and batched `generate()`), `report` (statistics,
goals, JSON, plot, table) and `throughput` (the orchestration the CLI calls).
"""

from segserve.bench.throughput import add_throughput_args, run_throughput

__all__ = ["add_throughput_args", "run_throughput"]
