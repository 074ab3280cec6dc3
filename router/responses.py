"""OpenAI response bodies (pydantic) and the renderers that build them from `Delta`s.

A renderer knows one endpoint's shapes: the streamed chunks (one per delta, the
usage chunk) and the whole non-streamed response. Deltas carry their choice's
index (of n); a stream interleaves choices and the non-streamed response lists
them in index order, each with its own finish_reason; the usage is the last
delta's (choices.py sums it over the choices). Logprobs come out in OpenAI's
two shapes: the legacy completions one (tokens / token_logprobs / top_logprobs /
text_offset) and the chat one (content: [{token, logprob, bytes, top_logprobs}]).

Completions logprobs are vLLM's, field by field: a token's `top_logprobs` is
the token itself first, then its alternatives (`logprobs` + 1 entries at most,
so `logprobs: 0` gives the token alone), and `text_offset` adds up the choice's
tokens' texts from 0 (a stream's chunks go on where the last one ended).
`echo`: each choice's text starts with the prompt (a token-id prompt's decoded
text, special tokens included); with logprobs, its logprobs start with the
prompt's tokens, as OpenAI's legacy API (and lm-evaluation-harness's
loglikelihood) has them: the first prompt token's token_logprobs and
top_logprobs entries are null, every other prompt token has its own logprob
under the model and its alternatives. vLLM's `prompt_logprobs` lists, in a whole
answer's choices, each prompt token's logprob and alternatives by token id with
their rank and text. The prompt's logprobs arrive in the scheduler's chunks
(Delta.prompt_logprobs, possibly over several before the first generated token);
a stream sends them with the choice's first chunk of text. Usage always carries
`prompt_tokens_details.cached_tokens`, 0 when nothing came from the prefix cache.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from pydantic import BaseModel, SerializeAsAny

from protos.segserve.v1.step_result import PromptLogprobs
from protos.segserve.v1.usage import Usage
from router.detokenizer import TokenTexts
from router.generation import Delta, TokenLogprob
from router.tools import CallReader, ToolCallDeltaOut, ToolCallOut

# JSON has no -inf; clients get a very small number instead (as vLLM does).
_MIN_LOGPROB = -9999.0


def _clean(logprob: float) -> float:
    return _MIN_LOGPROB if math.isnan(logprob) or logprob < _MIN_LOGPROB else logprob


class PromptTokensDetails(BaseModel):
    cached_tokens: int
    """Prompt tokens whose KV came from the prefix cache (0 when none did)."""


class UsageInfo(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails
    """Always present, as OpenAI's: `cached_tokens` is 0 when nothing came from the prefix cache."""

    @classmethod
    def of(cls, counts: Usage) -> UsageInfo:
        return cls(prompt_tokens=counts.prompt_tokens, completion_tokens=counts.completion_tokens,
                   total_tokens=counts.total_tokens,
                   prompt_tokens_details=PromptTokensDetails(cached_tokens=counts.cached_tokens))


class CompletionLogprobs(BaseModel):
    tokens: list[str]
    token_logprobs: list[float | None]
    """None for the first prompt token with `echo` (it has no context)."""
    top_logprobs: list[dict[str, float] | None]
    text_offset: list[int]


class CompletionChoice(BaseModel):
    """A streamed chunk's choice."""

    index: int = 0
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None


class PromptTokenLogprob(BaseModel):
    """One token of vLLM's `prompt_logprobs`."""

    logprob: float
    rank: int | None = None
    """1 for the most likely token; None when unknown (a prompt token outside its alternatives)."""
    decoded_token: str | None = None


class CompletionResponseChoice(CompletionChoice):
    """A choice of the non-streamed body."""

    prompt_logprobs: list[dict[int, PromptTokenLogprob] | None] | None = None
    """vLLM's extension: per prompt token (None for the first), its logprob and its alternatives', by token id."""


class CompletionResponse(BaseModel):
    """The non-streamed body (CompletionResponseChoice) and, with partial text, every streamed chunk."""

    id: str
    object: str = "text_completion"
    created: int
    model: str
    choices: list[SerializeAsAny[CompletionChoice]]
    usage: UsageInfo | None = None


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class ChatLogprob(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChatLogprobs(BaseModel):
    content: list[ChatLogprob]


class ChatMessageOut(BaseModel):
    role: str = "assistant"
    content: str | None
    """None when the choice is only tool calls."""
    tool_calls: list[ToolCallOut] | None = None


class ChatChoice(BaseModel):
    index: int = 0
    message: ChatMessageOut
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None


class ChatCompletionResponse(BaseModel):
    id: str
    object: str = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: UsageInfo | None = None


class ChatDelta(BaseModel):
    role: str | None = None
    content: str | None = None
    tool_calls: list[ToolCallDeltaOut] | None = None


class ChatStreamChoice(BaseModel):
    index: int = 0
    delta: ChatDelta
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None


class ChatCompletionChunk(BaseModel):
    id: str
    object: str = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatStreamChoice]
    usage: UsageInfo | None = None


_TEXT_SLOT = "\u0000segserve-text-slot\u0000"


class TextTemplate:
    """A streamed chunk's JSON with its text left open, so that a delta costs one string encoding, not a
    pydantic model: built once per choice index from the model's own serialization of a placeholder text,
    so the filled-in JSON is byte for byte what the model would give."""

    def __init__(self, build: Callable[[int, str], BaseModel]) -> None:
        self._build = build
        self._parts: dict[int, tuple[str, str]] = {}

    def fill(self, index: int, text: str) -> str:
        """The JSON of `build(index, text)`."""
        parts = self._parts.get(index)
        if parts is None:
            before, _, after = self._build(index, _TEXT_SLOT).model_dump_json().partition(json.dumps(_TEXT_SLOT))
            parts = self._parts[index] = (before, after)
        return parts[0] + json.dumps(text, ensure_ascii=False) + parts[1]


def by_choice(deltas: list[Delta]) -> list[list[Delta]]:
    """The deltas of each choice, in index order."""
    choices: dict[int, list[Delta]] = {}
    for delta in deltas:
        choices.setdefault(delta.index, []).append(delta)
    return [choices[index] for index in sorted(choices)]


def _finish_reason(deltas: list[Delta]) -> str | None:
    return next((d.finish_reason for d in deltas if d.finish_reason is not None), None)


class _Renderer:
    stream_done: str | None = "[DONE]"
    """The data of the SSE event that ends a stream (None = no end event)."""

    def __init__(self, response_id: str, created: int, model: str, token_texts: TokenTexts, want_logprobs: bool,
                 num_choices: int = 1):
        self.response_id = response_id
        self.created = created
        self.model = model
        self.token_texts = token_texts
        self.want_logprobs = want_logprobs
        self.num_choices = num_choices

    def start(self) -> list[BaseModel]:
        """Chunks sent before the first delta."""
        return []

    def text_chunk(self, index: int, text: str) -> str:
        """The JSON of a stream chunk carrying only `text` for choice `index`."""
        return self._text_chunk.fill(index, text)

    def _has_content(self, delta: Delta) -> bool:
        return bool(delta.text or delta.finish_reason or (self.want_logprobs and delta.logprobs))


@dataclass(frozen=True)
class ChoicePrompt:
    """What a completions choice shows of its prompt (`echo`, vLLM's `prompt_logprobs`)."""

    text: str
    token_ids: tuple[int, ...]
    is_echoed: bool = False
    """`echo`: the choice's text (and its logprobs) start with the prompt's."""
    is_echo_only: bool = False
    """`echo` with `max_tokens` 0: the prompt alone; the one token generated is left out."""
    num_listed_logprobs: int | None = None
    """The choice's `prompt_logprobs` list with this many alternatives per token; None = no list."""


_Scored = tuple[int, float | None, Sequence[tuple[int, float]]]
"""A token of a choice's logprobs: (id, logprob or None when it has none, its alternatives (id, logprob))."""


class CompletionRenderer(_Renderer):
    """/v1/completions. Logprobs as vLLM gives them: each token's `top_logprobs` is the token itself, then its
    alternatives (`num_logprobs` + 1 entries at most); `text_offset` adds up the choice's tokens' texts from 0."""

    def __init__(self, *args, prompts: list[ChoicePrompt] | None = None, num_logprobs: int = 0, **kwargs) -> None:
        """`prompts[i]`: what choice i shows of its prompt (None when no choice echoes or lists it);
        `num_logprobs`: the request's `logprobs` (alternatives per token)."""
        super().__init__(*args, **kwargs)
        self.prompts = prompts
        self.num_logprobs = num_logprobs
        self._text_offsets = [0] * self.num_choices  # per choice: where its next token's text starts
        self._is_echo_pending = [prompts is not None and prompts[i].is_echoed for i in range(self.num_choices)]
        # per choice: prompt position -> (its logprob, its alternatives), as the chunks bring them
        self._prompt_logprobs: list[dict[int, tuple[float, list[tuple[int, float]]]]] = \
            [{} for _ in range(self.num_choices)]
        self._text_chunk = TextTemplate(lambda index, text: self._body([CompletionChoice(index=index, text=text)]))

    def _take_prompt_logprobs(self, delta: Delta) -> None:
        prompt: PromptLogprobs | None = delta.prompt_logprobs
        if prompt is None or self.prompts is None:
            return
        for offset, logprob in enumerate(prompt.logprobs):
            top = prompt.top_logprobs[offset] if offset < len(prompt.top_logprobs) else None
            alternatives = [] if top is None else list(zip(top.token_ids, top.logprobs))
            self._prompt_logprobs[delta.index][prompt.start + offset] = (logprob, alternatives)

    def _is_echo_only(self, index: int) -> bool:
        return self.prompts is not None and self.prompts[index].is_echo_only

    def _prompt_tokens(self, index: int) -> list[_Scored]:
        """The prompt's tokens as they lead a choice's logprobs: the first (and any not reported) without one."""
        known = self._prompt_logprobs[index]
        return [(token_id, *known.get(position, (None, ()))) for position, token_id in
                enumerate(self.prompts[index].token_ids)]

    def _top(self, token_id: int, logprob: float, alternatives: Sequence[tuple[int, float]]) -> dict[str, float]:
        by_id = {token_id: logprob}
        for alternative, value in alternatives:
            by_id.setdefault(alternative, value)
        return {self.token_texts.get(t)[0]: _clean(v) for t, v in list(by_id.items())[:self.num_logprobs + 1]}

    def _logprobs(self, tokens: list[_Scored], index: int) -> CompletionLogprobs:
        """Choice `index`'s next tokens' logprobs, their text offsets going on from its earlier tokens'."""
        out = CompletionLogprobs(tokens=[], token_logprobs=[], top_logprobs=[], text_offset=[])
        for token_id, logprob, alternatives in tokens:
            token = self.token_texts.get(token_id)[0]
            out.tokens.append(token)
            out.text_offset.append(self._text_offsets[index])
            self._text_offsets[index] += len(token)
            out.token_logprobs.append(None if logprob is None else _clean(logprob))
            out.top_logprobs.append(None if logprob is None else self._top(token_id, logprob, alternatives))
        return out

    def _listed_prompt_logprobs(self, index: int) -> list[dict[int, PromptTokenLogprob] | None] | None:
        """vLLM's `prompt_logprobs` of a choice: None for the first token, then each token's logprob and its
        alternatives by id, with their ranks (a token's own rank is known when it is among its alternatives)."""
        prompt = None if self.prompts is None else self.prompts[index]
        if prompt is None or prompt.num_listed_logprobs is None:
            return None
        listed: list[dict[int, PromptTokenLogprob] | None] = []
        for token_id, logprob, alternatives in self._prompt_tokens(index):
            if logprob is None:
                listed.append(None)
                continue
            ranks = {alternative: rank for rank, (alternative, _) in enumerate(alternatives, 1)}
            entries = {token_id: (logprob, ranks.get(token_id))}
            for rank, (alternative, value) in enumerate(alternatives[:prompt.num_listed_logprobs], 1):
                entries.setdefault(alternative, (value, rank))
            listed.append({t: PromptTokenLogprob(logprob=_clean(v), rank=rank, decoded_token=self.token_texts.get(t)[0])
                           for t, (v, rank) in entries.items()})
        return listed

    def _body(self, choices: list[CompletionChoice], usage: Usage | None = None) -> CompletionResponse:
        return CompletionResponse(id=self.response_id, created=self.created, model=self.model, choices=choices,
                                  usage=UsageInfo.of(usage) if usage else None)

    def chunk(self, delta: Delta) -> CompletionResponse | str | None:
        """The stream's chunk for `delta` (as JSON text when it is only text), None when it has nothing to send.
        A choice's first chunk carries the echoed prompt (its logprobs arrive in chunks of their own before)."""
        index = delta.index
        if (delta.text and delta.finish_reason is None and not self.want_logprobs and not self._is_echo_pending[index]
                and delta.prompt_logprobs is None and not self._is_echo_only(index)):
            return self._text_chunk.fill(index, delta.text)  # the common case, without a model per token
        self._take_prompt_logprobs(delta)
        if not (delta.num_tokens or delta.finish_reason):
            return None  # only prompt logprobs: they go with the choice's first text
        text, tokens = self._choice_output(index, [delta])
        if not (text or delta.finish_reason or (self.want_logprobs and tokens)):
            return None
        logprobs = self._logprobs(tokens, index) if self.want_logprobs else None
        return self._body([CompletionChoice(index=index, text=text, logprobs=logprobs,
                                            finish_reason=delta.finish_reason)])

    def _choice_output(self, index: int, deltas: list[Delta]) -> tuple[str, list[_Scored]]:
        """The text and scored tokens `deltas` add to choice `index`: the echoed prompt's first, once."""
        text, tokens = "", []
        if self._is_echo_pending[index]:
            self._is_echo_pending[index] = False
            text, tokens = self.prompts[index].text, self._prompt_tokens(index)
        if not self._is_echo_only(index):
            text += "".join(d.text for d in deltas)
            tokens += [(lp.token_id, lp.logprob, lp.top) for d in deltas for lp in d.logprobs]
        return text, tokens

    def usage_chunk(self, usage: Usage) -> CompletionResponse:
        return self._body([], usage)

    def response(self, deltas: list[Delta]) -> CompletionResponse:
        choices = [self._choice(ds) for ds in by_choice(deltas)]
        return self._body(choices, deltas[-1].usage)

    def _choice(self, deltas: list[Delta]) -> CompletionResponseChoice:
        """One choice of the non-streamed body from all of its deltas."""
        index = deltas[0].index
        for delta in deltas:
            self._take_prompt_logprobs(delta)
        text, tokens = self._choice_output(index, deltas)
        return CompletionResponseChoice(index=index, text=text,
                                        logprobs=self._logprobs(tokens, index) if self.want_logprobs else None,
                                        finish_reason=_finish_reason(deltas),
                                        prompt_logprobs=self._listed_prompt_logprobs(index))


class ChatRenderer(_Renderer):
    """/v1/chat/completions. With `call_reader` (a request with tools), each choice's text is read by its own
    reader (tools.py) into content and tool calls."""

    def __init__(self, *args, call_reader: Callable[[], CallReader] | None = None, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._text_chunk = TextTemplate(
            lambda index, text: self._chunk([ChatStreamChoice(index=index, delta=ChatDelta(content=text))]))
        self._call_reader = call_reader
        self._readers: dict[int, CallReader] = {}
        self._calling: set[int] = set()  # choices that made a tool call

    def _reader(self, index: int) -> CallReader:
        if index not in self._readers:
            self._readers[index] = self._call_reader()
        return self._readers[index]

    def _finish_reason(self, index: int, finish_reason: str | None) -> str | None:
        """A choice that called a tool and ended on its own finishes with `tool_calls`."""
        return "tool_calls" if finish_reason == "stop" and index in self._calling else finish_reason

    def _logprobs(self, logprobs: list[TokenLogprob]) -> ChatLogprobs | None:
        if not self.want_logprobs:
            return None
        content = []
        for lp in logprobs:
            token, raw = self.token_texts.get(lp.token_id)
            top = [TopLogprob(token=self.token_texts.get(t)[0], logprob=_clean(v), bytes=self.token_texts.get(t)[1])
                   for t, v in lp.top]
            content.append(ChatLogprob(token=token, logprob=_clean(lp.logprob), bytes=raw, top_logprobs=top))
        return ChatLogprobs(content=content)

    def _chunk(self, choices: list[ChatStreamChoice], usage: Usage | None = None) -> ChatCompletionChunk:
        return ChatCompletionChunk(id=self.response_id, created=self.created, model=self.model, choices=choices,
                                   usage=UsageInfo.of(usage) if usage else None)

    def start(self) -> list[BaseModel]:
        return [self._chunk([ChatStreamChoice(index=index, delta=ChatDelta(role="assistant", content=""))])
                for index in range(self.num_choices)]

    def chunk(self, delta: Delta) -> ChatCompletionChunk | str | None:
        """The stream's chunk for `delta` (as JSON text when it is only text), None when it has nothing to send."""
        if self._call_reader is not None:
            return self._call_chunk(delta)
        if delta.text and delta.finish_reason is None and not self.want_logprobs:
            return self._text_chunk.fill(delta.index, delta.text)  # the common case, without a model per token
        if not self._has_content(delta):
            return None
        content = ChatDelta(content=delta.text) if delta.text or not delta.finish_reason else ChatDelta()
        choice = ChatStreamChoice(index=delta.index, delta=content, logprobs=self._logprobs(delta.logprobs),
                                  finish_reason=delta.finish_reason)
        return self._chunk([choice])

    def _call_chunk(self, delta: Delta) -> ChatCompletionChunk | None:
        """The chunk of a choice whose text its reader turns into content and tool-call deltas."""
        reader = self._reader(delta.index)
        content, calls = reader.feed(delta.text)
        if delta.finish_reason is not None:
            more_content, more_calls = reader.finish()
            content, calls = content + more_content, calls + more_calls
        if calls:
            self._calling.add(delta.index)
        if not (content or calls or delta.finish_reason or (self.want_logprobs and delta.logprobs)):
            return None
        out = ChatDelta(content=content or None, tool_calls=[ToolCallDeltaOut.of(call) for call in calls] or None)
        choice = ChatStreamChoice(index=delta.index, delta=out, logprobs=self._logprobs(delta.logprobs),
                                  finish_reason=self._finish_reason(delta.index, delta.finish_reason))
        return self._chunk([choice])

    def usage_chunk(self, usage: Usage) -> ChatCompletionChunk:
        return self._chunk([], usage)

    def _message(self, index: int, text: str) -> ChatMessageOut:
        if self._call_reader is None:
            return ChatMessageOut(content=text)
        parsed = self._reader(index).parse(text)
        if parsed.tool_calls:
            self._calling.add(index)
        return ChatMessageOut(content=parsed.content,
                              tool_calls=[ToolCallOut.of(call) for call in parsed.tool_calls] or None)

    def response(self, deltas: list[Delta]) -> ChatCompletionResponse:
        choices = [
            ChatChoice(index=ds[0].index, message=self._message(ds[0].index, "".join(d.text for d in ds)),
                       logprobs=self._logprobs([lp for d in ds for lp in d.logprobs]),
                       finish_reason=self._finish_reason(ds[0].index, _finish_reason(ds)))
            for ds in by_choice(deltas)
        ]
        last = deltas[-1]
        return ChatCompletionResponse(id=self.response_id, created=self.created, model=self.model,
                                      choices=choices, usage=UsageInfo.of(last.usage) if last.usage else None)
