"""Decode HiCache ablation (issue 8, the reference design's experiment, extended by issue
16): 1 prefill + 1 decode rank; multi-turn conversations whose prompts grow over the
rounds from --first-prompt-len to --last-prompt-len; a decode L1 too small for every
conversation. Settings: classic PD (every prompt through the prefill rank) with the
decode cache off, L1, L1+L2, L1+L2+L3 (file), L1+L2 with HiCache on the prefill rank
too (`prefill_hicache`); local prefill on the decode rank (`local`: L1+L2, auto); local
prefill plus one shared L3 that the prefill rank reuses (`local_reuse`); and one
unified rank with L1+L2, no PD (`unified`). --transport ipc|mooncake. Each cluster is
warmed up first (--max-concurrency random prompts of --first-prompt-len tokens, then every
rank's cache flushed), so no setting pays the kernels' first compiles. Greedy outputs must
be identical across settings (exit status 1 if not; with random bf16 weights on a GPU a
different chunking can flip a near-tie, so read the count it prints).

    PYTHONPATH=. python bench/experiments/decode_hicache_ablation.py [--device cuda]
        [--model DIR] [--out DIR] [size flags] [rank flags, e.g. --max-num-seqs 64]

--profile gpu (auto on CUDA) sizes it for a qwen3-0.6b-shape model (--preset qwen3-8b for
the larger shapes; made in a temp dir unless --model): 4k -> 32k prompts; --profile cpu for
the tiny model: 100 -> 1000. --rank-devices cuda:0,cuda:1 puts the prefill and the decode
rank on their own GPUs; the summary then also gives the bandwidth the PD transfers reached.
--decode-l1-tokens sets --num-kv-pages of every rank (launch_cluster gives both roles the
same pool), so the prefill rank's own cache is as small as the decode rank's. The summary
covers every setting's JSON in --out, so a long run can be split (--settings off,l1 then
--settings l1l2,l1l2l3)."""

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
    machine_line,
    model_dir,
    parse_args,
    rank_devices,
    resolve_device,
    run_main,
    transport_flags,
    warm_up,
    write_summary,
)
from profile_window import ProfileWindow
from rank_metrics import pd_transfer, step_counters, transfer_line
from trace_steps import step_rows, summarize

from kvstrata.bench.report import BenchReport
from kvstrata.bench.run import load_report
from kvstrata.cluster.launch import launch_cluster
from kvstrata.cluster.launch_config import LaunchConfig
from kvstrata.config import ConfigError, opt

SETTINGS = (
    "off", "l1", "l1l2", "l1l2l3", "prefill_hicache", "local", "local_reuse", "unified",
)  # fmt: skip
DEFAULT_SETTINGS = ("off", "l1", "l1l2", "l1l2l3")
LABELS = {
    "off": "decode cache off",
    "l1": "L1",
    "l1l2": "L1+L2",
    "l1l2l3": "L1+L2+L3",
    "prefill_hicache": "L1+L2, prefill HiCache",
    "local": "L1+L2, local prefill",
    "local_reuse": "L1+L2+shared L3, local prefill, prefill reuse",
    "unified": "unified rank L1+L2",
}
# Size defaults per profile; a size flag left at 0 takes its profile's value.
PROFILES: dict[str, dict[str, int]] = {
    "cpu": {
        "num_clients": 8,
        "first_prompt_len": 100,
        "last_prompt_len": 1000,
        "output_len": 16,
        "max_concurrency": 2,
        "decode_l1_tokens": 3072,
    },
    "gpu": {
        "num_clients": 8,
        "first_prompt_len": 4096,
        "last_prompt_len": 32768,
        "output_len": 64,
        "max_concurrency": 2,
        "decode_l1_tokens": 98304,
    },
}


@dataclass(frozen=True)
class AblationConfig(MultiTurnCluster):
    """The experiment's own flags, on the shared section; sizes at 0 come from --profile."""

    num_rounds: int = opt(6, "multiturn: rounds per conversation.")
    max_duration_s: float = opt(400.0, "Bound on each setting's benchmark run.")
    out: str = opt("bench/results/decode_hicache_ablation", "Output directory.")
    settings: str = opt(
        ",".join(DEFAULT_SETTINGS), f"Comma-separated settings to run, of {', '.join(SETTINGS)}."
    )
    transport: str = opt("ipc", "KV transport between the ranks.", ("ipc", "mooncake"))
    local_prefill: str = opt(
        "auto", "Local prefill mode of the `local*` settings.", ("threshold", "auto")
    )
    request_rate: float = opt(0.0, "Request starts per second (0: as soon as possible).")
    profile_window: str = opt(
        "",
        "START_S,LENGTH_S: profile every rank of each setting over that window of its run "
        "(torch profiler, /start_profile) and break the decode rank's GPU time down by step "
        "(trace_steps.py; into OUT/steps-LABEL.json).",
    )

    def __post_init__(self) -> None:
        super().__post_init__()
        bad = [s for s in self.setting_list if s not in SETTINGS]
        if bad or not self.setting_list:
            raise ConfigError(f"--settings: choose from {', '.join(SETTINGS)}; got {bad}")
        _ = self.window_s  # checked here, before any cluster starts

    @property
    def window_s(self) -> tuple[float, float] | None:
        if not self.profile_window:
            return None
        start_s, _, length_s = self.profile_window.partition(",")
        try:
            return float(start_s), float(length_s)
        except ValueError:
            raise ConfigError(
                f"--profile-window: START_S,LENGTH_S, got {self.profile_window!r}"
            ) from None

    @property
    def setting_list(self) -> list[str]:
        return [s.strip() for s in self.settings.split(",") if s.strip()]


def resolve_sizes(config: AblationConfig, profile: str) -> dict[str, int]:
    """The profile's sizes with the flags given; the decode L1 must hold the requests in
    flight (and is reported if it holds every conversation)."""
    sizes = config.sizes(PROFILES[profile])
    longest = sizes["last_prompt_len"] + sizes["output_len"]
    if sizes["decode_l1_tokens"] < sizes["max_concurrency"] * longest:
        raise ConfigError(
            f"--decode-l1-tokens {sizes['decode_l1_tokens']} cannot hold the "
            f"{sizes['max_concurrency']} requests in flight ({longest} tokens each)"
        )
    if sizes["decode_l1_tokens"] >= sizes["num_clients"] * longest:
        console.print("[yellow]warning[/yellow]: decode L1 holds every conversation")
    return sizes


def rank_flags(
    setting: str,
    config: AblationConfig,
    sizes: dict[str, int],
    device: str,
    l3_dir: Path,
    user_flags: list[str],
) -> list[str]:
    """The rank flags of `setting` (`kvstrata launch` gives each role those it takes)."""
    flags = config.rank_flags(user_flags, sizes, device)
    ratio = str(config.decode_hicache_ratio)
    storage = ["--hicache-storage-backend", "file", "--hicache-storage-dir", str(l3_dir)]
    if setting == "unified":  # one rank, no PD: its own L1 + L2
        return [*flags, "--enable-hierarchical-cache", "--hicache-ratio", ratio]
    flags += transport_flags(config.transport)
    local = setting in ("local", "local_reuse")
    flags += ["--disaggregation-decode-local-prefill", config.local_prefill if local else "never"]
    if setting != "off":
        flags.append("--disaggregation-decode-enable-radix-cache")
    if setting != "off" and setting != "l1":
        flags += [
            "--disaggregation-decode-enable-hicache",
            "--disaggregation-decode-hicache-ratio",
            ratio,
        ]
    if setting in ("prefill_hicache", "local_reuse"):  # the prefill rank's L2 (and L3)
        flags += ["--enable-hierarchical-cache", "--hicache-ratio", ratio]
    if setting in ("l1l2l3", "local_reuse"):
        flags += storage  # local_reuse: one L3 directory for both ranks
    return flags


def break_down_steps(profiled: ProfileWindow, decode_urls: list[str], out: Path) -> None:
    """The decode rank's GPU time by step, against the other rank's kernels (same GPU)."""
    for error in profiled.errors:
        console.print(f"[red]profile[/red]: {error}")
    decode = [profiled.traces[url] for url in decode_urls if url in profiled.traces]
    others = [path for url, path in profiled.traces.items() if url not in decode_urls]
    if not decode:
        return
    try:
        rows, facts = step_rows(Path(decode[0]), Path(others[0]) if others else None)
    except ValueError as e:
        console.print(f"profile: {e}")
        return
    table = summarize(rows)
    out.write_text(json.dumps({"table": table, **facts}, indent=1) + "\n")
    for line in table:
        console.print(f"{out.stem}: {line}")


def label(setting: str) -> str:
    return LABELS[setting].replace(" ", "-")


def compare_outputs(reports: list[BenchReport]) -> tuple[bool, str]:
    """Every setting's output ids per (conversation, round) against the first setting's."""

    def outputs(report: BenchReport) -> dict[tuple[int, int], list[int] | None]:
        return {(r.conversation, r.round): r.output_ids for r in report.requests}

    base = outputs(reports[0])
    lines, identical = [], True
    for report in reports[1:]:
        other = outputs(report)
        differ = sum(base.get(k) != other.get(k) for k in set(base) | set(other))
        identical &= differ == 0 and all(v is not None for v in other.values())
        lines.append(
            f"{report.label}: {differ} of {len(base)} requests differ from {reports[0].label}"
        )
    return identical, "; ".join(lines)


def save_transfers(out_dir: Path, transfers: dict[str, dict[str, float]]) -> None:
    """Merge into out_dir/transfer.json (a long run may be split across commands)."""
    merged = load_transfers(out_dir) | transfers
    (out_dir / "transfer.json").write_text(json.dumps(merged, indent=1) + "\n")


def load_transfers(out_dir: Path) -> dict[str, dict[str, float]]:
    path = out_dir / "transfer.json"
    return json.loads(path.read_text()) if path.is_file() else {}


def main(argv: list[str] | None = None) -> int:
    args = parse_args(AblationConfig, __doc__.splitlines()[0], argv)
    config: AblationConfig = args.config
    device = resolve_device(config.device)
    profile = config.profile_on(device)
    sizes = resolve_sizes(config, profile)
    out_dir = Path(config.out)
    preset = config.preset if profile == "gpu" else None
    devices = rank_devices(config.rank_devices, 2)
    transfers: dict[str, dict[str, float]] = {}
    steps: dict[str, dict[str, float]] = {}  # the decode rank's step counters per setting
    with model_dir(config.model, preset) as model, tempfile.TemporaryDirectory() as tmp:
        dump_setup(
            out_dir,
            {
                "command": command_line(),
                "machine": machine_line(),
                "device": device,
                "profile": profile,
                "model": model,
                "config": dataclasses.asdict(config),
                "sizes": sizes,
                "rank_flags": args.rank_flags,
            },
        )
        for setting in config.setting_list:
            flags = rank_flags(
                setting, config, sizes, device, Path(tmp) / f"l3-{setting}", args.rank_flags
            )
            unified = setting == "unified"
            launch = LaunchConfig(
                model=model,
                num_prefill=0 if unified else 1,
                num_decode=1,
                port=0,
                log_dir=str(Path(tmp) / f"logs-{setting}"),
                rank_devices=devices[1:] if unified and devices else devices,
                startup_timeout_s=config.startup_timeout_s,
            )
            console.print(f"[bold]{LABELS[setting]}[/bold]: rank flags {' '.join(flags)}")
            if config.window_s is not None:
                flags += ["--profile-dir", str(Path(tmp) / f"profiles-{setting}")]
            with launch_cluster(launch, flags, args.router_options) as cluster:
                window = config.window_s or (1e9, 0.0)
                ranks = cluster.decode_urls + cluster.prefill_urls
                warm_up(
                    cluster.router_url, ranks, sizes["first_prompt_len"], sizes["max_concurrency"]
                )
                with ProfileWindow(ranks, *window) as profiled:
                    bench(
                        cluster.router_url,
                        label(setting),
                        out_dir,
                        workload="multiturn",
                        request_rate=config.request_rate,
                        **config.multiturn_fields(sizes),
                    )
                break_down_steps(
                    profiled, cluster.decode_urls, out_dir / f"steps-{label(setting)}.json"
                )
                if not unified:
                    transfers[label(setting)] = pd_transfer(cluster.prefill_urls)
                    console.print(transfer_line(label(setting), transfers[label(setting)]))
                steps[label(setting)] = step_counters(cluster.decode_urls)
                console.print(f"{label(setting)} decode rank steps: {steps[label(setting)]}")
        save_transfers(out_dir, transfers)
        merged_steps = out_dir / "steps.json"
        old_steps = json.loads(merged_steps.read_text()) if merged_steps.is_file() else {}
        merged_steps.write_text(json.dumps(old_steps | steps, indent=1) + "\n")
    # Every setting's results in --out, including earlier commands' (split a long run).
    paths = [out_dir / f"{label(s)}.json" for s in SETTINGS]
    reports = [load_report(p) for p in paths if p.is_file()]
    identical, detail = compare_outputs(reports)
    transfer_md = "".join(
        f"\n- PD transfer, {transfer_line(name, t)}" for name, t in load_transfers(out_dir).items()
    )
    verdict = "identical" if identical else "NOT identical"
    header = (
        f"Decode HiCache ablation: 1 prefill + 1 decode rank, {sizes['num_clients']} "
        f"conversations x {config.num_rounds} rounds, prompts {sizes['first_prompt_len']} "
        f"-> ~{sizes['last_prompt_len']} tokens, {sizes['output_len']} output tokens, "
        f"{sizes['max_concurrency']} in flight, L1 {sizes['decode_l1_tokens']} tokens per "
        f"rank, L2 = {config.decode_hicache_ratio} x L1; {device}; transport "
        f"{config.transport}."
    )
    write_summary(
        reports,
        out_dir,
        "decode HiCache ablation",
        header,
        f"\nOutputs across settings: **{verdict}** ({detail}).\n{transfer_md}\n",
    )
    console.print(f"outputs across settings: {verdict} ({detail})")
    ok = all(r.num_failed == 0 and not r.timed_out for r in reports)
    return 0 if identical and ok else 1


if __name__ == "__main__":
    sys.exit(run_main(main))
