"""A chat request's prompt tokens: the chat template over its messages (with its tools and
`chat_template_kwargs`), tokenized; where the server still holds the tokens it generated
for an assistant message of the history, those tokens stand in that message's place
instead of the template's re-rendering of it (so the prompt extends the conversation's
earlier prompt and output exactly, and their KV is hit)."""

from __future__ import annotations

import uuid
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from kvstrata.http.errors import OpenAIError
from kvstrata.http.tool_prompt import TemplateTools, ToolRequest, template_messages

if TYPE_CHECKING:
    from kvstrata.http.protocol import ChatMessage
    from kvstrata.model.tokenizer import Tokenizer

_RESERVED = ("messages", "add_generation_prompt", "bos_token", "eos_token")


def chat_prompt_ids(
    tokenizer: Tokenizer | None,
    messages: list[ChatMessage],
    tools: ToolRequest | None = None,
    template_kwargs: dict[str, Any] | None = None,
    generated: Mapping[int, list[int]] | None = None,
) -> list[int]:
    """The prompt of `messages`; `generated` maps the index of an assistant message to the
    tokens generated for it (they replace its rendering, from its content to its end of
    turn). Blocking: run off the loop."""
    if tokenizer is None:
        raise OpenAIError(400, "this model has no tokenizer; chat is unavailable", "messages")
    marker = f"\x00kvstrata-turn-{uuid.uuid4().hex}-"
    marked = [
        m.model_copy(update={"content": f"{marker}{i}\x00", "tool_calls": None})
        if i in (generated or {})
        else m
        for i, m in enumerate(messages)
    ]
    rendered, variables = template_messages(
        marked, tools, TemplateTools.of(tokenizer.chat_template)
    )
    clash = sorted(set(template_kwargs or {}) & {*_RESERVED, *variables})
    if clash:
        message = f"chat_template_kwargs may not set {clash[0]!r}"
        raise OpenAIError(400, message, "chat_template_kwargs", "invalid_value")
    variables |= template_kwargs or {}
    try:
        text = tokenizer.render_chat(rendered, add_generation_prompt=True, **variables)
    except Exception as e:  # the template is model data run on client data: any failure is a 400
        raise OpenAIError(400, f"the chat template failed: {e}", "messages") from e
    spliced = _spliced(tokenizer, text, marker, generated) if generated else None
    if spliced is not None:
        return spliced
    if generated:  # a template that does not render some message's content: no splice
        return chat_prompt_ids(tokenizer, messages, tools, template_kwargs)
    return tokenizer.encode(text, add_special_tokens=False)


def _spliced(
    tokenizer: Tokenizer, text: str, marker: str, generated: Mapping[int, list[int]]
) -> list[int] | None:
    """The text between markers tokenized, each marker replaced by its generated tokens. A
    generation that ended with a special token (its end of turn) already holds what the
    template writes after the content, so that much of the next piece is dropped."""
    ids: list[int] = []
    rest = text
    for index in sorted(generated):
        tag = f"{marker}{index}\x00"
        before, found, rest = rest.partition(tag)
        if not found:
            return None
        ids += tokenizer.encode(before, add_special_tokens=False)
        tokens = generated[index]
        ids += tokens
        end = tokenizer.decode(tokens[-1:], skip_special_tokens=False) if tokens else ""
        if end and end != tokenizer.decode(tokens[-1:]) and rest.startswith(end):
            rest = rest[len(end) :]  # a special token ended the turn: it is not written twice
    return ids + tokenizer.encode(rest, add_special_tokens=False)
