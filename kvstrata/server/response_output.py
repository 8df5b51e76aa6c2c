"""A Responses API answer in its shapes: `ResponseShape` (the response object around the
output items of a chat answer: reasoning, message, function calls) and `ResponseEvents`
(the typed stream: response.created, output items added and done, text and argument
deltas, response.completed), built from the chat path's choices and deltas."""

from __future__ import annotations

import json
import time
import uuid
from typing import Any

from kvstrata.http.protocol import ChatMessage
from kvstrata.http.responses import ChatDelta, ChatResponseMessage, Usage
from kvstrata.http.responses_api import ResponsesRequest


def _item_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def reasoning_item(text: str, item_id: str | None = None) -> dict[str, Any]:
    content = [{"type": "reasoning_text", "text": text}]
    return {"type": "reasoning", "id": item_id or _item_id("rs"), "summary": [], "content": content}


def message_item(
    text: str, item_id: str | None = None, status: str = "completed"
) -> dict[str, Any]:
    part = {"type": "output_text", "text": text, "annotations": []}
    return {
        "type": "message",
        "id": item_id or _item_id("msg"),
        "status": status,
        "role": "assistant",
        "content": [part] if status == "completed" else [],
    }


def call_item(call_id: str, name: str, arguments: str) -> dict[str, Any]:
    return {
        "type": "function_call",
        "id": _item_id("fc"),
        "call_id": call_id,
        "name": name,
        "arguments": arguments,
        "status": "completed",
    }


def output_items(message: ChatResponseMessage) -> list[dict[str, Any]]:
    """A chat answer's message as output items, in the order the model wrote them."""
    items = [reasoning_item(message.reasoning_content)] if message.reasoning_content else []
    if message.content:
        items.append(message_item(message.content))
    for call in message.tool_calls or []:
        items.append(call_item(call.id, call.function.name, call.function.arguments))
    return items


def assistant_message(items: list[dict[str, Any]]) -> ChatMessage:
    """The chat message of a response's output, as its follow-up's history holds it (what
    the client got: text and calls; reasoning is not rendered)."""
    text = "".join(
        part["text"] for item in items if item["type"] == "message" for part in item["content"]
    )
    calls = [
        {
            "id": item["call_id"],
            "type": "function",
            "function": {"name": item["name"], "arguments": item["arguments"]},
        }
        for item in items
        if item["type"] == "function_call"
    ]
    return ChatMessage.model_validate(
        {"role": "assistant", "content": text or None, "tool_calls": calls or None}
    )


def response_usage(usage: Usage) -> dict[str, Any]:
    return {
        "input_tokens": usage.prompt_tokens,
        "input_tokens_details": {"cached_tokens": usage.prompt_tokens_details.cached_tokens},
        "output_tokens": usage.completion_tokens,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": usage.total_tokens,
        "kvstrata": usage.kvstrata.model_dump(),
    }


class ResponseShape:
    """The response object of one request: what it was asked (echoed as OpenAI does) and,
    once known, its status, output and usage."""

    def __init__(self, body: ResponsesRequest, response_id: str, model_name: str) -> None:
        self.body = body
        self.response_id = response_id
        self.model_name = model_name
        self.created_s = int(time.time())

    def envelope(
        self,
        status: str,
        output: list[dict[str, Any]],
        usage: Usage | None = None,
        finish_reason: str | None = None,
        error: dict[str, Any] | None = None,
    ) -> dict[str, Any]:
        body = self.body
        format_ = body.text.format if body.text is not None else None
        incomplete = status == "completed" and finish_reason == "length"
        choice = body.tool_choice
        return {
            "id": self.response_id,
            "object": "response",
            "created_at": self.created_s,
            "status": "incomplete" if incomplete else status,
            "error": error,
            "incomplete_details": {"reason": "max_output_tokens"} if incomplete else None,
            "instructions": body.instructions,
            "max_output_tokens": body.max_output_tokens,
            "model": self.model_name,
            "output": output,
            "parallel_tool_calls": body.parallel_tool_calls,
            "previous_response_id": body.previous_response_id,
            "reasoning": None,
            "store": body.store,
            "temperature": body.temperature,
            "text": {
                "format": format_.model_dump(by_alias=True, exclude_none=True)
                if format_ is not None
                else {"type": "text"}
            },
            "tool_choice": choice.model_dump()
            if choice is not None and not isinstance(choice, str)
            else (choice or "auto"),
            "tools": [tool.model_dump(exclude_none=True) for tool in body.tools or []],
            "top_p": body.top_p,
            "truncation": "disabled",
            "usage": response_usage(usage) if usage is not None else None,
            "user": body.user,
            "metadata": body.metadata or {},
        }


class ResponseEvents:
    """The stream of one response, event by event: the chat path's deltas (reasoning,
    then text, then whole calls) open and close output items in order."""

    def __init__(self, shape: ResponseShape) -> None:
        self.shape = shape
        self.sequence = 0
        self.items: list[dict[str, Any]] = []  # done items
        self._open: dict[str, Any] | None = None  # the item being streamed
        self._text = ""

    def event(self, kind: str, **fields: Any) -> str:
        payload = {"type": kind, "sequence_number": self.sequence, **fields}
        self.sequence += 1
        return f"event: {kind}\ndata: {json.dumps(payload, ensure_ascii=False)}\n\n"

    def openings(self) -> list[str]:
        in_progress = self.shape.envelope("in_progress", [])
        return [
            self.event("response.created", response=in_progress),
            self.event("response.in_progress", response=in_progress),
        ]

    def on_delta(self, delta: ChatDelta) -> list[str]:
        events: list[str] = []
        if delta.reasoning_content:
            events += self._opened("reasoning")
            events.append(
                self._text_delta("response.reasoning_text.delta", delta.reasoning_content)
            )
        if delta.content:
            events += self._opened("message")
            events.append(self._text_delta("response.output_text.delta", delta.content))
        for call in delta.tool_calls or []:
            events += self._closed()
            item = call_item(call.id, call.function.name, call.function.arguments)
            index = len(self.items)
            events.append(
                self.event(
                    "response.output_item.added",
                    output_index=index,
                    item=item | {"arguments": "", "status": "in_progress"},
                )
            )
            common = {"item_id": item["id"], "output_index": index}
            events.append(
                self.event(
                    "response.function_call_arguments.delta", **common, delta=item["arguments"]
                )
            )
            events.append(
                self.event(
                    "response.function_call_arguments.done",
                    **common,
                    name=item["name"],
                    arguments=item["arguments"],
                )
            )
            events.append(self.event("response.output_item.done", output_index=index, item=item))
            self.items.append(item)
        return events

    def closing(self, usage: Usage, finish_reason: str | None) -> list[str]:
        events = self._closed()
        body = self.shape.envelope("completed", self.items, usage, finish_reason)
        kind = "response.incomplete" if body["status"] == "incomplete" else "response.completed"
        return [*events, self.event(kind, response=body)]

    def failed(self, code: str, message: str) -> str:
        error = {"code": code, "message": message}
        body = self.shape.envelope("failed", self.items, error=error)
        return self.event("response.failed", response=body)

    def _opened(self, kind: str) -> list[str]:
        """Events that make an item of `kind` the open one (closing another first)."""
        if self._open is not None and self._open["type"] == kind:
            return []
        events = self._closed()
        index = len(self.items)
        if kind == "reasoning":
            self._open = reasoning_item("")
            self._open["content"] = []
            events.append(
                self.event("response.output_item.added", output_index=index, item=self._open)
            )
            return events
        self._open = message_item("", status="in_progress")
        events.append(self.event("response.output_item.added", output_index=index, item=self._open))
        part = {"type": "output_text", "text": "", "annotations": []}
        events.append(
            self.event(
                "response.content_part.added",
                item_id=self._open["id"],
                output_index=index,
                content_index=0,
                part=part,
            )
        )
        return events

    def _text_delta(self, kind: str, text: str) -> str:
        assert self._open is not None
        self._text += text
        fields: dict[str, Any] = {"logprobs": []} if kind == "response.output_text.delta" else {}
        return self.event(
            kind,
            item_id=self._open["id"],
            output_index=len(self.items),
            content_index=0,
            delta=text,
            **fields,
        )

    def _closed(self) -> list[str]:
        """Events that finish the open item, if any."""
        item, text = self._open, self._text
        if item is None:
            return []
        self._open, self._text = None, ""
        index = len(self.items)
        common = {"item_id": item["id"], "output_index": index, "content_index": 0}
        if item["type"] == "reasoning":
            done = reasoning_item(text, item["id"])
            events = [self.event("response.reasoning_text.done", **common, text=text)]
        else:
            done = message_item(text, item["id"])
            part = done["content"][0]
            events = [
                self.event("response.output_text.done", **common, text=text, logprobs=[]),
                self.event("response.content_part.done", **common, part=part),
            ]
        events.append(self.event("response.output_item.done", output_index=index, item=done))
        self.items.append(done)
        return events
