"""The default model served as a user serves it, `segserve serve --model qwen2.5-coder-0.5b-instruct`, once for
the end-to-end tests that need a model that answers: its README examples, its tool calls, agent frameworks as
clients."""

from __future__ import annotations

import pytest

from common.catalog import DEFAULT_MODEL
from common.ports import free_port
from tests.e2e.test_serve_supervision import Serve


@pytest.fixture(scope="package")
def default_model_serve(instruct_model_dir, tmp_path_factory):
    """The running Serve (converted into the cache beforehand by `instruct_model_dir`): its self-check passed, the
    drafter speculating; prompts of tools take 512-token prefill chunks. Ports of its own, none of the defaults
    (the other tests' stacks start while it runs)."""
    serve = Serve(DEFAULT_MODEL, tmp_path_factory.mktemp("default-model-logs"), "--max-num-batched-tokens", "512",
                  "--worker-port", str(free_port()), "--drafter-port", "0")
    try:
        serve.wait_ready(timeout_s=600)
        assert serve.client()[1] == DEFAULT_MODEL
        yield serve
    finally:
        serve.stop()
