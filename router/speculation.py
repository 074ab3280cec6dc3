"""How each streamed token came about, for people to see (the playground): an opt-in extension of SSE chunks.

In: the scheduler's TokenChunks (one per step: the segment kind, the size and
depth of the candidate tree it verified, how many of its tokens are accepted
drafts), read before generation.py merges chunks that piled up. Out: per Delta,
a `Speculation` (each token's own text and its step), and per SSE chunk the
`segserve` object built from it:

    "segserve": {"tokens": [{"text": " foo", "origin": "draft", "step": 0}, ...],
                 "steps": [{"num_tokens": 3, "num_accepted": 2, "segment": "code",
                            "tree_size": 8, "tree_depth": 4}, ...]}

`origin` is "draft" (a draft token the target model accepted) or "model" (the
target model's own token); `step` indexes `steps`. A request asks for it with
`stream_options: {"include_speculation": true}`; without that nothing changes:
no per-token decoding, no extra field.
"""

from __future__ import annotations

import collections
import json
from collections.abc import Sequence
from dataclasses import dataclass

from protos.segserve.v1.generate import TokenChunk

EXTENSION_KEY = "segserve"


@dataclass(frozen=True)
class StepInfo:
    """One scheduler step of one request."""

    num_tokens: int
    num_accepted: int
    """The first this many of the step's tokens are accepted drafts."""
    segment: str
    tree_size: int
    """Draft tokens in the candidate tree verified (0 = no tree)."""
    tree_depth: int

    @classmethod
    def of(cls, chunk: TokenChunk) -> StepInfo:
        return cls(len(chunk.token_ids), chunk.num_accepted_draft_tokens, chunk.segment, chunk.num_draft_tokens,
                   chunk.draft_depth)

    def to_json(self) -> dict:
        return {"num_tokens": self.num_tokens, "num_accepted": self.num_accepted, "segment": self.segment,
                "tree_size": self.tree_size, "tree_depth": self.tree_depth}


@dataclass(frozen=True)
class Speculation:
    """A Delta's tokens, each with its own text (their concatenation is the Delta's text) and its step."""

    token_texts: tuple[str, ...]
    steps: tuple[StepInfo, ...]

    def to_json(self) -> dict:
        tokens, index = [], 0
        for step_index, step in enumerate(self.steps):
            for position in range(step.num_tokens):
                if index < len(self.token_texts):
                    origin = "draft" if position < step.num_accepted else "model"
                    tokens.append({"text": self.token_texts[index], "origin": origin, "step": step_index})
                index += 1
        return {"tokens": tokens, "steps": [step.to_json() for step in self.steps]}


class StepQueue:
    """The steps of the chunks read off the stream, handed out by token count (merging never splits a chunk)."""

    def __init__(self) -> None:
        self._steps: collections.deque[StepInfo] = collections.deque()

    def note(self, events: Sequence) -> None:
        self._steps.extend(StepInfo.of(e) for e in events if isinstance(e, TokenChunk) and e.token_ids)

    def take(self, num_tokens: int) -> tuple[StepInfo, ...]:
        steps = []
        while num_tokens > 0 and self._steps:
            steps.append(self._steps.popleft())
            num_tokens -= steps[-1].num_tokens
        return tuple(steps)


def with_extension(chunk_json: str, speculation: Speculation) -> str:
    """A chunk's JSON object with the `segserve` field added last."""
    if not chunk_json.endswith("}"):
        raise ValueError("a stream chunk must be a JSON object")
    return f'{chunk_json[:-1]},"{EXTENSION_KEY}":{json.dumps(speculation.to_json(), ensure_ascii=False)}}}'
