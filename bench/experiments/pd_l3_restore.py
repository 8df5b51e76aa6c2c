"""L3 restore beside the PD transfer (issue 17.3): time to first token of a conversation's
second turn when the decode rank holds its first turn only in L3 (its L1 and L2 flushed),
through 1 prefill + 1 decode rank (no local prefill, the prefill rank without a cache),
with the decode rank's L3 read serial (the task waits for it) and parallel (the task goes
out at once; the read runs beside the prefill and the transfer), against one unified rank
with the same L3 and against classic PD (no decode cache), all in one run.

    PYTHONPATH=. python bench/experiments/pd_l3_restore.py --model DIR --device cuda \
        --transport mooncake --history-len 8192 --new-len 4096 --out DIR

Bound: parallel TTFT ~ max(L3 read, prefill + transfer); serial ~ their sum."""

from __future__ import annotations

import json
import random
import statistics
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import httpx
from common import (
    OnePairRun,
    command_line,
    flush,
    machine_line,
    model_dir,
    one_pair,
    parse_args,
    require_cuda,
    run_main,
)

from kvstrata.config import opt

SETTINGS = ("classic", "serial", "parallel", "unified")


@dataclass(frozen=True)
class RestoreConfig(OnePairRun):
    """The experiment's own flags, on the shared section."""

    chunk_tokens: int = opt(4096, "--max-num-batched-tokens of every rank.")
    settings: str = opt(",".join(SETTINGS), f"Comma-separated, of {', '.join(SETTINGS)}.")
    history_len: int = opt(8192, "Tokens of each conversation's first turn (then in L3 only).")
    new_len: int = opt(4096, "New tokens of the second turn (computed by the prefill rank).")
    num_conversations: int = opt(4, "Conversations, one at a time (the first warms up).")
    out: str = opt("bench/results/pd_l3_restore", "Output directory.")


def rank_flags(config: RestoreConfig, setting: str, l3_dir: Path) -> list[str]:
    flags = config.rank_flags(max_model_len=config.history_len + config.new_len + 64)
    storage = ["--hicache-storage-backend", "file", "--hicache-storage-dir", str(l3_dir),
               "--hicache-storage-prefetch-policy", "wait_complete"]  # fmt: skip
    if setting == "unified":
        return [*flags, "--enable-hierarchical-cache", *storage]
    flags += config.pd_flags()
    if setting == "classic":
        return flags
    flags += ["--disaggregation-decode-enable-radix-cache",
              "--disaggregation-decode-enable-hicache", *storage]  # fmt: skip
    if setting == "serial":
        flags.append("--no-disaggregation-decode-parallel-restore")
    return flags


def generate(http: httpx.Client, prompt: list[int], max_tokens: int) -> tuple[float, list[int]]:
    body = {"input_ids": prompt, "sampling_params": {"max_new_tokens": max_tokens,
                                                     "temperature": 0}}  # fmt: skip
    start_s = time.perf_counter()
    response = http.post("/generate", json=body)
    if response.status_code != 200:
        raise RuntimeError(f"{response.status_code}: {response.text[:300]}")
    return time.perf_counter() - start_s, response.json()["output_ids"]


def decode_metrics(url: str) -> dict[str, float]:
    text = httpx.get(url + "/metrics", timeout=30).text
    wanted = ("pd_parallel_restore", "pd_restore_repair", "hicache_hit_tokens_l3")
    out: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith("kvstrata_") and any(w in line for w in wanted):
            name, _, value = line.rpartition(" ")
            out[name.removeprefix("kvstrata_")] = float(value)
    return out


def second_turns(url: str, decode_url: str, config: RestoreConfig, seed: int) -> dict[str, Any]:
    """Turn 1 of every conversation, a flush (L3 keeps the pages), then each turn 2."""
    rng = random.Random(seed)
    histories = [
        [rng.randrange(1, 500) for _ in range(config.history_len)]
        for _ in range(config.num_conversations)
    ]
    with httpx.Client(base_url=url, timeout=600) as http:
        firsts = [generate(http, history, 1)[1] for history in histories]
        flush(url)
        ttfts, outputs = [], []
        for history, first in zip(histories, firsts):
            new = [rng.randrange(1, 500) for _ in range(config.new_len)]
            ttft_s, output = generate(http, history + first + new, 1)
            ttfts.append(ttft_s)
            outputs.append(output)
    return {"ttft_s": ttfts, "outputs": outputs, "decode_metrics": decode_metrics(decode_url)}


def main(argv: list[str] | None = None) -> int:
    args = parse_args(RestoreConfig, __doc__.splitlines()[0], argv)
    config: RestoreConfig = args.config
    require_cuda(config.device)  # before minutes of building random weights for nothing
    out_dir = Path(config.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    results: dict[str, dict[str, Any]] = {}
    with model_dir(config.model, config.preset) as model, tempfile.TemporaryDirectory() as tmp:
        for setting in config.settings.split(","):
            flags = rank_flags(config, setting, Path(tmp) / f"l3-{setting}")
            pd = setting != "unified"
            with one_pair(
                model, Path(tmp) / setting, pd, flags, config.startup_timeout_s
            ) as cluster:
                run = second_turns(cluster.router_url, cluster.decode_urls[0], config, 0)
            warm = run["ttft_s"][1:] or run["ttft_s"]  # the first conversation warms up
            run["ttft_mean_s"] = statistics.mean(warm)
            results[setting] = run
            print(f"{setting}: turn-2 TTFT {[round(t, 3) for t in run['ttft_s']]} s, "
                  f"{run['decode_metrics']}", flush=True)  # fmt: skip
    first = next(iter(results.values()))["outputs"]
    same = all(run["outputs"] == first for run in results.values())
    summary = {
        "command": command_line(), "machine": machine_line(), "config": asdict(config),
        "ttft_mean_s": {s: run["ttft_mean_s"] for s, run in results.items()},
        "outputs_equal": same, "runs": results,
    }  # fmt: skip
    (out_dir / "pd_l3_restore.json").write_text(json.dumps(summary, indent=1) + "\n")
    means = ", ".join(f"{s} {t:.3f} s" for s, t in summary["ttft_mean_s"].items())
    print(f"turn-2 TTFT mean: {means}; outputs equal across settings: {same}")
    return 0


if __name__ == "__main__":
    sys.exit(run_main(main))
