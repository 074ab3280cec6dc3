"""Command-line flags derived from the services' config dataclasses.

Each dataclass field becomes `--field-name`, typed from its annotation, with its
attribute docstring as help. A boolean is `--field-name/--no-field-name`; an
`is_*` boolean also answers to its name without `is_` (`is_prefix_caching`:
`--prefix-caching/--no-prefix-caching`). `to_argv` is the inverse, used by the launcher to
start each service as its own process with the same config.

Every flag also reads an environment variable, for container manifests: `SEGSERVE_` and the
flag's name in capitals (`--max-num-seqs` -> SEGSERVE_MAX_NUM_SEQS, `--prefix-caching` ->
SEGSERVE_PREFIX_CACHING). A flag given on the command line wins over its variable. Booleans take
1/true/yes/on or 0/false/no/off; lists take comma-separated values.

A secret (the router's api_keys) is a field with `metadata={ENV_ONLY: True}`: it gets no flag, since
flags show in `ps` and /proc/<pid>/cmdline, only its environment variable sets it, `to_argv` leaves
it out and `to_env` gives it to a child process in its environment instead.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import inspect
import os
import textwrap
import typing
from functools import cache
from typing import Any, TypeVar

T = TypeVar("T")


@cache
def field_docs(cls: type) -> dict[str, str]:
    """Attribute docstrings (the string literal under each field) of a dataclass."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
    body = tree.body[0].body
    docs = {}
    for node, following in zip(body, body[1:]):
        if isinstance(node, ast.AnnAssign) and isinstance(following, ast.Expr):
            if isinstance(following.value, ast.Constant) and isinstance(following.value.value, str):
                docs[node.target.id] = " ".join(following.value.value.split())
    return docs


def _base_type(annotation: Any) -> type:
    """`int | None` -> int; `list[int]` -> list."""
    args = [a for a in typing.get_args(annotation) if a is not type(None)]
    if typing.get_origin(annotation) in (typing.Union, getattr(__import__("types"), "UnionType")):
        return _base_type(args[0])
    return typing.get_origin(annotation) or annotation


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


ENV_PREFIX = "SEGSERVE_"
ENV_ONLY = "env_only"
"""The field metadata key of a secret: set only by its environment variable, never a flag (module docstring)."""
_TRUE, _FALSE = ("1", "true", "yes", "on"), ("0", "false", "no", "off")


def is_env_only(field: dataclasses.Field) -> bool:
    return bool(field.metadata.get(ENV_ONLY))


def env_name(dest: str) -> str:
    """The environment variable of the flag whose destination is `dest`."""
    return ENV_PREFIX + dest.removeprefix("is_").upper()


def env_names(cls: type, rename: dict[str, str] | None = None) -> set[str]:
    """The environment variables that configure `cls`'s fields."""
    rename = rename or {}
    return {env_name(rename.get(f.name, f.name)) for f in dataclasses.fields(cls)}


def _from_env(dest: str, kind: type) -> Any:
    """The value of dest's environment variable as `kind`, or None when it is unset or empty."""
    name = env_name(dest)
    text = os.environ.get(name, "").strip()
    if not text:
        return None
    try:
        if kind is bool:
            if text.lower() not in _TRUE + _FALSE:
                raise ValueError(f"expected one of {'/'.join(_TRUE + _FALSE)}")
            return text.lower() in _TRUE
        if kind is list:
            return [part.strip() for part in text.split(",") if part.strip()]
        return kind(text)
    except ValueError as exc:
        raise ValueError(f"environment variable {name}={text!r}: {exc}") from None


def add_dataclass_args(parser: argparse.ArgumentParser, cls: type, skip: frozenset[str] = frozenset(),
                       rename: dict[str, str] | None = None) -> None:
    """Add one flag per field of `cls` (defaults None, so unset flags keep the dataclass default); none for
    `skip`'s fields and the env-only ones."""
    rename = rename or {}
    hints = typing.get_type_hints(cls)
    docs = field_docs(cls)
    for field in dataclasses.fields(cls):
        if field.name in skip or is_env_only(field):
            continue
        dest = rename.get(field.name, field.name)
        kind = _base_type(hints[field.name])
        default = field.default if field.default is not dataclasses.MISSING else None
        help_text = f"{docs.get(field.name, '')} (default: {default}; env {env_name(dest)})"
        if kind is bool:
            names = [_flag(dest)] + ([_flag(dest.removeprefix("is_"))] if dest.startswith("is_") else [])
            parser.add_argument(*names, dest=dest, action=argparse.BooleanOptionalAction, default=None,
                                help=help_text)
        elif kind is list:
            parser.add_argument(_flag(dest), dest=dest, nargs="*", default=None, help=help_text)
        else:
            parser.add_argument(_flag(dest), dest=dest, type=kind, default=None, help=help_text)


def from_args(cls: type[T], args: argparse.Namespace, rename: dict[str, str] | None = None, **overrides) -> T:
    """Build `cls` from parsed flags, then their environment variables; what neither sets keeps the dataclass
    default. Raises ValueError naming the variable when one does not parse."""
    rename = rename or {}
    hints = typing.get_type_hints(cls)
    values = {}
    for field in dataclasses.fields(cls):
        dest = rename.get(field.name, field.name)
        value = getattr(args, dest, None)
        if value is None:
            value = _from_env(dest, _base_type(hints[field.name]))
        if value is not None:
            values[field.name] = value
    values.update(overrides)
    return cls(**values)


def to_argv(config: Any) -> list[str]:
    """Flags that reproduce `config` when parsed by add_dataclass_args/from_args, but for its env-only fields
    (`to_env`)."""
    argv = []
    for field in dataclasses.fields(config):
        value = getattr(config, field.name)
        if is_env_only(field) or value is None or value == field.default:
            continue
        if isinstance(value, bool):
            argv.append(_flag(field.name) if value else "--no-" + field.name.replace("_", "-"))
        elif isinstance(value, (list, tuple)):
            argv += [_flag(field.name), *map(str, value)]
        else:
            argv += [_flag(field.name), str(value)]
    return argv


def to_env(config: Any) -> dict[str, str]:
    """The environment variables that give a child process `config`'s env-only fields (set ones only); with
    `to_argv`'s flags, from_args rebuilds `config` there."""
    env = {}
    for field in dataclasses.fields(config):
        value = getattr(config, field.name)
        if not is_env_only(field) or not value:
            continue
        if isinstance(value, (list, tuple)):
            if any("," in str(item) for item in value):
                raise ValueError(f"{field.name}: a value holds a comma, which {env_name(field.name)} cannot carry")
            value = ",".join(map(str, value))
        env[env_name(field.name)] = str(value)
    return env
