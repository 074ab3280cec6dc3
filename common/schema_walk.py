"""Walking a JSON schema: its subschemas, each with its JSON pointer (RFC 6901), and its local `$ref`s resolved.

In: a schema (a dict) and which of a schema object's subschemas to follow. Out: (schema object, pointer) pairs,
each object once, the target of a `#` or `#/...` reference visited where the reference is; the subschema a local
reference points at. Pure Python; iterative (a schema may be deep or recursive).
"""

from __future__ import annotations

import re

_NESTED = ("properties", "patternProperties", "dependentSchemas", "$defs", "definitions")
_SINGLE = ("additionalProperties", "items", "additionalItems", "unevaluatedItems", "unevaluatedProperties",
           "contains", "propertyNames", "not", "if", "then", "else")
_LISTED = ("prefixItems", "anyOf", "oneOf", "allOf", "items")


def nodes(schema: dict, children):
    """(schema object, its pointer) for every object reachable from the root through `children` and local
    `$ref`s, each once."""
    seen, pending = set(), [(schema, "")]
    while pending:
        node, pointer = pending.pop()
        if not isinstance(node, dict) or pointer in seen:
            continue
        seen.add(pointer)
        yield node, pointer
        ref = node.get("$ref")
        if isinstance(ref, str) and (ref == "#" or ref.startswith("#/")):
            target = resolve(schema, ref)
            if target is not None:
                pending.append((target, unescape_ref(ref[1:])))
        pending.extend(reversed([(child, pointer + "".join("/" + escape_step(step) for step in steps))
                                 for steps, child in children(node)]))


def all_children(node: dict):
    """(pointer steps, subschema) of every subschema in a schema object."""
    for key in _NESTED:
        if isinstance(node.get(key), dict):
            yield from (((key, name), child) for name, child in node[key].items())
    for key in _SINGLE:
        if isinstance(node.get(key), dict):
            yield (key,), node[key]
    for key in _LISTED:
        if isinstance(node.get(key), list):
            yield from (((key, str(index)), child) for index, child in enumerate(node[key]))


def used_children(node: dict):
    """all_children but definitions (which only a `$ref` brings in)."""
    return (item for item in all_children(node) if item[0][0] not in ("$defs", "definitions"))


def resolved(schema: object, root: dict, limit: int = 32) -> object:
    """`schema`, through its local `$ref`s (a chain of at most `limit`); None where one does not resolve."""
    while isinstance(schema, dict) and isinstance(schema.get("$ref"), str) and limit:
        schema, limit = resolve(root, schema["$ref"]), limit - 1
    return schema


def resolve(root: dict, ref: str) -> object:
    """The subschema a local reference ("#", "#/a/b") points at, None where it points at nothing."""
    if ref == "#":
        return root
    node: object = root
    for step in unescape_ref(ref[1:]).split("/")[1:]:
        step = step.replace("~1", "/").replace("~0", "~")
        if isinstance(node, dict) and step in node:
            node = node[step]
        elif isinstance(node, list) and step.isdigit() and int(step) < len(node):
            node = node[int(step)]
        else:
            return None
    return node


def unescape_ref(fragment: str) -> str:
    """A URI fragment's percent-escapes decoded (a JSON pointer, still ~-escaped)."""
    return re.sub(r"%([0-9A-Fa-f]{2})", lambda m: chr(int(m.group(1), 16)), fragment)


def escape_step(step: str) -> str:
    """One JSON pointer step, escaped (RFC 6901)."""
    return step.replace("~", "~0").replace("/", "~1")
