"""Structured outputs: constrained decoding with xgrammar (and llguidance), speculative trees included.

In: a sequence's StructuredOutput (protos/segserve/v1/sampling.py), its generated tokens, its candidate tree if it
has one, and the logits rows it samples from. Out: the tree cut to what the grammar allows, those rows with every
token its grammar forbids at -inf, before any processing (worker/sampler.py: logit bias, penalties, warpers and the
watermark all keep -inf at -inf, so a greedy row takes the argmax over the allowed tokens and a sampling row never
draws a forbidden one), and the span the grammar forces next, as a free draft for the scheduler.

- `GrammarEngine`, one per model: xgrammar's TokenizerInfo from the model directory's tokenizer (its vocabulary as
  wide as the logits, its stop tokens the model's EOS ids) and a GrammarCompiler whose cache, keyed by the grammar's
  text (hence by (kind, spec)), is bounded in bytes. Both are built at the first constrained sequence, so a worker
  that never sees one never loads its tokenizer. How each kind becomes a grammar (JSON options, the choice EBNF)
  is common/grammar.py's, which the router's compile check follows too. A JSON schema that xgrammar would
  approximate (common/schema_exactness.py's rule, the router's too) is llguidance's instead
  (worker/grammar_guidance.py), whose matcher answers the same calls. Compiles run off the step, on the
  engine's own small pool: `start` submits one when the sequence arrives (sequences with the same spec share it),
  so it runs during the sequence's prefill forwards, and the step waits for it only where the grammar is first
  needed (its first masked row, or a tree to prune).
- `GrammarState`, one per constrained sequence (on its worker/planning.py SequenceState): an xgrammar
  GrammarMatcher, made at its first use once the grammar compiled, whose state is a function of the sequence's
  output. `sync` brings it to exactly the output tokens
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

import functools
import json
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import torch
import xgrammar as xgr

from common.grammar import (
    JSON_OBJECT_SCHEMA,
    JSON_SCHEMA_OPTIONS,
    ROOT_RULE,
    choice_grammar,
    engine_message,
    json_string_characters,
)
from common.schema_exactness import xgrammar_gaps
from protos.segserve.v1.sampling import StructuredKind, StructuredOutput
from protos.segserve.v1.step_result import MAX_FORCED_TOKENS
from protos.segserve.v1.tree import ROOT, CandidateTree
from worker.grammar_guidance import (
    GuidanceGrammar,
    GuidanceMatcher,
    fill_guidance_rows,
    guidance_tokenizer,
    json_schema_guidance,
)
from worker.work import tree_nodes

__all__ = ["GRAMMAR_CACHE_BYTES", "MAX_FORCED_CHARS", "GrammarEngine", "GrammarError", "GrammarState", "fill_rows",
           "json_schema_grammar", "json_schema_source"]

GRAMMAR_CACHE_BYTES = 256 << 20
"""The most memory the compiled grammars cached for reuse take (xgrammar's cache evicts beyond it)."""
MAX_FORCED_CHARS = 32 * MAX_FORCED_TOKENS
"""The most characters of a jump-forward string tokenized for a forced span (a long const costs no more)."""
MAX_FORCED_SPANS_KEPT = 4096
"""Jump-forward strings whose tokens GrammarEngine keeps (tokenizing one took 14 us here, per row and step)."""
MAX_GUIDANCE_GRAMMARS = 64
"""llguidance grammars GrammarEngine keeps compiled (its matchers are copied from them)."""
NUM_COMPILE_THREADS = 2
"""Grammars compiled at once, off the step (xgrammar's compiler spreads each one over its own threads besides)."""
_ENTER, _LEAVE = 0, 1  # GrammarState.walk's two kinds of move


class GrammarError(ValueError):
    """A structured_output this worker cannot constrain to (a spec the engine does not compile, no tokenizer)."""


class GrammarState:
    """One sequence's matcher, kept in step with its output tokens."""

    __slots__ = ("_compiling", "_matcher", "_stop_token_ids", "is_ended", "tokens")

    def __init__(self, compiling: Future[xgr.CompiledGrammar | GuidanceGrammar]):
        """compiling: its grammar's compile (GrammarEngine.compiling), finished or not."""
        self._compiling = compiling
        self._matcher: xgr.GrammarMatcher | GuidanceMatcher | None = None
        self._stop_token_ids: frozenset[int] = frozenset()
        self.tokens: list[int] = []
        """The output tokens the matcher has seen, in order (those after its termination it only records)."""
        self.is_ended = False
        """The matcher accepted a stop token, which only stop tokens may follow: xgrammar's is_terminated(), kept
        here so that a step's fill calls xgrammar once per matcher, not three times (each call releases the GIL,
        a handover to the forward's thread and back)."""

    @property
    def matcher(self) -> xgr.GrammarMatcher | GuidanceMatcher:
        """The sequence's matcher, made at the first call, after waiting for its grammar's compile. Raises the
        compile's GrammarError (at every call)."""
        if self._matcher is None:
            compiled = self._compiling.result()
            # rollback is unlimited (xgrammar's default, max_rollback_tokens=-1): a tree walk rolls back its depth
            self._matcher = compiled.matcher() if isinstance(compiled, GuidanceGrammar) else \
                xgr.GrammarMatcher(compiled)
            self._stop_token_ids = frozenset(self._matcher.stop_token_ids)
        return self._matcher

    def compile_problem(self) -> str | None:
        """Why its grammar did not compile, once the compile has ended; None while it runs, or when it compiled."""
        if self._matcher is not None or not self._compiling.done():  # (a matcher: it compiled)
            return None
        error = self._compiling.exception()
        return None if error is None else str(error)

    def sync(self, output: list[int]) -> str | None:
        """Bring the matcher to exactly `output`, the sequence's output tokens; why it cannot (a token its grammar
        refuses), or None. Raises GrammarError where its grammar did not compile."""
        matcher, num_seen = self.matcher, len(self.tokens)
        if output[:num_seen] != self.tokens:  # shorter, or rewritten by a recompute: replay
            matcher.reset()
            self.tokens, self.is_ended = [], False
        for token_id in output[len(self.tokens):]:
            if not self.is_ended:
                if not matcher.accept_token(token_id):
                    return (f"output token {token_id} at position {len(self.tokens)} does not match its "
                            "structured_output")
                self.is_ended = token_id in self._stop_token_ids
            self.tokens.append(token_id)
        return None

    def fill(self, bitmask: torch.Tensor, row: int) -> None:
        """Write the tokens allowed next into bitmask[row] (int32 [B, ceil(V / 32)] on the host; bit j of word w is
        token 32 w + j)."""
        matcher = self.matcher
        if not self.is_ended:
            matcher.fill_next_token_bitmask(bitmask, row)
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
            if kind == _LEAVE:  # value: the steps the node's token took (1: it was not ended before the node)
                if value:
                    self.matcher.rollback(value)
                    self.is_ended = False
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
        if self.is_ended:
            return 0 if token_id in self._stop_token_ids else -1
        if not self.matcher.accept_token(token_id):
            return -1
        self.is_ended = token_id in self._stop_token_ids
        return 1


@functools.lru_cache(maxsize=64)
def json_schema_grammar(spec: str) -> str:
    """The EBNF a JSON schema compiles to: the engine's own conversion, with JSON's string characters in its
    length-bounded strings (common/grammar.py's json_string_characters)."""
    return json_string_characters(str(xgr.Grammar.from_json_schema(spec, **JSON_SCHEMA_OPTIONS)))


@functools.lru_cache(maxsize=64)
def json_schema_source(spec: str) -> tuple[bool, str]:
    """(whether llguidance enforces it, the grammar's text) of the JSON schema `spec`: xgrammar's EBNF where it
    has nothing xgrammar would approximate and xgrammar converts it, else llguidance's grammar (the router's
    rule: router/schema_engines.py). Raises what llguidance raises for a schema that is not JSON."""
    schema = json.loads(spec)
    if not isinstance(schema, dict):  # (a boolean schema: xgrammar's to take or refuse)
        return False, json_schema_grammar(spec)
    if not xgrammar_gaps(schema):
        try:
            return False, json_schema_grammar(spec)
        except Exception:  # noqa: BLE001 (xgrammar cannot convert it: llguidance may, as the router found)
            pass
    return True, json_schema_guidance(spec)


class GrammarEngine:
    """Compiles a model's structured outputs, each distinct one once while the cache holds it, on a pool of its own
    (NUM_COMPILE_THREADS threads, started at the first compile)."""

    def __init__(self, model_dir: Path | str, vocab_size: int, stop_token_ids: Sequence[int],
                 cache_limit_bytes: int = GRAMMAR_CACHE_BYTES):
        """vocab_size: the width of the model's logits (the tokenizer's may be narrower); stop_token_ids: the
        model's EOS ids (empty: the tokenizer's)."""
        self.model_dir, self.vocab_size = Path(model_dir), vocab_size
        self._stop_token_ids = list(stop_token_ids)
        self._cache_limit_bytes = cache_limit_bytes
        self._compiler: xgr.GrammarCompiler | None = None
        self._compiler_lock = threading.Lock()  # two compiles may need the compiler first at once
        self._tokenizer = None
        """The model's transformers tokenizer, loaded with the compiler (forced spans are split with it)."""
        self._guidance_tokenizer = None
        """llguidance's view of it, made at the first schema llguidance enforces."""
        self._guidance_grammars: dict[str, GuidanceGrammar] = {}
        """llguidance's compiled grammars by spec, at most MAX_GUIDANCE_GRAMMARS (then started over): xgrammar's
        compiler caches its own."""
        self._forced: dict[str, tuple[int, ...]] = {}
        """Jump-forward strings as forced_tokens() split them, at most MAX_FORCED_SPANS_KEPT (then started over)."""
        self._pool = ThreadPoolExecutor(NUM_COMPILE_THREADS, thread_name_prefix="grammar-compile")
        self._compiling: dict[tuple[StructuredKind, str], Future[xgr.CompiledGrammar | GuidanceGrammar]] = {}
        """The compiles running, by (kind, spec); each leaves when it ends (the compiler's cache keeps its result)."""
        self._compiling_lock = threading.Lock()

    @property
    def compiler(self) -> xgr.GrammarCompiler:
        """The model's compiler, built at the first call. Raises GrammarError when the model has no tokenizer."""
        with self._compiler_lock:
            if self._compiler is None:
                self._load_compiler()
        return self._compiler

    def _load_compiler(self) -> None:
        """Load the tokenizer and build the compiler on it. Raises GrammarError."""
        from transformers import AutoTokenizer

        try:
            tokenizer = AutoTokenizer.from_pretrained(self.model_dir)
            info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=self.vocab_size,
                                                      stop_token_ids=self._stop_token_ids or None)
        except Exception as exc:  # no tokenizer files, or ones transformers or xgrammar cannot read
            raise GrammarError(f"structured_output needs the model's tokenizer, which did not load: {exc}") from None
        self._stop_token_ids = list(info.stop_token_ids)
        self._tokenizer = tokenizer
        self._compiler = xgr.GrammarCompiler(info, cache_limit_bytes=self._cache_limit_bytes)

    def compile(self, structured: StructuredOutput) -> xgr.CompiledGrammar | GuidanceGrammar:
        """The compiled grammar of `structured` (a shape validate() accepted). Raises GrammarError."""
        compiler = self.compiler
        spec = structured.spec
        try:
            if structured.kind is StructuredKind.JSON_SCHEMA:
                is_guidance, grammar = json_schema_source(spec)
                if is_guidance:
                    return self._guidance_grammar(spec, grammar)
                return compiler.compile_grammar(grammar)
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

    def _guidance_grammar(self, spec: str, grammar: str) -> GuidanceGrammar:
        """llguidance's compiled grammar of the JSON schema `spec` (`grammar`: its text), cached."""
        compiled = self._guidance_grammars.get(spec)
        if compiled is None:
            compiled = GuidanceGrammar(self._guidance(), grammar, self._stop_token_ids)
            if len(self._guidance_grammars) >= MAX_GUIDANCE_GRAMMARS:
                self._guidance_grammars.clear()
            self._guidance_grammars[spec] = compiled
        return compiled

    def _guidance(self):
        """llguidance's tokenizer (the model's, as wide as the logits), made at the first call (after the compiler's
        load). Raises ValueError for a tokenizer it cannot read (a slow one)."""
        with self._compiler_lock:
            if self._guidance_tokenizer is None:
                self._guidance_tokenizer = guidance_tokenizer(self._tokenizer, self.vocab_size, self._stop_token_ids)
        return self._guidance_tokenizer

    def compiling(self, structured: StructuredOutput) -> Future[xgr.CompiledGrammar | GuidanceGrammar]:
        """The compile of `structured` on the engine's pool: the one running for the same (kind, spec), or a new
        one. Its result is compile()'s, or its GrammarError."""
        key = (structured.kind, structured.spec)
        with self._compiling_lock:
            future = self._compiling.get(key)
            if future is not None:
                return future
            future = self._compiling[key] = self._pool.submit(self.compile, structured)
        future.add_done_callback(lambda done: self._forget(key, done))  # (at once, should it have ended already)
        return future

    def _forget(self, key: tuple[StructuredKind, str], done: Future) -> None:
        """Drop an ended compile (the compiler's cache serves its spec from now on)."""
        with self._compiling_lock:
            if self._compiling.get(key) is done:
                del self._compiling[key]

    def start(self, structured: StructuredOutput) -> GrammarState:
        """A new sequence's state at the start of its output, its grammar compiling meanwhile (compiling()); its
        matcher raises the compile's GrammarError, if any."""
        return GrammarState(self.compiling(structured))

    def forced_tokens(self, state: GrammarState) -> tuple[int, ...]:
        """The tokens `state`'s grammar forces next: its jump-forward string (of a matcher `start` made, so the
        tokenizer is loaded) as the model's tokenizer splits it, at most MAX_FORCED_TOKENS and cut before any id
        past the logits; () where the grammar leaves a choice or has ended."""
        if state.is_ended:
            return ()
        try:
            text = state.matcher.find_jump_forward_string()
        except UnicodeDecodeError:  # the matcher stands inside a multi-byte character: no whole text is forced
            return ()
        if not text:
            return ()
        text = text[:MAX_FORCED_CHARS]
        forced = self._forced.get(text)
        if forced is None:  # the rows of one schema are forced the same keys and punctuation, step after step
            token_ids = self._tokenizer.encode(text, add_special_tokens=False)[:MAX_FORCED_TOKENS]
            end = next((i for i, token_id in enumerate(token_ids) if token_id >= self.vocab_size), len(token_ids))
            if len(self._forced) >= MAX_FORCED_SPANS_KEPT:
                self._forced.clear()
            forced = self._forced[text] = tuple(token_ids[:end])
        return forced


def fill_rows(states: Sequence[GrammarState], bitmask: torch.Tensor, rows: Sequence[int]) -> None:
    """states[k].fill(bitmask, rows[k]) for every k: xgrammar's matchers that have not ended in one call to xgrammar
    (measured at 64 rows of the tiny model's 400-token vocabulary: 15 us, against 37 us for a call per row),
    llguidance's in one call to llguidance (worker/grammar_guidance.py)."""
    going, going_rows, guided, guided_rows = [], [], [], []
    for state, row in zip(states, rows):
        if state.is_ended:
            state.fill(bitmask, row)
        elif isinstance(state.matcher, GuidanceMatcher):
            guided.append(state.matcher)
            guided_rows.append(row)
        else:
            going.append(state.matcher)
            going_rows.append(row)
    if going:  # one thread (the calling one): the forward has the cores; made per call (1 us), shared by no thread
        xgr.BatchGrammarMatcher(max_threads=1).batch_fill_next_token_bitmask(going, bitmask, going_rows)
    if guided:
        fill_guidance_rows(guided, bitmask, guided_rows)


def _bit(position: int) -> int:
    """The int32 word with only bit `position` set (bit 31 is the sign bit)."""
    return -(1 << 31) if position == 31 else 1 << position
