"""Streamed PD writes against their bound (issue 17.2): time to first token of cold
prompts through 1 prefill + 1 decode rank (no decode cache, no local prefill), with the
prefill rank's writes streamed per chunk and written once at the end, against the two
parts measured alone in the same run: the prefill compute (one unified rank, same chunk
budget) and the transfer (the prefill rank's write time per room when it writes last).

    PYTHONPATH=. python bench/experiments/pd_overlap.py --model DIR --device cuda \
        --transport mooncake --prompt-len 16384 --num-prompts 4 --out DIR

Target: streamed TTFT <= 1.15 x max(compute, transfer). Other flags go to every rank
(e.g. --kv-cache-dtype fp8)."""

from __future__ import annotations

import json
import random
import statistics
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import httpx
from common import (
    OnePairRun,
    command_line,
    machine_line,
    model_dir,
    one_pair,
    parse_args,
    require_cuda,
    run_main,
)
from rank_metrics import pd_transfer

from kvstrata.config import opt


@dataclass(frozen=True)
class OverlapConfig(OnePairRun):
    """The experiment's own flags, on the shared section."""

    prompt_len: int = opt(16384, "Tokens of each cold prompt.")
    num_prompts: int = opt(4, "Cold prompts, sent one at a time (the first warms up).")
    out: str = opt("bench/results/pd_overlap", "Output directory.")


def rank_flags(config: OverlapConfig, setting: str) -> list[str]:
    flags = config.rank_flags(max_model_len=config.prompt_len + 64)
    if setting == "unified":
        return [*flags, "--disable-radix-cache"]
    flags += config.pd_flags()
    return [*flags, "--stream-writes", "off" if setting == "pd_serial" else "on"]


def ttfts(url: str, config: OverlapConfig, seed: int) -> list[float]:
    """Seconds until each cold prompt's only token (one request at a time)."""
    rng = random.Random(seed)
    out = []
    with httpx.Client(base_url=url, timeout=600) as http:
        for _ in range(config.num_prompts):
            prompt = [rng.randrange(1, 500) for _ in range(config.prompt_len)]
            body = {"input_ids": prompt, "sampling_params": {"max_new_tokens": 1,
                                                             "temperature": 0}}  # fmt: skip
            start_s = time.perf_counter()
            response = http.post("/generate", json=body)
            if response.status_code != 200:
                raise RuntimeError(f"{response.status_code}: {response.text[:300]}")
            out.append(time.perf_counter() - start_s)
    return out


def main(argv: list[str] | None = None) -> int:
    args = parse_args(OverlapConfig, __doc__.splitlines()[0], argv)
    config: OverlapConfig = args.config
    require_cuda(config.device)  # before minutes of building random weights for nothing
    out_dir = Path(config.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    results: dict[str, dict[str, object]] = {}
    with model_dir(config.model, config.preset) as model, tempfile.TemporaryDirectory() as tmp:
        for seed, setting in enumerate(("unified", "pd_serial", "pd_stream")):
            flags = [*args.rank_flags, *rank_flags(config, setting)]  # the user's first
            pd = setting != "unified"
            with one_pair(
                model, Path(tmp) / setting, pd, flags, config.startup_timeout_s
            ) as cluster:
                measured = ttfts(cluster.router_url, config, seed)
                transfer = pd_transfer(cluster.prefill_urls) if cluster.prefill_urls else {}
            warm = measured[1:] or measured  # the first prompt compiles and warms up
            results[setting] = {"ttft_s": measured, "ttft_mean_s": statistics.mean(warm)}
            if transfer:
                results[setting]["transfer"] = transfer
            print(f"{setting}: TTFT {[round(t, 3) for t in measured]} s", flush=True)
            if pd and not transfer.get("pd_sent_bytes"):
                # A prefill rank that refuses every task leaves the decode rank to recompute
                # each prompt itself: the TTFTs look like the unified rank's, and mean nothing.
                raise SystemExit(f"{setting}: the prefill rank sent no KV (see the rank logs)")
    compute_s = float(results["unified"]["ttft_mean_s"])  # type: ignore[arg-type]
    serial = results["pd_serial"]["transfer"]
    num_rooms = config.num_prompts
    transfer_s = float(serial["pd_send_seconds"]) / num_rooms  # type: ignore[index]
    streamed_s = float(results["pd_stream"]["ttft_mean_s"])  # type: ignore[arg-type]
    bound_s = max(compute_s, transfer_s)
    summary = {
        "command": command_line(), "machine": machine_line(), "config": asdict(config),
        "compute_s": compute_s, "transfer_s_per_room": transfer_s,
        "serial_ttft_s": results["pd_serial"]["ttft_mean_s"], "streamed_ttft_s": streamed_s,
        "bound_s": bound_s, "streamed_over_bound": streamed_s / bound_s, "runs": results,
    }  # fmt: skip
    (out_dir / "pd_overlap.json").write_text(json.dumps(summary, indent=1) + "\n")
    print(
        f"compute alone {compute_s:.3f} s, transfer alone {transfer_s:.3f} s per room, "
        f"serial PD {summary['serial_ttft_s']:.3f} s, streamed PD {streamed_s:.3f} s = "
        f"{streamed_s / bound_s:.2f} x max(compute, transfer)"
    )
    return 0


if __name__ == "__main__":
    sys.exit(run_main(main))
