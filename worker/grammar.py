"""Structured outputs: constrained decoding with xgrammar, speculative trees included.

In: a sequence's StructuredOutput (protos/segserve/v1/sampling.py), its generated tokens, its candidate tree if it
has one, and the logits rows it samples from. Out: the tree cut to what the grammar allows, those rows with every
token its grammar forbids at -inf, before any processing (worker/sampler.py: logit bias, penalties, warpers and the
watermark all keep -inf at -inf, so a greedy row takes the argmax over the allowed tokens and a sampling row never
draws a forbidden one), and the span the grammar forces next, as a free draft for the scheduler.

- `GrammarEngine`, one per model: xgrammar's TokenizerInfo from the model directory's tokenizer (its vocabulary as
  wide as the logits, its stop tokens the model's EOS ids) and a GrammarCompiler whose cache, keyed by the grammar's
  text (hence by (kind, spec)), is bounded in bytes. Both are built at the first constrained sequence, so a worker
  that never sees one never loads its tokenizer. How each kind becomes a grammar (JSON options, the choice EBNF)
  is common/grammar.py's, which the router's compile check follows too.
- `GrammarState`, one per constrained sequence (on its worker/planning.py SequenceState): an xgrammar
  GrammarMatcher whose state is a function of the sequence's output. `sync` brings it to exactly the output tokens
  it is given: it accepts the new ones, and after a recompute that rewrote them (or on a sequence moved here from
  another worker, whose NewSequence carries its output after num_prompt_tokens) it starts over and replays them. So
  the matcher advances only by tokens the scheduler kept (or, for a forced span, the tokens just sampled), and a
  multi-step or async continuation, whose sampled token enters the history before its next row, needs nothing more.
- Trees (worker/verify.py verifies them): `walk` goes depth first from the root, accepting each node's token and
  rolling it back after the node's subtree, so it stands at every node in the state after that node's path.
  `prune` (planning, before the forward) keeps the nodes the grammar allows there, whose subtrees are then dropped
  with them; after the forward every kept node's row gets the mask of that state (worker/grammar_masks.py), so
  each node is verified against exactly the constrained distribution plain decoding would sample from there.
- worker/grammar_masks.py turns a step's matchers into masked logits rows (the `constrainer` of sample_works).
- `GrammarEngine.forced_tokens`: the jump-forward string (what the grammar allows as the only continuation: a key,
  punctuation, a const, the rest of an enum) tokenized by the model's tokenizer, at most MAX_FORCED_TOKENS. A
  tokenization the model would not choose is only a rejected draft, so the output stays the model's.
- Where the grammar may end, the stop tokens (the model's EOS ids) are allowed; where nothing else may follow, only
  they are, so the sequence ends as on any EOS. After one was accepted (ignore_eos) only they stay allowed.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from pathlib import Path

import torch
import xgrammar as xgr

from common.grammar import JSON_OBJECT_SCHEMA, JSON_SCHEMA_OPTIONS, ROOT_RULE, choice_grammar, engine_message
from protos.segserve.v1.sampling import StructuredKind, StructuredOutput
from protos.segserve.v1.step_result import MAX_FORCED_TOKENS
from protos.segserve.v1.tree import ROOT, CandidateTree
from worker.work import tree_nodes

__all__ = ["GRAMMAR_CACHE_BYTES", "MAX_FORCED_CHARS", "GrammarEngine", "GrammarError", "GrammarState"]

GRAMMAR_CACHE_BYTES = 256 << 20
"""The most memory the compiled grammars cached for reuse take (xgrammar's cache evicts beyond it)."""
MAX_FORCED_CHARS = 32 * MAX_FORCED_TOKENS
"""The most characters of a jump-forward string tokenized for a forced span (a long const costs no more)."""
_ENTER, _LEAVE = 0, 1  # GrammarState.walk's two kinds of move


class GrammarError(ValueError):
    """A structured_output this worker cannot constrain to (a spec the engine does not compile, no tokenizer)."""


class GrammarState:
    """One sequence's matcher, kept in step with its output tokens."""

    __slots__ = ("matcher", "tokens", "_stop_token_ids")

    def __init__(self, compiled: xgr.CompiledGrammar, stop_token_ids: Sequence[int]):
        # rollback is unlimited (xgrammar's default, max_rollback_tokens=-1): a tree walk rolls back its depth
        self.matcher = xgr.GrammarMatcher(compiled)
        self.tokens: list[int] = []
        """The output tokens the matcher has seen, in order (those after its termination it only records)."""
        self._stop_token_ids = list(stop_token_ids)

    def sync(self, output: list[int]) -> str | None:
        """Bring the matcher to exactly `output`, the sequence's output tokens; why it cannot (a token its grammar
        refuses), or None."""
        num_seen = len(self.tokens)
        if output[:num_seen] != self.tokens:  # shorter, or rewritten by a recompute: replay
            self.matcher.reset()
            self.tokens = []
        for token_id in output[len(self.tokens):]:
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

    def walk(self, token_ids: Sequence[int], parents: Sequence[int],
             visit: Callable[[int], None] | None = None) -> list[bool]:
        """Depth first over a tree whose node 0 is the root, the matcher's current state (synced through it); node
        i > 0 carries token_ids[i] after its parent parents[i] < i. Per node, whether the grammar allows its path;
        visit(node) is called at every allowed node with the matcher after the node's path (the root first). A node
        the grammar forbids is not entered, so its subtree is not either. The matcher ends where it started."""
        children: list[list[int]] = [[] for _ in token_ids]
        for node in range(1, len(token_ids)):
            children[parents[node]].append(node)
        allowed = [False] * len(token_ids)
        allowed[0] = True
        if visit is not None:
            visit(0)
        moves = [(_ENTER, child) for child in reversed(children[0])]  # a stack: first children first
        while moves:
            kind, value = moves.pop()
            if kind == _LEAVE:  # value: the steps the node's token took
                if value:
                    self.matcher.rollback(value)
                continue
            num_steps = self._advance(token_ids[value])
            if num_steps < 0:
                continue
            allowed[value] = True
            if visit is not None:
                visit(value)
            moves.append((_LEAVE, num_steps))
            moves.extend((_ENTER, child) for child in reversed(children[value]))
        return allowed

    def prune(self, root: int, tree: CandidateTree) -> CandidateTree:
        """`tree`, drafted after `root` (the matcher stands after it), without the nodes the grammar forbids after
        their path and their subtrees (the same tree when it forbids none)."""
        parents, _ = tree_nodes(tree)
        allowed = self.walk((root,) + tree.token_ids, parents)
        if all(allowed):
            return tree
        new_index: dict[int, int] = {}
        token_ids, kept_parents = [], []
        for index, (token_id, parent) in enumerate(zip(tree.token_ids, tree.parents)):
            if allowed[index + 1]:  # its parent is kept too (walk enters no child of a forbidden node)
                new_index[index] = len(token_ids)
                token_ids.append(token_id)
                kept_parents.append(ROOT if parent == ROOT else new_index[parent])
        return CandidateTree(tuple(token_ids), tuple(kept_parents))

    def _advance(self, token_id: int) -> int:
        """Accept token_id: the matcher steps it took (0: a stop token after termination, which only stop tokens
        may follow), or -1 when the grammar refuses it."""
        if self.matcher.is_terminated():
            return 0 if token_id in self._stop_token_ids else -1
        return 1 if self.matcher.accept_token(token_id) else -1


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
        self._tokenizer = None
        """The model's transformers tokenizer, loaded with the compiler (forced spans are split with it)."""

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
            self._tokenizer = tokenizer
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

    def forced_tokens(self, state: GrammarState) -> tuple[int, ...]:
        """The tokens `state`'s grammar forces next: its jump-forward string (of a matcher `start` made, so the
        tokenizer is loaded) as the model's tokenizer splits it, at most MAX_FORCED_TOKENS and cut before any id
        past the logits; () where the grammar leaves a choice or has ended."""
        if state.matcher.is_terminated():
            return ()
        text = state.matcher.find_jump_forward_string()
        if not text:
            return ()
        token_ids = self._tokenizer.encode(text[:MAX_FORCED_CHARS], add_special_tokens=False)[:MAX_FORCED_TOKENS]
        end = next((i for i, token_id in enumerate(token_ids) if token_id >= self.vocab_size), len(token_ids))
        return tuple(token_ids[:end])


def _bit(position: int) -> int:
    """The int32 word with only bit `position` set (bit 31 is the sign bit)."""
    return -(1 << 31) if position == 31 else 1 << position
