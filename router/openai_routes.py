"""The OpenAI-compatible routes: POST /v1/completions, POST /v1/chat/completions, GET /v1/models[/{model}].

A request's life: the pydantic body checks types (protocol.py); the prompt (each
of a completion's prompts) is tokenized (prompts.py), which fixes the output
budget (prompts.output_budget); each of the n choices (per prompt) becomes a
contract GenerateRequest (router/jobs.py, as /v2's and gRPC's) that admission.py validates with the contract's
validator and against the context left (a 400 naming the field in OpenAI's
words, before the scheduler sees anything), and a structured output's grammar
must compile (structured.check_compiles); serving.py runs the jobs (one per
choice, merged by choices.py; stop strings cut by stop.py; a finished JSON
output validated by output_validation.py) and a renderer
(responses.py) shapes the answer, SSE when `stream`.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator

from fastapi import APIRouter, Request
from fastapi.responses import Response

from router.choices import merge_choices
from router.errors import bad_request
from router.generation import GenerationJob
from router.jobs import build_jobs
from router.output_validation import validated_outputs
from router.prompts import chat_prompt_ids, completion_prompt_ids
from router.protocol import ChatCompletionRequest, CompletionRequest, SamplingRequest
from router.responses import ChatRenderer, ChoicePrompt, CompletionRenderer
from router.serving import job_events, respond_events
from router.state import RouterState, StateDep
from router.stop import stop_at_strings
from router.structured import check_compiles
from router.tools import CallReader, call_reader, known_parsers, template_tools

# OpenAPI: a 200 is either a JSON body or, with `stream`, SSE events.
STREAM_OR_JSON = {200: {"content": {"application/json": {}, "text/event-stream": {"schema": {
    "type": "object", "properties": {"data": {"type": "string"}}, "required": ["data"]}}}}}

router = APIRouter()


@router.post("/v1/completions", responses=STREAM_OR_JSON)
async def completions(body: CompletionRequest, request: Request, state: StateDep) -> Response:
    state.check_model(body.model)
    prompts = body.prompts
    prompt_ids = [completion_prompt_ids(state.tokenizer, prompt, body.add_special_tokens) for prompt in prompts]
    num_choices, response_id = body.num_choices, f"cmpl-{uuid.uuid4().hex}"
    request_ids = generation_ids(response_id, len(prompts) * num_choices)
    jobs = [job for number, ids in enumerate(prompt_ids)
            for job in choice_jobs(state, body, ids, request_ids[number * num_choices:][:num_choices])]
    await check_structured_output(body)
    num_listed = None if body.stream else body.num_prompt_logprobs  # vLLM lists them in whole answers only
    shown = None
    if body.echo or num_listed is not None:  # the ids were validated with the jobs: decoding them is safe
        shown = [ChoicePrompt(prompt if isinstance(prompt, str) else state.tokenizer.decode(ids), tuple(ids),
                              bool(body.echo), body.is_echo_only, num_listed)
                 for prompt, ids in zip(prompts, prompt_ids) for _ in range(num_choices)]
    renderer = CompletionRenderer(response_id, int(time.time()), state.served_name, state.token_texts,
                                  body.num_top_logprobs is not None, len(jobs), prompts=shown,
                                  num_logprobs=body.logprobs or 0)
    return await serve(state, request, body, jobs, renderer, [index // num_choices for index in range(len(jobs))])


@router.post("/v1/chat/completions", responses=STREAM_OR_JSON)
async def chat_completions(body: ChatCompletionRequest, request: Request, state: StateDep) -> Response:
    state.check_model(body.model)
    mode, parser = body.tool_mode, state.config.tool_call_parser
    if mode == "auto" and not parser:
        raise bad_request(f'tool_choice "auto" needs the server started with --tool-call-parser ({known_parsers()}) '
                          f'to read the calls; send tool_choice "required", a named function or "none"', "tool_choice")
    prompt_ids = chat_prompt_ids(state.tokenizer, body.template_messages(), template_tools(body.tools), body)
    response_id = f"chatcmpl-{uuid.uuid4().hex}"
    jobs = choice_jobs(state, body, prompt_ids, generation_ids(response_id, body.num_choices))
    await check_structured_output(body)
    readers = None
    if mode != "none":
        def readers() -> CallReader:
            return call_reader(mode, body.tool_choice, parser, body.is_parallel_tool_calls, body.tools)
    renderer = ChatRenderer(response_id, int(time.time()), state.served_name, state.token_texts,
                            body.num_top_logprobs is not None, len(jobs), call_reader=readers)
    return await serve(state, request, body, jobs, renderer)


@router.get("/v1/models")
async def list_models(state: StateDep) -> dict:
    return {"object": "list", "data": [_model_card(state)]}


@router.get("/v1/models/{model:path}")
async def retrieve_model(model: str, state: StateDep) -> dict:
    state.check_model(model)
    return _model_card(state)


def _model_card(state: RouterState) -> dict:
    return {"id": state.served_name, "object": "model", "created": state.created, "owned_by": "segserve",
            "max_model_len": state.model_info.max_model_len}


def generation_ids(response_id: str, count: int) -> list[str]:
    """The scheduler's request ids of a response's `count` generations: the response id for one, else
    `<id>-<index>`."""
    return [response_id] if count == 1 else [f"{response_id}-{index}" for index in range(count)]


def choice_jobs(state: RouterState, body: SamplingRequest, prompt_ids: list[int],
                request_ids: list[str]) -> list[GenerationJob]:
    """One validated job per choice of one prompt (`request_ids`: the n choices' ids), each with the output
    budget the prompt leaves (a 400 naming the field when the contract or the context refuses it; router/jobs.py)."""
    return build_jobs(state, prompt_ids, request_ids, body.requested_max_tokens, state.config.default_max_tokens,
                      body.to_sampling, body.api_names, ignore_eos=body.ignore_eos,
                      num_top_logprobs=body.num_top_logprobs, timeout_s=state.config.request_timeout_s or None,
                      include_speculation=body.include_speculation)


async def check_structured_output(body: SamplingRequest) -> None:
    """A 400 naming the body field unless the request's structured output (if any) compiles; after
    choice_jobs, so the contract's cheaper shape checks answer first."""
    if body.structured_request is not None:
        param, structured = body.structured_request
        await check_compiles(structured, param)


async def serve(state: RouterState, request: Request, body: SamplingRequest, jobs: list[GenerationJob],
                renderer, prompts: list[int] | None = None) -> Response:
    """Run the choices' jobs (stop strings applied per choice, choices merged) and answer with `renderer`;
    `prompts[i]` numbers job i's prompt (merge_choices), None when all share one."""
    stops = body.stop_strings

    def choice_events(job: GenerationJob, keepalive_s: float | None) -> AsyncIterator:
        events = job_events(state, job, keepalive_s)
        events = stop_at_strings(events, stops, len(job.prompt_token_ids)) if stops else events
        return validated_outputs(events, job)

    def open_events(keepalive_s: float | None) -> AsyncIterator:
        if len(jobs) == 1:
            return choice_events(jobs[0], keepalive_s)
        return merge_choices([choice_events(job, None) for job in jobs], keepalive_s, prompts)

    return await respond_events(state, request, open_events, renderer, body.stream, body.include_usage)
