"""What the experiment scripts share: flags split between the script, the router and the
ranks, and the flag sections of the multi-turn cluster experiments (`MultiTurnCluster`) and
the one-pair latency experiments (`OnePairRun`); the device check before anything is
built; the model (a random one unless --model, `random_model.py`); a launched cluster per
configuration; one `kvstrata bench` run; and the comparison written to --out."""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import platform
import random
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, TypeVar

import httpx
from random_model import Stopped, stop_signals
from random_model import model_dir as model_dir  # the scripts take it from here

from kvstrata.bench.config import BenchConfig
from kvstrata.bench.report import BenchReport
from kvstrata.bench.run import run_bench, save_report
from kvstrata.bench.tables import make_console, markdown_comparison, print_comparison
from kvstrata.cluster.launch import Child, Cluster, ClusterStartError, launch_cluster
from kvstrata.cluster.launch_config import LAUNCHER_ROUTER_FIELDS, LaunchConfig
from kvstrata.config import (
    ConfigError,
    RouterConfig,
    add_config_args,
    config_from_args,
    flag,
    opt,
    to_argv,
)

T = TypeVar("T")
console = make_console()
# Router fields an experiment sets itself; the other RouterConfig fields pass through.
EXPERIMENT_ROUTER_FIELDS = (*LAUNCHER_ROUTER_FIELDS, "load_balance_method")
_ROUTER_START_TIMEOUT_S = 120.0
# The mooncake transport between ranks of one host: tcp, peers exchange metadata directly.
MOONCAKE_TCP = '{"metadata_server": "P2PHANDSHAKE", "protocol": "tcp"}'


@dataclasses.dataclass(frozen=True)
class Args:
    """The parsed command line: the script's config, router options, rank flags."""

    config: Any
    router_options: dict[str, Any]
    rank_flags: list[str]


@dataclasses.dataclass(frozen=True)
class MultiTurnCluster:
    """The flags both multi-turn cluster experiments take (decode_hicache_ablation.py,
    routing_comparison.py; each script's config is built on this section): the model and
    where its ranks run, the size profile, the multi-turn workload's sizes (0: the
    profile's value), the decode L1 and L2, and the bounds of a run."""

    model: str = opt("", "Model directory; default: a random model in a temp dir.")
    device: str = opt("auto", "Device of every rank: auto, cpu, cuda.")
    rank_devices: str = opt(
        "", "Device of each rank, prefill first, comma-separated (e.g. cuda:0,cuda:1)."
    )
    preset: str = opt(
        "qwen3-0.6b", "Shapes of the random model of --profile gpu.", ("qwen3-0.6b", "qwen3-8b")
    )
    profile: str = opt(
        "auto", "Size defaults: auto (gpu on CUDA), cpu, gpu.", ("auto", "cpu", "gpu")
    )
    num_clients: int = opt(0, "multiturn: conversations.")
    num_rounds: int = opt(4, "multiturn: rounds per conversation.")
    first_prompt_len: int = opt(0, "multiturn: prompt tokens of round 1.")
    last_prompt_len: int = opt(0, "multiturn: prompt tokens of the last round (about).")
    output_len: int = opt(0, "multiturn: output tokens per request.")
    max_concurrency: int = opt(
        0, "multiturn: requests in flight at once (the rest of the conversations wait "
        "between rounds).",
    )  # fmt: skip
    decode_l1_tokens: int = opt(0, "L1 KV pool of each rank, in tokens.")
    decode_hicache_ratio: float = opt(2.0, "Decode L2 size as a multiple of L1.")
    page_size: int = opt(16, "Tokens per KV page.")
    startup_timeout_s: float = opt(600.0, "Longest wait for a cluster to start.")
    max_duration_s: float = opt(300.0, "Bound on each benchmark run.")
    seed: int = opt(0, "Seed of the synthetic prompts.")

    def __post_init__(self) -> None:
        if self.num_rounds < 2:
            raise ConfigError(f"--num-rounds must be >= 2, got {self.num_rounds}")

    def profile_on(self, device: str) -> str:
        """--profile, with auto decided by the resolved `device`."""
        if self.profile != "auto":
            return self.profile
        return "gpu" if device == "cuda" else "cpu"

    def sizes(self, profile_sizes: dict[str, int]) -> dict[str, int]:
        """`profile_sizes` with the size flags given, plus `question_len`: the new user
        tokens per round, so the last prompt is about last_prompt_len (each round adds the
        previous answer and a question)."""
        sizes = {name: getattr(self, name) or value for name, value in profile_sizes.items()}
        step = (sizes["last_prompt_len"] - sizes["first_prompt_len"]) // (self.num_rounds - 1)
        sizes["question_len"] = step - sizes["output_len"]
        if sizes["question_len"] < 1:
            raise ConfigError("--last-prompt-len is too close to --first-prompt-len for the rounds")
        return sizes

    def rank_flags(self, user_flags: list[str], sizes: dict[str, int], device: str) -> list[str]:
        """The flags every rank gets: the user's, the page size, an L1 pool of
        --decode-l1-tokens, the device unless --rank-devices, quiet logs, and on CUDA
        graphs for the largest decode batch (max_concurrency sequences)."""
        flags = [*user_flags, "--page-size", str(self.page_size),
                 "--num-kv-pages", str(sizes["decode_l1_tokens"] // self.page_size)]  # fmt: skip
        if not self.rank_devices:
            flags += ["--device", device]
        flags = with_default(flags, "log_level", "warning")
        if device == "cuda":
            max_bs = str(max(8, sizes["max_concurrency"]))
            flags = with_default(flags, "cuda_graph_max_bs", max_bs)
        return flags

    def multiturn_fields(self, sizes: dict[str, int]) -> dict[str, Any]:
        """The `kvstrata bench` fields of the multi-turn workload at `sizes`."""
        return {
            "num_clients": sizes["num_clients"], "num_rounds": self.num_rounds,
            "first_prompt_len": sizes["first_prompt_len"],
            "question_len": sizes["question_len"], "output_len": sizes["output_len"],
            "max_concurrency": sizes["max_concurrency"], "seed": self.seed,
            "max_duration_s": self.max_duration_s,
        }  # fmt: skip


@dataclasses.dataclass(frozen=True)
class OnePairRun:
    """The flags both one-pair latency experiments take (pd_overlap.py, pd_l3_restore.py;
    each script's config is built on this section): the model, the device and transport
    of the ranks, every rank's step budget and L1 pool, and the start-up bound."""

    model: str = opt("", "Model directory; default: a random model in a temp dir.")
    preset: str = opt("qwen3-8b", "Shapes of the random model.", ("qwen3-0.6b", "qwen3-8b"))
    device: str = opt("cuda", "Device of every rank.")
    transport: str = opt("mooncake", "KV transport.", ("ipc", "mooncake"))
    chunk_tokens: int = opt(2048, "--max-num-batched-tokens of every rank (prefill chunks).")
    num_kv_pages: int = opt(2048, "L1 pages of every rank.")
    startup_timeout_s: float = opt(600.0, "Longest wait for a cluster to start.")
    mooncake_config: str = opt(MOONCAKE_TCP, "--disaggregation-mooncake-config of the ranks.")

    def rank_flags(self, max_model_len: int) -> list[str]:
        """The flags every rank gets; --max-model-len `max_model_len` unless given."""
        flags = ["--device", self.device, "--page-size", "16", "--log-level", "warning",
                 "--num-kv-pages", str(self.num_kv_pages),
                 "--max-num-batched-tokens", str(self.chunk_tokens)]  # fmt: skip
        return with_default(flags, "max_model_len", str(max_model_len))

    def pd_flags(self) -> list[str]:
        """What the ranks of a pair add: every prompt through the prefill rank, whose
        radix cache is off (the decode rank keeps none unless asked), over --transport."""
        pd = ["--disaggregation-decode-local-prefill", "never", "--disable-radix-cache"]
        return [*pd, *transport_flags(self.transport, self.mooncake_config)]


def transport_flags(transport: str, mooncake_config: str = MOONCAKE_TCP) -> list[str]:
    """The rank flags of an experiment's --transport (ipc, the default: none)."""
    if transport != "mooncake":
        return []
    return ["--disaggregation-transfer-backend", "mooncake",
            "--disaggregation-mooncake-config", mooncake_config]  # fmt: skip


def parse_args(cls: type[T], description: str, argv: Sequence[str] | None = None) -> Args:
    """Flags of `cls` (a frozen config dataclass) and of RouterConfig are the script's;
    every other flag goes to the ranks (checked by launch_cluster before anything starts)."""
    parser = argparse.ArgumentParser(description=description, allow_abbrev=False)
    add_config_args(parser, cls)
    add_config_args(parser, RouterConfig, skip=EXPERIMENT_ROUTER_FIELDS)
    namespace, rank_flags = parser.parse_known_args(argv)
    router_options = {
        f.name: getattr(namespace, f.name)
        for f in dataclasses.fields(RouterConfig)
        if f.name not in EXPERIMENT_ROUTER_FIELDS and getattr(namespace, f.name) is not None
    }
    try:
        return Args(config_from_args(cls, namespace), router_options, rank_flags)
    except ConfigError as e:
        parser.error(str(e))
        raise  # unreachable: parser.error exits


def run_main(main: Callable[[], int]) -> int:
    """An experiment script's entry: a bad flag, a missing input or a cluster that cannot
    start ends in one line naming it (and exit status 2), not a traceback. SIGTERM, SIGHUP
    and SIGINT stop it with every cleanup run: clusters stopped, temp dirs (the random
    model's included) removed; exit status 128 + the signal."""
    name = Path(sys.argv[0]).name
    try:
        with stop_signals():
            return main()
    except (ConfigError, ClusterStartError) as e:
        print(f"{name}: error: {e}", file=sys.stderr)
        return 2
    except (Stopped, KeyboardInterrupt) as e:
        signum = e.signum if isinstance(e, Stopped) else signal.SIGINT
        print(f"{name}: stopped by {signal.Signals(signum).name}; cleaned up", file=sys.stderr)
        return 128 + signum


def require_cuda(device: str) -> None:
    """Refuse a CUDA --device on a host where torch sees none, before anything is built
    (the ranks would fail only after minutes of building random qwen3-8b weights)."""
    if not device.startswith("cuda"):
        return
    import torch

    if not torch.cuda.is_available():
        raise ConfigError(
            f"--device {device}: torch sees no CUDA device on this host, and this experiment "
            "measures GPU ranks. To run it on the CPU anyway, pass --device cpu (with "
            "--preset qwen3-0.6b or --model DIR: random qwen3-8b weights take minutes and "
            "16 GB of disk to build on a CPU)"
        )


def resolve_device(device: str) -> str:
    """Either "cpu" or "cuda"; `auto` asks torch (imported only here), and cuda must be
    there (`require_cuda`)."""
    if device != "auto":
        require_cuda(device)
        return "cpu" if device == "cpu" else "cuda"
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


@contextlib.contextmanager
def one_pair(
    model: str, log_dir: Path, pd: bool, flags: list[str], startup_timeout_s: float
) -> Iterator[Cluster]:
    """1 prefill + 1 decode rank behind a router, or one unified rank when not `pd`."""
    launch = LaunchConfig(
        model=model, num_prefill=1 if pd else 0, num_decode=1, port=0, log_dir=str(log_dir),
        startup_timeout_s=startup_timeout_s,
    )  # fmt: skip
    with launch_cluster(launch, flags) as cluster:
        yield cluster


def with_default(flags: list[str], name: str, value: str) -> list[str]:
    """`flags` plus `--name value` unless the user already gave --name."""
    option = flag(name)
    given = any(f == option or f.startswith(option + "=") for f in flags)
    return flags if given else [*flags, option, value]


def method_accepted(method: str) -> str | None:
    """None if the router accepts `--load-balance-method method`, else why not."""
    try:
        RouterConfig(decode=("http://127.0.0.1:1",), load_balance_method=method)
    except ConfigError as e:
        return str(e)
    return None


@contextlib.contextmanager
def extra_router(cluster: Cluster, model: str, options: dict[str, Any]) -> Iterator[str]:
    """Another router over the cluster's ranks (e.g. with another policy), stopped on
    exit. Yields its URL."""
    argv = [
        "router",
        "--prefill",
        *cluster.prefill_urls,
        "--decode",
        *cluster.decode_urls,
        "--host",
        "127.0.0.1",
        "--model",
        model,
        *to_argv(options),
        *cluster.router_key_argv,  # the cluster key (a file), as the launched router has
    ]
    name = f"router-{options.get('load_balance_method', 'extra')}"
    child = Child(name, argv, "127.0.0.1", cluster.log_dir / f"{name}.log", fixed_port=0)
    child.start()
    try:
        deadline_s = time.monotonic() + _ROUTER_START_TIMEOUT_S
        while True:
            if child.exit_code is not None:
                raise RuntimeError(f"{name} exited while starting:\n{child.log_tail()}")
            with contextlib.suppress(httpx.TransportError):
                if httpx.get(child.url + "/health", timeout=2).status_code == 200:
                    break
            if time.monotonic() > deadline_s:
                raise RuntimeError(f"{name} was not healthy in time:\n{child.log_tail()}")
            time.sleep(0.2)
        yield child.url
    finally:
        assert child.proc is not None
        child.proc.terminate()
        try:
            child.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            child.proc.kill()
            child.proc.wait()


def rank_devices(text: str, num_ranks: int) -> tuple[str, ...]:
    """--rank-devices "cuda:0,cuda:1,...": one per rank, prefill first (or empty)."""
    devices = tuple(d.strip() for d in text.split(",") if d.strip())
    if devices and len(devices) != num_ranks:
        raise ConfigError(f"--rank-devices needs {num_ranks} devices, got {len(devices)}")
    return devices


def flush(url: str) -> None:
    """Empty every rank's L1 and L2 (L3 keeps its pages) once no request runs."""
    response = httpx.post(url + "/flush_cache", params={"wait": "true"}, timeout=120)
    if response.status_code != 200:
        raise RuntimeError(f"POST {url}/flush_cache answered {response.status_code}")


def warm_up(router_url: str, rank_urls: Sequence[str], prompt_len: int, num_prompts: int) -> None:
    """Run what a measured run will run before it is measured, then empty every rank's L1
    and L2: `num_prompts` random prompts of `prompt_len` tokens at once through the router.
    On a fresh box the first prompts of a rank pay its kernels' JIT compiles (about 1 s of
    TTFT on an H200), which would land on whichever setting runs first."""
    vocab_size = httpx.get(router_url + "/server_info", timeout=30).json().get("vocab_size") or 500
    rng = random.Random(7)
    prompts = [[rng.randrange(vocab_size) for _ in range(prompt_len)] for _ in range(num_prompts)]

    def generate(prompt: list[int]) -> None:
        params = {"max_new_tokens": 4, "temperature": 0, "ignore_eos": True}
        body = {"input_ids": prompt, "sampling_params": params}
        httpx.post(router_url + "/generate", json=body, timeout=600).raise_for_status()

    with ThreadPoolExecutor(num_prompts) as pool:
        list(pool.map(generate, prompts))
    for url in rank_urls:
        flush(url)


def bench(url: str, label: str, out_dir: Path, **fields: Any) -> BenchReport:
    """One `kvstrata bench` run; its JSON is written to out_dir/label.json."""
    config = BenchConfig(url=url, label=label, **fields)
    report = run_bench(config, make_console(stderr=True))
    save_report(report, out_dir / f"{label}.json")
    console.print(
        f"{label}: {report.num_ok}/{report.num_requests} ok, TTFT mean "
        f"{report.ttft_s.mean * 1e3:.1f} ms, hit rate {report.tiers.hit_rate:.1%}"
    )
    return report


def write_summary(
    reports: list[BenchReport],
    out_dir: Path,
    title: str,
    header: str,
    extra_md: str = "",
    prefix: str = "",
) -> None:
    """Print the comparison and write charts (if matplotlib is there) and a markdown
    snippet (`{prefix}summary.md`) into out_dir."""
    print_comparison(reports, console, title)
    markdown = f"{header}\n\n{markdown_comparison(reports)}{extra_md}"
    (out_dir / f"{prefix}summary.md").write_text(markdown)
    try:
        from kvstrata.bench.plots import write_charts

        paths = write_charts(reports, out_dir / "plots", prefix=prefix)
        console.print("charts: " + ", ".join(str(p) for p in paths))
    except ImportError:
        console.print(
            "matplotlib is not installed: no charts; later run kvstrata bench "
            f"compare {out_dir}/*.json --plot DIR"
        )
    console.print(f"wrote {out_dir / f'{prefix}summary.md'}")


def machine_line() -> str:
    return f"{platform.node()} ({platform.machine()}, Python {platform.python_version()})"


def command_line() -> str:
    return " ".join(["python", *sys.argv])


def dump_setup(out_dir: Path, setup: dict[str, Any]) -> None:
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "setup.json").write_text(json.dumps(setup, indent=1, default=str) + "\n")
