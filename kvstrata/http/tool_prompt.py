"""A chat request's tools as its prompt shows them and its output must follow: the
format (`--tool-call-parser`, or from the chat template), the messages as the template
takes them (tools, assistant calls and tool results through the template when it knows
them, else kvstrata's hermes-style tool prompt and tagged blocks), and the grammar that
`tool_choice` "required" or a named function puts on the output."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from kvstrata.core import GrammarKind, GrammarSpec
from kvstrata.http.errors import OpenAIError
from kvstrata.http.tool_parser import HERMES_CLOSE, HERMES_OPEN, ToolFormat, call_json

if TYPE_CHECKING:
    from kvstrata.http.protocol import ChatCompletionRequest, ChatMessage, Tool


@dataclass(frozen=True)
class TemplateTools:
    """What a chat template does with tools (read from its text once)."""

    takes_tools: bool  # renders a `tools` variable
    takes_calls: bool  # renders assistant messages' `tool_calls`
    takes_tool_role: bool  # renders `tool` messages

    @classmethod
    def of(cls, template: str | None) -> TemplateTools:
        text = template or ""
        return cls(
            takes_tools="tools" in text,
            takes_calls="tool_calls" in text,
            takes_tool_role="'tool'" in text or '"tool"' in text,
        )


def tool_format(flag: str, template: str | None) -> ToolFormat:
    """`--tool-call-parser`; `auto`: the template's own format if it shows one, else
    hermes (kvstrata's tool prompt teaches it to any model)."""
    if flag != "auto":
        return ToolFormat(flag)
    if template is not None and PYTHON_TAG_HINT in template and HERMES_OPEN not in template:
        return ToolFormat.LLAMA3_JSON
    return ToolFormat.HERMES


PYTHON_TAG_HINT = "<|python_tag|>"


@dataclass(frozen=True)
class ToolRequest:
    """The tools one chat request offers and what it asks of them."""

    tools: list[Tool]
    choice: str  # "none", "auto", "required" or "function"
    function: str | None  # the named function (choice "function")
    parallel: bool
    fmt: ToolFormat

    @property
    def active(self) -> bool:
        """The output is parsed for calls ("none": the answer is text, whatever it says).
        The tools are in the prompt whatever the choice, so that turns of one conversation
        with different choices share their prefix."""
        return bool(self.tools) and self.choice != "none"


def tool_request(body: ChatCompletionRequest, fmt: ToolFormat) -> ToolRequest:
    """The request's tools, checked: 400 naming the field."""
    tools = list(body.tools or [])
    names = [tool.function.name for tool in tools]
    if len(set(names)) != len(names):
        raise OpenAIError(400, "two tools have the same function name", "tools", "invalid_value")
    for tool in tools:
        parameters = tool.function.parameters
        if parameters is not None and parameters.get("type", "object") != "object":
            message = f"tool {tool.function.name}'s parameters must be an object's JSON schema"
            raise OpenAIError(400, message, "tools", "invalid_value")
    given, function = body.tool_choice, None
    if given is None:
        choice = "auto" if tools else "none"
    elif isinstance(given, str):
        choice = given
    else:
        function = given.function.name
        if function not in names:
            message = f"tool_choice names {function!r}, which is not among the tools"
            raise OpenAIError(400, message, "tool_choice", "invalid_value")
        choice = "function"
    if choice in ("required", "function") and not tools:
        raise OpenAIError(400, f"tool_choice {choice!r} needs tools", "tool_choice")
    return ToolRequest(tools, choice, function, body.parallel_tool_calls, fmt)


def tool_grammar(request: ToolRequest) -> GrammarSpec | None:
    """The output grammar `tool_choice` asks for: "required", one or more calls of the
    tools (one with parallel_tool_calls false); a named function, one call of it. None:
    free output ("auto": the model decides; its calls are parsed)."""
    if request.choice not in ("required", "function"):
        return None
    tools = request.tools
    if request.function is not None:
        tools = [t for t in tools if t.function.name == request.function]
    calls = [
        {"name": t.function.name, "parameters": t.function.parameters or {"type": "object"}}
        for t in tools
    ]
    parallel = request.parallel and request.function is None
    source = {"format": request.fmt.value, "calls": calls, "parallel": parallel}
    return GrammarSpec(GrammarKind.TOOL_CALLS, json.dumps(source, ensure_ascii=False))


def template_messages(
    messages: list[ChatMessage], request: ToolRequest | None, caps: TemplateTools
) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """The messages as the template renders them, and the extra template variables
    (`tools` when the template takes them)."""
    hermes = request is not None and request.fmt is ToolFormat.HERMES
    rendered = [_message(m, caps, hermes) for m in messages]
    extra: dict[str, Any] = {}
    if request is None or not request.tools:
        return rendered, extra
    tool_dicts = [t.model_dump(exclude_none=True) for t in request.tools]
    if caps.takes_tools:
        extra["tools"] = tool_dicts
        return rendered, extra
    prompt = hermes_tool_prompt(tool_dicts)
    if rendered and rendered[0]["role"] in ("system", "developer"):
        first = rendered[0]
        rendered[0] = first | {"content": (first["content"] + "\n\n" + prompt).lstrip()}
    else:
        rendered.insert(0, {"role": "system", "content": prompt})
    return rendered, extra


def hermes_tool_prompt(tools: list[dict[str, Any]]) -> str:
    """kvstrata's tool prompt: the tools' signatures and the block a call is written in."""
    signatures = "\n".join(json.dumps(t, ensure_ascii=False) for t in tools)
    lines = [
        "# Tools",
        "",
        "You may call functions to answer. Each function's signature is a JSON object "
        "inside <tools></tools>:",
        f"<tools>\n{signatures}\n</tools>",
        "",
        "To call a function, write its name and arguments as a JSON object inside "
        f"{HERMES_OPEN}{HERMES_CLOSE}, one block per call:",
        f'{HERMES_OPEN}\n{{"name": "<function name>", "arguments": {{<arguments>}}}}\n'
        f"{HERMES_CLOSE}",
    ]
    # Nothing here depends on tool_choice (a grammar enforces "required" and a named
    # function): the prompt of a conversation's turns stays one prefix.
    return "\n".join(lines)


def _message(message: ChatMessage, caps: TemplateTools, hermes: bool) -> dict[str, Any]:
    """One message as the template takes it: a call or a tool result it cannot render is
    written as the tagged text the hermes format uses (as the model generated it)."""
    content = message.text()
    if message.role == "assistant" and message.tool_calls:
        if caps.takes_calls:
            calls = [
                {
                    "id": call.id,
                    "type": "function",
                    "function": {"name": call.function.name, "arguments": _args(call)},
                }
                for call in message.tool_calls
            ]
            return {"role": "assistant", "content": content, "tool_calls": calls}
        blocks = [
            f"{HERMES_OPEN}\n{call_json(call.function.name, _args(call))}\n{HERMES_CLOSE}"
            if hermes
            else call_json(call.function.name, _args(call))
            for call in message.tool_calls
        ]
        return {"role": "assistant", "content": "\n".join([content, *blocks]).lstrip("\n")}
    if message.role == "tool" and not caps.takes_tool_role:
        return {"role": "user", "content": f"<tool_response>\n{content}\n</tool_response>"}
    rendered: dict[str, Any] = {"role": message.role, "content": content}
    if message.role == "tool" and message.tool_call_id is not None:
        rendered["tool_call_id"] = message.tool_call_id
    return rendered


def _args(call: Any) -> Any:
    """A history call's arguments as an object (they travel as JSON text)."""
    try:
        return json.loads(call.function.arguments)
    except json.JSONDecodeError:
        raise OpenAIError(
            400,
            f"the arguments of tool call {call.id!r} are not JSON",
            "messages",
            "invalid_value",
        ) from None
