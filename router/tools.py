"""Tool calling on /v1/chat/completions: the body's `tools` and `tool_choice`, what they make of the prompt and
of the grammar, and how a choice's text becomes `tool_calls`.

In: the request's tool definitions (OpenAI's `{"type": "function", "function": {name, description,
parameters}}`), its `tool_choice` and `parallel_tool_calls`, and the chat history, whose assistant turns may
carry `tool_calls` and whose `role: "tool"` turns answer them. The tools go to the chat template (its `tools`
variable) whatever the choice; an assistant turn's arguments reach the template as an object, as templates
render them with `tojson`.

Out, by `tool_choice`:
- `none`: plain text, as without tools.
- `auto` (the default when tools are given): the model chooses; its text is read by the server's tool-call
  parser (`--tool-call-parser`, tool_parsers.py), for which only a call naming one of the request's tools is a
  call. Without a parser, `auto` is a 400: nothing could read the calls.
- `required`: the grammar makes the output a JSON array of `{"name": ..., "parameters": {...}}`, one item a
  call, each name one of the tools and its parameters valid for that tool's schema (one item without
  `parallel_tool_calls`).
- a named function: the grammar makes the whole output that function's arguments, valid for its schema.

Each of these reads a choice's text through a `CallReader` (`parse` for a whole text, `feed` and `finish` for a
stream), whose calls come out as OpenAI's `message.tool_calls` and streamed `delta.tool_calls`: the call's
id and name first, then fragments of its arguments. A choice that calls a tool and ends on its own (not cut by
`max_tokens`) finishes with `tool_calls`. Text a reader cannot read as calls stays content, never an error.
"""

from __future__ import annotations

import json
import re
import uuid
from typing import Any, Literal, Protocol

from pydantic import BaseModel, ConfigDict, field_validator, model_serializer

from protos.segserve.v1.sampling import StructuredKind, StructuredOutput
from router.structured import compact_json, schema_object
from router.tool_parsers import (
    PARSERS,
    ParsedOutput,
    ToolCall,
    ToolCallDelta,
    tool_parser,
)

MAX_TOOLS = 128
_FUNCTION_NAME = re.compile(r"[A-Za-z0-9_.-]{1,64}")
ANY_OBJECT = {"type": "object"}


class FunctionDefinition(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)

    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    """The JSON schema of the arguments; none = any object."""
    strict: bool | None = None
    """Accepted: a forced call's arguments always follow the schema."""

    @field_validator("name")
    @classmethod
    def _name(cls, name: str) -> str:
        if not _FUNCTION_NAME.fullmatch(name):
            raise ValueError("must be 1 to 64 letters, digits, '_', '.' or '-'")
        return name

    @field_validator("parameters", mode="before")
    @classmethod
    def _schema(cls, schema: object) -> dict | None:
        return None if schema is None else schema_object(schema)

    @property
    def schema(self) -> dict:
        return self.parameters if self.parameters is not None else ANY_OBJECT


class Tool(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)

    type: Literal["function"]
    function: FunctionDefinition


class FunctionName(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)

    name: str


class NamedToolChoice(BaseModel):
    """`{"type": "function", "function": {"name": ...}}`: call this function."""

    model_config = ConfigDict(extra="ignore", strict=True)

    type: Literal["function"]
    function: FunctionName


ToolChoice = Literal["none", "auto", "required"] | NamedToolChoice


class CalledFunction(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)

    name: str
    arguments: str
    """The arguments as JSON text."""


class CallIn(BaseModel):
    """A tool call of an earlier assistant turn, as the client sends it back."""

    model_config = ConfigDict(extra="ignore", strict=True)

    id: str = ""
    type: Literal["function"] = "function"
    function: CalledFunction


def check_tools(tools: list[Tool] | None, tool_choice: ToolChoice | None) -> None:
    """ValueError unless the tool choice can be met by the tools: any choice but `none` needs tools (as OpenAI
    refuses it), and a named function must be among them."""
    if tools is not None and len(tools) > MAX_TOOLS:
        raise ValueError(f"at most {MAX_TOOLS} tools are allowed (got {len(tools)})")
    names = [tool.function.name for tool in tools or []]
    if len(set(names)) != len(names):
        raise ValueError("tool names must be unique")
    if tool_choice is not None and tool_choice != "none" and not names:
        shown = f'"{tool_choice}"' if isinstance(tool_choice, str) else "naming a function"
        raise ValueError(f"tool_choice {shown} needs `tools`; without tools only \"none\" is allowed")
    if isinstance(tool_choice, NamedToolChoice) and tool_choice.function.name not in names:
        raise ValueError(f"tool_choice names the function {tool_choice.function.name!r}, which is not in `tools`")


def tool_mode(tools: list[Tool] | None, tool_choice: ToolChoice | None) -> str:
    """"none", "auto", "required" or "named": what the tool choice asks (auto when tools are given alone)."""
    if isinstance(tool_choice, NamedToolChoice):
        return "named"
    if tool_choice is None:
        return "auto" if tools else "none"
    return tool_choice


def forced_output(tools: list[Tool], tool_choice: ToolChoice, is_parallel: bool) -> StructuredOutput | None:
    """The grammar that forces the chosen calls: a named function's arguments, or the array of `required`
    calls; None when the model chooses (`auto`, `none`)."""
    mode = tool_mode(tools, tool_choice)
    if mode == "named":
        function = next(tool.function for tool in tools if tool.function.name == tool_choice.function.name)
        return StructuredOutput(StructuredKind.JSON_SCHEMA, compact_json(function.schema))
    if mode != "required":
        return None
    calls = [{"type": "object", "properties": {"name": {"type": "string", "enum": [tool.function.name]},
                                               "parameters": tool.function.schema},
              "required": ["name", "parameters"], "additionalProperties": False} for tool in tools]
    schema = {"type": "array", "minItems": 1, "items": calls[0] if len(calls) == 1 else {"anyOf": calls}}
    if not is_parallel:
        schema["maxItems"] = 1
    return StructuredOutput(StructuredKind.JSON_SCHEMA, compact_json(schema))


def template_tools(tools: list[Tool] | None) -> list[dict] | None:
    """The tools as chat templates take them (OpenAI's shape, no nulls)."""
    if not tools:
        return None
    return [tool.model_dump(exclude_none=True) for tool in tools]


def template_calls(calls: list[CallIn]) -> list[dict]:
    """An assistant turn's calls as chat templates take them: arguments as an object where they are one."""
    return [{"id": call.id, "type": "function",
             "function": {"name": call.function.name, "arguments": _arguments_object(call.function.arguments)}}
            for call in calls]


def _arguments_object(arguments: str) -> dict | str:
    try:
        value = json.loads(arguments)
    except ValueError:
        return arguments
    return value if isinstance(value, dict) else arguments


def call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


# Readers: a choice's text -> content and calls.


class CallReader(Protocol):
    """Reads one choice's text: whole (`parse`) or streamed (`feed` each piece, then `finish`)."""

    def parse(self, text: str) -> ParsedOutput: ...

    def feed(self, text: str) -> tuple[str, list[ToolCallDelta]]:
        """The content that became final with this piece, and the call deltas it completes."""

    def finish(self) -> tuple[str, list[ToolCallDelta]]:
        """What was held back, at the end of the output."""


class NamedCall:
    """A named function's output: the whole text is its arguments (the grammar saw to it)."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.id = call_id()
        self._is_started = False

    def parse(self, text: str) -> ParsedOutput:
        return ParsedOutput(None, (ToolCall(self.id, self.name, text),))

    def feed(self, text: str) -> tuple[str, list[ToolCallDelta]]:
        if self._is_started:
            return "", [ToolCallDelta(0, arguments=text)] if text else []
        self._is_started = True
        return "", [ToolCallDelta(0, self.id, self.name, text)]

    def finish(self) -> tuple[str, list[ToolCallDelta]]:
        return self.feed("") if not self._is_started else ("", [])


class RequiredCalls:
    """`required`'s output: a JSON array of {"name", "parameters"} objects. Streamed, each call goes out whole
    once its object is complete; text that is not such an array (cut short by max_tokens) stays content."""

    def __init__(self) -> None:
        self._text = ""
        self._position = 0  # where the next unread object may start
        self._calls: list[ToolCall] = []

    def parse(self, text: str) -> ParsedOutput:
        try:
            items = json.loads(text)
        except ValueError:
            return ParsedOutput(text or None, ())
        calls = [_required_call(item) for item in items] if isinstance(items, list) else [None]
        if not calls or None in calls:
            return ParsedOutput(text or None, ())
        return ParsedOutput(None, tuple(calls))

    def feed(self, text: str) -> tuple[str, list[ToolCallDelta]]:
        self._text += text
        deltas = []
        decoder = json.JSONDecoder()
        while True:
            start = self._position
            while start < len(self._text) and self._text[start] in "[, ":
                start += 1
            try:
                item, end = decoder.raw_decode(self._text, start)
            except ValueError:
                return "", deltas
            call = _required_call(item)
            if call is None:
                return "", deltas
            self._position = end
            deltas.append(ToolCallDelta(len(self._calls), call.id, call.name, call.arguments))
            self._calls.append(call)

    def finish(self) -> tuple[str, list[ToolCallDelta]]:
        if self._calls:
            return "", []
        return self._text, []


def _required_call(item: object) -> ToolCall | None:
    if not (isinstance(item, dict) and isinstance(item.get("name"), str) and isinstance(item.get("parameters"), dict)):
        return None
    return ToolCall(call_id(), item["name"], json.dumps(item["parameters"], ensure_ascii=False))


class SingleCall:
    """A reader that keeps only the first call (`parallel_tool_calls: false` under `auto`)."""

    def __init__(self, reader: CallReader) -> None:
        self.reader = reader

    def parse(self, text: str) -> ParsedOutput:
        parsed = self.reader.parse(text)
        return ParsedOutput(parsed.content, parsed.tool_calls[:1])

    def feed(self, text: str) -> tuple[str, list[ToolCallDelta]]:
        content, deltas = self.reader.feed(text)
        return content, [delta for delta in deltas if delta.index == 0]

    def finish(self) -> tuple[str, list[ToolCallDelta]]:
        content, deltas = self.reader.finish()
        return content, [delta for delta in deltas if delta.index == 0]


def call_reader(mode: str, tool_choice: ToolChoice | None, parser_name: str, is_parallel: bool,
                tools: list[Tool] | None = None) -> CallReader:
    """A fresh reader for one choice of a request in tool `mode` (not "none"). Under `auto`, only a call of one
    of `tools` is a call (None: of any name)."""
    if mode == "named":
        return NamedCall(tool_choice.function.name)
    if mode == "required":
        return RequiredCalls()
    tool_names = None if tools is None else frozenset(tool.function.name for tool in tools)
    reader = tool_parser(parser_name, tool_names)
    return reader if is_parallel else SingleCall(reader)


def known_parsers() -> str:
    return ", ".join(PARSERS)


class ToolCallFunctionOut(BaseModel):
    name: str
    arguments: str


class ToolCallOut(BaseModel):
    """An entry of `message.tool_calls`."""

    id: str
    type: str = "function"
    function: ToolCallFunctionOut

    @classmethod
    def of(cls, call: ToolCall) -> ToolCallOut:
        return cls(id=call.id, function=ToolCallFunctionOut(name=call.name, arguments=call.arguments))


class ToolCallDeltaOut(BaseModel):
    """An entry of a streamed `delta.tool_calls`: id, type and name on a call's first entry, then fragments of
    its arguments."""

    index: int
    id: str | None = None
    type: str | None = None
    function: dict[str, str]

    @model_serializer(mode="wrap")
    def _without_nulls(self, serialize) -> dict:
        return {key: value for key, value in serialize(self).items() if value is not None}

    @classmethod
    def of(cls, delta: ToolCallDelta) -> ToolCallDeltaOut:
        function = {"arguments": delta.arguments}
        if delta.name is not None:
            function = {"name": delta.name, **function}
        return cls(index=delta.index, id=delta.id, type="function" if delta.id is not None else None,
                   function=function)
