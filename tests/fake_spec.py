"""Fakes for speculation tests: a rule-following model that verifies trees, and a scriptable drafter.

The model's rule: next token = (7 * last + len(prefix)) % VOCAB, so it depends
on both the token and its position (a tree node at the wrong position, or KV
kept for the wrong nodes, changes the output). EOS is a token the rule reaches.
"""

from __future__ import annotations

from collections.abc import Sequence

from scheduler.drafter_client import DraftQuery, DraftReply
from scheduler.outputs import DraftTree, SampledTokens, SchedulerOutput

VOCAB = 97
EOS = 96


def rule(prefix: Sequence[int]) -> int:
    return (7 * prefix[-1] + len(prefix)) % VOCAB


def reference(prompt: list[int], max_new_tokens: int, eos: int | None = EOS, max_len: int = 10**9) -> list[int]:
    """Plain greedy decoding under the rule, with the scheduler's stop conditions."""
    tokens = list(prompt)
    while True:
        tokens.append(rule(tokens))
        if tokens[-1] == eos or len(tokens) - len(prompt) >= max_new_tokens or len(tokens) >= max_len:
            return tokens[len(prompt):]


class FakeTreeWorker:
    """Checks each step like a worker would (known ids, KV accounting, blocks) and verifies trees by the rule."""

    def __init__(self, block_size: int):
        self.block_size = block_size
        self.kv: dict[str, list[int]] = {}
        self.num_steps = 0
        self.max_tokens_per_step = 0

    def step(self, output: SchedulerOutput) -> dict[str, SampledTokens]:
        self.num_steps += 1
        self.max_tokens_per_step = max(self.max_tokens_per_step, output.num_scheduled_tokens)
        for seq_id in output.finished_seq_ids:
            assert seq_id in self.kv, f"released {seq_id} the worker never saw"
            self.kv.pop(seq_id)
        for new in output.new_sequences:  # a reused id restarts (its release was withdrawn)
            self.kv[new.seq_id] = []
        used: set[int] = set()
        sampled = {}
        for work in output.scheduled:
            cache = [] if work.num_computed_tokens == 0 else self.kv[work.seq_id]
            assert len(cache) == work.num_computed_tokens, (work.seq_id, len(cache), work.num_computed_tokens)
            assert len(work.block_table) * self.block_size >= work.num_computed_tokens + len(work.token_ids)
            assert used.isdisjoint(work.block_table), "two sequences share a KV block"
            used.update(work.block_table)
            if work.draft_parents:
                assert not work.sample_indices and not work.position_ids and not work.attention_mask
                assert all(0 <= p <= i for i, p in enumerate(work.draft_parents))
                accepted = self._verify(cache + work.token_ids[:1], work.token_ids, work.draft_parents)
                self.kv[work.seq_id] = cache + work.token_ids[:1] + accepted[:-1]
                sampled[work.seq_id] = SampledTokens(accepted, [0.5] * len(accepted))
            else:
                self.kv[work.seq_id] = cache + work.token_ids
                if work.sample_indices:
                    assert work.sample_indices == [len(work.token_ids) - 1]
                    sampled[work.seq_id] = SampledTokens([rule(self.kv[work.seq_id])], [0.5])
        return sampled

    @staticmethod
    def _verify(context: list[int], token_ids: list[int], parents: list[int]) -> list[int]:
        """Accepted drafts + the target's own token: descend while a child equals the rule's token."""
        node, out = 0, []
        while True:
            target = rule(context + out)
            child = next((i + 1 for i, p in enumerate(parents) if p == node and token_ids[i + 1] == target), None)
            out.append(target)
            if child is None:
                return out
            node = child


class FakeDrafter:
    """Tracks each request's tokens like a drafter; proposes a tree whose main chain follows the rule.

    The chain is right for `num_right` nodes, then wrong; a wrong sibling hangs
    at depth 1. `mode` scripts failures: "ok", "empty", "down" (answers
    nothing), "raise", "oov", "bad_parents", "too_many", "forget" (loses all
    state at its third call, so every request must resync).
    """

    def __init__(self, num_right: int = 3, segment: str = "code"):
        self.num_right = num_right
        self.segment = segment
        self.mode = "ok"
        self.state: dict[str, list[int]] = {}
        self.finished: list[str] = []
        self.num_resyncs = 0
        self.num_calls = 0

    async def draft(self, queries: Sequence[DraftQuery], finished_ids: Sequence[str]) -> dict[str, DraftReply]:
        return self.draft_sync(queries, finished_ids)

    def draft_sync(self, queries: Sequence[DraftQuery], finished_ids: Sequence[str]) -> dict[str, DraftReply]:
        self.num_calls += 1
        if self.mode == "raise":
            raise RuntimeError("injected drafter bug")
        if self.mode == "down":
            return {}
        if self.mode == "forget" and self.num_calls >= 3:
            self.state.clear()
            self.mode = "ok"
        replies = {q.request_id: self._answer(q) for q in queries}
        for request_id in finished_ids:
            self.finished.append(request_id)
            self.state.pop(request_id, None)
        return replies

    def _answer(self, query: DraftQuery) -> DraftReply:
        tokens = self.state.get(query.request_id, []) + list(query.new_token_ids)
        if len(tokens) != query.num_tokens:
            self.state.pop(query.request_id, None)
            self.num_resyncs += 1
            return DraftReply(DraftTree([], [], ""), needs_resync=True)
        self.state[query.request_id] = tokens
        return DraftReply(self._tree(tokens, query.max_nodes))

    def _tree(self, tokens: list[int], max_nodes: int) -> DraftTree:
        if self.mode == "empty" or max_nodes == 0:
            return DraftTree([], [], self.segment)
        chain, context = [], list(tokens)
        for depth in range(max_nodes - 1):
            right = rule(context)
            chain.append(right if depth < self.num_right else (right + 1) % VOCAB)
            context.append(chain[-1])
        token_ids = [(rule(tokens) + 5) % VOCAB] + chain  # a wrong sibling first, then the chain
        parents = [-1, -1] + list(range(1, len(chain)))
        token_ids, parents = token_ids[:max_nodes], parents[:max_nodes]
        if self.mode == "oov":
            token_ids[-1] = VOCAB + 3
        elif self.mode == "bad_parents":
            parents[0] = len(parents)
        elif self.mode == "too_many":
            token_ids, parents = token_ids + [1] * 50, parents + [-1] * 50
        return DraftTree(token_ids, parents, self.segment)
