"""What the routes of one rank share (engine loop, tokenizer, limits, metrics, config),
built once at start-up, plus the helpers every generating route uses."""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import itertools
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any

from fastapi import Depends, Request

from kvstrata.config import ConfigError, ServerConfig
from kvstrata.config.secret import Secret
from kvstrata.core import RequestOutput, SamplingParams, SessionRef
from kvstrata.disagg.decode import DecodeHandoff
from kvstrata.disagg.prefill import PrefillHandoff
from kvstrata.engine.engine import Engine
from kvstrata.engine.grammar_compiler import GrammarError
from kvstrata.engine.step_profiler import StepProfiler
from kvstrata.http.errors import OpenAIError
from kvstrata.http.inputs import RequestLimits
from kvstrata.http.prefill_url import PREFILL_URL_HEADER, requested_prefill_url
from kvstrata.http.reasoning import ReasoningFormat, reasoning_format
from kvstrata.http.session_id import SessionHeaderError, session_of
from kvstrata.http.tool_parser import ToolFormat
from kvstrata.http.tool_prompt import tool_format
from kvstrata.http.tracing import NULL_TRACER, Tracer, make_tracer
from kvstrata.model.tokenizer import Tokenizer
from kvstrata.pd.decode_sender import DecodeRoomSender
from kvstrata.pd.failures import FailurePolicy
from kvstrata.pd.prefill_rooms import PrefillRoomTable
from kvstrata.runtime.engine_loop import EngineLoop, RequestGroup
from kvstrata.server.generated_turns import GeneratedTurns, turn_key
from kvstrata.server.inflight import InflightPerClient, client_of
from kvstrata.server.invariants import InvariantWatch
from kvstrata.server.metrics import ServerMetrics
from kvstrata.server.request_spans import REQUEST_SPAN, trace_group
from kvstrata.server.response_store import ResponseStore

_SECRET_FIELDS = ("api_key", "cluster_key")  # never shown by /server_info


@dataclass(frozen=True)
class ServerState:
    engine_loop: EngineLoop
    tokenizer: Tokenizer | None  # the event loop's own copy; the engine thread has another
    limits: RequestLimits
    metrics: ServerMetrics
    config: ServerConfig
    model_name: str
    created_s: int
    info: dict[str, Any]  # GET /server_info
    prefill_rooms: PrefillRoomTable  # prefill mode: rooms in progress and aborted
    decode_sender: DecodeRoomSender | None  # decode mode: sends the role's SENT rooms
    invariants: InvariantWatch  # the last invariants report, which /metrics shows
    inflight: InflightPerClient  # engine requests in flight per client
    turns: GeneratedTurns  # recent chat answers' generated tokens (prefix-stable history)
    responses: ResponseStore  # the Responses API's stored responses
    profiler: StepProfiler | None  # POST /start_profile; None without --profile-dir
    tracer: Tracer = NULL_TRACER  # --otlp-traces-endpoint: each request's spans

    @classmethod
    def build(cls, engine: Engine, config: ServerConfig) -> ServerState:
        mode = engine.config.pd.mode
        if mode != "null" and config.cluster_key is None:
            # Its only work arrives over rank-to-rank calls, which need the cluster key.
            raise ConfigError(
                f"a {mode} rank needs the cluster key: give --cluster-key-file (or set "
                f"$KVSTRATA_CLUSTER_KEY); kvstrata launch hands its ranks one"
            )
        num_total_pages = engine.load().num_total_pages
        metrics = ServerMetrics(engine.config.pool.page_size, num_total_pages)
        pool_tokens = num_total_pages * engine.config.pool.page_size
        limits = RequestLimits(
            engine.model_config.vocab_size,
            min(engine.max_model_len, pool_tokens),
            tuple(engine.eos_token_ids),
            pool_tokens,
        )
        model_dir = engine.config.model.path  # a GGUF file's directory: resolved at start-up
        tokenizer = Tokenizer(model_dir) if engine.tokenizer is not None else None
        model_name = config.served_model_name or model_dir
        server_fields = {
            k: v for k, v in dataclasses.asdict(config).items() if k not in _SECRET_FIELDS
        }
        keys_set = {
            "api_key_set": config.api_key is not None,
            "cluster_key_set": config.cluster_key is not None,
        }
        info = {
            "model": model_dir,
            "served_model_name": model_name,
            "rank": config.rank,
            "page_size": engine.config.pool.page_size,
            "max_model_len": engine.max_model_len,
            "max_seq_len": limits.max_seq_len,
            "vocab_size": limits.vocab_size,
            "num_total_pages": engine.load().num_total_pages,
            "device": str(engine.device),
            "dtype": str(engine.dtype).removeprefix("torch."),
            "kv_cache_dtype": str(engine.pool.data.dtype).removeprefix("torch."),
            "kv_bytes_per_token": engine.pool.page_bytes // engine.config.pool.page_size,
            "kv_scales": engine.pool.scales.describe(),  # unit, or source + fingerprint
            "disaggregation_mode": mode,
            # By flag name; a secret shows only that it is set ({"is_set": true}).
            "engine_config": {
                name: dataclasses.asdict(value) if isinstance(value, Secret) else value
                for name, value in engine.config.flags().items()
            },
            "server_config": server_fields | keys_set,
        }
        engine_loop = EngineLoop(engine, metrics)
        role = engine.role  # the server's typed handles below talk to it
        decode_sender = None
        if isinstance(role, DecodeHandoff):
            failures = FailurePolicy(
                config.disaggregation_kv_failure_policy, config.prefill_url_list
            )
            decode_sender = DecodeRoomSender(
                engine_loop,
                role,
                config.pd_transfer_timeout_s,
                config.api_key,
                failures,
                cluster_key=config.cluster_key,
                answer_timeout_s=config.pd_prefill_answer_timeout_s,
            )
            role.send_to(decode_sender)  # before the engine thread starts
        prefill_role = role if isinstance(role, PrefillHandoff) else None
        return cls(
            engine_loop,
            tokenizer,
            limits,
            metrics,
            config,
            model_name,
            int(time.time()),
            info,
            PrefillRoomTable(engine_loop, prefill_role),
            decode_sender,
            InvariantWatch(config.metrics_invariants_interval_s),
            InflightPerClient(config.max_inflight_per_client),
            GeneratedTurns(config.chat_generated_turns),
            ResponseStore(config.responses_max_stored, config.responses_max_age_s),
            None
            if config.profile_dir is None
            else StepProfiler(
                Path(config.profile_dir),
                f"{'unified' if mode == 'null' else mode}-rank{config.rank}",
            ),
            make_tracer(
                config.otlp_traces_endpoint,
                f"kvstrata-{'unified' if mode == 'null' else mode}-rank{config.rank}",
            ),
        )

    def remember_answer(
        self,
        context: bytes,
        content: str | None,
        calls: list[tuple[str, str]],
        out: RequestOutput,
    ) -> None:
        """Keep a finished chat choice's generated tokens under the answer the client got
        after the conversation `context`, if they are that answer's whole text (a stop
        string cut, say, hides tokens the client never saw: then the template renders
        that turn)."""
        if self.tokenizer is None or self.turns.max_turns <= 0 or out.error is not None:
            return
        if self.tokenizer.decode(out.output_ids) != out.text:
            return
        self.turns.remember(turn_key(context, content, calls), out.output_ids)

    @functools.cached_property
    def tool_format(self) -> ToolFormat:
        """How this rank's model writes tool calls (`--tool-call-parser`, its template)."""
        template = self.tokenizer.chat_template if self.tokenizer is not None else None
        return tool_format(self.config.tool_call_parser, template)

    @functools.cached_property
    def reasoning_format(self) -> ReasoningFormat | None:
        """How this rank's model thinks (`--reasoning-parser`, its template); None: not."""
        template = self.tokenizer.chat_template if self.tokenizer is not None else None
        return reasoning_format(self.config.reasoning_parser, template)

    async def compile_grammar(self, params: SamplingParams, param: str) -> None:
        """Compile the request's grammar off the event loop and off the engine thread (the
        engine finds it in the compiler's cache); 400 naming `param` if it cannot be."""
        if params.grammar is None:
            return
        grammars = self.engine_loop.engine.sampler.grammars  # compile is thread-safe
        try:
            await asyncio.to_thread(grammars.compile, params.grammar)
        except GrammarError as e:
            raise OpenAIError(400, str(e), param, "invalid_grammar") from None

    def submit(
        self,
        request: Request,
        request_id: str,
        prompts: list[list[int]],
        params: SamplingParams,
        user: str | None = None,
        session: SessionRef | None = None,
    ) -> RequestGroup:
        """Queue a generation, counted against its client's in-flight bound (429 past
        it) until the group is closed. On a decode rank, its rooms go to the prefill rank
        the router named (header, checked before anything is queued) or, failing that, to
        one of --prefill-urls; with neither (no prefill rank is up) this rank prefills it,
        unless the failure policy is `fail`. The decode sender hands the rank to the
        engine thread with the requests: it is their rooms' `target` (disagg/rooms.py).
        The agent session it is a turn of: its headers', else `user`'s (when the rank
        is told to), else `session` (a Responses API chain's)."""
        params = self.with_session(request, params, user, session)
        sender, prefill_url = self.decode_sender, None
        if sender is not None:
            named = requested_prefill_url(request, self.config.cluster_key)
            prefill_url = named or self._default_prefill_url()
            if prefill_url is None and not sender.failures.allows_local:
                raise OpenAIError(
                    503,
                    f"no prefill rank was named for this request ({PREFILL_URL_HEADER} "
                    "from the router, or --prefill-urls), and --disaggregation-kv-failure-"
                    "policy fail keeps this rank from prefilling it",
                    code="no_prefill_rank",
                )
        client = client_of(request, self.config.cluster_key)
        self.inflight.take(client, len(prompts))
        span = self.tracer.request_span(REQUEST_SPAN, request.headers, {"kvstrata.rid": request_id})
        try:
            if sender is not None:
                group = sender.submit(request_id, prompts, params, prefill_url, span)
            else:
                group = self.engine_loop.submit(request_id, prompts, params)
        except BaseException:
            self.inflight.give(client, len(prompts))
            span.end()
            raise
        group.call_on_close(lambda: self.inflight.give(client, len(prompts)))
        trace_group(span, group)
        return group

    def with_session(
        self,
        request: Request,
        params: SamplingParams,
        user: str | None = None,
        session: SessionRef | None = None,
    ) -> SamplingParams:
        """`params` as a turn of the session the headers name, else `user`'s (with
        --session-id-from-user), else `session`, else `params.session` (400: a bad one)."""
        try:
            named = session_of(request.headers, user, from_user=self.config.session_id_from_user)
        except SessionHeaderError as e:
            raise OpenAIError(400, str(e), "session", "invalid_session") from None
        named = named or session
        return params if named is None else dataclasses.replace(params, session=named)

    def _default_prefill_url(self) -> str | None:
        urls = self.config.prefill_url_list
        if not urls:
            return None
        return urls[next(self._prefill_turn) % len(urls)]

    @functools.cached_property
    def _prefill_turn(self) -> itertools.count[int]:
        return itertools.count()

    def check_model(self, model: str | None) -> None:
        if model is not None and model != self.model_name:
            raise OpenAIError(
                404,
                f"the model '{model}' does not exist; this server serves '{self.model_name}'",
                "model",
                "model_not_found",
            )


def server_state(request: Request) -> ServerState:
    """FastAPI dependency: the state `build_app` attached to the app."""
    return request.app.state.kvstrata


StateDep = Annotated[ServerState, Depends(server_state)]


@dataclass(frozen=True)
class Delta:
    """What one engine output adds to request `index`: new text and new token ids."""

    index: int
    text: str
    token_ids: list[int]
    output: RequestOutput

    @property
    def finish_reason(self) -> str | None:
        reason = self.output.finish_reason
        return reason.value if reason is not None and self.output.finished else None


async def deltas(group: RequestGroup) -> AsyncIterator[Delta]:
    # Output text and token ids only grow (stop strings are held back until decided), so
    # what is new is the part past what was already sent; outputs a slow reader did not
    # take in time arrive merged into the newest one.
    sent_chars: dict[int, int] = {}
    sent_tokens: dict[int, int] = {}
    async for index, out in group:
        start = sent_chars.get(index, 0)
        sent_chars[index] = max(start, len(out.text))
        first_token = sent_tokens.get(index, 0)
        sent_tokens[index] = max(first_token, len(out.output_ids))
        yield Delta(index, out.text[start:], out.output_ids[first_token:], out)
