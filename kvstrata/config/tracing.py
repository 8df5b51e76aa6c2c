"""`TracingOptions`: the options section a rank's server and the router share for
OpenTelemetry traces (where spans are exported; unset: no tracing code is imported)."""

from __future__ import annotations

from dataclasses import dataclass

from kvstrata.config.options import ConfigError, opt


@dataclass(frozen=True)
class TracingOptions:
    """One span tree per request, exported over OTLP/HTTP (docs/tracing.md)."""

    otlp_traces_endpoint: str | None = opt(
        None,
        "Export a span tree per request (router decision, queue waits, prefix match per "
        "tier, prefill compute, KV transfer) to this OTLP/HTTP collector, e.g. "
        "http://127.0.0.1:4318 (/v1/traces is appended unless given). W3C traceparent is "
        "taken from the client and carried to the ranks. Needs the `otel` extra; unset: off.",
    )

    def check_tracing(self) -> None:
        endpoint = self.otlp_traces_endpoint
        if endpoint is not None and not endpoint.startswith(("http://", "https://")):
            raise ConfigError(f"--otlp-traces-endpoint: {endpoint!r} is not an http(s) URL")
