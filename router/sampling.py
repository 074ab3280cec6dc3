"""What a request body asked of sampling -> the contract's SamplingParams, by one rule for every API.

Each edge reads its body into an `AskedSampling`, in the contract's names, with None for a field the body did not
send: the OpenAI routes (router/protocol.py), /v2's `parameters` (router/v2.py) and the public gRPC API's
`GenerationParameters` (router/grpc_convert.py). `sampling_params` then makes one choice's SamplingParams of it.

The greedy rule (SPEC, section 3): `do_sample` samples, and so does any sampling parameter that is sent and not
off (a temperature; a top_k above 0; a top_p or typical_p other than 1). A temperature in [0, 1e-5) is greedy
whatever else is set, as OpenAI's 0 (vLLM's bound), where the API takes 0 (`is_zero_temperature_greedy`; /v2's
temperature is > 0, as MindIE's, so there a 0 goes on to be refused). The OpenAI APIs have no `do_sample`: they
sample, at temperature 1, unless told otherwise (`is_sampled_by_default`).

Choice i's seed is the seed + i modulo 2**64 (`choice_seed`), so the choices of one request differ and each is
reproducible. Nothing is checked here: values out of range go on as they are, for the contract to refuse
(admission.check_request) with the body's own field name.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Mapping

from protos.segserve.v1.sampling import SEED_LIMIT, SamplingParams, StructuredOutput

GREEDY_TEMPERATURE = 1e-5
"""Temperatures in [0, this) are greedy decoding (as in vLLM)."""
MIN_SEED = -(SEED_LIMIT // 2)
"""Seeds are uint64 on the wire; negative (int64) seeds wrap around."""


@dataclass(frozen=True)
class AskedSampling:
    """A body's sampling fields in the contract's names; None: not sent."""

    do_sample: bool = False
    is_sampled_by_default: bool = False
    """The API samples when nothing says otherwise (OpenAI's, which has no do_sample)."""
    is_zero_temperature_greedy: bool = True
    """A temperature in [0, GREEDY_TEMPERATURE) means greedy (OpenAI's 0); False: it goes on as it is."""
    temperature: float | None = None
    top_k: int | None = None
    top_p: float | None = None
    typical_p: float | None = None
    repetition_penalty: float | None = None
    frequency_penalty: float | None = None
    presence_penalty: float | None = None
    seed: int | None = None
    num_top_logprobs: int | None = None
    """Alternatives per output token; None: no log-probabilities."""
    num_prompt_logprobs: int | None = None
    watermark: bool = False
    logit_bias: Mapping[int, float] = field(default_factory=dict)
    structured_output: StructuredOutput | None = None


def choice_seed(seed: int | None, choice_index: int) -> int | None:
    """Choice `choice_index`'s seed: `seed` + index modulo 2**64 for a seed the APIs allow (int64 or uint64); any
    other value is passed on unchanged for the contract to refuse."""
    if seed is None or not MIN_SEED <= seed < SEED_LIMIT:
        return seed
    return (seed + choice_index) % SEED_LIMIT


def is_sampled(asked: AskedSampling) -> tuple[bool, float]:
    """(do_sample, temperature) by the greedy rule (module docstring)."""
    if asked.temperature is not None:
        if asked.is_zero_temperature_greedy and 0.0 <= asked.temperature < GREEDY_TEMPERATURE:
            return False, 1.0
        return True, asked.temperature  # negative and non-finite ones too: the contract refuses them
    warped = (asked.top_k or 0) > 0 or any(p is not None and p != 1.0 for p in (asked.top_p, asked.typical_p))
    return asked.do_sample or asked.is_sampled_by_default or warped, 1.0


def sampling_params(asked: AskedSampling, choice_index: int = 0) -> SamplingParams:
    """Choice `choice_index`'s SamplingParams; unchecked. A request for log-probabilities asks for at least one
    alternative: the chosen token's own log-probability comes from the top list (a greedy score is a logit)."""
    do_sample, temperature = is_sampled(asked)
    num_top = asked.num_top_logprobs
    return SamplingParams(
        do_sample=do_sample,
        temperature=temperature,
        top_k=_or(asked.top_k, 0),
        top_p=_or(asked.top_p, 1.0),
        typical_p=_or(asked.typical_p, 1.0),
        repetition_penalty=_or(asked.repetition_penalty, 1.0),
        frequency_penalty=_or(asked.frequency_penalty, 0.0),
        presence_penalty=_or(asked.presence_penalty, 0.0),
        seed=choice_seed(asked.seed, choice_index),
        num_top_logprobs=0 if num_top is None else 1 if num_top == 0 else num_top,
        num_prompt_logprobs=asked.num_prompt_logprobs,
        watermark=asked.watermark,
        logit_bias=asked.logit_bias,
        structured_output=asked.structured_output,
    )


def _or(value, default):
    return default if value is None else value
