"""OpenAI request bodies for /v1/completions and /v1/chat/completions (pydantic).

Validation here is about one field at a time (ranges, types, unsupported
features) and names the field; limits that need the model (prompt length,
vocabulary size) are checked by the app. Unknown fields are ignored, as OpenAI
clients send extras, and null is accepted wherever OpenAI's default would do
(clients send `"n": 1, "logprobs": null, "stop": null, ...` explicitly). Types
are strict, as OpenAI's: `true` is not 1, `"5"` not 5, `5.0` not an integer.
`to_params` is the single place the HTTP fields become the scheduler's
`GenerateParams`. top_k, typical_p, repetition_penalty and ignore_eos are
extensions, as in vLLM. Stop strings are applied by the router (stop.py), the n
choices are n scheduler requests (choices.py).
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator

from router.choices import MAX_CHOICES
from router.scheduler_client import GenerateParams

# Temperatures below this are greedy decoding (as in vLLM).
GREEDY_TEMPERATURE = 1e-5
MAX_TOP_LOGPROBS = 20
MAX_COMPLETION_LOGPROBS = 5  # the legacy completions API's limit
MAX_STOP_STRINGS = 4
SEED_RANGE = 2**64  # seeds are uint64 on the wire; negative (int64) seeds wrap around


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)

    include_usage: bool | None = False
    """Send a last chunk with token usage before [DONE]."""


class _SamplingRequest(BaseModel):
    """Fields both endpoints share."""

    model_config = ConfigDict(extra="ignore", strict=True)

    model: str | None = None
    max_tokens: int | None = Field(default=None, ge=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    top_k: int | None = Field(default=None, ge=-1)
    typical_p: float | None = Field(default=None, gt=0.0, le=1.0)
    repetition_penalty: float | None = Field(default=None, gt=0.0)
    frequency_penalty: float | None = Field(default=None, ge=-2.0, le=2.0)
    presence_penalty: float | None = Field(default=None, ge=-2.0, le=2.0)
    seed: int | None = Field(default=None, ge=-(SEED_RANGE // 2), lt=SEED_RANGE)
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    n: int | None = Field(default=1, ge=1, le=MAX_CHOICES)
    """Independent choices of the same prompt (greedy ones are identical)."""
    stop: str | list[str] | None = None
    """Up to 4 strings; the output ends before the first one, which is not returned."""
    logit_bias: dict[str, float] | None = None
    ignore_eos: bool = False
    user: str | None = None

    @field_validator("stop")
    @classmethod
    def _check_stop(cls, stop: str | list[str] | None) -> str | list[str] | None:
        stops = [stop] if isinstance(stop, str) else stop or []
        if len(stops) > MAX_STOP_STRINGS:
            raise ValueError(f"at most {MAX_STOP_STRINGS} stop strings are allowed (got {len(stops)})")
        if not all(stops):
            raise ValueError("stop strings must not be empty")
        return stop

    @field_validator("logit_bias")
    @classmethod
    def _no_logit_bias(cls, logit_bias: dict[str, float] | None) -> dict[str, float] | None:
        if logit_bias:
            raise ValueError("`logit_bias` is not supported")
        return logit_bias

    @property
    def num_choices(self) -> int:
        return self.n or 1

    @property
    def stop_strings(self) -> list[str]:
        return [self.stop] if isinstance(self.stop, str) else list(self.stop or [])

    @property
    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens

    @property
    def include_usage(self) -> bool:
        return bool(self.stream and self.stream_options and self.stream_options.include_usage)

    @property
    def num_top_logprobs(self) -> int | None:
        """Alternatives per token to return; None = no logprobs at all."""
        raise NotImplementedError

    def to_params(self, max_new_tokens: int, choice_index: int = 0) -> GenerateParams:
        """The scheduler's parameters for choice `choice_index`: its seed is `seed` + the index, so
        each choice samples differently and a request with a seed is reproducible choice by choice."""
        temperature = 1.0 if self.temperature is None else self.temperature  # OpenAI's default samples
        do_sample = temperature >= GREEDY_TEMPERATURE
        num_top = self.num_top_logprobs
        return GenerateParams(
            max_new_tokens=max_new_tokens,
            do_sample=do_sample,
            temperature=temperature if do_sample else 1.0,
            top_k=max(self.top_k or 0, 0),
            top_p=1.0 if self.top_p is None else self.top_p,
            typical_p=1.0 if self.typical_p is None else self.typical_p,
            repetition_penalty=1.0 if self.repetition_penalty is None else self.repetition_penalty,
            frequency_penalty=self.frequency_penalty or 0.0,
            presence_penalty=self.presence_penalty or 0.0,
            seed=None if self.seed is None else (self.seed + choice_index) % SEED_RANGE,
            # The chosen token's own logprob comes from the top list (under greedy
            # decoding the score is a logit), so ask for at least one.
            num_top_logprobs=0 if num_top is None else max(num_top, 1),
            ignore_eos=self.ignore_eos,
        )


class CompletionRequest(_SamplingRequest):
    """POST /v1/completions."""

    prompt: str | list[int] | list[str] | list[list[int]]
    logprobs: int | None = Field(default=None, ge=0, le=MAX_COMPLETION_LOGPROBS)
    echo: bool | None = False
    suffix: str | None = None
    best_of: int | None = Field(default=None, ge=1)
    """Only best_of = n (the default): ranking extra generations is not implemented."""

    @field_validator("prompt")
    @classmethod
    def _single_prompt(cls, prompt):
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
            if len(prompt) != 1:
                raise ValueError("only one prompt per request is supported for now")
            prompt = prompt[0]
        if isinstance(prompt, list) and any(t < 0 for t in prompt):
            raise ValueError("token ids must be >= 0")
        if len(prompt) == 0:
            raise ValueError("the prompt must not be empty")
        return prompt

    @field_validator("echo", "suffix")
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

    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(part.text for part in self.content)
        return self.content or ""


class ChatCompletionRequest(_SamplingRequest):
    """POST /v1/chat/completions."""

    messages: list[ChatMessage] = Field(min_length=1)
    logprobs: bool | None = False
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_TOP_LOGPROBS)

    @field_validator("top_logprobs")
    @classmethod
    def _top_logprobs_need_logprobs(cls, top_logprobs: int | None, info: ValidationInfo) -> int | None:
        if top_logprobs and not info.data.get("logprobs"):
            raise ValueError("`top_logprobs` requires `logprobs` to be true")
        return top_logprobs

    @property
    def num_top_logprobs(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None

    def template_messages(self) -> list[dict[str, str]]:
        """Messages as chat templates expect them: role and plain-string content."""
        return [{"role": m.role, "content": m.text()} for m in self.messages]
