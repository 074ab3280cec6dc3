"""Short convolutions with their state carried from step to step: LFM2's gated convolution layers.

transformers' Lfm2ShortConv convolves a sequence's inputs (B * x, per channel, over the last kernel-size tokens) and
keeps the last kernel-size - 1 of them in its own cache between calls. The worker packs many sequences into one
forward and passes no transformers cache, so each such layer's forward is replaced (`attach`): per sequence of the
step, its saved inputs and then its new tokens are convolved causally, and the last inputs are kept for its next
step. A sequence whose step starts at position 0 starts from zeros (a new one, or one preempted and computed again).

A step must start where the sequence's saved state ends. A draft tree's nodes are not one sequence of inputs, and a
rejected draft would have to be taken out of the state; a cached prefix has no state saved for it. So a model with
these layers takes neither: the worker says why in WorkerInfo.sequence_state_reason, the scheduler then sends no
drafts and shares no prefixes, and a step that asks for either is an InvalidRequest.

The new states of a step are kept aside until its forward has finished (`commit`): a step that fails leaves the
sequences' states as they were, so the scheduler's retry computes the same tokens again from them.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from worker.validation import InvalidRequest

CONV_MODULES = frozenset({"Lfm2ShortConv"})
"""transformers' classes whose forward `attach` replaces."""


@dataclass(slots=True)
class Span:
    """One sequence's tokens in the step: at [offset, offset + length) of the packed forward, from `position` on."""

    seq_id: str
    offset: int
    length: int
    position: int


@dataclass
class ConvStates:
    """Every sequence's saved convolution inputs, per convolution layer."""

    layers: tuple[int, ...]
    """The indices of the decoder layers with a short convolution."""
    kernel_size: int
    saved: dict[str, tuple[int, dict[int, torch.Tensor]]] = field(default_factory=dict)
    """seq_id -> (the tokens the state covers, layer -> its last kernel_size - 1 inputs [D, K - 1])."""
    spans: list[Span] = field(default_factory=list)
    """The step under way's sequences (`begin`)."""
    pending: dict[str, dict[int, torch.Tensor]] = field(default_factory=dict)
    """The step under way's new states, committed once its forward has finished."""

    @property
    def reason(self) -> str:
        return (f"its layers {list(self.layers)} are short convolutions whose state runs from each token to the "
                "next: a step must continue where the last one ended, so drafts and cached prefixes are not taken")

    def check(self, sequences) -> None:
        """InvalidRequest unless every scheduled sequence continues its saved state (or starts at position 0) with
        no draft. sequences: the request's ScheduledSequences."""
        for seq in sequences:
            if seq.draft is not None and len(seq.draft):
                raise InvalidRequest(f"sequence {seq.seq_id!r}: a draft, but the model's {self.reason}")
            start = seq.num_computed_tokens
            if start and self.saved.get(seq.seq_id, (None,))[0] != start:
                raise InvalidRequest(f"sequence {seq.seq_id!r} starts at token {start}, where it has no "
                                     f"convolution state (a cached prefix?), but the model's {self.reason}")

    def begin(self, spans: list[Span]) -> None:
        self.spans = spans
        self.pending = {span.seq_id: {} for span in spans}

    def commit(self) -> None:
        """Keep the finished step's new states."""
        for span in self.spans:
            self.saved[span.seq_id] = (span.position + span.length, self.pending[span.seq_id])
        self.spans, self.pending = [], {}

    def retain(self, seq_ids) -> None:
        """Forget the states of sequences not in seq_ids (ended, released or preempted)."""
        for seq_id in self.saved.keys() - set(seq_ids):
            del self.saved[seq_id]

    def convolve(self, layer: int, inputs: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None
                 ) -> torch.Tensor:
        """The causal depthwise convolution of the packed step's inputs [D, T], each sequence over its own past:
        [D, T]."""
        out = torch.empty_like(inputs)
        history = self.kernel_size - 1
        for span in self.spans:
            new = inputs[:, span.offset:span.offset + span.length]
            past = (self.saved[span.seq_id][1][layer] if span.position
                    else inputs.new_zeros(inputs.shape[0], history))
            window = torch.cat([past, new], dim=1)  # [D, K - 1 + n]
            out[:, span.offset:span.offset + span.length] = F.conv1d(window[None], weight, bias,
                                                                     groups=inputs.shape[0])[0]
            self.pending[span.seq_id][layer] = window[:, -history:].clone()
        return out


def attach(model: torch.nn.Module) -> ConvStates | None:
    """Give each of the model's short convolutions a forward over ConvStates (returned) for the worker's steps;
    called without the worker's batch (the self-check's reference), it is transformers' own. None when the model
    has none."""
    convs = [module for module in model.modules() if type(module).__name__ in CONV_MODULES]
    if not convs:
        return None
    states = ConvStates(tuple(conv.layer_idx for conv in convs), convs[0].conv.kernel_size[0])
    for conv in convs:
        conv.forward = functools.partial(_forward, conv, conv.forward)
    return states


def _forward(self, transformers_forward, hidden_states: torch.Tensor, segserve_batch=None, **kwargs) -> torch.Tensor:
    """Lfm2ShortConv's forward on a packed step [1, T, D]: gate, convolve each sequence over its saved inputs,
    gate again, project."""
    if segserve_batch is None:
        return transformers_forward(hidden_states, **kwargs)
    B, C, x = self.in_proj(hidden_states)[0].transpose(0, 1).chunk(3, dim=0)  # [D, T] each
    convolved = segserve_batch.conv_states.convolve(self.layer_idx, B * x, self.conv.weight, self.conv.bias)
    return self.out_proj((C * convolved).transpose(0, 1)[None])
