"""The model runner: one batched forward per step over the paged KV cache, then sampling.

In: a `StepRequest` (protos/segserve/v1/step.py: new sequences, the scheduled work, finished ids).
Out: one `SequenceOutput` per scheduled sequence that sampled, asked for prompt log-probabilities
of prompt tokens it computed, or failed, in request order.

Fault isolation: whatever is tied to ONE sequence fails that sequence alone, with an error output
and no tokens, and every other sequence gets exactly the output it would have had: a failed
check (worker/validation.py: it is left out of the forward, its state untouched), non-finite
logits at any of its rows or non-finite keys or values at any of its new tokens, a sampler exception
at its row (worker/faults.py). A sequence whose forward was not finite may have written non-finite
KV: its blocks are cleared of it before the answer goes back, so the next owner of a block is not
failed by what it reads there, masked. Only a failure of the whole step (the batched forward itself,
out of memory) raises.

Sequence state lives in worker/planning.py. KV slots and history are only meaningful up to the
scheduler's next `num_computed_tokens`: tree nodes that were not accepted are overwritten by
later steps. Invariant the scheduler keeps: the first num_computed_tokens storage positions hold
the sequence's real tokens at their own rotary positions. A verified tree (worker/verify.py)
keeps it too: after acceptance the runner moves the accepted nodes' KV to their sequential slots
and sets the history to history[:num_computed] + root + accepted drafts.
"""

from __future__ import annotations

import functools
import itertools
import logging
import time
from concurrent.futures import ThreadPoolExecutor, wait

import numpy as np
import torch

from worker.block_tables import BlockTables
from common import tracing
from common.checkpoint import resolve_model
from protos.segserve.v1.info import WorkerInfo
from protos.segserve.v1.sampling import SamplingParams
from protos.segserve.v1.step import MAX_DECODE_STEPS, NewSequence, ScheduledSequence, StepRequest, multi_step_problem
from protos.segserve.v1.step_result import PromptLogprobs, SequenceOutput, TopLogprobs
from worker.config import WorkerConfig
from worker.kv_cache import KVCacheShape, PagedKVCache, num_blocks_in_gb
from worker.loading import load, max_model_len, prepare_linears, resolve_device_dtype
from worker.forward_path import PathChoice
from worker.fused_norm import fuse_rms_norms
from worker.grammar import GrammarEngine
from worker.grammar_masks import GrammarMasks, constrainer, fill_masks
from worker.planning import ForwardPlan, SequenceState, plan_step
from worker.threads import cpu_threads, threads_for
from worker.prompt_logprobs import compute as compute_prompt_logprobs
from worker.ranks import Launch, launch_process
from worker.sharded_load import peak_host_gib
from worker.tensor_parallel import RankGroup
from worker.upload import to_device
from worker.sampler import PrefixedHistory, SampleRow
from worker import latent_attention, self_check, sequence_state
from worker.validation import InvalidRequest, StepLimits
from worker.verify import NON_FINITE, Sampled, kv_moves, sample_works, step_paths
from worker.work import Work


logger = logging.getLogger(__name__)
OVERLAP_MIN_FORWARD_S = 0.005
"""On the CPU, a step's grammar masks are filled on the grammar thread while its forward runs when the last forward
took at least this long; otherwise after it, on the step's thread. A second thread that wants the GIL while the
forward dispatches its ops slows a short forward by more than it hides (measured on the 2-core CPU, tiny model:
the forward 0.1 ms slower at batch 1 and 0.3 ms at 64, for a fill of 0.01 and 0.14 ms). On a GPU the masks are
filled after the forward is launched, on the step's thread, while the device runs it."""
_WARMUP_SEQ_ID = "__segserve_warmup__"


class ModelRunner:
    """Loads a transformers causal LM with paged attention and runs scheduler steps on it."""

    def __init__(self, config: WorkerConfig, ranks: RankGroup | None = None, seed: int | None = None,
                 launch: Launch = launch_process):
        """ranks: this runner's place among its worker's tensor-parallel ranks when it is a follower (worker/ranks.py
        starts it with them); None: rank 0, which starts the others itself when config.tensor_parallel_size > 1, by
        `launch` (processes; on a Ray cluster, actors)."""
        self.config = config
        self.device, self.dtype = resolve_device_dtype(config)
        size = config.tensor_parallel_size
        if self.device.type == "cpu":
            torch.set_num_threads(max(1, cpu_threads(config.num_threads) // size))
        if self.device.type == "cuda":
            # SDPA with a boolean mask would pick cuDNN, which plans anew for every new shape (measured on an
            # H100: ~80 ms of host time per step at batch 64); the memory-efficient kernel needs no plan.
            torch.backends.cuda.enable_cudnn_sdp(False)
        path = resolve_model(config.model)
        loaded = load(config, path, self.device, self.dtype, ranks, seed, launch)
        self.model, self.device, self._name, seed = loaded.model, loaded.device, loaded.name, loaded.seed
        if self.device.type == "cpu" and not config.num_threads and size == 1:
            # Before the linears' row policies are probed: they hold at the thread count they were probed at.
            torch.set_num_threads(threads_for(self.model, torch.get_num_threads()))
            logger.info("%d torch threads for this model's forward (worker/threads.py, threads_for)",
                        torch.get_num_threads())
        self.followers = loaded.followers
        """Rank 0's other ranks, which run each step with it (worker/ranks.py); None on one device and on them."""
        self.choice = PathChoice.of(config, self.device.type, self.model)
        """Which forward path steps take (worker/forward_path.py), decided before the linears are packed."""
        self.latent = latent_attention.attach(self.model)  # before the linears are packed: it keeps kv_b_proj's
        """Multi-head latent attention's latent widths, which the KV cache holds (worker/latent_attention.py), or
        None."""
        prepare_linears(self.model, config, is_packed=config.is_packed_linear and not self.choice.is_compiled_layers)
        self.num_threads = torch.get_num_threads()
        """torch's threads the linears' row policies were probed at: every step runs at this many (step())."""
        logger.info("fused %d RMSNorm modules into one op each", fuse_rms_norms(self.model))
        self.sequence_states = sequence_state.attach(self.model)
        """The sequences' states besides the KV cache (LFM2's convolutions, Mamba mixers; worker/sequence_state.py),
        or None: a model without."""
        if (self.sequence_states is not None or self.latent is not None) and config.is_compiled:
            raise ValueError(f"{type(self.model).__name__}'s stateful layers and latent attention run eagerly only: "
                             "drop --compiled")
        max_len = max_model_len(self.model, config)
        num_layers = self.model.config.get_text_config().num_hidden_layers
        shape = (self.latent.cache_shape(num_layers) if self.latent is not None
                 else KVCacheShape.from_model_config(self.model.config))
        num_blocks = config.num_kv_blocks or num_blocks_in_gb(shape, config.block_size, self.dtype, config.kv_cache_gb)
        self.kv_cache = PagedKVCache(shape, num_blocks + self.choice.num_scratch_blocks, config.block_size, self.dtype,
                                     self.device)
        self.limits = StepLimits(num_blocks=num_blocks, block_size=config.block_size,
                                 input_vocab_size=self.model.get_input_embeddings().num_embeddings,
                                 max_model_len=config.max_model_len or max_len)
        self._info = WorkerInfo(
            model_name=config.served_model_name or path.name,
            num_kv_blocks=num_blocks,
            block_size=config.block_size,
            max_model_len=self.limits.max_model_len,
            vocab_size=_output_vocab_size(self.model),
            eos_token_ids=_eos_token_ids(self.model),
            device=str(self.device),
            dtype=str(self.dtype).removeprefix("torch."),
            block_table_deltas=True,  # plan_step resolves them (BlockTables.resolve)
            max_decode_steps=MAX_DECODE_STEPS,
            sequence_state_reason=self.sequence_states.reason if self.sequence_states is not None else "",
        )
        self.grammars = GrammarEngine(path, self._info.vocab_size, self._info.eos_token_ids)
        """Structured outputs' grammars (worker/grammar.py); it loads the tokenizer at the first one."""
        self.grammar_masks = GrammarMasks(self._info.vocab_size, self.device)
        """The host bitmask constrained rows are masked with (worker/grammar_masks.py), reused by every step."""
        self._grammar_thread = ThreadPoolExecutor(1, thread_name_prefix="grammar-masks")
        """Where a step's masks are filled while a long CPU forward runs (OVERLAP_MIN_FORWARD_S): one step's at a
        time; started at the first such step."""
        self._forward_s = 0.0
        """How long the last forward took on the host (on a GPU: its launch)."""
        self.block_tables = BlockTables(-(-self.limits.max_model_len // config.block_size), num_blocks, self.device)
        self.path = self.choice.build(self.model, self.device, self.kv_cache, self.block_tables, self.sequence_states)
        """How a step's tokens become logits (worker/forward_path.py), chosen here once."""
        self._states: dict[str, SequenceState] = {}
        self.is_ready = False
        self.timings: dict[str, float] | None = None
        """None (the default): nothing is timed. A dict: each step() refills it with the seconds of its
        parts, "metadata" (state update, validation, expansion, attention metadata and inputs),
        "forward" (the model call) and "sample" (checks, sampling/verification, outputs); on CUDA each
        part ends with a device synchronize, so the times are the device's too (segserve bench engine)."""
        self._lap_start = 0.0
        if seed is not None:  # every rank samples alike from here on (worker/ranks.py)
            torch.manual_seed(seed)
        logger.info("%s prepared its model; peak host memory %.2f GiB", self._name, peak_host_gib())

    def close(self) -> None:
        """Stop the other ranks (nothing on one device)."""
        if self.followers is not None:
            self.followers.close()
            self.followers = None

    def info(self) -> WorkerInfo:
        return self._info

    def warm_up(self) -> None:
        """Run one real step (forward and sampling) from block 0; the runner is ready after it. A compiled runner
        runs one per bucket up to config.compile_max_tokens (as far as the KV cache and max_model_len reach),
        so that no request waits for a compile of those. With decode graphs, a step of one token runs on them too
        (on a GPU it captures a graph: a capture that cannot work fails the start, not a request)."""
        most = min(self.limits.max_model_len, self.limits.num_blocks * self.kv_cache.block_size)
        sizes = {min(4, most)} | ({1} if self.path.graphs is not None else set())
        if self.config.is_compiled:
            sizes |= {n for n in (1 << i for i in range(32)) if n <= min(self.config.compile_max_tokens, most)}
        for num_tokens in sorted(sizes):
            blocks = tuple(range(-(-num_tokens // self.kv_cache.block_size)))
            seq = ScheduledSequence(_WARMUP_SEQ_ID, (0,) * num_tokens, 0, blocks, sample_indices=(num_tokens - 1,))
            (output,) = self.step(StepRequest([seq], [NewSequence(_WARMUP_SEQ_ID, SamplingParams(), num_tokens)]))
            if self.sequence_states is not None and not output.error:
                logger.info("each sequence keeps %.1f KiB of state besides its KV blocks (not in --kv-cache-gb)",
                            self.sequence_states.nbytes(_WARMUP_SEQ_ID) / 1024)
            self._states.pop(_WARMUP_SEQ_ID, None)
            if output.error:
                raise RuntimeError(f"the warm-up step failed: {output.error}")
        if self.config.is_self_check and self.config.tensor_parallel_size == 1:
            self_check.run(self)  # SelfCheckFailed: this model would be served wrong
        self.is_ready = True

    def step(self, request: StepRequest) -> list[SequenceOutput]:
        """Update sequence state, run the batched forward, sample (verify trees), answer every sequence.

        A request of num_steps > 1 decode steps runs them back to back: each step after the first continues
        every sequence still going with the token it sampled in the one before, as a step ahead would
        (async scheduling), and a sequence's tokens, scores and top log-probabilities are joined in order.
        A sequence that fails in any of them is answered with that error alone and leaves the rest."""
        if self.timings is not None:
            self.timings.clear()
            self._lap_start = time.perf_counter()
        if torch.get_num_threads() != self.num_threads:  # another runner in this process set its own (tests)
            torch.set_num_threads(self.num_threads)
        if self.followers is None:
            return self._steps(request)
        try:
            self.followers.send("step", request)
            return self._steps(request)
        except InvalidRequest:
            raise
        except Exception:
            self.followers.check()  # a channel or collective that failed for a dead rank stops the worker
            raise

    def _steps(self, request: StepRequest) -> list[SequenceOutput]:
        """step()'s work: its request's num_steps steps."""
        problem = multi_step_problem(request)
        if problem is not None:
            raise InvalidRequest(problem)
        outputs = self._step(request)
        if request.num_steps == 1:
            return outputs
        joined = {output.seq_id: output for output in outputs}
        going = request.sequences  # their block tables are whole now (plan_step resolved them in place)
        for offset in range(1, request.num_steps):
            going = [seq for seq in going if not joined[seq.seq_id].error]
            if not going:
                break
            continued = StepRequest([ScheduledSequence(seq.seq_id, (0,), seq.num_computed_tokens + offset,
                                                       seq.block_table, (0,), None, True) for seq in going])
            for output in self._step(continued):
                joined[output.seq_id] = output if output.error else joined[output.seq_id].followed_by(output)
        return [joined[output.seq_id] for output in outputs]

    def _step(self, request: StepRequest) -> list[SequenceOutput]:
        plan = self.update_states(request)
        try:
            try:
                with tracing.span("worker.forward"):  # under a traced step's scheduler span (server.py), else none
                    logits = self.execute(plan)
            except torch.OutOfMemoryError:
                if self.device.type == "cuda":
                    torch.cuda.empty_cache()  # give the failed step's activations back before the retry
                raise
            with tracing.span("worker.sample"):
                outputs = self.postprocess(plan, logits)
        finally:
            if plan.grammar_masks is not None:  # a failed step's fill too: the matchers are the next step's after it
                wait([plan.grammar_masks])
        self._lap("sample")
        return outputs

    def forward(self, request: StepRequest) -> torch.Tensor:
        """The float32 logits [N, V] that step(request) would sample from, one row per sample index (every node of
        a tree) in request order: its state update and forward, without the sampling. InvalidRequest when the
        request or any of its sequences is rejected."""
        if self.followers is not None:
            self.followers.send("forward", request)
        plan = self.update_states(request)
        if plan.rejected:
            raise InvalidRequest("; ".join(plan.rejected.values()))
        return self.execute(plan)[:plan.num_sample_rows]

    def update_states(self, request: StepRequest) -> ForwardPlan:
        """Apply the request to the sequence states and return what to run (worker/planning.py).

        Nothing changes when the request as a whole is invalid (InvalidRequest)."""
        if self.sequence_states is not None:
            self.sequence_states.check(request.sequences)  # no draft, no step but where the last one ended
        try:
            self._states, plan = plan_step(request, self._states, self.limits, self.block_tables, self.grammars.start)
        except InvalidRequest:
            self.block_tables.retain(self._states)  # rows staged for sequences the step would have added
            raise
        if self.sequence_states is not None:
            self.sequence_states.retain(self._states)
        return plan

    @torch.inference_mode()
    def execute(self, plan: ForwardPlan) -> torch.Tensor:
        """One forward over every scheduled token. Returns float32 logits [N + R, V]: first the N
        sample indices, then the R rows kept for prompt log-probabilities, each in work order. Just
        before a long CPU forward, the grammar masks of the constrained rows start filling on the
        grammar thread (OVERLAP_MIN_FORWARD_S), which postprocess() waits for."""
        works = plan.works
        if not works:
            self._lap("metadata")
            return torch.empty(0, self._info.vocab_size, device=self.device)
        layout = plan.layout
        num_tokens = len(layout.slots)
        token_ids = np.fromiter(itertools.chain.from_iterable(w.token_ids for w in works), np.int64, num_tokens)
        positions = np.fromiter(itertools.chain.from_iterable(w.positions for w in works), np.int64, num_tokens)
        keep = np.concatenate([_kept_rows(works, layout.offsets, "sample_indices"),
                               _kept_rows(works, layout.offsets, "prompt_offsets")])
        forward = self.path.prepare(plan, token_ids, positions, keep)
        self._lap("metadata")
        self._start_masks(plan)
        started = time.perf_counter()
        logits = forward()
        self._forward_s = time.perf_counter() - started
        self._lap("forward")
        return logits

    def _start_masks(self, plan: ForwardPlan) -> None:
        """Just before the forward: start filling the masks of the plan's constrained rows on the grammar thread,
        where that pays (OVERLAP_MIN_FORWARD_S; worker/grammar_masks.py). Nothing without constrained rows."""
        if plan.constrained and self.device.type == "cpu" and self._forward_s >= OVERLAP_MIN_FORWARD_S:
            plan.grammar_masks = self._grammar_thread.submit(fill_masks, plan.works, plan.constrained, self._states,
                                                             self.grammar_masks)

    def _lap(self, part: str) -> None:
        """With timings on: add the time since the last lap to `part` (after a device sync on CUDA)."""
        if self.timings is None:
            return
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        now = time.perf_counter()
        self.timings[part] = self.timings.get(part, 0.0) + now - self._lap_start
        self._lap_start = now

    @torch.inference_mode()
    def postprocess(self, plan: ForwardPlan, logits: torch.Tensor) -> list[SequenceOutput]:
        """Check the logits, sample, score prompt tokens, keep accepted tree KV; one output per
        sequence that has something to say, in request order. logits: [N + R, V] from execute()."""
        works = plan.works
        # failed: work index -> why it failed (non-finite logits at any of its rows or keys and values at any of
        # its tokens, a sampler error)
        constrain = None
        if plan.constrained:  # the masks filled beside the forward, or filled now (a GPU runs the forward meanwhile)
            filled = (plan.grammar_masks.result if plan.grammar_masks is not None
                      else functools.partial(fill_masks, works, plan.constrained, self._states, self.grammar_masks))
            constrain = constrainer(filled, self.grammar_masks)
        sampled, failed = sample_works(works, logits, self.sample_rows, plan.non_finite_tokens, constrain)
        forcing = self._forcing(plan) if plan.constrained else ()
        overflowed = {block for i, why in failed.items() if why in NON_FINITE for block in works[i].block_table}
        if overflowed:  # before the scheduler can give these blocks to anyone else (it frees them on the error)
            self.kv_cache.clear_non_finite(to_device(torch.tensor(sorted(overflowed)), self.device))
        prompt = self._prompt_logprobs(plan, logits[plan.num_sample_rows:], failed)
        outputs, accepted = [], {}
        work_index = iter(range(len(works)))  # the works are the sequences not rejected, in request order
        for seq_id in plan.seq_ids:
            if seq_id in plan.rejected:
                outputs.append(SequenceOutput(seq_id, error=plan.rejected[seq_id]))
                continue
            i = next(work_index)
            if i in failed:
                outputs.append(SequenceOutput(seq_id, error=f"sequence {seq_id!r}: {failed[i]}"))
                continue
            out, state = sampled.get(i), self._states[seq_id]
            if out is not None:
                work = works[i]
                if out.accepted_nodes is not None:
                    self._keep_accepted(work, out.accepted_nodes)
                    accepted[seq_id] = out.accepted_nodes
                if out.accepted_nodes is not None or work.sample_indices[-1] == len(work.token_ids) - 1:
                    state.last_sampled = out.token_ids[-1]  # what a continuation computes
            if out is not None or i in prompt:
                forced = self._forced_span(state) if i in forcing and out is not None else ()
                outputs.append(self._output(seq_id, state, out, prompt.get(i), forced))
        if accepted and self.sequence_states is not None:
            self.sequence_states.accept(accepted)  # the trees' accepted paths into the sequences' states
        return outputs

    def _forcing(self, plan: ForwardPlan) -> set[int]:
        """The constrained works whose outputs carry a forced span (NewSequence.is_drafting_forced_spans)."""
        return {i for i in plan.constrained if self._states[plan.works[i].seq_id].is_drafting_forced_spans}

    def _forced_span(self, state: SequenceState) -> tuple[int, ...]:
        """The tokens the sequence's grammar forces after what it just sampled (its matcher advances by those
        tokens, which the next step's history holds); () where it leaves a choice."""
        if state.last_sampled is None:  # it sampled before its end (a prefill chunk's prompt rows): no output yet
            return ()
        output = state.history[state.num_prompt_tokens:]
        output.append(state.last_sampled)
        return () if state.grammar.sync(output) is not None else self.grammars.forced_tokens(state.grammar)

    @staticmethod
    def _output(seq_id: str, state: SequenceState, sampled: Sampled | None, prompt: PromptLogprobs | None,
                forced: tuple[int, ...] = ()) -> SequenceOutput:
        if sampled is None:
            return SequenceOutput(seq_id, prompt_logprobs=prompt)
        tops = ()
        if state.params.num_top_logprobs > 0:
            tops = tuple(TopLogprobs(*top) for top in sampled.top_logprobs)
        return SequenceOutput(seq_id, tuple(sampled.token_ids), tuple(sampled.scores), tops, prompt,
                              forced_token_ids=forced)

    def _prompt_logprobs(self, plan: ForwardPlan, logits: torch.Tensor, failed: dict[int, str]
                         ) -> dict[int, PromptLogprobs]:
        """Work index -> PromptLogprobs for every work that scores prompt tokens and did not fail.
        logits: [R, V], the prompt rows of every work in turn."""
        if not any(plan.prompt_plans):
            return {}
        items, indices, row = [], [], 0
        for i, (work, prompt_plan) in enumerate(zip(plan.works, plan.prompt_plans)):
            kept = logits[row:row + len(work.prompt_offsets)]  # [K, V]
            row += len(work.prompt_offsets)
            if prompt_plan is not None and i not in failed:
                state = self._states[work.seq_id]
                items.append((prompt_plan, state.prompt, state.history, kept))
                indices.append(i)
        return dict(zip(indices, compute_prompt_logprobs(items))) if items else {}

    def sample_rows(self, work: Work) -> list[SampleRow]:
        """The rows of every sample index of `work`, in order; when the sampler reads no history (no penalty, no
        watermark) they are one row, kept on the sequence's state, with no history, so a tree costs no row per
        node and a decode step builds no row."""
        state = self._states[work.seq_id]
        if state.plain_row is None and not (state.params.has_penalty or state.params.watermark):
            # the sampler reads no history: one row object for the sequence's life, made at its first step
            state.plain_row = SampleRow(state.params, (), state.num_prompt_tokens, state.generator)
        if state.plain_row is not None:
            return [state.plain_row] * len(work.sample_indices)
        return [SampleRow(state.params, PrefixedHistory(state.history, work.num_computed_tokens, path),
                          state.num_prompt_tokens, state.generator) for path in step_paths(work)]

    def _keep_accepted(self, work: Work, accepted_nodes: list[int]) -> None:
        """Move the accepted nodes' KV to sequential slots; history = computed + root + accepted drafts."""
        moves = kv_moves(accepted_nodes, work.node_depths)
        if moves:
            block_size, start = self.kv_cache.block_size, work.num_computed_tokens
            slots = [[work.block_table[p // block_size] * block_size + p % block_size
                      for p in (start + a, start + b)] for a, b in moves]
            src, dst = to_device(torch.tensor(slots, dtype=torch.long), self.device).unbind(1)  # [M] each
            self.kv_cache.move(src, dst)
        history = self._states[work.seq_id].history
        history[work.num_computed_tokens + 1:] = [work.token_ids[node] for node in accepted_nodes]


def _kept_rows(works: list[Work], offsets: np.ndarray, field: str) -> np.ndarray:
    """Packed-row index of every token listed in each work's `field` (sample_indices or prompt_offsets), in work
    order. [K] int64."""
    indices = [getattr(work, field) for work in works]
    counts = np.fromiter((len(i) for i in indices), np.int64, len(works))
    flat = np.fromiter(itertools.chain.from_iterable(indices), np.int64, int(counts.sum()))
    return flat + np.repeat(offsets, counts)


def _output_vocab_size(model) -> int:
    head = model.get_output_embeddings()
    if hasattr(head, "vocab_size"):  # a vocabulary-parallel head (worker/tensor_parallel.py)
        return head.vocab_size
    return head.weight.shape[0] if head is not None else model.config.get_text_config().vocab_size


def _eos_token_ids(model) -> tuple[int, ...]:
    """EOS ids from the generation config and the model config, deduplicated."""
    ids: set[int] = set()
    for source in (getattr(model, "generation_config", None), model.config.get_text_config()):
        value = getattr(source, "eos_token_id", None)
        if value is not None:
            ids.update([value] if isinstance(value, int) else value)
    return tuple(sorted(ids))
