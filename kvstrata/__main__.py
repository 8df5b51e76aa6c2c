"""The `kvstrata` command line: one sub-command per job, each a thin call into the package."""

from __future__ import annotations

import argparse
import sys

from kvstrata.config import ConfigError, EngineConfig, add_config_args, config_from_args


def _make_tiny_model(args: argparse.Namespace) -> None:
    from kvstrata.model.tiny import make_tiny_model

    path = make_tiny_model(args.dir, arch=args.arch, seed=args.seed)
    print(f"wrote a tiny {args.arch} model to {path}")


def _generate(args: argparse.Namespace) -> None:
    from kvstrata.core import SamplingParams
    from kvstrata.llm import LLM

    llm = LLM.from_config(config_from_args(EngineConfig, args))
    params = SamplingParams(
        max_tokens=args.max_tokens, temperature=args.temperature, seed=args.sampling_seed
    )
    for out in llm.generate([args.prompt], params):
        print(out.text)


def _demo(args: argparse.Namespace) -> None:
    from kvstrata.demo import run_demo

    run_demo(args.dir)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvstrata", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    tiny = sub.add_parser("make-tiny-model", help="Write a small random model and tokenizer.")
    tiny.add_argument("dir", help="Output directory.")
    tiny.add_argument("--arch", choices=("llama", "qwen3"), default="llama")
    tiny.add_argument("--seed", type=int, default=0)
    tiny.set_defaults(func=_make_tiny_model)

    gen = sub.add_parser("generate", help="Generate a completion for one prompt.")
    add_config_args(gen, EngineConfig)
    gen.add_argument("--prompt", required=True, help="Prompt text.")
    gen.add_argument("--max-tokens", type=int, default=32)
    gen.add_argument("--temperature", type=float, default=0.0, help="0 means greedy.")
    gen.add_argument("--sampling-seed", type=int, default=None)
    gen.set_defaults(func=_generate)

    demo = sub.add_parser("demo", help="Make a tiny model and show prefix-cache hits.")
    demo.add_argument("--dir", default=None, help="Where to write the tiny model (temp dir).")
    demo.set_defaults(func=_demo)
    return parser


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    try:
        args.func(args)
    except (ConfigError, ValueError, FileNotFoundError) as e:
        print(f"kvstrata {args.command}: error: {e}", file=sys.stderr)
        sys.exit(2)


if __name__ == "__main__":
    main()
