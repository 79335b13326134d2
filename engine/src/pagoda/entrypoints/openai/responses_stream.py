"""The output side of ``POST /v1/responses``: output items, the response object, and its streamed events.

The generated text is read by :mod:`chat_output` exactly as for chat (reasoning, content, tool calls); here the
assistant message becomes output items - a ``reasoning`` item, a ``message`` item with one ``output_text`` part,
a ``function_call`` item per call - and a stream of chat deltas becomes OpenAI's event family, each event with
the next ``sequence_number``: ``response.output_item.added``, ``response.content_part.added``,
``response.output_text.delta`` / ``response.reasoning_text.delta`` / ``response.function_call_arguments.delta``,
their ``.done`` events, ``response.content_part.done`` and ``response.output_item.done``.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import AsyncIterator
from typing import Any, Optional

from fastapi.responses import StreamingResponse

from pagoda.entrypoints.openai.responses import SSE_MEDIA_TYPE


def new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def response_usage(prompt_tokens: int, output_tokens: int, cached_tokens: int) -> dict[str, Any]:
    """The Responses API's ``usage``."""
    return {
        "input_tokens": prompt_tokens,
        "input_tokens_details": {"cached_tokens": cached_tokens},
        "output_tokens": output_tokens,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": prompt_tokens + output_tokens,
    }


def _reasoning_item(item_id: str, text: str, status: str) -> dict[str, Any]:
    content = [{"type": "reasoning_text", "text": text}]
    return {"id": item_id, "type": "reasoning", "summary": [], "content": content, "status": status}


def _text_part(text: str) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def _message_item(item_id: str, text: Optional[str], status: str) -> dict[str, Any]:
    content = [_text_part(text)] if text is not None else []
    return {"id": item_id, "type": "message", "role": "assistant", "status": status, "content": content}


def _call_item(item_id: str, call_id: str, name: str, arguments: str, status: str) -> dict[str, Any]:
    return {
        "id": item_id,
        "type": "function_call",
        "call_id": call_id,
        "name": name,
        "arguments": arguments,
        "status": status,
    }


def output_items(message: dict[str, Any], status: str = "completed") -> list[dict[str, Any]]:
    """The output items of an assistant message (``chat_output``'s shape)."""
    items = []
    if message.get("reasoning_content"):
        items.append(_reasoning_item(new_id("rs"), message["reasoning_content"], status))
    if message.get("content"):
        items.append(_message_item(new_id("msg"), message["content"], status))
    for call in message.get("tool_calls") or ():
        function = call["function"]
        items.append(_call_item(new_id("fc"), call["id"], function["name"], function["arguments"], status))
    return items


class ResponseEvents:
    """Turns one output's chat deltas into Responses events, and keeps the assistant message they add up to."""

    def __init__(self) -> None:
        self.sequence = 0
        self.items: list[dict[str, Any]] = []  # every item opened so far, as it is now
        self._open: Optional[dict[str, Any]] = None
        self._calls: dict[int, dict[str, Any]] = {}  # chat tool-call index -> its item

    def event(self, kind: str, **fields: Any) -> dict[str, Any]:
        event = {"type": kind, "sequence_number": self.sequence, **fields}
        self.sequence += 1
        return event

    def delta(self, delta: dict[str, Any]) -> list[dict[str, Any]]:
        """The events for one chat delta (``reasoning_content``, ``content``, ``tool_calls`` fragments)."""
        events: list[dict[str, Any]] = []
        if delta.get("reasoning_content"):
            events += self._text("reasoning", delta["reasoning_content"])
        if delta.get("content"):
            events += self._text("message", delta["content"])
        for fragment in delta.get("tool_calls") or ():
            events += self._call(fragment)
        return events

    def close(self, status: str = "completed") -> list[dict[str, Any]]:
        """The events that end the open item (if any)."""
        item, self._open = self._open, None
        if item is None:
            return []
        index = self.items.index(item)
        item["status"] = status
        common = {"item_id": item["id"], "output_index": index}
        events = []
        if item["type"] in ("message", "reasoning"):
            part = item["content"][0]
            kind = "output_text" if item["type"] == "message" else "reasoning_text"
            done = {"text": part["text"], **({"logprobs": []} if kind == "output_text" else {})}
            events.append(self.event(f"response.{kind}.done", **common, content_index=0, **done))
            events.append(self.event("response.content_part.done", **common, content_index=0, part=dict(part)))
        else:
            events.append(self.event("response.function_call_arguments.done", **common, arguments=item["arguments"]))
        events.append(self.event("response.output_item.done", output_index=index, item=json.loads(json.dumps(item))))
        return events

    def message(self) -> dict[str, Any]:
        """The assistant message (chat shape) of what was streamed, for the conversation store."""
        texts = {"reasoning": "", "message": ""}
        calls = []
        for item in self.items:
            if item["type"] == "function_call":
                function = {"name": item["name"], "arguments": item["arguments"]}
                calls.append({"id": item["call_id"], "type": "function", "function": function})
            else:
                texts[item["type"]] += item["content"][0]["text"]
        message: dict[str, Any] = {"role": "assistant", "content": texts["message"] or None}
        if texts["reasoning"]:
            message["reasoning_content"] = texts["reasoning"]
        if calls:
            message["tool_calls"] = calls
        return message

    def _add(self, item: dict[str, Any]) -> list[dict[str, Any]]:
        events = self.close()
        self.items.append(item)
        self._open = item
        snapshot = json.loads(json.dumps(item))
        events.append(self.event("response.output_item.added", output_index=len(self.items) - 1, item=snapshot))
        return events

    def _text(self, kind: str, text: str) -> list[dict[str, Any]]:
        events: list[dict[str, Any]] = []
        if self._open is None or self._open["type"] != kind:
            if kind == "message":
                item = _message_item(new_id("msg"), None, "in_progress")
            else:
                item = _reasoning_item(new_id("rs"), "", "in_progress")
                item["content"] = []
            events += self._add(item)
            part = _text_part("") if kind == "message" else {"type": "reasoning_text", "text": ""}
            common = {"item_id": item["id"], "output_index": len(self.items) - 1, "content_index": 0}
            events.append(self.event("response.content_part.added", **common, part=dict(part)))
            item["content"].append(part)
        item = self._open
        assert item is not None
        item["content"][0]["text"] += text
        common = {"item_id": item["id"], "output_index": self.items.index(item), "content_index": 0}
        if kind == "message":
            events.append(self.event("response.output_text.delta", **common, delta=text, logprobs=[]))
        else:
            events.append(self.event("response.reasoning_text.delta", **common, delta=text))
        return events

    def _call(self, fragment: dict[str, Any]) -> list[dict[str, Any]]:
        events: list[dict[str, Any]] = []
        function = fragment.get("function", {})
        item = self._calls.get(fragment["index"])
        if item is None or fragment.get("id") is not None and fragment["id"] != item["call_id"]:
            item = _call_item(new_id("fc"), fragment.get("id") or new_id("call"), function.get("name", ""), "", "")
            item["status"] = "in_progress"
            self._calls[fragment["index"]] = item
            events += self._add(item)
        arguments = function.get("arguments") or ""
        if arguments:
            item["arguments"] += arguments
            common = {"item_id": item["id"], "output_index": self.items.index(item)}
            events.append(self.event("response.function_call_arguments.delta", **common, delta=arguments))
        return events


def sse_events(events: AsyncIterator[dict[str, Any]]) -> StreamingResponse:
    """Server-Sent Events as OpenAI sends the Responses API's: an ``event:`` line naming each one, no [DONE]."""

    async def body():
        async for event in events:
            yield f"event: {event['type']}\ndata: {json.dumps(event, allow_nan=False)}\n\n"

    return StreamingResponse(body(), media_type=SSE_MEDIA_TYPE, headers={"Cache-Control": "no-cache"})
