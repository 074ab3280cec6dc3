"""The drafter's typed configuration; CLI flags derive from these fields."""

from __future__ import annotations

from dataclasses import dataclass

from common.tls import InternalTlsFields, internal_tls
from common.tracing import TracingFields, settings_of
from drafter.history import ITEM_BYTES

BACKENDS = ("segserve", "suffix")
"""The proposers behind the Draft interface: segment corpora (drafter/planner.py), or SuffixDecoding's suffix trees
(drafter/suffix.py), the peer the benchmark compares with."""


@dataclass
class DrafterConfig(InternalTlsFields, TracingFields):
    host: str = "127.0.0.1"
    """Address the gRPC server binds to (localhost by default)."""
    port: int = 50071
    """gRPC port (0 = any free port)."""
    segments_config: str | None = None
    """Segments TOML file; None = the one shipped for the model. That is drafter/segments/<name>.toml for a
    catalog model that has one, else drafter/segments/default.toml."""
    tokenizer: str | None = None
    """Tokenizer for marker strings: a catalog name (qwen2.5-coder-0.5b-instruct, gemma-3-270m) or a transformers
    model directory; None = the default model."""
    corpus_dir: str | None = None
    """Directory of the corpora's snapshots; None = in memory only. Snapshots (<segment>.corpus.npz +
    snapshot.json) are loaded at start and saved every snapshot_interval_s and at shutdown."""
    max_requests: int = 4096
    """Most requests tracked at once; the least recently queried is dropped (it resyncs later)."""
    max_corpus_keys: int = 256
    """Most corpus keys (DraftQuery.corpus_key: structured outputs' schemas) with a corpus of their own per tenant;
    the least recently used key's corpus is dropped whole past it (drafter/keyed.py)."""
    history_max_key: int = 8
    """Longest suffix of a request's tokens matched against its own history."""
    history_min_key: int = 1
    """Shortest such suffix; shorter matches propose nothing. With adaptive depth (a kind's spec_factor) a one-token
    match drafts one token, as SuffixDecoding's does."""
    history_max_bytes: int = 64 << 20
    """Memory of one request's own-history search array (8 bytes a token: 64 MiB search the latest 4M-8M
    tokens); past it the older half is no longer searched."""
    history_total_bytes: int = 2 << 30
    """Memory of every request's history index together; past it the least recently queried requests are
    dropped (they resync later)."""
    redis_url: str | None = None
    """Redis URL of the shared log of learned segments (a Redis Stream every replica appends to and reads);
    None = a directory log (shared_log_dir)."""
    redis_stream: str = "segserve:drafter:segments"
    """The Redis Stream's key."""
    shared_log_dir: str | None = None
    """Directory of the shared log when there is no redis_url (replicas on one machine or one shared volume);
    None = <corpus_dir>/log, or no sharing when there is no corpus_dir either."""
    log_poll_interval_s: float = 0.2
    """How often a replica applies what the others have published."""
    snapshot_interval_s: float = 60.0
    """How often the corpora (and the log position) are snapshotted to corpus_dir; also on SIGTERM. kill -9
    loses nothing the log holds: a restarted replica replays it from its snapshot's position."""
    redact_corpora: bool = False
    """Redact what the corpora learn. Every learned segment goes through reflow's redaction (e-mail addresses,
    phone numbers and API keys become [EMAIL], [PHONE], [API_KEY]; common/redact.py) before it reaches a corpus,
    the shared log or a snapshot, as `segserve reflow consume --redact` does for the inference logs."""
    replica_name: str = ""
    """This replica's name in the log's records (default: the host name)."""
    device: str = "auto"
    """Device of the draft models: auto (cuda when present, else cpu), cpu, cuda or cuda:N."""
    dtype: str = "auto"
    """Draft models' weights: auto (bfloat16 on cuda, float32 on cpu), float32, bfloat16 or float16."""
    backend: str = "segserve"
    """The proposer: segserve (segment corpora, trees, draft models) or suffix (SuffixDecoding's global and
    per-request suffix trees, built by `make suffix-decoding`; segments, corpora and the shared log are not used)."""
    suffix_max_tree_depth: int = 24
    """Backend suffix: depth of the suffix trees (the longest context matched and the longest draft)."""
    suffix_max_cached_requests: int = 10000
    """Backend suffix: responses kept in the global tree (-1 = no bound). The oldest leaves first."""
    suffix_max_spec_factor: float = 1.0
    """Backend suffix: drafts have at most this times the match length tokens. Plus suffix_max_spec_offset."""
    suffix_max_spec_offset: float = 0.0
    """Backend suffix: tokens a draft may add to the factor times the match length."""
    suffix_min_token_prob: float = 0.1
    """Backend suffix: draft tokens less likely than this are left out. Their frequency share is the estimate."""
    is_suffix_tree_spec: bool = True
    """Backend suffix: trees of several continuations rather than one chain."""

    def __post_init__(self) -> None:
        if not 0 <= self.port < 65536:
            raise ValueError("port must be in 0..65535")
        if self.max_requests <= 0 or self.max_corpus_keys <= 0:
            raise ValueError("max_requests and max_corpus_keys must be > 0")
        if not 1 <= self.history_min_key <= self.history_max_key:
            raise ValueError("history keys need 1 <= history_min_key <= history_max_key")
        if not ITEM_BYTES * (self.history_max_key + 2) <= self.history_max_bytes <= self.history_total_bytes:
            raise ValueError(f"history bytes need {ITEM_BYTES} * (history_max_key + 2) <= history_max_bytes <= "
                             "history_total_bytes")
        if self.log_poll_interval_s <= 0 or self.snapshot_interval_s <= 0:
            raise ValueError("log_poll_interval_s and snapshot_interval_s must be > 0")
        if not (self.device in ("auto", "cpu", "cuda") or self.device.startswith("cuda:")):
            raise ValueError(f"device must be auto, cpu, cuda or cuda:N, got {self.device!r}")
        if self.dtype not in ("auto", "float32", "bfloat16", "float16"):
            raise ValueError(f"dtype must be auto, float32, bfloat16 or float16, got {self.dtype!r}")
        if self.backend not in BACKENDS:
            raise ValueError(f"backend must be one of {', '.join(BACKENDS)}, got {self.backend!r}")
        if self.suffix_max_tree_depth < 1 or not (self.suffix_max_cached_requests > 0
                                                  or self.suffix_max_cached_requests == -1):  # fmt: skip
            raise ValueError("suffix_max_tree_depth must be >= 1 and suffix_max_cached_requests > 0 or -1")
        if not (self.suffix_max_spec_factor >= 0 and self.suffix_max_spec_offset >= 0
                and 0 <= self.suffix_min_token_prob <= 1):  # fmt: skip
            raise ValueError("suffix_max_spec_factor and suffix_max_spec_offset must be >= 0, "
                             "suffix_min_token_prob in [0, 1]")
        internal_tls(self)  # ValueError naming the fields when only some are given
        settings_of(self)  # ValueError naming the field for a bad endpoint or ratio
