"""Fuzz the router's HTTP API from its own OpenAPI document (schemathesis), end to end.

The router runs under uvicorn on a free port in front of the fake scheduler, so
streamed answers are real SSE. schemathesis takes the app's OpenAPI document and,
for every operation, sends what the schema describes (positive) and what it
forbids (negative: wrong types, missing fields, out-of-range numbers, odd
unicode), plus its coverage phase's boundary values. Every answer must be below
500, match the documented status codes, content types and response schemas, and
arrive in full within CALL_TIMEOUT_S: a stream that hangs fails the test instead
of stalling CI (the router's keep-alive interval is longer than that timeout, so
comments cannot keep a stuck stream alive).

The document is built at import (schemathesis' pytest integration needs it to
parametrize), from an app made by the same `create_app` with stand-ins for the
scheduler and tokenizer; `test_fuzzed_document_is_the_served_one` checks that it
is the document the live router serves.

Bound: MAX_EXAMPLES generated examples per operation and generation mode, on top
of the coverage phase's deterministic cases; about 30 s on a 2-core machine, and
pytest-timeout stops any one operation at OPERATION_TIMEOUT_S whatever happens.
"""

from __future__ import annotations

import time

import httpx
import hypothesis
import pytest
import schemathesis
from schemathesis.specs.openapi.checks import positive_data_acceptance

from router.app import create_app
from router.config import RouterConfig
from protos.segserve.v1.info import WorkerInfo

# The fake scheduler (serving MODEL) and the tokenizer of test_router.py.
from tests.support.router_server import serve_router
from tests.router.test_server import MODEL, _free_port, scheduler, tokenizer  # noqa: F401

MAX_EXAMPLES = 25
CALL_TIMEOUT_S = 5.0
OPERATION_TIMEOUT_S = 60


@pytest.fixture(scope="module")
def fuzz_router_url(scheduler, tokenizer):  # noqa: F811
    _, grpc_port = scheduler
    config = RouterConfig(scheduler_address=f"127.0.0.1:{grpc_port}", port=_free_port(),
                          keepalive_interval_s=3 * CALL_TIMEOUT_S, scheduler_wait_s=10)
    with serve_router(config, tokenizer, log_level="error") as url:
        yield url


def _openapi_document() -> dict:
    """The app's OpenAPI document; routes do not touch the scheduler or the tokenizer to describe themselves."""
    model_info = WorkerInfo(model_name=MODEL, num_kv_blocks=64, block_size=16, max_model_len=256, vocab_size=1,
                            eos_token_ids=(0,))
    return create_app(RouterConfig(), client=None, tokenizer=None, model_info=model_info).openapi()


schema = schemathesis.openapi.from_dict(_openapi_document())


def test_fuzzed_document_is_the_served_one(fuzz_router_url):
    served = httpx.get(f"{fuzz_router_url}/openapi.json", timeout=CALL_TIMEOUT_S).json()
    assert served == _openapi_document()


@pytest.mark.timeout(OPERATION_TIMEOUT_S)
@schema.parametrize()
@hypothesis.settings(max_examples=MAX_EXAMPLES, deadline=CALL_TIMEOUT_S * 1000, derandomize=True,
                     suppress_health_check=list(hypothesis.HealthCheck))
def test_api_never_fails_or_hangs(case, fuzz_router_url):
    """Every built-in check but positive_data_acceptance: a valid body may rightly get 400 for limits
    JSON Schema cannot state (the prompt's tokens plus max_tokens within the context, top_k below the
    vocabulary), and integers are strict (5.0 is an integer to JSON Schema, not to us or to OpenAI)."""
    started_s = time.monotonic()
    response = case.call_and_validate(base_url=fuzz_router_url, timeout=CALL_TIMEOUT_S,
                                      excluded_checks=[positive_data_acceptance])
    elapsed_s = time.monotonic() - started_s
    assert response.status_code < 500, response.text
    assert elapsed_s < CALL_TIMEOUT_S, f"{case.method} {case.formatted_path} took {elapsed_s:.1f} s"
