"""The sampling contract: how one request chooses its tokens and when it stops (common.proto).

`SamplingParams` and `StoppingCriteria` are the only definitions of these values in
segserve: the router builds them from an HTTP body, the scheduler from a
GenerateRequest, the worker keeps them per sequence. `validate()` owns every range
rule; the router calls it to answer 400 naming the field, and the scheduler's
gRPC admission calls it to answer INVALID_ARGUMENT with the same message. Nothing
downstream re-checks a range.

Every number must be finite as a float32 (the wire's type), so `Infinity`, `NaN`
and 1e39 are refused before they can reach a batch. Torch-free.
"""

from __future__ import annotations

import enum
import json
import math
from dataclasses import dataclass, field
from numbers import Integral, Real
from typing import Mapping

from protos.segserve.v1 import common_pb2

FLOAT32_MAX = 3.4028234663852886e38
UINT32_MAX = 2**32 - 1
SEED_LIMIT = 2**64
MAX_TOP_LOGPROBS = 20
"""Alternatives per token a request may ask for (OpenAI's chat limit)."""
MAX_LOGIT_BIAS_ENTRIES = 1024
MAX_LOGIT_BIAS = 100.0
"""OpenAI's range for a logit bias: [-100, 100]."""
MAX_PENALTY = 2.0
"""OpenAI's range for frequency and presence penalties: [-2, 2]."""
MAX_STOP_TOKEN_IDS = 64
MAX_STRUCTURED_SPEC_CHARS = 256 * 1024
"""Longest schema, regex, choice list or grammar a request may carry, in characters."""


class InvalidParameter(ValueError):
    """A value outside its contract; `field` is the contract's name for it (e.g. "top_p")."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field
        self.message = message


class StructuredKind(enum.Enum):
    """What a StructuredOutput's spec is (common.proto's StructuredOutput.Kind)."""

    JSON_SCHEMA = common_pb2.StructuredOutput.KIND_JSON_SCHEMA
    JSON_OBJECT = common_pb2.StructuredOutput.KIND_JSON_OBJECT
    REGEX = common_pb2.StructuredOutput.KIND_REGEX
    CHOICE = common_pb2.StructuredOutput.KIND_CHOICE
    GRAMMAR = common_pb2.StructuredOutput.KIND_GRAMMAR
    STRUCTURAL_TAG = common_pb2.StructuredOutput.KIND_STRUCTURAL_TAG


@dataclass(frozen=True)
class StructuredOutput:
    """A grammar the output must match. The contract checks its shape only (validate()); whether the schema,
    regex or grammar compiles is the grammar engine's to say, at the API edge."""

    kind: StructuredKind
    """What `spec` is."""
    spec: str = ""
    """JSON_SCHEMA: the schema as JSON text; JSON_OBJECT: empty; REGEX: the expression; CHOICE: a JSON list of
    strings; GRAMMAR: EBNF (GBNF) whose root rule is `root`; STRUCTURAL_TAG: a structural tag's JSON object
    (common/grammar.py)."""

    def to_pb(self) -> common_pb2.StructuredOutput:
        return common_pb2.StructuredOutput(kind=self.kind.value, spec=self.spec)

    @classmethod
    def from_pb(cls, pb: common_pb2.StructuredOutput) -> StructuredOutput:
        """Convert as sent; an unknown kind raises InvalidParameter."""
        try:
            kind = StructuredKind(pb.kind)
        except ValueError:
            raise InvalidParameter("structured_output", f"unknown kind {pb.kind}") from None
        return cls(kind, pb.spec)


@dataclass(frozen=True)
class SamplingParams:
    """How the next token is chosen; every default means "off"."""

    do_sample: bool = False
    """Sample from the processed distribution (True) or take the argmax (False)."""
    temperature: float = 1.0
    """Softmax temperature, finite and > 0."""
    top_k: int = 0
    """Keep the k most likely tokens; 0 = off, else below the vocabulary size."""
    top_p: float = 1.0
    """Nucleus mass in (0, 1]; 1.0 = off."""
    typical_p: float = 1.0
    """Locally typical mass in (0, 1]; 1.0 = off."""
    repetition_penalty: float = 1.0
    """Divide positive / multiply negative logits of tokens in prompt + output; finite, > 0; 1.0 = off."""
    frequency_penalty: float = 0.0
    """Subtract penalty x count of the token in the output; [-2, 2]; 0 = off."""
    presence_penalty: float = 0.0
    """Subtract penalty once per token present in the output; [-2, 2]; 0 = off."""
    seed: int | None = None
    """Seed of the request's own generator, in [0, 2**64); None = random."""
    num_top_logprobs: int = 0
    """Most likely log-probabilities returned with every token, [0, 20]; 0 = none."""
    num_prompt_logprobs: int | None = None
    """Return the prompt tokens' log-probabilities and this many alternatives each; None = none."""
    watermark: bool = False
    """Bias sampling toward a green list (worker/watermark.py)."""
    logit_bias: Mapping[int, float] = field(default_factory=dict, hash=False)
    """Token id -> bias added to its raw logit before any other processing, in [-100, 100]."""
    structured_output: StructuredOutput | None = None
    """A grammar the output must match (structured outputs); None = unconstrained."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "logit_bias", dict(self.logit_bias))  # a private copy

    @property
    def has_penalty(self) -> bool:
        return self.repetition_penalty != 1.0 or self.frequency_penalty != 0.0 or self.presence_penalty != 0.0

    def to_pb(self) -> common_pb2.SamplingParams:
        pb = common_pb2.SamplingParams(
            do_sample=self.do_sample, temperature=self.temperature, top_k=self.top_k, top_p=self.top_p,
            typical_p=self.typical_p, repetition_penalty=self.repetition_penalty,
            frequency_penalty=self.frequency_penalty, presence_penalty=self.presence_penalty,
            num_top_logprobs=self.num_top_logprobs, watermark=self.watermark, logit_bias=dict(self.logit_bias))
        if self.seed is not None:
            pb.seed = self.seed
        if self.num_prompt_logprobs is not None:
            pb.num_prompt_logprobs = self.num_prompt_logprobs
        if self.structured_output is not None:
            pb.structured_output.CopyFrom(self.structured_output.to_pb())
        return pb

    @classmethod
    def from_pb(cls, pb: common_pb2.SamplingParams) -> SamplingParams:
        """Convert as sent; call validate() before trusting the values."""
        return cls(
            do_sample=pb.do_sample, temperature=pb.temperature, top_k=pb.top_k, top_p=pb.top_p,
            typical_p=pb.typical_p, repetition_penalty=pb.repetition_penalty,
            frequency_penalty=pb.frequency_penalty, presence_penalty=pb.presence_penalty,
            seed=pb.seed if pb.HasField("seed") else None, num_top_logprobs=pb.num_top_logprobs,
            num_prompt_logprobs=pb.num_prompt_logprobs if pb.HasField("num_prompt_logprobs") else None,
            watermark=pb.watermark, logit_bias=dict(pb.logit_bias),
            structured_output=StructuredOutput.from_pb(pb.structured_output)
            if pb.HasField("structured_output") else None)


@dataclass(frozen=True)
class StoppingCriteria:
    """When a request stops generating (besides the context limit)."""

    max_tokens: int = 16
    """Upper bound on generated tokens, in [1, 2**32)."""
    stop_token_ids: tuple[int, ...] = ()
    """Extra token ids that end generation (the model's EOS ids always do unless ignore_eos)."""
    ignore_eos: bool = False
    """Keep generating past the model's EOS tokens."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))

    def to_pb(self) -> common_pb2.StoppingCriteria:
        return common_pb2.StoppingCriteria(max_tokens=self.max_tokens, stop_token_ids=self.stop_token_ids,
                                           ignore_eos=self.ignore_eos)

    @classmethod
    def from_pb(cls, pb: common_pb2.StoppingCriteria) -> StoppingCriteria:
        return cls(max_tokens=pb.max_tokens, stop_token_ids=tuple(pb.stop_token_ids), ignore_eos=pb.ignore_eos)


@dataclass(frozen=True)
class Range:
    """An interval a number must lie in; None = unbounded on that side."""

    low: float | None = None
    high: float | None = None
    is_low_open: bool = False
    is_high_open: bool = False

    def contains(self, value: float) -> bool:
        if self.low is not None and (value <= self.low if self.is_low_open else value < self.low):
            return False
        return not (self.high is not None and (value >= self.high if self.is_high_open else value > self.high))

    def describe(self) -> str:
        low = "-inf" if self.low is None else _number(self.low)
        high = "inf" if self.high is None else _number(self.high)
        return f"{'(' if self.is_low_open or self.low is None else '['}{low}, {high}" \
               f"{')' if self.is_high_open or self.high is None else ']'}"

    def json_schema(self) -> dict:
        """The same bounds as JSON Schema keywords (for API documentation)."""
        schema: dict = {}
        if self.low is not None:
            schema["exclusiveMinimum" if self.is_low_open else "minimum"] = self.low
        if self.high is not None:
            schema["exclusiveMaximum" if self.is_high_open else "maximum"] = self.high
        return schema


def _number(value: float) -> str:
    return str(value) if isinstance(value, int) else f"{value:g}"


RANGES: dict[str, Range] = {
    "temperature": Range(0.0, FLOAT32_MAX, is_low_open=True),
    "top_k": Range(0, UINT32_MAX),  # and below the vocabulary size, when known
    "top_p": Range(0.0, 1.0, is_low_open=True),
    "typical_p": Range(0.0, 1.0, is_low_open=True),
    "repetition_penalty": Range(0.0, FLOAT32_MAX, is_low_open=True),
    "frequency_penalty": Range(-MAX_PENALTY, MAX_PENALTY),
    "presence_penalty": Range(-MAX_PENALTY, MAX_PENALTY),
    "seed": Range(0, SEED_LIMIT, is_high_open=True),
    "num_top_logprobs": Range(0, MAX_TOP_LOGPROBS),
    "num_prompt_logprobs": Range(0, MAX_TOP_LOGPROBS),
    "logit_bias": Range(-MAX_LOGIT_BIAS, MAX_LOGIT_BIAS),
    "max_tokens": Range(1, UINT32_MAX),
}
"""Every numeric rule of the contract, by field; validate() applies them, the APIs document them."""

_FLOATS = ("temperature", "top_p", "typical_p", "repetition_penalty", "frequency_penalty", "presence_penalty")
_INTS = ("top_k", "num_top_logprobs")
_BOOLS = ("do_sample", "watermark")


def validate(sampling: SamplingParams, stopping: StoppingCriteria | None = None, *,
             vocab_size: int | None = None) -> None:
    """Raise InvalidParameter for the first value outside the contract.

    vocab_size, when known, also bounds top_k, token ids and logit_bias keys.
    """
    for name in _BOOLS:
        _check_bool(name, getattr(sampling, name))
    for name in _FLOATS:
        _check_number(name, getattr(sampling, name), is_integer=False)
    for name in _INTS:
        _check_number(name, getattr(sampling, name), is_integer=True)
    if sampling.seed is not None:
        _check_number("seed", sampling.seed, is_integer=True)
    if sampling.num_prompt_logprobs is not None:
        _check_number("num_prompt_logprobs", sampling.num_prompt_logprobs, is_integer=True)
    if vocab_size is not None and sampling.top_k >= vocab_size:
        raise InvalidParameter("top_k", f"must be below the vocabulary size {vocab_size} (got {sampling.top_k})")
    _check_logit_bias(sampling.logit_bias, vocab_size)
    if sampling.structured_output is not None:
        _check_structured_output(sampling.structured_output)
    if stopping is not None:
        _check_number("max_tokens", stopping.max_tokens, is_integer=True)
        _check_bool("ignore_eos", stopping.ignore_eos)
        _check_token_ids("stop_token_ids", stopping.stop_token_ids, vocab_size, MAX_STOP_TOKEN_IDS)


def _check_bool(name: str, value: object) -> None:
    if not isinstance(value, bool):
        raise InvalidParameter(name, f"must be a boolean (got {type(value).__name__})")


def _check_number(name: str, value: object, *, is_integer: bool) -> None:
    allowed = RANGES[name]
    if isinstance(value, bool) or not isinstance(value, Integral if is_integer else Real):
        kind = "an integer" if is_integer else "a number"
        raise InvalidParameter(name, f"must be {kind} (got {type(value).__name__})")
    if not is_integer and not (math.isfinite(value) and abs(value) <= FLOAT32_MAX):
        raise InvalidParameter(name, f"must be a finite number (got {value!r})")
    if not allowed.contains(value):
        raise InvalidParameter(name, f"must be in {allowed.describe()} (got {value!r})")


def _check_token_ids(name: str, token_ids: object, vocab_size: int | None, max_count: int) -> None:
    if len(token_ids) > max_count:
        raise InvalidParameter(name, f"at most {max_count} entries are allowed (got {len(token_ids)})")
    high = UINT32_MAX + 1 if vocab_size is None else vocab_size
    for token_id in token_ids:
        if isinstance(token_id, bool) or not isinstance(token_id, Integral) or not 0 <= token_id < high:
            raise InvalidParameter(name, f"token ids must be integers in [0, {high}) (got {token_id!r})")


def _check_logit_bias(logit_bias: Mapping[int, float], vocab_size: int | None) -> None:
    _check_token_ids("logit_bias", list(logit_bias), vocab_size, MAX_LOGIT_BIAS_ENTRIES)
    for token_id, bias in logit_bias.items():
        try:
            _check_number("logit_bias", bias, is_integer=False)
        except InvalidParameter as exc:
            raise InvalidParameter("logit_bias", f"token {token_id}: {exc.message}") from None


def _check_structured_output(structured: object) -> None:
    """The shape of a StructuredOutput: a known kind, a spec of the right form and size."""
    name = "structured_output"
    if not isinstance(structured, StructuredOutput) or not isinstance(structured.kind, StructuredKind):
        raise InvalidParameter(name, "must name one of json_schema, json_object, regex, choice, grammar, "
                                     "structural_tag")
    spec = structured.spec
    if not isinstance(spec, str):
        raise InvalidParameter(name, "its spec must be a string")
    if len(spec) > MAX_STRUCTURED_SPEC_CHARS:
        raise InvalidParameter(name, f"its spec is longer than {MAX_STRUCTURED_SPEC_CHARS} characters")
    if structured.kind is StructuredKind.JSON_OBJECT:
        if spec:
            raise InvalidParameter(name, "json_object takes no spec")
        return
    if not spec:
        raise InvalidParameter(name, f"{structured.kind.name.lower()} needs a spec")
    if structured.kind in (StructuredKind.JSON_SCHEMA, StructuredKind.CHOICE, StructuredKind.STRUCTURAL_TAG):
        try:
            value = json.loads(spec)
        except ValueError as exc:
            raise InvalidParameter(name, f"its spec is not JSON: {exc}") from None
        if structured.kind is StructuredKind.JSON_SCHEMA and not isinstance(value, (dict, bool)):
            raise InvalidParameter(name, "a JSON schema must be an object or a boolean")
        if structured.kind is StructuredKind.CHOICE and (
                not isinstance(value, list) or not value or not all(isinstance(c, str) and c for c in value)):
            raise InvalidParameter(name, "choice must be a non-empty list of non-empty strings")
        if structured.kind is StructuredKind.STRUCTURAL_TAG and not (
                isinstance(value, dict) and value.get("type") == "structural_tag" and "format" in value):
            raise InvalidParameter(name, 'a structural tag must be an object {"type": "structural_tag", "format": '
                                         '{...}}')
