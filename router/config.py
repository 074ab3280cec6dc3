"""The router's typed configuration; CLI flags derive from these fields (api_keys excepted: a secret)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path

from common.tls import InternalTlsFields, TlsFiles, internal_tls
from common.tracing import TracingFields, settings_of
from router.tool_parsers import PARSERS


@dataclass
class RouterConfig(InternalTlsFields, TracingFields):
    model: str | None = None
    """Model the tokenizer (and chat template) is loaded from: a catalog name
    (qwen2.5-coder-0.5b-instruct, gemma-3-270m) or a transformers model directory; None = the default model."""
    served_model_name: str | None = None
    """Model name clients send; defaults to the scheduler's (the worker's) name."""
    scheduler_address: str = "127.0.0.1:50051"
    """gRPC address of the scheduler; several comma-separated, or dns:///name:port for every address a name resolves
    to (re-resolved every 10 s): requests are balanced over them by load, with prompt-prefix affinity."""
    host: str = "127.0.0.1"
    """Bind address of HTTP and of the public gRPC API."""
    port: int = 8000
    """HTTP port (0 = any free port, which the router binds and reports: common/ports.py)."""
    is_grpc_api: bool = True
    """Serve the public gRPC API (segserve.v1.Generation, with health and reflection) on grpc_port."""
    grpc_port: int = 8001
    """Port of the public gRPC API, on the HTTP bind address (0 = any free port, bound as `port`'s)."""
    grpc_max_message_bytes: int = 4 * 1024 * 1024
    """Largest gRPC message received or sent by the public gRPC API; a larger one is RESOURCE_EXHAUSTED."""
    grpc_keepalive_time_s: float = 30.0
    """Idle seconds before the gRPC API pings a connection (load balancers then keep long streams open)."""
    grpc_keepalive_timeout_s: float = 10.0
    """Seconds before a connection with an unanswered keep-alive ping is closed."""
    default_max_tokens: int = 256
    """max_tokens when a request gives none (bounded by the context left)."""
    keepalive_interval_s: float = 10.0
    """Idle seconds before a stream gets an SSE keep-alive comment (so proxies keep it open)."""
    request_timeout_s: float = 600.0
    """Deadline of one request from arrival; past it the stream ends with an error event. 0 = none."""
    scheduler_wait_s: float = 300.0
    """Seconds start-up waits for the scheduler to answer GetInfo."""
    scheduler_retry_s: float = 30.0
    """Seconds a new request is retried while no scheduler can take it; 0 = fail at once. Unreachable, shutting
    down or without a live worker, a scheduler answers `unavailable`; the request is tried again with back-off
    (a scheduler or worker restarting takes it then), and fails with 503 / UNAVAILABLE once this is spent."""
    drain_timeout_s: float = 10.0
    """Seconds the requests under way get to finish after SIGTERM. Meanwhile /ready answers 503, the gRPC API's
    health NOT_SERVING, and new requests are refused (HTTP 503, gRPC UNAVAILABLE); a pod's
    terminationGracePeriodSeconds must cover it."""
    api_keys: list[str] = field(default_factory=list, metadata={"env_only": True})  # segserve.flags.ENV_ONLY
    """API keys; none = no auth. Clients send one as `Authorization: Bearer <key>` on /v1 and /v2 routes and on
    the gRPC API. A secret, so never a flag (flags show in `ps`): SEGSERVE_API_KEYS (comma-separated) sets it, and
    api_key_file's keys are added to it."""
    api_key_file: str = ""
    """File of API keys, one a line (blank lines and '#' comments skipped), added to api_keys at start-up; a missing
    or unreadable file, or one without a key, stops the start-up. Empty = none."""
    tenant_header: str = ""
    """With no api_keys: a request header (e.g. X-Segserve-Tenant) whose value is the request's tenant, trusted as
    sent (put the router behind a proxy that sets it). Empty = every request is the default tenant "". With keys the
    tenant is always the key's id (the first 16 hex of its SHA-256) and the header is ignored. The drafter learns
    a request's segments only for its tenant."""
    metrics_require_key: bool = False
    """/metrics and /status want `Authorization: Bearer <one of api_keys>` too (off: Prometheus scrapes freely)."""
    tls_cert_file: str = ""
    """PEM certificate (chain) of the router's public ports; with tls_key_file, HTTP and the public gRPC API are
    served over TLS only (both empty = plaintext)."""
    tls_key_file: str = ""
    """PEM private key of tls_cert_file."""
    max_request_body_bytes: int = 4 * 1024 * 1024
    """Largest request body accepted; a larger one gets 413 before it is parsed."""
    reflow_queue_url: str = ""
    """Record every inference request for data reflow into this queue (sqlite:///PATH or
    redis://HOST:PORT/DB[#STREAM]; `segserve reflow consume` drains it); empty = no recording."""
    reflow_spill_dir: str = "reflow/spill"
    """Where chunks spill while the reflow queue refuses writes."""
    is_strip_segment_markers: bool = True
    """Leave segment markers out of the text users see. These are the markers of a model fine-tuned to emit them
    (`segserve finetune`; the tokenizer's config lists them). They stay tokens: counted in usage, returned as token
    ids and logprobs, and used by the drafter to find segments."""
    tool_call_parser: str = ""
    """Format tool calls are read in; empty = the catalog model's own. hermes, llama3_json, mistral, pythonic or
    qwen2_5_coder: under tool_choice "auto", a chat choice's text is read as tool calls in the format the model
    was trained on. Empty takes the parser its catalog entry names (segserve-model.json); a model with none
    refuses "auto" (400)."""

    def __post_init__(self) -> None:
        if self.tool_call_parser and self.tool_call_parser not in PARSERS:
            raise ValueError(f"tool_call_parser must be one of {', '.join(PARSERS)} (got {self.tool_call_parser!r})")
        if not 0 <= self.port < 65536:
            raise ValueError("port must be in 0..65535")
        if not 0 <= self.grpc_port < 65536:
            raise ValueError("grpc_port must be in 0..65535")
        if self.grpc_max_message_bytes <= 0:
            raise ValueError("grpc_max_message_bytes must be > 0")
        if self.grpc_keepalive_time_s <= 0 or self.grpc_keepalive_timeout_s <= 0:
            raise ValueError("grpc_keepalive_time_s and grpc_keepalive_timeout_s must be > 0")
        if self.default_max_tokens <= 0:
            raise ValueError("default_max_tokens must be > 0")
        if self.keepalive_interval_s <= 0:
            raise ValueError("keepalive_interval_s must be > 0")
        if self.request_timeout_s < 0:
            raise ValueError("request_timeout_s must be >= 0 (0 = no deadline)")
        if self.scheduler_wait_s <= 0:
            raise ValueError("scheduler_wait_s must be > 0")
        if not 0 <= self.scheduler_retry_s < math.inf:
            raise ValueError("scheduler_retry_s must be finite and >= 0")
        if self.drain_timeout_s < 0:
            raise ValueError("drain_timeout_s must be >= 0")
        keys = [*self.api_keys, *(read_api_key_file(self.api_key_file) if self.api_key_file else [])]
        self.api_keys = list(dict.fromkeys(key.strip() for key in keys if key.strip()))
        if any(char.isspace() or char == "," for key in self.api_keys for char in key):
            raise ValueError("api_keys: a key holds no whitespace or comma")
        if self.metrics_require_key and not self.api_keys:
            raise ValueError("metrics_require_key needs api_keys (SEGSERVE_API_KEYS or api_key_file)")
        if self.tenant_header and not all(c.isalnum() or c == "-" for c in self.tenant_header):
            raise ValueError("tenant_header must be a header name (letters, digits and -)")
        if bool(self.tls_cert_file) != bool(self.tls_key_file):
            raise ValueError("tls_cert_file and tls_key_file are given together or not at all")
        internal_tls(self)  # ValueError naming the fields when only some are given
        settings_of(self)  # ValueError naming the field for a bad endpoint or ratio
        if self.max_request_body_bytes <= 0:
            raise ValueError("max_request_body_bytes must be > 0")

    @property
    def tls(self) -> TlsFiles | None:
        """HTTPS's certificate and key; None = plaintext."""
        return TlsFiles(self.tls_cert_file, self.tls_key_file) if self.tls_cert_file else None


def read_api_key_file(path: str) -> list[str]:
    """The keys of an API key file: one a line, blank lines and '#' comments skipped; ValueError naming the file
    when it cannot be read or holds no key."""
    try:
        text = Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
        raise ValueError(f"api_key_file {path!r} cannot be read: {reason}") from None
    keys = [line.partition("#")[0].strip() for line in text.splitlines()]
    keys = [key for key in keys if key]
    if not keys:
        raise ValueError(f"api_key_file {path!r} holds no key")
    return keys
