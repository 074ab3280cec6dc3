"""The public gRPC API's messages (protos/segserve/v1/generation.proto) to and from the router's own types.

In: a `GenerationRequest`. Out: the prompt's token ids (prompts.py: the same
tokenization and chat template as /v1), one validated `GenerationJob` per
choice (the contract's validate_request through admission.check_request, so a
refusal is a 400 `APIError` whose `param` is the gRPC field path, e.g.
`parameters.top_p`), and the body data reflow records. Back: the `Delta`s of
generation.py (after stop strings and the merge of n choices) as stream events
or as the one Generate answer.

A structured output (`parameters.structured_output`, one kind of its oneof)
becomes the contract's `StructuredOutput` of every choice, as /v1's
`structured_outputs` does (router/structured.py's schema_object and
compact_json); errors name the kind's path, e.g.
`parameters.structured_output.json_schema`. Whether its grammar compiles is
grpc_api.py's check (structured.check_compiles), after the contract's.

Sampling follows the rule every API follows (router/sampling.py): `do_sample`
samples, and so does any sampling parameter sent and not off; a temperature in
[0, 1e-5) is greedy; choice i's seed is seed + i.

Speculative decoding shows in `step_num_tokens`: the scheduler sends one chunk
per step, so `StepSizes` (a StreamObserver of the choice's stream) notes each
chunk's token count (1 + the drafts accepted in that step) as the chunks are
taken, and each Delta takes the counts of the tokens it covers (generation.py
merges the chunks a busy consumer did not read in time into one Delta).
"""

from __future__ import annotations

import collections
import dataclasses
import time

from google.protobuf.json_format import MessageToDict

from protos.segserve.v1 import generation_pb2 as pb
from protos.segserve.v1.generate import FinishReason, GenerateEvent, TokenChunk
from protos.segserve.v1.sampling import RANGES, SamplingParams, StructuredKind, StructuredOutput
from protos.segserve.v1.step_result import PromptLogprobs
from router.choices import MAX_CHOICES
from router.errors import APIError, bad_request
from router.generation import Delta, GenerationJob, TokenLogprob
from router.jobs import build_jobs
from router.prompts import chat_prompt_ids, completion_prompt_ids
from router.protocol import MAX_STOP_STRINGS
from router.responses import by_choice
from router.sampling import AskedSampling, sampling_params
from router.scheduler_streams import StreamObserver
from router.state import RouterState
from router.structured import compact_json, schema_object, tag_object

CHAT_ROLES = ("system", "developer", "user", "assistant", "tool")
# The contract's field names -> GenerationRequest's field paths (admission.check_request).
FIELD_PATHS = {
    **{name: f"parameters.{name}" for name in (*RANGES, "do_sample", "watermark", "ignore_eos", "stop_token_ids")},
    "num_top_logprobs": "parameters.logprobs",
    "num_prompt_logprobs": "parameters.prompt_logprobs",
    "request_id": "request_id",
}
STRUCTURED_KINDS = {"json_schema": StructuredKind.JSON_SCHEMA, "json_object": StructuredKind.JSON_OBJECT,
                    "regex": StructuredKind.REGEX, "choice": StructuredKind.CHOICE, "grammar": StructuredKind.GRAMMAR,
                    "structural_tag": StructuredKind.STRUCTURAL_TAG}
"""GenerationStructuredOutput's alternatives -> the contract's kinds."""
_FINISH = {
    FinishReason.EOS_TOKEN: pb.GENERATION_FINISH_REASON_EOS_TOKEN,
    FinishReason.STOP_TOKEN: pb.GENERATION_FINISH_REASON_STOP,
    FinishReason.LENGTH: pb.GENERATION_FINISH_REASON_LENGTH,
    FinishReason.CONTEXT_LENGTH: pb.GENERATION_FINISH_REASON_LENGTH,
    FinishReason.ERROR: pb.GENERATION_FINISH_REASON_ERROR,
}


@dataclasses.dataclass(frozen=True)
class Prompt:
    """A request's input, tokenized."""

    token_ids: list[int]
    field: str
    """The request field it came from ("prompt" or "messages"), named in errors."""


def prompt_of(state: RouterState, text: str, messages, text_field: str = "prompt") -> Prompt:
    """The token ids of a completion text or a chat (exactly one given), as /v1 tokenizes them; errors name
    `text_field` (the request's name for the text) or `messages`."""
    if text and messages:
        raise bad_request(f"Invalid request: set one of `{text_field}` and `messages`, not both", text_field)
    if messages:
        for index, message in enumerate(messages):
            if message.role not in CHAT_ROLES:
                param = f"messages[{index}].role"
                raise bad_request(f"Invalid request: `{param}` must be one of {', '.join(CHAT_ROLES)} "
                                  f"(got {message.role[:40]!r})", param)
        template = [{"role": m.role, "content": m.content} for m in messages]
        return Prompt(chat_prompt_ids(state.tokenizer, template), "messages")
    if not text:
        raise bad_request(f"Invalid request: `{text_field}` (or `messages`) is required and must not be empty",
                          text_field)
    try:
        return Prompt(completion_prompt_ids(state.tokenizer, text), text_field)
    except APIError as exc:  # it tokenizes to nothing
        raise bad_request(exc.message.replace("the prompt", f"`{text_field}`"), text_field) from None


def structured_output(params: pb.GenerationParameters) -> tuple[str, StructuredOutput] | None:
    """(the field path that asked for it, the contract's structured output); None = free text. A kind left
    unset, a false json_object or a json_schema that is not a JSON object is a 400 naming the field; the rest
    of the shape (an empty regex or choice list, the size) is the contract's to refuse."""
    if not params.HasField("structured_output"):
        return None
    message = params.structured_output
    kind = message.WhichOneof("kind")
    if kind is None:
        param = "parameters.structured_output"
        raise bad_request(f"Invalid request: `{param}` must set one of {', '.join(STRUCTURED_KINDS)}", param)
    param = f"parameters.structured_output.{kind}"
    if kind in ("json_schema", "structural_tag"):
        try:
            spec = compact_json((schema_object if kind == "json_schema" else tag_object)(getattr(message, kind)))
        except ValueError as exc:
            raise bad_request(f"Invalid request: `{param}` {exc}", param) from None
    elif kind == "json_object":
        if not message.json_object:
            raise bad_request(f"Invalid request: `{param}` must be true (for free text, leave "
                              "`parameters.structured_output` out)", param)
        spec = ""
    elif kind == "choice":
        spec = compact_json(list(message.choice.choices))
    else:
        spec = getattr(message, kind)
    return param, StructuredOutput(STRUCTURED_KINDS[kind], spec)


def to_sampling(params: pb.GenerationParameters, choice_index: int,
                structured: StructuredOutput | None = None) -> SamplingParams:
    """The contract's sampling for choice `choice_index` (router/sampling.py), constrained to `structured`
    (structured_output's); unchecked."""
    def sent(name: str):
        return getattr(params, name) if params.HasField(name) else None

    return sampling_params(AskedSampling(
        do_sample=params.do_sample, temperature=sent("temperature"), top_k=params.top_k, top_p=sent("top_p"),
        typical_p=sent("typical_p"), repetition_penalty=sent("repetition_penalty"),
        frequency_penalty=params.frequency_penalty, presence_penalty=params.presence_penalty, seed=sent("seed"),
        num_top_logprobs=sent("logprobs"), num_prompt_logprobs=sent("prompt_logprobs"), watermark=params.watermark,
        logit_bias=dict(params.logit_bias), structured_output=structured), choice_index)


def stop_strings(params: pb.GenerationParameters) -> list[str]:
    stops = list(params.stop)
    if len(stops) > MAX_STOP_STRINGS or not all(stops):
        raise bad_request(f"Invalid request: `parameters.stop` takes at most {MAX_STOP_STRINGS} strings, none empty "
                          f"(got {len(stops)})", "parameters.stop")
    return stops


def choice_jobs(state: RouterState, request: pb.GenerationRequest, prompt: Prompt, scheduler_id: str,
                timeout_s: float | None, structured: tuple[str, StructuredOutput] | None = None
                ) -> list[GenerationJob]:
    """One validated job per choice, each with the output budget /v1 would give it (prompts.output_budget) and
    `structured` (structured_output's, its field path named in errors)."""
    params = request.parameters
    num_choices = params.n or 1
    if num_choices > MAX_CHOICES:
        raise bad_request(f"Invalid request: `parameters.n` must be in [1, {MAX_CHOICES}] (got {num_choices})",
                          "parameters.n")
    request_ids = [scheduler_id] if num_choices == 1 else [f"{scheduler_id}-{i}" for i in range(num_choices)]
    names = {**FIELD_PATHS, "prompt_token_ids": prompt.field,
             "structured_output": structured[0] if structured else "parameters.structured_output"}
    max_tokens = params.max_tokens if params.HasField("max_tokens") else None
    return build_jobs(state, prompt.token_ids, request_ids, max_tokens, state.config.default_max_tokens,
                      lambda index: to_sampling(params, index, structured[1] if structured else None), names,
                      stop_token_ids=params.stop_token_ids, ignore_eos=params.ignore_eos,
                      num_top_logprobs=params.logprobs if params.HasField("logprobs") else None, timeout_s=timeout_s)


def reflow_body(request: pb.GenerationRequest, served_name: str) -> dict:
    """What data reflow records as the request: the shape of the HTTP bodies (`prompt`, or `messages` as
    {role, content}), so that the session of a chat is derived from the same opening over either protocol."""
    body: dict = {"model": served_name, "protocol": "grpc"}
    if request.messages:
        body["messages"] = [{"role": m.role, "content": m.content, **({"name": m.name} if m.name else {})}
                            for m in request.messages]
    else:
        body["prompt"] = request.prompt
    body["parameters"] = MessageToDict(request.parameters, preserving_proto_field_name=True)
    return body


class StepSizes(StreamObserver):
    """One choice's step sizes: how many tokens each of the scheduler's chunks brought, noted as they are taken."""

    def __init__(self) -> None:
        self._sizes: collections.deque[int] = collections.deque()

    def took(self, events: list[GenerateEvent], now_s: float) -> None:
        for event in events:
            if isinstance(event, TokenChunk) and event.token_ids:
                self._sizes.append(len(event.token_ids))

    def take(self, num_tokens: int) -> list[int]:
        """The step sizes behind the next `num_tokens` tokens (whole steps: a Delta never splits a chunk)."""
        steps = []
        while num_tokens > 0 and self._sizes:
            steps.append(self._sizes.popleft())
            num_tokens -= steps[-1]
        return steps


def finish_reason(delta: Delta) -> int:
    """The proto finish reason of a choice's last Delta."""
    done = delta.complete
    if delta.finish_reason == "stop" and (done is None or done.finish_reason is not FinishReason.EOS_TOKEN):
        return pb.GENERATION_FINISH_REASON_STOP  # cut at a stop string by stop.py, or a stop token id
    if done is None:
        return pb.GENERATION_FINISH_REASON_UNSPECIFIED
    return _FINISH.get(done.finish_reason, pb.GENERATION_FINISH_REASON_EOS_TOKEN)


class _Costs:
    """One choice's measured costs (v2.py's `details`, per choice): router clock from the request's arrival."""

    def __init__(self, arrived_s: float) -> None:
        self.arrived_s = arrived_s
        self.num_tokens = self.batch_size = self.queue_wait_us = 0
        self.first_token_s: float | None = None
        self.last_token_s = arrived_s

    def read(self, delta: Delta) -> None:
        if delta.num_tokens:
            if self.first_token_s is None:
                self.first_token_s = delta.received_s
            self.num_tokens += delta.num_tokens
            self.last_token_s = delta.received_s
        if delta.batch_size:
            self.batch_size, self.queue_wait_us = delta.batch_size, delta.queue_wait_us
        if delta.complete is not None:
            done = delta.complete
            self.num_tokens, self.batch_size = done.num_generated_tokens, done.max_batch_size or self.batch_size
            self.queue_wait_us = done.queue_wait_us or self.queue_wait_us

    def to_pb(self) -> pb.GenerationDetails:
        first_s = self.last_token_s if self.first_token_s is None else self.first_token_s
        return pb.GenerationDetails(generated_tokens=self.num_tokens,
                                    first_token_cost_ms=(first_s - self.arrived_s) * 1e3,
                                    decode_cost_ms=(self.last_token_s - first_s) * 1e3,
                                    queue_wait_us=self.queue_wait_us, batch_size=self.batch_size)


class Renderer:
    """Deltas of one request to the API's messages; knows the request's id, tokens, choices and options."""

    def __init__(self, state: RouterState, response_id: str, prompt_ids: list[int], step_sizes: list[StepSizes],
                 is_details: bool, arrived_s: float | None = None) -> None:
        self.response_id = response_id
        self.model = state.served_name
        self.token_texts = state.token_texts
        self.prompt_ids = prompt_ids
        self.step_sizes = step_sizes
        self.is_details = is_details
        arrived_s = time.monotonic() if arrived_s is None else arrived_s
        self._costs = [_Costs(arrived_s) for _ in step_sizes]

    def event(self, delta: Delta) -> pb.GenerationStreamResponse | None:
        """The stream event of `delta`; None when it carries nothing (no text, token, end or prompt logprob)."""
        costs = self._costs[delta.index]
        costs.read(delta)
        if not (delta.text or delta.token_ids or delta.finish_reason or delta.prompt_logprobs or delta.logprobs):
            return None
        steps = self.step_sizes[delta.index].take(delta.num_tokens)
        event = pb.GenerationStreamResponse(
            id=self.response_id, index=delta.index, text=delta.text, token_ids=delta.token_ids,
            logprobs=self._logprobs(delta.logprobs), step_num_tokens=steps,
            num_accepted_draft_tokens=sum(steps) - len(steps), prompt_logprobs=self._prompt_logprobs(delta),
            details=costs.to_pb() if self.is_details else None)
        if delta.finish_reason is not None:
            event.finish_reason = finish_reason(delta)
            event.error_message = _error_message(delta)
        if delta.usage is not None:
            event.usage.CopyFrom(delta.usage.to_pb())
        return event

    def response(self, deltas: list[Delta]) -> pb.GenerationResponse:
        """The one answer of Generate, from every Delta of every choice."""
        answer = pb.GenerationResponse(id=self.response_id, model=self.model)
        for choice in by_choice(deltas):
            last = choice[-1]
            for delta in choice:
                self._costs[delta.index].read(delta)
            steps = self.step_sizes[last.index].take(sum(d.num_tokens for d in choice))
            answer.choices.append(pb.GenerationChoice(
                index=last.index, text="".join(d.text for d in choice),
                token_ids=[t for d in choice for t in d.token_ids],
                logprobs=self._logprobs([lp for d in choice for lp in d.logprobs]),
                finish_reason=finish_reason(last), error_message=_error_message(last), step_num_tokens=steps,
                details=self._costs[last.index].to_pb() if self.is_details else None))
            if last.index == 0:
                answer.prompt_logprobs.extend(lp for d in choice for lp in self._prompt_logprobs(d))
        if deltas[-1].usage is not None:
            answer.usage.CopyFrom(deltas[-1].usage.to_pb())
        return answer

    def _logprobs(self, logprobs: list[TokenLogprob]) -> list[pb.TokenLogprob]:
        return [self._token_logprob(lp.token_id, lp.logprob, lp.top) for lp in logprobs]

    def _token_logprob(self, token_id: int, logprob: float, top) -> pb.TokenLogprob:
        text = self.token_texts.get
        return pb.TokenLogprob(token_id=token_id, token=text(token_id)[0], logprob=logprob,
                               top=[pb.TokenAlternative(token_id=t, token=text(t)[0], logprob=v) for t, v in top])

    def _prompt_logprobs(self, delta: Delta) -> list[pb.PromptTokenLogprob]:
        prompt: PromptLogprobs | None = delta.prompt_logprobs
        if prompt is None:
            return []
        out = []
        for offset, logprob in enumerate(prompt.logprobs):
            position = prompt.start + offset
            top = prompt.top_logprobs[offset] if offset < len(prompt.top_logprobs) else None
            alternatives = [] if top is None else list(zip(top.token_ids, top.logprobs))
            out.append(pb.PromptTokenLogprob(
                position=position, token=self._token_logprob(self.prompt_ids[position], logprob, alternatives)))
        return out


def _error_message(delta: Delta) -> str:
    done = delta.complete
    if done is None or done.finish_reason is not FinishReason.ERROR:
        return ""
    return done.error_message or "the request failed in the worker"
