"""How one admitted OpenAI request's answer reads: `Answer`, the interface the shared route
path fills (a final choice per output, a stream choice per delta, the bodies around them),
and its two shapes, `ChatAnswer` (/v1/chat/completions) and `CompletionAnswer` (/v1/completions)."""

from __future__ import annotations

import time
import uuid
from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import Any, ClassVar

from pydantic import BaseModel

from kvstrata.core import FinishReason, RequestOutput
from kvstrata.http.responses import (
    ChatChoice,
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatCompletionResponse,
    ChatDelta,
    ChatResponseMessage,
    CompletionChoice,
    CompletionResponse,
    FunctionCallOut,
    ToolCallDelta,
    ToolCallOut,
    Usage,
)
from kvstrata.http.streaming import sse_event
from kvstrata.http.tool_parser import ParsedCall
from kvstrata.server.chat_output import ChatOutput
from kvstrata.server.logprob_shapes import CompletionShape, TokenTexts, chat_logprobs, new_records
from kvstrata.server.state import Delta


class Answer(ABC):
    """One request's answer in its API: made per request, since a stream's choices may
    depend on what was sent before (the completions text offsets)."""

    id_prefix: ClassVar[str]
    response_type: ClassVar[type[BaseModel]]  # the whole answer
    chunk_type: ClassVar[type[BaseModel]]  # one streamed event

    def __init__(self, model_name: str) -> None:
        self.request_id = f"{self.id_prefix}-{uuid.uuid4().hex}"
        self.created_s = int(time.time())
        self.model_name = model_name

    def response(self, choices: list[Any], usage: Usage) -> BaseModel:
        return self.response_type(
            id=self.request_id,
            created=self.created_s,
            model=self.model_name,
            choices=choices,
            usage=usage,
        )

    def chunk(self, choices: list[Any], usage: Usage | None = None) -> str:
        return sse_event(
            self.chunk_type(
                id=self.request_id,
                created=self.created_s,
                model=self.model_name,
                choices=choices,
                usage=usage,
            )
        )

    @abstractmethod
    def final_choice(self, index: int, out: RequestOutput) -> BaseModel:
        """Choice `index` of the whole answer, from its finished output."""

    @abstractmethod
    def stream_choice(self, delta: Delta) -> BaseModel | None:
        """The streamed choice of one delta; None when it carries nothing to send."""

    def openings(self) -> list[str]:
        """Events sent before the first delta."""
        return []


# Told of a finished chat choice: its content and calls as the client got them, and the
# engine output behind them (server/state.py's remember_answer).
Remember = Callable[[str | None, list[tuple[str, str]], RequestOutput], None]


class ChatAnswer(Answer):
    id_prefix = "chatcmpl"
    response_type = ChatCompletionResponse
    chunk_type = ChatCompletionChunk

    def __init__(
        self,
        model_name: str,
        n: int,
        texts: TokenTexts,
        output: ChatOutput | None = None,
        remember: Remember | None = None,
    ) -> None:
        super().__init__(model_name)
        self.n = n
        self.texts = texts
        self.output = output if output is not None else ChatOutput(None, None)
        self.remember = remember  # told of each finished choice (GeneratedTurns)

    def final_choice(self, index: int, out: RequestOutput) -> ChatChoice:
        choice = self._final_choice(index, out)
        if self.remember is not None:
            message = choice.message
            calls = [(c.function.name, c.function.arguments) for c in message.tool_calls or []]
            self.remember(message.content, calls, out)
        return choice

    def _final_choice(self, index: int, out: RequestOutput) -> ChatChoice:
        reason = finish_reason(out.finish_reason)
        message = ChatResponseMessage(content=out.text)
        if not self.output.is_plain:
            part = self.output.whole(out.text)
            calls = [_tool_call(call) for call in part.calls] or None
            message = ChatResponseMessage(
                content=part.content if part.content or not calls else None,
                reasoning_content=part.reasoning,
                tool_calls=calls,
            )
            if calls and out.finish_reason is FinishReason.STOP:
                reason = "tool_calls"
        return ChatChoice(
            index=index,
            message=message,
            finish_reason=reason,
            logprobs=chat_logprobs(out.logprobs, self.texts) if out.logprobs is not None else None,
        )

    def stream_choice(self, delta: Delta) -> ChatChunkChoice | None:
        records = new_records(delta.output, len(delta.token_ids))
        reason = delta.finish_reason
        if reason is not None and self.remember is not None:
            part = self.output.whole(delta.output.text)  # as the choice's stream joins
            held = [(call.name, call.arguments) for call in part.calls]
            self.remember(part.content if part.content or not held else None, held, delta.output)
        if self.output.is_plain:
            chat_delta = ChatDelta(content=delta.text or None)
        else:
            piece = self.output.piece(delta.index, delta.text, last=reason is not None)
            calls = [
                ToolCallDelta(index=piece.first_call_index + k, id=c.id, function=_function(c))
                for k, c in enumerate(piece.calls)
            ]
            chat_delta = ChatDelta(
                content=piece.content or None,
                reasoning_content=piece.reasoning or None,
                tool_calls=calls or None,
            )
            if reason == "stop" and self.output.num_calls(delta.index):
                reason = "tool_calls"
        empty = not (chat_delta.content or chat_delta.reasoning_content or chat_delta.tool_calls)
        if empty and not (reason or records):
            return None
        return ChatChunkChoice(
            index=delta.index,
            delta=chat_delta,
            finish_reason=reason,
            logprobs=chat_logprobs(records, self.texts) if records else None,
        )

    def openings(self) -> list[str]:
        return [
            self.chunk([ChatChunkChoice(index=i, delta=ChatDelta(role="assistant", content=""))])
            for i in range(self.n)
        ]


class CompletionAnswer(Answer):
    id_prefix = "cmpl"
    response_type = CompletionResponse
    chunk_type = CompletionResponse  # a streamed chunk has the whole answer's shape

    def __init__(self, model_name: str, shape: CompletionShape) -> None:
        super().__init__(model_name)
        self.shape = shape
        # Per choice: the summed texts of the tokens sent so far, where the next token's
        # text_offset is (offsets follow each token's own text, as in the whole response).
        self._sent_offsets: dict[int, int] = {}

    def final_choice(self, index: int, out: RequestOutput) -> CompletionChoice:
        return CompletionChoice(
            index=index,
            text=self.shape.echo(index) + out.text,
            finish_reason=finish_reason(out.finish_reason),
            logprobs=self.shape.logprobs(index, out, out.output_ids, 0, first=True),
        )

    def stream_choice(self, delta: Delta) -> CompletionChoice | None:
        # With echo and logprobs the prompt goes out with the first delta (its logprobs
        # come with the first output), else in an opening event of its own.
        shape = self.shape
        first = delta.index not in self._sent_offsets
        lead = shape.echo(delta.index) if first and shape.echo_logprobs else ""
        offset = self._sent_offsets.get(delta.index, 0)
        logprobs = shape.logprobs(delta.index, delta.output, delta.token_ids, offset, first)
        self._sent_offsets[delta.index] = offset + sum(len(shape.texts(t)) for t in delta.token_ids)
        if not (lead or delta.text or delta.finish_reason or logprobs):
            return None
        return CompletionChoice(
            index=delta.index,
            text=lead + delta.text,
            finish_reason=delta.finish_reason,
            logprobs=logprobs,
        )

    def openings(self) -> list[str]:
        shape = self.shape
        if shape.echoes is None or shape.echo_logprobs:
            return []
        return [
            self.chunk([CompletionChoice(index=i, text=shape.echo(i), finish_reason=None)])
            for i in range(len(shape.echoes) * shape.n)
        ]


def finish_reason(reason: FinishReason | None) -> str | None:
    return reason.value if reason is not None else None


def _function(call: ParsedCall) -> FunctionCallOut:
    return FunctionCallOut(name=call.name, arguments=call.arguments)


def _tool_call(call: ParsedCall) -> ToolCallOut:
    return ToolCallOut(id=call.id, function=_function(call))
