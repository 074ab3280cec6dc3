"""A Python client of segserve's public gRPC API (segserve.v1.Generation), for internal services.

In: prompts or chats and sampling parameters; out: small frozen dataclasses (`GenerationResult`,
`StreamEvent`, `TokenizeResult`, `ModelCard`), never protobuf messages. Two forms with the same methods:
`Client` (blocking) and `AsyncClient` (asyncio); each has `generate`, `stream`, `tokenize`, `detokenize` and
`list_models`.

    from segserve.client import Client

    with Client("localhost:8001", api_key="sk-...", timeout_s=60) as client:
        result = client.generate("def add(a, b):", max_tokens=64, temperature=0)
        print(result.text, result.finish_reason, result.usage.completion_tokens)
        for event in client.stream("Once upon a time", max_tokens=64):
            print(event.text, end="", flush=True)
        answer = client.generate("Is water wet?", choice=["yes", "no"])   # or json_schema=, regex=, grammar=

- Structured outputs: one of the keywords `json_schema` (a dict, its JSON text or a pydantic model class),
  `json_object=True`, `regex`, `choice` (a list of strings) or `grammar` (EBNF) constrains every choice.
- API key: sent as the metadata `authorization: Bearer <key>`.
- TLS: `ca_file` (the server's CA; `tls=True` alone trusts the system's roots) and, for mutual TLS,
  `cert_file`/`key_file`.
- Deadlines: `timeout_s` per client, or per call; it bounds the call and all its retries.
- Retries (`RetryPolicy`): UNAVAILABLE and RESOURCE_EXHAUSTED, with exponential backoff and jitter, or after
  the server's `retry-after-ms` when it sends one; a stream only before its first event.
- Errors: every failure raises `SegserveError`, with the gRPC status name (`code`), the server's `message`,
  and for INVALID_ARGUMENT the `field` at fault (`parameters.top_p`).

Imports only grpc, the generated stubs in protos/ and common.tls (for the credentials), never a service.
"""

from segserve.client.aio import AsyncClient
from segserve.client.errors import SegserveError
from segserve.client.results import (
    Choice,
    Details,
    GenerationResult,
    ModelCard,
    PromptTokenLogprob,
    StreamEvent,
    TokenAlternative,
    TokenizeResult,
    TokenLogprob,
    Usage,
)
from segserve.client.retry import RetryPolicy
from segserve.client.sync import Client

__all__ = [
    "AsyncClient", "Choice", "Client", "Details", "GenerationResult", "ModelCard", "PromptTokenLogprob",
    "RetryPolicy", "SegserveError", "StreamEvent", "TokenAlternative", "TokenLogprob", "TokenizeResult", "Usage",
]
