"""Corpora per corpus key: each structured output's schema (or tool) gets lookup corpora of its own.

In: a request's corpus key (DraftQuery.corpus_key) and tenant. Out: the key's corpora it drafts from
and the one it learns into, scoped as segment kinds are (drafter/planner.py): the default tenant ""
learns into the shared scope, any other tenant into its own, and a request draws from its tenant's
corpus and the shared one, never from another tenant's.

A keyed request's whole output is one segment of the `schema` kind (drafter/segments.py), learned
when the request ends, after KEY_START: a keyed corpus is asked about KEY_START and the output's
tail, never the prompt, so the start of an output matches the start of the learned ones (the
request's own history still sees the prompt).

Bounds: each scope (a tenant, or the shared "") keeps at most `max_keys` keys, the least recently
used (drafted from or learned into) dropped whole past it. Each key's corpus has the schema kind's
corpus limits, and the shared scope's corpora together, like all the tenants' together, stay within
its `max_bytes`: past it the least recently used go first (the one learning now is kept). So the
keyed corpora hold at most about twice the schema kind's budget, however many keys and tenants.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterator, Mapping, Sequence

from drafter.corpus import LookupCorpus
from drafter.segments import CorpusLimits

KEY_START = -1
"""What a keyed corpus learns before every output: no vocabulary has it, and a continuation never holds it."""
MAX_KEY_CHARS = 64
"""Longest corpus key kept (its hex names a snapshot file); a longer one is ignored: the request has no key."""
Scope = tuple[str, str]
"""(tenant, corpus key); tenant "" = the shared scope."""


def kept_key(corpus_key: str) -> str:
    """The key a request is drafted and learned under: "" (none) for one past MAX_KEY_CHARS."""
    return corpus_key if len(corpus_key) <= MAX_KEY_CHARS else ""


def output_context(tokens: Sequence[int], num_prompt_tokens: int, max_key: int) -> list[int]:
    """What a keyed corpus is asked about: KEY_START, then the output's last max_key tokens (all while shorter)."""
    return [KEY_START, *tokens[max(num_prompt_tokens, len(tokens) - max_key):]]


class KeyedCorpora:
    """(tenant, corpus key) -> LookupCorpus, bounded in keys per tenant and in bytes (see the module docstring)."""

    def __init__(self, limits: CorpusLimits, max_keys: int = 256, corpora: Mapping[Scope, LookupCorpus] | None = None):
        if max_keys <= 0:
            raise ValueError("max_keys must be > 0")
        self.limits = limits
        self.max_keys = max_keys
        self._recency: OrderedDict[Scope, LookupCorpus] = OrderedDict()
        """Every corpus, least recently used first."""
        self._scopes: dict[str, OrderedDict[str, LookupCorpus]] = {}
        """Tenant -> its keys' corpora, least recently used first."""
        self.num_dropped = 0
        """Corpora dropped for either bound."""
        for (tenant, key), corpus in (corpora or {}).items():
            self._use(tenant, key, corpus)
            self._bound(tenant, key)

    def __len__(self) -> int:
        return len(self._recency)

    def items(self) -> Iterator[tuple[Scope, LookupCorpus]]:
        """Every ((tenant, key), corpus), least recently used first."""
        return iter(list(self._recency.items()))

    def get(self, tenant: str, corpus_key: str) -> LookupCorpus | None:
        """A scope's corpus, without counting as a use."""
        return self._recency.get((tenant, corpus_key))

    def lookup(self, tenant: str, corpus_key: str) -> list[LookupCorpus]:
        """The corpora a request of `tenant` drafts from for the key: the shared one, then the tenant's (those held)."""
        found = []
        for scope in ("", tenant) if tenant else ("",):
            corpus = self._recency.get((scope, corpus_key))
            if corpus is not None:
                self._use(scope, corpus_key, corpus)
                found.append(corpus)
        return found

    def for_learning(self, tenant: str, corpus_key: str) -> LookupCorpus:
        """The corpus a request of `tenant` learns into for the key (made at its first use); then both bounds hold."""
        corpus = self._recency.get((tenant, corpus_key))
        if corpus is None:
            corpus = LookupCorpus(self.limits)
        self._use(tenant, corpus_key, corpus)
        self._bound(tenant, corpus_key)
        return corpus

    def sizes(self) -> tuple[int, int]:
        """Learned tokens and bytes of every keyed corpus together."""
        corpora = list(self._recency.values())
        return sum(c.num_entries for c in corpora), sum(c.num_bytes for c in corpora)

    def _use(self, tenant: str, corpus_key: str, corpus: LookupCorpus) -> None:
        self._recency[(tenant, corpus_key)] = corpus
        self._recency.move_to_end((tenant, corpus_key))
        scope = self._scopes.setdefault(tenant, OrderedDict())
        scope[corpus_key] = corpus
        scope.move_to_end(corpus_key)

    def _bound(self, tenant: str, corpus_key: str) -> None:
        """Keep the tenant's keys within max_keys, then its side (shared, or all tenants) within max_bytes;
        (tenant, corpus_key) is kept."""
        scope = self._scopes[tenant]
        while len(scope) > self.max_keys:
            self._drop(tenant, next(iter(scope)))
        side = [(scope, corpus) for scope, corpus in self._recency.items() if bool(scope[0]) == bool(tenant)]
        total = sum(corpus.num_bytes for _, corpus in side)
        for scope, corpus in side:
            if total <= self.limits.max_bytes:
                break
            if scope != (tenant, corpus_key):
                total -= corpus.num_bytes
                self._drop(*scope)

    def _drop(self, tenant: str, corpus_key: str) -> None:
        del self._recency[(tenant, corpus_key)]
        scope = self._scopes[tenant]
        del scope[corpus_key]
        if not scope:
            del self._scopes[tenant]
        self.num_dropped += 1
