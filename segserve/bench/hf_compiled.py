"""HF `generate()` with a static cache and torch.compile, timed beside the engine (`segserve bench engine
--hf-compiled`): ms per decode step = (time of steps + 1 new tokens - time of 1 new token) / steps."""

from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING

from segserve.bench import engine_report as report

if TYPE_CHECKING:
    from segserve.bench.engine_config import EngineBenchConfig


def bench_hf_compiled(config: EngineBenchConfig, model_dir: Path, runner) -> dict[int, dict]:
    """HF generate() with a static cache + torch.compile at every batch size: ms per decode step, tok/s."""
    import torch
    from transformers import AutoModelForCausalLM
    from transformers.generation.configuration_utils import CompileConfig

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=runner.dtype).to(runner.device).eval()
    compile_config = CompileConfig()
    compile_config._compile_all_devices = True  # transformers compiles on cuda only unless told
    vocab_size = runner.info().vocab_size
    results = {}
    for batch_size in config.batch_sizes:
        generator = torch.Generator().manual_seed(config.seed + batch_size)
        input_ids = torch.randint(3, vocab_size, (batch_size, config.prompt_len), generator=generator)
        input_ids = input_ids.to(runner.device)

        def generate(num_new: int) -> float:
            kwargs = dict(do_sample=False, max_new_tokens=num_new, min_new_tokens=num_new,
                          cache_implementation="static", compile_config=compile_config,
                          repetition_penalty=config.repetition_penalty, pad_token_id=0,
                          attention_mask=torch.ones_like(input_ids))
            if runner.device.type == "cuda":
                torch.cuda.synchronize(runner.device)
            start = time.perf_counter()
            with torch.inference_mode():
                model.generate(input_ids, **kwargs)
            if runner.device.type == "cuda":
                torch.cuda.synchronize(runner.device)
            return time.perf_counter() - start

        try:
            for _ in range(2):  # compiles, then settles
                generate(config.steps + 1)
                generate(1)
            per_step = []
            for _ in range(config.repeats):
                long, short = generate(config.steps + 1), generate(1)
                per_step.append(1000 * max(long - short, 0.0) / config.steps)
            results[batch_size] = report.summarize_hf(batch_size, per_step)
        except Exception as exc:  # a benchmark reports what would not run; it does not crash
            results[batch_size] = {"error": f"{type(exc).__name__}: {exc}"}
        print(f"[bench engine] HF compiled batch {batch_size}: {results[batch_size]}", file=sys.stderr, flush=True)
    return results
