"""The worker's start-up self-check: its own path against transformers' reference forward, or no start.

The worker runs transformers' modules under its own attention (worker/attention.py), cache and step loop. A model
whose layers do something that path does not carry would be served with wrong text and no warning: attention
that never calls the attention interface (unmasked, unpaged), state besides attention's keys and values that the
worker does not hand from a step to the next (a mixer worker/sequence_state.py does not know), an attention keyword
the paged attention does not implement (those raise UnsupportedAttention as they come). So at warm-up the worker
runs a short prompt, two decode steps and a draft tree through its own path (paged KV, its linears, compiled
layers and decode graphs where on, a tree), and the tree's paths through transformers' eager forward, each in one
causal pass. When the logits differ by more than the dtype's tolerance, the worker refuses to start, naming the
architecture, the first position and the first decoder layer where the paths part (both replayed with a hook on
each layer), and why that usually is.

Costs: the worker's four steps and two reference forwards of 17 tokens or fewer, a few hundred milliseconds on the
default model on a CPU (the log says); a refusal replays the tokens once more. `--no-self-check` skips
it. A tensor-parallel worker skips it: its architectures are the lean decoders', which
tests/worker/test_tensor_parallel.py holds to one device's logits.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import time
from collections.abc import Iterator

import torch

from protos.segserve.v1.sampling import SamplingParams
from protos.segserve.v1.step import NewSequence, ScheduledSequence, StepRequest
from protos.segserve.v1.tree import ROOT, CandidateTree

logger = logging.getLogger(__name__)
TOLERANCE = {torch.float32: 1e-3, torch.bfloat16: 0.1, torch.float16: 0.1}
"""Largest |worker - reference| logit difference allowed, relative to the reference's largest |logit| (at least
1): the worker's own paths round otherwise than eager transformers (fused norms, packed or compiled linears, a
half-precision reduction order), by ~1e-5 of the logits' scale in fp32; a missing mask, sink or state moves them
by tens of percent."""
PROMPT_LEN = 12
SEQ_ID = "__segserve_self_check__"
STATEFUL_KINDS = ("Mamba", "Conv", "SSM", "Mixer", "DeltaNet")
"""Words in the class names of layers' modules that keep state across tokens (for the error's wording only)."""


class SelfCheckFailed(RuntimeError):
    """The worker's path disagrees with transformers' on this model: it is not served."""


def run(runner) -> float:
    """Check `runner` (a ModelRunner, warmed up) against its model's reference forward; the seconds it took.
    Raises SelfCheckFailed."""
    started = time.perf_counter()
    vocab = runner.limits.input_vocab_size
    prompt = [(7 * i + 3) % vocab for i in range(PROMPT_LEN)]
    ours, path, branch, blocks = _worker_logits(runner, prompt)
    reference = torch.cat([_reference_logits(runner, path), _reference_logits(runner, branch)[-1:]])
    scale = max(1.0, reference.abs().max().item())
    difference = (ours - reference).abs().amax(dim=-1)  # [positions]
    tolerance = TOLERANCE[runner.dtype] * scale
    if difference.max().item() > tolerance:
        first = int(torch.nonzero(difference > tolerance)[0])
        tokens, position = (path, first) if first < len(path) else (branch, len(branch) - 1)
        layer = _first_layer_apart(runner, tokens, position)
        raise SelfCheckFailed(_diagnosis(runner, blocks, first, difference[first].item(), tolerance, layer))
    seconds = time.perf_counter() - started
    logger.info("self-check passed in %.2f s: the worker's logits are within %.1e of transformers' (tolerance %.1e)",
                seconds, difference.max().item(), tolerance)
    return seconds


def _worker_logits(runner, prompt: list[int]) -> tuple[torch.Tensor, list[int], list[int], tuple[int, ...]]:
    """The worker's logits [18, V]: at every position of the prompt, two greedy decodes, then a third greedy token
    verified with a tree after it (a two-node chain and a sibling of its first node). Also the tree's two paths
    as token lists (the chain's path, whose positions are the first 17 rows; the sibling's, whose last is the
    18th) and the blocks the sequence used (free again after)."""
    with _sequence(runner, PROMPT_LEN + 6) as blocks:
        rows = [_prompt_step(runner, prompt, blocks, sample_indices=list(range(PROMPT_LEN)))]
        tokens = list(prompt)
        for _ in range(2):  # decode steps, one token each (the decode graphs' kind where they are on)
            tokens.append(int(rows[-1][-1].argmax()))
            rows.append(_decode_step(runner, tokens[-1], len(tokens) - 1, blocks))
        tokens.append(int(rows[-1][-1].argmax()))
        first, second, sibling = ((tokens[-1] + k) % rows[-1].shape[-1] for k in (1, 2, 3))
        draft = CandidateTree((first, second, sibling), (ROOT, 0, ROOT))  # verified after its root: four rows
        rows.append(runner.forward(StepRequest([ScheduledSequence(SEQ_ID, tokens[-1:], len(tokens) - 1, blocks,
                                                                  draft=draft)])))
    return torch.cat(rows).float(), [*tokens, first, second], [*tokens, sibling], blocks


def _reference_logits(runner, tokens: list[int]) -> torch.Tensor:
    """transformers' eager forward of `tokens` in one causal pass, without a cache: [len(tokens), V] float32. With
    the compiled decoder, the decoder's own forward (the compiled one is the worker's path)."""
    model, compiled = runner.model, runner.path.compiled
    implementation = model.config._attn_implementation
    model.set_attn_implementation("eager")
    if compiled is not None:
        model.model.forward = compiled.eager
    try:
        with torch.inference_mode():
            ids = torch.tensor([tokens], device=runner.device)
            return model(input_ids=ids, use_cache=False).logits[0].float()
    finally:
        model.set_attn_implementation(implementation)
        if compiled is not None:
            model.model.forward = compiled.forward


def _decoder_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    return list(getattr(getattr(model, "model", model), "layers", None) or
                getattr(getattr(model, "transformer", model), "h", None) or [])


def _first_layer_apart(runner, tokens: list[int], position: int) -> int | None:
    """The first decoder layer whose output at `position` differs beyond the tolerance between the worker's path
    (the tokens up to `position` again: the prompt in one step, then a step per token) and the reference's; None
    when the worker's path runs no transformers layer (a lean decoder) or no layer differs."""
    layers = _decoder_layers(runner.model)
    ours = _layer_outputs(layers, lambda: _replay(runner, tokens, position), position if position < PROMPT_LEN else -1)
    theirs = _layer_outputs(layers, lambda: _reference_logits(runner, tokens[:position + 1]), -1)
    for index, (mine, reference) in enumerate(zip(ours, theirs)):
        if mine is None or reference is None:
            return None
        if (mine - reference).abs().max() > TOLERANCE[runner.dtype] * max(1.0, reference.abs().max().item()):
            return index
    return None


def _replay(runner, tokens: list[int], position: int) -> None:
    """The tokens through the worker's steps as far as `position`: the prompt in one step, then a step per token."""
    with _sequence(runner, max(position + 1, PROMPT_LEN)) as blocks:
        _prompt_step(runner, tokens[:PROMPT_LEN], blocks, sample_indices=[PROMPT_LEN - 1])
        for index in range(PROMPT_LEN, position + 1):
            _decode_step(runner, tokens[index], index, blocks)


@contextlib.contextmanager
def _sequence(runner, num_tokens: int) -> Iterator[tuple[int, ...]]:
    """The blocks of the check's sequence of num_tokens tokens; the sequence is released on the way out."""
    try:
        yield tuple(range(-(-num_tokens // runner.kv_cache.block_size)))
    finally:
        runner.step(StepRequest(finished_seq_ids=[SEQ_ID]))


def _prompt_step(runner, prompt: list[int], blocks: tuple[int, ...], sample_indices: list[int]) -> torch.Tensor:
    new = NewSequence(SEQ_ID, SamplingParams(), len(prompt))
    return runner.forward(StepRequest([ScheduledSequence(SEQ_ID, prompt, 0, blocks, sample_indices=sample_indices)],
                                      [new]))


def _decode_step(runner, token: int, position: int, blocks: tuple[int, ...]) -> torch.Tensor:
    return runner.forward(StepRequest([ScheduledSequence(SEQ_ID, [token], position, blocks, sample_indices=[0])]))


def _layer_outputs(layers: list[torch.nn.Module], run, row: int) -> list[torch.Tensor | None]:
    """Each layer's output at token `row` of its last call while run() runs (None: not called), float32."""
    outputs: list[torch.Tensor | None] = [None] * len(layers)

    def keep(index, module, args, output):
        hidden = output[0] if isinstance(output, tuple) else output
        outputs[index] = hidden[0, row].float().clone()

    hooks = [layer.register_forward_hook(functools.partial(keep, index)) for index, layer in enumerate(layers)]
    try:
        run()
    finally:
        for hook in hooks:
            hook.remove()
    return outputs


def _diagnosis(runner, blocks: tuple[int, ...], position: int, difference: float, tolerance: float,
               layer: int | None) -> str:
    """Why the paths part, as far as the worker can tell: which layers' attention never wrote the paged cache,
    which layers keep no attention at all (their state is not carried between steps), or neither; and the first
    layer whose output differs, where known."""
    model = runner.model
    name = type(model).__name__
    layers = _decoder_layers(model)
    cache = runner.kv_cache
    unwritten = [i for i in range(cache.shape.num_layers) if not cache.keys[i][list(blocks)].any()]
    attention = {i for i, layer in enumerate(layers) if _has_attention(layer)}
    where = (f"the logits first differ at position {position} "
             f"({'the prompt' if position < PROMPT_LEN else 'a step after the prompt'}) by {difference:.3g}, "
             f"beyond the tolerance {tolerance:.3g}")
    if layer is not None:
        where += f", from layer {layer} ({type(layers[layer]).__name__}) on"
    stateful = sorted({type(m).__name__ for layer in layers for m in layer.modules()
                       if any(kind in type(m).__name__ for kind in STATEFUL_KINDS)})
    if attention and attention <= set(unwritten):
        why = ("its attention never calls the attention interface, so it would run unmasked on its own keys, "
               "without the paged KV cache")
    elif position >= PROMPT_LEN:  # the prompt, computed in one forward, agreed
        modules = f" ({', '.join(stateful)})" if stateful else ""
        why = (f"it keeps state besides attention's keys and values{modules}, such as a convolution's or an SSM's, "
               "which the worker does not carry from one step to the next")
    else:
        why = "its layers compute something the worker's path does not (an unsupported attention variant)"
    return (f"{name} is not served: {why}; {where} (the self-check against transformers' eager forward; "
            "--no-self-check skips it)")


def _has_attention(layer: torch.nn.Module) -> bool:
    return any(type(module).__name__.endswith("Attention") for module in layer.modules())
