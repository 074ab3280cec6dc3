"""Tool-call parsers (router/tool_parsers.py): each format read whole, and streamed in any split to the same result."""

from __future__ import annotations

import json
import keyword
import re

import hypothesis
import pytest
from hypothesis import strategies as st

from router.tool_parsers import PARSERS, ParsedOutput, ToolCallDelta, tool_parser

WEATHER = {"city": "Paris", "unit": "c"}


def _stream(name: str, pieces: list[str], tool_names: frozenset[str] | None = None
            ) -> tuple[str, list[ToolCallDelta]]:
    parser = tool_parser(name, tool_names)
    contents, deltas = [], []
    for piece in pieces:
        content, new = parser.feed(piece)
        contents.append(content)
        deltas += new
    content, new = parser.finish()
    return "".join(contents) + content, deltas + new


def _joined(deltas: list[ToolCallDelta]) -> list[tuple[str, str, str]]:
    """(id, name, arguments) per call, checking the delta contract: indexes in order, id and name on the first
    delta of a call only."""
    calls: list[list[str]] = []
    for delta in deltas:
        if delta.index == len(calls):
            assert delta.id and delta.name, delta
            calls.append([delta.id, delta.name, delta.arguments])
        else:
            assert delta.index == len(calls) - 1, delta
            assert delta.id is None and delta.name is None, delta
            calls[-1][2] += delta.arguments
    return [tuple(call) for call in calls]


def _calls(parsed: ParsedOutput) -> list[tuple[str, dict]]:
    return [(call.name, json.loads(call.arguments)) for call in parsed.tool_calls]


def _split(text: str, cuts: list[int]) -> list[str]:
    cuts = sorted(cuts)
    return [text[start:end] for start, end in zip([0, *cuts], [*cuts, len(text)])]


def _assert_stream_agrees(name: str, text: str, cuts: list[int], tool_names: frozenset[str] | None = None
                          ) -> ParsedOutput:
    parsed = tool_parser(name, tool_names).parse(text)
    content, deltas = _stream(name, _split(text, cuts), tool_names)
    assert content == (parsed.content or "")
    calls = _joined(deltas)
    assert [(call_name, arguments) for _, call_name, arguments in calls] == [
        (call.name, call.arguments) for call in parsed.tool_calls]
    assert len({call_id for call_id, _, _ in calls}) == len(calls)
    for call in parsed.tool_calls:
        assert isinstance(json.loads(call.arguments), dict), call
    assert parsed.content is None or parsed.content.strip()
    return parsed


# hermes


def test_hermes_single_call():
    parsed = tool_parser("hermes").parse(
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "c"}}\n</tool_call>')
    assert parsed.content is None
    assert _calls(parsed) == [("get_weather", WEATHER)]
    assert parsed.tool_calls[0].arguments == '{"city": "Paris", "unit": "c"}'  # the model's own text
    assert re.fullmatch(r"call_[0-9a-f]{24}", parsed.tool_calls[0].id)


def test_hermes_parallel_calls_with_content_before():
    parsed = tool_parser("hermes").parse(
        'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "c"}}\n'
        '</tool_call>\n<tool_call>\n{"name": "ping", "arguments": {}}\n</tool_call>')
    assert parsed.content == "Let me check.\n\n"
    assert _calls(parsed) == [("get_weather", WEATHER), ("ping", {})]
    assert parsed.tool_calls[0].id != parsed.tool_calls[1].id


def test_hermes_call_object_keys_in_any_order_and_arguments_optional():
    parsed = tool_parser("hermes").parse(
        '<tool_call>{"arguments": {"a": 1}, "name": "f", "id": 7}</tool_call><tool_call>{"name": "g"}</tool_call>')
    assert _calls(parsed) == [("f", {"a": 1}), ("g", {})]


def test_hermes_no_call_is_content():
    text = "The weather in Paris is mild; no <tool> needed. 1 < 2."
    assert tool_parser("hermes").parse(text) == ParsedOutput(text, ())


@pytest.mark.parametrize("text", [
    '<tool_call>{"name": "f" "arguments": {}}</tool_call>',  # bad JSON before the arguments began
    '<tool_call>{"arguments": {"a": 1}}</tool_call>',  # no name
    '<tool_call>{"name": "", "arguments": {}}</tool_call>',  # an empty name
    '<tool_call>{"name": 3, "arguments": {}}</tool_call>',  # a name not a string
    '<tool_call>{"name": "f", "arguments": "{\\"a\\": 1}"}</tool_call>',  # arguments not an object
    '<tool_call>{"name": "f", "arguments": [1]}</tool_call>',
    '<tool_call>["f", {}]</tool_call>',
    "<tool_call>get_weather(city='Paris')</tool_call>",
    '<tool_call>{"name": "f"',  # never closed, and no call committed
    "<tool_call>",
])
def test_hermes_malformed_call_is_content(text):
    assert tool_parser("hermes").parse(text) == ParsedOutput(text, ())


def test_hermes_text_around_a_failed_block_is_read_on():
    text = '<tool_call>oops</tool_call> then <tool_call>{"name": "f", "arguments": {}}</tool_call> done'
    parsed = tool_parser("hermes").parse(text)
    assert parsed.content == "<tool_call>oops</tool_call> then  done"
    assert _calls(parsed) == [("f", {})]


def test_hermes_call_cut_short_is_closed_at_its_last_complete_point():
    parsed = tool_parser("hermes").parse('<tool_call>{"name": "f", "arguments": {"city": "Par')
    assert [(call.name, call.arguments) for call in parsed.tool_calls] == [("f", '{"city": "Par"}')]
    parsed = tool_parser("hermes").parse('<tool_call>{"name": "f", "arguments": {"a": [1, tr')
    assert [call.arguments for call in parsed.tool_calls] == ['{"a": [1]}']


def test_hermes_call_broken_after_its_name_drops_the_rest_of_its_block():
    text = '<tool_call>{"name": "f", "arguments": {"a": 1, oops}}</tool_call>Done.'
    parsed = tool_parser("hermes").parse(text)
    assert parsed.content == "Done."
    assert [call.arguments for call in parsed.tool_calls] == ['{"a": 1}']
    parsed = tool_parser("hermes").parse('<tool_call>{"name": "f", "arguments": {"a": 1}</tool_call>Done.')
    assert parsed.content == "Done." and _calls(parsed) == [("f", {"a": 1})]  # the outer brace forgotten


def test_hermes_streams_the_name_then_the_arguments_as_they_arrive():
    parser = tool_parser("hermes")
    assert parser.feed("Sure. <tool_") == ("Sure. ", [])  # only what may begin the marker is held
    assert parser.feed('call>\n{"name": "get_weather", ') == ("", [])
    content, deltas = parser.feed('"arguments": {"city": "Pa')
    call_id = deltas[0].id
    assert (content, deltas) == ("", [ToolCallDelta(0, call_id, "get_weather", '{"city": "Pa')])
    assert parser.feed('ris", "un') == ("", [ToolCallDelta(0, arguments='ris"')])  # a key is held whole
    assert parser.feed('it": "c"}}\n</tool_call>') == ("", [ToolCallDelta(0, arguments=', "unit": "c"}')])
    assert parser.feed(" Bye") == (" Bye", [])
    assert parser.finish() == ("", [])


def test_hermes_held_marker_start_is_content_when_no_marker_follows():
    parser = tool_parser("hermes")
    assert parser.feed("a <tool") == ("a ", [])
    assert parser.feed("box and <") == ("<toolbox and ", [])
    assert parser.finish() == ("<", [])


def test_hermes_block_naming_no_tool_of_the_request_is_content():
    text = '<tool_call>{"name": "g", "arguments": {}}</tool_call> <tool_call>{"name": "f", "arguments": {}}</tool_call>'
    parsed = tool_parser("hermes", frozenset({"f"})).parse(text)
    assert parsed.content == '<tool_call>{"name": "g", "arguments": {}}</tool_call> '
    assert _calls(parsed) == [("f", {})]


def test_hermes_holds_a_call_only_until_its_name_is_known_to_be_no_tool():
    parser = tool_parser("hermes", frozenset({"f"}))
    assert parser.feed('<tool_call>{"name": "g') == ("", [])
    assert parser.feed('", ') == ('<tool_call>{"name": "g", ', [])


# qwen2_5_coder

CODER_TOOLS = frozenset({"get_weather", "ping"})
PARIS = '{"name": "get_weather", "arguments": {"city": "Paris", "unit": "c"}}'


def _coder(text: str) -> ParsedOutput:
    return tool_parser("qwen2_5_coder", CODER_TOOLS).parse(text)


@pytest.mark.parametrize("text", [
    f"<tool_call>\n{PARIS}\n</tool_call>",  # the form the template asks for
    PARIS,  # bare
    f" \n{PARIS}\n",
    f"```json\n{PARIS}\n```",  # fenced
    f"```\n{PARIS}\n```",
    f"\n```json {PARIS}```\n",
])
def test_coder_reads_a_call_in_each_form(text):
    parsed = _coder(text)
    assert parsed.content is None
    assert _calls(parsed) == [("get_weather", WEATHER)]
    assert parsed.tool_calls[0].arguments == '{"city": "Paris", "unit": "c"}'  # the model's own text


@pytest.mark.parametrize("text", [
    f'<tool_call>\n{PARIS}\n</tool_call>\n<tool_call>\n{{"name": "ping", "arguments": {{}}}}\n</tool_call>',
    f'{PARIS}\n{{"name": "ping", "arguments": {{}}}}\n',
    f'[{PARIS}, {{"name": "ping", "arguments": {{}}}}]',
    f'```json\n{PARIS}\n\n{{"name": "ping"}}\n```',
    f'```json\n[\n  {PARIS},\n  {{"name": "ping"}}\n]\n```',
    f'```json\n{PARIS}\n```\n```json\n{{"name": "ping"}}\n```',
])
def test_coder_reads_several_calls(text):
    parsed = _coder(text)
    assert parsed.content is None
    assert _calls(parsed) == [("get_weather", WEATHER), ("ping", {})]


def test_coder_text_around_a_fenced_call_is_content():
    parsed = _coder(f"I'll check the weather.\n```json\n{PARIS}\n```\nLet me know!")
    assert parsed.content == "I'll check the weather.\n\nLet me know!"
    assert _calls(parsed) == [("get_weather", WEATHER)]


@pytest.mark.parametrize("text", [
    '{"answer": 42}',  # a JSON answer: no name
    '{"name": "Paris", "population": 2102650}',  # a name, but of no tool
    '{"name": "get_time", "arguments": {}}',  # a call of a tool the request does not have
    '[{"name": "get_time", "arguments": {}}, ' + PARIS + ']',
    '[1, 2, 3]',
    '```json\n{"city": "Paris"}\n```',
    '```\n{"name": "get_time", "arguments": {}}\n```',
    '```python\nprint({"name": "ping"})\n```',
    'Use ```json fences``` for JSON.',
    '<tool_call>{"name": "get_time", "arguments": {}}</tool_call>',
    '{"name": "get_weather"',  # cut short before it was a call
    "```json\n",
    "Paris is sunny.",
])
def test_coder_json_that_is_no_call_of_a_tool_is_content_verbatim(text):
    assert _coder(text) == ParsedOutput(text, ())


def test_coder_a_fence_of_no_call_is_content_through_its_end():
    text = f'```json\n{{"a": 1}}\n```\nand ```json\n{PARIS}\n``` done'
    parsed = _coder(text)
    assert parsed.content == '```json\n{"a": 1}\n```\nand  done'
    assert _calls(parsed) == [("get_weather", WEATHER)]


def test_coder_text_after_calls_in_their_fence_is_content_without_the_fence():
    parsed = _coder(f'```json\n{PARIS}\n{{"a": 1}}\n```\nDone.')
    assert parsed.content == '{"a": 1}\n\nDone.'
    assert _calls(parsed) == [("get_weather", WEATHER)]


@pytest.mark.parametrize("text, content", [
    ('{"name": "get_weather", "arguments": {"city": "Par', None),
    ('```json\n{"name": "get_weather", "arguments": {"city": "Par', None),
    ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Par', None),
    ('{"name": "get_weather", "arguments": {"city": "Par", oops}}\nMore.', None),  # the rest of the output dropped
    ('```json\n{"name": "get_weather", "arguments": {"city": "Par", oops}}\n```\nMore.', "\nMore."),
])
def test_coder_call_cut_short_is_closed_at_its_last_complete_point(text, content):
    parsed = _coder(text)
    assert parsed.content == content
    assert [(call.name, call.arguments) for call in parsed.tool_calls] == [("get_weather", '{"city": "Par"}')]


def test_coder_holds_what_may_become_a_call_until_it_is_known():
    parser = tool_parser("qwen2_5_coder", CODER_TOOLS)
    assert parser.feed("Sure.\n``") == ("Sure.\n", [])
    assert parser.feed("`js") == ("", [])
    assert parser.feed('on\n{"name": "get_weather", ') == ("", [])
    content, deltas = parser.feed('"arguments": {"city": "Pa')
    assert (content, deltas) == ("", [ToolCallDelta(0, deltas[0].id, "get_weather", '{"city": "Pa')])
    assert parser.feed('ris"}}\n``') == ("", [ToolCallDelta(0, arguments='ris"}')])
    assert parser.feed("`\nBye") == ("\nBye", [])
    assert parser.finish() == ("", [])


def test_coder_releases_held_text_once_it_cannot_be_a_call():
    parser = tool_parser("qwen2_5_coder", CODER_TOOLS)
    assert parser.feed(' {"na') == ("", [])
    assert parser.feed('me": "Paris", ') == (' {"name": "Paris", ', [])  # a name of no tool
    assert parser.feed('"population": 2}') == ('"population": 2}', [])
    parser = tool_parser("qwen2_5_coder", CODER_TOOLS)
    assert parser.feed("```") == ("", [])
    assert parser.feed("python\nx = {") == ("```python\nx = {", [])
    assert parser.feed("}\n``") == ("}\n", [])
    assert parser.finish() == ("``", [])


def test_coder_without_tool_names_reads_any_name():
    assert _calls(tool_parser("qwen2_5_coder").parse('{"name": "anything"}')) == [("anything", {})]


# llama3_json


def test_llama3_json_single_call_after_the_python_tag():
    parsed = tool_parser("llama3_json").parse(
        '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris", "unit": "c"}}')
    assert parsed.content is None
    assert _calls(parsed) == [("get_weather", WEATHER)]


def test_llama3_json_parallel_calls_separated_by_semicolons():
    parsed = tool_parser("llama3_json").parse(
        '{"name": "get_weather", "parameters": {"city": "Paris", "unit": "c"}}; {"name": "ping", "arguments": {}};')
    assert parsed.content is None
    assert _calls(parsed) == [("get_weather", WEATHER), ("ping", {})]


def test_llama3_json_text_after_the_calls_is_content():
    parsed = tool_parser("llama3_json").parse('{"name": "f", "parameters": {}} I called f.')
    assert parsed.content == " I called f." and _calls(parsed) == [("f", {})]


@pytest.mark.parametrize("text", [
    'Sure: {"name": "f", "parameters": {}}',  # content before the object
    "The answer is 42.",
    '{"name": f, "parameters": {"a": 1}}',
    '{"city": "Paris"}',  # a JSON object, not a call
    '{"name": "f", "parameters": 3}',
    '<|python_tag|>print("hi")',
    '{"name": "f"',
])
def test_llama3_json_output_not_starting_with_a_call_is_content(text):
    assert tool_parser("llama3_json").parse(text) == ParsedOutput(text, ())


def test_llama3_json_content_is_not_held_once_it_cannot_be_a_call():
    parser = tool_parser("llama3_json")
    assert parser.feed("  <|python") == ("", [])
    assert parser.feed("_tag|> ") == ("", [])
    assert parser.feed("x") == ("  <|python_tag|> x", [])
    assert parser.feed(' {"name": "f", "parameters": {}}') == (' {"name": "f", "parameters": {}}', [])


def test_llama3_json_call_naming_no_tool_makes_the_output_content():
    text = '{"name": "g", "parameters": {}}; {"name": "f", "parameters": {}}'
    assert tool_parser("llama3_json", frozenset({"f"})).parse(text) == ParsedOutput(text, ())


# mistral


def test_mistral_single_call_with_a_nine_character_id():
    parsed = tool_parser("mistral").parse(
        '[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Paris", "unit": "c"}}]')
    assert parsed.content is None
    assert _calls(parsed) == [("get_weather", WEATHER)]
    assert re.fullmatch(r"[A-Za-z0-9]{9}", parsed.tool_calls[0].id)


def test_mistral_parallel_calls_with_content_before():
    parsed = tool_parser("mistral").parse(
        'Checking.[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris", "unit": "c"}}, '
        '{"name": "ping", "arguments": {}}]')
    assert parsed.content == "Checking."
    assert _calls(parsed) == [("get_weather", WEATHER), ("ping", {})]


@pytest.mark.parametrize("text", [
    "No tools needed here [really].",
    "[TOOL_CALLS] I would call a tool.",
    '[TOOL_CALLS][{"name": "f" "arguments": {"a": 1}}]',
    '[TOOL_CALLS]{"name": "f", "arguments": {}}',  # not an array
    '[TOOL_CALLS][{"arguments": {}}]',
    '[TOOL_CALLS][',
])
def test_mistral_malformed_is_content(text):
    assert tool_parser("mistral").parse(text) == ParsedOutput(text, ())


def test_mistral_a_later_element_that_is_no_call_is_content():
    parsed = tool_parser("mistral").parse('[TOOL_CALLS][{"name": "f", "arguments": {}}, "oops"]')
    assert parsed.content == ' "oops"]' and _calls(parsed) == [("f", {})]


def test_mistral_call_naming_no_tool_is_content():
    text = '[TOOL_CALLS][{"name": "g", "arguments": {}}]'
    assert tool_parser("mistral", frozenset({"f"})).parse(text) == ParsedOutput(text, ())


# pythonic


def test_pythonic_single_call():
    parsed = tool_parser("pythonic").parse('[get_weather(city="Paris", unit="c")]')
    assert parsed.content is None
    assert _calls(parsed) == [("get_weather", WEATHER)]


def test_pythonic_parallel_calls_with_nested_literals():
    parsed = tool_parser("pythonic").parse(
        "\n[search(query='x', filters={'tags': ['a', 'b'], 'max': None, 'exact': True}, limit=-3, w=0.5), ping()]\n")
    assert parsed.content is None
    assert _calls(parsed) == [
        ("search", {"query": "x", "filters": {"tags": ["a", "b"], "max": None, "exact": True}, "limit": -3, "w": 0.5}),
        ("ping", {})]


@pytest.mark.parametrize("text", [
    "Paris is sunny.",
    "[see the docs](https://example.com)",
    "[get_weather('Paris')]",  # positional
    "[get_weather(city=x)]",  # not a literal
    "[get_weather(**kw)]",
    "[get_weather(city='a', city='b')]",
    "[f(a={1, 2})]",  # a set is no JSON
    "[f(a=1e999)]",  # infinity is no JSON
    "[math.sqrt(x=2)]",
    "[f(a=1)] and then some text",
    "Sure: [f(a=1)]",
    "[]",
    "[f(a=1), 2]",
    "[f(a=1)",
])
def test_pythonic_anything_but_a_list_of_calls_is_content(text):
    assert tool_parser("pythonic").parse(text) == ParsedOutput(text, ())


def test_pythonic_holds_only_what_may_begin_a_call_list():
    parser = tool_parser("pythonic")
    assert parser.feed(" [see") == ("", [])
    assert parser.feed(" the docs]") == (" [see the docs]", [])
    parser = tool_parser("pythonic")
    assert parser.feed("[ping(") == ("", [])
    content, deltas = parser.feed(")]")
    assert (content, deltas) == ("", [])  # only the end says whether it is a list
    content, deltas = parser.finish()
    assert content == "" and [(d.index, d.name, d.arguments) for d in deltas] == [(0, "ping", "{}")]


def test_pythonic_list_calling_a_function_of_no_tool_is_content():
    text = "[f(a=1), g()]"
    assert tool_parser("pythonic", frozenset({"f"})).parse(text) == ParsedOutput(text, ())


# Every parser.


@pytest.mark.parametrize("name", sorted(PARSERS))
def test_whitespace_only_content_is_none_and_not_streamed(name):
    text = {"hermes": ' \n<tool_call>{"name": "f", "arguments": {}}</tool_call>\n',
            "llama3_json": ' \n{"name": "f", "arguments": {}}\n',
            "mistral": ' \n[TOOL_CALLS][{"name": "f", "arguments": {}}]\n',
            "pythonic": " \n[f()]\n",
            "qwen2_5_coder": ' \n```json\n{"name": "f", "arguments": {}}\n```\n'}[name]
    assert tool_parser(name).parse(text).content is None
    assert _stream(name, list(text))[0] == ""
    assert tool_parser(name).parse(" \n\t ") == ParsedOutput(None, ())
    assert tool_parser(name).parse("") == ParsedOutput(None, ())


def test_leading_whitespace_goes_out_with_the_first_content():
    parser = tool_parser("hermes")
    assert parser.feed(" \n") == ("", [])
    assert parser.feed("Hi") == (" \nHi", [])


def test_unknown_parser_names_the_known_ones():
    with pytest.raises(ValueError, match="hermes.*llama3_json.*mistral.*pythonic"):
        tool_parser("qwen")


def test_each_parser_is_registered_under_its_name():
    assert {name: parser.name for name, parser in PARSERS.items()} == {name: name for name in PARSERS}
    assert sorted(PARSERS) == ["hermes", "llama3_json", "mistral", "pythonic", "qwen2_5_coder"]


# Properties: well-formed outputs read back, and any split of any text streams to what parse gives.

_JSON_VALUES = st.recursive(
    st.none() | st.booleans() | st.integers(-10**6, 10**6) | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=6),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=4), inner, max_size=3),
    max_leaves=6)
_IDENTIFIERS = st.from_regex(r"[A-Za-z_][A-Za-z0-9_]{0,8}", fullmatch=True).filter(
    lambda word: not keyword.iskeyword(word))
_JSON_CALLS = st.lists(st.tuples(_IDENTIFIERS | st.text(min_size=1, max_size=8),
                                 st.dictionaries(st.text(max_size=5), _JSON_VALUES, max_size=3)),
                       min_size=1, max_size=3)
_PYTHONIC_CALLS = st.lists(st.tuples(_IDENTIFIERS, st.dictionaries(_IDENTIFIERS, _JSON_VALUES, max_size=3)),
                           min_size=1, max_size=3)
_PROSE = st.text(st.characters(codec="utf-8", exclude_characters="\x00"), max_size=12)


@st.composite
def _well_formed(draw, name: str) -> tuple[str, str | None, list[tuple[str, dict]]]:
    """(text, its content, its calls)."""
    if name == "pythonic":
        calls = draw(_PYTHONIC_CALLS)
        items = (f"{call}({', '.join(f'{key}={value!r}' for key, value in arguments.items())})"
                 for call, arguments in calls)
        return draw(st.sampled_from(["", " ", "\n"])) + f"[{', '.join(items)}]", None, calls
    calls = draw(_JSON_CALLS)
    prose = draw(_PROSE.filter(lambda text: "<tool_call>" not in text and "[TOOL_CALLS]" not in text))
    key = draw(st.sampled_from(["arguments", "parameters"]))
    objects = [json.dumps({"name": call, key: arguments}, ensure_ascii=draw(st.booleans()))
               for call, arguments in calls]
    if name == "qwen2_5_coder":
        return (*_coder_well_formed(draw, objects), calls)
    if name == "hermes":
        content = prose + "\n" * (len(calls) - 1)
        return prose + "\n".join(f"<tool_call>\n{item}\n</tool_call>" for item in objects), content, calls
    if name == "mistral":
        return f"{prose}[TOOL_CALLS] [{', '.join(objects)}]", prose, calls
    return draw(st.sampled_from(["", "<|python_tag|>", " "])) + "; ".join(objects), None, calls


def _coder_well_formed(draw, objects: list[str]) -> tuple[str, str]:
    """(text, content) of `objects` in one of qwen2_5_coder's forms."""
    before, after = (draw(_PROSE.filter(lambda text: "`" not in text and "<tool_call>" not in text))
                     for _ in range(2))
    form = draw(st.sampled_from(["tags", "bare", "fenced"]))
    if form == "tags":
        return (before + "\n".join(f"<tool_call>\n{item}\n</tool_call>" for item in objects),
                before + "\n" * (len(objects) - 1))
    calls = draw(st.sampled_from([f"[{', '.join(objects)}]", "\n".join(objects)]))
    if form == "bare":
        return draw(st.sampled_from(["", " ", "\n"])) + calls + draw(st.sampled_from(["", "\n"])), None
    return f"{before}```{draw(st.sampled_from(['json', '']))}\n{calls}\n```{after}", before + after


_JSON_PIECES = ['{', '}', '[', ']', '"name"', '"arguments"', '"parameters"', ': ', ', ', ' ', '\n', '"f"', '"',
                '\\', '1', '-', '.5', 'e3', 'true', 'nul', '"a"', '\\u00e9', '{"name": "f", "arguments": {', '}}',
                '"g"', '{"name": "g", "arguments": {']
_PIECES = {
    "hermes": [*_JSON_PIECES, "<tool_call>", "</tool_call>", "<tool_", "</tool", "Hi "],
    "llama3_json": [*_JSON_PIECES, "<|python_tag|>", "<|python", ";", "Hi "],
    "mistral": [*_JSON_PIECES, "[TOOL_CALLS]", "[TOOL_", "Hi "],
    "qwen2_5_coder": [*_JSON_PIECES, "<tool_call>", "</tool_call>", "<tool_", "```", "```json\n", "``", "`", "json",
                      "Hi "],
    "pythonic": ["[", "]", "(", ")", "f", "g", "get_weather", "=", ", ", " ", "'x'", "1", "None", "{", "}", ":", "a",
                 "**", "x.y", "Hi "],
}


@st.composite
def _any_text(draw, name: str) -> str:
    """Texts from the format's own pieces, and well-formed outputs cut short or with a piece put in or taken out."""
    pieces = st.sampled_from(_PIECES[name]) | st.text(max_size=2)
    if draw(st.booleans()):
        return "".join(draw(st.lists(pieces, max_size=24)))
    text = draw(_well_formed(name))[0]
    at = draw(st.integers(0, len(text)))
    return draw(st.sampled_from([text[:at], text[:at] + draw(pieces) + text[at:], text[:at] + text[at + 1:]]))


def _cuts(data: st.DataObject, text: str) -> list[int]:
    return data.draw(st.lists(st.integers(0, len(text)), max_size=16))


_SETTINGS = hypothesis.settings(max_examples=300, deadline=None,
                                suppress_health_check=[hypothesis.HealthCheck.too_slow])


@pytest.mark.parametrize("name", sorted(PARSERS))
@_SETTINGS
@hypothesis.given(data=st.data())
def test_well_formed_output_reads_back_in_any_split(name, data):
    text, content, calls = data.draw(_well_formed(name))
    for tool_names in (None, frozenset(call for call, _ in calls)):
        parsed = _assert_stream_agrees(name, text, _cuts(data, text), tool_names)
        assert parsed.content == (content if content and content.strip() else None)
        assert _calls(parsed) == calls
    assert tool_parser(name, frozenset({"none of them"})).parse(text) == ParsedOutput(text, ())


@pytest.mark.parametrize("name, tool_names", [*((name, None) for name in sorted(PARSERS)),
                                              *((name, frozenset({"f"})) for name in sorted(PARSERS))])
@_SETTINGS
@hypothesis.given(data=st.data())
def test_any_text_streams_in_any_split_as_parse_reads_it(name, tool_names, data):
    text = data.draw(_any_text(name))
    _assert_stream_agrees(name, text, _cuts(data, text), tool_names)
