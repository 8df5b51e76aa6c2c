"""`RouterState`: what the router's routes share (its config with the body limit derived,
the rank registry, the forwarder, the load inquirer, the HTTP client to the ranks, metrics,
the tokenizer, membership), built once from a `RouterConfig`."""

from __future__ import annotations

import dataclasses

import httpx

from kvstrata.config import ConfigError, RouterConfig
from kvstrata.config.limits import PromptBounds
from kvstrata.config.server import CLUSTER_KEY_ENV
from kvstrata.http.tracing import make_tracer
from kvstrata.model.gguf_dir import resolve_model_dir
from kvstrata.model.model_dir import context_len, read_json
from kvstrata.model.tokenizer import Tokenizer
from kvstrata.router.breaker import CircuitBreakers
from kvstrata.router.discovery import attach_discovery
from kvstrata.router.events import EventStreams, StreamSettings
from kvstrata.router.membership import Membership
from kvstrata.router.metrics import RouterMetrics
from kvstrata.router.poison import PoisonLedger
from kvstrata.router.policies import make_policy
from kvstrata.router.policy import ShortestQueue
from kvstrata.router.proxy import Forwarder
from kvstrata.router.rank_keys import RankKeys
from kvstrata.router.retry import RetryPolicy
from kvstrata.router.session_routing import SessionAffinity
from kvstrata.router.workers import LoadInquirer, WorkerRegistry

ROUTER_MAX_BODY_BYTES_WITHOUT_MODEL = 32 * 1024 * 1024  # no context length to derive from


@dataclasses.dataclass(frozen=True)
class RouterState:
    """What the routes share; built once, the mutable parts live on the event loop."""

    config: RouterConfig
    workers: WorkerRegistry
    forwarder: Forwarder
    inquirer: LoadInquirer
    client: httpx.AsyncClient
    metrics: RouterMetrics
    tokenizer: Tokenizer | None  # loaded only if the policy routes by token ids
    membership: Membership
    prompt_bounds: PromptBounds | None = None  # from --model's context length, if given

    @classmethod
    def build(
        cls, config: RouterConfig, transport: httpx.AsyncBaseTransport | None = None
    ) -> RouterState:
        """`transport`: how to reach the ranks (tests pass an in-process fake)."""
        config, prompt_bounds = _with_body_limit(config)
        policy = make_policy(config)
        tokenizer = None
        if policy.needs_tokens:
            if not config.model:
                raise ConfigError(
                    f"--load-balance-method {config.load_balance_method} needs --model "
                    "(the router tokenizes requests for it)"
                )
            tokenizer = Tokenizer(config.model)
        if config.prefill and config.cluster_key is None:
            raise ConfigError(
                "a router with prefill ranks needs the cluster key (its decode ranks take a "
                "prefill rank's URL only with it): give --cluster-key-file or set "
                f"${CLUSTER_KEY_ENV}"
            )
        client = httpx.AsyncClient(
            auth=RankKeys(config.rank_api_key, config.cluster_key),  # by the path called
            timeout=httpx.Timeout(
                config.upstream_timeout_s or None, connect=config.upstream_connect_timeout_s
            ),
            limits=httpx.Limits(max_connections=None, max_keepalive_connections=64),
            transport=transport,
        )
        workers = WorkerRegistry(config.prefill, config.decode, config.unhealthy_after_failures)
        metrics = RouterMetrics()
        forwarder = Forwarder(
            workers,
            client,
            metrics,
            policy,
            ShortestQueue(),
            config.ttft_calibrate,
            RetryPolicy.of(config),
            CircuitBreakers.of(config),
            PoisonLedger.of(config),
            make_tracer(config.otlp_traces_endpoint, "kvstrata-router"),
            SessionAffinity.of(config, metrics),
        )
        chunk_size = config.dp_routing_digest_chunk_size if policy.uses_digests else None
        inquirer = LoadInquirer(
            workers, client, config.load_poll_interval_s, config.load_poll_timeout_s, chunk_size
        )
        streams = None
        if config.kv_events:
            settings = StreamSettings(
                chunk_size,
                config.kv_events_heartbeat_s,
                config.kv_events_reconnect_s,
                config.upstream_connect_timeout_s,
            )
            streams = EventStreams(workers, client, settings)
        members = Membership(workers, inquirer, streams, config.remove_unhealthy_after_s)
        attach_discovery(config, members)  # --discovery kubernetes|file: joins and leaves
        return cls(
            config,
            workers,
            forwarder,
            inquirer,
            client,
            metrics,
            tokenizer,
            members,
            prompt_bounds,
        )


def _with_body_limit(config: RouterConfig) -> tuple[RouterConfig, PromptBounds | None]:
    """The body limit a rank of --model would derive (its longest prompt: the context less
    one output token), unless --max-body-bytes is given; without --model, 32 MiB."""
    if not config.model:
        max_body_bytes = config.max_body_bytes or ROUTER_MAX_BODY_BYTES_WITHOUT_MODEL
        return dataclasses.replace(config, max_body_bytes=max_body_bytes), None
    hf_config = read_json(resolve_model_dir(config.model) / "config.json")
    bounds = PromptBounds.derive(context_len(hf_config) - 1, config.max_body_bytes)
    return dataclasses.replace(config, max_body_bytes=bounds.max_body_bytes), bounds
