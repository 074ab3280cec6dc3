"""Which tenant a request belongs to: set at the edge (HTTP's RequestGuard, the gRPC API's key check), read where
the router sends the GenerateRequest (scheduler_client.py), so every endpoint carries it without passing it along.

- With API keys configured, the tenant is a stable non-secret id of the key the request authenticated with: the
  first 16 hex digits of its SHA-256 (the key itself never leaves the router).
- With no keys, every request is the default tenant "" unless the router trusts a tenant header
  (`tenant_header`, off by default): then its value is the tenant (a plain id, else 400); no header = "".

The drafter learns a request's segments only into its tenant's corpora (drafter/planner.py), so one tenant's text
is never proposed to another.
"""

from __future__ import annotations

import hashlib
import hmac
from contextvars import ContextVar

from protos.segserve.v1.generate import MAX_TENANT_CHARS, is_valid_tenant

current_tenant: ContextVar[str] = ContextVar("segserve_tenant", default="")
"""The tenant of the request being served in this context ("" = the default tenant)."""


class InvalidTenant(ValueError):
    """A trusted tenant header holds something that is not a plain tenant id."""


def tenant_of_key(key: bytes) -> str:
    """A key's tenant id: stable across restarts and replicas, and not the key."""
    return hashlib.sha256(key).hexdigest()[:16]


def matching_key(authorization: bytes, api_keys: list[bytes]) -> bytes | None:
    """The key of an `Authorization: Bearer <key>` header (HTTP) or metadata value (gRPC) if it is one of api_keys."""
    scheme, _, key = authorization.partition(b" ")
    if scheme.lower() != b"bearer":
        return None
    key = key.strip()
    matches = [k for k in api_keys if hmac.compare_digest(key, k)]  # every key compared: no early exit
    return matches[0] if matches else None


def tenant_for(authorization: bytes, api_keys: list[bytes], header_value: bytes | None) -> str:
    """The tenant of an authorized request: its key's id with keys configured, else the trusted header's value
    (None = no trusted header, or none sent) or "". Raises InvalidTenant for a header value that is not a plain id."""
    if api_keys:
        key = matching_key(authorization, api_keys)
        return tenant_of_key(key) if key is not None else ""
    if not header_value:
        return ""
    tenant = header_value.decode("latin-1").strip()
    if not is_valid_tenant(tenant):
        raise InvalidTenant(f"The tenant header must be at most {MAX_TENANT_CHARS} characters of A-Z a-z 0-9 . _ : -")
    return tenant
