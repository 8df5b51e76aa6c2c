"""Helpers of the PD end-to-end tests: prefill and decode `kvstrata serve` processes on
loopback, a /generate call, and the unified reference outputs."""

from __future__ import annotations

from pathlib import Path

import httpx
from server_harness import ServerProcess, start_server

from kvstrata import LLM, SamplingParams

PAGE = 4
MAX_NEW = 6
COMMON = ("--page-size", str(PAGE), "--max-model-len", "512", "--log-level", "warning")
DECODE_CACHES: dict[str, tuple[str, ...]] = {
    "off": (),
    "l1": ("--disaggregation-decode-enable-radix-cache",),
    "l1l2": (
        "--disaggregation-decode-enable-radix-cache", "--disaggregation-decode-enable-hicache",
        "--disaggregation-decode-hicache-ratio", "4",
    ),
}  # fmt: skip


def decode_l3_flags(l3_dir: Path) -> tuple[str, ...]:
    return DECODE_CACHES["l1l2"] + (
        "--hicache-storage-backend", "file", "--hicache-storage-dir", str(l3_dir),
        "--hicache-storage-prefetch-policy", "wait_complete", "--hicache-prefetch-threshold", "4",
    )  # fmt: skip


def start_prefill(model: Path, logs: Path, *flags: str) -> ServerProcess:
    return start_server(
        model, logs, "--disaggregation-mode", "prefill", "--num-kv-pages", "512", *COMMON, *flags
    )


def start_decode(model: Path, logs: Path, prefill_urls: list[str], *flags: str) -> ServerProcess:
    return start_server(
        model, logs, "--disaggregation-mode", "decode", "--num-kv-pages", "128",
        "--prefill-urls", ",".join(prefill_urls), *COMMON,
        # These tests exercise the prefill rank's path; flags may choose local prefill.
        "--disaggregation-decode-local-prefill", "never", *flags,
    )  # fmt: skip


def generate(http: httpx.Client, prompt: list[int], **headers: str) -> httpx.Response:
    return http.post(
        "/generate",
        json={
            "input_ids": prompt,
            "sampling_params": {"max_new_tokens": MAX_NEW, "temperature": 0, "ignore_eos": True},
        },
        headers=headers,
    )


def unified(model: Path, prompts: list[list[int]]) -> list[list[int]]:
    llm = LLM(str(model), page_size=PAGE, disable_radix_cache=True, num_kv_pages=256)
    params = SamplingParams(max_tokens=MAX_NEW, temperature=0.0, ignore_eos=True)
    return [o.output_ids for o in llm.generate(input_ids=prompts, sampling_params=params)]


def assert_rank_idle(http: httpx.Client) -> None:
    """No request, no room, no lock, every page free or cached."""
    load = http.get("/get_load").json()
    assert load["num_running_reqs"] == load["num_waiting_reqs"] == 0, load
    assert load["num_pd_rooms"] == 0 and load["num_locked_pages"] == 0, load
    assert load["num_used_pages"] == 0, load
    assert load["num_free_pages"] + load["num_cached_pages"] == load["num_total_pages"], load
