"""The `segserve` extension of stream chunks (router/speculation.py): each token's text, whether it was an
accepted draft or the model's own, and each step's segment kind and tree, only when a request asks for it.

Through real HTTP against the fake scheduler of test_router.py, whose chunks are steps of two tokens: one
accepted draft of a tree of 4 (depth 2) in segment "code", then the model's own token.
"""

from __future__ import annotations

import json

import httpx
import openai
import pytest

from protos.segserve.v1.generate import FinishReason, GenerateComplete, GenerateRequest, TokenChunk
from protos.segserve.v1.sampling import SamplingParams, StoppingCriteria
from router.detokenizer import IncrementalDetokenizer
from router.generation import GenerationJob, generate_deltas
from router.speculation import Speculation, StepInfo, with_extension
from tests.support.fake_scheduler import FAKE_SEGMENT, OUTPUT_TEXT, ScriptedClient
from tests.router.test_server import MODEL, router_url, scheduler, tokenizer  # noqa: F401

USER = [{"role": "user", "content": "hi"}]
SPECULATION = {"include_speculation": True}


def _events(url: str, path: str, body: dict) -> list[dict]:
    with httpx.stream("POST", url + path, json=body, timeout=30) as response:
        assert response.status_code == 200, response.read()
        lines = [line for line in response.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "data: [DONE]"
    return [json.loads(line[len("data: "):]) for line in lines[:-1]]


def _text(event: dict) -> str:
    choice = event["choices"][0] if event["choices"] else {}
    return choice.get("text") or (choice.get("delta") or {}).get("content") or ""


@pytest.mark.parametrize("path,body", [
    ("/v1/chat/completions", {"messages": USER}),
    ("/v1/completions", {"prompt": "hi"}),
])
def test_each_token_says_whether_it_was_a_draft_and_which_tree_and_segment(router_url, path, body):
    events = _events(router_url, path, {"model": MODEL, "stream": True, "max_tokens": 12,
                                        "stream_options": SPECULATION, **body})
    tokens = [t for e in events if "segserve" in e for t in e["segserve"]["tokens"]]
    assert "".join(_text(e) for e in events) == "".join(t["text"] for t in tokens)
    assert OUTPUT_TEXT.startswith("".join(t["text"] for t in tokens)) and len(tokens) == 12
    assert [t["origin"] for t in tokens] == ["draft", "model"] * 6
    for event in (e for e in events if "segserve" in e):
        steps = event["segserve"]["steps"]
        assert steps and all(step == {"num_tokens": 2, "num_accepted": 1, "segment": FAKE_SEGMENT,
                                      "tree_size": 4, "tree_depth": 2} for step in steps)
        assert {t["step"] for t in event["segserve"]["tokens"]} == set(range(len(steps)))


def test_without_the_option_chunks_are_unchanged(router_url):
    for options in (None, {"include_usage": True}, {"include_speculation": False}):
        events = _events(router_url, "/v1/chat/completions", {"model": MODEL, "messages": USER, "stream": True,
                                                              "max_tokens": 6, "stream_options": options})
        assert events and not any("segserve" in e for e in events)


def test_the_openai_client_streams_with_the_option_on(router_url):
    client = openai.OpenAI(base_url=f"{router_url}/v1", api_key="unused", max_retries=0)
    texts = []
    for options in ({"include_usage": True, **SPECULATION}, {"include_usage": True}):
        chunks = list(client.chat.completions.create(model=MODEL, messages=USER, max_tokens=8, stream=True,
                                                     stream_options=options))
        texts.append("".join(c.choices[0].delta.content or "" for c in chunks if c.choices))
        assert chunks[-1].usage.completion_tokens == 8
    assert texts[0] == texts[1] and texts[0].startswith("Hello")


def test_a_wrong_option_value_is_a_400_naming_the_field(router_url):
    response = httpx.post(router_url + "/v1/chat/completions", timeout=30, json={
        "model": MODEL, "messages": USER, "stream": True, "stream_options": {"include_speculation": "yes"}})
    assert response.status_code == 400
    assert "include_speculation" in response.text


async def test_chunks_merged_into_one_delta_keep_their_steps_in_order(tokenizer):
    ids = tokenizer("Hello 🙂 world, again", add_special_tokens=False).input_ids
    eos = 1
    chunks = [TokenChunk(tuple(ids[:3]), (0.0,) * 3, segment="", num_draft_tokens=0),
              TokenChunk(tuple(ids[3:]), (0.0,) * (len(ids) - 3), segment="json", num_draft_tokens=5, draft_depth=3,
                         num_accepted_draft_tokens=len(ids) - 4),
              TokenChunk((eos,), (0.0,), segment="json")]
    job = GenerationJob(GenerateRequest("r", (2,), SamplingParams(), StoppingCriteria(max_tokens=32)),
                        eos_token_ids=frozenset({eos}), include_speculation=True)
    events = [*chunks, GenerateComplete(FinishReason.EOS_TOKEN, 1, len(ids) + 1)]
    deltas = [d async for d in generate_deltas(ScriptedClient(events), job, IncrementalDetokenizer(tokenizer, (2,)))]
    first = deltas[0]
    assert first.speculation.steps == tuple(StepInfo.of(c) for c in chunks)
    assert "".join(first.speculation.token_texts) == first.text == tokenizer.decode(ids)
    origins = [t["origin"] for t in first.speculation.to_json()["tokens"]]
    assert origins == ["model"] * 3 + ["draft"] * (len(ids) - 4) + ["model", "model"]
    assert first.speculation.token_texts[-1] == ""  # EOS has no text


def test_the_extension_is_the_chunks_last_field():
    speculation = Speculation(("a",), (StepInfo(1, 0, "", 0, 0),))
    chunk = json.loads(with_extension('{"id":"x","choices":[]}', speculation))
    assert chunk == {"id": "x", "choices": [], "segserve": speculation.to_json()}
    with pytest.raises(ValueError):
        with_extension("[]", speculation)
