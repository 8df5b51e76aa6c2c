"""The Responses API's request (`POST /v1/responses`, pydantic, strict as the chat schema)
and its one translation: input items, instructions and the history of a previous response
into the chat messages (and tools, tool choice, output format) the chat path serves. The
router uses the same translation to tokenize a request for routing."""

from __future__ import annotations

from typing import Annotated, Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field

from kvstrata.http.errors import OpenAIError
from kvstrata.http.protocol import (
    MAX_TOOLS,
    ChatCompletionRequest,
    ChatMessage,
    FunctionName,
    MaxTokens,
    Temperature,
    TopP,
    _Request,
)

MAX_INPUT_ITEMS = 4096
# A rank's answer to POST /v1/responses names its id here too (a router learns its home).
RESPONSE_ID_HEADER = "X-Kvstrata-Response-Id"
MAX_METADATA_KEYS = 16


class InputText(_Request):
    type: Literal["input_text", "output_text"]
    text: str
    annotations: list[Any] | None = None  # output_text's, sent back as given: not read
    logprobs: list[Any] | None = None


class MessageItem(_Request):
    """A message: the easy form (`role`, `content` a string) or an output message sent
    back (`type` "message", `id`, `status`, content parts)."""

    type: Literal["message"] | None = None
    role: Literal["user", "assistant", "system", "developer"]
    content: str | list[InputText]
    id: str | None = None
    status: str | None = None

    def text(self) -> str:
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)


class FunctionCallItem(_Request):
    type: Literal["function_call"]
    call_id: str = Field(min_length=1, max_length=128)
    name: FunctionName
    arguments: str = Field(description="The arguments as JSON text.")
    id: str | None = None
    status: str | None = None


class FunctionCallOutputItem(_Request):
    type: Literal["function_call_output"]
    call_id: str = Field(min_length=1, max_length=128)
    output: str
    id: str | None = None
    status: str | None = None


class ReasoningItem(BaseModel):
    """A reasoning item sent back: accepted and not rendered (as chat templates drop
    earlier thinking; the rank's generated tokens keep it where they can, `chat_prompt`)."""

    model_config = ConfigDict(extra="allow")
    type: Literal["reasoning"]


InputItem = Annotated[
    MessageItem | FunctionCallItem | FunctionCallOutputItem | ReasoningItem,
    Field(union_mode="left_to_right"),
]


class FunctionTool(_Request):
    type: Literal["function"]
    name: FunctionName
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class NamedFunctionChoice(_Request):
    type: Literal["function"]
    name: FunctionName


class TextFormat(_Request):
    type: Literal["text", "json_object", "json_schema"]
    name: str | None = Field(None, max_length=64, pattern=r"^[A-Za-z0-9_-]+$")
    description: str | None = None
    schema_: dict[str, Any] | bool | None = Field(None, alias="schema")
    strict: bool | None = None


class TextOptions(_Request):
    format: TextFormat | None = None


class ResponsesRequest(_Request):
    """`POST /v1/responses`. Fields not implemented take only their off values."""

    OFF_VALUES: ClassVar[dict[str, tuple[Any, ...]]] = {
        "truncation": (None, "disabled"),
        "include": (None, []),
        "reasoning": (None,),
        "background": (None, False),
    }
    model: str | None = None
    input: str | list[InputItem] = Field(max_length=MAX_INPUT_ITEMS)
    instructions: str | None = None
    previous_response_id: str | None = Field(None, max_length=128)
    store: bool = True
    stream: bool = False
    tools: list[FunctionTool] | None = Field(None, max_length=MAX_TOOLS)
    tool_choice: Literal["none", "auto", "required"] | NamedFunctionChoice | None = None
    parallel_tool_calls: bool = True
    max_output_tokens: MaxTokens | None = None
    temperature: Temperature = 1.0
    top_p: TopP = 1.0
    text: TextOptions | None = None
    metadata: dict[str, str] | None = Field(None, max_length=MAX_METADATA_KEYS)
    user: str | None = None
    truncation: str | None = None
    include: list[str] | None = None
    reasoning: dict[str, Any] | None = None
    background: bool | None = None

    def input_items(self) -> list[Any]:
        if isinstance(self.input, str):
            return [MessageItem(role="user", content=self.input)]
        return list(self.input)


def input_messages(items: list[Any]) -> list[ChatMessage]:
    """The chat messages of input items: consecutive function calls join one assistant
    message with those tool calls (after the assistant text before them, if any); each
    call's output is a tool message; reasoning items are not rendered."""
    messages: list[ChatMessage] = []
    for item in items:
        if isinstance(item, MessageItem):
            messages.append(ChatMessage(role=item.role, content=item.text()))
        elif isinstance(item, FunctionCallItem):
            call = {
                "id": item.call_id,
                "type": "function",
                "function": {"name": item.name, "arguments": item.arguments},
            }
            last = messages[-1] if messages else None
            if last is not None and last.role == "assistant":
                calls = [c.model_dump() for c in last.tool_calls or []] + [call]
                messages[-1] = ChatMessage.model_validate(
                    {"role": "assistant", "content": last.content, "tool_calls": calls}
                )
            else:
                messages.append(
                    ChatMessage.model_validate(
                        {"role": "assistant", "content": None, "tool_calls": [call]}
                    )
                )
        elif isinstance(item, FunctionCallOutputItem):
            messages.append(
                ChatMessage(role="tool", content=item.output, tool_call_id=item.call_id)
            )
    return messages


def chat_request(
    body: ResponsesRequest, history: list[ChatMessage], max_tokens: int | None = None
) -> ChatCompletionRequest:
    """The chat request a Responses request amounts to: its instructions as the system
    message, then `history` (the previous response's conversation, without its
    instructions: they do not carry over), then its input."""
    messages = [ChatMessage(role="system", content=body.instructions)] if body.instructions else []
    messages += history + input_messages(body.input_items())
    if not messages:
        raise OpenAIError(400, "the input holds no message", "input", "invalid_value")
    fields: dict[str, Any] = {
        "messages": messages,
        "max_tokens": max_tokens or body.max_output_tokens,
        "temperature": body.temperature,
        "top_p": body.top_p,
        "parallel_tool_calls": body.parallel_tool_calls,
        "user": body.user,
    }
    if body.tools:
        fields["tools"] = [
            {"type": "function", "function": tool.model_dump(exclude={"type"}, by_alias=True)}
            for tool in body.tools
        ]
    choice = body.tool_choice
    if isinstance(choice, NamedFunctionChoice):
        fields["tool_choice"] = {"type": "function", "function": {"name": choice.name}}
    elif choice is not None:
        fields["tool_choice"] = choice
    fmt = body.text.format if body.text is not None else None
    if fmt is not None and fmt.type != "text":
        response_format: dict[str, Any] = {"type": fmt.type}
        if fmt.type == "json_schema":
            if fmt.name is None:
                raise OpenAIError(400, "text.format needs a name", "text.format.name")
            response_format["json_schema"] = {
                "name": fmt.name,
                "schema": fmt.schema_,
                "strict": fmt.strict,
                "description": fmt.description,
            }
        fields["response_format"] = response_format
    return ChatCompletionRequest.model_validate(
        {k: v for k, v in fields.items() if v is not None}, strict=False
    )
