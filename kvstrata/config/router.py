"""`RouterConfig`: the options of the router (ranks, load balancing, health watching, its
HTTP front end), and the measured per-token costs its `ttft` policy starts from."""

from __future__ import annotations

import os
import typing
from dataclasses import dataclass

from kvstrata.config.h200_costs import (
    H200_L2_TOKENS_PER_S,
    H200_L3_TOKENS_PER_S,
    H200_PREFILL_TOKENS_PER_S,
    H200_TRANSFER_TOKENS_PER_S,
)
from kvstrata.config.limits import IngressLimits
from kvstrata.config.options import (
    ConfigError,
    check_choices,
    flag,
    key_file_opt,
    opt,
    resolve_key_files,
)
from kvstrata.config.server import CLUSTER_KEY_ENV, CLUSTER_KEY_HELP
from kvstrata.config.tracing import TracingOptions

DISCOVERY_SOURCES = ("static", "register", "kubernetes", "file")


@dataclass(frozen=True)
class RouterConfig(IngressLimits, TracingOptions):
    """Options of the router (`kvstrata router`): the ranks behind it, how it picks them,
    how it watches their health, and its own HTTP front end (on the shared
    `IngressLimits` section)."""

    prefill: tuple[str, ...] = opt(
        (),
        "Prefill rank URLs (space- or comma-separated). Leave empty when the --decode ranks "
        "are unified ranks: requests then go to them without a prefill URL.",
    )
    decode: tuple[str, ...] = opt(
        (), "Decode rank URLs (space- or comma-separated); unified ranks if --prefill is empty."
    )
    host: str = opt("127.0.0.1", "Address the router listens on.")
    port: int = opt(30000, "TCP port the router listens on.")
    model: str = opt(
        "", "Model directory; its tokenizer is loaded only if the routing policy needs token ids."
    )
    load_balance_method: str = opt(
        "auto",
        "How a decode rank is picked: round_robin, shortest_queue (fewest running + waiting "
        "requests), total_tokens (fewest queued tokens), cache_aware (longest cached prefix "
        "in the ranks' digests, bounded by load and KV room), ttft (least estimated time to "
        "first token), or auto (cache_aware when several decode ranks keep a prefix cache, "
        "else round_robin). Prefill ranks: shortest_queue.",
        ("auto", "round_robin", "shortest_queue", "total_tokens", "cache_aware", "ttft"),
    )
    dp_routing_digest_chunk_size: int = opt(
        256,
        "Tokens between the prefix hashes of a cache digest (a multiple of the ranks' "
        "page size): the granularity of cache-aware matching.",
    )
    dp_routing_max_extra_reqs: int = opt(
        4,
        "cache_aware: the best-matching rank is skipped for the least-loaded one when it "
        "has more than this many queued requests beyond it.",
    )
    dp_routing_cache_threshold: float = opt(
        0.1,
        "cache_aware and ttft: a rank's match counts only if it covers at least this "
        "fraction of the prompt, and only beyond the prefix every rank holds (otherwise "
        "the request is routed as new: least loaded, ties to the emptiest cache). 0: any "
        "match beyond the common prefix counts.",
    )
    ttft_prefill_tokens_per_s: float = opt(
        H200_PREFILL_TOKENS_PER_S, "ttft: prompt tokens a rank computes per second."
    )
    ttft_transfer_tokens_per_s: float = opt(
        H200_TRANSFER_TOKENS_PER_S, "ttft: prompt tokens of KV moved prefill -> decode per second."
    )
    ttft_l2_tokens_per_s: float = opt(
        H200_L2_TOKENS_PER_S, "ttft: tokens of KV loaded back from L2 (host) per second."
    )
    ttft_l3_tokens_per_s: float = opt(
        H200_L3_TOKENS_PER_S, "ttft: tokens of KV read from L3 (storage) per second."
    )
    ttft_reuse_weight: float = opt(
        4.0,
        "ttft: leaving the rank that holds a request's longest cached prefix is charged this "
        "many prefills of the prefix tokens left behind (the later requests sharing the "
        "prefix that would miss). 0: pure least estimated TTFT.",
    )
    ttft_calibrate: bool = opt(
        True,
        "ttft: scale each rank's estimates by its observed / estimated TTFT (an EWMA over "
        "streamed responses).",
    )
    session_affinity: bool = opt(
        True,
        "Keep an agent session's turns (X-Session-ID or a peer's spelling; a Responses API "
        "chain) on the rank of its last turn, a sub-agent's first on its parent's rank. "
        "--no-session-affinity: the policy alone places them (headers still forwarded).",
    )
    session_move_margin: float = opt(
        1.0,
        "A session leaves its rank when another's ttft estimate is below 1/(1 + this) of "
        "its rank's (calibration deems 25% apart one speed: 1.25/0.75 = 1.67x is noise), "
        "or its rank is unhealthy, gone, or past --dp-routing-max-extra-reqs.",
    )
    session_id_from_user: bool = opt(
        False, "A request without a session header is a turn of its `user` field's session."
    )
    load_poll_interval_s: float = opt(
        0.5,
        "Seconds between polls of the /get_load of every rank whose event stream is "
        "down (all ranks with --no-kv-events).",
    )
    kv_events: bool = opt(
        True,
        "Subscribe to every rank's GET /kv_events (cache digest deltas and load pushed "
        "as they happen); a rank whose stream is down is polled until it is back. "
        "--no-kv-events: poll only.",
    )
    kv_events_heartbeat_s: float = opt(
        1.0,
        "A rank sends a heartbeat on a quiet event stream this often; 3 missed ones "
        "end the stream (then the rank is polled while the router subscribes again).",
    )
    kv_events_reconnect_s: float = opt(
        0.5, "Seconds between attempts to subscribe again to a rank whose event stream ended."
    )
    wait_for_registrations: bool = opt(
        False,
        "Start without --decode ranks; ranks join by registering (POST /workers, "
        "which kvstrata serve --register-with sends). Needs the cluster key.",
    )
    discovery: str = opt(
        "static",
        "Where the ranks come from: static (--prefill/--decode), register (ranks join by "
        "POST /workers, as --wait-for-registrations), kubernetes (the ready pods of "
        "--discovery-label-selector, watched through the Kubernetes API; needs the `k8s` "
        "extra) or file (--discovery-file, re-read when it changes). Every source feeds the "
        "same registry as /workers; a source removes only the ranks it added.",
        DISCOVERY_SOURCES,
    )
    discovery_label_selector: str = opt(
        "", "kubernetes: the label selector of the rank pods, e.g. app=kvstrata."
    )
    discovery_namespace: str = opt("default", "kubernetes: the namespace of the rank pods.")
    discovery_role_label: str = opt(
        "kvstrata.io/role",
        "kubernetes: the pod label holding a rank's role (prefill, decode or unified).",
    )
    discovery_rank_port: int = opt(
        30000,
        "kubernetes: a rank's port when its pod has no kvstrata.io/port annotation.",
    )
    discovery_kubeconfig: str | None = opt(
        None,
        "kubernetes: the kubeconfig file (default: ~/.kube/config or $KUBECONFIG); "
        "ignored inside a cluster (KUBERNETES_SERVICE_HOST set: in-cluster config).",
    )
    discovery_file: str | None = opt(
        None,
        'file: a JSON list of ranks, [{"url": "http://HOST:PORT", "role": "prefill|decode", '
        '"rank": 0}] ("rank" optional); YAML too (.yaml/.yml) if PyYAML is installed.',
    )
    discovery_poll_interval_s: float = opt(
        1.0,
        "kubernetes and file: seconds between checks of the file's mtime and size, and "
        "between /health probes of a discovered rank that does not answer yet.",
    )
    remove_unhealthy_after_s: float = opt(
        30.0,
        "A rank that registered itself (POST /workers) and has been unhealthy this "
        "long is removed (a rank that died without deregistering). Ranks given on the "
        "command line stay.",
    )
    load_poll_timeout_s: float = opt(
        2.0,
        "A /get_load poll that takes longer is slow: it fails only if the rank's /health "
        "does not answer within this time either (a busy rank stays healthy).",
    )
    unhealthy_after_failures: int = opt(
        2, "Consecutive failed polls after which a rank gets no more requests until it answers."
    )
    upstream_connect_timeout_s: float = opt(5.0, "Longest wait to connect to a rank.")
    upstream_timeout_s: float = opt(
        600.0, "Longest wait for the next bytes of a rank's response (0: no limit)."
    )
    # Retries and circuit breakers (docs/router.md); defaults as SGLang's model gateway.
    retry_max_attempts: int = opt(
        5,
        "Attempts a request gets in all (the first included; 1: no retries). A request "
        "is sent again, to ranks it has not tried, only if its attempt failed before any "
        "byte reached the client: connection refused, reset or timed out, or a 502/503.",
    )
    retry_backoff_base_s: float = opt(0.05, "Wait before the first retry, in seconds.")
    retry_backoff_multiplier: float = opt(1.5, "Each further retry waits this much longer.")
    retry_backoff_max_s: float = opt(30.0, "Longest wait before a retry, in seconds.")
    retry_jitter: float = opt(
        0.2, "Each wait is scaled by a factor drawn from [1 - this, 1 + this]."
    )
    breaker_failure_threshold: int = opt(
        10,
        "Failed forwards in a row (refused, reset, 502/503, broken mid-stream; polls do "
        "not count) after which a rank's circuit breaker opens: no requests for "
        "--breaker-cooldown-s, then one probe request decides. 0: no breaker.",
    )
    breaker_cooldown_s: float = opt(
        60.0, "Seconds an open circuit breaker keeps requests from its rank."
    )
    # Requests that take ranks down (docs/reliability.md, "Containment").
    poison_memory_s: float = opt(
        600.0,
        "A request body whose attempt ended in a rank's engine failure or with its "
        "rank dead (connection reset after the whole request was sent) is remembered this "
        "long: it is not retried after an engine failure, and after a reset only if no rank "
        "died holding it before; once two attempts died with it, identical bodies are "
        "refused (422 poison_request) until this long after the last one.",
    )
    poison_max_bodies: int = opt(
        4096,
        "Request bodies remembered for --poison-memory-s at most (the least recently "
        "failed is forgotten first).",
    )
    max_inflight_per_client: int = opt(
        1024,
        "Generation requests one client may have in flight through the router at once "
        "(a client: its address, or its API key when --api-key is set); beyond it 429 with "
        "Retry-After, so one client's batch cannot take every rank from the others. 0: no "
        "limit.",
    )
    api_key: str | None = opt(
        None,
        "If set, clients need 'Authorization: Bearer KEY' everywhere but /health. Prefer "
        "--api-key-file: a key on the command line is visible to every user of the host.",
        secret=True,
    )
    api_key_file: str | None = key_file_opt("api_key")
    rank_api_key: str | None = opt(
        None,
        "The API key the router sends to the ranks. Prefer --rank-api-key-file.",
        secret=True,
    )
    rank_api_key_file: str | None = key_file_opt("rank_api_key")
    cluster_key: str | None = opt(
        None,
        CLUSTER_KEY_HELP + " The router sends it to every rank; a router with prefill "
        "ranks needs it.",
        secret=True,
        env=CLUSTER_KEY_ENV,
    )
    cluster_key_file: str | None = key_file_opt("cluster_key")
    log_level: str = opt(
        "info", "Router log level.", ("critical", "error", "warning", "info", "debug")
    )
    launch_proof_key_file: str | None = opt(
        None,
        "A file (keep it mode 0600) holding a key; GET /launch_proof?challenge=C then "
        "answers the HMAC of C under it, so whoever wrote the file (kvstrata launch, which "
        "sets this) can tell this router from another server on its port.",
    )

    def __post_init__(self) -> None:
        # CLI lists arrive as lists and may hold comma-separated items; store clean tuples.
        for name in ("prefill", "decode"):
            object.__setattr__(self, name, _url_list(getattr(self, name)))
        resolve_key_files(self)
        # --wait-for-registrations is the older spelling of --discovery register.
        if self.wait_for_registrations and self.discovery == "static":
            object.__setattr__(self, "discovery", "register")
        if self.discovery == "register":
            object.__setattr__(self, "wait_for_registrations", True)
        self.validate()

    def validate(self) -> None:
        self._check_discovery()
        if self.wait_for_registrations and self.cluster_key is None:
            raise ConfigError(
                "--discovery register (--wait-for-registrations) needs the cluster key "
                "(POST /workers requires "
                f"it): give --cluster-key-file or set ${CLUSTER_KEY_ENV}"
            )
        urls = self.prefill + self.decode
        for url in urls:
            if not url.startswith(("http://", "https://")):
                raise ConfigError(f"--prefill/--decode: not an http(s) URL: {url!r}")
        repeated = next((url for url in urls if urls.count(url) > 1), None)
        if repeated is not None:
            raise ConfigError(f"--prefill/--decode: a rank is listed twice: {repeated}")
        if not 0 < self.port < 65536:
            raise ConfigError(f"--port must be in [1, 65535], got {self.port}")
        if self.model and not os.path.isdir(self.model):
            raise ConfigError(f"--model: no such model directory: {self.model}")
        if self.dp_routing_digest_chunk_size < 1:
            raise ConfigError(
                f"--dp-routing-digest-chunk-size must be >= 1, got "
                f"{self.dp_routing_digest_chunk_size}"
            )
        if self.ttft_reuse_weight < 0:
            raise ConfigError(f"--ttft-reuse-weight must be >= 0, got {self.ttft_reuse_weight}")
        if not 0 <= self.dp_routing_cache_threshold <= 1:
            raise ConfigError(
                "--dp-routing-cache-threshold must be in [0, 1], got "
                f"{self.dp_routing_cache_threshold}"
            )
        if self.dp_routing_max_extra_reqs < 0:
            raise ConfigError(
                f"--dp-routing-max-extra-reqs must be >= 0, got {self.dp_routing_max_extra_reqs}"
            )
        for name in (
            "discovery_poll_interval_s",
            "load_poll_interval_s",
            "load_poll_timeout_s",
            "upstream_connect_timeout_s",
            "kv_events_heartbeat_s",
            "kv_events_reconnect_s",
            "remove_unhealthy_after_s",
            "ttft_prefill_tokens_per_s",
            "ttft_transfer_tokens_per_s",
            "ttft_l2_tokens_per_s",
            "ttft_l3_tokens_per_s",
        ):
            if getattr(self, name) <= 0:
                raise ConfigError(f"{flag(name)} must be > 0, got {getattr(self, name)}")
        if self.upstream_timeout_s < 0:
            raise ConfigError(f"--upstream-timeout-s must be >= 0, got {self.upstream_timeout_s}")
        if self.retry_max_attempts < 1 or self.breaker_failure_threshold < 0:
            raise ConfigError(
                "--retry-max-attempts must be >= 1 and --breaker-failure-threshold >= 0, got "
                f"{self.retry_max_attempts} and {self.breaker_failure_threshold}"
            )
        for name in ("retry_backoff_base_s", "retry_backoff_max_s", "breaker_cooldown_s"):
            if getattr(self, name) < 0:
                raise ConfigError(f"{flag(name)} must be >= 0, got {getattr(self, name)}")
        if not self.session_move_margin >= 0:  # NaN too
            raise ConfigError(f"--session-move-margin must be >= 0, got {self.session_move_margin}")
        if self.retry_backoff_multiplier < 1 or not 0 <= self.retry_jitter < 1:
            raise ConfigError(
                "--retry-backoff-multiplier must be >= 1 and --retry-jitter in [0, 1), got "
                f"{self.retry_backoff_multiplier} and {self.retry_jitter}"
            )
        if self.poison_memory_s <= 0 or self.poison_max_bodies < 1:
            raise ConfigError(
                "--poison-memory-s must be > 0 and --poison-max-bodies >= 1, got "
                f"{self.poison_memory_s} and {self.poison_max_bodies}"
            )
        if self.max_inflight_per_client < 0:
            raise ConfigError(
                f"--max-inflight-per-client must be >= 0, got {self.max_inflight_per_client}"
            )
        if self.unhealthy_after_failures < 1:
            raise ConfigError(
                f"--unhealthy-after-failures must be >= 1, got {self.unhealthy_after_failures}"
            )
        for name in ("api_key", "rank_api_key", "cluster_key"):
            if getattr(self, name) is not None and not getattr(self, name):
                raise ConfigError(f"{flag(name)} must not be empty")
        self.check_ingress()
        self.check_tracing()
        check_choices(self)

    def _check_discovery(self) -> None:
        """The flags of the chosen --discovery source, each refused by its name."""
        if self.discovery == "static" and not self.decode:
            raise ConfigError(
                "--decode needs at least one rank URL (or --discovery register|kubernetes|"
                "file: ranks then join by POST /workers, as pods, or from a file)"
            )
        if self.wait_for_registrations and self.discovery != "register":
            raise ConfigError(
                "--wait-for-registrations is --discovery register; it cannot be combined "
                f"with --discovery {self.discovery}"
            )
        if self.discovery == "kubernetes" and not self.discovery_label_selector.strip():
            raise ConfigError(
                "--discovery kubernetes needs --discovery-label-selector (e.g. app=kvstrata)"
            )
        if self.discovery == "kubernetes" and not self.discovery_namespace.strip():
            raise ConfigError("--discovery-namespace must not be empty")
        if self.discovery == "file" and not self.discovery_file:
            raise ConfigError("--discovery file needs --discovery-file PATH")
        if self.discovery != "file" and self.discovery_file:
            raise ConfigError(
                f"--discovery-file is read only with --discovery file, not {self.discovery}"
            )
        if not 0 < self.discovery_rank_port < 65536:
            raise ConfigError(
                f"--discovery-rank-port must be in [1, 65535], got {self.discovery_rank_port}"
            )


def _url_list(value: str | typing.Iterable[str]) -> tuple[str, ...]:
    items = [value] if isinstance(value, str) else list(value)
    return tuple(
        url.strip().rstrip("/") for item in items for url in item.split(",") if url.strip()
    )
