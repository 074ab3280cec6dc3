"""/v1/completions' `echo`, `logprobs` and vLLM's `prompt_logprobs`, field by field as vLLM answers them.

Through real HTTP against the fake scheduler of test_server.py: it gives prompt
token p the logprob prompt_logprob(p) and, when asked for k alternatives, the
token itself and the k - 1 ids after it (logprobs 0, -1, ...); its generated tokens
are OUTPUT_TEXT's, each with TOP_LOGPROB. Token-id prompts (one list, or a list of
lists) are echoed as their decoded text, special tokens included.
"""

from __future__ import annotations

import itertools
import json

import httpx
import pytest

from tests.support.fake_scheduler import TOP_LOGPROB, prompt_logprob
from tests.router.test_server import MODEL, router_url, scheduler, tokenizer  # noqa: F401

IDS = [1, 43, 72, 79, 79, 82]  # <bos> and the ids of "Hello" in the tiny tokenizer


def _post(router_url: str, **body) -> httpx.Response:
    return httpx.post(f"{router_url}/v1/completions", json={"model": MODEL, **body}, timeout=10)


def _completion(router_url: str, **body) -> dict:
    answer = _post(router_url, **body)
    assert answer.status_code == 200, answer.text
    return answer.json()


def _texts(tokenizer, ids) -> list[str]:
    return [tokenizer.decode([token]) for token in ids]


def _assert_legacy_logprobs(lp: dict, tokens: list[str], num_logprobs: int) -> None:
    """vLLM's shape: a null first entry, then each token first in its own top dict (logprobs + 1 entries at
    most, the token's value its own logprob), and text offsets adding up the tokens' texts from 0."""
    assert lp["tokens"] == tokens
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    for token, logprob, top in zip(tokens[1:], lp["token_logprobs"][1:], lp["top_logprobs"][1:], strict=True):
        assert next(iter(top)) == token and top[token] == logprob and 1 <= len(top) <= num_logprobs + 1, top
    assert lp["text_offset"] == list(itertools.accumulate((len(t) for t in tokens[:-1]), initial=0))


@pytest.mark.parametrize("prompt", [IDS, [IDS]])
@pytest.mark.parametrize("num_logprobs", [0, 2])
def test_a_token_id_prompt_is_echoed_with_its_logprobs(router_url, scheduler, tokenizer, prompt, num_logprobs):
    fake, _ = scheduler
    out = _completion(router_url, prompt=prompt, max_tokens=2, temperature=0, echo=True, logprobs=num_logprobs)
    assert list(fake.requests[-1].prompt_token_ids) == IDS, "token ids are taken as they are"
    generated = fake.output_ids[:2]
    choice = out["choices"][0]
    assert choice["text"] == tokenizer.decode(IDS) + tokenizer.decode(generated)
    assert choice["text"].startswith("<bos>Hello")
    lp = choice["logprobs"]
    _assert_legacy_logprobs(lp, _texts(tokenizer, IDS + generated), num_logprobs)
    assert lp["token_logprobs"][1:len(IDS)] == pytest.approx([prompt_logprob(p) for p in range(1, len(IDS))])
    assert lp["token_logprobs"][len(IDS):] == [TOP_LOGPROB] * 2
    if num_logprobs == 0:
        assert all(len(top) == 1 for top in lp["top_logprobs"][1:]), "logprobs 0: the token alone"
    assert choice["prompt_logprobs"] is not None, "vLLM lists the prompt's logprobs it computed for echo"
    assert out["usage"] == {"prompt_tokens": len(IDS), "completion_tokens": 2, "total_tokens": len(IDS) + 2,
                            "prompt_tokens_details": {"cached_tokens": 0}}


def test_several_token_id_prompts_each_echo_their_own(router_url, tokenizer):
    prompts = [IDS, IDS[1:4]]
    out = _completion(router_url, prompt=prompts, max_tokens=1, temperature=0, echo=True, logprobs=1, n=2)
    assert [c["index"] for c in out["choices"]] == [0, 1, 2, 3]
    for choice in out["choices"]:
        ids = prompts[choice["index"] // 2]
        assert choice["text"].startswith(tokenizer.decode(ids))
        assert choice["logprobs"]["tokens"][:len(ids)] == _texts(tokenizer, ids)
        assert choice["logprobs"]["token_logprobs"][0] is None and choice["logprobs"]["token_logprobs"][1] is not None


def test_prompt_logprobs_are_listed_by_token_id(router_url, scheduler, tokenizer):
    fake, _ = scheduler
    out = _completion(router_url, prompt=IDS, max_tokens=2, temperature=0, prompt_logprobs=2)
    assert fake.requests[-1].sampling.num_prompt_logprobs == 2
    choice = out["choices"][0]
    assert choice["logprobs"] is None and choice["text"] == tokenizer.decode(fake.output_ids[:2]), "no echo"
    listed = choice["prompt_logprobs"]
    assert len(listed) == len(IDS) and listed[0] is None
    for position, entry in enumerate(listed[1:], 1):
        token = IDS[position]
        assert list(entry)[0] == str(token), "the prompt token first, then its alternatives"
        assert entry[str(token)] == {"logprob": pytest.approx(prompt_logprob(position)), "rank": 1,
                                     "decoded_token": tokenizer.decode([token])}
        assert len(entry) == 2 and entry[str(token + 1)]["rank"] == 2


def test_prompt_logprobs_are_not_listed_unless_asked(router_url):
    choice = _completion(router_url, prompt=IDS, max_tokens=2, temperature=0)["choices"][0]
    assert choice["prompt_logprobs"] is None


def test_echo_of_max_tokens_0_is_the_prompt_alone(router_url, scheduler, tokenizer):
    fake, _ = scheduler
    out = _completion(router_url, prompt=IDS, max_tokens=0, echo=True, logprobs=1)
    assert fake.requests[-1].stopping.max_tokens == 1, "one token is generated to get the prompt's logprobs"
    choice = out["choices"][0]
    assert choice["text"] == tokenizer.decode(IDS) and choice["finish_reason"] == "length"
    _assert_legacy_logprobs(choice["logprobs"], _texts(tokenizer, IDS), 1)
    body = {"model": MODEL, "prompt": IDS, "max_tokens": 0, "echo": True, "logprobs": 1, "stream": True}
    events = httpx.post(f"{router_url}/v1/completions", json=body, timeout=10).text.split("\n\n")
    chunks = [json.loads(e.removeprefix("data: "))["choices"][0] for e in events if e.startswith("data: {")]
    assert "".join(c["text"] for c in chunks) == tokenizer.decode(IDS)
    assert [t for c in chunks if c["logprobs"] for t in c["logprobs"]["tokens"]] == _texts(tokenizer, IDS)
    assert chunks[-1]["finish_reason"] == "length"


def test_streamed_echo_offsets_go_on_across_chunks(router_url, tokenizer):
    body = {"model": MODEL, "prompt": [IDS], "max_tokens": 6, "temperature": 0, "echo": True, "logprobs": 1,
            "stream": True, "stream_options": {"include_usage": True}}
    events = httpx.post(f"{router_url}/v1/completions", json=body, timeout=10).text.split("\n\n")
    chunks = [json.loads(e.removeprefix("data: ")) for e in events if e.startswith("data: {")]
    merged = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    for chunk in chunks[:-1]:
        for key, values in chunk["choices"][0]["logprobs"].items():
            merged[key] += values
        assert "prompt_logprobs" not in chunk["choices"][0], "vLLM's stream choices have no prompt_logprobs"
    _assert_legacy_logprobs(merged, merged["tokens"], 1)
    assert merged["tokens"][:len(IDS)] == _texts(tokenizer, IDS) and len(merged["tokens"]) == len(IDS) + 6
    assert chunks[-1]["usage"]["prompt_tokens_details"] == {"cached_tokens": 0}


@pytest.mark.parametrize("body, words", [
    ({"prompt_logprobs": 1, "stream": True}, "not available when `stream`"),
    ({"prompt_logprobs": 21}, "`prompt_logprobs` must be in"),
    ({"prompt_logprobs": -1}, "`prompt_logprobs` must be in"),
    ({"prompt_logprobs": "2"}, "valid integer"),
])  # fmt: skip
def test_bad_prompt_logprobs_are_a_400_naming_them(router_url, scheduler, body, words):
    fake, _ = scheduler
    num_sent = len(fake.requests)
    answer = _post(router_url, prompt=IDS, max_tokens=1, **body)
    assert answer.status_code == 400, answer.text
    error = answer.json()["error"]
    assert error["param"] == "prompt_logprobs" and words in error["message"], error
    assert len(fake.requests) == num_sent


def test_prompt_logprobs_0_may_be_streamed(router_url):
    body = {"model": MODEL, "prompt": IDS, "max_tokens": 2, "prompt_logprobs": 0, "stream": True}
    answer = httpx.post(f"{router_url}/v1/completions", json=body, timeout=10)
    assert answer.status_code == 200 and answer.text.rstrip().endswith("data: [DONE]")
