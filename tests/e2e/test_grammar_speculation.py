"""Speculation under a grammar end to end: two real tiny stacks (router, scheduler, worker and drafter processes), one
speculative and one not, on the tiny random Gemma3.

Greedy structured outputs (JSON schemas, a regex, a choice) through the official openai client are identical with
speculation on and off: constrained trees are pruned and verified under their grammar, so drafting changes only
how many tokens a step takes. On a schema of long fixed keys, the speculative stack takes several tokens per step:
the spans the grammar forces are drafted for free. The steps are read from the scheduler's stream (one TokenChunk
per step, with the draft tokens it accepted), as tests/e2e/test_spec_lossless.py reads them.
"""

from __future__ import annotations

import asyncio
import json

import grpc
import pytest
from openai import OpenAI
from transformers import AutoTokenizer

from protos.segserve.v1 import scheduler_pb2_grpc
from protos.segserve.v1.generate import GenerateComplete, GenerateRequest, TokenChunk, event_from_pb
from protos.segserve.v1.sampling import SamplingParams, StoppingCriteria, StructuredKind, StructuredOutput
from tests.support.e2e_helpers import tiny_stack, wait_until_idle

pytestmark = pytest.mark.e2e

MAX_TOKENS = 96
PROMPT = 'Give me a record as JSON: {"name": "Ada", "age": 36}'
KEYS_SCHEMA = {
    "type": "object", "additionalProperties": False,
    "required": ["zebra_quux_identifier", "kind_of_the_record", "is_valid_flag"],
    "properties": {"zebra_quux_identifier": {"type": "integer", "minimum": 0, "maximum": 99},
                   "kind_of_the_record": {"enum": ["alpha_primary_kind", "beta_secondary_kind"]},
                   "is_valid_flag": {"type": "boolean"}},
}
CITY_SCHEMA = {"type": "object", "additionalProperties": False, "required": ["city", "is_capital"],
               "properties": {"city": {"enum": ["Paris", "Rome", "Tokyo"]}, "is_capital": {"type": "boolean"}}}
NESTED_SCHEMA = {
    "type": "object", "additionalProperties": False, "required": ["user", "score"],
    "properties": {
        "user": {"type": "object", "additionalProperties": False, "required": ["first_name", "colours"],
                 "properties": {"first_name": {"type": "string", "maxLength": 6},
                                "colours": {"type": "array", "maxItems": 2,
                                            "items": {"enum": ["red", "green", "blue"]}}}},
        "score": {"type": "number"}},
}
STRUCTURED = {
    "keys": {"json": KEYS_SCHEMA},
    "city": {"json": CITY_SCHEMA},
    "nested": {"json": NESTED_SCHEMA},
    "regex": {"regex": "[0-9]{3}-[a-z]{2,5}"},
    "choice": {"choice": ["alpha_centauri", "beta_pictoris", "gamma_draconis"]},
}


@pytest.fixture(scope="module")
def stacks(tiny_gemma3_dir, tmp_path_factory):
    """(speculative stack, plain stack), started together."""
    on = tiny_stack(tiny_gemma3_dir, tmp_path_factory.mktemp("logs-on"), num_kv_blocks=128, block_size=16)
    off = tiny_stack(tiny_gemma3_dir, tmp_path_factory.mktemp("logs-off"), is_speculative=False,
                     num_kv_blocks=128, block_size=16)
    with on, off:
        yield on, off


def completion(stack, structured: dict) -> tuple[str, str, int]:
    client = OpenAI(base_url=stack.base_url + "/v1", api_key="unused", max_retries=0, timeout=120)
    model = client.models.list().data[0].id
    result = client.completions.create(model=model, prompt=PROMPT, max_tokens=MAX_TOKENS, temperature=0,
                                       extra_body={"structured_outputs": structured})
    choice = result.choices[0]
    return choice.text, choice.finish_reason, result.usage.completion_tokens


@pytest.mark.parametrize("name", sorted(STRUCTURED))
def test_greedy_structured_outputs_are_the_same_with_speculation_on_and_off(stacks, name):
    on, off = stacks
    speculative, plain = completion(on, STRUCTURED[name]), completion(off, STRUCTURED[name])
    assert speculative == plain, name
    text, finish_reason, _ = plain
    if finish_reason == "stop" and "json" in STRUCTURED[name]:
        assert isinstance(json.loads(text, strict=False), dict)


async def steps(stack, prompt_ids: list[int], structured: StructuredOutput) -> tuple[list[int], list[TokenChunk]]:
    """A greedy request straight to the stack's scheduler: its tokens, and its chunks (one per step)."""
    request = GenerateRequest("grammar-steps", tuple(prompt_ids), SamplingParams(structured_output=structured),
                              StoppingCriteria(max_tokens=MAX_TOKENS))
    chunks: list[TokenChunk] = []
    async with grpc.aio.insecure_channel(stack.config.router.scheduler_address) as channel:
        async for response in scheduler_pb2_grpc.SchedulerStub(channel).Generate(request.to_pb(), timeout=120):
            event = event_from_pb(response)
            if not isinstance(event, TokenChunk):
                assert isinstance(event, GenerateComplete), event
                break
            chunks.append(event)
    return [t for chunk in chunks for t in chunk.token_ids], chunks


def test_long_fixed_keys_take_several_tokens_per_step_with_speculation(stacks, tiny_gemma3_dir):
    on, off = stacks
    prompt_ids = AutoTokenizer.from_pretrained(tiny_gemma3_dir)(PROMPT).input_ids
    keys = StructuredOutput(StructuredKind.JSON_SCHEMA, json.dumps(KEYS_SCHEMA))
    speculative, chunks = asyncio.run(steps(on, prompt_ids, keys))
    plain, _ = asyncio.run(steps(off, prompt_ids, keys))
    assert speculative == plain and len(plain) > 40
    # the forced keys were drafted (no drafter corpus knows them) and accepted: steps take several tokens
    assert sum(chunk.num_accepted_draft_tokens for chunk in chunks) > len(plain) / 2
    assert len(speculative) / len(chunks) > 2, [len(chunk.token_ids) for chunk in chunks]
    # the slots of pruned and rejected nodes went back with the rest: nothing is held once the stack is idle
    stats = wait_until_idle(on)
    assert (stats.num_running, stats.num_waiting, stats.num_used_kv_blocks) == (0, 0, 0)
