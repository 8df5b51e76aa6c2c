"""`BenchConfig`: every option of one `kvstrata bench` run (workload shape, pacing, bounds,
outputs), with its validation. The CLI flags are generated from it; the `--agentic-*`
flags are `AgenticOptions`, shared with `kvstrata simulate`."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from kvstrata.config import ConfigError, flag, opt
from kvstrata.sim.agent_synth import AgenticOptions

WORKLOADS = ("multiturn", "shared-prefix", "trace", "agentic")


@dataclass(frozen=True)
class BenchConfig(AgenticOptions):
    """One benchmark run against one server."""

    url: str = opt("http://127.0.0.1:30000", "Base URL of the server or router to measure.")
    workload: str = opt("multiturn", "What to send.", WORKLOADS)
    backend: str = opt(
        "auto",
        "auto: token ids through /generate if GET /server_info says kvstrata, else text "
        "through /v1/completions; generate or openai force one.",
        ("auto", "generate", "openai"),
    )
    model: str = opt(
        "",
        "Model directory whose tokenizer turns synthetic tokens into text (openai backend); "
        "default: random words.",
    )
    served_model_name: str = opt(
        "", "The `model` sent to /v1/completions; default: the first id of GET /v1/models."
    )
    api_key: str | None = opt(None, "Sent as 'Authorization: Bearer KEY' if set.")
    label: str = opt("", "Name of this run in tables and charts; default: the workload.")
    seed: int = opt(0, "Seed of the synthetic tokens, Poisson arrivals and agent sessions.")
    vocab_size: int = opt(
        0,
        "Synthetic token ids are drawn from [0, N); 0: the server's vocabulary, capped at "
        "32000 (random words: 1000).",
    )
    output_len: int = opt(64, "Tokens generated per request (greedy, eos ignored).")
    ignore_eos: bool = opt(True, "Ask the server to generate exactly the requested tokens.")
    # -- multiturn --
    num_clients: int = opt(8, "multiturn: conversations run at once (C).")
    num_rounds: int = opt(6, "multiturn: rounds per conversation (R).")
    first_prompt_len: int = opt(1024, "multiturn: prompt tokens of round 1.")
    question_len: int = opt(
        128, "multiturn: new user tokens each later round; shared-prefix: the question (Q)."
    )
    # -- shared-prefix --
    num_groups: int = opt(4, "shared-prefix: groups, each with its own system prompt (G).")
    prompts_per_group: int = opt(8, "shared-prefix: prompts per group (P).")
    system_prompt_len: int = opt(1024, "shared-prefix: tokens of each group's system prompt (S).")
    # -- trace --
    trace: str = opt("", "trace: Mooncake JSONL file (timestamp, input_length, ...).")
    trace_block_size: int = opt(512, "trace: tokens per hash id in the trace file.")
    trace_replay_block_size: int = opt(
        0,
        "trace: tokens per hash id in the prompts sent; smaller than --trace-block-size "
        "shrinks every prompt by the same factor and keeps which blocks are shared (0: same).",
    )
    trace_skip: int = opt(
        0, "trace: skip the first N records (later parts of a trace reuse more of its blocks)."
    )
    trace_speed: float = opt(1.0, "trace: arrival times are divided by this factor.")
    max_requests: int = opt(0, "Send at most this many requests (0: the whole workload).")
    max_input_len: int = opt(
        0, "trace: cut prompts to this many tokens (0: what fits the server's context)."
    )
    max_output_len: int = opt(0, "trace: cap each request's output tokens (0: no cap).")
    # -- pacing --
    request_rate: float = opt(
        0.0, "Requests per second started (multiturn, shared-prefix); 0: each as soon as ready."
    )
    arrival: str = opt("poisson", "Gaps between starts at --request-rate.", ("poisson", "fixed"))
    max_concurrency: int = opt(0, "Most requests in flight at once (0: no limit).")
    round_barrier: bool = opt(
        False, "multiturn: round r+1 starts only when every conversation finished round r."
    )
    # -- bounds and outputs --
    request_timeout_s: float = opt(600.0, "A request that takes longer fails.")
    max_duration_s: float = opt(
        3600.0, "The run stops after this long; requests not finished by then are counted."
    )
    output: str = opt("", "Write the results JSON here.")
    plot: str = opt("", "Write PNG charts into this directory (needs matplotlib).")
    progress: bool = opt(True, "Show a live progress bar.")
    record_output_ids: bool = opt(True, "Keep every request's output token ids in the JSON.")

    def __post_init__(self) -> None:
        self.validate()

    @property
    def name(self) -> str:
        return self.label or self.workload

    def validate(self) -> None:
        self.check_agentic()
        if not self.url.startswith(("http://", "https://")):
            raise ConfigError(f"--url must be an http(s) URL, got {self.url!r}")
        positive = [
            "output_len",
            "num_clients",
            "num_rounds",
            "first_prompt_len",
            "num_groups",
            "prompts_per_group",
            "trace_block_size",
        ]
        for name in positive:
            if getattr(self, name) < 1:
                raise ConfigError(f"{flag(name)} must be >= 1")
        non_negative = [
            "vocab_size",
            "question_len",
            "system_prompt_len",
            "max_requests",
            "max_input_len",
            "max_output_len",
            "max_concurrency",
            "trace_replay_block_size",
            "request_rate",
        ]
        for name in non_negative:
            if getattr(self, name) < 0:
                raise ConfigError(f"{flag(name)} must be >= 0")
        if self.workload == "shared-prefix" and self.system_prompt_len + self.question_len < 1:
            raise ConfigError("--system-prompt-len plus --question-len must be >= 1")
        if self.workload == "agentic" and (
            self.max_requests or self.round_barrier or self.request_rate
        ):
            raise ConfigError(
                "--max-requests, --round-barrier and --request-rate do not apply to --workload "
                "agentic (size and pace it with --agentic-num-sessions, --agentic-session-rate)"
            )
        if self.workload == "trace" and not self.trace:
            raise ConfigError("--workload trace needs --trace FILE")
        if self.trace_replay_block_size > self.trace_block_size:
            raise ConfigError("--trace-replay-block-size must be <= --trace-block-size")
        if self.trace_speed <= 0:
            raise ConfigError(f"--trace-speed must be > 0, got {self.trace_speed}")
        if self.request_timeout_s <= 0 or self.max_duration_s <= 0:
            raise ConfigError("--request-timeout-s and --max-duration-s must be > 0")
        if self.api_key is not None and not self.api_key:
            raise ConfigError("--api-key must not be empty")
        for field in dataclasses.fields(self):
            choices = field.metadata.get("choices")
            if choices and getattr(self, field.name) not in choices:
                raise ConfigError(f"{flag(field.name)} must be one of {', '.join(choices)}")
