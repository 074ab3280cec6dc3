"""Export of inference logs to the formats people train and analyse with.

In: a sink directory of session logs (JSONL or Parquet, as the consumer wrote
them). Out: one file.
- openai-chat: OpenAI fine-tuning chat JSONL, one {"messages": [...]} per line,
  roles system/user/assistant with string content. Each completed turn whose
  conversation a later turn of the same session does not extend gives one example
  (a follow-up repeats its history, so only the last turn of each branch is new):
  its messages plus the assistant's reply (choice 0's). A completion prompt
  becomes a user message, each of a list of text prompts its own example (with
  its first choice's text). Turns with other roles (tools) or non-text content
  are skipped.
- parquet: one row per turn, request/usage as JSON text, for analysis.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Iterator

from router.protocol import prompt_list
from segserve.reflow.sink import JsonlSink, ParquetSink, SessionSink, write_parquet

EXPORT_FORMATS = ("openai-chat", "parquet")
_ROLE_MAP = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant"}


def export(sink_dir: str | Path, out: str | Path, export_format: str) -> int:
    """Write the export; returns the number of examples (openai-chat) or rows (parquet)."""
    if export_format not in EXPORT_FORMATS:
        raise ValueError(f"export format must be one of {EXPORT_FORMATS}")
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    if export_format == "parquet":
        turns = [turn for sink in _sinks(sink_dir) for session in sink.sessions() for turn in session]
        write_parquet(out, turns)
        return len(turns)
    samples = list(chat_samples(sink_dir))
    with open(out, "w", encoding="utf-8") as f:
        f.writelines(json.dumps(sample, ensure_ascii=False) + "\n" for sample in samples)
    return len(samples)


def chat_samples(sink_dir: str | Path) -> Iterator[dict[str, list[dict[str, str]]]]:
    """The fine-tuning samples ({"messages": [...]}) of every session in a reflow log directory, as the
    openai-chat export writes them (and `segserve segments annotate --from-reflow` reads them)."""
    for sink in _sinks(sink_dir):
        for turns in sink.sessions():
            for example in chat_examples(turns):
                yield {"messages": example}


def generated_texts(sink_dir: str | Path) -> Iterator[str]:
    """Per completed turn, the text the model continued: a completion's prompt + response (for each of its
    prompts), or a chat turn's response (for drafter corpora, segserve/corpus_build.py)."""
    for sink in _sinks(sink_dir):
        for turns in sink.sessions():
            for turn in turns:
                if turn["finish"] != "complete":
                    continue
                for prompt, text in _prompt_responses(turn):
                    if text:
                        yield (prompt if isinstance(prompt, str) else "") + text


def chat_examples(turns: list[dict[str, Any]]) -> Iterator[list[dict[str, str]]]:
    """Fine-tuning conversations of one session (rules in the module docstring)."""
    conversations = [c for turn in turns for c in _conversations(turn)]
    for index, messages in enumerate(conversations):
        if not any(other[: len(messages)] == messages for other in conversations[index + 1 :]):
            yield messages


def _conversations(turn: dict[str, Any]) -> list[list[dict[str, str]]]:
    if turn["finish"] != "complete":
        return []
    request = turn["request"]
    if isinstance(request.get("messages"), list):
        messages = []
        for message in request["messages"]:
            role, content = _ROLE_MAP.get(message.get("role")), _text(message.get("content"))
            if role is None or content is None:
                return []
            messages.append({"role": role, "content": content})
        prompted = [(messages, turn["response_text"])]
    else:
        prompted = [([{"role": "user", "content": prompt}], text) for prompt, text in _prompt_responses(turn)
                    if isinstance(prompt, str)]
    return [messages + [{"role": "assistant", "content": text}] for messages, text in prompted if text]


def _prompt_responses(turn: dict[str, Any]) -> list[tuple[Any, str]]:
    """(prompt, its first choice's text) for each of a completion's prompts (prompt i's choices are indices i * n
    to i * n + n - 1); one (None, text) pair for a request without a prompt."""
    texts = {0: turn["response_text"], **{c["index"]: c["text"] for c in turn.get("other_choices") or []}}
    request = turn["request"]
    n = request.get("n") or 1
    return [(prompt, texts.get(number * n, "")) for number, prompt in enumerate(prompt_list(request.get("prompt")))]


def _text(content: Any) -> str | None:
    """String content, or the text parts of a content list; None when there is anything else."""
    if isinstance(content, str):
        return content
    if isinstance(content, list) and all(isinstance(p, dict) and p.get("type") == "text" for p in content):
        return "".join(p.get("text", "") for p in content)
    return None


def _sinks(sink_dir: str | Path) -> list[SessionSink]:
    if not Path(sink_dir).is_dir():
        raise FileNotFoundError(f"no reflow logs at {sink_dir}")
    return [sink(sink_dir) for sink in (JsonlSink, ParquetSink)]
