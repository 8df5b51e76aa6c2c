"""Request schemas of the HTTP API (pydantic), OpenAI-compatible and native (responses:
responses.py).
Requests are strict (no '5' for 5) and refuse unknown fields (as vLLM's strict mode does);
ranges are declared here so the OpenAPI document states them and bad values are refused
before any engine work. Fields of the OpenAI schema the engine does not implement are
declared with the values that mean "off" (`OFF_VALUES`): any other value is refused
(`unsupported_field`)."""

from __future__ import annotations

from typing import Annotated, Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from kvstrata.core import (
    MAX_CACHE_PRIORITY,
    MAX_LOGIT_BIAS,
    MAX_LOGPROBS,
    REPETITION_PENALTY_RANGE,
)

MAX_SEED = 2**63 - 1
MAX_CHOICES = 128  # n: choices per prompt
MAX_TOOLS = 128  # tools one chat request may offer

MaxTokens = Annotated[int, Field(ge=1)]
Temperature = Annotated[float, Field(ge=0.0, allow_inf_nan=False)]
TopP = Annotated[float, Field(gt=0.0, le=1.0, allow_inf_nan=False)]
TopK = Annotated[int, Field(ge=-1, description="0 or -1 disables top-k.")]
Seed = Annotated[int, Field(ge=0, le=MAX_SEED)]
TokenId = Annotated[int, Field(ge=0)]
Stop = str | list[str] | None
Penalty = Annotated[float, Field(ge=-2.0, le=2.0, allow_inf_nan=False)]
# SGLang's retention hint (with --radix-eviction-policy priority): how long this request's
# cached pages should outlive it.
CachePriority = Annotated[
    int,
    Field(ge=0, le=MAX_CACHE_PRIORITY, description="Eviction priority of the cached pages."),
]
RetentionSeconds = Annotated[
    float,
    Field(gt=0, allow_inf_nan=False, description="The priority lapses after this idle time."),
]
RepetitionPenalty = Annotated[
    float,
    Field(
        ge=REPETITION_PENALTY_RANGE[0],
        le=REPETITION_PENALTY_RANGE[1],
        allow_inf_nan=False,
        description="vLLM's: > 1 discourages repeats.",
    ),
]
Bias = Annotated[float, Field(ge=-MAX_LOGIT_BIAS, le=MAX_LOGIT_BIAS, allow_inf_nan=False)]
LogitBias = dict[str, Bias] | None  # token id (as a string, OpenAI's shape) -> bias
NumLogprobs = Annotated[int, Field(ge=0, le=MAX_LOGPROBS)]


class _Request(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")
    # Fields accepted only with one of these values (JSON), which mean the feature is off.
    OFF_VALUES: ClassVar[dict[str, tuple[Any, ...]]] = {}

    def unsupported_field(self) -> str | None:
        """The first field set to a value the engine does not implement; None if none is."""
        for name, off in self.OFF_VALUES.items():
            value = getattr(self, name)
            if isinstance(value, BaseModel):
                value = value.model_dump(exclude_none=True)
            if value not in off:
                return name
        return None


_NOT_YET = "Not implemented: only the value that means off is accepted (else 400)."


class StreamOptions(_Request):
    include_usage: bool = False
    # vLLM's extension: every chunk carries its choice's usage so far.
    continuous_usage_stats: bool = False


class JsonSchemaFormat(_Request):
    """OpenAI's `response_format.json_schema`: the schema the output must be valid against
    (`strict` or not, the output always is: constrained decoding)."""

    name: str = Field(max_length=64, pattern=r"^[A-Za-z0-9_-]+$")
    description: str | None = None
    schema_: dict[str, Any] | bool | None = Field(None, alias="schema")
    strict: bool | None = None


class ResponseFormat(_Request):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class OpenAISampling(_Request):
    """Fields chat and completions share. `top_k`, `seed`-less determinism, `stop_token_ids`
    and `ignore_eos` are extensions (as in vLLM and SGLang); so are `regex` and `ebnf`
    (constrained output, as `response_format` is)."""

    model: str | None = Field(None, description="Must be the served model name if given.")
    max_tokens: MaxTokens | None = None
    temperature: Temperature = 1.0
    top_p: TopP = 1.0
    top_k: TopK = 0
    seed: Seed | None = None
    stop: Stop = None
    stop_token_ids: list[TokenId] | None = None
    ignore_eos: bool = False
    n: int = Field(1, ge=1, le=MAX_CHOICES, description="Choices per prompt.")
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    presence_penalty: Penalty = 0.0
    frequency_penalty: Penalty = 0.0
    repetition_penalty: RepetitionPenalty = 1.0
    logit_bias: LogitBias = None
    min_tokens: int = Field(0, ge=0, description="No eos/stop before this many tokens.")
    priority: CachePriority = 0
    retention_seconds: RetentionSeconds | None = None
    response_format: ResponseFormat | None = None
    regex: str | None = Field(None, description="The output matches this regular expression.")
    ebnf: str | None = Field(None, description="The output matches this EBNF grammar (root).")


class TextPart(_Request):
    type: Literal["text"]
    text: str


FunctionName = Annotated[str, Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.\-]+$")]


class FunctionDefinition(_Request):
    name: FunctionName
    description: str | None = None
    parameters: dict[str, Any] | None = Field(None, description="A JSON schema (an object's).")
    strict: bool | None = None


class Tool(_Request):
    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(_Request):
    name: FunctionName


class NamedToolChoice(_Request):
    type: Literal["function"]
    function: NamedFunction


class FunctionCall(_Request):
    name: str
    arguments: str = Field(description="The arguments as JSON text.")


class ToolCall(_Request):
    """A call an assistant message of the history made (as the answer gave it)."""

    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(_Request):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = Field(None, description="assistant messages only.")
    tool_call_id: str | None = Field(None, description="tool messages only.")

    @model_validator(mode="after")
    def _fields_of_its_role(self) -> ChatMessage:
        if self.tool_calls is not None and self.role != "assistant":
            raise ValueError("tool_calls belong to assistant messages")
        if self.tool_call_id is not None and self.role != "tool":
            raise ValueError("tool_call_id belongs to tool messages")
        return self

    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(part.text for part in self.content)
        return self.content or ""


class ChatCompletionRequest(OpenAISampling):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: MaxTokens | None = None
    logprobs: bool | None = None
    top_logprobs: NumLogprobs | None = Field(None, description="Needs logprobs: true.")
    tools: list[Tool] | None = Field(None, max_length=MAX_TOOLS)
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = Field(
        None, description="Default: auto with tools, none without."
    )
    parallel_tool_calls: bool = True
    chat_template_kwargs: dict[str, Any] | None = Field(
        None, description='Extra chat template variables, e.g. {"enable_thinking": false}.'
    )


class CompletionRequest(OpenAISampling):
    prompt: str | list[str] | list[TokenId] | list[list[TokenId]] = Field(
        description="Text, a list of texts, token ids, or a list of token id lists."
    )
    echo: bool = Field(False, description="Prepend the prompt to each choice's text.")
    logprobs: NumLogprobs | None = None
    best_of: int | None = Field(None, ge=1, description="Accepted only equal to n.")
    suffix: str | None = Field(None, description=_NOT_YET)
    OFF_VALUES: ClassVar[dict[str, tuple[Any, ...]]] = {"suffix": (None, "")}

    def unsupported_field(self) -> str | None:
        # best_of > n (sample more, return the best n) is not implemented; = n is plain n.
        if self.best_of is not None and self.best_of != self.n:
            return "best_of"
        return super().unsupported_field()


class NativeSamplingParams(_Request):
    max_new_tokens: MaxTokens | None = None
    temperature: Temperature = 1.0
    top_p: TopP = 1.0
    top_k: TopK = 0
    seed: Seed | None = None
    stop: Stop = None
    stop_token_ids: list[TokenId] | None = None
    ignore_eos: bool = False
    presence_penalty: Penalty = 0.0
    frequency_penalty: Penalty = 0.0
    repetition_penalty: RepetitionPenalty = 1.0
    logit_bias: LogitBias = None
    min_new_tokens: int = Field(0, ge=0, description="No eos/stop before this many tokens.")
    priority: CachePriority = 0
    retention_seconds: RetentionSeconds | None = None
    json_schema: str | None = Field(None, description="The output is JSON valid against it.")
    regex: str | None = Field(None, description="The output matches this regular expression.")
    ebnf: str | None = Field(None, description="The output matches this EBNF grammar (root).")

    @property
    def min_tokens(self) -> int:
        return self.min_new_tokens


class GenerateRequest(_Request):
    """Native generation: give exactly one of `text` and `input_ids`. `return_logprob`
    (SGLang's name) adds each output token's logprob, with `top_logprobs_num` alternatives."""

    text: str | None = None
    input_ids: list[TokenId] | None = None
    sampling_params: NativeSamplingParams = Field(default_factory=NativeSamplingParams)
    stream: bool = False
    return_logprob: bool = False
    top_logprobs_num: NumLogprobs = 0


class TokenizeRequest(_Request):
    """vLLM's /tokenize: exactly one of `prompt` (text) and `messages` (chat, through the
    template). `add_special_tokens` defaults to true for a prompt, false for messages (the
    template writes them itself)."""

    model: str | None = Field(None, description="Must be the served model name if given.")
    prompt: str | None = None
    messages: list[ChatMessage] | None = Field(None, min_length=1)
    add_special_tokens: bool | None = None
    add_generation_prompt: bool = Field(True, description="messages only.")


class DetokenizeRequest(_Request):
    model: str | None = Field(None, description="Must be the served model name if given.")
    tokens: list[TokenId]
