"""L3 pages a rank did not write with its key are refused (issue 27.4), with real processes:
an attacker rewrites a served rank's `file` L3 pages of a prompt with another prompt's KV
from a rank of their own (format version 1 with its checksum, then version 2 MACed with a
guessed key); the rank serves the cold run's greedy tokens, counts the refusals in
/metrics and recomputes. A rank with another key refuses the first one's pages and shows
its key nowhere; a shared directory stops a rank at start. The same forgery against a
Mooncake Store (the test's own mooncake_master) is refused too."""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
from pathlib import Path

import httpx
import torch
from cluster_key import TEST_CLUSTER_KEY
from l3_forgery import FORGED_VERSIONS, HEADER_BYTES, forged_page
from mooncake_fixtures import MooncakeMaster
from server_harness import ServerProcess, assert_idle, start_server

from kvstrata import LLM, EngineConfig, SamplingParams
from kvstrata.kvcache.factory import namespace_of
from kvstrata.kvcache.hashing import page_hashes

PAGE = 4
PROMPT_LEN = 70
NUM_PAGES = (PROMPT_LEN - 1) // PAGE  # the whole pages a repeat of the prompt can match
GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
SHARED_FLAG = "--hicache-storage-allow-shared-dir"


def l3_options(**extra: object) -> dict[str, object]:
    return dict(
        page_size=PAGE, num_kv_pages=256, enable_hierarchical_cache=True,
        hicache_storage_prefetch_policy="wait_complete", hicache_prefetch_threshold=4, **extra,
    )  # fmt: skip


def rank_flags(l3_dir: Path, *extra: str) -> tuple[str, ...]:
    return (
        "--page-size", str(PAGE), "--num-kv-pages", "256", "--max-model-len", "256",
        "--enable-hierarchical-cache", "--hicache-storage-backend", "file",
        "--hicache-storage-dir", str(l3_dir), "--hicache-storage-prefetch-policy",
        "wait_complete", "--hicache-prefetch-threshold", "4", "--log-level", "info", *extra,
    )  # fmt: skip


def prompts() -> tuple[list[int], list[int]]:
    rng = random.Random(27)
    victim, other = ([rng.randrange(500) for _ in range(PROMPT_LEN)] for _ in range(2))
    return victim, other


def hashes(model: Path, tokens: list[int]) -> list[bytes]:
    """What an attacker computes from the public weights and the tokens."""
    namespace = namespace_of(
        EngineConfig.from_flags(model=str(model), page_size=PAGE), torch.float32
    )
    return page_hashes(tokens, PAGE, namespace)[:NUM_PAGES]


def page_path(l3_dir: Path, page_hash: bytes) -> Path:
    return l3_dir / page_hash.hex()[:2] / f"{page_hash.hex()}.kvpage"


def attackers_kv(model: Path, l3_dir: Path, tokens: list[int]) -> tuple[list[int], list[bytes]]:
    """The attacker's own rank of the same model: its cold greedy output of `tokens` and
    the KV payload of each of their pages, read back from its own L3 directory."""
    llm = LLM(str(model), hicache_storage_backend="file", hicache_storage_dir=str(l3_dir),
              **l3_options())  # fmt: skip
    (out,) = llm.generate(input_ids=[tokens], sampling_params=GREEDY)
    llm.engine.flush_cache()  # waits for the L3 writes
    llm.engine.close()
    payloads = [page_path(l3_dir, h).read_bytes()[HEADER_BYTES:] for h in hashes(model, tokens)]
    return out.output_ids, payloads


def generate(http: httpx.Client, prompt: list[int]) -> tuple[list[int], int]:
    """Greedy output ids and the prompt tokens that came from L3."""
    response = http.post("/generate", json={"input_ids": prompt, "sampling_params": {
        "max_new_tokens": 8, "temperature": 0, "ignore_eos": True}})  # fmt: skip
    assert response.status_code == 200, response.text
    body = response.json()
    return body["output_ids"], body["usage"]["kvstrata"]["cached_tokens_l3"]


def metric(http: httpx.Client, name: str) -> float:
    for line in http.get("/metrics").text.splitlines():
        if line.startswith(f"kvstrata_hicache_l3_{name} "):
            return float(line.split()[1])
    raise AssertionError(f"no kvstrata_hicache_l3_{name} in /metrics")


def flush(http: httpx.Client) -> None:
    assert http.post("/flush_cache", params={"wait": "true"}).status_code == 200


def stop(server: ServerProcess) -> None:
    assert server.stop() == 0, server.log()


def test_forged_file_pages_are_refused_and_another_key_reads_nothing(
    tiny_llama: Path, tmp_path: Path
) -> None:
    victim_prompt, other_prompt = prompts()
    l3_dir = tmp_path / "l3"
    other_key = "another-rank-s-l3-secret-0123456789abcdef"
    (tmp_path / "other.key").write_text(other_key + "\n")
    os.chmod(tmp_path / "other.key", 0o600)
    # Both ranks start at once; the second (its own key) waits until the first is done.
    first = start_server(tiny_llama, tmp_path / "logs1", *rank_flags(l3_dir))
    second = start_server(tiny_llama, tmp_path / "logs2", *rank_flags(
        l3_dir, "--hicache-storage-key-file", str(tmp_path / "other.key")))  # fmt: skip
    try:
        cold, _ = attackers_kv(tiny_llama, tmp_path / "attacker-l3", victim_prompt)
        _, other_kv = attackers_kv(tiny_llama, tmp_path / "attacker-l3", other_prompt)
        with httpx.Client(base_url=first.base_url, timeout=120) as http:
            assert generate(http, victim_prompt) == (cold, 0)
            flush(http)
            assert generate(http, victim_prompt) == (cold, NUM_PAGES * PAGE)  # the control
            victim_hashes = hashes(tiny_llama, victim_prompt)
            namespace = namespace_of(
                EngineConfig.from_flags(model=str(tiny_llama), page_size=PAGE), torch.float32
            )
            for version in FORGED_VERSIONS:
                flush(http)
                for page_hash, payload in zip(victim_hashes, other_kv):
                    forged = forged_page(version, namespace, page_hash, payload)
                    page_path(l3_dir, page_hash).write_bytes(forged)
                assert generate(http, victim_prompt) == (cold, 0), f"version {version}"
            # Version 1 is no longer a page format (a miss); version 2 failed its MAC.
            assert metric(http, "num_corrupt_pages") == 2 * NUM_PAGES
            assert metric(http, "num_mac_refused") == NUM_PAGES
            flush(http)  # the recomputed pages were stored again, signed
            assert generate(http, victim_prompt) == (cold, NUM_PAGES * PAGE)
            info = http.get("/server_info").text
            assert TEST_CLUSTER_KEY not in info
            assert_idle(http)
        with httpx.Client(base_url=second.base_url, timeout=120) as http:
            assert generate(http, victim_prompt) == (cold, 0)  # the first rank's key
            assert metric(http, "num_mac_refused") == NUM_PAGES
            info = http.get("/server_info").json()
            assert info["engine_config"]["hicache_storage_key"] == {"is_set": True}
            assert other_key not in json.dumps(info)
            assert_idle(http)
        for rank in (first, second):
            cmdline = Path(f"/proc/{rank.proc.pid}/cmdline").read_bytes().decode()
            assert other_key not in cmdline and TEST_CLUSTER_KEY not in cmdline
    finally:
        stop(first)
        stop(second)
    for rank in (first, second):
        assert other_key not in rank.log() and TEST_CLUSTER_KEY not in rank.log()


def test_a_shared_directory_stops_the_rank_at_start(tiny_llama: Path, tmp_path: Path) -> None:
    shared = tmp_path / "shared"
    shared.mkdir()
    os.chmod(shared, 0o777)
    done = subprocess.run(
        [sys.executable, "-m", "kvstrata", "serve", "--model", str(tiny_llama), "--port", "9",
         *rank_flags(shared)],
        capture_output=True, text=True, timeout=180, check=False,
    )  # fmt: skip
    assert done.returncode == 2, done.stderr
    assert f"{shared} is writable by other users" in done.stderr
    assert SHARED_FLAG in done.stderr


def test_forged_mooncake_pages_are_refused(
    tiny_llama: Path, mooncake_master: MooncakeMaster
) -> None:
    victim_prompt, other_prompt = prompts()
    store = json.dumps(mooncake_master.storage_options(timeout_s=2))

    def rank(secret: str) -> LLM:
        return LLM(str(tiny_llama), hicache_storage_backend="mooncake",
                   hicache_storage_backend_extra_config=store,
                   **l3_options(hicache_storage_key=secret))  # fmt: skip

    victim = rank("the-victim-rank-s-l3-secret-0123456789")
    (cold,) = (o.output_ids for o in victim.generate(input_ids=[victim_prompt],
                                                     sampling_params=GREEDY))  # fmt: skip
    victim.generate(input_ids=[other_prompt], sampling_params=GREEDY)
    assert victim.engine.flush_cache()
    # The attacker reaches the master with a client of their own: objects are readable
    # and writable by anyone who can, under names the page hashes give.
    backend = victim.engine.tiers.l3.backend
    client = backend._client
    for version in FORGED_VERSIONS:
        for victim_hash, other_hash in zip(hashes(tiny_llama, victim_prompt),
                                           hashes(tiny_llama, other_prompt)):  # fmt: skip
            payload = bytes(client.get(backend.store_key(other_hash)))[HEADER_BYTES:]
            forged = forged_page(version, backend.namespace, victim_hash, payload)
            assert client.remove(backend.store_key(victim_hash), True) in (0, -704)
            assert client.put(backend.store_key(victim_hash), forged) == 0
        (out,) = victim.generate(input_ids=[victim_prompt], sampling_params=GREEDY)
        assert (out.output_ids, out.cache_usage.l3_tokens) == (cold, 0), f"version {version}"
        assert victim.engine.flush_cache()
    metrics = victim.engine.metrics()  # what /metrics shows as kvstrata_hicache_l3_*
    assert metrics["hicache_l3_num_corrupt_pages"] == 2 * NUM_PAGES
    assert metrics["hicache_l3_num_mac_refused"] == NUM_PAGES
    (out,) = victim.generate(input_ids=[victim_prompt], sampling_params=GREEDY)
    assert (out.output_ids, out.cache_usage.l3_tokens) == (cold, NUM_PAGES * PAGE)
    assert victim.engine.flush_cache()
    other = rank("another-rank-s-l3-secret-0123456789abc")
    (out,) = other.generate(input_ids=[victim_prompt], sampling_params=GREEDY)
    assert (out.output_ids, out.cache_usage.l3_tokens) == (cold, 0)
    assert other.engine.metrics()["hicache_l3_num_mac_refused"] == NUM_PAGES
    other.engine.close()
    victim.engine.close()
