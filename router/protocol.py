"""OpenAI request bodies for /v1/completions and /v1/chat/completions (pydantic).

Validation here is about one field at a time (ranges, types, unsupported
features) and names the field; limits that need the model (prompt length,
vocabulary size) are checked by the app. Unknown fields are ignored, as OpenAI
clients send extras. `to_params` is the single place the HTTP fields become the
scheduler's `GenerateParams`. top_k, typical_p, repetition_penalty and
ignore_eos are extensions, as in vLLM.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator

from router.scheduler_client import GenerateParams

# Temperatures below this are greedy decoding (as in vLLM).
GREEDY_TEMPERATURE = 1e-5
MAX_TOP_LOGPROBS = 20


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="ignore")

    include_usage: bool = False
    """Send a last chunk with token usage before [DONE]."""


class _SamplingRequest(BaseModel):
    """Fields both endpoints share."""

    model_config = ConfigDict(extra="ignore")

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
    seed: int | None = Field(default=None, ge=0, lt=2**64)
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int = Field(default=1, ge=1)
    stop: str | list[str] | None = None
    ignore_eos: bool = False
    user: str | None = None

    @field_validator("n")
    @classmethod
    def _only_one_choice(cls, n: int) -> int:
        if n != 1:
            raise ValueError("only n=1 is supported for now")
        return n

    @field_validator("stop")
    @classmethod
    def _no_stop_sequences(cls, stop: str | list[str] | None) -> str | list[str] | None:
        if stop:
            raise ValueError("stop sequences are not supported yet")
        return stop

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

    def to_params(self, max_new_tokens: int) -> GenerateParams:
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
            seed=self.seed,
            # The chosen token's own logprob comes from the top list (under greedy
            # decoding the score is a logit), so ask for at least one.
            num_top_logprobs=0 if num_top is None else max(num_top, 1),
            ignore_eos=self.ignore_eos,
        )


class CompletionRequest(_SamplingRequest):
    """POST /v1/completions."""

    prompt: str | list[int] | list[str] | list[list[int]]
    logprobs: int | None = Field(default=None, ge=0, le=MAX_TOP_LOGPROBS)
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = Field(default=None, ge=1)

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

    @field_validator("echo", "suffix", "best_of")
    @classmethod
    def _unsupported(cls, value, info: ValidationInfo):
        if value and not (info.field_name == "best_of" and value == 1):
            raise ValueError(f"`{info.field_name}` is not supported yet")
        return value

    @property
    def num_top_logprobs(self) -> int | None:
        return self.logprobs


class TextPart(BaseModel):
    model_config = ConfigDict(extra="ignore")

    type: str
    text: str = ""

    @field_validator("type")
    @classmethod
    def _text_only(cls, type: str) -> str:
        if type != "text":
            raise ValueError(f"content parts of type {type!r} are not supported (text only)")
        return type


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")

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
    logprobs: bool = False
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
