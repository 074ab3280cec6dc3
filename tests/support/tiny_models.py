"""Tiny random causal LMs and a byte-level BPE tokenizer, built locally in seconds.

Nothing is downloaded. The tiny Gemma3 has a short sliding window so that tests
cross it, and a Llama stands for "any transformers causal LM".
"""

from __future__ import annotations

from pathlib import Path

from segserve.bench.random_models import TINY_GEMMA3, save_random

_TRAINING_TEXT = """
The quick brown fox jumps over the lazy dog. def add(a, b):\n    return a + b\n
{"name": "Ada", "age": 36, "city": "London"} Übermäßig schöne Grüße! 東京 こんにちは 🙂
User: what is the capital of France? Assistant: The capital of France is Paris.
for i in range(10):\n    print(i * i)\n``` code fence ``` <think> reasoning </think>
"""

CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}<|end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)
SPECIAL_TOKENS = ["<pad>", "<bos>", "<eos>", "<|end|>"]


def build_tokenizer(out_dir: Path, vocab_size: int = 400, is_bos_added: bool = False):
    """Train a byte-level BPE on a few lines of mixed text and save it as a transformers tokenizer; with
    `is_bos_added` it puts <bos> before every text it tokenizes with special tokens, as gemma's does."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator([_TRAINING_TEXT] * 4, trainer=trainer)
    if is_bos_added:
        bos = ("<bos>", tok.token_to_id("<bos>"))
        tok.post_processor = processors.TemplateProcessing(single="<bos> $A", pair="<bos> $A <bos> $B",
                                                           special_tokens=[bos])
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<bos>", eos_token="<eos>", pad_token="<pad>", chat_template=CHAT_TEMPLATE
    )
    fast.save_pretrained(out_dir)
    return fast


def build_tiny_gemma3(out_dir: Path, seed: int = 0, is_bos_added: bool = False) -> Path:
    """A 4-layer Gemma3 (sliding window 8 on local layers) with random weights, and its tokenizer (adding <bos>
    to what it tokenizes with special tokens when `is_bos_added`)."""
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    tokenizer = build_tokenizer(out_dir, is_bos_added=is_bos_added)
    config = Gemma3TextConfig(**{
        **TINY_GEMMA3, "vocab_size": len(tokenizer), "max_position_embeddings": 512,
        "bos_token_id": tokenizer.bos_token_id, "eos_token_id": tokenizer.eos_token_id,
        "pad_token_id": tokenizer.pad_token_id,
    })
    return save_random(Gemma3ForCausalLM, config, out_dir, seed)


def build_tiny_llama(out_dir: Path, seed: int = 0) -> Path:
    """A 2-layer Llama with grouped-query attention and random weights."""
    from transformers import LlamaConfig, LlamaForCausalLM

    tokenizer = build_tokenizer(out_dir)
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        # Wide init and an untied head give varied, well-separated greedy choices
        # (the default init makes a tiny random model repeat one token).
        initializer_range=0.3,
        tie_word_embeddings=False,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    return save_random(LlamaForCausalLM, config, out_dir, seed)


LLAMA_KIN = ("mistral", "qwen2", "qwen3")
"""Architectures built as Llama is, with a sliding window of 8 keys (Mistral's on every layer, Qwen's on the layers
past the first), Qwen2's biased projections and Qwen3's normed queries and keys."""


def build_tiny_llama_kin(out_dir: Path, architecture: str, seed: int = 0) -> Path:
    """A 2-layer model of one of LLAMA_KIN with grouped-query attention and random weights, and its tokenizer."""
    from transformers import (
        MistralConfig, MistralForCausalLM, Qwen2Config, Qwen2ForCausalLM, Qwen3Config, Qwen3ForCausalLM,
    )

    tokenizer = build_tokenizer(out_dir)
    shared = dict(
        vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=512, initializer_range=0.3, tie_word_embeddings=False,
        sliding_window=8, bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    qwen = dict(use_sliding_window=True, max_window_layers=1)
    model_cls, config = {
        "mistral": lambda: (MistralForCausalLM, MistralConfig(**shared)),
        "qwen2": lambda: (Qwen2ForCausalLM, Qwen2Config(**shared, **qwen)),
        "qwen3": lambda: (Qwen3ForCausalLM, Qwen3Config(**shared, **qwen, head_dim=16)),
    }[architecture]()
    return save_random(model_cls, config, out_dir, seed)


def build_small_vocab_llama(out_dir: Path, vocab_size: int = 40, seed: int = 0) -> Path:
    """A 2-layer Llama over `vocab_size` token ids and no tokenizer: its next-token distributions are
    small enough to estimate from a few thousand draws (speculative sampling tests)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        # Between flat and peaked (perplexity ~3-7): drafts of likely tokens are often accepted,
        # and rejections with real probability mass elsewhere happen too.
        initializer_range=0.5,
        tie_word_embeddings=False,
        bos_token_id=0,
        eos_token_id=None,
        pad_token_id=0,
    )
    out_dir.mkdir(parents=True, exist_ok=True)
    return save_random(LlamaForCausalLM, config, out_dir, seed)
