"""`ServerConfig`: the options of one rank's HTTP server (address, limits, the API key and
the cluster key, which are read from files or the environment so they stay off the
command line)."""

from __future__ import annotations

from dataclasses import dataclass

from kvstrata.config.costs import RequestCosts
from kvstrata.config.limits import IngressLimits
from kvstrata.config.options import (
    ConfigError,
    check_choices,
    flag,
    key_file_opt,
    opt,
    resolve_key_files,
)
from kvstrata.config.tracing import TracingOptions

# Where a hand-started rank or router finds the cluster key when no --cluster-key-file
# is given (the environment of a process is readable only by its own user).
CLUSTER_KEY_ENV = "KVSTRATA_CLUSTER_KEY"
CLUSTER_KEY_HELP = (
    "The key ranks and routers of one cluster share: rank-to-rank endpoints (/pd/*) and "
    "the X-Kvstrata-Prefill-Url header are refused (401) without it. Prefer "
    f"--cluster-key-file or ${CLUSTER_KEY_ENV}; kvstrata launch generates one."
)


@dataclass(frozen=True)
class ServerConfig(IngressLimits, RequestCosts, TracingOptions):
    """Options of one rank's HTTP front end (`kvstrata serve`), on the shared
    `IngressLimits` section and the `RequestCosts` bounds."""

    host: str = opt("127.0.0.1", "Address to listen on.")
    port: int = opt(30000, "TCP port to listen on.")
    api_key: str | None = opt(
        None,
        "If set, every endpoint but /health needs 'Authorization: Bearer KEY'. Prefer "
        "--api-key-file: a key on the command line is visible to every user of the host.",
        secret=True,
    )
    api_key_file: str | None = key_file_opt("api_key")
    cluster_key: str | None = opt(None, CLUSTER_KEY_HELP, secret=True, env=CLUSTER_KEY_ENV)
    cluster_key_file: str | None = key_file_opt("cluster_key")
    served_model_name: str | None = opt(
        None, "Model name clients send and responses report; default: the --model value."
    )
    rank: int = opt(0, "This rank's index, reported in usage.kvstrata.rank and /get_load.")
    tool_call_parser: str = opt(
        "auto",
        "How the model writes tool calls (chat `tools`): hermes (<tool_call> blocks; "
        "kvstrata's tool prompt teaches it to a model whose chat template knows no tools) "
        'or llama3_json (a bare {"name", "parameters"} object). auto: llama3_json when '
        "the chat template writes <|python_tag|>, else hermes.",
        ("auto", "hermes", "llama3_json"),
    )
    session_id_from_user: bool = opt(
        False,
        "Requests without a session header (X-Session-ID and the peers' spellings) are "
        "turns of the session their OpenAI `user` field names.",
    )
    chat_generated_turns: int = opt(
        4096,
        "Chat answers whose generated tokens this rank keeps: when a conversation sends "
        "one back in its history, its tokens stand in its place in the prompt instead of "
        "the chat template's re-rendering (which may drop a think block or re-serialize a "
        "tool call), so the prompt extends the last turn's prompt and output exactly and "
        "hits the cache. 0: every turn is rendered by the template.",
    )
    responses_max_stored: int = opt(
        1024,
        "Responses API: responses this rank keeps (store: true) for GET /v1/responses/{id} "
        "and previous_response_id, the oldest dropped first. 0: none is stored.",
    )
    responses_max_age_s: float = opt(
        3600.0, "Responses API: seconds a stored response is kept at most."
    )
    reasoning_parser: str = opt(
        "auto",
        "Split a reasoning model's thinking from its answer into message.reasoning_content "
        "(streamed too): qwen3 (<think>...</think>), none; auto: qwen3 when the chat "
        "template writes <think>.",
        ("auto", "none", "qwen3"),
    )
    max_prompt_tokens: int | None = opt(
        None,
        "Longest prompt accepted, in tokens (else 400), checked right after "
        "tokenization; text longer than 32 characters per such token is refused before "
        "it is tokenized. Default: the context length.",
    )
    shutdown_grace_s: float = opt(
        30.0, "On SIGTERM: seconds in-flight requests may run before they are aborted."
    )
    log_level: str = opt(
        "info", "Server log level.", ("critical", "error", "warning", "info", "debug")
    )
    prefill_urls: str = opt(
        "",
        "Decode mode: comma-separated prefill rank URLs to use when a request does not "
        "name one (the router names one with the X-Kvstrata-Prefill-Url header).",
    )
    pd_transfer_timeout_s: float = opt(
        600.0, "Decode mode: longest wait for a prefill rank to compute and send a room."
    )
    pd_prefill_answer_timeout_s: float = opt(
        10.0,
        "Decode mode: a prefill rank must take a room's connection, and answer /health "
        "(asked every quarter of this) while it holds rooms, within this many seconds; one "
        "that does not is taken for frozen or gone, and its rooms follow "
        "--disaggregation-kv-failure-policy.",
    )
    disaggregation_kv_failure_policy: str = opt(
        "retry",
        "Decode mode: what a failed room (prefill rank dead, frozen or erroring, a failed "
        "or timed-out write, a result that does not match its room) leads to. retry: a new "
        "room on another prefill rank of --prefill-urls not tried yet, then recompute; "
        "recompute: this rank prefills the request itself; fail: the request fails.",
        ("retry", "recompute", "fail"),
    )

    kv_events_queue_size: int = opt(
        1024,
        "GET /kv_events: events one subscriber may leave unread before it is dropped "
        "(it then subscribes again from a snapshot; the engine never waits for it).",
    )
    kv_events_load_interval_s: float = opt(
        0.05,
        "GET /kv_events: how often the load is checked for a change to push (digest "
        "changes are pushed as soon as the engine step that made them ends).",
    )
    register_with: str = opt(
        "",
        "Comma-separated router URLs this rank registers with (POST /workers, with its "
        "role and --advertise-url) and deregisters from when it stops. Needs the cluster key.",
    )
    advertise_url: str = opt(
        "",
        "The URL routers reach this rank at; default http://HOST:PORT (required when "
        "--host is a wildcard address).",
    )
    metrics_invariants_interval_s: float = opt(
        60.0,
        "/metrics: how old the invariants behind kvstrata_invariants_ok may be before "
        "a scrape checks them again (the full check walks every page and lock on the engine "
        "thread: ~0.1 s at 90k L1 + 200k L2 pages); 0: at every scrape. GET "
        "/debug/invariants always checks.",
    )
    profile_dir: str | None = opt(
        None,
        "Where POST /start_profile writes its torch profiler traces (chrome format, "
        "gzipped; one per profile); unset: profiling is off.",
    )
    register_interval_s: float = opt(
        5.0,
        "Seconds between repeated registrations (idempotent: a restarted router learns "
        "the rank again within this time).",
    )

    def __post_init__(self) -> None:
        resolve_key_files(self)
        self.validate()

    @property
    def prefill_url_list(self) -> list[str]:
        return _urls(self.prefill_urls)

    @property
    def router_urls(self) -> list[str]:
        return _urls(self.register_with)

    @property
    def own_url(self) -> str:
        """The URL this rank announces to routers."""
        return self.advertise_url.rstrip("/") or f"http://{self.host}:{self.port}"

    def validate(self) -> None:
        if not 0 < self.port < 65536:
            raise ConfigError(f"--port must be in [1, 65535], got {self.port}")
        for name in ("api_key", "cluster_key"):
            if getattr(self, name) is not None and not getattr(self, name):
                raise ConfigError(f"{flag(name)} must not be empty")
        if self.served_model_name is not None and not self.served_model_name:
            raise ConfigError("--served-model-name must not be empty")
        if self.profile_dir is not None and not self.profile_dir:
            raise ConfigError("--profile-dir must not be empty")
        if self.rank < 0:
            raise ConfigError(f"--rank must be >= 0, got {self.rank}")
        if self.responses_max_stored < 0:
            raise ConfigError(
                f"--responses-max-stored must be >= 0, got {self.responses_max_stored}"
            )
        if not self.responses_max_age_s > 0:
            raise ConfigError(f"--responses-max-age-s must be > 0, got {self.responses_max_age_s}")
        if self.chat_generated_turns < 0:
            raise ConfigError(
                f"--chat-generated-turns must be >= 0, got {self.chat_generated_turns}"
            )
        self.check_ingress()
        self.check_costs()
        self.check_tracing()
        if not self.metrics_invariants_interval_s >= 0:
            raise ConfigError(
                "--metrics-invariants-interval-s must be >= 0, got "
                f"{self.metrics_invariants_interval_s}"
            )
        if self.shutdown_grace_s < 0:
            raise ConfigError(f"--shutdown-grace-s must be >= 0, got {self.shutdown_grace_s}")
        if self.pd_prefill_answer_timeout_s <= 0:
            raise ConfigError(
                f"--pd-prefill-answer-timeout-s must be > 0, got {self.pd_prefill_answer_timeout_s}"
            )
        if self.pd_transfer_timeout_s <= 0:
            raise ConfigError(
                f"--pd-transfer-timeout-s must be > 0, got {self.pd_transfer_timeout_s}"
            )
        for name, urls in (
            ("prefill_urls", self.prefill_url_list),
            ("register_with", self.router_urls),
        ):
            for url in urls:
                if not url.startswith(("http://", "https://")):
                    raise ConfigError(f"{flag(name)}: {url!r} is not an http(s) URL")
        if self.advertise_url and not self.advertise_url.startswith(("http://", "https://")):
            raise ConfigError(f"--advertise-url: {self.advertise_url!r} is not an http(s) URL")
        if self.register_with and self.cluster_key is None:
            raise ConfigError(
                f"--register-with needs the cluster key (routers accept registrations only "
                f"with it): give --cluster-key-file or set ${CLUSTER_KEY_ENV}"
            )
        if self.register_with and not self.advertise_url and self.host in ("0.0.0.0", "::", ""):
            raise ConfigError(
                f"--register-with with --host {self.host!r}: give --advertise-url (the "
                "address routers reach this rank at)"
            )
        if self.kv_events_queue_size < 1:
            raise ConfigError(
                f"--kv-events-queue-size must be >= 1, got {self.kv_events_queue_size}"
            )
        for name in ("kv_events_load_interval_s", "register_interval_s"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"{flag(name)} must be > 0, got {getattr(self, name)}")
        check_choices(self)


def _urls(value: str) -> list[str]:
    return [u.strip().rstrip("/") for u in value.split(",") if u.strip()]
