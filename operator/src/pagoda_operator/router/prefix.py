"""The text a request's prompt starts with, and chained hashes of its chunks, for prefix-affinity routing.

Two requests whose canonical texts share their first ``n`` full chunks share their first ``n`` chunk hashes (and
only those: each hash commits to every character before it), so "how many leading hashes of this request did I send
to that endpoint" estimates how much of its prompt the endpoint's prefix cache may still hold.

The canonical text is not the engine's rendered prompt (the router has no chat template or tokenizer): it is a
stable rendering of the same information in the same order, which is all prefix matching needs.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from hashlib import blake2b
from typing import Any

# Separators that do not occur in ordinary text, so "a" + "bc" and "ab" + "c" render differently.
_FIELD = "\x1f"
_RECORD = "\x1e"


def _json(value: Any) -> str:
    return json.dumps(value, sort_keys=True, ensure_ascii=False, separators=(",", ":"), default=str)


def _content_text(content: Any) -> str:
    """A message's content: a string, or a list of parts (text parts by their text, others, e.g. images, as JSON)."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for part in content:
            if isinstance(part, Mapping) and isinstance(part.get("text"), str):
                parts.append(part["text"])
            else:
                parts.append(_json(part))
        return _FIELD.join(parts)
    return _json(content)


def _message_text(message: Any) -> str:
    if not isinstance(message, Mapping):
        return _json(message)
    text = f"{message.get('role', '')}{_FIELD}{_content_text(message.get('content'))}"
    # what else the engine renders into the prompt for this message (assistant tool calls, tool results)
    for extra in ("name", "tool_calls", "tool_call_id"):
        if message.get(extra) is not None:
            text += _FIELD + _json(message[extra])
    return text


def _chat_text(body: Mapping[str, Any]) -> str:
    # chat templates render tools into the system part, ahead of the conversation
    head = _json(body["tools"]) + _RECORD if body.get("tools") else ""
    messages = body.get("messages")
    if not isinstance(messages, list):
        return ""
    return head + _RECORD.join(_message_text(message) for message in messages)


def _completion_text(body: Mapping[str, Any]) -> str:
    prompt = body.get("prompt")
    if isinstance(prompt, list) and prompt and not all(isinstance(item, int) for item in prompt):
        prompt = prompt[0]  # a batch of prompts: the router places the request by its first one
    if isinstance(prompt, str):
        return prompt
    if isinstance(prompt, list) and all(isinstance(item, int) and not isinstance(item, bool) for item in prompt):
        return " ".join(str(item) for item in prompt)
    return ""


def _responses_text(body: Mapping[str, Any]) -> str:
    instructions = body.get("instructions")
    head = instructions + _RECORD if isinstance(instructions, str) and instructions else ""
    items = body.get("input")
    if isinstance(items, str):
        return head + items
    if isinstance(items, list):
        return head + _RECORD.join(_message_text(item) for item in items)
    return head


def prompt_text(path: str, body: Mapping[str, Any]) -> str:
    """The canonical text of a request's prompt, for prefix matching; "" for other paths or bodies it cannot read.

    ``/v1/chat/completions``: tools, then each message's role and content (text parts by their text); ``/v1/completions``:
    the prompt (a list of prompts: the first; token ids: their decimal text); ``/v1/responses``: instructions, then
    the input. Never raises.
    """
    if not isinstance(body, Mapping):
        return ""
    route = path.split("?", 1)[0].rstrip("/")
    try:
        if route.endswith("/chat/completions"):
            return _chat_text(body)
        if route.endswith("/completions"):
            return _completion_text(body)
        if route.endswith("/responses"):
            return _responses_text(body)
    except (TypeError, ValueError, RecursionError):  # odd bodies (unserialisable parts, deep nesting)
        return ""
    return ""


def chunk_hashes(text: str, chunk_chars: int = 128) -> list[int]:
    """64-bit chain hashes of each full ``chunk_chars``-character chunk of ``text`` (a partial tail is left out).

    ``h[i] = blake2b_8(h[i-1] || utf8(chunk i))``, so ``h[i]`` commits to the whole text up to the end of chunk i.
    """
    if chunk_chars <= 0:
        raise ValueError(f"chunk_chars must be positive, not {chunk_chars}")
    hashes = []
    previous = b""
    for start in range(0, len(text) - chunk_chars + 1, chunk_chars):
        chunk = text[start : start + chunk_chars].encode("utf-8", "surrogatepass")
        previous = blake2b(previous + chunk, digest_size=8).digest()
        hashes.append(int.from_bytes(previous, "big"))
    return hashes
