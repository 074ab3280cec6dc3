"""Which grammar engine enforces a JSON schema exactly: the constructs each engine would approximate, found by
walking the schema, each named with its JSON pointer.

In: a JSON schema (a dict). Out: `Gap`s, per engine, and the schema as llguidance is given it. A gap is a
construct an engine would let an output break: xgrammar (0.2) ignores some keywords silently (`uniqueItems`,
`not`, `if`, `contains`, every keyword beside `$ref`, `enum` or a combinator), warns and approximates others
(`oneOf` as `anyOf`, `allOf` of several schemas, lookarounds, `pattern` beside a length); llguidance (1.9)
refuses what it does not implement, so its gaps here only name, with their place, what it would refuse.
The rule both services apply (router/schema_engines.py at the edge, worker/grammar.py when compiling): xgrammar
where it has no gap and compiles the schema, else llguidance where it compiles it, else a 400 naming the gap.
Every engine here is sound, not complete: each may allow less than the schema does (a fixed property order,
no extra properties under xgrammar, a `pattern` anchored at both ends), never more. `format` is an annotation,
as JSON Schema defines it: enforced where the engine knows the format, else ignored, by both (llguidance is
given the schema without the formats it does not know, which it would refuse). A `oneOf` proved disjoint here is
exact as an `anyOf`: xgrammar's, and llguidance's too when told so (llguidance_options). Pure Python, no engine.
"""

from __future__ import annotations

import copy
import re
from dataclasses import dataclass

from common.grammar import LLGUIDANCE_JSON_OPTIONS
from common.schema_disjoint import branch_types, is_of_type, pairwise_disjoint, types_of
from common.schema_walk import all_children, escape_step, nodes, resolve, used_children

_BY_TYPE = {
    "string": {"minLength", "maxLength", "pattern"},
    "number": {"minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "multipleOf"},
    "array": {"items", "prefixItems", "additionalItems", "minItems", "maxItems", "uniqueItems", "contains",
              "minContains", "maxContains", "unevaluatedItems"},
    "object": {"properties", "patternProperties", "additionalProperties", "required", "minProperties",
               "maxProperties", "propertyNames", "dependentRequired", "dependentSchemas", "dependencies",
               "unevaluatedProperties"}}
_BY_TYPE["integer"] = _BY_TYPE["number"]
_BY_TYPE_KEYWORDS = frozenset().union(*_BY_TYPE.values())
_OBJECT_SIGNS = ("properties", "additionalProperties", "unevaluatedProperties")
_ARRAY_SIGNS = ("items", "prefixItems", "unevaluatedItems")
"""Without `type`, xgrammar reads a schema with one of these as an object (an array), else as any value."""
_APPLICATORS = ("$ref", "const", "enum", "anyOf", "oneOf", "allOf")
"""xgrammar reads the first of these a schema has and ignores every other assertion beside it."""
_KEYWORDS = frozenset().union(*_BY_TYPE.values(), _APPLICATORS, {
    "type", "not", "if", "then", "else", "$dynamicRef", "$recursiveRef"})
"""Every assertion keyword of drafts 4 to 2020-12; any other key is an annotation, as validators read it."""
_XGRAMMAR_IGNORES = {
    "uniqueItems": "xgrammar ignores it", "contains": "xgrammar ignores it", "minContains": "xgrammar ignores it",
    "maxContains": "xgrammar ignores it", "not": "xgrammar ignores it", "if": "xgrammar ignores it",
    "dependentRequired": "xgrammar ignores it", "dependentSchemas": "xgrammar ignores it",
    "dependencies": "xgrammar ignores it", "$dynamicRef": "xgrammar cannot follow it",
    "$recursiveRef": "xgrammar cannot follow it"}
LLGUIDANCE_KEYWORDS = frozenset({
    "anyOf", "oneOf", "allOf", "$ref", "const", "enum", "type", "items", "additionalItems", "prefixItems",
    "minItems", "maxItems", "properties", "additionalProperties", "patternProperties", "required", "minProperties",
    "maxProperties", "minLength", "maxLength", "pattern", "format", "minimum", "maximum", "exclusiveMinimum",
    "exclusiveMaximum", "multipleOf"})
"""The keywords llguidance implements (its json/schema.rs IMPLEMENTED); it refuses a schema with any other."""
LLGUIDANCE_FORMATS = frozenset({"date-time", "time", "date", "duration", "email", "hostname", "ipv4", "ipv6",
                                "uuid", "uri"})
_OLD_DRAFTS = re.compile(r"draft-0[3-7]")
"""Drafts whose `$ref` replaces its siblings (they are ignored), so xgrammar's reading is the draft's."""


@dataclass(frozen=True)
class Gap:
    """A construct an engine cannot enforce exactly, where it is, and why."""

    construct: str
    """The keyword (or what in it: "`pattern` with a lookaround"), in backquotes."""
    pointer: str
    """Its schema object's JSON pointer (RFC 6901): "" is the root."""
    why: str

    def __str__(self) -> str:
        return f"{self.construct} at {self.pointer or '/'} ({self.why})"


def xgrammar_gaps(schema: dict) -> list[Gap]:
    """What xgrammar would approximate in `schema`, reachable from its root, in walking order."""
    is_old_draft = bool(_OLD_DRAFTS.search(str(schema.get("$schema", ""))))
    return _walk(schema, lambda node, pointer: _xgrammar_node(node, pointer, schema, is_old_draft),
                 _xgrammar_children)


def llguidance_gaps(schema: dict) -> list[Gap]:
    """What llguidance would refuse in `schema` that can be named and placed before compiling it (its keywords and
    regexes; it refuses more, such as a `oneOf` it cannot prove disjoint, with its own message)."""
    def node_gaps(node: dict, pointer: str) -> list[Gap]:
        gaps = [Gap(f"`{key}`", pointer, "llguidance does not implement it") for key in node
                if key in _KEYWORDS and key not in LLGUIDANCE_KEYWORDS]
        return gaps + _pattern_gaps(node, pointer, is_xgrammar=False)
    return _walk(schema, node_gaps, used_children)


def llguidance_schema(schema: dict) -> dict:
    """`schema` as llguidance compiles it, meaning the same: without the definitions no `$ref` reaches (llguidance
    resolves every one's references, and refuses a remote one even there), without the formats llguidance does
    not know (annotations, which it would refuse) and without an `x-guidance` of the client's (the engine's
    options are the server's)."""
    reached = [pointer for _, pointer in nodes(schema, used_children)]
    schema = copy.deepcopy(schema)
    schema.pop("x-guidance", None)
    for key in ("definitions", "$defs"):
        if isinstance(schema.get(key), dict):
            schema[key] = {name: value for name, value in schema[key].items()
                           if any(f"{p}/".startswith(f"/{key}/{escape_step(name)}/") for p in reached)}
    for node, _ in nodes(schema, all_children):
        if isinstance(node.get("format"), str) and node["format"] not in LLGUIDANCE_FORMATS:
            del node["format"]
    return schema


def llguidance_options(schema: dict) -> dict:
    """llguidance's JSON options for `schema` (common/grammar.py's, as overrides): `oneOf` read as `anyOf` where
    every `oneOf` the schema reaches was proved disjoint here (then the two mean the same), which llguidance's own
    proof does not always find; never otherwise."""
    one_ofs = [node["oneOf"] for node, _ in nodes(schema, used_children) if isinstance(node.get("oneOf"), list)]
    is_exact = bool(one_ofs) and all(pairwise_disjoint(branches, schema) for branches in one_ofs)
    return {**LLGUIDANCE_JSON_OPTIONS, "coerce_one_of": is_exact}


def empty_ref_cycle(schema: dict) -> str | None:
    """The pointer of a schema object whose `$ref`s lead only to `$ref`s, in a circle that never reaches an
    assertion (no engine builds a grammar of it; a validator recurses without end); None when none does."""
    for node, pointer in nodes(schema, used_children):
        seen = set()
        while isinstance(node, dict) and isinstance(node.get("$ref"), str) and \
                not any(key in _KEYWORDS and key != "$ref" for key in node):
            if node["$ref"] in seen:
                return pointer
            seen.add(node["$ref"])
            node = resolve(schema, node["$ref"]) if node["$ref"].startswith("#") else None
    return None


def _walk(schema: dict, node_gaps, children) -> list[Gap]:
    return [gap for node, pointer in nodes(schema, children) for gap in node_gaps(node, pointer)]


def _xgrammar_children(node: dict):
    """The subschemas xgrammar reads: under the applicator it dispatches on, only that one's."""
    applicator = next((key for key in _APPLICATORS if key in node), None)
    if applicator in ("$ref", "const", "enum"):
        return ()  # (a $ref's target is followed by nodes)
    if applicator is not None:
        branches = node[applicator] if isinstance(node[applicator], list) else []
        return [((applicator, str(index)), child) for index, child in enumerate(branches)]
    return used_children(node)


def _xgrammar_node(node: dict, pointer: str, root: dict, is_old_draft: bool) -> list[Gap]:
    """The gaps of one schema object as xgrammar reads it (its subschemas are visited on their own)."""
    assertions = [key for key in node if key in _KEYWORDS]
    applicator = next((key for key in _APPLICATORS if key in node), None)
    if applicator == "$ref" and is_old_draft:  # the draft itself ignores a $ref's siblings
        return _beside_applicator(node, pointer, applicator, assertions, root, is_old_draft)
    gaps = [Gap(f"`{key}`", pointer, why) for key, why in _XGRAMMAR_IGNORES.items() if key in node]
    if applicator is not None:
        return gaps + _beside_applicator(node, pointer, applicator, assertions, root, is_old_draft)
    types = types_of(node)
    if types is None and any(key in node for key in _OBJECT_SIGNS):
        types = {"object"}  # as xgrammar reads it: an object (less than the schema allows, no more)
    elif types is None and any(key in node for key in _ARRAY_SIGNS):
        types = {"array"}
    elif types is None:  # xgrammar allows any value: every type's keywords go unenforced
        gaps += [Gap(f"`{key}`", pointer, "xgrammar ignores it in a schema without `type`") for key in assertions
                 if key in _BY_TYPE_KEYWORDS and key not in _XGRAMMAR_IGNORES]
    types = types or set()
    if "multipleOf" in node and "number" in types:
        gaps.append(Gap("`multipleOf`", pointer, "xgrammar ignores it on non-integer numbers"))
    if "pattern" in node and "string" in types and ("minLength" in node or "maxLength" in node):
        gaps.append(Gap("`pattern` beside `minLength`/`maxLength`", pointer, "xgrammar drops the length"))
    if isinstance(node.get("items"), list):
        gaps.append(Gap("`items` as a list (a tuple)", pointer, "xgrammar reads `prefixItems` only"))
    for key in ("exclusiveMinimum", "exclusiveMaximum"):
        if isinstance(node.get(key), bool):
            gaps.append(Gap(f"`{key}` as a boolean (draft 4)", pointer, "xgrammar reads numbers only"))
    return gaps + _pattern_gaps(node, pointer, is_xgrammar=True)


def _beside_applicator(node: dict, pointer: str, applicator: str, assertions: list[str], root: dict,
                       is_old_draft: bool) -> list[Gap]:
    """The gaps of a schema object that has one of _APPLICATORS, which xgrammar reads alone."""
    gaps = []
    if applicator == "$ref":
        ref = node["$ref"]
        if not (isinstance(ref, str) and (ref == "#" or ref.startswith("#/"))):  # (a dangling one: no compile)
            gaps.append(Gap(f"`$ref` to {str(ref)[:80]!r}", pointer, "only local `#/...` references are followed"))
        if is_old_draft:  # the draft itself ignores a $ref's siblings
            return gaps
    others = [key for key in assertions if key != applicator and key not in _XGRAMMAR_IGNORES]
    if applicator in ("const", "enum"):
        values = [node["const"]] if applicator == "const" else node["enum"]
        others = [key for key in others if key != "type" or not all(is_of_type(v, node["type"]) for v in values)
                  ] if isinstance(values, list) else others
    elif applicator in ("anyOf", "oneOf", "allOf") and others == ["type"]:
        types = types_of(node)
        if types and all(branch_types(branch, root) <= types | ({"integer"} if "number" in types else set())
                         for branch in node[applicator] if isinstance(node[applicator], list)):
            others = []
    gaps += [Gap(f"`{key}` beside `{applicator}`", pointer, "xgrammar reads only the first of `$ref`, `const`, "
                 "`enum`, `anyOf`, `oneOf`, `allOf`") for key in others]
    branches = node[applicator] if isinstance(node[applicator], list) else []
    if applicator == "allOf" and sum(1 for b in branches if _is_assertive(b)) > 1:
        gaps.append(Gap("`allOf` of several schemas", pointer, "xgrammar does not intersect them"))
    if applicator == "oneOf" and not pairwise_disjoint(branches, root):
        gaps.append(Gap("`oneOf`", pointer, "its branches are not provably disjoint: xgrammar allows several"))
    return gaps


_LOOKAROUND = re.compile(r"\(\?<?[=!]")
_BACKREF = re.compile(r"\\(?:[1-9]|k<)")
_BOUNDARY = re.compile(r"\\[bB]")
_UNICODE_CLASS = re.compile(r"\\[pP]")
_UNKNOWN_ESCAPE = re.compile(r"(?<!\\)(?:\\\\)*\\[aeghijklmopqyzACE-RT-VX-Z]")
"""A letter escape ECMA-262 does not have (it has b B c d D f k n r s S t u v w W x)."""


def _pattern_gaps(node: dict, pointer: str, is_xgrammar: bool) -> list[Gap]:
    """Gaps of the regexes in `pattern` and `patternProperties` keys."""
    patterns = [("`pattern`", node.get("pattern"))]
    if isinstance(node.get("patternProperties"), dict):
        patterns += [("`patternProperties` key", key) for key in node["patternProperties"]]
    gaps = []
    for what, pattern in patterns:
        if isinstance(pattern, str):
            why = regex_problem(_without_classes(pattern), is_xgrammar)
            if why is not None:
                gaps.append(Gap(f"{what} {pattern[:60]!r}", pointer, why))
    return gaps


def regex_problem(pattern: str, is_xgrammar: bool) -> str | None:
    """Why an engine would not match `pattern` (an ECMA-262 regex, its character classes blanked) exactly."""
    if _LOOKAROUND.search(pattern):
        return "a lookaround, which the engines ignore or refuse"
    if _BACKREF.search(pattern):
        return "a backreference, which no grammar engine can match"
    if _BOUNDARY.search(pattern):
        return "a word boundary, which the engines refuse"
    if not is_xgrammar:
        return None
    if _UNICODE_CLASS.search(pattern):
        return "a Unicode property class, which xgrammar does not read"
    if _UNKNOWN_ESCAPE.search(pattern):
        return "an escape xgrammar does not know, which it matches as the letter itself"
    if re.search(r"(?<!\\)\^", pattern[1:]) or re.search(r"(?<!\\)\$(?!$)", pattern):
        return "an anchor inside the pattern, which xgrammar ignores"
    if _alternation_with_range(pattern):
        return "alternatives beside a counted repetition, which xgrammar's JSON strings can repeat without bound"
    return None


def _alternation_with_range(pattern: str) -> bool:
    """Whether a group (or the whole pattern) has alternatives and, in it, a `{m,n}` repetition: xgrammar 0.2's
    JSON-string regexes let `^(a|a{1,3})$` repeat without bound."""
    frames = [[False, False]]  # per open group: [has `|`, has `{m,n}` in it]
    escaped = False
    for index, char in enumerate(pattern):
        if escaped:
            escaped = False
        elif char == "\\":
            escaped = True
        elif char == "(":
            frames.append([False, False])
        elif char == ")" and len(frames) > 1:
            has_alternatives, has_range = frames.pop()
            if has_alternatives and has_range:
                return True
            frames[-1][1] |= has_range
        elif char == "|":
            frames[-1][0] = True
        elif char == "{" and re.match(r"\{\d*,\d*\}", pattern[index:]):
            frames[-1][1] = True
    return any(has_alternatives and has_range for has_alternatives, has_range in frames)


def _without_classes(pattern: str) -> str:
    """`pattern` with each character class [...] replaced by `C` (so that `^`, `$` and `|` in one are not read as
    operators); escapes kept."""
    return re.sub(r"\[(?:\\.|[^\]\\])*\]", "C", pattern)


def _is_assertive(schema: object) -> bool:
    """Whether a subschema asserts anything (not `true`, `{}` or annotations only)."""
    return schema is False or isinstance(schema, dict) and any(key in _KEYWORDS for key in schema)
