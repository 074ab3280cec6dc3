"""POST /tokenize, POST /detokenize and GET /tokenizer_info, in vLLM's shapes, for clients that count, inspect or
do their own tokenization (lm-evaluation-harness's remote tokenizer uses all three).

/tokenize takes a completion `prompt` or chat `messages` (exactly one) and
tokenizes them as generation would (prompts.py), with vLLM's defaults:
`add_special_tokens` true for a prompt and false for messages, whose template
options (`add_generation_prompt`, `continue_final_message`,
`chat_template_kwargs`) and `tools` are chat completions'. So `count` is what a
request with the same input is charged against `max_model_len`. /detokenize
turns token ids back into text. /tokenizer_info is the tokenizer's configuration
(its init kwargs, special tokens as their text, the chat template) and class
name, without the server's file paths. All three want the API key as /v1 does
(router/guard.py).
"""

from __future__ import annotations

import math
from typing import Any

from fastapi import APIRouter
from pydantic import BaseModel, ConfigDict, Field, model_validator

from router.prompts import ChatTemplateOptions, chat_prompt_ids, completion_prompt_ids
from router.protocol import ChatMessage, template_messages
from router.state import StateDep
from router.tools import Tool, template_tools

router = APIRouter()

_PATH_KEYS = frozenset({"vocab_file", "merges_file", "tokenizer_file", "name_or_path"})
"""Init kwargs that are the server's file paths, left out of /tokenizer_info."""


class TokenizeRequest(ChatTemplateOptions):
    model_config = ConfigDict(extra="ignore", strict=True)

    model: str | None = None
    prompt: str | None = Field(default=None, min_length=1)
    messages: list[ChatMessage] | None = Field(default=None, min_length=1)
    tools: list[Tool] | None = None
    """With `messages`: the functions the chat template is given, as in chat completions."""
    add_special_tokens: bool | None = None
    """Add the tokenizer's special tokens (BOS); default true for `prompt`, false for `messages`."""
    return_token_strs: bool = False
    """Also return each token's text."""

    @model_validator(mode="after")
    def _one_input(self) -> TokenizeRequest:
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("set exactly one of `prompt` and `messages`")
        return self


class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)

    model: str | None = None
    tokens: list[int]


class DetokenizeResponse(BaseModel):
    prompt: str


class TokenizerInfoResponse(BaseModel):
    """The tokenizer's configuration, as tokenizer_config.json has it, and its class."""

    model_config = ConfigDict(extra="allow")

    tokenizer_class: str


@router.post("/tokenize")
async def tokenize(body: TokenizeRequest, state: StateDep) -> TokenizeResponse:
    state.check_model(body.model)
    if body.messages is not None:
        options = body.model_copy(update={"add_special_tokens": bool(body.add_special_tokens)})
        ids = chat_prompt_ids(state.tokenizer, template_messages(body.messages), template_tools(body.tools), options)
    else:
        ids = completion_prompt_ids(state.tokenizer, body.prompt, body.add_special_tokens is not False)
    strs = [state.token_texts.get(token)[0] for token in ids] if body.return_token_strs else None
    return TokenizeResponse(count=len(ids), max_model_len=state.model_info.max_model_len, tokens=ids, token_strs=strs)


@router.post("/detokenize")
async def detokenize(body: DetokenizeRequest, state: StateDep) -> DetokenizeResponse:
    state.check_model(body.model)
    return DetokenizeResponse(prompt=state.decode(body.tokens, "tokens"))


@router.get("/tokenizer_info")
async def tokenizer_info(state: StateDep) -> TokenizerInfoResponse:
    return TokenizerInfoResponse(**describe_tokenizer(state.tokenizer))


def describe_tokenizer(tokenizer) -> dict[str, Any]:
    """vLLM's tokenizer info: the tokenizer's init kwargs (file paths left out, special tokens as their text),
    `tokenizer_class`, and the chat template the router applies."""
    init_kwargs = getattr(tokenizer, "init_kwargs", None) or {}
    info = {key: _json_value(value) for key, value in init_kwargs.items() if key not in _PATH_KEYS}
    info["tokenizer_class"] = type(tokenizer).__name__
    if isinstance(chat_template := getattr(tokenizer, "chat_template", None), str):
        info["chat_template"] = chat_template
    return info


def _json_value(value: Any) -> Any:
    """`value` as JSON can carry it: a special token (an AddedToken) as its text, anything unknown as its str."""
    if hasattr(value, "content"):
        return value.content
    if isinstance(value, dict):
        return {str(key): _json_value(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [_json_value(item) for item in value]
    if isinstance(value, float) and not math.isfinite(value):
        return None  # JSON has no infinity
    if value is None or isinstance(value, (str, int, float, bool)):
        return value
    return str(value)
