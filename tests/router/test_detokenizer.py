"""Incremental detokenization against whole-sequence decoding, on a byte-level BPE and on gemma's tokenizer."""

from __future__ import annotations

import random

import pytest
from transformers import AutoTokenizer

from router.detokenizer import REPLACEMENT_CHAR, IncrementalDetokenizer, TokenTexts
from tests.support.tiny_models import build_tokenizer

TEXTS = [
    "Hello 🙂 world 👨‍👩‍👧 and 🚀🚀!",
    "東京 こんにちは 你好，世界。東京東京",
    "Übermäßig schöne Grüße, café, naïve, Ærø, ½ €100",
    "def add(a, b):\n    return a + b\n\n\tif x  ==  1:\n        print( 'spaced  out' )\n",
    "  leading and trailing spaces   ",
    "𝔘𝔫𝔦𝔠𝔬𝔡𝔢 ✓ ✗ → ∀x∃y",
]


@pytest.fixture(scope="module")
def tiny_tokenizer(tmp_path_factory):
    return build_tokenizer(tmp_path_factory.mktemp("tiny-tokenizer"))


@pytest.fixture(scope="module")
def gemma_tokenizer(default_model_dir):
    return AutoTokenizer.from_pretrained(str(default_model_dir))


@pytest.fixture(params=["tiny", "gemma"])
def tokenizer(request):
    return request.getfixturevalue(f"{request.param}_tokenizer")


def _stream(tokenizer, ids, prompt_ids=(), rng: random.Random | None = None) -> list[str]:
    """Feed `ids` one token at a time (or in random chunks of 1-4); return the deltas, flush included."""
    detok = IncrementalDetokenizer(tokenizer, prompt_ids)
    deltas, i = [], 0
    while i < len(ids):
        n = rng.randint(1, 4) if rng else 1
        deltas.append(detok.add(ids[i:i + n]))
        i += n
    deltas.append(detok.flush())
    return deltas


@pytest.mark.parametrize("text", TEXTS)
def test_incremental_text_equals_whole_decode(tokenizer, text):
    ids = tokenizer(text, add_special_tokens=False).input_ids
    full = tokenizer.decode(ids, skip_special_tokens=True)
    assert full == text  # both tokenizers round-trip these texts
    for seed in (None, 0, 1, 2):
        deltas = _stream(tokenizer, ids, rng=random.Random(seed) if seed is not None else None)
        assert "".join(deltas) == full
        assert not any(REPLACEMENT_CHAR in d for d in deltas), deltas


def test_tiny_tokenizer_really_splits_characters(tiny_tokenizer):
    """Guards the test above: the byte-level BPE must cut emoji and CJK into partial tokens."""
    ids = tiny_tokenizer("🚀 你好", add_special_tokens=False).input_ids
    assert any(REPLACEMENT_CHAR in tiny_tokenizer.decode([t]) for t in ids)


def test_output_after_a_prompt_keeps_its_leading_space(tokenizer):
    prompt_ids = tokenizer("The capital of France is", add_special_tokens=False).input_ids
    out_ids = tokenizer("The capital of France is Paris, 東京 🙂.", add_special_tokens=False).input_ids
    assert out_ids[:len(prompt_ids)] == prompt_ids
    out_ids = out_ids[len(prompt_ids):]
    expected = tokenizer.decode(prompt_ids + out_ids)[len(tokenizer.decode(prompt_ids)):]
    assert expected.startswith(" Paris")
    assert "".join(_stream(tokenizer, out_ids, prompt_ids)) == expected


def test_special_tokens_are_skipped(tokenizer):
    ids = tokenizer("Hi there", add_special_tokens=False).input_ids
    seq = [tokenizer.bos_token_id] + ids + [tokenizer.eos_token_id]
    text = "".join(_stream(tokenizer, seq))
    assert text == "Hi there"


def test_gemma_byte_fallback_waits_for_the_whole_character(gemma_tokenizer):
    byte_ids = gemma_tokenizer.convert_tokens_to_ids(["<0xE2>", "<0x82>", "<0xAC>"])
    detok = IncrementalDetokenizer(gemma_tokenizer, gemma_tokenizer("Price:", add_special_tokens=False).input_ids)
    assert [detok.add([t]) for t in byte_ids] == ["", "", "€"]
    assert detok.flush() == ""


def test_invalid_bytes_are_not_lost(gemma_tokenizer):
    ids = gemma_tokenizer.convert_tokens_to_ids(["<0xFF>", "<0xFF>"]) + gemma_tokenizer("ok").input_ids[1:]
    assert "".join(_stream(gemma_tokenizer, ids)) == gemma_tokenizer.decode(ids, skip_special_tokens=True)
    # a stream ending inside a character still ends with what was decoded
    detok = IncrementalDetokenizer(gemma_tokenizer)
    assert detok.add(gemma_tokenizer.convert_tokens_to_ids(["<0xE2>"])) == ""
    assert detok.flush() == REPLACEMENT_CHAR


def test_work_per_token_is_bounded(tokenizer):
    """Each decode covers a small window, however long the sequence grows."""
    ids = tokenizer(" ".join(TEXTS) * 40, add_special_tokens=False).input_ids
    assert len(ids) > 2000
    lengths = []
    original = tokenizer.decode

    class Counting:
        def decode(self, token_ids, **kwargs):
            lengths.append(len(token_ids))
            return original(token_ids, **kwargs)

    deltas = _stream(Counting(), ids)
    assert "".join(deltas) == tokenizer.decode(ids)
    assert max(lengths) <= 16 and len(lengths) <= 2 * len(ids) + 2


@pytest.mark.parametrize("text", TEXTS)
def test_token_bytes_concatenate_to_the_text(tokenizer, text):
    texts = TokenTexts(tokenizer)
    ids = tokenizer(text, add_special_tokens=False).input_ids
    assert b"".join(bytes(texts.get(t)[1]) for t in ids) == text.encode()
    for t in ids:
        token, raw = texts.get(t)
        assert REPLACEMENT_CHAR not in token
        assert token.startswith("bytes:") or token == bytes(raw).decode()
