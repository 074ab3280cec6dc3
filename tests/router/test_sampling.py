"""One sampling rule for every API (router/sampling.py): the OpenAI bodies, /v2's parameters and the public gRPC
API's give the same SamplingParams for the same fields."""

from __future__ import annotations

import pytest

from protos.segserve.v1 import generation_pb2 as pb
from router.grpc_convert import to_sampling as grpc_sampling
from router.protocol import CompletionRequest
from router.sampling import AskedSampling, choice_seed, sampling_params
from router.v2 import Parameters

SHARED = [  # fields all three APIs take, in the names they share, with a temperature each takes
    {},
    {"temperature": 0.7},
    {"temperature": 1.0},  # sent: it samples
    {"top_k": 5},
    {"top_k": 0},
    {"top_p": 0.9},
    {"top_p": 1.0},
    {"typical_p": 0.5},
    {"repetition_penalty": 1.3, "seed": 7},
    {"temperature": 0.5, "top_k": 40, "top_p": 0.95, "seed": 2**64 - 1},
]


@pytest.mark.parametrize("fields", SHARED, ids=[str(f) for f in SHARED])
@pytest.mark.parametrize("do_sample", [False, True])
def test_v2_and_grpc_sample_alike(fields, do_sample):
    v2 = Parameters(do_sample=do_sample, **fields).to_sampling()
    assert v2 == grpc_sampling(pb.GenerationParameters(do_sample=do_sample, **fields), 0)


GREEDY = [{"temperature": 0.0}, {"temperature": 5e-6, "top_k": 5}]  # greedy, whatever else is set


@pytest.mark.parametrize("fields", SHARED + GREEDY, ids=[str(f) for f in SHARED + GREEDY])
def test_openai_samples_as_the_others_do_with_do_sample(fields):
    """OpenAI's APIs have no do_sample and sample by default: as do_sample true elsewhere."""
    openai = CompletionRequest(prompt="x", **fields).to_sampling()
    assert openai == grpc_sampling(pb.GenerationParameters(do_sample=True, **fields), 0)


def test_a_v2_temperature_is_never_greedy():
    """MindIE's temperature is > 0: a 0 goes on for the contract to refuse, a tiny one samples."""
    assert Parameters(temperature=0.0).to_sampling().temperature == 0.0
    assert (Parameters(temperature=5e-6).to_sampling().do_sample, grpc_sampling(pb.GenerationParameters(
        temperature=5e-6), 0).do_sample) == (True, False)


@pytest.mark.parametrize(("asked", "is_sampled", "temperature"), [
    (AskedSampling(), False, 1.0),
    (AskedSampling(is_sampled_by_default=True), True, 1.0),
    (AskedSampling(do_sample=True, temperature=0.0), False, 1.0),
    (AskedSampling(is_sampled_by_default=True, temperature=1e-6), False, 1.0),
    (AskedSampling(temperature=0.7), True, 0.7),
    (AskedSampling(temperature=-1.0), True, -1.0),  # goes on, for the contract to refuse
    (AskedSampling(temperature=0.0, is_zero_temperature_greedy=False), True, 0.0),  # /v2's: refused
    (AskedSampling(top_k=3), True, 1.0),
    (AskedSampling(typical_p=1.0, top_p=1.0, top_k=0), False, 1.0),
])
def test_the_greedy_rule(asked, is_sampled, temperature):
    sampling = sampling_params(asked)
    assert (sampling.do_sample, sampling.temperature) == (is_sampled, temperature)


def test_choices_get_consecutive_seeds_and_logprobs_ask_for_one_at_least():
    asked = AskedSampling(seed=2**64 - 1, num_top_logprobs=0)
    assert [sampling_params(asked, i).seed for i in range(3)] == [2**64 - 1, 0, 1]
    assert sampling_params(asked).num_top_logprobs == 1
    assert sampling_params(AskedSampling()).num_top_logprobs == 0
    assert choice_seed(-1, 1) == 0 and choice_seed(2**64, 1) == 2**64  # out of range: left for the contract
