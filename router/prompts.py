"""Prompts to token ids, and the output budget they leave.

Completions prompts are tokenized with the tokenizer's default special tokens
(BOS for gemma); a list of token ids is taken as is. Chat messages go through
the model's chat template, which already writes the BOS token, so the templated
text is tokenized without adding special tokens again.

`output_budget` is the `max_tokens` every API edge (OpenAI, /v2, gRPC) puts in
its requests, computed once before it builds them; admission.check_request then
refuses a requested budget that the context cannot hold.
"""

from __future__ import annotations

from jinja2 import TemplateError

from router.errors import bad_request


def completion_prompt_ids(tokenizer, prompt: str | list[int]) -> list[int]:
    """A list of token ids is taken as is (the contract's validate_request checks them against the vocabulary)."""
    if isinstance(prompt, list):
        return list(prompt)
    ids = list(tokenizer(prompt).input_ids)
    if not ids:
        raise bad_request("the prompt tokenizes to no tokens", "prompt")
    return ids


def chat_prompt_ids(tokenizer, messages: list[dict], tools: list[dict] | None = None) -> list[int]:
    """The templated messages' ids; `tools` (OpenAI's function definitions) are the template's `tools`."""
    if not getattr(tokenizer, "chat_template", None):
        raise bad_request("this model has no chat template; use /v1/completions", "messages")
    try:
        text = tokenizer.apply_chat_template(messages, tools=tools, add_generation_prompt=True, tokenize=False)
    except TemplateError as exc:
        raise bad_request(f"the chat template rejected the messages: {exc}", "messages") from exc
    ids = list(tokenizer(text, add_special_tokens=False).input_ids)
    if not ids:
        raise bad_request("the messages tokenize to no tokens", "messages")
    return ids


def output_budget(requested: int | None, num_prompt_tokens: int, max_model_len: int, default: int) -> int:
    """The request's max tokens as the client sent it, else the API's `default` cut to the context the prompt
    leaves. Unchecked: the contract's ranges and the room left are admission.check_request's."""
    if requested is not None:
        return requested
    return min(default, max_model_len - num_prompt_tokens)
