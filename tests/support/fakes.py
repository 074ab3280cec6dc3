"""The one fake worker and the one fake drafter of the scheduler's tests, at every tier.

`FakeWorker` implements the Engine's Worker protocol (get_info / step / health)
with a deterministic model: the next token is `rule(prefix)` (`increment`:
last + 1; `positional`: depends on the token and its position, so KV kept for
the wrong tree nodes changes the output). Its KV cache is paged like the real
one: every slot holds the token computed there, and the next token follows the
rule on the context read back through the block table, so a block shared or
reused wrongly changes the output. It checks every StepRequest the way the real
worker does and more (announced sequences, num_computed_tokens within the
tokens it knows, the KV read back equal to those tokens, block tables, no
block written in a step while another sequence of the step holds it, well-formed
trees), verifies candidate trees by the rule (draft nodes' KV is written to the
slots past the root, then the accepted path is moved to sequential slots),
returns top and prompt log-probabilities when asked, and injects faults on
request: a per-sequence error output, whole-step failures (once, for good,
past a batch size, whenever a given sequence is in the step) and malformed
answers. `step_sync` is the same step for the pure tier; `FakeWorkerServicer`
(tests/support/fake_services.py) serves it over gRPC for the in-process service tier.
The fake drafter is tests/support/fake_drafter.py.
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Callable, Sequence

from protos.segserve.v1.info import Health, WorkerInfo
from protos.segserve.v1.sampling import SamplingParams
from protos.segserve.v1.step import (
    CONTINUATION_REFUSED,
    ScheduledSequence,
    StepRequest,
    multi_step_problem,
)
from protos.segserve.v1.step_result import (
    PromptLogprobs,
    SequenceOutput,
    StepResult,
    TopLogprobs,
)
from protos.segserve.v1.tree import ROOT, CandidateTree
from scheduler.worker_client import WorkerError

Rule = Callable[[Sequence[int]], int]
SCORE = 0.5
"""The score the fake reports for every sampled token."""


def increment(vocab_size: int) -> Rule:
    """next token = (last + 1) % vocab_size."""
    return lambda prefix: (prefix[-1] + 1) % vocab_size


def positional(vocab_size: int) -> Rule:
    """next token = (7 * last + len(prefix)) % vocab_size: depends on the token and its position."""
    return lambda prefix: (7 * prefix[-1] + len(prefix)) % vocab_size


def reference(rule: Rule, prompt: Sequence[int], max_tokens: int, eos: int | None = None,
              max_len: int = 10**9) -> list[int]:
    """Plain greedy decoding under the rule, with the scheduler's stop conditions."""
    tokens = list(prompt)
    while True:
        tokens.append(rule(tokens))
        if tokens[-1] == eos or len(tokens) - len(prompt) >= max_tokens or len(tokens) >= max_len:
            return tokens[len(prompt):]


def prompt_logprob(prefix: Sequence[int], token_id: int) -> float:
    """The fake's log-probability of token_id after prefix (deterministic, in (-1, 0])."""
    return -((token_id + len(prefix)) % 10) / 10


class InjectedFailure(WorkerError):
    """A whole-step failure the test asked for, as WorkerClient reports a gRPC status."""

    def __init__(self, code: str, detail: str) -> None:
        super().__init__(f"worker Step failed: {code}: {detail}", code)
        self.detail = detail


class FakeWorker:
    """A rule-following model behind the Engine's Worker protocol; see the module docstring."""

    def __init__(self, rule: Rule, vocab_size: int, eos_token_ids: Sequence[int] = (), *, num_kv_blocks: int = 64,
                 block_size: int = 4, max_model_len: int = 128, block_table_deltas: bool = True,
                 max_decode_steps: int = 1):
        self.info = WorkerInfo("fake", num_kv_blocks, block_size, max_model_len, vocab_size, tuple(eos_token_ids),
                               "cpu", "float32", block_table_deltas=block_table_deltas,
                               max_decode_steps=max_decode_steps)
        self.rule = rule
        self.step_delay_s = 0.0
        self.kv: dict[str, list[int]] = {}
        """Each known sequence's token history: its NewSequence's prompt, then after every step
        history[:num_computed_tokens] + the step's tokens (+ accepted drafts), like the real worker."""
        self.slots: dict[int, int] = {}
        """KV-cache slot -> the token whose KV it holds (-1: garbage left by a failed step)."""
        self.tables: dict[str, tuple[int, ...]] = {}
        """Each sequence's last whole block table, which a delta (block_table_start) continues."""
        self.num_table_entries = 0
        """Block-table entries received, over every step."""
        self.sampling: dict[str, SamplingParams] = {}
        self.num_prompt_tokens: dict[str, int] = {}
        self.ever_announced: set[str] = set()
        self.released: list[str] = []
        self.requests: list[StepRequest] = []
        """Every StepRequest received, failed ones included."""
        self.problems: list[str] = []
        """Violations of the worker contract seen (each also fails its step)."""
        self.max_batch = 0
        self.max_tokens_per_step = 0
        # Fault injection.
        self.failing_code: str | None = None
        """Every step fails with this gRPC status name while set."""
        self.step_failures: list[str] = []
        """Status names the next steps fail with, one per step."""
        self.fail_once_at_batch: tuple[int, str] | None = None
        """(batch size, status name): the first step with at least that many sequences fails once."""
        self.max_batch_size: int | None = None
        """A step with more sequences fails with RESOURCE_EXHAUSTED (out of memory)."""
        self.poison_seq_ids: set[str] = set()
        """A step holding any of these sequences fails with INTERNAL."""
        self.sequence_errors: dict[str, int] = {}
        """seq id -> sampled outputs it gets before an error output (then every time)."""
        self.num_malformed_answers = 0
        """The next steps answer one token too many for their first sampled sequence."""
        self._num_sampled: dict[str, int] = {}
        self.last_sampled: dict[str, int] = {}
        """seq id -> the token its last step sampled at its end (what a continuation computes next)."""
        self.num_continuations = 0
        """Continuations (async scheduling) received and resolved."""
        self.num_multi_steps = 0
        """Requests of several decode steps run (StepRequest.num_steps)."""
        self.refused_continuations: list[str] = []
        """Ids of continuations that could not be resolved (their sequence failed or ended in the step before)."""
        self._step_lock = asyncio.Lock()

    async def get_info(self) -> WorkerInfo:
        return self.info

    async def health(self) -> Health:
        return Health(True)

    async def step(self, request: StepRequest) -> StepResult:
        async with self._step_lock:  # like the real worker: steps run one at a time, in the order they came
            if self.step_delay_s:
                await asyncio.sleep(self.step_delay_s)
            return self.step_sync(request)

    def step_sync(self, request: StepRequest) -> StepResult:
        """Apply the request like the real worker (state first, then the forward, num_steps decode steps in a
        row); raise InjectedFailure for an injected whole-step failure, AssertionError for a contract
        violation."""
        problem = multi_step_problem(request)
        if problem is None and request.num_steps > self.info.max_decode_steps:
            problem = f"num_steps={request.num_steps}, but the worker offers {self.info.max_decode_steps}"
        if problem is not None:
            self.requests.append(request)
            self.problems.append(problem)
            raise AssertionError(problem)
        result = self._step_once(request)
        if request.num_steps == 1:
            return result
        self.num_multi_steps += 1
        joined = {output.seq_id: output for output in result.outputs}
        going = list(request.sequences)
        for offset in range(1, request.num_steps):  # each sequence continues with the token it just sampled
            going = [work for work in going if not joined[work.seq_id].error]
            continued = [ScheduledSequence(work.seq_id, (self.last_sampled[work.seq_id],),
                                           work.num_computed_tokens + offset, self.tables[work.seq_id], (0,))
                         for work in going]
            problem = self._check(StepRequest(continued))
            if problem is not None:
                self.problems.append(problem)
                raise AssertionError(problem)
            for work in continued:
                output = self._run(work)
                if output.token_ids:
                    self.last_sampled[work.seq_id] = output.token_ids[-1]
                joined[work.seq_id] = output if output.error else joined[work.seq_id].followed_by(output)
        return StepResult([joined[output.seq_id] for output in result.outputs], compute_us=1)

    def _step_once(self, request: StepRequest) -> StepResult:
        self.requests.append(request)
        self.num_table_entries += sum(len(work.block_table) for work in request.sequences)
        problem = self._register(request) or self._order_problem(request)
        refused: list[str] = []
        if problem is None:
            request, problem = self._whole_tables(request)
        if problem is None:
            request, refused = self._continued(request)
        problem = problem or self._check(request)
        if problem is not None:
            self.problems.append(problem)
            raise AssertionError(problem)
        for work in request.sequences:  # taken in whether or not the step then runs, as the real worker's tables
            self.tables[work.seq_id] = work.block_table
        failure = self._injected_failure(request)
        for work in request.sequences:
            self.last_sampled.pop(work.seq_id, None)  # until this step samples
        if failure is not None:  # like an out-of-memory forward: announcements and releases were taken in,
            for work in request.sequences:  # and the step's own slots may hold garbage
                for position in range(work.num_computed_tokens, work.num_tokens):
                    self.slots[self._slot(work.block_table, position)] = -1
            raise failure
        self.max_batch = max(self.max_batch, len(request.sequences))
        self.max_tokens_per_step = max(self.max_tokens_per_step, request.num_scheduled_tokens)
        outputs = [output for work in request.sequences if (output := self._run(work)) is not None]
        outputs += [SequenceOutput(seq_id, error=f"sequence {seq_id!r}: {CONTINUATION_REFUSED}") for seq_id in refused]
        for output in outputs:
            if output.token_ids:
                self.last_sampled[output.seq_id] = output.token_ids[-1]
        sampled = [i for i, output in enumerate(outputs) if output.token_ids]
        if self.num_malformed_answers and sampled:
            self.num_malformed_answers -= 1
            bad = outputs[sampled[0]]
            outputs[sampled[0]] = SequenceOutput(bad.seq_id, bad.token_ids * 2, bad.scores * 2)
        return StepResult(outputs, compute_us=1)

    def _register(self, request: StepRequest) -> str | None:
        for seq_id in request.finished_seq_ids:
            if seq_id not in self.ever_announced:
                return f"released {seq_id!r}, never announced"
            self.released.append(seq_id)
            self.kv.pop(seq_id, None)
            self.tables.pop(seq_id, None)
            self.sampling.pop(seq_id, None)
        for new in request.new_sequences:  # a known id restarts (e.g. re-announced after a failed step)
            self.ever_announced.add(new.seq_id)
            self.kv[new.seq_id] = list(new.prompt_token_ids)
            self.sampling[new.seq_id] = new.sampling
            self.num_prompt_tokens[new.seq_id] = new.num_prompt_tokens
        return None

    def _order_problem(self, request: StepRequest) -> str | None:
        """Steps with ids (the engine's async scheduling): one with continuations names the step before it."""
        if not request.step_id or not any(work.is_continuation for work in request.sequences):
            return None
        before = self.requests[-2].step_id if len(self.requests) > 1 else 0
        if request.follows_step_id != before:
            return f"step {request.step_id} follows step {request.follows_step_id}, not the one before it ({before})"
        return None

    def _whole_tables(self, request: StepRequest) -> tuple[StepRequest, str | None]:
        """A copy of the request with every block table whole: a delta continues the sequence's last table."""
        if not any(work.block_table_start for work in request.sequences):
            return request, None
        if not self.info.block_table_deltas:
            return request, "a block-table delta sent to a worker that does not offer them"
        sequences = []
        for work in request.sequences:
            if work.block_table_start:
                base = self.tables.get(work.seq_id, ())
                if work.block_table_start > len(base):
                    return request, (f"{work.seq_id}: block_table_start {work.block_table_start}, but the worker "
                                     f"holds {len(base)} entries")
                work = dataclasses.replace(work, block_table=base[:work.block_table_start] + work.block_table,
                                           block_table_start=0)
            sequences.append(work)
        return dataclasses.replace(request, sequences=sequences), None

    def _continued(self, request: StepRequest) -> tuple[StepRequest, list[str]]:
        """A copy of the request with the token each continuation's previous step sampled in place of its
        placeholder, as the real worker resolves them before its checks, and the ids of continuations it
        cannot resolve (left out; they get an error output, as from the real worker)."""
        if not any(work.is_continuation for work in request.sequences):
            return request, []
        sequences, refused = [], []
        for work in request.sequences:
            if work.is_continuation:
                token_id = self.last_sampled.get(work.seq_id)
                known = self.kv.get(work.seq_id)
                if token_id is None or len(work.token_ids) != 1 or known is None \
                        or work.num_computed_tokens != len(known):
                    refused.append(work.seq_id)
                    self.refused_continuations.append(work.seq_id)
                    continue
                work = dataclasses.replace(work, token_ids=(token_id,), is_continuation=False)
                self.num_continuations += 1
            sequences.append(work)
        return dataclasses.replace(request, sequences=sequences), refused

    def _check(self, request: StepRequest) -> str | None:
        seen: set[str] = set()
        num_holders: dict[int, int] = {}
        for work in request.sequences:
            if work.seq_id not in self.kv:
                return f"unknown sequence {work.seq_id!r}"
            if work.seq_id in seen:
                return f"{work.seq_id!r} scheduled twice"
            seen.add(work.seq_id)
            known = self.kv[work.seq_id]
            if work.num_computed_tokens > len(known):
                return f"{work.seq_id}: {len(known)} tokens known, num_computed_tokens {work.num_computed_tokens}"
            if len(work.block_table) * self.info.block_size < work.num_tokens:
                return f"{work.seq_id}: block table too short"
            cached = self._read(work.block_table, work.num_computed_tokens)
            if cached != known[:work.num_computed_tokens]:
                return f"{work.seq_id}: the KV cache holds {cached}, not its tokens {known[:work.num_computed_tokens]}"
            for block in set(work.block_table[:-(-work.num_tokens // self.info.block_size)]):
                num_holders[block] = num_holders.get(block, 0) + 1
        for work in request.sequences:
            if any(num_holders[block] > 1 for block in self._written_blocks(work)):
                return f"{work.seq_id}: writes a KV block another sequence of the step holds"
            if work.draft is not None and (len(work.token_ids) != 1 or work.sample_indices
                                           or work.draft.problem(self.info.vocab_size) is not None):
                return f"{work.seq_id}: malformed tree step"
            if work.sample_indices and work.sample_indices != (len(work.token_ids) - 1,):
                return f"{work.seq_id}: sample indices {work.sample_indices}"
        return None

    def _injected_failure(self, request: StepRequest) -> InjectedFailure | None:
        if self.step_failures:
            return InjectedFailure(self.step_failures.pop(0), "injected step failure")
        if self.fail_once_at_batch is not None and len(request.sequences) >= self.fail_once_at_batch[0]:
            code, self.fail_once_at_batch = self.fail_once_at_batch[1], None
            return InjectedFailure(code, "injected step failure")
        if self.failing_code is not None:
            return InjectedFailure(self.failing_code, "injected worker failure")
        if self.max_batch_size is not None and len(request.sequences) > self.max_batch_size:
            return InjectedFailure("RESOURCE_EXHAUSTED", f"out of memory at {len(request.sequences)} sequences")
        if any(work.seq_id in self.poison_seq_ids for work in request.sequences):
            return InjectedFailure("INTERNAL", "injected failure of a poisoned batch")
        return None

    def _run(self, work: ScheduledSequence) -> SequenceOutput | None:
        """The forward for one sequence: its KV grows, and the output when it is sampled or asked for."""
        start = work.num_computed_tokens
        context = self._read(work.block_table, start) + list(work.token_ids)
        self._write(work.block_table, start, work.token_ids)
        sampling = self.sampling[work.seq_id]
        prompt = self._prompt_logprobs(work, context, sampling)
        if work.draft is not None:
            self._write(work.block_table, start + 1, work.draft.token_ids)  # every node's KV past the root
            token_ids = self._verify(context, work.draft)
            self._write(work.block_table, start + 1, token_ids[:-1])  # the accepted path, moved to sequential slots
            self.kv[work.seq_id] = context + token_ids[:-1]
        else:
            self.kv[work.seq_id] = context
            token_ids = [self.rule(context)] if work.sample_indices else []
        if not token_ids:
            return None if prompt is None else SequenceOutput(work.seq_id, prompt_logprobs=prompt)
        num_sampled = self._num_sampled[work.seq_id] = self._num_sampled.get(work.seq_id, 0) + 1
        if work.seq_id in self.sequence_errors and num_sampled > self.sequence_errors[work.seq_id]:
            return SequenceOutput(work.seq_id, error=f"non-finite logits for {work.seq_id}")
        top = [self._top(token_id, sampling.num_top_logprobs) for token_id in token_ids]
        return SequenceOutput(work.seq_id, tuple(token_ids), (SCORE,) * len(token_ids),
                              tuple(top) if sampling.num_top_logprobs else (), prompt)

    def _slot(self, block_table: Sequence[int], position: int) -> int:
        size = self.info.block_size
        return block_table[position // size] * size + position % size

    def _read(self, block_table: Sequence[int], num_tokens: int) -> list[int | None]:
        """The tokens whose KV positions 0..num_tokens-1 of a block table hold (None: never written)."""
        return [self.slots.get(self._slot(block_table, position)) for position in range(num_tokens)]

    def _write(self, block_table: Sequence[int], start: int, token_ids: Sequence[int]) -> None:
        for offset, token_id in enumerate(token_ids):
            self.slots[self._slot(block_table, start + offset)] = token_id

    def _written_blocks(self, work: ScheduledSequence) -> set[int]:
        """The blocks a step writes for `work`: positions num_computed_tokens.. (draft nodes included)."""
        size = self.info.block_size
        return {work.block_table[position // size] for position in range(work.num_computed_tokens, work.num_tokens)}

    def _verify(self, context: list[int], draft: CandidateTree) -> list[int]:
        """Accepted drafts + the target's own token: descend while a child equals the rule's token."""
        node, out = ROOT, []
        while True:
            target = self.rule(context + out)
            child = next((i for i, (t, p) in enumerate(zip(draft.token_ids, draft.parents))
                          if p == node and t == target), None)
            out.append(target)
            if child is None:
                return out
            node = child

    def _prompt_logprobs(self, work: ScheduledSequence, tokens: list[int],
                         sampling: SamplingParams) -> PromptLogprobs | None:
        """Log-probabilities of the prompt tokens this chunk covers (index >= 1), when asked for."""
        if sampling.num_prompt_logprobs is None:
            return None
        num_prompt = self.num_prompt_tokens[work.seq_id]
        start = max(work.num_computed_tokens, 1)
        end = min(work.num_computed_tokens + len(work.token_ids), num_prompt)
        if start >= end:
            return None
        indices = range(start, end)
        return PromptLogprobs(start, tuple(prompt_logprob(tokens[:i], tokens[i]) for i in indices),
                              tuple(self._top(tokens[i], sampling.num_prompt_logprobs) for i in indices)
                              if sampling.num_prompt_logprobs else ())

    def _top(self, token_id: int, n: int) -> TopLogprobs:
        return TopLogprobs(tuple((token_id + k) % self.info.vocab_size for k in range(n)),
                           tuple(-0.1 * (k + 1) for k in range(n)))
