"""POST /tokenize and /detokenize: the ids generation would use, vLLM's shapes, and clear 4xx for bad input.

Through real HTTP against the fake scheduler of test_router.py, which records the
prompt ids every generation request carries.
"""

from __future__ import annotations

import httpx
import pytest

from tests.router.test_server import MODEL, router_url, scheduler, tokenizer  # noqa: F401

USER = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi 東京"}]


def _post(router_url: str, path: str, body) -> httpx.Response:
    return httpx.post(f"{router_url}{path}", json=body, timeout=10)


@pytest.mark.parametrize("field, value, endpoint", [("prompt", "def add(a, b):", "/v1/completions"),
                                                    ("messages", USER, "/v1/chat/completions")])
def test_tokenize_gives_the_ids_generation_uses(router_url, scheduler, field, value, endpoint):
    fake, _ = scheduler
    answer = _post(router_url, "/tokenize", {"model": MODEL, field: value, "return_token_strs": True})
    assert answer.status_code == 200, answer.text
    tokens = answer.json()
    assert _post(router_url, endpoint, {"model": MODEL, field: value, "max_tokens": 1}).status_code == 200
    assert tokens["tokens"] == list(fake.requests[-1].prompt_token_ids)
    assert tokens["count"] == len(tokens["tokens"])
    assert tokens["max_model_len"] == httpx.get(f"{router_url}/v1/models").json()["data"][0]["max_model_len"]
    assert len(tokens["token_strs"]) == tokens["count"]
    assert ("def add(a, b):" if field == "prompt" else "Be brief.") in "".join(tokens["token_strs"])


def test_token_strs_only_when_asked(router_url):
    assert _post(router_url, "/tokenize", {"prompt": "x"}).json()["token_strs"] is None


def test_detokenize_inverts_tokenize(router_url, tokenizer):
    text = "Ü 東京 (a, b) 🙂"
    ids = tokenizer(text, add_special_tokens=False).input_ids
    answer = _post(router_url, "/detokenize", {"model": MODEL, "tokens": ids})
    assert answer.status_code == 200 and answer.json() == {"prompt": text}


@pytest.mark.parametrize("path, body, param, words", [
    ("/tokenize", {"prompt": "x", "messages": USER}, None, "exactly one of `prompt` and `messages`"),
    ("/tokenize", {}, None, "exactly one of `prompt` and `messages`"),
    ("/tokenize", {"prompt": ""}, "prompt", "at least 1 character"),
    ("/tokenize", {"prompt": 5}, "prompt", "valid string"),
    ("/tokenize", {"messages": [{"role": "wizard", "content": "x"}]}, "messages", "'system'"),
    ("/detokenize", {"tokens": [1, 99999999]}, "tokens", "outside the vocabulary"),
    ("/detokenize", {"tokens": [-1]}, "tokens", "outside the vocabulary"),
    ("/detokenize", {"tokens": ["a"]}, "tokens", "valid integer"),
    ("/detokenize", {"tokens": [1.5]}, "tokens", "valid integer"),
    ("/detokenize", "garbage", None, "JSON object"),
])  # fmt: skip
def test_bad_input_gets_a_400_naming_the_problem(router_url, path, body, param, words):
    answer = _post(router_url, path, body)
    assert answer.status_code == 400, answer.text
    error = answer.json()["error"]
    assert error["param"] == param and words in error["message"], error


@pytest.mark.parametrize("path, body", [("/tokenize", {"model": "nope", "prompt": "x"}),
                                        ("/detokenize", {"model": "nope", "tokens": [1]})])
def test_an_unknown_model_is_404(router_url, path, body):
    answer = _post(router_url, path, body)
    assert answer.status_code == 404 and answer.json()["error"]["code"] == "model_not_found"
