"""Tool calls in a model's text: the `--tool-call-parser` formats, read whole or as the text streams.

In: the raw text of one choice, whole (`parse`) or in pieces as it is generated (`feed` each, then `finish`).
Out: its content text and its OpenAI tool calls. The formats, under the names vLLM gives its parsers of them:

- hermes (Qwen2.5, Hermes): `<tool_call>{"name": "f", "arguments": {...}}</tool_call>` blocks; the text around
  them is content.
- llama3_json: the whole output is call objects `{"name": "f", "parameters": {...}}`, optionally after
  `<|python_tag|>`, separated by `;`. An output that does not start with `{` (after whitespace and the tag) is
  content.
- mistral: `[TOOL_CALLS]` and a JSON array of call objects; the text before it is content.
- pythonic: the whole output is a Python list of calls with literal keyword arguments,
  `[get_weather(city="Paris"), ping()]`; anything else is content.
- qwen2_5_coder (Qwen2.5-Coder, which writes calls in several ways): hermes blocks; call objects, or a JSON
  array of them, bare as the whole output (objects separated by whitespace); or the same in a markdown fence
  amid content: three backticks, the tag `json` or none, whitespace, then `{` or `[`. A fence of no call is
  content through its closing backticks; after a fence's calls, text before its closing backticks is content
  and the fence itself is dropped. Text after bare calls is content.

A parser made with the request's tool names (`tool_parser(name, tool_names)`) reads as a call only a call of
one of them: any other JSON (a JSON answer, an object whose "name" is no tool's) is content, verbatim, as a call
without a name is (pythonic: a list calling any other function is content). Without names, any name is a call.

A call object needs a non-empty string "name"; its "arguments" ("parameters" is the same key) must be an object,
and are "{}" when absent; its keys may come in any order and other keys are ignored. A call's `arguments` is
always the text of a JSON object: the model's own text for the JSON formats, `json.dumps` of the keywords for
pythonic.

Failures: text that does not read as a call is content, never an exception (malformed JSON, a call without a
name, a marker with no call after it). The one exception is streaming's: a call whose name has been sent stays a
call. If its text then breaks off (the output was cut short) or stops being JSON, its arguments are closed at the
last point where they were a complete prefix (`{"city": "Par` becomes `{"city": "Par"}`) and the rest of that
call is dropped (hermes and qwen2_5_coder's blocks: through `</tool_call>`; qwen2_5_coder's fence: through its
closing backticks; mistral, llama3_json and bare qwen2_5_coder calls: the rest of the output).

Streaming: `feed(piece)` returns the content that became final and the call deltas completed; `finish()` returns
what was held back. Held back is only what may still be part of a call: a tail that may begin a marker (`<tool_`,
a fence's backticks), a fence's opening until what follows it shows whether calls do, the start of an output
that may be calls (llama3_json, pythonic, qwen2_5_coder), a call object until its name is known (and, when it
is a tool's, until its arguments have begun), and, inside the arguments, a piece that is not yet a complete
prefix (a key, a number's sign, half of `true`, an escape). A call's first delta carries its id and name; its
arguments then stream as they arrive. Pythonic calls come whole at `finish()`: only the end of the output makes
it a list.
Content that is only whitespace (`not text.strip()`) is none: `parse` gives None, and streaming sends content
only once some non-whitespace has come.

`parse(text)` is `feed(text)` and `finish()` on a fresh parser: for any split of a text into pieces, the streamed
content joins to `parse(text).content or ""` and the deltas, joined per index, give its calls, same text.
"""

from __future__ import annotations

import ast
import dataclasses
import json
import re
import secrets
import string
from collections.abc import Callable
from dataclasses import dataclass
from typing import ClassVar

from router.json_stream import JSON_WHITESPACE, CallObjectReader


@dataclass(frozen=True)
class ToolCall:
    id: str
    name: str
    arguments: str
    """The text of a JSON object."""


@dataclass(frozen=True)
class ToolCallDelta:
    """One entry of OpenAI's streamed `delta.tool_calls`."""

    index: int
    """The call's position among this choice's calls."""
    id: str | None = None
    """Set on the call's first delta only, as is `name`."""
    name: str | None = None
    arguments: str = ""
    """A fragment; a call's fragments join to its `arguments`."""


@dataclass(frozen=True)
class ParsedOutput:
    content: str | None
    """None when there is no content text, or only whitespace."""
    tool_calls: tuple[ToolCall, ...]


# The parsers.


class ToolParser:
    """Reads one choice's text: `parse` it whole, or `feed` it piece by piece and then `finish`. Not thread safe.

    A format is a few states, each a method that reads from `_buffer` (the text not yet decided) and returns
    whether it made progress; `is_final` says no more text will come, so that nothing may wait.
    """

    name: ClassVar[str]

    def __init__(self, tool_names: frozenset[str] | None = None) -> None:
        self._tool_names = tool_names  # a call names one of these; None: any name
        self._state: Callable[[bool], bool] = self._read_plain
        self._buffer = ""
        self._pending: list[str] = []  # the text since a call may have begun, given back if it was none
        self._reader: CallObjectReader | None = None
        self._call_index: int | None = None  # the index of the reader's call, once it has started
        self._num_calls = 0
        self._content: list[str] = []
        self._deltas: list[ToolCallDelta] = []
        self._has_content = False
        self._held_space = ""  # the content so far, while it is only whitespace

    def parse(self, text: str) -> ParsedOutput:
        parser = type(self)(self._tool_names)
        content, deltas = parser.feed(text)
        more_content, more_deltas = parser.finish()
        return _assemble(content + more_content, deltas + more_deltas)

    def feed(self, text: str) -> tuple[str, list[ToolCallDelta]]:
        """Streaming: the content text that became final with this piece and the tool-call deltas it completes."""
        self._buffer += text
        while self._buffer and self._state(False):
            pass
        return self._take()

    def finish(self) -> tuple[str, list[ToolCallDelta]]:
        """End of output: flush what is held back."""
        while self._state(True):
            pass
        self._held_space = ""
        return self._take()

    @staticmethod
    def _new_id() -> str:
        return "call_" + secrets.token_hex(12)

    # What the states call.

    def _emit_content(self, text: str) -> None:
        if self._has_content:
            self._content.append(text)
        elif text.strip():
            self._has_content = True
            self._content.append(self._held_space + text)
            self._held_space = ""
        else:
            self._held_space += text

    def _start_call(self, name: str) -> int:
        index = self._num_calls
        self._num_calls += 1
        self._deltas.append(ToolCallDelta(index, self._new_id(), name))
        return index

    def _add_arguments(self, index: int, fragment: str) -> None:
        if not fragment:
            return
        if self._deltas and self._deltas[-1].index == index:
            self._deltas[-1] = dataclasses.replace(self._deltas[-1], arguments=self._deltas[-1].arguments + fragment)
        else:
            self._deltas.append(ToolCallDelta(index, arguments=fragment))

    def _take(self) -> tuple[str, list[ToolCallDelta]]:
        content, deltas = "".join(self._content), self._deltas
        self._content, self._deltas = [], []
        return content, deltas

    def _content_until(self, markers: tuple[str, ...], is_final: bool) -> str:
        """Send the buffer as content up to the first of `markers`, holding back a tail that may begin one.
        Returns the marker found, then read, or ""."""
        found = [(start, marker) for marker in markers if (start := self._buffer.find(marker)) >= 0]
        if not found:
            held = 0 if is_final else max(_marker_start_len(self._buffer, marker) for marker in markers)
            end = len(self._buffer) - held
            self._emit_content(self._buffer[:end])
            self._buffer = self._buffer[end:]
            return ""
        start, marker = min(found)
        self._emit_content(self._buffer[:start])
        self._buffer = self._buffer[start + len(marker):]
        return marker

    def _drop_through(self, marker: str, is_final: bool) -> bool:
        """Drop the buffer through `marker`, keeping a tail that may begin it; True when found."""
        end = self._buffer.find(marker)
        if end < 0:
            keep = 0 if is_final else _marker_start_len(self._buffer, marker)
            self._buffer = self._buffer[len(self._buffer) - keep:]
            return False
        self._buffer = self._buffer[end + len(marker):]
        return True

    def _is_tool(self, name: str) -> bool:
        return self._tool_names is None or name in self._tool_names

    def _read_call(self, is_final: bool) -> str:
        """Read the call object at the head of the buffer. Returns "reading" (the buffer is all read), "done",
        "broken" (it failed after its name was sent) or "no call" (the pending text is back in the buffer)."""
        reader = self._reader
        num_read = reader.feed(self._buffer)
        self._pending.append(self._buffer[:num_read])
        self._buffer = self._buffer[num_read:]
        if is_final and not (reader.is_done or reader.is_failed):
            reader.end()
        # A call of no tool of the request's is text, known once its name is read (before the call starts).
        is_unknown = reader.name is not None and not self._is_tool(reader.name)
        if not reader.is_committed or is_unknown:
            if not (reader.is_failed or is_unknown):
                return "reading"
            self._give_back()
            return "no call"
        self._pending = []
        if self._call_index is None:
            self._call_index = self._start_call(reader.name)
        self._add_arguments(self._call_index, reader.take_arguments())
        if not (reader.is_done or reader.is_failed):
            return "reading"
        self._reader = self._call_index = None
        return "done" if reader.is_done else "broken"

    def _give_back(self) -> None:
        self._buffer = "".join(self._pending) + self._buffer
        self._pending = []

    # States every format uses.

    def _read_plain(self, is_final: bool) -> bool:
        """Everything from here on is content."""
        self._emit_content(self._buffer)
        self._buffer = ""
        return False

    def _drop_rest(self, is_final: bool) -> bool:
        self._buffer = ""
        return False


class HermesParser(ToolParser):
    """`<tool_call>{"name": ..., "arguments": {...}}</tool_call>` blocks amid content."""

    name = "hermes"
    _OPEN = "<tool_call>"
    _CLOSE = "</tool_call>"

    def __init__(self, tool_names: frozenset[str] | None = None) -> None:
        super().__init__(tool_names)
        self._state = self._read_content

    def _read_content(self, is_final: bool) -> bool:
        if not self._content_until((self._OPEN,), is_final):
            return False
        self._pending = [self._OPEN]
        self._reader, self._state = CallObjectReader(), self._read_block
        return True

    def _read_block(self, is_final: bool) -> bool:
        outcome = self._read_call(is_final)
        if outcome == "reading":
            return False
        if outcome == "no call":  # the marker was text: read on after it
            self._emit_content(self._OPEN)
            self._buffer = self._buffer[len(self._OPEN):]
        self._state = {"done": self._read_block_end, "broken": self._skip_block}.get(outcome, self._read_content)
        return True

    def _read_block_end(self, is_final: bool) -> bool:
        """After the call object: whitespace and `</tool_call>` end the block; anything else is content again."""
        rest = self._buffer.lstrip()
        if rest.startswith(self._CLOSE):
            self._buffer = rest[len(self._CLOSE):]
        elif self._CLOSE.startswith(rest) and not is_final:
            return False
        self._state = self._read_content
        return True

    def _skip_block(self, is_final: bool) -> bool:
        """After a broken call: its text is dropped through `</tool_call>`."""
        if not self._drop_through(self._CLOSE, is_final):
            return False
        self._state = self._read_content
        return True


class Qwen25CoderParser(HermesParser):
    """Hermes blocks, and call objects (or an array of them) bare as the whole output or in a markdown fence."""

    name = "qwen2_5_coder"
    _FENCE = "```"
    _FENCE_TAG = "json"

    def __init__(self, tool_names: frozenset[str] | None = None) -> None:
        super().__init__(tool_names)
        self._state = self._read_start
        self._is_fenced = False  # the calls being read are in a fence
        self._is_array = False  # ... in a JSON array
        self._is_first_call = False  # of the group: failing, it makes the group's opening text

    def _read_start(self, is_final: bool) -> bool:
        """Calls are bare only as the whole output: it starts with `{` or `[` after whitespace."""
        head = self._buffer.lstrip()
        if not head and not is_final:
            return False
        if head[:1] in ("{", "["):
            self._pending = [self._buffer[:len(self._buffer) - len(head)]]
            self._buffer = head
            self._start_calls(is_fenced=False)
        else:
            self._state = self._read_content
        return True

    def _read_content(self, is_final: bool) -> bool:
        marker = self._content_until((self._OPEN, self._FENCE), is_final)
        if not marker:
            return False
        self._pending = [marker]
        if marker == self._OPEN:
            self._reader, self._state = CallObjectReader(), self._read_block
        else:
            self._state = self._read_fence_open
        return True

    def _read_fence_open(self, is_final: bool) -> bool:
        """After ```: the tag `json` or none, whitespace, then `{` or `[` make a fence of calls; else it is text."""
        rest = self._buffer
        if rest.startswith(self._FENCE_TAG):
            rest = rest[len(self._FENCE_TAG):]
        elif self._FENCE_TAG.startswith(rest) and not is_final:
            return False
        head = rest.lstrip()
        if not head and not is_final:
            return False
        if head[:1] in ("{", "["):
            self._pending.append(self._buffer[:len(self._buffer) - len(head)])
            self._buffer = head
            self._start_calls(is_fenced=True)
        else:
            self._give_back()
            self._fence_was_text()
        return True

    def _start_calls(self, is_fenced: bool) -> None:
        self._is_fenced, self._is_array, self._is_first_call = is_fenced, self._buffer[0] == "[", True
        if self._is_array:
            self._pending.append("[")
            self._buffer = self._buffer[1:]
        self._reader, self._state = CallObjectReader(), self._read_object

    def _read_object(self, is_final: bool) -> bool:
        outcome = self._read_call(is_final)
        if outcome == "reading":
            return False
        if outcome == "done":
            self._state = self._read_after_object
        elif outcome == "broken":
            self._state = self._skip_fence if self._is_fenced else self._drop_rest
        elif self._is_first_call and self._is_fenced:
            self._fence_was_text()
        else:  # no call: the text from here on is content
            self._state = self._read_fence_rest if self._is_fenced else self._read_content
        self._is_first_call = False
        return True

    def _read_after_object(self, is_final: bool) -> bool:
        """Between calls: whitespace and the next object (after `,` in an array); other text ends the calls."""
        rest = self._buffer.lstrip()
        if not rest and not is_final:
            return False
        if rest.startswith("," if self._is_array else "{"):
            self._buffer = rest[1:] if self._is_array else rest
            self._reader, self._state = CallObjectReader(), self._read_object
            return True
        if self._is_array and rest.startswith("]"):
            self._buffer = rest[1:]
        self._state = self._read_fence_end if self._is_fenced else self._read_content
        return True

    def _read_fence_end(self, is_final: bool) -> bool:
        """After a fence's calls: whitespace and ``` close it; other text is content."""
        rest = self._buffer.lstrip()
        if rest.startswith(self._FENCE):
            self._buffer = rest[len(self._FENCE):]
            self._state = self._read_content
        elif self._FENCE.startswith(rest) and not is_final:
            return False
        else:
            self._state = self._read_fence_rest
        return True

    def _read_fence_rest(self, is_final: bool) -> bool:
        """What follows calls in their fence is content; its closing ``` is dropped, as its opening was."""
        if not self._content_until((self._FENCE,), is_final):
            return False
        self._state = self._read_content
        return True

    def _read_fence_text(self, is_final: bool) -> bool:
        """A fence of no calls is content through its closing ```."""
        if not self._content_until((self._FENCE,), is_final):
            return False
        self._emit_content(self._FENCE)
        self._state = self._read_content
        return True

    def _skip_fence(self, is_final: bool) -> bool:
        """After a broken call: the rest of its fence is dropped."""
        if not self._drop_through(self._FENCE, is_final):
            return False
        self._state = self._read_content
        return True

    def _fence_was_text(self) -> None:
        self._emit_content(self._FENCE)
        self._buffer = self._buffer[len(self._FENCE):]
        self._state = self._read_fence_text


class Llama3JsonParser(ToolParser):
    """Call objects, `{"name": ..., "parameters": {...}}`, optionally after `<|python_tag|>`, separated by `;`."""

    name = "llama3_json"
    _TAG = "<|python_tag|>"
    _SEPARATOR = re.compile(r"\s*(?:;\s*)?")

    def __init__(self, tool_names: frozenset[str] | None = None) -> None:
        super().__init__(tool_names)
        self._state = self._read_start

    def _read_start(self, is_final: bool) -> bool:
        """The output is calls when it starts with `{`, after whitespace and the optional tag."""
        head = self._buffer.lstrip()
        if head.startswith(self._TAG):
            head = head[len(self._TAG):].lstrip()
        elif self._TAG.startswith(head) and not is_final:
            return False
        if not head and not is_final:
            return False
        if head.startswith("{"):
            self._pending = [self._buffer[:len(self._buffer) - len(head)]]
            self._buffer = head
            self._reader, self._state = CallObjectReader(), self._read_object
        else:
            self._state = self._read_plain
        return True

    def _read_object(self, is_final: bool) -> bool:
        outcome = self._read_call(is_final)
        if outcome == "reading":
            return False
        self._state = {"done": self._read_separator, "broken": self._drop_rest}.get(outcome, self._read_plain)
        return True

    def _read_separator(self, is_final: bool) -> bool:
        """Between calls: whitespace and a `;`, dropped when `{` follows or the output ends; other text is content."""
        end = self._SEPARATOR.match(self._buffer).end()
        if end == len(self._buffer):
            if is_final:
                self._buffer = ""
            return False
        if self._buffer[end] == "{":
            self._buffer = self._buffer[end:]
            self._reader, self._state = CallObjectReader(), self._read_object
        else:
            self._state = self._read_plain
        return True


class MistralParser(ToolParser):
    """`[TOOL_CALLS]` and a JSON array of call objects; call ids are 9 letters and digits."""

    name = "mistral"
    _MARKER = "[TOOL_CALLS]"
    _ID_CHARS = string.ascii_letters + string.digits

    def __init__(self, tool_names: frozenset[str] | None = None) -> None:
        super().__init__(tool_names)
        self._state = self._read_content
        self._is_first_call = True  # of the array: failing, it makes the marker text

    @staticmethod
    def _new_id() -> str:
        return "".join(secrets.choice(MistralParser._ID_CHARS) for _ in range(9))

    def _read_content(self, is_final: bool) -> bool:
        if not self._content_until((self._MARKER,), is_final):
            return False
        self._pending = [self._MARKER]
        self._state = self._read_array_start
        return True

    def _read_array_start(self, is_final: bool) -> bool:
        rest = self._buffer.lstrip(JSON_WHITESPACE)
        if not rest and not is_final:
            return False
        if rest.startswith("["):
            self._pending.append(self._buffer[:len(self._buffer) - len(rest) + 1])
            self._buffer = rest[1:]
            self._reader, self._state, self._is_first_call = CallObjectReader(), self._read_element, True
        else:
            self._give_back()
            self._marker_was_text()
        return True

    def _read_element(self, is_final: bool) -> bool:
        outcome = self._read_call(is_final)
        if outcome == "reading":
            return False
        if outcome == "no call" and self._is_first_call:
            self._marker_was_text()
        else:
            self._state = {"done": self._read_after_element, "broken": self._drop_rest}.get(
                outcome, self._read_content)
        self._is_first_call = False
        return True

    def _read_after_element(self, is_final: bool) -> bool:
        """After a call: `,` and the next, or `]` and content again; other text is content."""
        rest = self._buffer.lstrip(JSON_WHITESPACE)
        if not rest and not is_final:
            return False
        if rest.startswith(","):
            self._buffer = rest[1:]
            self._reader, self._state = CallObjectReader(), self._read_element
        else:
            self._buffer = rest[1:] if rest.startswith("]") else self._buffer
            self._state = self._read_content
        return True

    def _marker_was_text(self) -> None:
        self._emit_content(self._MARKER)
        self._buffer = self._buffer[len(self._MARKER):]
        self._state = self._read_content


class PythonicParser(ToolParser):
    """The whole output a Python list of calls with literal keyword arguments: `[f(a=1), g()]`."""

    name = "pythonic"
    _START = re.compile(r"\s*\[\s*[^\W\d]\w*\s*\(")
    _MAY_START = re.compile(r"\s*(?:\[\s*(?:[^\W\d]\w*\s*)?)?")
    """What can still grow into `_START`."""

    def __init__(self, tool_names: frozenset[str] | None = None) -> None:
        super().__init__(tool_names)
        self._state = self._read_start
        self._held: list[str] = []

    def _read_start(self, is_final: bool) -> bool:
        if self._START.match(self._buffer):
            self._state = self._read_list
        elif self._MAY_START.fullmatch(self._buffer) and not is_final:
            return False
        else:
            self._state = self._read_plain
        return True

    def _read_list(self, is_final: bool) -> bool:
        """Held to the end, which alone says whether the output is a list of calls."""
        self._held.append(self._buffer)
        self._buffer = ""
        if not is_final:
            return False
        text = "".join(self._held)
        calls = _pythonic_calls(text)
        if calls is None or not all(self._is_tool(name) for name, _ in calls):
            self._emit_content(text)
            return False
        for name, arguments in calls:
            self._add_arguments(self._start_call(name), arguments)
        return False


def _pythonic_calls(text: str) -> list[tuple[str, str]] | None:
    """(name, arguments JSON) of each call when `text` is a list of calls with literal keyword arguments."""
    try:
        tree = ast.parse(text.strip(), mode="eval").body
        if not isinstance(tree, ast.List) or not tree.elts:
            return None
        calls = []
        for call in tree.elts:
            if not (isinstance(call, ast.Call) and isinstance(call.func, ast.Name)) or call.args:
                return None
            names = [keyword.arg for keyword in call.keywords]
            if None in names or len(set(names)) < len(names):  # **kwargs, or a keyword given twice
                return None
            arguments = {keyword.arg: ast.literal_eval(keyword.value) for keyword in call.keywords}
            calls.append((call.func.id, json.dumps(arguments, ensure_ascii=False, allow_nan=False)))
        return calls
    except (SyntaxError, ValueError, TypeError, MemoryError, RecursionError):
        return None


def _marker_start_len(text: str, marker: str) -> int:
    """The length of the longest tail of `text` that is a proper beginning of `marker`."""
    for size in range(min(len(marker) - 1, len(text)), 0, -1):
        if text.endswith(marker[:size]):
            return size
    return 0


def _assemble(content: str, deltas: list[ToolCallDelta]) -> ParsedOutput:
    calls: dict[int, list[str]] = {}
    for delta in deltas:
        if delta.id is not None:
            calls[delta.index] = [delta.id, delta.name, delta.arguments]
        else:
            calls[delta.index][2] += delta.arguments
    return ParsedOutput(content if content.strip() else None, tuple(ToolCall(*call) for call in calls.values()))


PARSERS: dict[str, type[ToolParser]] = {
    parser.name: parser
    for parser in (HermesParser, Llama3JsonParser, MistralParser, PythonicParser, Qwen25CoderParser)}


def tool_parser(name: str, tool_names: frozenset[str] | None = None) -> ToolParser:
    """A fresh parser for one choice, reading as calls only those of `tool_names` (None: any name); ValueError
    for an unknown parser name."""
    try:
        return PARSERS[name](tool_names)
    except KeyError:
        raise ValueError(f"unknown tool call parser {name!r}; known: {', '.join(PARSERS)}") from None
