"""One request body -> the validated GenerationJobs of its choices, the same way for every API.

Each edge (the OpenAI routes, /v2 and the public gRPC API) gives the prompt's token ids, its choices' request ids,
the output budget it asked for, each choice's SamplingParams (router/sampling.py) and its own names of the
contract's fields; `build_jobs` cuts the budget to the room the prompt leaves (prompts.output_budget), builds the
contract's request per choice and validates each (admission.check_request: a 400 naming the field in the API's
words), so an API differs from another in how it reads its body and renders its answer, never in what it sends.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING

from protos.segserve.v1.generate import GenerateRequest
from protos.segserve.v1.sampling import SamplingParams, StoppingCriteria
from router.admission import check_request
from router.generation import GenerationJob
from router.prompts import output_budget

if TYPE_CHECKING:
    from router.state import RouterState


def build_jobs(state: RouterState, prompt_ids: Sequence[int], request_ids: Sequence[str],
                requested_max_tokens: int | None, default_max_tokens: int, sampling: Callable[[int], SamplingParams],
                names: Mapping[str, str], *, stop_token_ids: Sequence[int] = (), ignore_eos: bool = False,
                num_top_logprobs: int | None = None, timeout_s: float | None = None,
                include_speculation: bool = False) -> list[GenerationJob]:  # fmt: skip
    """One validated job per choice (request_ids[i] is choice i's, sampled by sampling(i)), each with the output
    budget the prompt leaves of requested_max_tokens (None: default_max_tokens)."""
    max_tokens = output_budget(requested_max_tokens, len(prompt_ids), state.model_info.max_model_len,
                               default_max_tokens)
    stopping = StoppingCriteria(max_tokens=max_tokens, stop_token_ids=tuple(stop_token_ids), ignore_eos=ignore_eos)
    requests = [GenerateRequest(request_id, tuple(prompt_ids), sampling(index), stopping)
                for index, request_id in enumerate(request_ids)]
    for request in requests:
        check_request(request, state.model_info, names)
    return [GenerationJob(request, state.eos_token_ids, num_top_logprobs, timeout_s, include_speculation)
            for request in requests]
