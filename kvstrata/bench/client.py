"""The HTTP side of a benchmark: what the server is (GET /server_info, /v1/models), and one
streamed request through /generate (token ids) or /v1/completions (text), timed per
event, with the usage the server reported."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import httpx

from kvstrata.errors_text import describe_error

# A kvstrata rank's /server_info has these keys; the router's has role == "router".
_KVSTRATA_KEYS = ("engine_config", "disaggregation_mode", "page_size")
_ERROR_EXCERPT_CHARS = 300


@dataclass(frozen=True)
class ServerInfo:
    """What the bench needs to know about the server; `None` where it did not say."""

    kind: str  # "kvstrata" or "openai"
    model_name: str | None
    vocab_size: int | None
    max_seq_len: int | None
    page_size: int | None = None
    is_router: bool = False
    num_decode_ranks: int = 1
    load_balance_method: str | None = None


async def probe_server(http: httpx.AsyncClient) -> ServerInfo:
    """Ask GET /server_info (kvstrata rank or router) and fall back to GET /v1/models."""
    info: dict[str, Any] | None = None
    try:
        response = await http.get("/server_info")
        if response.status_code == 200 and isinstance(response.json(), dict):
            info = response.json()
    except (httpx.HTTPError, ValueError):
        info = None
    if info is not None and info.get("role") == "router":
        rank = info.get("decode_server_info") or {}
        decode = [r for r in info.get("ranks", []) if r.get("role") == "decode"]
        return ServerInfo(
            "kvstrata",
            rank.get("served_model_name"),
            rank.get("vocab_size"),
            rank.get("max_seq_len"),
            rank.get("page_size"),
            is_router=True,
            num_decode_ranks=max(1, len(decode)),
            load_balance_method=info.get("load_balance_method"),
        )
    if info is not None and all(key in info for key in _KVSTRATA_KEYS):
        return ServerInfo(
            "kvstrata",
            info.get("served_model_name"),
            info.get("vocab_size"),
            info.get("max_seq_len"),
            info.get("page_size"),
        )
    response = await http.get("/v1/models")
    response.raise_for_status()
    models = response.json().get("data") or [{}]
    return ServerInfo("openai", models[0].get("id"), None, models[0].get("max_model_len"))


async def routed_per_rank(http: httpx.AsyncClient) -> dict[int, int]:
    """A router's count of requests sent to each decode rank so far (GET /get_load);
    empty if the server is not a kvstrata router."""
    try:
        response = await http.get("/get_load")
        ranks = response.json() if response.status_code == 200 else []
    except (httpx.HTTPError, ValueError):
        return {}
    if not isinstance(ranks, list):
        return {}
    return {
        r["index"]: r["num_routed"]
        for r in ranks
        if isinstance(r, dict) and r.get("role") == "decode" and "num_routed" in r
    }


@dataclass(frozen=True)
class TierTokens:
    """Where a request's prompt tokens came from, as `usage.kvstrata` reports them."""

    cached_l1: int = 0
    cached_l2: int = 0
    cached_l3: int = 0
    transferred: int = 0  # sent by a prefill rank (PD); computed there

    @property
    def cached(self) -> int:
        return self.cached_l1 + self.cached_l2 + self.cached_l3


@dataclass(frozen=True)
class Completion:
    """One request as the client saw it. Times in seconds from sending the request;
    `itl_s` has one gap per output token after the first (a chunk of k tokens after a gap
    g counts as k gaps of g / k)."""

    ok: bool
    error: str | None
    ttft_s: float | None
    e2e_s: float
    itl_s: tuple[float, ...]
    output_ids: tuple[int, ...]
    text: str
    num_output_tokens: int
    num_prompt_tokens: int | None  # from usage
    cached_tokens: int | None  # usage.prompt_tokens_details.cached_tokens
    tiers: TierTokens | None  # usage.kvstrata
    rank: int | None


@dataclass
class _Stream:
    """Accumulates one streamed response."""

    start_s: float
    ttft_s: float | None = None
    last_s: float | None = None
    itl_s: list[float] = field(default_factory=list)
    output_ids: list[int] = field(default_factory=list)
    text: list[str] = field(default_factory=list)
    num_chunk_tokens: int = 0
    usage: dict[str, Any] | None = None
    error: str | None = None

    def on_tokens(self, num_tokens: int) -> None:
        now_s = time.perf_counter()
        if self.ttft_s is None:
            self.ttft_s = now_s - self.start_s
        elif self.last_s is not None and num_tokens:
            self.itl_s += [(now_s - self.last_s) / num_tokens] * num_tokens
        self.last_s = now_s
        self.num_chunk_tokens += num_tokens


class Backend:
    """One way to send a prompt: `/generate` with token ids (kvstrata) or
    `/v1/completions` with text (any OpenAI-compatible server)."""

    def __init__(
        self,
        http: httpx.AsyncClient,
        text_mode: bool,
        model_name: str | None,
        ignore_eos: bool,
        timeout_s: float,
    ) -> None:
        self.http = http
        self.text_mode = text_mode
        self.model_name = model_name
        self.ignore_eos = ignore_eos
        self.timeout_s = timeout_s

    @property
    def path(self) -> str:
        return "/v1/completions" if self.text_mode else "/generate"

    def body(self, prompt: list[int] | str, max_tokens: int) -> dict[str, Any]:
        if self.text_mode:
            body: dict[str, Any] = {
                "prompt": prompt,
                "max_tokens": max_tokens,
                "temperature": 0,
                "stream": True,
                "stream_options": {"include_usage": True},
                "ignore_eos": self.ignore_eos,
            }
            return body | ({"model": self.model_name} if self.model_name else {})
        params = {"max_new_tokens": max_tokens, "temperature": 0, "ignore_eos": self.ignore_eos}
        return {"input_ids": prompt, "sampling_params": params, "stream": True}

    async def send(
        self, prompt: list[int] | str, max_tokens: int, headers: Mapping[str, str] | None = None
    ) -> Completion:
        """Stream one request (with `headers` besides the client's own, e.g. an agent
        session's identity); failures (HTTP status, error event, timeout, transport) come
        back as a Completion with ok=False, never as an exception."""
        stream = _Stream(time.perf_counter())
        try:
            await asyncio.wait_for(
                self._stream(stream, prompt, max_tokens, headers), self.timeout_s
            )
        except asyncio.TimeoutError:
            stream.error = f"timed out after {self.timeout_s} s"
        except (httpx.HTTPError, ValueError) as e:  # ValueError: an event that is not JSON
            stream.error = describe_error(e, qualified=True)
        return self._completion(stream)

    async def _stream(
        self,
        stream: _Stream,
        prompt: list[int] | str,
        max_tokens: int,
        headers: Mapping[str, str] | None,
    ) -> None:
        body = self.body(prompt, max_tokens)
        async with self.http.stream("POST", self.path, json=body, headers=headers) as response:
            if response.status_code != 200:
                text = (await response.aread()).decode(errors="replace")
                stream.error = f"HTTP {response.status_code}: {text[:_ERROR_EXCERPT_CHARS]}"
                return
            async for line in response.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                event = json.loads(line[len("data: ") :])
                if "error" in event:
                    stream.error = str(event["error"].get("message", event["error"]))
                    return
                self._on_event(stream, event)

    def _on_event(self, stream: _Stream, event: dict[str, Any]) -> None:
        if self.text_mode:
            text = "".join(choice.get("text") or "" for choice in event.get("choices", []))
            if text:
                stream.text.append(text)
                stream.on_tokens(1)  # a chunk's token count is unknown: one per chunk
        else:
            ids = event.get("output_ids") or []
            if ids:
                stream.output_ids += ids
                stream.text.append(event.get("text") or "")
                stream.on_tokens(len(ids))
        if event.get("usage"):
            stream.usage = event["usage"]

    def _completion(self, stream: _Stream) -> Completion:
        usage = stream.usage or {}
        tiers = rank = None
        if isinstance(usage.get("kvstrata"), dict):
            k = usage["kvstrata"]
            tiers = TierTokens(
                k.get("cached_tokens_l1", 0),
                k.get("cached_tokens_l2", 0),
                k.get("cached_tokens_l3", 0),
                k.get("transferred_tokens", 0),
            )
            rank = k.get("rank")
        details = usage.get("prompt_tokens_details") or {}
        num_output = usage.get("completion_tokens", stream.num_chunk_tokens)
        return Completion(
            ok=stream.error is None,
            error=stream.error,
            ttft_s=stream.ttft_s,
            e2e_s=time.perf_counter() - stream.start_s,
            itl_s=tuple(stream.itl_s),
            output_ids=tuple(stream.output_ids),
            text="".join(stream.text),
            num_output_tokens=num_output,
            num_prompt_tokens=usage.get("prompt_tokens"),
            cached_tokens=details.get("cached_tokens"),
            tiers=tiers,
            rank=rank,
        )
