"""The prompt token ids of a request body, for routing policies that need them: the
same tokenization the rank will do (chat template for chat, the tokenizer for text,
`input_ids` as given). Anything that would fail validation yields None: the rank answers
the error, not the router."""

from __future__ import annotations

from typing import Any

from pydantic import ValidationError

from kvstrata.http.chat_prompt import chat_prompt_ids
from kvstrata.http.errors import OpenAIError
from kvstrata.http.inputs import completion_prompt_ids, generate_prompt_ids
from kvstrata.http.protocol import ChatCompletionRequest, CompletionRequest, GenerateRequest
from kvstrata.http.responses_api import ResponsesRequest, chat_request
from kvstrata.http.tool_prompt import tool_format, tool_request
from kvstrata.model.tokenizer import Tokenizer


def request_token_ids(tokenizer: Tokenizer | None, path: str, body: Any) -> list[int] | None:
    """Token ids of the (first) prompt of a request to `path`. Blocking: run off the loop."""
    try:
        if path == "/v1/chat/completions":
            return _chat_token_ids(tokenizer, ChatCompletionRequest.model_validate(body))
        if path == "/v1/responses":
            responses = ResponsesRequest.model_validate(body)
            if responses.previous_response_id is not None:
                return None  # its history is at the rank holding it: routed there
            return _chat_token_ids(tokenizer, chat_request(responses, []))
        if path == "/v1/completions":
            prompts = completion_prompt_ids(tokenizer, CompletionRequest.model_validate(body))
            return prompts[0] if prompts else None
        if path == "/generate":
            return generate_prompt_ids(tokenizer, GenerateRequest.model_validate(body))
    except (ValidationError, OpenAIError):
        return None
    return None


def _chat_token_ids(tokenizer: Tokenizer | None, chat: ChatCompletionRequest) -> list[int]:
    tools = None
    if tokenizer is not None and (chat.tools or chat.tool_choice):
        # The ranks' default format (--tool-call-parser auto), from the template.
        tools = tool_request(chat, tool_format("auto", tokenizer.chat_template))
    return chat_prompt_ids(tokenizer, chat.messages, tools)


def known_token_ids(path: str, body: Any) -> list[int] | None:
    """Token ids the body carries itself (no tokenizer): `/generate` `input_ids`, or a
    completion prompt given as ids. Used for the router's queued-token estimates."""
    if not isinstance(body, dict):
        return None
    ids = body.get("input_ids") if path == "/generate" else body.get("prompt")
    if isinstance(ids, list) and ids and all(type(t) is int for t in ids):
        return ids
    return None
