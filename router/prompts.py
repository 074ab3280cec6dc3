"""Prompts to token ids, and the output budget they leave.

Completions prompts are tokenized with the tokenizer's special tokens unless the
body's `add_special_tokens` is false (vLLM's extension; BOS for gemma); a list of
token ids is taken as is. Chat messages go through the model's chat template
(`ChatTemplateOptions`: vLLM's add_generation_prompt, continue_final_message,
chat_template_kwargs), which already writes the BOS token, so the templated text
is tokenized without special tokens unless the body asks for them. Either way a
text that already begins with the BOS token's text ("<bos>Question: ...") keeps
that one BOS and gets no second (`encode_text`): lm-evaluation-harness's `hf`
model tokenizes such a text so, and its remote-tokenizer clients send exactly
such texts; vLLM would add a second BOS in front.

`output_budget` is the `max_tokens` every API edge (OpenAI, /v2, gRPC) puts in
its requests, computed once before it builds them; admission.check_request then
refuses a requested budget that the context cannot hold.
"""

from __future__ import annotations

import functools
import inspect
from typing import Any

from jinja2 import TemplateError
from pydantic import BaseModel, ConfigDict, ValidationInfo, field_validator

from router.errors import bad_request

_TEMPLATE_FLAGS = frozenset({"add_generation_prompt", "continue_final_message"})


class ChatTemplateOptions(BaseModel):
    """How a chat body's messages become its prompt, as vLLM takes them (chat completions, /tokenize with
    `messages`)."""

    model_config = ConfigDict(extra="ignore", strict=True)

    add_generation_prompt: bool = True
    """End the prompt with the template's opening of an assistant turn."""
    continue_final_message: bool = False
    """Leave the last message open for the model to continue (a prefilled assistant turn); needs
    `add_generation_prompt` false."""
    add_special_tokens: bool = False
    """Also add the tokenizer's special tokens to the templated text (which writes its BOS already)."""
    chat_template_kwargs: dict[str, Any] | None = None
    """More variables for the chat template (e.g. `enable_thinking`); `add_generation_prompt` and
    `continue_final_message` are the fields' own."""
    chat_template: str | None = None
    """A request's own template: refused, as vLLM does unless its server trusts request templates."""

    @field_validator("continue_final_message")
    @classmethod
    def _one_ending(cls, is_continued: bool, info: ValidationInfo) -> bool:
        if is_continued and info.data.get("add_generation_prompt"):
            raise ValueError("cannot continue the final message and add a generation prompt: send "
                             "`add_generation_prompt`: false with `continue_final_message`: true")
        return is_continued

    @field_validator("chat_template")
    @classmethod
    def _no_request_template(cls, template: str | None) -> str | None:
        if template is not None:
            raise ValueError("a request's own chat template is not accepted; the model's template is used")
        return template

    def template_kwargs(self, tokenizer) -> dict[str, Any]:
        """apply_chat_template's keyword arguments beyond the messages and tools; a 400 naming
        `chat_template_kwargs` for a name that is one of apply_chat_template's own parameters."""
        extra = {k: v for k, v in (self.chat_template_kwargs or {}).items() if k not in _TEMPLATE_FLAGS}
        reserved = sorted(set(extra) & _reserved_names(type(tokenizer)))
        if reserved:
            raise bad_request(f"Invalid request: `chat_template_kwargs` may not set `{reserved[0]}`, which is the "
                              f"server's argument to the template, not a template variable", "chat_template_kwargs")
        return {**extra, "add_generation_prompt": self.add_generation_prompt,
                "continue_final_message": self.continue_final_message}


DEFAULT_CHAT_OPTIONS = ChatTemplateOptions()


@functools.cache
def _reserved_names(tokenizer_type: type) -> frozenset[str]:
    """The names chat_template_kwargs may not set: apply_chat_template's own parameters (and `messages`, which
    the template gets from the conversation), less the two flags the options set."""
    parameters = inspect.signature(tokenizer_type.apply_chat_template).parameters
    names = {name for name, p in parameters.items() if p.kind not in (p.VAR_KEYWORD, p.VAR_POSITIONAL)}
    return frozenset(names - {"self"} - _TEMPLATE_FLAGS | {"messages"})


def encode_text(tokenizer, text: str, add_special_tokens: bool) -> list[int]:
    """`text`'s ids, with the tokenizer's special tokens when `add_special_tokens`, except a second BOS: when
    the tokenizer puts a BOS before a text whose own first token is the BOS, that added one is left out."""
    ids = list(tokenizer(text, add_special_tokens=add_special_tokens).input_ids)
    bos, bos_id = getattr(tokenizer, "bos_token", None), getattr(tokenizer, "bos_token_id", None)
    if not (add_special_tokens and bos and bos_id is not None and text.startswith(bos) and ids[:2] == [bos_id] * 2):
        return ids
    own = list(tokenizer(text, add_special_tokens=False).input_ids)
    return ids[1:] if own[:1] == [bos_id] and ids[1:len(own) + 1] == own else ids


def completion_prompt_ids(tokenizer, prompt: str | list[int], add_special_tokens: bool = True) -> list[int]:
    """A list of token ids is taken as is (the contract's validate_request checks them against the vocabulary)."""
    if isinstance(prompt, list):
        return list(prompt)
    ids = encode_text(tokenizer, prompt, add_special_tokens)
    if not ids:
        raise bad_request("the prompt tokenizes to no tokens", "prompt")
    return ids


def chat_prompt_ids(tokenizer, messages: list[dict], tools: list[dict] | None = None,
                    options: ChatTemplateOptions = DEFAULT_CHAT_OPTIONS) -> list[int]:
    """The templated messages' ids; `tools` (OpenAI's function definitions) are the template's `tools`."""
    if not getattr(tokenizer, "chat_template", None):
        raise bad_request("this model has no chat template; use /v1/completions", "messages")
    kwargs = options.template_kwargs(tokenizer)
    try:
        text = tokenizer.apply_chat_template(messages, tools=tools, tokenize=False, **kwargs)
    except (TemplateError, ValueError, TypeError) as exc:  # the template's refusals, and transformers' own checks
        raise bad_request(f"the chat template rejected the messages: {exc}", "messages") from exc
    ids = encode_text(tokenizer, text, options.add_special_tokens)
    if not ids:
        raise bad_request("the messages tokenize to no tokens", "messages")
    return ids


def output_budget(requested: int | None, num_prompt_tokens: int, max_model_len: int, default: int) -> int:
    """The request's max tokens as the client sent it, else the API's `default` cut to the context the prompt
    leaves. Unchecked: the contract's ranges and the room left are admission.check_request's."""
    if requested is not None:
        return requested
    return min(default, max_model_len - num_prompt_tokens)
