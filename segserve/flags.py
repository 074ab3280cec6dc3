"""Command-line flags derived from the services' config dataclasses.

Each dataclass field becomes `--field-name`, typed from its annotation. A boolean has one spelling,
`--field-name/--no-field-name`, where an `is_*` field drops its `is_` (`is_prefix_caching`:
`--prefix-caching/--no-prefix-caching`; the prefix stays in the code). `to_argv` is the inverse, used by the
launcher to start each service as its own process with the same config.

`--help` shows one argument group per config class, each flag with a summary of its field's docstring (its first
sentence, shortened to fit two lines: `summary`); the docstring itself is the full text.

Every flag also reads an environment variable, for container manifests: `SEGSERVE_` and the flag's name in
capitals (`--max-num-seqs` -> SEGSERVE_MAX_NUM_SEQS, `--prefix-caching` -> SEGSERVE_PREFIX_CACHING). A flag given
on the command line wins over its variable. Booleans take on|off (true/false, yes/no and 1/0 too); lists take
comma-separated values.

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
import re
import textwrap
import typing
from functools import cache
from typing import Any, TypeVar

T = TypeVar("T")


@cache
def field_docs(cls: type) -> dict[str, str]:
    """Attribute docstrings (the string literal under each field) of a dataclass, its dataclass bases' included
    (a field a subclass declares again takes the subclass's)."""
    docs = {}
    for klass in reversed(cls.__mro__):
        if not dataclasses.is_dataclass(klass):
            continue
        body = ast.parse(textwrap.dedent(inspect.getsource(klass))).body[0].body
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


def option_name(dest: str) -> str:
    """The name a field (or renamed destination) goes by outside the code: its `is_` prefix dropped."""
    return dest.removeprefix("is_")


def flag(dest: str) -> str:
    """The flag of the field (or renamed destination) `dest`: `is_prefix_caching` -> `--prefix-caching`."""
    return "--" + option_name(dest).replace("_", "-")


ENV_PREFIX = "SEGSERVE_"
ENV_ONLY = "env_only"
"""The field metadata key of a secret: set only by its environment variable, never a flag (module docstring)."""
_TRUE, _FALSE = ("on", "true", "yes", "1"), ("off", "false", "no", "0")
HELP_WIDTH, HELP_LINES = 46, 2
"""A flag's help, default included, takes at most two lines of 46 characters: its column in HelpFormatter's
layout on an 80-column terminal."""
_METAVARS = {int: "N", float: "X", str: "TEXT", list: "ITEM"}


class HelpFormatter(argparse.HelpFormatter):
    """argparse's layout with the help column at 32, where most flags with their metavar fit: a flag's help starts
    on its line and takes at most two (HELP_WIDTH)."""

    def __init__(self, prog: str, indent_increment: int = 2, max_help_position: int = 32, width: int | None = None):
        super().__init__(prog, indent_increment, max_help_position, width)


def is_env_only(field: dataclasses.Field) -> bool:
    return bool(field.metadata.get(ENV_ONLY))


def env_name(dest: str) -> str:
    """The environment variable of the flag whose destination is `dest`."""
    return ENV_PREFIX + option_name(dest).upper()


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
                raise ValueError("expected on or off")
            return text.lower() in _TRUE
        if kind is list:
            return [part.strip() for part in text.split(",") if part.strip()]
        return kind(text)
    except ValueError as exc:
        raise ValueError(f"environment variable {name}={text!r}: {exc}") from None


def summary(doc: str, suffix: str = "") -> str:
    """The first sentence of `doc`, then `suffix`, in at most HELP_LINES lines of HELP_WIDTH: when it is longer, its
    parentheticals go, then its last clauses (after `; `) while half a line is left, then its last words, for an
    ellipsis. The whole docstring stays the reference (the docs); this is what `--help` has room for."""

    def fits(text: str) -> bool:
        return len(textwrap.wrap(text + suffix, HELP_WIDTH)) <= HELP_LINES

    protected = doc.replace("e.g.", "e\0g\0").replace("i.e.", "i\0e\0")
    text = re.split(r"(?<=[.!?])\s+", protected, maxsplit=1)[0].replace("\0", ".").rstrip(".")
    while not fits(text) and re.search(r"\s*\([^()]*\)", text):
        text = re.sub(r"\s*\([^()]*\)", "", text, count=1)
    clauses = text.split("; ")
    while not fits(text) and len(clauses) > 1 and len("; ".join(clauses[:-1])) >= HELP_WIDTH // 2:
        clauses.pop()
        text = "; ".join(clauses)
    words = text.split(" ")
    while not fits(text) and len(words) > 1:
        words.pop()
        text = " ".join(words).rstrip(",;:") + "…"
    return text + suffix


def _help(doc: str, default: Any) -> str:
    if isinstance(default, bool):
        default = "on" if default else "off"
    return summary(doc, "" if default in (None, "", []) else f" (default: {default})")


def add_dataclass_args(parser: argparse.ArgumentParser, cls: type, skip: frozenset[str] = frozenset(),
                       rename: dict[str, str] | None = None, title: str | None = None) -> None:
    """Add one flag per field of `cls` (defaults None, so unset flags keep the dataclass default), in an argument
    group titled `title` (by default the class's name without Config: `worker (WorkerConfig)`); none for `skip`'s
    fields and the env-only ones."""
    rename = rename or {}
    hints = typing.get_type_hints(cls)
    docs = field_docs(cls)
    group = parser.add_argument_group(f"{title or cls.__name__.removesuffix('Config').lower()} ({cls.__name__})")
    own = vars(cls).get("__annotations__", {})
    for field in sorted(dataclasses.fields(cls), key=lambda f: f.name not in own):  # the class's own fields first
        if field.name in skip or is_env_only(field):
            continue
        dest = rename.get(field.name, field.name)
        kind = _base_type(hints[field.name])
        default = field.default if field.default is not dataclasses.MISSING else None
        help_text = _help(docs.get(field.name, ""), default)
        if kind is bool:
            group.add_argument(flag(dest), dest=dest, action=argparse.BooleanOptionalAction, default=None,
                               help=help_text)
        elif kind is list:
            group.add_argument(flag(dest), dest=dest, nargs="*", default=None, metavar=_METAVARS[list],
                               help=help_text)
        else:
            group.add_argument(flag(dest), dest=dest, type=kind, default=None, metavar=_METAVARS.get(kind),
                               help=help_text)


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
            argv.append(flag(field.name) if value else "--no-" + flag(field.name).removeprefix("--"))
        elif isinstance(value, (list, tuple)):
            argv += [flag(field.name), *map(str, value)]
        else:
            argv += [flag(field.name), str(value)]
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
