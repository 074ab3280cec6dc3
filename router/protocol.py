"""OpenAI request bodies for /v1/completions and /v1/chat/completions (pydantic), and their contract.

The bodies check types, strictly as OpenAI does (`true` is not 1, `"5"` not 5,
`5.0` not an integer), and the API's own rules (n, stop strings, best_of, the
legacy completions' 5 logprobs, chat's top_logprobs needing logprobs). They do
not own the value ranges of the sampling contract's fields: `to_sampling` maps a
body onto the contract (protos/segserve/v1/sampling.py) and admission.py's
`check_request` runs the contract's validator on it, naming the field in
OpenAI's words (`api_names`). The OpenAPI document shows the same ranges,
generated from `sampling.RANGES` (admission.bounds). Unknown fields are ignored,
as OpenAI clients send extras, and null is accepted wherever OpenAI's default
would do (clients send `"n": 1, "logprobs": null, "stop": null, ...`).

Mapping at the edge (and nothing else): the body's sampling fields become an
`AskedSampling` (router/sampling.py: one greedy rule and one seed per choice for
every API; OpenAI's bodies sample by default); top_k -1 is off (vLLM's);
logit_bias keys are token ids written as strings; `logprobs` / `top_logprobs`
become num_top_logprobs and, with `echo`, num_prompt_logprobs (vLLM's
`prompt_logprobs` sets it itself); `echo` with `max_tokens` 0 asks for one
token, which the answer leaves out (the prompt alone, as vLLM answers it).
top_k, typical_p, repetition_penalty, ignore_eos, add_special_tokens and the chat
template's options (prompts.ChatTemplateOptions) are extensions, as in vLLM.
Stop strings are applied by the router (stop.py), the n choices are n scheduler
requests (choices.py). A structured output (`response_format` json_object /
json_schema, vLLM's `structured_outputs` or `guided_*`; one of them per request)
becomes the contract's `structured_output` of every choice (structured.py, which
also checks at the edge that it compiles), as does a `tool_choice` that forces a
call (tools.py). What segserve does not do is refused, not ignored: a
`structural_tag`.
"""

from __future__ import annotations

import re
from functools import cached_property
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator

from protos.segserve.v1.sampling import MAX_LOGIT_BIAS_ENTRIES, SamplingParams, StructuredOutput
from router.admission import bounds
from router.choices import MAX_CHOICES, MAX_GENERATIONS
from router.prompts import ChatTemplateOptions
from router.sampling import MIN_SEED, AskedSampling, sampling_params
from router.structured import (
    STRUCTURED_FIELDS,
    ResponseFormat,
    StructuredOutputsParams,
    guided_structure,
    is_requested,
    schema_object,
)
from router.tools import (
    CallIn,
    Tool,
    ToolChoice,
    check_tools,
    forced_output,
    template_calls,
    tool_mode,
)

MAX_COMPLETION_LOGPROBS = 5  # the legacy completions API's limit
MAX_STOP_STRINGS = 4
_TOKEN_ID_KEY = re.compile(r"-?[0-9]{1,40}")
_LOGIT_BIAS_SCHEMA = {
    "propertyNames": {"pattern": "^[0-9]+$"}, "maxProperties": MAX_LOGIT_BIAS_ENTRIES,
    "additionalProperties": {"type": "number", **bounds("logit_bias")},
}


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)

    include_usage: bool | None = False
    """Send a last chunk with token usage before [DONE]."""
    include_speculation: bool | None = False
    """segserve's extension: every chunk gets a `segserve` object saying how each token came about (accepted
    draft or the model's own), in which segment kind, and the size and depth of each step's candidate tree
    (router/speculation.py)."""


def _bounded(field: str, **changes: float | None):
    """A body field documented with the contract's range (checked by the contract, not here)."""
    return Field(default=None, json_schema_extra=bounds(field, **changes))


class SamplingRequest(BaseModel):
    """Fields both endpoints share."""

    model_config = ConfigDict(extra="ignore", strict=True)

    model: str | None = None
    max_tokens: int | None = _bounded("max_tokens")
    max_completion_tokens: int | None = _bounded("max_tokens")
    temperature: float | None = _bounded("temperature", exclusiveMinimum=None, minimum=0.0)
    top_p: float | None = _bounded("top_p")
    top_k: int | None = _bounded("top_k", minimum=-1)
    """-1 or 0 = off."""
    typical_p: float | None = _bounded("typical_p")
    repetition_penalty: float | None = _bounded("repetition_penalty")
    frequency_penalty: float | None = _bounded("frequency_penalty")
    presence_penalty: float | None = _bounded("presence_penalty")
    seed: int | None = _bounded("seed", minimum=MIN_SEED)
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    n: int | None = Field(default=1, ge=1, le=MAX_CHOICES)
    """Independent choices of the same prompt (greedy ones are identical)."""
    stop: str | list[str] | None = None
    """Up to 4 strings; the output ends before the first one, which is not returned."""
    logit_bias: dict[str, float] | None = Field(default=None, json_schema_extra=_LOGIT_BIAS_SCHEMA)
    """Token id (as a string) -> bias added to its logit, in [-100, 100]."""
    ignore_eos: bool = False
    user: str | None = None
    response_format: ResponseFormat | None = None
    """`text` (the default), `json_object` or `json_schema`: the output is constrained to match."""
    structured_outputs: StructuredOutputsParams | None = None
    """vLLM's extension: one of `json` (a schema), `regex`, `choice`, `grammar`, `json_object`."""
    guided_json: dict[str, Any] | str | None = None
    """vLLM's older spelling of structured_outputs.json (and so on for the three below)."""
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None

    @field_validator("stop")
    @classmethod
    def _check_stop(cls, stop: str | list[str] | None) -> str | list[str] | None:
        stops = [stop] if isinstance(stop, str) else stop or []
        if len(stops) > MAX_STOP_STRINGS:
            raise ValueError(f"at most {MAX_STOP_STRINGS} stop strings are allowed (got {len(stops)})")
        if not all(stops):
            raise ValueError("stop strings must not be empty")
        return stop

    @field_validator("guided_json", mode="before")
    @classmethod
    def _guided_schema(cls, schema: object) -> object:
        return None if schema is None else schema_object(schema)

    @field_validator(*STRUCTURED_FIELDS[1:])
    @classmethod
    def _one_structured_output(cls, value: object, info: ValidationInfo) -> object:
        earlier = [name for name in STRUCTURED_FIELDS if is_requested(info.data.get(name))]  # fields before this one
        if value is not None and earlier:
            raise ValueError(f"give one structured output per request, not both `{earlier[0]}` and "
                             f"`{info.field_name}`")
        return value

    @field_validator("logit_bias")
    @classmethod
    def _token_id_keys(cls, logit_bias: dict[str, float] | None) -> dict[str, float] | None:
        for key in logit_bias or {}:
            if not _TOKEN_ID_KEY.fullmatch(key):
                raise ValueError(f"keys must be token ids written as decimal strings (got {key[:40]!r})")
        return logit_bias

    @cached_property
    def structured_request(self) -> tuple[str, StructuredOutput] | None:
        """(the body field that asked for it, the contract's structured output); None = unconstrained."""
        return self.asked_structure()

    def asked_structure(self) -> tuple[str, StructuredOutput] | None:
        """structured_request, uncached."""
        if self.response_format is not None and (structured := self.response_format.to_structured()):
            return "response_format", structured
        if self.structured_outputs is not None:
            return "structured_outputs", self.structured_outputs.to_structured()
        for name in STRUCTURED_FIELDS[2:]:
            if (value := getattr(self, name)) is not None:
                return name, guided_structure(name, value)
        return None

    @property
    def num_choices(self) -> int:
        return self.n or 1

    @property
    def stop_strings(self) -> list[str]:
        return [self.stop] if isinstance(self.stop, str) else list(self.stop or [])

    @property
    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    @property
    def include_usage(self) -> bool:
        return bool(self.stream and self.stream_options and self.stream_options.include_usage)

    @property
    def include_speculation(self) -> bool:
        return bool(self.stream and self.stream_options and self.stream_options.include_speculation)

    @property
    def num_top_logprobs(self) -> int | None:
        """Alternatives per token to return; None = no logprobs at all."""
        raise NotImplementedError

    @property
    def num_prompt_logprobs(self) -> int | None:
        """Alternatives per prompt token to return (echo with logprobs); None = none."""
        return None

    @property
    def api_names(self) -> dict[str, str]:
        """The contract's field names -> this body's (admission.check_request)."""
        max_param = "max_completion_tokens" if self.max_completion_tokens is not None else "max_tokens"
        structured_param = self.structured_request[0] if self.structured_request else "response_format"
        return {"max_tokens": max_param, "prompt_token_ids": "prompt", "structured_output": structured_param}

    def to_sampling(self, choice_index: int = 0) -> SamplingParams:
        """The contract's sampling for choice `choice_index` (router/sampling.py)."""
        return sampling_params(AskedSampling(
            is_sampled_by_default=True, temperature=self.temperature, top_k=None if self.top_k == -1 else self.top_k,
            top_p=self.top_p, typical_p=self.typical_p, repetition_penalty=self.repetition_penalty,
            frequency_penalty=self.frequency_penalty, presence_penalty=self.presence_penalty, seed=self.seed,
            num_top_logprobs=self.num_top_logprobs, num_prompt_logprobs=self.num_prompt_logprobs,
            logit_bias={int(key): bias for key, bias in (self.logit_bias or {}).items()},
            structured_output=self.structured_request[1] if self.structured_request else None), choice_index)


class CompletionRequest(SamplingRequest):
    """POST /v1/completions."""

    prompt: str | list[int] | list[str] | list[list[int]]
    """One prompt (text or token ids) or a list of them; prompt i's choices are indices i * n to i * n + n - 1."""
    logprobs: int | None = Field(default=None, json_schema_extra=bounds(
        "num_top_logprobs", maximum=MAX_COMPLETION_LOGPROBS))
    """Alternatives per token, at most 5 (the legacy API's own limit; the range is the contract's)."""
    echo: bool | None = False
    """Prepend the prompt to the text (and, with logprobs, its tokens' logprobs); with `max_tokens` 0, the
    prompt alone."""
    prompt_logprobs: int | None = Field(default=None, json_schema_extra=bounds("num_prompt_logprobs"))
    """vLLM's extension: each choice's `prompt_logprobs` lists every prompt token's logprob and this many
    alternatives (not in a stream); with `echo`, the echoed prompt's alternatives too."""
    add_special_tokens: bool = True
    """vLLM's extension: add the tokenizer's special tokens (BOS) to a text prompt."""
    suffix: str | None = None
    best_of: int | None = Field(default=None, ge=1)
    """Only best_of = n (the default): ranking extra generations is not implemented."""

    @field_validator("prompt")
    @classmethod
    def _prompts(cls, prompt, info: ValidationInfo):
        prompts = prompt_list(prompt)
        num_generations = len(prompts) * (info.data.get("n") or 1)
        if num_generations > MAX_GENERATIONS:
            raise ValueError(f"{len(prompts)} prompts times n makes {num_generations} generations; "
                             f"at most {MAX_GENERATIONS} are allowed per request")
        for number, one in enumerate(prompts):
            if len(one) == 0:
                raise ValueError("the prompt must not be empty" if len(prompts) == 1 else f"prompt {number} is empty")
        return prompt

    @property
    def prompts(self) -> list[str | list[int]]:
        """The request's prompts, each a text or a list of token ids."""
        return prompt_list(self.prompt)

    @field_validator("logprobs")
    @classmethod
    def _legacy_logprobs_limit(cls, logprobs: int | None) -> int | None:
        if logprobs is not None and logprobs > MAX_COMPLETION_LOGPROBS:
            raise ValueError(f"at most {MAX_COMPLETION_LOGPROBS} logprobs per token are allowed (got {logprobs})")
        return logprobs

    @field_validator("prompt_logprobs")
    @classmethod
    def _prompt_logprobs_not_streamed(cls, prompt_logprobs: int | None, info: ValidationInfo) -> int | None:
        if prompt_logprobs and info.data.get("stream"):
            raise ValueError("`prompt_logprobs` are not available when `stream` is true (0 is allowed)")
        return prompt_logprobs

    @field_validator("suffix")
    @classmethod
    def _unsupported(cls, value, info: ValidationInfo):
        if value:
            raise ValueError(f"`{info.field_name}` is not supported yet")
        return value

    @field_validator("best_of")
    @classmethod
    def _best_of_is_n(cls, best_of: int | None, info: ValidationInfo) -> int | None:
        n = info.data.get("n") or 1
        if best_of is not None and best_of < n:
            raise ValueError(f"`best_of` must be at least n ({n}), got {best_of}")
        if best_of is not None and best_of > n:
            raise ValueError(f"`best_of` > n is not supported yet (got best_of={best_of}, n={n})")
        return best_of

    @property
    def num_top_logprobs(self) -> int | None:
        return self.logprobs

    @property
    def num_prompt_logprobs(self) -> int | None:
        if self.prompt_logprobs is not None:
            return self.prompt_logprobs
        return self.logprobs if self.echo else None

    @property
    def is_echo_only(self) -> bool:
        """`echo` with `max_tokens` 0: the answer is the prompt alone (one token is generated, then left out)."""
        return bool(self.echo) and super().requested_max_tokens == 0

    @property
    def requested_max_tokens(self) -> int | None:
        return 1 if self.is_echo_only else super().requested_max_tokens

    @property
    def api_names(self) -> dict[str, str]:
        prompt_param = "prompt_logprobs" if self.prompt_logprobs is not None else "logprobs"
        return {**super().api_names, "num_top_logprobs": "logprobs", "num_prompt_logprobs": prompt_param}


def prompt_list(prompt: object) -> list:
    """A completions body's `prompt` as a list of prompts: a list of texts or of token-id lists as it is, anything
    else (one text, one list of ids) as the only prompt."""
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
        return list(prompt)
    return [prompt]


class TextPart(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)

    type: str
    text: str = ""

    @field_validator("type")
    @classmethod
    def _text_only(cls, type: str) -> str:
        if type != "text":
            raise ValueError(f"content parts of type {type!r} are not supported (text only)")
        return type


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[CallIn] | None = None
    """An assistant turn's calls, sent back on the next turn."""
    tool_call_id: str | None = None
    """A tool turn's answer: the call it answers."""

    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(part.text for part in self.content)
        return self.content or ""


class ChatCompletionRequest(SamplingRequest, ChatTemplateOptions):
    """POST /v1/chat/completions (the chat template's options: prompts.ChatTemplateOptions)."""

    messages: list[ChatMessage] = Field(min_length=1)
    logprobs: bool | None = False
    top_logprobs: int | None = _bounded("num_top_logprobs")
    tools: list[Tool] | None = None
    """Functions the model may call; they go to the chat template (tools.py)."""
    tool_choice: ToolChoice | None = None
    """none, auto (the default with tools; needs the server's --tool-call-parser), required, or a named function."""
    parallel_tool_calls: bool | None = None
    """Whether a choice may make several calls (default true)."""

    @field_validator("top_logprobs")
    @classmethod
    def _top_logprobs_need_logprobs(cls, top_logprobs: int | None, info: ValidationInfo) -> int | None:
        if top_logprobs and not info.data.get("logprobs"):
            raise ValueError("`top_logprobs` requires `logprobs` to be true")
        return top_logprobs

    @field_validator("tool_choice")
    @classmethod
    def _tool_choice_met(cls, tool_choice: ToolChoice | None, info: ValidationInfo) -> ToolChoice | None:
        check_tools(info.data.get("tools"), tool_choice)
        structured = [name for name in STRUCTURED_FIELDS if is_requested(info.data.get(name))]
        if structured and tool_mode(info.data.get("tools"), tool_choice) in ("required", "named"):
            raise ValueError(f"give one structured output per request: `{structured[0]}` and a tool_choice that "
                             f"forces a call both constrain the output")
        return tool_choice

    @property
    def tool_mode(self) -> str:
        """"none", "auto", "required" or "named" (tools.tool_mode)."""
        return tool_mode(self.tools, self.tool_choice)

    @property
    def is_parallel_tool_calls(self) -> bool:
        return self.parallel_tool_calls is not False

    def asked_structure(self) -> tuple[str, StructuredOutput] | None:
        forced = forced_output(self.tools or [], self.tool_choice, self.is_parallel_tool_calls)
        return ("tool_choice", forced) if forced is not None else super().asked_structure()

    @property
    def num_top_logprobs(self) -> int | None:
        if not self.logprobs:
            return None
        return 0 if self.top_logprobs is None else self.top_logprobs

    @property
    def api_names(self) -> dict[str, str]:
        return {**super().api_names, "prompt_token_ids": "messages", "num_top_logprobs": "top_logprobs"}

    def template_messages(self) -> list[dict]:
        return template_messages(self.messages)


def template_messages(messages: list[ChatMessage]) -> list[dict]:
    """Messages as chat templates expect them: role and plain-string content, and an assistant turn's calls and
    a tool turn's call id where they are given."""
    out = []
    for message in messages:
        entry: dict = {"role": message.role, "content": message.text()}
        if message.tool_calls:
            entry["tool_calls"] = template_calls(message.tool_calls)
        if message.tool_call_id is not None:
            entry["tool_call_id"] = message.tool_call_id
        if message.name is not None and message.role == "tool":
            entry["name"] = message.name
        out.append(entry)
    return out
