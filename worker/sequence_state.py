"""State besides the KV cache, carried per sequence: LFM2's short convolutions, the Mamba mixers of Jamba and
Falcon-H1, Qwen3-Next's gated delta rule.

These layers keep a convolution state and (all but LFM2's) a recurrent state from one forward to the next, in the
linear-attention layers of transformers' Cache (cache_utils.LinearAttentionLayer), which their forward reads and
updates itself (get/update_conv_state, get/update_recurrent_state). The worker packs many sequences into one forward
and passes no transformers cache, so each such module's forward is wrapped (`attach`): during a worker step it runs
once per sequence of the step, on that sequence's tokens, with that sequence's own Cache. A sequence whose step
starts at position 0 (a new one, or one preempted and computed again) gets a new Cache and transformers'
whole-sequence form; a step that continues a sequence goes through it too where that form starts from the cached
state, else (Jamba's scan starts from zeros) token by token through the single-token form that transformers'
generate decodes with.

A step must start where the sequence's saved state ends. A draft tree's nodes are not one sequence of inputs, and a
rejected draft would have to be taken out of the state; a cached prefix has no state saved for it. So a model with
these layers takes neither: the worker says why in WorkerInfo.sequence_state_reason, the scheduler then sends no
drafts and shares no prefixes, and a step that asks for either is an InvalidRequest.

A step that fails forgets its sequences' states (`step`): the scheduler preempts them and computes them again from
position 0, and a step that would continue one is refused.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch
from transformers.cache_utils import Cache, DummyLayer, LinearAttentionLayer

from worker.validation import InvalidRequest

STATEFUL_MODULES = frozenset({"Lfm2ShortConv", "JambaMambaMixer", "FalconH1Mixer", "Qwen3NextGatedDeltaNet"})
"""transformers' classes whose state `attach` carries per sequence (each tested against transformers' generate)."""
WHOLE_CONTINUATIONS = frozenset({"Lfm2ShortConv", "FalconH1Mixer", "Qwen3NextGatedDeltaNet"})
"""Those whose whole-sequence form starts from the cached state: a step continuing a sequence goes through it in
one call. The others' (JambaMambaMixer's scan starts from zeros) go token by token."""


@dataclass(slots=True)
class Span:
    """One sequence's tokens in the step: at [offset, offset + length) of the packed forward, from `position` on."""

    seq_id: str
    offset: int
    length: int
    position: int


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
    spans: list[Span] = field(default_factory=list)
    """The step under way's sequences, in the packed forward's order; empty between steps."""
    pending: dict[str, Cache] = field(default_factory=dict)
    """The step under way's states: each sequence's saved one, updated in place, or a new one from position 0."""

    @property
    def reason(self) -> str:
        return (f"its layers {list(self.layers)} ({', '.join(self.kinds)}) keep a state that runs from each token to "
                "the next: a step must continue where the last one ended, so drafts and cached prefixes are not "
                "taken")

    def check(self, sequences) -> None:
        """InvalidRequest unless every scheduled sequence continues its saved state (or starts at position 0) with
        no draft. sequences: the request's ScheduledSequences."""
        for seq in sequences:
            if seq.draft is not None and len(seq.draft):
                raise InvalidRequest(f"sequence {seq.seq_id!r}: a draft, which the model cannot take: {self.reason}")
            start = seq.num_computed_tokens
            if start and self.saved.get(seq.seq_id, (None,))[0] != start:
                raise InvalidRequest(f"sequence {seq.seq_id!r} starts at token {start}, where it has no saved "
                                     f"state (a cached prefix?), which the model cannot take: {self.reason}")

    @contextlib.contextmanager
    def step(self, spans: list[Span]) -> Iterator[None]:
        """The forward of a step over `spans` runs inside. Its sequences' states are theirs once it returns; when it
        raises, they are forgotten, half-updated as they may be (the scheduler preempts a failed step's sequences
        and computes them again from position 0; a step that would continue one is refused)."""
        self.spans = spans
        self.pending = {span.seq_id: self.saved[span.seq_id][1] if span.position else self._new_cache()
                        for span in spans}
        try:
            yield
        except BaseException:
            for span in spans:
                self.saved.pop(span.seq_id, None)
            raise
        else:
            for span in spans:
                self.saved[span.seq_id] = (span.position + span.length, self.pending[span.seq_id])
        finally:
            self.spans, self.pending = [], {}

    def retain(self, seq_ids) -> None:
        """Forget the states of sequences not in seq_ids (ended, released or preempted)."""
        for seq_id in self.saved.keys() - set(seq_ids):
            del self.saved[seq_id]

    def run(self, layer: int, forward, hidden_states: torch.Tensor, is_whole: bool) -> torch.Tensor:
        """A stateful module's output on the packed step [1, T, D]: each sequence's tokens through `forward` (the
        module's transformers forward) with its own Cache, in one call from position 0 or with is_whole. The
        sequences that decode one token go through together, as one batch (`_decode_together`)."""
        output = torch.empty_like(hidden_states)
        decodes = [span for span in self.spans if span.position and span.length == 1]
        if len(decodes) > 1:
            rows = torch.tensor([span.offset for span in decodes], device=hidden_states.device)
            output[0, rows] = self._decode_together(layer, forward, hidden_states[0, rows, None], decodes)[:, 0]
        else:
            decodes = []
        for span in self.spans:
            if decodes and span.position and span.length == 1:
                continue
            cache, tokens = self.pending[span.seq_id], hidden_states[:, span.offset:span.offset + span.length]
            if span.position == 0 or is_whole:
                output[:, span.offset:span.offset + span.length] = forward(hidden_states=tokens, cache=cache)
            else:
                for i in range(span.length):
                    output[:, span.offset + i:span.offset + i + 1] = forward(hidden_states=tokens[:, i:i + 1],
                                                                             cache=cache)
        return output

    def _decode_together(self, layer: int, forward, tokens: torch.Tensor, spans: list[Span]) -> torch.Tensor:
        """One token of each of `spans` [B, 1, D] through `forward` at once: their states of `layer` stacked into
        one cache layer of batch B, and each row's new state copied back to its sequence's."""
        own = [self.pending[span.seq_id].layers[layer] for span in spans]
        batch = LinearAttentionLayer(number_of_states=own[0].number_of_states)
        for i in range(batch.number_of_states):
            for kind in ("conv", "recurrent"):
                if getattr(own[0], f"is_{kind}_states_initialized")[i]:
                    getattr(batch, f"{kind}_states")[i] = torch.cat([getattr(o, f"{kind}_states")[i] for o in own])
                    getattr(batch, f"is_{kind}_states_initialized")[i] = True
            batch.conv_kernel_size[i], batch.has_previous_state[i] = own[0].conv_kernel_size[i], True
        batch.device, batch.dtype = own[0].device, own[0].dtype
        output = forward(hidden_states=tokens, cache=Cache(layers=[
            batch if i == layer else DummyLayer() for i in range(self.num_layers)]))
        for i in range(batch.number_of_states):
            for kind in ("conv", "recurrent"):
                if getattr(batch, f"is_{kind}_states_initialized")[i]:
                    for row, o in enumerate(own):
                        getattr(o, f"{kind}_states")[i].copy_(getattr(batch, f"{kind}_states")[i][row:row + 1])
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
        module.forward = functools.partial(_forward, states, module.forward, module.layer_idx, is_whole)
    return states


def _forward(states: SequenceStates, transformers_forward, layer: int, is_whole: bool, *args, **kwargs) -> torch.Tensor:
    if not states.spans:
        return transformers_forward(*args, **kwargs)
    hidden_states = kwargs["hidden_states"] if "hidden_states" in kwargs else args[0]
    return states.run(layer, transformers_forward, hidden_states, is_whole)
