"""The rank-to-rank messages as strict schemas, checked where they arrive: a `PrefillTask`
(its sampling fields and the decode rank's transport endpoint) and a `PrefillResult`.
Unknown fields, wrong types and out-of-range values are refused naming the field; the
engine only ever sees the protocol dataclasses built from a message that passed."""

from __future__ import annotations

import math
from typing import Annotated, Any, Literal, cast

from pydantic import BaseModel, ConfigDict, Discriminator, Field, Tag

from kvstrata.core import (
    MAX_CACHE_PRIORITY,
    MAX_LOGIT_BIAS,
    MAX_LOGPROBS,
    REPETITION_PENALTY_RANGE,
    TokenLogprobs,
)
from kvstrata.disagg.protocol import PrefillResult, PrefillTask
from kvstrata.disagg.transport.endpoints import Endpoint as EndpointDict
from kvstrata.grammar_spec import MAX_GRAMMAR_BYTES

_STRICT = ConfigDict(extra="forbid", strict=True, frozen=True)
_INT32 = 2**31
MAX_TASK_TOKENS = 1 << 22  # no context is longer; bounds the list before any other check
MAX_STOP_STRINGS = 64
MAX_TP_SIZE = 64  # workers of one rank

Count = Annotated[int, Field(ge=0, lt=_INT32)]
TokenId = Annotated[int, Field(ge=0, lt=_INT32)]  # the vocabulary bound is the rank's
PageId = Annotated[int, Field(ge=0, lt=_INT32)]
Dim = Annotated[int, Field(ge=1, lt=_INT32)]
Address = Annotated[int, Field(ge=0, lt=2**64)]
Seconds = Annotated[float, Field(ge=0.0, allow_inf_nan=False)]
Name = Annotated[str, Field(min_length=1, max_length=256)]
RoomId = Annotated[str, Field(pattern=r"^[A-Za-z0-9._:-]{1,128}$")]
SessionId = Annotated[str, Field(pattern=r"^[\x21-\x7e]{1,128}$")]  # as core.check_session_id
DtypeName = Literal[
    "torch.float32",
    "torch.bfloat16",
    "torch.float16",
    "torch.float8_e4m3fn",
    "torch.float8_e5m2",
]
Base64 = Annotated[str, Field(max_length=4096, pattern=r"^[A-Za-z0-9+/=]*$")]
Bias = Annotated[float, Field(ge=-MAX_LOGIT_BIAS, le=MAX_LOGIT_BIAS, allow_inf_nan=False)]
MAX_BIAS_ENTRIES = 1 << 16
Logprob = Annotated[float, Field(le=0.0, allow_inf_nan=False)]


class WireGrammar(BaseModel):
    """A `GrammarSpec`: the prefill rank compiles and applies it to the first token."""

    model_config = _STRICT
    kind: Literal["json_object", "json_schema", "regex", "ebnf", "tool_calls"]
    source: str = Field("", max_length=MAX_GRAMMAR_BYTES)


class WireSession(BaseModel):
    """A `SessionRef`: the prefill rank keeps the session's retention on its own cache."""

    model_config = _STRICT
    session_id: SessionId
    parent_id: SessionId | None = None
    final: bool = False


class WireSampling(BaseModel):
    """Exactly the fields of `SamplingParams`, each in the range it accepts."""

    model_config = _STRICT
    max_tokens: int = Field(16, ge=1, lt=_INT32)
    temperature: float = Field(1.0, ge=0.0, allow_inf_nan=False)
    top_k: int = Field(0, ge=0, lt=_INT32)
    top_p: float = Field(1.0, gt=0.0, le=1.0, allow_inf_nan=False)
    seed: int | None = Field(None, ge=-(2**63), lt=2**64)
    stop: list[Annotated[str, Field(max_length=1024)]] = Field([], max_length=MAX_STOP_STRINGS)
    stop_token_ids: list[TokenId] = Field([], max_length=1024)
    ignore_eos: bool = False
    n: int = Field(1, ge=1, lt=_INT32)
    presence_penalty: float = Field(0.0, ge=-2.0, le=2.0, allow_inf_nan=False)
    frequency_penalty: float = Field(0.0, ge=-2.0, le=2.0, allow_inf_nan=False)
    repetition_penalty: float = Field(
        1.0, ge=REPETITION_PENALTY_RANGE[0], le=REPETITION_PENALTY_RANGE[1], allow_inf_nan=False
    )
    logit_bias: list[tuple[TokenId, Bias]] = Field([], max_length=MAX_BIAS_ENTRIES)
    min_tokens: int = Field(0, ge=0, lt=_INT32)
    cache_priority: int = Field(0, ge=0, le=MAX_CACHE_PRIORITY)
    cache_retention_s: float | None = Field(None, gt=0, allow_inf_nan=False)
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    prompt_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    grammar: WireGrammar | None = None
    session: WireSession | None = None


class CudaIpcHandle(BaseModel):
    """torch's reduction of a CUDA tensor (ipc.encode_cuda_ipc), bytes as base64."""

    model_config = _STRICT
    size: list[Dim] = Field(max_length=8)
    stride: list[Count] = Field(max_length=8)
    offset: Count
    device: int = Field(ge=0, lt=1024)
    handle: Base64
    storage_bytes: Address
    storage_offset_bytes: Address
    ref_counter_handle: Base64
    ref_counter_offset: Address
    event_handle: Base64
    event_sync_required: bool


class _PoolEndpoint(BaseModel):
    model_config = _STRICT
    id: Name
    shape: list[Dim] = Field(min_length=6, max_length=6)  # [layers, 2, pages, page, heads, dim]
    dtype: DtypeName
    kv_scales: Annotated[str, Field(pattern=r"^([0-9a-f]{16})?$")] = ""  # "": unit scales
    tp_size: int = Field(1, ge=1, le=MAX_TP_SIZE)  # the decode rank's workers

    @property
    def num_pages(self) -> int:
        return self.shape[2]


class IpcShmEndpoint(_PoolEndpoint):
    """A CPU decode pool in a shared-memory file; ipc.py checks the file's own header."""

    backend: Literal["ipc"]
    shm_path: Annotated[str, Field(max_length=256)]
    owner: Annotated[str, Field(pattern=r"^[0-9a-f]{32}$")]
    generation: Address
    tp_slices: list[IpcShmEndpoint] = Field([], max_length=MAX_TP_SIZE - 1)


class IpcCudaEndpoint(_PoolEndpoint):
    backend: Literal["ipc"]
    cuda_ipc: CudaIpcHandle
    pid: int = Field(ge=1, lt=_INT32)
    tp_slices: list[IpcCudaEndpoint] = Field([], max_length=MAX_TP_SIZE - 1)


class WireStaging(BaseModel):
    model_config = _STRICT
    host: Name
    port: int = Field(ge=1, le=65535)
    base_ptr: Address
    slot_bytes: int = Field(ge=1, lt=2**40)
    secret: Annotated[str, Field(pattern=r"^[0-9a-f]{64}$")]
    every_write: bool = False  # host staging: the sender coalesces every write


class MooncakeEndpoint(_PoolEndpoint):
    backend: Literal["mooncake"]
    session: Name
    base_ptr: Address
    staging: WireStaging | None = None
    tp_slices: list[MooncakeEndpoint] = Field([], max_length=MAX_TP_SIZE - 1)


def _endpoint_kind(value: Any) -> str | None:
    if not isinstance(value, dict):
        return None
    if value.get("backend") == "mooncake":
        return "mooncake"
    return "cuda" if "cuda_ipc" in value else "shm"


Endpoint = Annotated[
    Annotated[IpcShmEndpoint, Tag("shm")]
    | Annotated[IpcCudaEndpoint, Tag("cuda")]
    | Annotated[MooncakeEndpoint, Tag("mooncake")],
    Discriminator(_endpoint_kind),
]


class WirePrefillTask(BaseModel):
    """A room's task: types and ranges. `TaskLimits.check` adds what relates fields to each
    other and to the receiving rank (vocabulary, page size, pool layout, page counts)."""

    model_config = _STRICT
    room: RoomId
    token_ids: list[TokenId] = Field(min_length=1, max_length=MAX_TASK_TOKENS)
    prefix_len: Count
    dst_page_ids: list[PageId] = Field(max_length=MAX_TASK_TOKENS)
    decode_endpoint: Endpoint
    sampling: WireSampling = WireSampling()

    def to_task(self) -> PrefillTask:
        return PrefillTask(
            room=self.room,
            token_ids=list(self.token_ids),
            prefix_len=self.prefix_len,
            dst_page_ids=list(self.dst_page_ids),
            # The schema above checked it field by field: it is the TypedDict it names.
            decode_endpoint=cast(EndpointDict, self.decode_endpoint.model_dump(exclude_none=True)),
            sampling=self.sampling.model_dump(),
        )


class WireTokenLogprobs(BaseModel):
    model_config = _STRICT
    token_id: TokenId
    logprob: Logprob
    top_token_ids: list[TokenId] = Field([], max_length=MAX_LOGPROBS)
    top_logprobs: list[Logprob] = Field([], max_length=MAX_LOGPROBS)

    def to_record(self) -> TokenLogprobs:
        if len(self.top_token_ids) != len(self.top_logprobs):
            raise ValueError("first_token_logprobs: top_token_ids and top_logprobs differ")
        return TokenLogprobs(
            self.token_id, self.logprob, tuple(zip(self.top_token_ids, self.top_logprobs))
        )


class WirePrefillResult(BaseModel):
    model_config = _STRICT
    room: RoomId
    first_token_id: TokenId  # the vocabulary bound is the decode rank's to check
    num_pages_written: Count
    prefill_cached_tokens: Count
    prefill_s: Seconds = 0.0
    send_s: Seconds = 0.0
    first_token_logprobs: WireTokenLogprobs | None = None

    def to_result(self) -> PrefillResult:
        record = self.first_token_logprobs
        fields = self.model_dump(exclude={"first_token_logprobs"})
        logprobs = None if record is None else record.to_record()
        return PrefillResult(**fields, first_token_logprobs=logprobs)


class WireAbort(BaseModel):
    model_config = _STRICT
    room: RoomId


class TaskRefused(ValueError):
    """A well-formed task this rank cannot take; `param` names the field."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(message)
        self.param = param


class TaskLimits(BaseModel):
    """What a prefill rank accepts beyond the schema."""

    model_config = ConfigDict(frozen=True)
    vocab_size: int
    page_size: int
    pool_shape: list[int]  # this rank's pool: the decode pool must match but for pages
    dtype: str
    kv_scales: str  # KVScales.fingerprint of this rank's pool ("" for unit scales)
    backend: str  # the transfer backend this rank's sender speaks
    device_type: str = "cpu"  # where this rank's pool lives: "cpu" or "cuda"
    tp_size: int = 1  # this rank's tensor-parallel workers (each pool above is one's slice)

    def check(self, task: WirePrefillTask) -> None:
        """Raises TaskRefused naming the field; messages never quote a pool's shape."""
        vocab = self.vocab_size
        if any(t >= vocab for t in task.token_ids):
            raise TaskRefused("token_ids", f"a token id is outside the vocabulary [0, {vocab})")
        if any(t >= vocab for t in task.sampling.stop_token_ids):
            raise TaskRefused("sampling", "a stop_token_ids entry is outside the vocabulary")
        if any(t >= vocab for t, _ in task.sampling.logit_bias):
            raise TaskRefused("sampling", "a logit_bias token id is outside the vocabulary")
        if task.prefix_len > len(task.token_ids):
            raise TaskRefused("prefix_len", "prefix_len is longer than token_ids")
        page = self.page_size
        if task.prefix_len % page:
            raise TaskRefused("prefix_len", f"prefix_len is not a multiple of page_size {page}")
        num_pages = math.ceil(len(task.token_ids) / page) - task.prefix_len // page
        if len(task.dst_page_ids) != num_pages:
            raise TaskRefused(
                "dst_page_ids",
                f"{len(task.dst_page_ids)} destination pages for the "
                f"{num_pages} pages of tokens [prefix_len, len(token_ids))",
            )
        endpoint = task.decode_endpoint
        if len(set(task.dst_page_ids)) != len(task.dst_page_ids):
            raise TaskRefused("dst_page_ids", "a page id appears twice")
        if endpoint.backend != self.backend:
            raise TaskRefused("decode_endpoint", f"this rank sends over {self.backend} only")
        if isinstance(endpoint, IpcCudaEndpoint) and self.device_type != "cuda":
            raise TaskRefused(
                "decode_endpoint", "a CUDA IPC endpoint, but this rank's pool is not on a GPU"
            )
        if endpoint.tp_size != self.tp_size:
            raise TaskRefused(
                "decode_endpoint",
                f"the decode rank runs --tp-size {endpoint.tp_size}, this prefill rank "
                f"--tp-size {self.tp_size}: PD needs equal tensor-parallel sizes (each worker "
                "writes its own head slice to its peer; slices are not remapped)",
            )
        slices = endpoint.tp_slices
        if len(slices) != endpoint.tp_size - 1:
            raise TaskRefused(
                "decode_endpoint",
                f"{len(slices)} tp_slices for a decode rank of {endpoint.tp_size} workers",
            )
        if any(s.tp_slices or s.tp_size != endpoint.tp_size for s in slices):
            raise TaskRefused("decode_endpoint", "a tp_slices entry names slices or another size")
        for pool in (endpoint, *slices):
            self._check_pool(pool, task.dst_page_ids)

    def _check_pool(self, endpoint: _PoolEndpoint, dst_page_ids: list[int]) -> None:
        """One decode worker's pool against this rank's (its own worker's slice)."""
        if any(page_id >= endpoint.num_pages for page_id in dst_page_ids):
            raise TaskRefused("dst_page_ids", "a page id outside the decode pool")
        remote, local = endpoint.shape, self.pool_shape
        if endpoint.dtype != self.dtype:
            raise TaskRefused(
                "decode_endpoint",
                f"the decode rank's KV dtype is {endpoint.dtype}, this prefill rank's "
                f"{self.dtype} (--kv-cache-dtype must match)",
            )
        if endpoint.kv_scales != self.kv_scales:
            raise TaskRefused(
                "decode_endpoint",
                f"the decode rank's KV scales are {_scales(endpoint.kv_scales)}, this prefill "
                f"rank's {_scales(self.kv_scales)} (the same --kv-scales-calibrate text and "
                "count, or the same checkpoint, on both)",
            )
        if remote[:2] + remote[3:] != local[:2] + local[3:]:
            raise TaskRefused("decode_endpoint", "the decode pool's layout is not this rank's")


def _scales(fingerprint: str) -> str:
    return fingerprint or "unit (1.0)"


def parse_task(body: bytes | str) -> WirePrefillTask:
    """Raises pydantic.ValidationError (a ValueError) naming the fields."""
    return WirePrefillTask.model_validate_json(body)


def parse_result(data: Any) -> PrefillResult:
    """A prefill rank's answer (decoded JSON); raises pydantic.ValidationError."""
    return WirePrefillResult.model_validate(data).to_result()
