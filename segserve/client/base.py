"""What the blocking and the asyncio client share: settings, credentials, metadata, deadlines and requests."""

from __future__ import annotations

import json
import random
import time
from collections.abc import Iterable, Mapping, Sequence

import grpc

from protos.segserve.v1 import generation_pb2 as pb
from segserve.client.errors import SegserveError
from segserve.client.retry import RetryPolicy
from common.tls import channel_credentials

DEFAULT_TARGET = "localhost:8001"

ChatMessages = Iterable[Mapping[str, str] | pb.ChatMessage]
"""A chat: messages as {"role": ..., "content": ..., "name": ...} (name optional), as OpenAI's API takes them."""
STRUCTURED_KINDS = tuple(pb.GenerationStructuredOutput.DESCRIPTOR.fields_by_name)
"""The keywords of a structured output, one per call: json_schema, json_object, regex, choice, grammar."""


class ClientBase:
    """Settings of one client of segserve.v1.Generation; see Client for what each one means."""

    def __init__(self, target: str = DEFAULT_TARGET, *, api_key: str | None = None, timeout_s: float | None = None,
                 retry: RetryPolicy | None = None, tls: bool = False, ca_file: str | None = None,
                 cert_file: str | None = None, key_file: str | None = None, server_name: str | None = None,
                 metadata: Sequence[tuple[str, str]] = (), options: Sequence[tuple[str, int | str]] = ()) -> None:
        if timeout_s is not None and timeout_s <= 0:
            raise ValueError("timeout_s must be > 0 (or None: no deadline)")
        self.target = target
        self.timeout_s = timeout_s
        self.retry = retry or RetryPolicy()
        auth = (("authorization", f"Bearer {api_key}"),) if api_key else ()
        self.metadata: tuple[tuple[str, str], ...] = (*metadata, *auth)
        self.is_tls = tls or bool(ca_file or cert_file or key_file)
        # Files are read (and checked: a clear ValueError naming a bad one) here, not at the first call.
        self._credentials = channel_credentials(ca_file, cert_file, key_file) if self.is_tls else None
        name_override = [("grpc.ssl_target_name_override", server_name)] if server_name and self.is_tls else []
        self._options = [*options, *name_override]
        self._rng = random.Random()

    def _deadline(self, timeout_s: float | None) -> float | None:
        """The monotonic time a call (all its attempts) must end by; None = no deadline."""
        timeout_s = self.timeout_s if timeout_s is None else timeout_s
        if timeout_s is not None and timeout_s <= 0:
            raise ValueError("timeout_s must be > 0 (or None: the client's default)")
        return None if timeout_s is None else time.monotonic() + timeout_s

    @staticmethod
    def _remaining_s(deadline: float | None) -> float | None:
        return None if deadline is None else max(deadline - time.monotonic(), 0.0)

    def _retry_delay_s(self, error: SegserveError, num_attempts: int, deadline: float | None) -> float | None:
        """The wait before the next attempt, None to give up (then `error` carries the number of attempts)."""
        delay = self.retry.next_delay_s(error, num_attempts, self._remaining_s(deadline), self._rng)
        if delay is None:
            error.num_attempts = num_attempts
        return delay


def generation_request(prompt: str | None, messages: ChatMessages | None, model: str, request_id: str,
                       session_id: str, parameters: dict) -> pb.GenerationRequest:
    """A GenerationRequest; which of prompt and messages may be set is the server's to check."""
    return pb.GenerationRequest(model=model, prompt=prompt or "", messages=chat_messages(messages),
                                parameters=generation_parameters(parameters), request_id=request_id,
                                session_id=session_id)


def tokenize_request(text: str | None, messages: ChatMessages | None, model: str) -> pb.TokenizeRequest:
    return pb.TokenizeRequest(model=model, text=text or "", messages=chat_messages(messages))


def chat_messages(messages: ChatMessages | None) -> list[pb.ChatMessage]:
    if messages is None:
        return []
    chat = []
    for index, message in enumerate(messages):
        if isinstance(message, pb.ChatMessage):
            chat.append(message)
            continue
        try:
            chat.append(pb.ChatMessage(**message))
        except (TypeError, ValueError) as exc:
            raise _invalid(f"messages[{index}]", exc) from None
    return chat


def generation_parameters(parameters: dict) -> pb.GenerationParameters:
    """GenerationParameters from keyword arguments named as its fields (max_tokens=64, temperature=0, stop=[...],
    logit_bias={id: bias}, ...), and at most one structured-output keyword (json_schema=..., regex=...: see
    structured_output). An unknown name is a TypeError (a bug in the caller); a value the field cannot hold (a
    negative max_tokens, a string for a number) is INVALID_ARGUMENT naming `parameters.<name>`, as the server
    names the values it refuses."""
    known = pb.GenerationParameters.DESCRIPTOR.fields_by_name
    message = pb.GenerationParameters()
    for name, value in parameters.items():
        if name in STRUCTURED_KINDS:
            continue
        if name not in known:
            raise TypeError(f"unknown generation parameter {name!r} (GenerationParameters has: {', '.join(known)}; "
                            f"a structured output: {', '.join(STRUCTURED_KINDS)})")
        if value is None:  # absent: the server's default
            continue
        try:
            message.MergeFrom(pb.GenerationParameters(**{name: value}))
        except (TypeError, ValueError) as exc:
            raise _invalid(f"parameters.{name}", exc) from None
    structured = structured_output({name: parameters[name] for name in STRUCTURED_KINDS if name in parameters})
    if structured is not None:
        if message.HasField("structured_output"):
            raise _invalid("parameters.structured_output", ValueError(
                f"is given twice: as structured_output and as {structured.WhichOneof('kind')}"))
        message.structured_output.CopyFrom(structured)
    return message


def structured_output(kinds: Mapping[str, object]) -> pb.GenerationStructuredOutput | None:
    """The structured output of the keywords json_schema (a dict, its JSON text, or a pydantic model class),
    json_object (True), regex, choice (a list of strings), grammar (EBNF, root rule `root`) and structural_tag
    (a dict or its JSON text); None when none is given (None and json_object=False are not). More than one, or a
    value of the wrong type, is INVALID_ARGUMENT naming the field; whether the spec compiles is the server's to
    say."""
    given = {name: value for name, value in kinds.items() if value is not None and value is not False}
    if not given:
        return None
    if len(given) > 1:
        raise _invalid("parameters.structured_output", ValueError(
            f"takes one of {', '.join(STRUCTURED_KINDS)} (got {', '.join(given)})"))
    ((kind, value),) = given.items()
    try:
        if kind == "json_schema":
            return pb.GenerationStructuredOutput(json_schema=schema_text(value))
        if kind == "structural_tag" and not isinstance(value, str):
            return pb.GenerationStructuredOutput(structural_tag=json.dumps(value))
        if kind == "choice":
            if isinstance(value, str):
                raise TypeError("takes a list of strings, not one string")
            return pb.GenerationStructuredOutput(choice=pb.GenerationStructuredOutput.Choices(choices=value))
        return pb.GenerationStructuredOutput(**{kind: value})
    except (TypeError, ValueError) as exc:
        raise _invalid(f"parameters.structured_output.{kind}", exc) from None


def schema_text(schema: object) -> str:
    """A JSON schema as JSON text, from its text, a mapping, or a pydantic model class (its model_json_schema(),
    called without importing pydantic)."""
    if isinstance(schema, str):
        return schema
    if callable(getattr(schema, "model_json_schema", None)):
        schema = schema.model_json_schema()
    if not isinstance(schema, Mapping):
        raise TypeError(f"must be a JSON schema: a dict, its JSON text or a pydantic model class "
                        f"(got {type(schema).__name__})")
    return json.dumps(schema, ensure_ascii=False)


def _invalid(field: str, exc: Exception) -> SegserveError:
    return SegserveError("INVALID_ARGUMENT", f"`{field}` cannot be sent: {exc}", field=field, num_attempts=0)


def channel_of(client: ClientBase, module) -> grpc.Channel | grpc.aio.Channel:
    """A channel to the client's target from `module` (grpc or grpc.aio), with TLS when the client has it."""
    if client._credentials is None:
        return module.insecure_channel(client.target, options=client._options)
    return module.secure_channel(client.target, client._credentials, options=client._options)
