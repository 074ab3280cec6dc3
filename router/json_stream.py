"""JSON read a character at a time, for the tool-call parsers (tool_parsers.py): how much of a value read so far
is a complete prefix, and one call object, `{"name": "f", "arguments": {...}}`, read as its text arrives.

In: text, one character at a time. Out: for a value, the length of its longest prefix that a closing quote and
brackets make complete (so a streamed argument never sends a fragment it must take back); for a call object, its
name, its arguments' text as far as it is safe, and whether it is committed (a call whatever follows) or failed.
"""

from __future__ import annotations

import json
import re
import string

JSON_WHITESPACE = " \t\n\r"
_NUMBER = re.compile(r"-?(?:0|[1-9][0-9]*)(?:\.[0-9]+)?(?:[eE][+-]?[0-9]+)?")
_NUMBER_START = re.compile(r"-?(?:(?:0|[1-9][0-9]*)(?:\.(?:[0-9]+(?:[eE][+-]?[0-9]*)?)?|[eE][+-]?[0-9]*)?)?")
"""What can still grow into a number."""
_LITERAL_RESTS = {"t": "rue", "f": "alse", "n": "ull"}
_ARGUMENT_KEYS = ("arguments", "parameters")


class JsonValue:
    """One JSON value read a character at a time, its grammar checked as it goes.

    `safe_len` is the length of the longest prefix read so far that becomes a complete value once `safe_closer`
    (a closing quote and brackets) is appended: `{"a": [1, "x` + `"]}`. A prefix that ends inside a key, a
    literal or an escape, or after a ':' or ',', never is.
    """

    def __init__(self) -> None:
        self.num_read = 0
        self.safe_len = 0
        self.safe_closer = ""
        self.is_done = False
        self.is_failed = False
        self._open: list[str] = []  # the closing brackets of the open containers, innermost last
        self._closers = ""  # _open reversed, joined
        self._expect = "value"  # or: value_or_end, key, key_or_end, colon, comma_or_end, string, number, literal
        self._is_key = False  # the string being read is an object's key
        self._escape = 0  # 1: after a backslash; 2 to 5: in \uXXXX, that many hex digits + 2 read
        self._number = ""
        self._literal = ""  # what `true`, `false` or `null` still needs

    def feed(self, ch: str) -> bool:
        """Read `ch`; False when it is no part of the value: wrong, or after its end (a number ends before it)."""
        if self.is_done or self.is_failed or not self._step(ch):
            return False
        self.num_read += 1
        closer = self._closer()
        if closer is not None:
            self.safe_len, self.safe_closer = self.num_read, closer
        return True

    def _step(self, ch: str) -> bool:
        expect = self._expect
        if expect == "string":
            return self._read_string(ch)
        if expect == "literal":
            if ch != self._literal[0]:
                return self._fail()
            self._literal = self._literal[1:]
            if not self._literal:
                self._end_value()
            return True
        if expect == "number":
            if _NUMBER_START.fullmatch(self._number + ch):
                self._number += ch
                return True
            if not _NUMBER.fullmatch(self._number):
                return self._fail()
            self._end_value()
            if self.is_done:
                return False
            expect = self._expect  # `ch` comes after the number
        if ch in JSON_WHITESPACE:
            return True
        if expect in ("value", "value_or_end"):
            return self._close() if ch == "]" and expect == "value_or_end" else self._start_value(ch)
        if expect in ("key", "key_or_end"):
            if ch == "}" and expect == "key_or_end":
                return self._close()
            self._expect, self._is_key = "string", True
            return ch == '"' or self._fail()
        if expect == "colon":
            self._expect = "value"
            return ch == ":" or self._fail()
        if ch == ",":  # expect == "comma_or_end"
            self._expect = "key" if self._open[-1] == "}" else "value"
            return True
        return self._close() if ch == self._open[-1] else self._fail()

    def _start_value(self, ch: str) -> bool:
        if ch in ("{", "["):
            self._open.append("}" if ch == "{" else "]")
            self._closers = self._open[-1] + self._closers
            self._expect = "key_or_end" if ch == "{" else "value_or_end"
        elif ch == '"':
            self._expect, self._is_key = "string", False
        elif ch in "-0123456789":
            self._expect, self._number = "number", ch
        elif ch in _LITERAL_RESTS:
            self._expect, self._literal = "literal", _LITERAL_RESTS[ch]
        else:
            return self._fail()
        return True

    def _read_string(self, ch: str) -> bool:
        if self._escape == 1:
            if ch == "u":
                self._escape = 2
            elif ch in '"\\/bfnrt':
                self._escape = 0
            else:
                return self._fail()
        elif self._escape:
            if ch not in string.hexdigits:
                return self._fail()
            self._escape = 0 if self._escape == 5 else self._escape + 1
        elif ch == "\\":
            self._escape = 1
        elif ch == '"':
            if self._is_key:
                self._expect = "colon"
            else:
                self._end_value()
        elif ch < " ":
            return self._fail()
        return True

    def _close(self) -> bool:
        self._open.pop()
        self._closers = self._closers[1:]
        self._end_value()
        return True

    def _end_value(self) -> None:
        self._expect = "comma_or_end" if self._open else "done"
        self.is_done = not self._open

    def _fail(self) -> bool:
        self.is_failed = True
        return False

    def _closer(self) -> str | None:
        """What completes the value read so far, or None when nothing appended can."""
        expect = self._expect
        if expect == "string":
            return None if self._is_key or self._escape else '"' + self._closers
        if expect in ("key_or_end", "value_or_end", "comma_or_end", "done"):
            return self._closers
        if expect == "number" and _NUMBER.fullmatch(self._number):
            return self._closers
        return None


class CallObjectReader:
    """One call object, `{"name": "f", "arguments": {...}}`, read as its text arrives.

    The call is committed, a call whatever follows, once its name is read and its arguments have begun (or, when
    they come first, once the name follows them; or at the closing brace when there are none). Before that, a
    failure means the text was no call.
    """

    def __init__(self) -> None:
        self.name: str | None = None
        self.is_committed = False
        self.is_done = False
        self.is_failed = False
        self._expect = "{"  # or: key, key_or_end, ":", value, comma_or_end
        self._key: str | None = None  # the key of the value being read
        self._part: JsonValue | None = None  # the key or value being read
        self._part_chars: list[str] = []
        self._arguments: JsonValue | None = None
        self._unsent: list[str] = []  # the arguments' characters read and not yet taken
        self._num_sent = 0
        self._is_sent = False

    def feed(self, text: str) -> int:
        """Read `text` up to the end of the object or a failure; return how many characters were read."""
        for i, ch in enumerate(text):
            if self.is_done or self.is_failed:
                return i
            if not self._read(ch):
                self.is_failed = True
                return i
        return len(text)

    def end(self) -> None:
        """The text has ended."""
        self.is_failed = not self.is_done

    def take_arguments(self) -> str:
        """The arguments text final since the last take; once the call has ended, all of it, closed."""
        if not self.is_committed or self._is_sent:
            return ""
        arguments = self._arguments
        if arguments is None:  # committed at the closing brace, without arguments
            self._is_sent = True
            return "{}"
        size = arguments.safe_len - self._num_sent
        fragment = "".join(self._unsent[:size])
        del self._unsent[:size]
        self._num_sent += size
        if arguments.is_done or self.is_failed:
            self._is_sent = True
            if not arguments.is_done:
                fragment += arguments.safe_closer
        return fragment

    def _read(self, ch: str) -> bool:
        part = self._part
        if part is not None:
            if part.feed(ch):
                (self._unsent if part is self._arguments else self._part_chars).append(ch)
                return self._end_part() if part.is_done else True
            if part.is_failed or not self._end_part():
                return False
            # A number ended before `ch`, which is read below.
        if ch in JSON_WHITESPACE:
            return True
        expect = self._expect
        if expect == "{":
            self._expect = "key_or_end"
            return ch == "{"
        if expect in ("key", "key_or_end") and ch == '"':
            return self._start_part(ch, is_key=True)
        if expect == "value":
            return self._start_part(ch, is_key=False)
        if expect == ":" and ch == ":":
            self._expect = "value"
            return True
        if expect == "comma_or_end" and ch == ",":
            self._expect = "key"
            return True
        if expect in ("key_or_end", "comma_or_end") and ch == "}" and self.name is not None:
            self.is_committed = self.is_done = True
            return True
        return False

    def _start_part(self, ch: str, is_key: bool) -> bool:
        part = self._part = JsonValue()
        self._expect = ":" if is_key else "comma_or_end"
        if not is_key and self._key in _ARGUMENT_KEYS and self._arguments is None:
            if ch != "{":
                return False
            self._arguments = part
            self.is_committed = self.name is not None
        return self._read(ch)

    def _end_part(self) -> bool:
        """A key or value has been read; False when it makes the object no call."""
        text = "".join(self._part_chars)
        self._part, self._part_chars = None, []
        if self._expect == ":":
            self._key = json.loads(text)
        elif self._key == "name" and self.name is None:
            try:
                name = json.loads(text)
            except ValueError:  # a number too long to convert
                return False
            if not isinstance(name, str) or not name:
                return False
            self.name = name
            self.is_committed = self._arguments is not None
        return True
