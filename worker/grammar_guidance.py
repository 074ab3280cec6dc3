"""llguidance in the worker: the engine of the JSON schemas xgrammar would approximate.

In: a JSON schema that common/schema_exactness.py's rule gives to llguidance (the router accepted it because
llguidance enforces it exactly), and the model's tokenizer. Out: `GuidanceGrammar`, what compiling it gives, and
its `GuidanceMatcher`s, which answer the calls worker/grammar.py's GrammarState makes of an xgrammar
GrammarMatcher (accept_token, rollback, reset, fill_next_token_bitmask, find_jump_forward_string,
stop_token_ids), so that nothing past GrammarState knows which engine a sequence has. Masks are the same int32
bitmask (bit j of word w is token 32 w + j), written into the same host rows.

Two differences are bridged here: a token llguidance refuses would put its matcher in an error state for good,
so a token is tried (try_consume_tokens), not forced; and llguidance does not count a stop token as one it can
roll back, so the matcher records an accepted stop token itself (GrammarState accepts nothing after one).
"""

from __future__ import annotations

import functools
import json
import threading
from collections.abc import Sequence

import llguidance
import llguidance.hf
import torch

from common.schema_exactness import llguidance_options, llguidance_schema

__all__ = ["GuidanceGrammar", "GuidanceMatcher", "fill_guidance_rows", "guidance_tokenizer", "json_schema_guidance"]


@functools.cache
def _executor() -> llguidance.LLExecutor:
    """One thread, as xgrammar's batch fill: the forward has the cores (two gained nothing here). One call for 64
    rows took a fifth of 64 calls' time; a step's masks of 64 rows took 4.6 ms at qwen2.5-coder's 151,936-token
    vocabulary (xgrammar's: 0.36 ms) and 0.45 ms at the tiny model's 400 (2026-11-29, 2-core CPU)."""
    return llguidance.LLExecutor(1)


def fill_guidance_rows(matchers: Sequence[GuidanceMatcher], bitmask: torch.Tensor, rows: Sequence[int]) -> None:
    """matchers[k].fill_next_token_bitmask(bitmask, rows[k]) for every k, in one call to llguidance (none of them
    stopped). bitmask: int32 [B, W] on the host, contiguous."""
    targets = [(matcher._matcher, row) for matcher, row in zip(matchers, rows)]
    _executor().unsafe_compute_mask_ptr(targets, bitmask.data_ptr(), bitmask.shape[1] * bitmask.element_size(),
                                        bitmask.shape[0])


def json_schema_guidance(spec: str) -> str:
    """llguidance's grammar of the JSON schema `spec`, with the server's options (not compiled yet)."""
    schema = json.loads(spec)
    return llguidance.LLMatcher.grammar_from_json_schema(llguidance_schema(schema),
                                                         overrides=llguidance_options(schema))


def guidance_tokenizer(tokenizer, vocab_size: int, stop_token_ids: Sequence[int]) -> llguidance.LLTokenizer:
    """llguidance's view of a transformers fast tokenizer, as wide as the logits, its stop tokens the model's.
    Raises ValueError for a slow tokenizer."""
    return llguidance.hf.from_tokenizer(tokenizer, n_vocab=vocab_size, eos_token=list(stop_token_ids))


class GuidanceGrammar:
    """A compiled llguidance grammar: a matcher at its start, which each sequence gets a copy of."""

    def __init__(self, tokenizer: llguidance.LLTokenizer, grammar: str, stop_token_ids: Sequence[int]):
        """Raises ValueError with llguidance's reason where the grammar does not build."""
        self._start = llguidance.LLMatcher(tokenizer, grammar, log_level=0)
        if self._start.is_error():
            raise ValueError(self._start.get_error().strip().splitlines()[0])
        self._stop_token_ids = tuple(stop_token_ids)
        self._lock = threading.Lock()  # sequences of one spec start on several threads

    def matcher(self) -> GuidanceMatcher:
        with self._lock:
            return GuidanceMatcher(self._start.deep_copy(), self._stop_token_ids)


class GuidanceMatcher:
    """One sequence's llguidance matcher, with the xgrammar GrammarMatcher calls GrammarState makes."""

    __slots__ = ("_is_stopped", "_matcher", "stop_token_ids")

    def __init__(self, matcher: llguidance.LLMatcher, stop_token_ids: Sequence[int]):
        self._matcher = matcher
        self._is_stopped = False
        """A stop token was accepted (llguidance is not told: it would not roll it back)."""
        self.stop_token_ids = list(stop_token_ids)

    def accept_token(self, token_id: int) -> bool:
        """Advance by token_id where the grammar allows it (True); else False, the state unchanged."""
        if self._is_stopped:
            return False
        if token_id in self.stop_token_ids:
            self._is_stopped = self._matcher.is_accepting()
            return self._is_stopped
        return self._matcher.try_consume_tokens([token_id]) == 1

    def rollback(self, num_tokens: int) -> None:
        """Undo the last num_tokens accepted."""
        if self._is_stopped and num_tokens:
            self._is_stopped, num_tokens = False, num_tokens - 1
        if num_tokens:
            self._matcher.rollback(num_tokens)

    def reset(self) -> None:
        self._is_stopped = False
        self._matcher.reset()

    def is_terminated(self) -> bool:
        return self._is_stopped

    def fill_next_token_bitmask(self, bitmask: torch.Tensor, row: int = 0) -> None:
        """Write the tokens allowed next into bitmask[row] (int32 [B, ceil(V / 32)] on the host, contiguous)."""
        words = bitmask[row]  # [W]
        self._matcher.unsafe_compute_mask_ptr(words.data_ptr(), words.numel() * words.element_size())

    def find_jump_forward_string(self) -> str:
        """The text the grammar forces next ("" where it leaves a choice). Raises UnicodeDecodeError where it
        ends inside a multi-byte character."""
        return self._matcher.compute_ff_bytes().decode()
