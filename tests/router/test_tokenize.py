"""POST /tokenize, /detokenize and GET /tokenizer_info: the ids generation would use, vLLM's shapes and
defaults, and clear 4xx for bad input.

Through real HTTP against the fake scheduler of test_router.py, which records the
prompt ids every generation request carries. A second router on the same fake
serves a tokenizer that adds <bos> to what it tokenizes with special tokens (as
gemma's does), for `add_special_tokens` and the text that starts with "<bos>".
"""

from __future__ import annotations

import httpx
import pytest
from transformers import AutoTokenizer

from common.ports import free_port
from router.config import RouterConfig
from router.prompts import encode_text
from tests.router.test_server import MODEL, router_url, scheduler, tokenizer  # noqa: F401
from tests.support.router_server import serve_router
from tests.support.tiny_models import CHAT_TEMPLATE, build_tokenizer

USER = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi 東京"}]
PREFILLED = [{"role": "user", "content": "Count:"}, {"role": "assistant", "content": "one, two,"}]


@pytest.fixture(scope="module")
def bos_tokenizer(tmp_path_factory):
    folder = tmp_path_factory.mktemp("bos-tokenizer")
    build_tokenizer(folder, is_bos_added=True)
    return AutoTokenizer.from_pretrained(str(folder))


@pytest.fixture(scope="module")
def bos_url(scheduler, tiny_gemma3_dir, bos_tokenizer):  # noqa: F811
    _, grpc_port = scheduler
    config = RouterConfig(model=str(tiny_gemma3_dir), scheduler_address=f"127.0.0.1:{grpc_port}", port=free_port(),
                          scheduler_wait_s=10)
    with serve_router(config, tokenizer=bos_tokenizer) as url:
        yield url


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


def _ids(url: str, **body) -> list[int]:
    answer = _post(url, "/tokenize", body)
    assert answer.status_code == 200, answer.text
    return answer.json()["tokens"]


def test_add_special_tokens_defaults_as_vllms(bos_url, bos_tokenizer):
    bos, text = bos_tokenizer.bos_token_id, "def add(a, b):"
    plain = bos_tokenizer(text, add_special_tokens=False).input_ids
    assert _ids(bos_url, prompt=text) == [bos, *plain], "a prompt gets the tokenizer's special tokens"
    assert _ids(bos_url, prompt=text, add_special_tokens=False) == plain
    templated = bos_tokenizer.apply_chat_template(USER, add_generation_prompt=True, tokenize=False)
    assert templated.startswith("<bos>")
    assert _ids(bos_url, messages=USER) == bos_tokenizer(templated, add_special_tokens=False).input_ids
    assert _ids(bos_url, messages=USER, add_special_tokens=True) == _ids(bos_url, messages=USER), \
        "the template wrote the BOS: none is added in front of it"


@pytest.mark.parametrize("add_special_tokens", [True, False])
def test_a_text_that_starts_with_the_bos_text_gets_one_bos(bos_url, bos_tokenizer, add_special_tokens):
    """As lm-evaluation-harness's hf model tokenizes it, and as its remote tokenizer's prompts need."""
    bos = bos_tokenizer.bos_token_id
    ids = _ids(bos_url, prompt="<bos>Question:", add_special_tokens=add_special_tokens)
    assert ids == bos_tokenizer("<bos>Question:", add_special_tokens=False).input_ids and ids.count(bos) == 1
    assert _ids(bos_url, prompt="<bos>", add_special_tokens=add_special_tokens) == [bos]


def test_a_texts_own_bos_tokens_all_stay(bos_tokenizer, tokenizer):  # noqa: F811
    for tok in (bos_tokenizer, tokenizer):  # one that adds a BOS, one that does not
        bos = tok.bos_token_id
        assert encode_text(tok, "<bos><bos>x", add_special_tokens=True)[:3] == [bos, bos, tok("x").input_ids[-1]]
    assert encode_text(bos_tokenizer, "x<bos>", add_special_tokens=True)[0] == bos_tokenizer.bos_token_id


def test_generation_uses_what_tokenize_gives(bos_url, scheduler, bos_tokenizer):
    fake, _ = scheduler
    for body in ({"prompt": "<bos>Hi"}, {"prompt": "Hi", "add_special_tokens": False}, {"prompt": "Hi"}):
        answer = _post(bos_url, "/v1/completions", {"model": MODEL, "max_tokens": 1, **body})
        assert answer.status_code == 200, answer.text
        assert list(fake.requests[-1].prompt_token_ids) == _ids(bos_url, **body)
    assert _ids(bos_url, prompt="<bos>Hi") == _ids(bos_url, prompt="Hi") == [bos_tokenizer.bos_token_id,
                                                                              *bos_tokenizer("Hi").input_ids[1:]]
    for options in ({}, {"add_generation_prompt": False}, {"add_special_tokens": True},
                    {"chat_template_kwargs": {"bos_token": "<eos>"}}):
        answer = _post(bos_url, "/v1/chat/completions", {"model": MODEL, "messages": USER, "max_tokens": 1, **options})
        assert answer.status_code == 200, answer.text
        assert list(fake.requests[-1].prompt_token_ids) == _ids(bos_url, messages=USER, **options), options


def test_chat_template_options_reach_the_template(router_url, tokenizer):  # noqa: F811
    def text(**body) -> str:
        return tokenizer.decode(_ids(router_url, **body))

    assert text(messages=USER).endswith("<|assistant|>\n")
    assert text(messages=USER, add_generation_prompt=False).endswith("Hi 東京<|end|>\n")
    continued = text(messages=PREFILLED, add_generation_prompt=False, continue_final_message=True)
    assert continued.endswith("<|assistant|>\none, two,"), continued
    assert text(messages=USER, chat_template_kwargs={"bos_token": "<eos>"}).startswith("<eos><|system|>")
    assert text(messages=USER, chat_template_kwargs={"add_generation_prompt": False}) == text(messages=USER), \
        "the field, not the kwargs, says whether to add the generation prompt (as vLLM)"
    assert CHAT_TEMPLATE == tokenizer.chat_template


def test_tokenize_takes_the_tools_chat_completions_would_send(router_url, scheduler):
    fake, _ = scheduler
    tools = [{"type": "function", "function": {"name": "get_time", "parameters": {"type": "object"}}}]
    body = {"messages": USER, "tools": tools}
    answer = _post(router_url, "/v1/chat/completions", {"model": MODEL, "tool_choice": "none", "max_tokens": 1,
                                                        **body})
    assert answer.status_code == 200, answer.text
    assert _ids(router_url, **body) == list(fake.requests[-1].prompt_token_ids)


@pytest.mark.parametrize("path", ["/tokenize", "/v1/chat/completions"])
@pytest.mark.parametrize("options, param, words", [
    ({"continue_final_message": True}, "continue_final_message", "`add_generation_prompt`: false"),
    ({"chat_template_kwargs": {"tokenize": True}}, "chat_template_kwargs", "may not set `tokenize`"),
    ({"chat_template_kwargs": {"messages": []}}, "chat_template_kwargs", "may not set `messages`"),
    ({"chat_template_kwargs": ["x"]}, "chat_template_kwargs", "valid dictionary"),
    ({"chat_template": "{{ messages }}"}, "chat_template", "not accepted"),
    ({"add_generation_prompt": "yes"}, "add_generation_prompt", "valid boolean"),
    ({"add_special_tokens": 1}, "add_special_tokens", "valid boolean"),
])  # fmt: skip
def test_bad_chat_template_options_are_a_400_naming_them(router_url, scheduler, path, options, param, words):
    fake, _ = scheduler
    num_sent = len(fake.requests)
    answer = _post(router_url, path, {"model": MODEL, "messages": PREFILLED, **options})
    assert answer.status_code == 400, answer.text
    error = answer.json()["error"]
    assert error["param"] == param and words in error["message"], error
    assert len(fake.requests) == num_sent


def test_tokenizer_info_is_vllms(router_url, tokenizer):  # noqa: F811
    answer = httpx.get(f"{router_url}/tokenizer_info", timeout=10)
    assert answer.status_code == 200, answer.text
    info = answer.json()
    assert info["tokenizer_class"] == type(tokenizer).__name__
    assert (info["bos_token"], info["eos_token"], info["pad_token"]) == ("<bos>", "<eos>", "<pad>")
    assert info["chat_template"] == tokenizer.chat_template
    assert info["added_tokens_decoder"]["1"] == "<bos>"
    assert not {"name_or_path", "vocab_file", "merges_file", "tokenizer_file"} & set(info), "no server paths"


def test_tokenizer_info_wants_the_api_key(scheduler, tiny_gemma3_dir):  # noqa: F811
    _, grpc_port = scheduler
    config = RouterConfig(model=str(tiny_gemma3_dir), scheduler_address=f"127.0.0.1:{grpc_port}", port=free_port(),
                          scheduler_wait_s=10, api_keys=["k1"])
    with serve_router(config) as url:
        assert httpx.get(f"{url}/tokenizer_info", timeout=10).status_code == 401
        keyed = httpx.get(f"{url}/tokenizer_info", headers={"Authorization": "Bearer k1"}, timeout=10)
        assert keyed.status_code == 200 and keyed.json()["eos_token"] == "<eos>"
