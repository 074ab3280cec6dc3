"""The tool calls an OpenAI chat stream builds, checked for OpenAI's shape as they come."""

from __future__ import annotations


def streamed_tool_calls(stream) -> tuple[str, list[dict], str | None]:
    """(content, calls, finish_reason) of an openai client's chat stream: each call {"id", "name", "arguments"},
    by index; a call's id, type and name come once, on its first delta, and its argument fragments join."""
    content, calls, finish_reason = "", {}, None
    for chunk in stream:
        for choice in chunk.choices:
            content += choice.delta.content or ""
            finish_reason = choice.finish_reason or finish_reason
            for delta in choice.delta.tool_calls or []:
                call = calls.setdefault(delta.index, {"id": None, "name": None, "arguments": ""})
                if delta.id is not None:
                    assert call["id"] is None and delta.type == "function", "a call's id comes once, on its first"
                    call["id"], call["name"] = delta.id, delta.function.name
                else:
                    assert delta.function.name is None, "the name comes once, with the id"
                call["arguments"] += delta.function.arguments or ""
    return content, [calls[index] for index in sorted(calls)], finish_reason
