"""The model runner: one batched forward per step over the paged KV cache, then sampling.

In: a `StepRequest` (new sequences, the scheduled work, finished sequence ids).
Out: one `SequenceOutput` per scheduled sequence that had sample indices.

Per-sequence sampling state lives here: the sampling parameters, the number of
prompt tokens, a random generator, and the token history, which after every step
is `history[:num_computed_tokens] + token_ids` (so a recompute after preemption
simply overwrites it). KV slots and history are only meaningful up to the
scheduler's next `num_computed_tokens`: tree nodes that were not accepted are
overwritten by later steps. Invariant the scheduler keeps: the first
num_computed_tokens storage positions hold the sequence's real tokens at their
own rotary positions. A verified tree (`draft_parents`, worker/verify.py) keeps
it too: after acceptance the runner moves the accepted nodes' KV to their
sequential slots and sets the history to history[:num_computed] + root +
accepted drafts.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch
from transformers import AutoModelForCausalLM

from worker.attention import ATTN_IMPLEMENTATION, build_attention_batch
from worker.checkpoint import resolve_model
from worker.config import WorkerConfig
from worker.kv_cache import KVCacheShape, PagedKVCache, num_blocks_for
from worker.packed_linear import pack_linears
from worker.messages import (
    InvalidRequest,
    NewSequence,
    ScheduledSequence,
    SequenceOutput,
    StepRequest,
    WorkerInfo,
)
from worker.sampler import SampleRow, SamplingParams, make_generator
from worker.validation import StepLimits, validate_disjoint_slots, validate_sequence
from worker.verify import TreeLayout, expand_tree, kv_moves, sample_with_trees


logger = logging.getLogger(__name__)
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
_WARMUP_SEQ_ID = "__segserve_warmup__"


@dataclass
class SequenceState:
    """What the worker remembers about a live sequence between steps."""

    params: SamplingParams
    num_prompt_tokens: int
    generator: torch.Generator | None
    history: list[int]
    """Every token of the sequence up to the end of its last step (prompt, output, step tokens)."""


def resolve_device_dtype(config: WorkerConfig) -> tuple[torch.device, torch.dtype]:
    """"auto" means cuda + bfloat16 when a GPU is present, else cpu + float32."""
    if config.device == "auto":
        device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    else:
        device = torch.device(config.device)
    if config.dtype != "auto":
        return device, _DTYPES[config.dtype]
    return device, torch.bfloat16 if device.type == "cuda" else torch.float32


class ModelRunner:
    """Loads a transformers causal LM with paged attention and runs scheduler steps on it."""

    def __init__(self, config: WorkerConfig):
        self.config = config
        self.device, self.dtype = resolve_device_dtype(config)
        if config.num_threads:
            torch.set_num_threads(config.num_threads)
        path = resolve_model(config.model)
        self.model = AutoModelForCausalLM.from_pretrained(
            path, dtype=self.dtype, attn_implementation=ATTN_IMPLEMENTATION
        ).to(self.device).eval()
        self.device = self.model.device  # "cuda" resolved to "cuda:0"
        if config.is_packed_linear:
            logger.info("packed %d linear weights for oneDNN", pack_linears(self.model))
        model_config = self.model.config.get_text_config()
        max_len = model_config.max_position_embeddings
        if config.max_model_len > max_len:
            raise ValueError(f"max_model_len={config.max_model_len} exceeds the model's {max_len} positions")
        shape = KVCacheShape.from_model_config(self.model.config)
        num_blocks = config.num_kv_blocks or num_blocks_for(shape, config.block_size, self.dtype, config.kv_cache_gb)
        self.kv_cache = PagedKVCache(shape, num_blocks, config.block_size, self.dtype, self.device)
        self.limits = StepLimits(
            num_blocks=num_blocks,
            block_size=config.block_size,
            input_vocab_size=self.model.get_input_embeddings().num_embeddings,
            max_model_len=config.max_model_len or max_len,
        )
        self._info = WorkerInfo(
            model_name=config.served_model_name or path.name,
            num_kv_blocks=num_blocks,
            block_size=config.block_size,
            max_model_len=self.limits.max_model_len,
            vocab_size=_output_vocab_size(self.model),
            eos_token_ids=_eos_token_ids(self.model),
            device=str(self.device),
            dtype=str(self.dtype).removeprefix("torch."),
        )
        self._states: dict[str, SequenceState] = {}
        self.is_ready = False

    def info(self) -> WorkerInfo:
        return self._info

    def warm_up(self) -> None:
        """Run one real step (forward and sampling) on block 0; the runner is ready after it."""
        num_tokens = min(4, self.limits.max_model_len)
        blocks = list(range(-(-num_tokens // self.kv_cache.block_size)))
        seq = ScheduledSequence(_WARMUP_SEQ_ID, [0] * num_tokens, 0, blocks, sample_indices=[num_tokens - 1])
        self.step(StepRequest([seq], [NewSequence(_WARMUP_SEQ_ID, SamplingParams(), num_tokens)], []))
        self._states.pop(_WARMUP_SEQ_ID, None)
        self.is_ready = True

    def step(self, request: StepRequest) -> list[SequenceOutput]:
        """Update sequence state, run the batched forward, sample at every sample index (verify trees)."""
        sequences = self.update_states(request)
        logits = self.execute(sequences)
        return self.sample(sequences, logits)

    def compute_logits(self, request: StepRequest) -> torch.Tensor:
        """Like step() without sampling: float32 logits [N, V], one row per sample index (every node
        of a tree) in request order."""
        return self.execute(self.update_states(request))

    def update_states(self, request: StepRequest) -> list[ScheduledSequence]:
        """Forget finished sequences, register new ones, validate the batch, then record its tokens.

        Nothing changes when the request is invalid. Returns the work to execute, with tree steps
        expanded to their mask, depth positions and one sample index per node.
        """
        states = dict(self._states)
        for seq_id in request.finished_seq_ids:
            states.pop(seq_id, None)
        for new in request.new_sequences:
            generator = make_generator(new.sampling.seed, self.device)
            states[new.seq_id] = SequenceState(new.sampling, new.num_prompt_tokens, generator, [])
        seen: set[str] = set()
        for seq in request.sequences:
            state = states.get(seq.seq_id)
            if state is None:
                raise InvalidRequest(f"unknown seq_id {seq.seq_id!r}: send a NewSequence first")
            if seq.seq_id in seen:
                raise InvalidRequest(f"sequence {seq.seq_id!r} is scheduled twice in one step")
            seen.add(seq.seq_id)
            validate_sequence(seq, len(state.history), self.limits)
        validate_disjoint_slots(request.sequences, self.limits.block_size)
        self._states = states
        for seq in request.sequences:
            history = states[seq.seq_id].history
            del history[seq.num_computed_tokens:]
            history.extend(seq.token_ids)
        return [expand_tree(seq) if seq.draft_parents is not None else seq for seq in request.sequences]

    @torch.inference_mode()
    def execute(self, sequences: list[ScheduledSequence]) -> torch.Tensor:
        """One forward over every scheduled token; float32 logits [N, V] at the sample indices."""
        if not sequences:
            return torch.empty(0, self._info.vocab_size)
        batch = build_attention_batch(sequences, self.kv_cache, self.device)
        token_ids, positions, keep, offset = [], [], [], 0
        for seq in sequences:
            token_ids += seq.token_ids
            positions += seq.positions()
            keep += [offset + i for i in seq.sample_indices]
            offset += len(seq.token_ids)
        output = self.model(
            input_ids=torch.tensor([token_ids], device=self.device),  # [1, T]
            position_ids=torch.tensor([positions], device=self.device),  # [1, T]
            use_cache=False,
            logits_to_keep=torch.tensor(keep, dtype=torch.long, device=self.device),  # [N]
            segserve_batch=batch,
        )
        return output.logits[0].float()  # [N, V]

    @torch.inference_mode()
    def sample(self, sequences: list[ScheduledSequence], logits: torch.Tensor) -> list[SequenceOutput]:
        """Sample one token per sample index, each with its own history; walk and compact trees."""
        outputs, accepted = sample_with_trees(sequences, logits, self._sample_row)
        for seq in sequences:
            if seq.seq_id in accepted:
                self._keep_accepted(seq, accepted[seq.seq_id])
        return outputs

    def _sample_row(self, seq: ScheduledSequence, index: int) -> SampleRow:
        """Token `index` of `seq`, seeing the sequence's computed tokens and its own path or prefix."""
        state = self._states[seq.seq_id]
        context = state.history[: seq.num_computed_tokens]
        return SampleRow(state.params, context + seq.visible_tokens(index), state.num_prompt_tokens, state.generator)

    def _keep_accepted(self, seq: ScheduledSequence, accepted_nodes: list[int]) -> None:
        """Move the accepted nodes' KV to sequential slots; history = computed + root + accepted drafts."""
        moves = kv_moves(accepted_nodes, TreeLayout.from_draft_parents(seq.draft_parents).depths)
        if moves:
            block_size, start = self.kv_cache.block_size, seq.num_computed_tokens
            slots = [[seq.block_table[p // block_size] * block_size + p % block_size for p in (start + a, start + b)]
                     for a, b in moves]
            src, dst = torch.tensor(slots, dtype=torch.long, device=self.device).unbind(1)  # [M] each
            self.kv_cache.move(src, dst)
        history = self._states[seq.seq_id].history
        history[seq.num_computed_tokens + 1:] = [seq.token_ids[node] for node in accepted_nodes]


def _output_vocab_size(model) -> int:
    head = model.get_output_embeddings()
    return head.weight.shape[0] if head is not None else model.config.get_text_config().vocab_size


def _eos_token_ids(model) -> tuple[int, ...]:
    """EOS ids from the generation config and the model config, deduplicated."""
    ids: set[int] = set()
    for source in (getattr(model, "generation_config", None), model.config.get_text_config()):
        value = getattr(source, "eos_token_id", None)
        if value is not None:
            ids.update([value] if isinstance(value, int) else value)
    return tuple(sorted(ids))
