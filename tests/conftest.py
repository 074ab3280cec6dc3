"""Shared fixtures: tiny random models built once per session, the real default model on demand."""

from __future__ import annotations

import pytest

from tests.support.devices import TEST_DEVICE
from tests.support.tiny_models import build_tiny_gemma3, build_tiny_llama, build_tiny_llama_kin


@pytest.fixture(scope="session")
def tiny_gemma3_dir(tmp_path_factory):
    return build_tiny_gemma3(tmp_path_factory.mktemp("tiny-gemma3"))


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory):
    return build_tiny_llama(tmp_path_factory.mktemp("tiny-llama"))


@pytest.fixture(scope="session")
def tiny_mistral_dir(tmp_path_factory):
    return build_tiny_llama_kin(tmp_path_factory.mktemp("tiny-mistral"), "mistral")


@pytest.fixture(scope="session")
def tiny_qwen2_dir(tmp_path_factory):
    return build_tiny_llama_kin(tmp_path_factory.mktemp("tiny-qwen2"), "qwen2")


@pytest.fixture(scope="session")
def tiny_qwen3_dir(tmp_path_factory):
    return build_tiny_llama_kin(tmp_path_factory.mktemp("tiny-qwen3"), "qwen3")


@pytest.fixture(scope="session")
def default_model_dir():
    """The real gemma-3-270m, converted once into the cache (about a minute the first time)."""
    from common.checkpoint import prepare_default_model

    return prepare_default_model()


def pytest_configure(config):
    if TEST_DEVICE not in ("cpu", "cuda"):
        raise pytest.UsageError(f"SEGSERVE_TEST_DEVICE must be cpu or cuda, not {TEST_DEVICE!r}")
    if TEST_DEVICE == "cuda":
        import torch

        if not torch.cuda.is_available():
            raise pytest.UsageError("SEGSERVE_TEST_DEVICE=cuda, but torch sees no GPU")
