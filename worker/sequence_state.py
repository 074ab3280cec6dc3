"""State besides the KV cache, carried per sequence: LFM2's short convolutions, the Mamba mixers of Jamba, Falcon-H1,
Bamba and Granite 4.0 (GraniteMoeHybrid), Qwen3-Next's gated delta rule.

These layers keep a convolution state and (all but LFM2's) a recurrent state from one forward to the next, in the
linear-attention layers of transformers' Cache (cache_utils.LinearAttentionLayer), which their forward reads and
updates itself (get/update_conv_state, get/update_recurrent_state). The worker packs many sequences into one forward
and passes no transformers cache, so each such module's forward is wrapped (`attach`): during a worker step it runs
once per sequence of the step, on that sequence's tokens, with that sequence's own Cache. A sequence whose step
starts at position 0 (a new one, or one preempted and computed again) gets a new Cache and transformers'
whole-sequence form; a step that continues a sequence goes through it too where that form starts from the cached
state, else (Jamba's scan starts from zeros) token by token through the single-token form that transformers'
generate decodes with. Single tokens go through together, one batch per round (`SequenceStates.run`).

A draft tree's nodes are not one run of inputs: each node goes from its parent's state, depth by depth, and those
states last only while their layer computes. What a tree step keeps is every node's input to every stateful module;
once it is verified (`accept`), its root's and accepted nodes' inputs go through the modules again from the
sequence's saved state, token by token as the step computed them. A rejected draft leaves nothing to undo.

A step must start where the sequence's saved state ends, and a cached prefix has no state saved for it: a model with
these layers shares no prefixes. The worker says why in WorkerInfo.sequence_state_reason, the scheduler turns prefix
sharing off, and a step that starts past a sequence's state is an InvalidRequest.

A step that fails forgets its sequences' states (`step`): the scheduler preempts them and computes them again from
position 0, and a step that would continue one is refused.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import torch
from transformers.cache_utils import Cache, DummyLayer, LinearAttentionLayer

from worker.validation import InvalidRequest

STATEFUL_MODULES = frozenset({"Lfm2ShortConv", "JambaMambaMixer", "FalconH1Mixer", "Qwen3NextGatedDeltaNet",
                              "BambaMixer", "GraniteMoeHybridMambaLayer"})
"""transformers' classes whose state `attach` carries per sequence (each tested against transformers' generate)."""
WHOLE_CONTINUATIONS = frozenset({"Lfm2ShortConv", "FalconH1Mixer", "Qwen3NextGatedDeltaNet", "BambaMixer",
                                 "GraniteMoeHybridMambaLayer"})
"""Those whose whole-sequence form starts from the cached state: a step continuing a sequence goes through it in
one call. The others' (JambaMambaMixer's scan starts from zeros) go token by token."""


@dataclass(slots=True)
class Span:
    """One sequence's tokens in the step: at [offset, offset + length) of the packed forward, from `position` on."""

    seq_id: str
    offset: int
    length: int
    position: int
    parents: tuple[int, ...] = ()
    """A tree step: each node's parent (-1 for the root, the token after `position`'s state); () for a plain one."""
    depths: tuple[int, ...] = ()
    """A tree step: each node's depth (the root's 0)."""


@dataclass(slots=True)
class _Token:
    """One token through a stateful module: its row of the packed step, the state it reads, the state it leaves."""

    row: int
    source: Cache
    target: Cache


@dataclass
class SequenceStates:
    """Every sequence's saved state, one transformers Cache per sequence."""

    layers: tuple[int, ...]
    """The indices of the decoder layers with state."""
    num_layers: int
    kinds: tuple[str, ...]
    """The stateful modules' class names."""
    saved: dict[str, tuple[int, Cache]] = field(default_factory=dict)
    """seq_id -> (the tokens its state covers, its Cache)."""
    modules: dict[int, Callable] = field(default_factory=dict)
    """Layer -> its stateful module's transformers forward, which `accept` replays an accepted path through."""
    trees: dict[str, dict[int, torch.Tensor]] = field(default_factory=dict)
    """seq_id -> layer -> the inputs of its tree's nodes to that layer's module [nodes, D], from a tree step until
    `accept`: the states of the nodes are dropped once a layer has computed its outputs, and the accepted path's
    is computed again from these."""
    spans: list[Span] = field(default_factory=list)
    """The step under way's sequences, in the packed forward's order; empty between steps."""
    pending: dict[str, Cache] = field(default_factory=dict)
    """The step under way's plain spans' states: the saved one, updated in place, or a new one from position 0."""

    @property
    def reason(self) -> str:
        return (f"its layers {list(self.layers)} ({', '.join(self.kinds)}) keep a state that runs from each token to "
                "the next, which a cached prefix has none of")

    def check(self, sequences) -> None:
        """InvalidRequest unless every scheduled sequence continues its saved state, or starts at position 0.
        sequences: the request's ScheduledSequences."""
        for seq in sequences:
            start = seq.num_computed_tokens
            if start and self.saved.get(seq.seq_id, (None,))[0] != start:
                raise InvalidRequest(f"sequence {seq.seq_id!r} starts at token {start}, where it has no saved "
                                     f"state (a cached prefix?): the model's {self.reason}")

    @contextlib.contextmanager
    def step(self, spans: list[Span]) -> Iterator[None]:
        """The forward of a step over `spans` runs inside. A plain span's state is its sequence's once it returns; a
        tree's root and accepted nodes are added by `accept`. When the forward raises, the step's sequences' states
        are forgotten, half-updated as they may be (the scheduler preempts a failed step's sequences and computes
        them again from position 0; a step that would continue one is refused)."""
        self.spans = spans
        self.pending = {span.seq_id: self.saved[span.seq_id][1] if span.position else self._new_cache()
                        for span in spans if not span.parents}
        for span in spans:
            if span.parents:
                self.trees[span.seq_id] = {}
        try:
            yield
        except BaseException:
            for span in spans:
                self.saved.pop(span.seq_id, None)
                self.trees.pop(span.seq_id, None)
            raise
        else:
            for span in spans:
                if not span.parents:
                    self.saved[span.seq_id] = (span.position + span.length, self.pending[span.seq_id])
        finally:
            self.spans, self.pending = [], {}

    def accept(self, accepted: dict[str, list[int]]) -> None:
        """The tree steps of these sequences kept their roots and accepted nodes (seq_id -> node indices, in order):
        their inputs go through each stateful module again from the saved states, token by token as the step
        computed them, the sequences together (one batch per token of their paths)."""
        paths = {seq_id: [0, *nodes] for seq_id, nodes in accepted.items()}
        inputs = {seq_id: self.trees.pop(seq_id) for seq_id in paths}
        for layer, forward in sorted(self.modules.items()):
            for i in range(max(map(len, paths.values()), default=0)):
                seq_ids = [seq_id for seq_id, path in paths.items() if i < len(path)]
                caches = [self.saved[seq_id][1] for seq_id in seq_ids]
                tokens = [_Token(row, cache, cache) for row, cache in enumerate(caches)]
                hidden_states = torch.stack([inputs[seq_id][layer][paths[seq_id][i]] for seq_id in seq_ids])
                self._together(layer, forward, hidden_states[:, None], tokens)
        for seq_id, path in paths.items():
            position, cache = self.saved[seq_id]
            self.saved[seq_id] = (position + len(path), cache)

    def nbytes(self, seq_id: str) -> int:
        """The bytes of seq_id's saved state."""
        layers = [layer for layer in self.saved[seq_id][1].layers if isinstance(layer, LinearAttentionLayer)]
        return sum(tensor.nbytes for layer in layers for states in (layer.conv_states, layer.recurrent_states)
                   for tensor in states.values() if tensor is not None)

    def retain(self, seq_ids) -> None:
        """Forget the states of sequences not in seq_ids (ended, released or preempted)."""
        kept = set(seq_ids)
        for states in (self.saved, self.trees):
            for seq_id in states.keys() - kept:
                del states[seq_id]

    def run(self, layer: int, forward, hidden_states: torch.Tensor, is_whole: bool) -> torch.Tensor:
        """A stateful module's output on the packed step [1, T, D]: each sequence's tokens through `forward` (the
        module's transformers forward) with its own Cache. A step from position 0, or any with is_whole, goes in
        one call. Single tokens go together, one batch per round (`_together`): in the first, every decoding
        sequence's token and every tree's root; in round d, the trees' nodes of depth d, each from its parent's
        state."""
        output = torch.empty_like(hidden_states)
        rounds: dict[int, list[_Token]] = {}
        for span in self.spans:
            if span.parents:
                rows = hidden_states[0, span.offset:span.offset + span.length]
                self.trees[span.seq_id][layer] = rows.clone()
                nodes = [self._new_cache() for _ in span.parents]  # this layer's states only, dropped after it
                for node, (parent, depth) in enumerate(zip(span.parents, span.depths)):
                    source = nodes[parent] if parent >= 0 else self.saved[span.seq_id][1]
                    rounds.setdefault(depth, []).append(_Token(span.offset + node, source, nodes[node]))
                continue
            cache = self.pending[span.seq_id]
            if span.position and span.length == 1:
                rounds.setdefault(0, []).append(_Token(span.offset, cache, cache))
            elif span.position == 0 or is_whole:
                tokens = hidden_states[:, span.offset:span.offset + span.length]
                output[:, span.offset:span.offset + span.length] = forward(hidden_states=tokens, cache=cache)
            else:
                for row in range(span.offset, span.offset + span.length):
                    output[:, row:row + 1] = forward(hidden_states=hidden_states[:, row:row + 1], cache=cache)
        for depth in sorted(rounds):
            tokens = rounds[depth]
            if len(tokens) == 1 and tokens[0].source is tokens[0].target:  # one sequence decoding: its own cache
                row = tokens[0].row
                output[:, row:row + 1] = forward(hidden_states=hidden_states[:, row:row + 1], cache=tokens[0].source)
                continue
            rows = torch.tensor([token.row for token in tokens], device=hidden_states.device)
            output[0, rows] = self._together(layer, forward, hidden_states[0, rows, None], tokens)[:, 0]
        return output

    def _together(self, layer: int, forward, hidden_states: torch.Tensor, tokens: list[_Token]) -> torch.Tensor:
        """Single tokens [B, 1, D] through `forward` at once: the states of `layer` they read stacked into one
        cache layer of batch B, and each row's new state made its token's target's."""
        sources = [token.source.layers[layer] for token in tokens]
        first = sources[0]
        batch = LinearAttentionLayer(number_of_states=first.number_of_states)
        batch.device, batch.dtype = first.device, first.dtype
        kinds = [(i, kind) for i in range(first.number_of_states) for kind in ("conv", "recurrent")
                 if getattr(first, f"is_{kind}_states_initialized")[i]]
        for i, kind in kinds:
            getattr(batch, f"{kind}_states")[i] = torch.cat([getattr(src, f"{kind}_states")[i] for src in sources])
            getattr(batch, f"is_{kind}_states_initialized")[i] = True
        for i in range(first.number_of_states):
            batch.conv_kernel_size[i], batch.has_previous_state[i] = first.conv_kernel_size[i], True
        output = forward(hidden_states=hidden_states, cache=Cache(layers=[
            batch if i == layer else DummyLayer() for i in range(self.num_layers)]))
        for row, token in enumerate(tokens):
            target = token.target.layers[layer]
            target.device, target.dtype = batch.device, batch.dtype
            for i, kind in kinds:
                getattr(target, f"{kind}_states")[i] = getattr(batch, f"{kind}_states")[i][row:row + 1].clone()
                getattr(target, f"is_{kind}_states_initialized")[i] = True
            for i in range(first.number_of_states):
                target.conv_kernel_size[i], target.has_previous_state[i] = batch.conv_kernel_size[i], True
        return output

    def _new_cache(self) -> Cache:
        return Cache(layers=[LinearAttentionLayer() if i in self.layers else DummyLayer()
                             for i in range(self.num_layers)])


def attach(model: torch.nn.Module) -> SequenceStates | None:
    """Have each of the model's stateful modules run per sequence over SequenceStates (returned) during the
    worker's steps; outside a step (the self-check's reference) it is transformers' own. None when the model has
    none."""
    modules = [module for module in model.modules() if type(module).__name__ in STATEFUL_MODULES]
    if not modules:
        return None
    states = SequenceStates(tuple(sorted(module.layer_idx for module in modules)),
                            model.config.get_text_config().num_hidden_layers,
                            tuple(sorted({type(module).__name__ for module in modules})))
    for module in modules:
        is_whole = type(module).__name__ in WHOLE_CONTINUATIONS
        states.modules[module.layer_idx] = module.forward
        module.forward = functools.partial(_forward, states, module.forward, module.layer_idx, is_whole)
    return states


def _forward(states: SequenceStates, transformers_forward, layer: int, is_whole: bool, *args, **kwargs) -> torch.Tensor:
    if not states.spans:
        return transformers_forward(*args, **kwargs)
    hidden_states = kwargs["hidden_states"] if "hidden_states" in kwargs else args[0]
    return states.run(layer, transformers_forward, hidden_states, is_whole)
