"""What segserve is measured against: vLLM, `transformers serve`, and plain/batched `generate()`.

- `PeerServer`: a peer's OpenAI-compatible server offline (HF_HUB_OFFLINE=1) on a
  free loopback port: started, waited for (bounded) until /health answers, and
  stopped (SIGTERM to its process group, then SIGKILL of what is left).
- `VllmServe`: `vllm serve MODEL_DIR` from `make vllm`'s venv, plain or speculating.
- `TransformersServe`: `transformers serve MODEL_DIR --continuous-batching`.
- `measure_plain_generate`: single-stream `model.generate(do_sample=False)`,
  the baseline every decode claim is held against.
- `run_batched_generate`: the fallback peer when `transformers serve` cannot run,
  C prompts per `generate()` call, timed per step into loadgen `RequestRecord`s.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx

from common.ports import free_port
from segserve.bench.loadgen import RequestRecord
from segserve.bench.report import decode_tokens_per_s, inter_token_gaps, percentile


class PeerStartError(RuntimeError):
    """The peer server did not become ready (it exited, or the wait ran out)."""


def offline_env() -> dict:
    """This process's environment, with the Hugging Face hub switched off."""
    return {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "HF_HUB_DISABLE_TELEMETRY": "1"}


def ignore_eos_body(model_dir: Path, max_new_tokens: int) -> dict:
    """Extra body fields that make `transformers serve` run to max_tokens (no EOS stop), greedily.

    It accepts no `ignore_eos`, but takes a whole `generation_config` (JSON) per
    request and its continuous batching treats eos_token_id -1 as "none".
    """
    path = Path(model_dir) / "generation_config.json"
    config = json.loads(path.read_text()) if path.is_file() else {}
    config = {k: v for k, v in config.items() if k in ("bos_token_id", "pad_token_id")}
    config.update(eos_token_id=-1, do_sample=False, max_new_tokens=max_new_tokens)
    return {"generation_config": json.dumps(config)}


class PeerServer:
    """An OpenAI-compatible server as a child process on loopback, in a session of its own; use as a context
    manager. A subclass gives its `name`, `model_name` and `command()`."""

    name = "peer"
    health_path = "/health"

    def __init__(self, model_dir: Path, port: int = 0, startup_timeout_s: float = 300.0,
                 log_path: Path | None = None, extra_args: tuple[str, ...] = ()) -> None:
        self.model_dir = Path(model_dir)
        self.port = port or free_port()
        self.startup_timeout_s = startup_timeout_s
        self.log_path = log_path
        self.extra_args = tuple(extra_args)
        self._process: subprocess.Popen | None = None
        self._log = None

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def model_name(self) -> str:
        raise NotImplementedError

    def command(self) -> list[str]:
        raise NotImplementedError

    def env(self) -> dict:
        return offline_env()

    def start(self) -> None:
        self._log = open(self.log_path, "wb") if self.log_path else subprocess.DEVNULL
        self._process = subprocess.Popen(
            self.command(), env=self.env(), stdout=self._log, stderr=subprocess.STDOUT, start_new_session=True
        )

    def wait_ready(self) -> None:
        deadline = time.monotonic() + self.startup_timeout_s
        with httpx.Client(timeout=5.0, trust_env=False) as client:
            while time.monotonic() < deadline:
                if self._process.poll() is not None:
                    raise PeerStartError(f"{self.name} exited with {self._process.returncode}{self._log_tail()}")
                try:
                    if client.get(self.base_url + self.health_path).status_code == 200:
                        return
                except httpx.HTTPError:
                    pass
                time.sleep(0.5)
        raise PeerStartError(f"{self.name} not ready after {self.startup_timeout_s:.0f} s{self._log_tail()}")

    def stop(self) -> None:
        """SIGTERM to the server's whole session (its engine processes too), SIGKILL after 15 s."""
        process, self._process = self._process, None
        if process is not None and process.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, signal.SIGTERM)
            try:
                process.wait(timeout=15)
            except subprocess.TimeoutExpired:
                pass
        if process is not None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, signal.SIGKILL)  # whatever of the session is left
            process.wait(timeout=15)
        if self._log not in (None, subprocess.DEVNULL):
            self._log.close()
        self._log = None

    def _log_tail(self) -> str:
        if not self.log_path or not Path(self.log_path).is_file():
            return ""
        return "; log tail:\n" + Path(self.log_path).read_text(errors="replace")[-2000:]

    def __enter__(self):
        self.start()
        try:
            self.wait_ready()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


class TransformersServe(PeerServer):
    """`transformers serve`, with or without its continuous batching."""

    name = "transformers serve"

    def __init__(self, model_dir: Path, port: int = 0, continuous_batching: bool = True, dtype: str = "float32",
                 startup_timeout_s: float = 300.0, log_path: Path | None = None,
                 extra_args: tuple[str, ...] = ()) -> None:
        super().__init__(model_dir, port, startup_timeout_s, log_path, extra_args)
        self.continuous_batching = continuous_batching
        self.dtype = dtype

    @property
    def model_name(self) -> str:
        # The server is pinned to this exact string; any other `model` is a 400.
        return str(self.model_dir)

    def command(self) -> list[str]:
        batching = "--continuous-batching" if self.continuous_batching else "--no-continuous-batching"
        return [
            sys.executable, "-m", "transformers.cli.transformers", "serve", str(self.model_dir),
            batching, "--host", "127.0.0.1", "--port", str(self.port), "--dtype", self.dtype, *self.extra_args,
        ]  # fmt: skip


VLLM_VENV = Path(__file__).resolve().parents[2] / ".venv-vllm"
"""Where `make vllm` installs vLLM: a venv of its own beside the project's (its pins are not the project's)."""


class VllmServe(PeerServer):
    """`vllm serve` from `make vllm`'s venv: its CPU build here, its CUDA build on a GPU machine. With
    `speculative_config` (e.g. {"method": "suffix", "num_speculative_tokens": 5}) it speculates. Its own
    defaults otherwise (CPU placement, threads), as a user would start it, but for the KV cache's size (`env`)."""

    name = "vLLM"

    def __init__(self, model_dir: Path, port: int = 0, dtype: str = "float32", max_model_len: int = 4096,
                 speculative_config: dict | None = None, venv: Path | None = None, startup_timeout_s: float = 600.0,
                 log_path: Path | None = None, extra_args: tuple[str, ...] = ()) -> None:
        super().__init__(model_dir, port, startup_timeout_s, log_path, extra_args)
        self.dtype = dtype
        self.max_model_len = max_model_len
        self.speculative_config = speculative_config
        self.venv = Path(venv) if venv else VLLM_VENV
        if speculative_config:
            self.name = f"vLLM ({speculative_config.get('method', 'speculative')})"

    @property
    def model_name(self) -> str:
        return self.model_dir.name

    def executable(self) -> Path:
        path = self.venv / "bin" / "vllm"
        if not path.is_file():
            raise PeerStartError(f"{path} not found: `make vllm` installs vLLM into {self.venv}")
        return path

    def command(self) -> list[str]:
        command = [str(self.executable()), "serve", str(self.model_dir), "--host", "127.0.0.1", "--port",
                   str(self.port), "--dtype", self.dtype, "--served-model-name", self.model_name,
                   "--max-model-len", str(self.max_model_len), "--disable-uvicorn-access-log"]
        if self.speculative_config:
            command += ["--speculative-config", json.dumps(self.speculative_config)]
        return command + list(self.extra_args)

    def env(self) -> dict:
        # Its CPU build's default KV cache takes most of the machine's memory (17 of 24 GiB here), and segserve
        # runs beside it in the benches: 4 GiB is over 100k tokens of the default model, far more than they use.
        return {"VLLM_CPU_KVCACHE_SPACE": "4", **offline_env(), "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1"}


class StepTimer:
    """A `generate()` streamer that notes when each decoding step's tokens come out."""

    def __init__(self) -> None:
        self.step_times: list[float] = []
        self._seen_prompt = False

    def put(self, value) -> None:
        if not self._seen_prompt:  # generate() first hands over the prompt itself
            self._seen_prompt = True
            return
        self.step_times.append(time.perf_counter())

    def end(self) -> None:
        pass


def resolve_dtype(dtype: str) -> str:
    """"auto" -> the worker's choice: bfloat16 on cuda, float32 on cpu; anything else unchanged."""
    if dtype != "auto":
        return dtype
    import torch

    return "bfloat16" if torch.cuda.is_available() else "float32"


def load_model(model_dir: Path, dtype: str = "float32"):
    """(model, tokenizer) for in-process generate(), on cuda when there is one."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    tokenizer.padding_side = "left"
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=getattr(torch, dtype))
    return model.to("cuda" if torch.cuda.is_available() else "cpu").eval(), tokenizer


def _generate_timed(model, tokenizer, prompts: list[str], max_new_tokens: int, **kwargs) -> list[RequestRecord]:
    """One generate() call over `prompts`; one record per row, sharing the step times."""
    import torch

    encoded = tokenizer(prompts, return_tensors="pt", padding=True).to(model.device)  # input_ids: [B, L]
    timer = StepTimer()
    started_at = time.perf_counter()
    with torch.inference_mode():
        output = model.generate(
            **encoded, max_new_tokens=max_new_tokens, do_sample=False, streamer=timer, **kwargs
        )  # output: [B, L + T]
    finished_at = time.perf_counter()
    generated = output[:, encoded["input_ids"].shape[1] :]  # [B, T]
    eos_ids = set(_as_list(model.generation_config.eos_token_id))
    records = []
    for row, tokens in enumerate(generated.tolist()):
        count = next((i + 1 for i, t in enumerate(tokens) if t in eos_ids), len(tokens))
        records.append(
            RequestRecord(row, started_at, finished_at, timer.step_times[:count], count, "length")
        )
    return records


def _as_list(value) -> list:
    return [] if value is None else list(value) if isinstance(value, (list, tuple)) else [value]


def measure_plain_generate(model, tokenizer, prompt: str, max_new_tokens: int, runs: int = 2) -> dict:
    """Single-stream plain `model.generate(do_sample=False)`: median tokens/s over `runs`."""
    _generate_timed(model, tokenizer, [prompt], 4)  # warm-up
    records = [_generate_timed(model, tokenizer, [prompt], max_new_tokens)[0] for _ in range(runs)]
    rates = sorted(r.num_tokens / (r.finished_at - r.started_at) for r in records)
    decode_rates = sorted(rate for r in records if (rate := decode_tokens_per_s(r)) is not None)
    gaps = [gap for r in records for gap in inter_token_gaps(r.event_times)]
    ttfts = [r.event_times[0] - r.started_at for r in records if r.event_times]
    return {
        "method": "model.generate(do_sample=False), batch 1, fp32, in the benchmark process",
        "prompt": prompt,
        "max_new_tokens": max_new_tokens,
        "tokens_per_s": percentile(rates, 50),
        "decode_tokens_per_s": percentile(decode_rates, 50),
        "ttft_ms": 1000 * percentile(ttfts, 50) if ttfts else None,
        "itl_ms_p50": 1000 * percentile(gaps, 50) if gaps else None,
        "itl_ms_p99": 1000 * percentile(gaps, 99) if gaps else None,
        "runs": [r.to_dict() for r in records],
    }


def run_batched_generate(
    model, tokenizer, prompts: list[str], concurrency: int, max_new_tokens: int, requests_per_stream: int
) -> list[RequestRecord]:
    """`requests_per_stream` rounds of one generate() over `concurrency` prompts, EOS suppressed."""
    _generate_timed(model, tokenizer, prompts[:1], 4)  # warm-up
    records: list[RequestRecord] = []
    for round_index in range(requests_per_stream):
        batch = [prompts[(i + round_index * concurrency) % len(prompts)] for i in range(concurrency)]
        records += _generate_timed(model, tokenizer, batch, max_new_tokens, min_new_tokens=max_new_tokens)
    return records
