"""Shared fixtures: tiny random models built once per session, the real catalog models on demand."""

from __future__ import annotations

import ctypes
import ctypes.util
import gc

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
    """The light real model, gemma-3-270m (common.catalog.LIGHT_MODEL), converted once into the cache (about a
    minute the first time). Not the catalog's DEFAULT_MODEL, which `segserve serve` serves without --model:
    tests want the lighter one."""
    from common.catalog import LIGHT_MODEL
    from common.checkpoint import prepare_model

    return prepare_model(LIGHT_MODEL)


@pytest.fixture(scope="session")
def instruct_model_dir():
    """The catalog's DEFAULT_MODEL, qwen2.5-coder-0.5b-instruct, converted once into the cache (about two minutes
    and 2.5 GB the first time): for tests of chat and tool calls that need an instruction-tuned model."""
    from common.catalog import DEFAULT_MODEL
    from common.checkpoint import prepare_model

    return prepare_model(DEFAULT_MODEL)


def pytest_configure(config):
    if TEST_DEVICE not in ("cpu", "cuda"):
        raise pytest.UsageError(f"SEGSERVE_TEST_DEVICE must be cpu or cuda, not {TEST_DEVICE!r}")
    from worker.loading import keep_compiled_code_per_isa

    keep_compiled_code_per_isa()  # before any test compiles: a run under ATEN_CPU_CAPABILITY=avx2 keeps its own
    if TEST_DEVICE == "cuda":
        import torch

        if not torch.cuda.is_available():
            raise pytest.UsageError("SEGSERVE_TEST_DEVICE=cuda, but torch sees no GPU")


_LIBC = ctypes.CDLL(ctypes.util.find_library("c"))


@pytest.fixture(autouse=True, scope="module")
def _give_freed_memory_back():
    """After each module, its models gone: collect what cycles hold and give the heap's free pages back to the
    kernel (glibc's malloc_trim). glibc keeps what it freed in its heap, and after a large block is freed it serves
    blocks up to 32 MiB from there too, so without this the test process kept each module's peak and grew to 8 GB
    resident over the suite."""
    yield
    gc.collect()
    if hasattr(_LIBC, "malloc_trim"):  # glibc only
        _LIBC.malloc_trim(0)

