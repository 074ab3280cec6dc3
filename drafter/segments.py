"""Segment kinds and their TOML config: markers, tree algorithm, corpus limits, draft model.

In: a TOML file (format below) and a tokenizer to resolve token strings. Out: a
`SegmentsConfig` of `SegmentKind`s whose markers are tuples of token ids.

Format (see drafter/segments/default.toml; a catalog model may have its own, drafter/segments/<name>.toml)::

    [default]                      # text outside every segment (no markers)
    algorithm = "best_first"       # single_branch | multi_branch_dfs | multi_branch_bfs | best_first
    max_nodes = 8                  # node budget of a tree (the root excluded)
    max_depth = 6                  # longest path of a tree
    max_candidates = 8             # continuations asked of each source
    spec_factor = 1.0              # drafts as deep as spec_factor x the match (0 = fixed max_depth)
    min_prob = 0.0                 # no node less likely to be accepted (the scheduler may ask more)
    corpus = { max_bytes = 67108864, max_depth = 16, max_key = 8, min_key = 2, decay = 0.5 }

    [[segment]]
    name = "code"
    start = "```"                  # a marker: a token string, a token id, or a list of them
    end = "```"                    #   (a list, or a string that is not one token, is a token sequence)
    algorithm = "multi_branch_dfs"
    draft_model = { kind = "self_speculative", num_layers = 4, mode = "combine" }
    # or draft_model = { kind = "model", path = "/models/tiny", mode = "replace" }
    # Besides `mode`, the table is the draft-model loader's spec (drafter/draft_model.py);
    # a self-speculative draft's "target" defaults to the served model.

    [schema]                       # optional: requests with a corpus key (drafter/keyed.py), no markers
    algorithm = "multi_branch_dfs" #   nor draft model; keys left out take [default]'s values

A string is first looked up as one vocabulary token, else it is encoded without
special tokens. Keys left out take the defaults of the dataclasses below.
"""

from __future__ import annotations

import tomllib
from dataclasses import dataclass, field, fields
from functools import cached_property
from pathlib import Path
from typing import Any

from drafter.trees import BUILDERS

DEFAULT_SEGMENT = "default"
SCHEMA_SEGMENT = "schema"
DEFAULT_CONFIG_PATH = Path(__file__).parent / "segments" / "default.toml"
DRAFT_MODEL_KINDS = ("self_speculative", "model")
DRAFT_MODES = ("replace", "combine")


@dataclass(frozen=True)
class CorpusLimits:
    """Size and lookup limits of one segment kind's lookup corpus (drafter/corpus.py)."""

    max_bytes: int = 64 << 20
    """Memory budget of the corpus's arrays in bytes (drafter/corpus.py, about 20 a learned token); past it the
    oldest sequences are evicted down to 90% of it."""
    max_entries: int = 0
    """An extra bound on learned tokens held (0 = none: the byte budget alone)."""
    max_depth: int = 16
    """Depth of the suffix arrays' sort: key length + continuation length never exceed it."""
    max_key: int = 8
    """Longest key (context suffix) tried; the longest that matches wins."""
    min_key: int = 2
    """Shortest key tried; shorter matches propose nothing (too weak to pay for verification)."""
    decay: float = 0.5
    """Factor applied to every count at each eviction pass (0 < decay < 1)."""

    def __post_init__(self) -> None:
        if self.max_bytes <= 0 or self.max_entries < 0 or self.max_depth < 2:
            raise ValueError("corpus max_bytes must be > 0, max_entries >= 0 (0 = no token bound) and max_depth >= 2")
        if not 1 <= self.min_key <= self.max_key < self.max_depth:
            raise ValueError("corpus keys need 1 <= min_key <= max_key < max_depth")
        if not 0.0 < self.decay < 1.0:
            raise ValueError("corpus decay must be in (0, 1)")


@dataclass(frozen=True)
class DraftModelSpec:
    """Which draft model a segment uses: `mode` plus the loader's own spec (drafter/draft_model.py)."""

    kind: str
    """"self_speculative" (the target's first num_layers layers + its head) or "model" (a directory)."""
    mode: str = "combine"
    """"replace": the draft model is the only source; "combine": it joins the corpus and history."""
    params: tuple[tuple[str, Any], ...] = ()
    """The TOML table without `mode` (kind, num_layers, path, head_vocab_size, ...), validated by the loader."""

    def __post_init__(self) -> None:
        if self.kind not in DRAFT_MODEL_KINDS:
            raise ValueError(f"draft_model kind must be one of {DRAFT_MODEL_KINDS}, got {self.kind!r}")
        if self.mode not in DRAFT_MODES:
            raise ValueError(f"draft_model mode must be one of {DRAFT_MODES}, got {self.mode!r}")

    @classmethod
    def from_table(cls, table: dict) -> "DraftModelSpec":
        params = {k: v for k, v in table.items() if k != "mode"}
        return cls(kind=table.get("kind", ""), mode=table.get("mode", "combine"), params=tuple(params.items()))

    def loader_spec(self, target_dir: str) -> dict[str, Any]:
        """The dict load_draft_model reads; a self-speculative draft defaults to the served model."""
        spec = dict(self.params)
        if self.kind == "self_speculative":
            spec.setdefault("target", target_dir)
        return spec


@dataclass(frozen=True)
class SegmentKind:
    """One kind of generation segment; the default and schema kinds have no markers."""

    name: str
    """Unique name, used for corpora, metrics and the DraftReply.segment field."""
    start: tuple[int, ...] = ()
    """Token ids whose appearance opens the segment (empty only for the default)."""
    end: tuple[int, ...] = ()
    """Token ids whose appearance closes it (may equal start, as code fences do)."""
    algorithm: str = "best_first"
    """Tree builder name, a key of drafter.trees.BUILDERS."""
    max_nodes: int = 8
    """Node budget of one tree (the root excluded); the scheduler's max_nodes may lower it."""
    max_depth: int = 6
    """Longest path of one tree."""
    max_candidates: int = 8
    """Continuations asked of each source."""
    spec_factor: float = 0.0
    """Match-length–adaptive depth (drafter/planner.py): a lookup's continuation after a match of n tokens drafts
    at most spec_factor * n tokens, and a long match may pass max_depth and max_nodes up to the scheduler's
    budget; 0 = fixed max_depth and max_nodes."""
    min_prob: float = 0.0
    """Nodes less likely to be accepted than this (their weight in the merged trie: drafter/trees.py) are not
    drafted, however much budget is left (SuffixDecoding's min_token_prob): a node rarely accepted costs a batch's
    step more than it brings. The scheduler's price of a draft token may ask more (DraftQuery.min_node_prob)."""
    corpus: CorpusLimits = field(default_factory=CorpusLimits)
    """Limits of this kind's lookup corpus."""
    draft_model: DraftModelSpec | None = None
    """Optional draft model for this kind."""

    def __post_init__(self) -> None:
        if not self.name:
            raise ValueError("a segment needs a name")
        if self.algorithm not in BUILDERS:
            raise ValueError(f"segment {self.name!r}: algorithm must be one of {sorted(BUILDERS)}")
        if self.max_nodes < 0 or self.max_depth <= 0 or self.max_candidates <= 0 or not self.spec_factor >= 0:
            raise ValueError(f"segment {self.name!r}: max_nodes >= 0, max_depth and max_candidates > 0, "
                             "spec_factor >= 0")
        if not 0 <= self.min_prob < 1:
            raise ValueError(f"segment {self.name!r}: min_prob must be in [0, 1), got {self.min_prob}")
        has_markers = (bool(self.start), bool(self.end))
        if has_markers != ((False, False) if self.name in (DEFAULT_SEGMENT, SCHEMA_SEGMENT) else (True, True)):
            raise ValueError(f"segment {self.name!r}: every segment but the default and schema needs start and end "
                             "markers (which those two never have)")


@dataclass(frozen=True)
class SegmentsConfig:
    """The default segment plus every marked kind, in file order, and the kind of keyed outputs."""

    default: SegmentKind
    kinds: tuple[SegmentKind, ...] = ()
    schema: SegmentKind = field(default_factory=lambda: SegmentKind(SCHEMA_SEGMENT))
    """A request with a corpus key (a structured output's schema) is one segment of this kind, its corpora one per
    key (drafter/keyed.py); not among all_kinds: no marker opens it."""

    def __post_init__(self) -> None:
        names = [self.default.name, *(k.name for k in self.kinds), self.schema.name]
        if len(set(names)) != len(names):
            raise ValueError(f"segment names must be unique (and not {SCHEMA_SEGMENT!r}): {names}")
        if self.schema.name != SCHEMA_SEGMENT or self.schema.draft_model is not None:
            raise ValueError(f"the schema kind is named {SCHEMA_SEGMENT!r} and takes no draft_model")

    @property
    def all_kinds(self) -> tuple[SegmentKind, ...]:
        return (self.default, *self.kinds)

    def kind(self, name: str) -> SegmentKind:
        return next(k for k in self.all_kinds if k.name == name)

    @cached_property
    def marker_token_ids(self) -> tuple[int, ...]:
        """Every token of every kind's start and end markers, sorted: a request's segment changes only at one."""
        return tuple(sorted({token for kind in self.kinds for token in (*kind.start, *kind.end)}))


def shipped_config_path(tokenizer: Any = None) -> Path:
    """The shipped segments file for the tokenizer's model: drafter/segments/<catalog name>.toml for a catalog
    model that has one (its converted checkpoint names it), else default.toml."""
    from common.checkpoint import model_card

    directory = getattr(tokenizer, "name_or_path", "")
    name = model_card(Path(directory)).get("name", "") if directory else ""
    own = DEFAULT_CONFIG_PATH.with_name(f"{name}.toml")
    return own if name and own.is_file() else DEFAULT_CONFIG_PATH


def load_segments(path: str | Path | None = None, tokenizer: Any = None) -> SegmentsConfig:
    """Read a segments TOML file (None = the one shipped for the tokenizer's model) and resolve its markers."""
    with open(path or shipped_config_path(tokenizer), "rb") as f:
        raw = tomllib.load(f)
    return parse_segments(raw, tokenizer)


def parse_segments(raw: dict, tokenizer: Any = None) -> SegmentsConfig:
    """Build a SegmentsConfig from parsed TOML; token strings need `tokenizer`."""
    unknown = set(raw) - {"default", "segment", SCHEMA_SEGMENT}
    if unknown:
        raise ValueError(f"unknown top-level keys in segments config: {sorted(unknown)}")
    default_table = raw.get("default", {})
    default = _kind({**default_table, "name": DEFAULT_SEGMENT}, tokenizer)
    kinds = tuple(_kind(table, tokenizer) for table in raw.get("segment", []))
    inherited = {key: value for key, value in default_table.items() if key != "draft_model"}
    schema = _kind({**inherited, **raw.get(SCHEMA_SEGMENT, {}), "name": SCHEMA_SEGMENT}, tokenizer)
    return SegmentsConfig(default=default, kinds=kinds, schema=schema)


def _kind(table: dict, tokenizer: Any) -> SegmentKind:
    allowed = {f.name for f in fields(SegmentKind)}
    unknown = set(table) - allowed
    if unknown:
        raise ValueError(f"segment {table.get('name')!r}: unknown keys {sorted(unknown)}")
    values = dict(table)
    for key in ("start", "end"):
        if key in values:
            values[key] = resolve_marker(values[key], tokenizer)
    if "corpus" in values:
        values["corpus"] = CorpusLimits(**values["corpus"])
    if "draft_model" in values:
        values["draft_model"] = DraftModelSpec.from_table(values["draft_model"])
    return SegmentKind(**values)


def resolve_marker(marker: Any, tokenizer: Any) -> tuple[int, ...]:
    """A token id, a token string, or a list of them -> a tuple of token ids."""
    parts = marker if isinstance(marker, list) else [marker]
    ids: list[int] = []
    for part in parts:
        if isinstance(part, int):
            ids.append(part)
        elif isinstance(part, str):
            ids.extend(_string_ids(part, tokenizer))
        else:
            raise ValueError(f"a marker is a token id or string, got {part!r}")
    if not ids:
        raise ValueError(f"marker {marker!r} resolves to no tokens")
    return tuple(ids)


def _string_ids(text: str, tokenizer: Any) -> list[int]:
    if tokenizer is None:
        raise ValueError(f"marker {text!r} is a string: resolving it needs a tokenizer")
    token_id = tokenizer.convert_tokens_to_ids(text)
    if isinstance(token_id, int) and token_id != tokenizer.unk_token_id:
        return [token_id]
    return list(tokenizer.encode(text, add_special_tokens=False))
