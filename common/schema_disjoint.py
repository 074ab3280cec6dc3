"""Whether two JSON schemas are disjoint (no value matches both), proved from what one look at each tells: their
types, their `const`/`enum` values, or a required property whose values differ. A `oneOf` whose branches are
pairwise disjoint means what its `anyOf` means, which is what grammar engines build.

In: subschemas and their root (for local `$ref`s). Out: True where disjointness is proved (False: not proved);
and the small readings of a schema object it rests on (its types, its values). Pure Python.
"""

from __future__ import annotations

from common.schema_walk import resolved


def types_of(node: dict) -> set[str] | None:
    """The JSON types `type` allows (None: any)."""
    value = node.get("type")
    if isinstance(value, str):
        return {value}
    return {t for t in value if isinstance(t, str)} if isinstance(value, list) else None


def is_of_type(value: object, types: object) -> bool:
    """Whether a JSON value is of `type` (a name or a list of names)."""
    names = [types] if isinstance(types, str) else types if isinstance(types, list) else []
    return any(value_type(value) == name or (name == "number" and value_type(value) == "integer")
               or (name == "integer" and isinstance(value, float) and value.is_integer()) for name in names)


def value_type(value: object) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, int):
        return "integer"
    return {float: "number", str: "string", list: "array", dict: "object"}.get(type(value), "?")


def values_of(node: dict) -> list | None:
    """The values `const` or `enum` allows (None: not restricted to a list)."""
    if "const" in node:
        return [node["const"]]
    return node["enum"] if isinstance(node.get("enum"), list) else None


def branch_types(branch: object, root: dict) -> set[str]:
    """The JSON types a branch allows at most, as far as one look tells ({"?"} where it does not)."""
    branch = resolved(branch, root)
    values = values_of(branch) if isinstance(branch, dict) else None
    if values is not None:
        return {value_type(value) for value in values}
    types = types_of(branch) if isinstance(branch, dict) else None
    return types if types is not None else {"?"}


def pairwise_disjoint(branches: list, root: dict) -> bool:
    """Whether no JSON value matches two of `branches` (proved by types, values or a discriminating property)."""
    targets = [resolved(branch, root) for branch in branches]
    return all(_disjoint(a, b, root) for i, a in enumerate(targets) for b in targets[i + 1:])


def _disjoint(a: object, b: object, root: dict) -> bool:
    if a is False or b is False:
        return True
    if not (isinstance(a, dict) and isinstance(b, dict)):
        return False
    types_a, types_b = branch_types(a, root), branch_types(b, root)
    if "?" not in types_a | types_b and not _types_overlap(types_a, types_b):
        return True
    values_a, values_b = values_of(a), values_of(b)
    if values_a is not None and values_b is not None:
        return not any(_same(x, y) for x in values_a for y in values_b)
    if types_a == {"object"} == types_b:
        return _discriminated(a, b, root) or _discriminated(b, a, root)
    return False


def _discriminated(a: dict, b: dict, root: dict) -> bool:
    """Objects that a property tells apart: required by `a` with values `b` does not allow there, or that `b`
    (without extra properties) does not have."""
    properties_b = b.get("properties") if isinstance(b.get("properties"), dict) else {}
    required_b = b.get("required") if isinstance(b.get("required"), list) else []
    for name in a.get("required", []) if isinstance(a.get("required"), list) else []:
        if name not in properties_b:
            if b.get("additionalProperties") is False and not b.get("patternProperties"):
                return True
            continue
        values_a = values_of(resolved((a.get("properties") or {}).get(name), root) or {})
        values_b = values_of(resolved(properties_b[name], root) or {})
        if name in required_b and values_a is not None and values_b is not None and \
                not any(_same(x, y) for x in values_a for y in values_b):
            return True
    return False


def _types_overlap(a: set[str], b: set[str]) -> bool:
    widen = lambda types: types | ({"integer"} if "number" in types else set())  # noqa: E731
    return bool(widen(a) & widen(b))


def _same(x: object, y: object) -> bool:
    """JSON equality: 1 and 1.0 are one number, true is not 1."""
    if isinstance(x, bool) or isinstance(y, bool):
        return isinstance(x, bool) and isinstance(y, bool) and x == y
    if isinstance(x, list) and isinstance(y, list):
        return len(x) == len(y) and all(_same(a, b) for a, b in zip(x, y))
    if isinstance(x, dict) and isinstance(y, dict):
        return x.keys() == y.keys() and all(_same(x[k], y[k]) for k in x)
    return type(x) is type(y) and x == y or (value_type(x) in ("integer", "number") and
                                            value_type(y) in ("integer", "number") and x == y)
