"""Incremental detokenization: token ids in, text deltas out.

Decoding token by token is wrong for tokenizers whose tokens only form text
together: byte-fallback tokens (gemma's `<0xE2>`), byte-level BPE tokens that
split a UTF-8 character, and sentencepiece's leading-space marker, which the
decoder treats differently at the start of a text. So, as vLLM and TGI do, the
detokenizer decodes a short window (a few already-emitted context tokens plus the
new ones) and emits the part of the window's text past what it already emitted.
A trailing U+FFFD means an unfinished character: it is held back until the
character completes (or the stream ends). Work per token is bounded by the
window, never by the length of the sequence.

Segment markers (tokens a fine-tuned model emits around code, JSON, ...; `segserve segments annotate`
records them in the tokenizer's config under SEGMENT_MARKERS_KEY) can be hidden: their ids never enter the
window, so their text never reaches the user, while they stay tokens of the sequence (counted in usage,
seen by the drafter's segment tracker).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence

REPLACEMENT_CHAR = "\ufffd"
_BYTE_FALLBACK_TOKEN = re.compile(r"^<0x([0-9A-Fa-f]{2})>$")
SEGMENT_MARKERS_KEY = "segment_markers"  # segserve.annotate.MARKERS_KEY (a service imports no segserve module)


def segment_marker_ids(tokenizer) -> frozenset[int]:
    """The ids of the segment markers the tokenizer's config records (none for most tokenizers)."""
    markers = getattr(tokenizer, "init_kwargs", {}).get(SEGMENT_MARKERS_KEY) or []
    ids = (tokenizer.convert_tokens_to_ids(marker) for marker in markers)
    return frozenset(i for i in ids if isinstance(i, int) and i != tokenizer.unk_token_id)


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte-level alphabet: every byte maps to one printable character."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
    printable += list(range(ord("®"), ord("ÿ") + 1))
    codes, extra = list(printable), 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            codes.append(256 + extra)
            extra += 1
    return {b: chr(c) for b, c in zip(printable, codes)}


_BYTE_LEVEL_DECODE = {ch: b for b, ch in _bytes_to_unicode().items()}


class IncrementalDetokenizer:
    """Turns a growing token sequence into text deltas whose concatenation is the decoded text.

    `prompt_token_ids` gives the first tokens context (their text is never emitted),
    so that e.g. a leading space of the first output token survives. `hidden_token_ids`
    (segment markers) are left out of the text.
    """

    def __init__(
        self,
        tokenizer,
        prompt_token_ids: Sequence[int] = (),
        skip_special_tokens: bool = True,
        num_context_tokens: int = 5,
        max_window_tokens: int = 64,
        hidden_token_ids: frozenset[int] = frozenset(),
    ) -> None:
        if num_context_tokens <= 0 or max_window_tokens <= 2 * num_context_tokens:
            raise ValueError("need num_context_tokens > 0 and max_window_tokens > 2 * num_context_tokens")
        self._tokenizer = tokenizer
        self._skip_special_tokens = skip_special_tokens
        self._backend_decode = backend_decoder(tokenizer)
        self._num_context = num_context_tokens
        self._max_window = max_window_tokens
        self._hidden = hidden_token_ids
        # Invariant: the first _num_emitted characters of decode(_window) are out.
        context = [t for t in prompt_token_ids if t not in hidden_token_ids] if hidden_token_ids else prompt_token_ids
        self._window: list[int] = list(context[-num_context_tokens:])
        # A prompt ending inside a character: the output completes it, so it is not out yet.
        self._num_emitted = len(self._decode(self._window).rstrip(REPLACEMENT_CHAR))

    def add(self, token_ids: Sequence[int]) -> str:
        """Append tokens; return the text that is now final (possibly "")."""
        if self._hidden:
            token_ids = [t for t in token_ids if t not in self._hidden]
        self._window.extend(token_ids)
        text = self._decode(self._window)
        stable_len = len(text)
        if len(self._window) <= self._max_window:
            # A window that keeps ending in U+FFFD this long is invalid bytes, not a
            # character in progress: past the bound it is emitted as is.
            stable_len -= len(text) - len(text.rstrip(REPLACEMENT_CHAR))
        delta = self._take(text, stable_len)
        if stable_len == len(text) and len(self._window) > 2 * self._num_context:
            # Everything is out: keep only a few tokens as context for what follows.
            self._window = self._window[-self._num_context:]
            self._num_emitted = len(self._decode(self._window))
        return delta

    def flush(self) -> str:
        """The end of the stream: return whatever was held back."""
        text = self._decode(self._window)
        return self._take(text, len(text))

    def _take(self, text: str, end: int) -> str:
        if end <= self._num_emitted:
            return ""
        delta = text[self._num_emitted:end]
        self._num_emitted = end
        return delta

    def _decode(self, token_ids: list[int]) -> str:
        if self._backend_decode is not None:
            return self._backend_decode(token_ids, skip_special_tokens=self._skip_special_tokens)
        return self._tokenizer.decode(token_ids, skip_special_tokens=self._skip_special_tokens)


def backend_decoder(tokenizer) -> Callable[..., str] | None:
    """The Rust `tokenizers.Tokenizer.decode` behind a transformers fast tokenizer, when calling it gives
    exactly what `tokenizer.decode` gives (neither method overridden, no clean-up of spaces); else None.
    It skips transformers' Python layers, a few microseconds per token."""
    backend = getattr(tokenizer, "_tokenizer", None)
    if backend is None or getattr(tokenizer, "clean_up_tokenization_spaces", True):
        return None
    try:
        from transformers.tokenization_utils_base import PreTrainedTokenizerBase
        from transformers.tokenization_utils_tokenizers import TokenizersBackend
    except ImportError:
        return None
    cls = type(tokenizer)
    if not isinstance(tokenizer, TokenizersBackend) or cls.decode is not PreTrainedTokenizerBase.decode \
            or cls._decode is not TokenizersBackend._decode:
        return None
    return backend.decode


class TokenTexts:
    """Per-token text and raw bytes for logprobs (cached; a vocabulary is finite)."""

    def __init__(self, tokenizer) -> None:
        self._tokenizer = tokenizer
        self._cache: dict[int, tuple[str, list[int]]] = {}
        decoder = getattr(getattr(tokenizer, "backend_tokenizer", None), "decoder", None)
        self._is_byte_level = "ByteLevel" in repr(decoder)

    def get(self, token_id: int) -> tuple[str, list[int]]:
        """(text, utf-8 bytes). A token that is not whole characters is shown as OpenAI does: "bytes:\\xe2"."""
        cached = self._cache.get(token_id)
        if cached is None:
            cached = self._cache[token_id] = self._compute(token_id)
        return cached

    def _compute(self, token_id: int) -> tuple[str, list[int]]:
        text = self._tokenizer.decode([token_id])
        if REPLACEMENT_CHAR not in text:
            return text, list(text.encode("utf-8"))
        raw = self._raw_bytes(self._tokenizer.convert_ids_to_tokens(token_id))
        if raw is None:
            return text, list(text.encode("utf-8"))
        return "bytes:" + "".join(f"\\x{b:02x}" for b in raw), list(raw)

    def _raw_bytes(self, piece: str | None) -> bytes | None:
        if piece is None:
            return None
        match = _BYTE_FALLBACK_TOKEN.match(piece)
        if match:
            return bytes([int(match.group(1), 16)])
        if self._is_byte_level and all(ch in _BYTE_LEVEL_DECODE for ch in piece):
            return bytes(_BYTE_LEVEL_DECODE[ch] for ch in piece)
        return None
