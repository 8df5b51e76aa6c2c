"""Routing comparison (issue 8): 1 prefill + 4 decode ranks (decode radix cache + HiCache
L2) behind a router; the multi-turn workload and the Mooncake trace under each
--load-balance-method: round_robin, shortest_queue, cache_aware, ttft. A method the router
does not accept (yet) is skipped with a message. The ranks start once; each method gets a
router process of its own over them, and every rank's cache is flushed before each run.

    PYTHONPATH=. python bench/experiments/routing_comparison.py [--device cuda]
        [--model DIR] [--out DIR] [--trace FILE] [size flags] [router or rank flags]

Reports per method: hit rate per tier, TTFT mean/p99, load imbalance (max / mean requests
per decode rank, as served, and as the router's /get_load counted them). The summary covers
every method's JSON in --out, so a long run can be split across commands (--methods X)."""

from __future__ import annotations

import dataclasses
import json
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

from common import (
    MultiTurnCluster,
    bench,
    command_line,
    console,
    dump_setup,
    extra_router,
    flush,
    machine_line,
    method_accepted,
    model_dir,
    parse_args,
    rank_devices,
    resolve_device,
    run_main,
    write_summary,
)
from rank_metrics import pd_transfer, transfer_line

from kvstrata.bench.report import BenchReport
from kvstrata.bench.run import load_report
from kvstrata.cluster.launch import Cluster, launch_cluster
from kvstrata.cluster.launch_config import LaunchConfig
from kvstrata.config import ConfigError, opt

METHODS = ("round_robin", "shortest_queue", "cache_aware", "ttft")
WORKLOADS = ("multiturn", "trace")
TRACE_NAME = "mooncake_synthetic_trace.jsonl"
TRACE_URL = (
    "https://raw.githubusercontent.com/kvcache-ai/Mooncake/main/"
    "FAST25-release/traces/synthetic_trace.jsonl"
)
# Not a multiple of the rank count: a fixed request order would otherwise send each
# conversation to the same rank every round under round_robin, by accident.
PROFILES: dict[str, dict[str, int]] = {
    "cpu": {
        "num_clients": 15,
        "first_prompt_len": 200,
        "last_prompt_len": 800,
        "output_len": 8,
        "max_concurrency": 4,
        "decode_l1_tokens": 8192,
        "trace_skip": 3893,
        "trace_requests": 100,
        "trace_replay_block_size": 16,
        "trace_max_input_len": 1536,
        "trace_max_output_len": 16,
    },
    "gpu": {
        "num_clients": 30,
        "first_prompt_len": 4096,
        "last_prompt_len": 16384,
        "output_len": 64,
        "max_concurrency": 12,
        "decode_l1_tokens": 49152,
        "trace_skip": 3793,
        "trace_requests": 200,
        "trace_replay_block_size": 512,
        "trace_max_input_len": 16384,
        "trace_max_output_len": 128,
    },
}


@dataclass(frozen=True)
class RoutingConfig(MultiTurnCluster):
    """The experiment's own flags, on the shared section; sizes at 0 come from --profile."""

    out: str = opt("bench/results/routing_comparison", "Output directory.")
    methods: str = opt(",".join(METHODS), "Comma-separated --load-balance-method values.")
    workloads: str = opt(",".join(WORKLOADS), "Comma-separated workloads: multiturn, trace.")
    num_decode: int = opt(4, "Decode ranks.")
    trace: str = opt("", f"Mooncake trace; default: shared/data/{TRACE_NAME} found upwards.")
    trace_skip: int = opt(0, "trace: skip the first N records (later ones reuse more).")
    trace_requests: int = opt(0, "trace: requests replayed after the skipped ones.")
    trace_speed: float = opt(1.0, "trace: arrival-time speed-up.")
    trace_replay_block_size: int = opt(0, "trace: tokens per hash id sent (512: as traced).")
    trace_max_input_len: int = opt(0, "trace: prompt cap in tokens.")
    trace_max_output_len: int = opt(0, "trace: output cap in tokens.")

    def __post_init__(self) -> None:
        super().__post_init__()
        unknown = [w for w in _items(self.workloads) if w not in WORKLOADS]
        if unknown or not _items(self.workloads):
            raise ConfigError(f"--workloads: choose from {', '.join(WORKLOADS)}; got {unknown}")
        if not _items(self.methods):
            raise ConfigError("--methods needs at least one method")
        if self.num_decode < 1:
            raise ConfigError(f"--num-decode must be >= 1, got {self.num_decode}")


def _items(text: str) -> list[str]:
    return [item.strip() for item in text.split(",") if item.strip()]


def find_trace(given: str) -> Path:
    if given:
        if not Path(given).is_file():
            raise ConfigError(f"--trace {given}: no such file (the trace: {TRACE_URL})")
        return Path(given)
    here = Path(__file__).resolve()
    for root in [Path.cwd(), *Path.cwd().parents, *here.parents]:
        for candidate in (root / "shared" / "data" / TRACE_NAME, root / "data" / TRACE_NAME):
            if candidate.is_file():
                return candidate
    raise ConfigError(
        f"--trace: no {TRACE_NAME} under shared/data/ or data/ from here upwards; pass "
        f"--trace FILE (the Mooncake project's trace: {TRACE_URL}) or --workloads multiturn"
    )


def run_method(
    method: str,
    cluster: Cluster,
    model: str,
    router_options: dict,
    out_dir: Path,
    workloads: list[str],
    workload_fields: dict[str, dict],
) -> None:
    """Both workloads through a router of this method, each with every cache flushed
    first; results go to out_dir/{workload}-{method}.json."""
    with extra_router(cluster, model, router_options | {"load_balance_method": method}) as url:
        for workload in workloads:
            flush(url)
            fields = workload_fields[workload]
            bench(url, f"{workload}-{method}", out_dir, workload=workload, **fields)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(RoutingConfig, __doc__.splitlines()[0], argv)
    config: RoutingConfig = args.config
    device = resolve_device(config.device)
    profile = config.profile_on(device)
    sizes = config.sizes(PROFILES[profile])
    workloads = _items(config.workloads)
    methods = []
    for method in _items(config.methods):
        refused = method_accepted(method)
        if refused is None:
            methods.append(method)
        else:
            console.print(
                f"[yellow]skipping --load-balance-method {method}[/yellow]: the "
                f"router does not accept it yet ({refused})"
            )
    if not methods:
        raise ConfigError("the router accepts none of --methods")
    common_fields = {"seed": config.seed, "max_duration_s": config.max_duration_s}
    workload_fields = {
        "multiturn": config.multiturn_fields(sizes),
        "trace": common_fields
        | {
            "trace": str(find_trace(config.trace)) if "trace" in workloads else "",
            "trace_skip": sizes["trace_skip"],
            "max_requests": sizes["trace_requests"],
            "trace_speed": config.trace_speed,
            "trace_replay_block_size": sizes["trace_replay_block_size"],
            "max_input_len": sizes["trace_max_input_len"],
            "max_output_len": sizes["trace_max_output_len"],
        },
    }
    flags = [
        *config.rank_flags(args.rank_flags, sizes, device),
        "--disaggregation-decode-enable-radix-cache",
        "--disaggregation-decode-enable-hicache",
        "--disaggregation-decode-hicache-ratio",
        str(config.decode_hicache_ratio),
    ]
    out_dir = Path(config.out)
    preset = config.preset if profile == "gpu" else None
    devices = rank_devices(config.rank_devices, 1 + config.num_decode)
    with model_dir(config.model, preset) as model, tempfile.TemporaryDirectory() as tmp:
        dump_setup(
            out_dir,
            {
                "command": command_line(),
                "machine": machine_line(),
                "device": device,
                "profile": profile,
                "model": model,
                "methods": methods,
                "config": dataclasses.asdict(config),
                "sizes": sizes,
                "rank_flags": flags,
                "router_options": args.router_options,
            },
        )
        launch = LaunchConfig(
            model=model,
            num_prefill=1,
            num_decode=config.num_decode,
            port=0,
            log_dir=str(Path(tmp) / "logs"),
            rank_devices=devices,
            startup_timeout_s=config.startup_timeout_s,
        )
        console.print(f"starting 1 prefill + {config.num_decode} decode ranks: {' '.join(flags)}")
        with launch_cluster(launch, flags, args.router_options) as cluster:
            for method in methods:
                before = pd_transfer(cluster.prefill_urls)
                run_method(
                    method, cluster, model, args.router_options, out_dir, workloads, workload_fields
                )
                after = pd_transfer(cluster.prefill_urls)
                sent = {k: after[k] - before[k] for k in ("pd_sent_bytes", "pd_send_seconds")}
                sent["pd_send_gb_per_s"] = (
                    sent["pd_sent_bytes"] / sent["pd_send_seconds"] / 1e9
                    if sent["pd_send_seconds"]
                    else 0.0
                )
                console.print(transfer_line(f"PD transfer, {method}", sent))
                (out_dir / f"transfer-{method}.json").write_text(json.dumps(sent) + "\n")
    # Every method's results in --out, including earlier commands' (split a long run).
    names = [*METHODS, *(m for m in methods if m not in METHODS)]
    reports: dict[str, list[BenchReport]] = {
        w: [load_report(p) for m in names if (p := out_dir / f"{w}-{m}.json").is_file()]
        for w in workloads
    }
    for workload, runs in reports.items():
        header = (
            f"Routing comparison, {workload}: 1 prefill + {config.num_decode} decode "
            f"ranks (decode L1 {sizes['decode_l1_tokens']} tokens each, L2 = "
            f"{config.decode_hicache_ratio} x L1), {device}."
        )
        write_summary(
            runs, out_dir, f"routing comparison: {workload}", header, prefix=f"{workload}_"
        )
    ok = all(r.num_failed == 0 and not r.timed_out for runs in reports.values() for r in runs)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(run_main(main))
