"""Structured outputs: constrained decoding with xgrammar.

In: a sequence's StructuredOutput (protos/segserve/v1/sampling.py), its generated tokens, and the logits rows it
samples from. Out: those rows with every token its grammar forbids at -inf, before any processing (worker/sampler.py:
logit bias, penalties, warpers and the watermark all keep -inf at -inf, so a greedy row takes the argmax over the
allowed tokens and a sampling row never draws a forbidden one).

- `GrammarEngine`, one per model: xgrammar's TokenizerInfo from the model directory's tokenizer (its vocabulary as
  wide as the logits, its stop tokens the model's EOS ids) and a GrammarCompiler whose cache, keyed by the grammar's
  text (hence by (kind, spec)), is bounded in bytes. Both are built at the first constrained sequence, so a worker
  that never sees one never loads its tokenizer. How each kind becomes a grammar (JSON options, the choice EBNF)
  is common/grammar.py's, which the router's compile check follows too.
- `GrammarState`, one per constrained sequence (on its worker/planning.py SequenceState): an xgrammar
  GrammarMatcher whose state is a function of the sequence's output. Before each row is masked, `sync` brings it to
  exactly the tokens the history holds after the prompt: it accepts the new ones, and after a recompute that
  rewrote them (or on a sequence moved here from another worker, whose NewSequence carries its output after
  num_prompt_tokens) it starts over and replays them. So the matcher advances only by tokens the scheduler kept,
  and a multi-step or async continuation, whose sampled token enters the history before its next row, needs
  nothing more.
- `constrainer` syncs a step's constrained sequences and masks their rows (`mask_rows`: one host bitmask, one copy
  to the device, one masked write) for sample_works (worker/verify.py); a step without one does none of this. A
  sequence whose history holds a token its grammar refuses fails alone, with the reason.
- Where the grammar may end, the stop tokens (the model's EOS ids) are allowed; where nothing else may follow, only
  they are, so the sequence ends as on any EOS. After one was accepted (ignore_eos) only they stay allowed.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Protocol

import torch
import xgrammar as xgr

from common.grammar import JSON_OBJECT_SCHEMA, JSON_SCHEMA_OPTIONS, ROOT_RULE, choice_grammar, engine_message
from protos.segserve.v1.sampling import StructuredKind, StructuredOutput
from worker.upload import to_device
from worker.verify import Constrainer
from worker.work import Work

__all__ = ["GRAMMAR_CACHE_BYTES", "GrammarEngine", "GrammarError", "GrammarState", "constrainer", "mask_rows"]

GRAMMAR_CACHE_BYTES = 256 << 20
"""The most memory the compiled grammars cached for reuse take (xgrammar's cache evicts beyond it)."""


class ConstrainedState(Protocol):
    """What `constrainer` reads of a sequence's state (worker/planning.py's SequenceState, which imports this)."""

    grammar: GrammarState | None
    history: list[int]
    num_prompt_tokens: int


class GrammarError(ValueError):
    """A structured_output this worker cannot constrain to (a spec the engine does not compile, no tokenizer)."""


class GrammarState:
    """One sequence's matcher, kept in step with its output tokens."""

    __slots__ = ("matcher", "tokens", "_stop_token_ids")

    def __init__(self, compiled: xgr.CompiledGrammar, stop_token_ids: Sequence[int]):
        self.matcher = xgr.GrammarMatcher(compiled)
        self.tokens: list[int] = []
        """The output tokens the matcher has seen, in order (those after its termination it only records)."""
        self._stop_token_ids = list(stop_token_ids)

    def sync(self, history: list[int], start: int) -> str | None:
        """Bring the matcher to exactly history[start:] (start: the prompt's length, so that is the sequence's
        output); why it cannot (a token its grammar refuses), or None."""
        num_seen = len(self.tokens)
        if history[start:start + num_seen] != self.tokens:  # shorter, or rewritten by a recompute: replay
            self.matcher.reset()
            self.tokens = []
        for token_id in history[start + len(self.tokens):]:
            if not self.matcher.is_terminated() and not self.matcher.accept_token(token_id):
                return f"output token {token_id} at position {len(self.tokens)} does not match its structured_output"
            self.tokens.append(token_id)
        return None

    def fill(self, bitmask: torch.Tensor, row: int) -> None:
        """Write the tokens allowed next into bitmask[row] (int32 [B, ceil(V / 32)] on the host; bit j of word w is
        token 32 w + j)."""
        if not self.matcher.is_terminated():
            self.matcher.fill_next_token_bitmask(bitmask, row)
            return
        bitmask[row].zero_()  # terminated (a stop token accepted): nothing but the stop tokens
        for token_id in self._stop_token_ids:
            bitmask[row, token_id // 32] |= _bit(token_id % 32)


class GrammarEngine:
    """Compiles a model's structured outputs, each distinct one once while the cache holds it."""

    def __init__(self, model_dir: Path | str, vocab_size: int, stop_token_ids: Sequence[int],
                 cache_limit_bytes: int = GRAMMAR_CACHE_BYTES):
        """vocab_size: the width of the model's logits (the tokenizer's may be narrower); stop_token_ids: the
        model's EOS ids (empty: the tokenizer's)."""
        self.model_dir, self.vocab_size = Path(model_dir), vocab_size
        self._stop_token_ids = list(stop_token_ids)
        self._cache_limit_bytes = cache_limit_bytes
        self._compiler: xgr.GrammarCompiler | None = None

    @property
    def compiler(self) -> xgr.GrammarCompiler:
        """The model's compiler, built at the first call. Raises GrammarError when the model has no tokenizer."""
        if self._compiler is None:
            from transformers import AutoTokenizer

            try:
                tokenizer = AutoTokenizer.from_pretrained(self.model_dir)
                info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=self.vocab_size,
                                                          stop_token_ids=self._stop_token_ids or None)
            except Exception as exc:  # no tokenizer files, or ones transformers or xgrammar cannot read
                raise GrammarError(f"structured_output needs the model's tokenizer, which did not load: {exc}"
                                   ) from None
            self._stop_token_ids = list(info.stop_token_ids)
            self._compiler = xgr.GrammarCompiler(info, cache_limit_bytes=self._cache_limit_bytes)
        return self._compiler

    def compile(self, structured: StructuredOutput) -> xgr.CompiledGrammar:
        """The compiled grammar of `structured` (a shape validate() accepted). Raises GrammarError."""
        compiler = self.compiler
        spec = structured.spec
        try:
            if structured.kind is StructuredKind.JSON_SCHEMA:
                return compiler.compile_json_schema(spec, **JSON_SCHEMA_OPTIONS)
            if structured.kind is StructuredKind.JSON_OBJECT:
                return compiler.compile_json_schema(JSON_OBJECT_SCHEMA, **JSON_SCHEMA_OPTIONS, strict_mode=False)
            if structured.kind is StructuredKind.REGEX:
                return compiler.compile_regex(spec)
            if structured.kind is StructuredKind.CHOICE:
                return compiler.compile_grammar(choice_grammar(json.loads(spec)))
            if structured.kind is StructuredKind.STRUCTURAL_TAG:
                return compiler.compile_structural_tag(spec)
            return compiler.compile_grammar(spec, root_rule_name=ROOT_RULE)
        except Exception as exc:  # xgrammar raises RuntimeError (and a few ValueErrors) for what it cannot compile
            raise GrammarError(f"structured_output ({structured.kind.name.lower()}) does not compile: "
                               f"{engine_message(exc)}") from None

    def start(self, structured: StructuredOutput) -> GrammarState:
        """A new sequence's matcher at the start of its output. Raises GrammarError."""
        compiled = self.compile(structured)
        return GrammarState(compiled, self._stop_token_ids)


def constrainer(works: Sequence[Work], constrained: Sequence[int], states: Mapping[str, ConstrainedState]
                ) -> Constrainer:
    """What masks a step's constrained rows for worker/verify.py's sample_works: each of `constrained` (indices
    into works, each sampling one row, its first) after its matcher caught up with the sequence's output. A work
    whose output broke its grammar fails with the reason and its row is left as it is."""
    def constrain(logits: torch.Tensor, first_rows: list[int]) -> dict[int, str]:
        failed, rows, grammars = {}, [], []
        for i in constrained:
            state = states[works[i].seq_id]
            problem = state.grammar.sync(state.history, state.num_prompt_tokens)
            if problem is None:
                rows.append(first_rows[i])
                grammars.append(state.grammar)
            else:
                failed[i] = problem
        if rows:
            mask_rows(logits, rows, grammars)
        return failed
    return constrain


def mask_rows(logits: torch.Tensor, rows: Sequence[int], states: Sequence[GrammarState]) -> None:
    """Set every token that states[j] forbids at logits row rows[j] to -inf, in place. logits: [N, V]; rows: distinct.

    One host bitmask [B, ceil(V / 32)] filled by the matchers, one copy to the device, and one masked write of the
    B rows; the other rows are not touched.
    """
    vocab_size = logits.shape[1]
    bitmask = xgr.allocate_token_bitmask(len(rows), vocab_size)  # [B, W] int32, host
    for j, state in enumerate(states):
        state.fill(bitmask, j)
    device = logits.device
    words = to_device(bitmask, device)  # [B, W]
    shifts = torch.arange(32, dtype=torch.int32, device=device)  # [32]
    allowed = ((words[:, :, None] >> shifts) & 1).bool().reshape(len(rows), -1)[:, :vocab_size]  # [B, V]
    index = to_device(torch.tensor(list(rows), dtype=torch.long), device)  # [B]
    logits.index_copy_(0, index, logits.index_select(0, index).masked_fill_(~allowed, float("-inf")))


def _bit(position: int) -> int:
    """The int32 word with only bit `position` set (bit 31 is the sign bit)."""
    return -(1 << 31) if position == 31 else 1 << position
