"""The client's typed results: small frozen dataclasses made from the API's messages at the edge.

Nothing of protobuf leaks out of the client: every method returns one of these. A finish reason is a lower-case
string, the enum's name without its prefix ("eos_token", "length", "stop", "error"), or None while a choice runs.
"""

from __future__ import annotations

from dataclasses import dataclass

from protos.segserve.v1 import generation_pb2 as pb
from protos.segserve.v1.usage import Usage

_FINISH_PREFIX = "GENERATION_FINISH_REASON_"


def finish_reason_of(value: int) -> str | None:
    """"eos_token", "length", "stop", "error" (or the number of a value this client does not know); None for
    UNSPECIFIED (not finished)."""
    if value == pb.GENERATION_FINISH_REASON_UNSPECIFIED:
        return None
    try:
        return pb.GenerationFinishReason.Name(value).removeprefix(_FINISH_PREFIX).lower()
    except ValueError:
        return str(value)


@dataclass(frozen=True)
class TokenAlternative:
    """A likely token at one position."""

    token_id: int
    token: str
    logprob: float


@dataclass(frozen=True)
class TokenLogprob:
    """One token, its log-probability and the most likely alternatives (most likely first)."""

    token_id: int
    token: str
    logprob: float
    top: tuple[TokenAlternative, ...] = ()

    @classmethod
    def from_pb(cls, message: pb.TokenLogprob) -> TokenLogprob:
        top = tuple(TokenAlternative(alt.token_id, alt.token, alt.logprob) for alt in message.top)
        return cls(message.token_id, message.token, message.logprob, top)


@dataclass(frozen=True)
class PromptTokenLogprob:
    """A prompt token's log-probability given the tokens before it (position >= 1)."""

    position: int
    token: TokenLogprob


def _logprobs(messages) -> tuple[TokenLogprob, ...]:
    return tuple(TokenLogprob.from_pb(message) for message in messages)


def _prompt_logprobs(messages) -> tuple[PromptTokenLogprob, ...]:
    return tuple(PromptTokenLogprob(message.position, TokenLogprob.from_pb(message.token)) for message in messages)


@dataclass(frozen=True)
class Details:
    """A choice's measured costs (asked for with details=True)."""

    generated_tokens: int
    first_token_cost_ms: float
    """Arrival at the router -> the choice's first token (router clock)."""
    decode_cost_ms: float
    """First token -> newest token (router clock)."""
    queue_wait_us: int
    """Arrival at the scheduler -> first scheduled."""
    batch_size: int
    """The largest batch the choice ran in."""

    @classmethod
    def from_pb(cls, message: pb.GenerationDetails) -> Details:
        return cls(message.generated_tokens, message.first_token_cost_ms, message.decode_cost_ms,
                   message.queue_wait_us, message.batch_size)


def _details(message) -> Details | None:
    return Details.from_pb(message.details) if message.HasField("details") else None


@dataclass(frozen=True)
class Choice:
    """One of the n choices of a generation."""

    index: int
    text: str
    """The generated text, cut before a stop string."""
    token_ids: tuple[int, ...]
    """The generated token ids (end-of-text included)."""
    finish_reason: str | None
    logprobs: tuple[TokenLogprob, ...] = ()
    """Per token, when logprobs were asked for; else empty."""
    step_num_tokens: tuple[int, ...] = ()
    """Tokens each scheduler step produced: 1 + the draft tokens accepted in it."""
    details: Details | None = None
    error_message: str = ""
    """Why the choice failed (finish_reason "error")."""

    @classmethod
    def from_pb(cls, message: pb.GenerationChoice) -> Choice:
        return cls(message.index, message.text, tuple(message.token_ids), finish_reason_of(message.finish_reason),
                   _logprobs(message.logprobs), tuple(message.step_num_tokens), _details(message),
                   message.error_message)


@dataclass(frozen=True)
class GenerationResult:
    """What `generate()` returns; text, token_ids, finish_reason, logprobs and details are choice 0's."""

    id: str
    model: str
    choices: tuple[Choice, ...]
    usage: Usage
    prompt_logprobs: tuple[PromptTokenLogprob, ...] = ()
    """With prompt_logprobs asked for."""

    @classmethod
    def from_pb(cls, message: pb.GenerationResponse) -> GenerationResult:
        return cls(message.id, message.model, tuple(Choice.from_pb(choice) for choice in message.choices),
                   Usage.from_pb(message.usage), _prompt_logprobs(message.prompt_logprobs))

    @property
    def text(self) -> str:
        return self.choices[0].text

    @property
    def token_ids(self) -> tuple[int, ...]:
        return self.choices[0].token_ids

    @property
    def finish_reason(self) -> str | None:
        return self.choices[0].finish_reason

    @property
    def logprobs(self) -> tuple[TokenLogprob, ...]:
        return self.choices[0].logprobs

    @property
    def details(self) -> Details | None:
        return self.choices[0].details


@dataclass(frozen=True)
class StreamEvent:
    """One event of `stream()`: a delta of choice `index`'s text and the tokens it covers."""

    id: str
    index: int
    text: str
    """Text that became final with this event (may be empty: half a character, an end-of-text token)."""
    token_ids: tuple[int, ...]
    logprobs: tuple[TokenLogprob, ...] = ()
    step_num_tokens: tuple[int, ...] = ()
    """Tokens each scheduler step covered by this event produced: 1 + the draft tokens accepted in it."""
    num_accepted_draft_tokens: int = 0
    finish_reason: str | None = None
    """Set on the choice's last event."""
    error_message: str = ""
    usage: Usage | None = None
    """On the request's last event."""
    details: Details | None = None
    prompt_logprobs: tuple[PromptTokenLogprob, ...] = ()

    @classmethod
    def from_pb(cls, message: pb.GenerationStreamResponse) -> StreamEvent:
        usage = Usage.from_pb(message.usage) if message.HasField("usage") else None
        return cls(message.id, message.index, message.text, tuple(message.token_ids), _logprobs(message.logprobs),
                   tuple(message.step_num_tokens), message.num_accepted_draft_tokens,
                   finish_reason_of(message.finish_reason), message.error_message, usage, _details(message),
                   _prompt_logprobs(message.prompt_logprobs))


@dataclass(frozen=True)
class TokenizeResult:
    """What `tokenize()` returns."""

    token_ids: tuple[int, ...]
    tokens: tuple[str, ...]
    """Each token's text."""
    max_model_len: int
    """The model's context length (prompt + output)."""

    @classmethod
    def from_pb(cls, message: pb.TokenizeResponse) -> TokenizeResult:
        return cls(tuple(message.token_ids), tuple(message.tokens), message.max_model_len)


@dataclass(frozen=True)
class ModelCard:
    """A served model."""

    id: str
    created: int
    """Unix time the router started serving it."""
    owned_by: str
    max_model_len: int
    vocab_size: int

    @classmethod
    def from_pb(cls, message: pb.ModelCard) -> ModelCard:
        return cls(message.id, message.created, message.owned_by, message.max_model_len, message.vocab_size)
