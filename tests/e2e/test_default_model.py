"""The default model, Qwen2.5-Coder-0.5B-Instruct, served as `segserve serve` serves it (its start-up self-check
passed, the drafter speculating): the README's examples give what the README says, a question gets its answer,
`tool_choice: "auto"` returns tool calls, and greedy output through the whole stack, speculation on, is
transformers' `generate` token for token."""

from __future__ import annotations

import re
import string
import subprocess
import sys

import pytest
import torch
from openai import OpenAI
from transformers import AutoModelForCausalLM, AutoTokenizer

from common.catalog import DEFAULT_MODEL
from tests.test_docs import DEFAULT_MODEL_MARK, README, REPO, RUNNABLE_MARK, runnable_examples

pytestmark = [pytest.mark.e2e, pytest.mark.real_model, pytest.mark.timeout(900)]

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}


def run_example(code: str, base_url: str) -> str:
    """A README example pointed at the served stack; its stdout (it must exit 0 and print no traceback)."""
    code = code.replace("http://localhost:8000", base_url)
    result = subprocess.run([sys.executable, "-"], input=code, cwd=REPO, capture_output=True, text=True,
                            timeout=300)
    assert result.returncode == 0 and "Traceback" not in result.stderr, result.stdout + result.stderr
    return result.stdout


WORD = re.compile(r"[^\W\d_]+(?:['’-][^\W\d_]+)*")
"""A word as a poem writes it, once the punctuation around it is stripped: letters, with inner apostrophes and
hyphens ("Nature's", "sun-lit")."""


def test_the_readmes_chat_example_writes_a_poem(default_model_serve):
    """Sampled at temperature 1, as the README runs it: any poem, but words, most of them ("stretches," and
    "Water's" are words; a run of symbols or numbers is not)."""
    chat, = [e for e in runnable_examples(README, RUNNABLE_MARK) if "haiku" in e.code]
    poem = run_example(chat.code, default_model_serve.base_url)
    words = poem.split()
    is_word = [WORD.fullmatch(word.strip(string.punctuation + "“”‘’…—–")) is not None for word in words]
    assert len(words) >= 5 and sum(is_word) >= len(words) // 2, poem


def test_the_readmes_structured_and_tool_example_prints_a_json_answer_and_a_tool_call(default_model_serve):
    example, = runnable_examples(README, DEFAULT_MODEL_MARK)
    answer, call = run_example(example.code, default_model_serve.base_url).strip().splitlines()[:2]
    assert answer in ('{"city": "Paris"}', '{"city": "Rome"}', '{"city": "Tokyo"}'), answer
    assert "name='get_weather'" in call and '"city": "Rome"' in call, call


def test_a_question_gets_its_answer(default_model_serve):
    client, model = default_model_serve.client()
    reply = client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": "What is the capital of France? Answer in one word."}],
        max_tokens=8, temperature=0)
    assert reply.choices[0].message.content.strip().rstrip(".") == "Paris"
    assert reply.choices[0].finish_reason == "stop"  # at <|im_end|>, the catalog's stop token


def test_tool_choice_auto_calls_the_tool_streamed_and_not(default_model_serve):
    client, model = default_model_serve.client()
    messages = [{"role": "user", "content": "What is the weather in Rome?"}]
    whole = client.chat.completions.create(model=model, messages=messages, max_tokens=64, temperature=0,
                                           tools=[WEATHER], tool_choice="auto")
    calls = whole.choices[0].message.tool_calls
    assert whole.choices[0].finish_reason == "tool_calls" and len(calls) == 1
    assert calls[0].function.name == "get_weather" and '"Rome"' in calls[0].function.arguments
    streamed = client.chat.completions.create(model=model, messages=messages, max_tokens=64, temperature=0,
                                              tools=[WEATHER], tool_choice="auto", stream=True)
    names, arguments = [], ""
    for event in streamed:
        for delta in event.choices[0].delta.tool_calls or []:
            names += [delta.function.name] if delta.function.name else []
            arguments += delta.function.arguments or ""
    assert names == ["get_weather"] and arguments == calls[0].function.arguments


def test_greedy_through_the_stack_with_speculation_is_transformers_generate(default_model_serve, instruct_model_dir):
    """Each prompt twice: the second time the drafter has learned the first answer's turn, so its drafts are
    verified and accepted. Every answer is transformers' greedy `generate`, token for token."""
    tokenizer = AutoTokenizer.from_pretrained(instruct_model_dir)
    model = AutoModelForCausalLM.from_pretrained(instruct_model_dir, dtype=torch.float32).eval()
    conversations = [
        ([{"role": "user", "content": "Write a python function that adds two numbers."}], None),
        ([{"role": "user", "content": "What is the weather in Rome?"}], [WEATHER]),
    ]
    client, served = default_model_serve.client()
    before = default_model_serve.stats().spec.num_accepted_tokens
    for messages, tools in conversations:
        prompt_ids = tokenizer.apply_chat_template(messages, tools=tools, add_generation_prompt=True,
                                                   return_dict=True)["input_ids"]
        with torch.inference_mode():
            generated = model.generate(torch.tensor([prompt_ids]), do_sample=False, max_new_tokens=32)
        expected = tokenizer.decode(generated[0, len(prompt_ids):], skip_special_tokens=True)
        for _ in range(2):
            completion = client.completions.create(model=served, prompt=prompt_ids, max_tokens=32, temperature=0)
            assert completion.choices[0].text == expected, messages
    assert default_model_serve.stats().spec.num_accepted_tokens > before
