"""The systems `segserve bench structured` compares, each behind one call: (chat body, max_tokens) -> record.

- `hf_xgrammar_system(model_dir, dtype)`: in-process greedy `model.generate`
  masked by xgrammar's own `xgrammar.contrib.hf.LogitsProcessor`, stopping at
  the model's EOS ids. The body is read by the router's own request model, so
  the prompt is the same chat template over the same messages and tools, the
  grammar the same spec (a response format's schema, or the forced calls'
  schema of router/tools.py) compiled with common/grammar.py's options against
  a TokenizerInfo as wide as the model's logits, and the text read into calls
  by the router's own readers. The grammar is compiled inside the timed span,
  as the router and worker compile theirs inside a request.
- `segserve_chat_system(model_dir, dtype, system, ...)`: a fresh local stack
  (`segserve.launcher.Stack`) per system: spec_systems.stack_config with
  speculation off (segserve_off) or on (segserve_spec), and for
  segserve_no_grammar_drafts on with the scheduler's `is_grammar_drafts`
  off (every system may override more scheduler fields, e.g. num_decode_steps).
  Non-streamed `POST /v1/chat/completions`, temperature 0, the
  scheduler's GetStats counters read around every request.

Each is a context manager factory yielding `chat(body, max_tokens) -> {"num_tokens", "wall_s", "text",
"calls": [{"name", "arguments"}], "finish_reason", "spec"}` (spec: counter deltas, or None).
"""

from __future__ import annotations

import contextlib
import copy
import json
import time
from collections.abc import Callable, Iterator
from dataclasses import fields, replace
from pathlib import Path

import httpx

from segserve.bench.spec_systems import counter_delta, read_counters, stack_config
from segserve.bench.structured_report import NO_GRAMMAR, OFF, SPEC

Chat = Callable[[dict, int], dict]
SCHEDULER_OVERRIDES = {OFF: {}, NO_GRAMMAR: {"is_grammar_drafts": False}, SPEC: {}}
"""Each segserve system's SchedulerConfig fields beyond spec_systems.stack_config's."""


def structured_stack_config(model_dir: Path, dtype: str, system: str, log_dir: Path,
                            startup_timeout_s: float = 300.0, scheduler: dict | None = None):  # fmt: skip
    """The StackConfig of one segserve system, `scheduler` overriding more SchedulerConfig fields; ValueError when
    the scheduler lacks a field the system needs."""
    from scheduler.config import SchedulerConfig

    if system not in SCHEDULER_OVERRIDES:
        raise ValueError(f"system must be one of {tuple(SCHEDULER_OVERRIDES)}, got {system!r}")
    overrides = {**(scheduler or {}), **SCHEDULER_OVERRIDES[system]}
    missing = set(overrides) - {f.name for f in fields(SchedulerConfig)}
    if missing:
        raise ValueError(f"{system} needs SchedulerConfig.{', '.join(sorted(missing))}, which this scheduler lacks")
    config = stack_config(model_dir, dtype, "off" if system == OFF else "spec", log_dir, startup_timeout_s)
    return replace(config, scheduler=replace(config.scheduler, **overrides))


@contextlib.contextmanager
def segserve_chat_system(model_dir: Path, dtype: str, system: str, log_dir: Path, startup_timeout_s: float = 300.0,
                         request_timeout_s: float = 600.0,
                         scheduler: dict | None = None) -> Iterator[Chat]:  # fmt: skip
    """A fresh local stack (fresh corpora too), measured one request at a time; `scheduler`: SchedulerConfig
    fields to override."""
    import grpc

    from protos.segserve.v1 import scheduler_pb2_grpc
    from segserve.launcher import Stack

    config = structured_stack_config(model_dir, dtype, system, log_dir, startup_timeout_s, scheduler)
    with Stack(config) as stack, grpc.insecure_channel(stack.config.router.scheduler_address) as channel:
        stub = scheduler_pb2_grpc.SchedulerStub(channel)
        # trust_env=False: a proxy configured for package registries must never see loopback traffic.
        with httpx.Client(base_url=stack.base_url, timeout=request_timeout_s, trust_env=False) as client:
            yield lambda body, max_tokens: chat_http(client, stub, body, max_tokens)


def chat_http(client: httpx.Client, stub, body: dict, max_tokens: int) -> dict:
    """One greedy chat completion; `stub` (a SchedulerStub or None) gives the counter deltas."""
    before = read_counters(stub) if stub else None
    started_at = time.perf_counter()
    response = client.post("/v1/chat/completions", json={**body, "max_tokens": max_tokens, "temperature": 0.0})
    wall_s = time.perf_counter() - started_at
    if response.status_code != 200:
        raise RuntimeError(f"segserve answered HTTP {response.status_code}: {response.text[:300]}")
    data = response.json()
    spec = counter_delta(before, read_counters(stub)) if stub else None
    choice = data["choices"][0]
    calls = [{"name": call["function"]["name"], "arguments": call["function"]["arguments"]}
             for call in choice["message"].get("tool_calls") or []]  # fmt: skip
    return {"num_tokens": data["usage"]["completion_tokens"], "wall_s": wall_s,
            "text": choice["message"].get("content") or "", "calls": calls,
            "finish_reason": choice["finish_reason"], "spec": spec}  # fmt: skip


def stop_token_ids(model) -> list[int]:
    """The EOS ids of the generation config and the model config: where the worker's grammar may end too."""
    ids: set[int] = set()
    for source in (model.generation_config, model.config.get_text_config()):
        value = getattr(source, "eos_token_id", None)
        if value is not None:
            ids.update([value] if isinstance(value, int) else value)
    return sorted(ids)


@contextlib.contextmanager
def hf_xgrammar_system(model_dir: Path, dtype: str = "float32") -> Iterator[Chat]:
    """Greedy `generate()` under xgrammar's HF logits processor, one grammar compiled per request."""
    import torch
    import xgrammar as xgr
    from xgrammar.contrib.hf import LogitsProcessor

    from common.grammar import JSON_SCHEMA_OPTIONS
    from router.prompts import chat_prompt_ids
    from router.protocol import ChatCompletionRequest
    from router.tools import call_reader, template_tools
    from segserve.bench.peers import load_model

    model, tokenizer = load_model(model_dir, dtype)
    stop_ids = stop_token_ids(model)
    vocab_size = model.get_output_embeddings().weight.shape[0]  # the logits' width; the tokenizer's may be less
    info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size, stop_token_ids=stop_ids)
    compiler = xgr.GrammarCompiler(info)
    config = copy.deepcopy(model.generation_config)
    config.update(do_sample=False, eos_token_id=stop_ids, pad_token_id=tokenizer.pad_token_id)

    def chat(body: dict, max_tokens: int) -> dict:
        request = ChatCompletionRequest.model_validate_json(json.dumps(body))  # as the router reads it
        prompt_ids = chat_prompt_ids(tokenizer, request.template_messages(), template_tools(request.tools))
        _, structure = request.asked_structure()
        input_ids = torch.tensor([prompt_ids], device=model.device)  # [1, L]
        call_config = copy.deepcopy(config)
        call_config.update(max_new_tokens=max_tokens)
        started_at = time.perf_counter()
        processor = LogitsProcessor(compiler.compile_json_schema(structure.spec, **JSON_SCHEMA_OPTIONS))
        with torch.inference_mode():
            output = model.generate(input_ids, attention_mask=torch.ones_like(input_ids),
                                    generation_config=call_config, logits_processor=[processor])  # [1, L + T]
        wall_s = time.perf_counter() - started_at
        new_ids = output[0, len(prompt_ids):].tolist()
        is_stopped = bool(new_ids) and new_ids[-1] in stop_ids
        text = tokenizer.decode(new_ids[:-1] if is_stopped else new_ids, skip_special_tokens=True)  # as the router
        calls, finish_reason = [], "stop" if is_stopped else "length"
        if request.tool_mode in ("required", "named"):
            parsed = call_reader(request.tool_mode, request.tool_choice, "", False).parse(text)
            text, calls = parsed.content or "", [{"name": c.name, "arguments": c.arguments} for c in parsed.tool_calls]
            finish_reason = "tool_calls" if is_stopped and calls else finish_reason
        return {"num_tokens": len(new_ids), "wall_s": wall_s, "text": text, "calls": calls,
                "finish_reason": finish_reason, "spec": None}  # fmt: skip

    yield chat
