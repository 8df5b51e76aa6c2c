"""Cache-tier faults under a steady multi-turn load, on a 1 prefill + 1 decode cluster whose
decode rank has a small L1, a tiny L2 and a file L3 (on a tmpfs where one can be mounted):
corrupt and foreign-namespace pages, L3 unwritable and full mid-run, L2 exhausted by
concurrent prefetches, L1 exhausted (preemption). Storage faults never fail a request."""

from __future__ import annotations

import os
import random
import threading
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from fault_cluster import FaultCluster, Mount, wait_for
from fault_load import PAGE_SIZE, Load, Outcome, Reference, generate, judge, serves_correctly

from kvstrata.kvcache.storage.page_format import HEADER_BYTES, PageMac, encode_header

NUM_L1_PAGES = 64  # 256 tokens: two long requests cannot both finish without preemption
NUM_L2_PAGES = 24
PAGE_BYTES = 2048  # the tiny llama: 2 layers x K,V x 4 tokens x 2 heads x 16 dims x fp32
COMMON = ("--page-size", str(PAGE_SIZE), "--max-model-len", "256", "--log-level", "warning")
FOREIGN_NAMESPACE = bytes(range(32))


@pytest.fixture(scope="module")
def cluster(tiny_llama: Path, l3_mount: Mount, tmp_path_factory: pytest.TempPathFactory
            ) -> Iterator[FaultCluster]:  # fmt: skip
    decode_flags = (
        *COMMON, "--num-kv-pages", str(NUM_L1_PAGES),
        "--disaggregation-decode-enable-radix-cache", "--disaggregation-decode-enable-hicache",
        "--disaggregation-decode-hicache-size", repr(NUM_L2_PAGES * PAGE_BYTES / (1 << 30)),
        "--hicache-storage-backend", "file", "--hicache-storage-dir", str(l3_mount.path),
        # Long enough that a file read always lands first: the L3 hits asserted below do
        # not depend on the box's speed.
        "--hicache-storage-prefetch-policy", "timeout", "--hicache-prefetch-timeout-base-s",
        "60", "--hicache-prefetch-threshold", "8",
    )  # fmt: skip
    with FaultCluster(
        tiny_llama, tmp_path_factory.mktemp("tier-logs"),
        prefill_flags=(*COMMON, "--num-kv-pages", "512"), decode_flags=decode_flags,
    ) as started:  # fmt: skip
        yield started
        assert not started.tracebacks(), started.tracebacks()


def decode_metric(cluster: FaultCluster, name: str) -> float:
    return cluster.metric(cluster.decode[0], f"kvstrata_hicache_l3_{name}")


def finish(cluster: FaultCluster, load: Load, reference: Reference) -> list[Outcome]:
    """Stop the load; every request completed exactly (storage faults are only misses);
    nothing is left in flight; the cluster still serves."""
    outcomes = load.stop()
    kinds = judge(outcomes, reference)
    assert kinds["completed"] == len(outcomes) > 0, kinds
    cluster.settle()
    serves_correctly(cluster.url, reference)
    cluster.settle()
    return outcomes


def page_files(directory: Path) -> list[Path]:
    return sorted(directory.rglob("*.kvpage"))


def damage(path: Path, foreign: bool) -> bool:
    """Flip a payload byte, or re-sign the page with another namespace's header."""
    try:
        data = bytearray(path.read_bytes())
        if foreign:
            key = bytes.fromhex(path.stem)
            data[:HEADER_BYTES] = encode_header(
                FOREIGN_NAMESPACE, key, data[HEADER_BYTES:], PageMac(FOREIGN_NAMESPACE)
            )
        else:
            data[-1] ^= 0xFF
        path.write_bytes(bytes(data))
    except (FileNotFoundError, ValueError):
        return False  # replaced or dropped meanwhile, or not a whole page yet
    return True


def replay(cluster: FaultCluster, outcomes: list[Outcome], num: int) -> list[Outcome]:
    """The last `num` completed prompts again, all at once (each on its own client)."""
    prompts = [o.prompt + o.output_ids for o in outcomes if o.kind == "completed"][-num:]
    results: list[Outcome] = []

    def one(prompt: list[int]) -> None:
        with httpx.Client(base_url=cluster.url, timeout=120) as client:
            results.append(generate(client, prompt, stream=False))

    threads = [threading.Thread(target=one, args=(p,)) for p in prompts]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(120)
    assert len(results) == len(prompts)
    return results


def flush(cluster: FaultCluster) -> None:
    """Drop L1 and L2 of every rank (L3 stays) once they are idle."""
    response = httpx.post(cluster.url + "/flush_cache", params={"wait": "true"}, timeout=120)
    assert response.status_code == 200, response.text


def test_corrupt_and_foreign_pages_under_load(
    cluster: FaultCluster, l3_mount: Mount, reference: Reference
) -> None:
    num_damaged = 0
    stop = threading.Event()

    def vandal() -> None:  # rewrites stored pages in place while the rank reads them
        nonlocal num_damaged
        rng = random.Random(3)
        while not stop.is_set():
            for path in page_files(l3_mount.path):
                num_damaged += damage(path, foreign=rng.random() < 0.5)
            stop.wait(0.01)

    with Load(cluster.url, num_conversations=4, seed=1) as load:
        wait_for(lambda: load.num_done >= 6, "6 turns before the fault")
        thread = threading.Thread(target=vandal)
        thread.start()
        done = load.num_done
        wait_for(lambda: load.num_done >= done + 16 and num_damaged >= 10, "16 turns under it")
        stop.set()
        thread.join()
    outcomes = finish(cluster, load, reference)
    # Deterministically through L3: damage every page, drop L1 and L2, replay.
    for i, path in enumerate(page_files(l3_mount.path)):
        damage(path, foreign=i % 2 == 0)
    flush(cluster)
    replayed = replay(cluster, outcomes, 4)
    assert judge(replayed, reference)["completed"] == 4
    assert all(o.usage["kvstrata"]["cached_tokens_l3"] == 0 for o in replayed)
    assert decode_metric(cluster, "num_corrupt_pages") >= 4
    cluster.settle()


def test_l3_unwritable_mid_run(
    cluster: FaultCluster, l3_mount: Mount, reference: Reference
) -> None:
    away = l3_mount.path.with_name("pages-away")
    with Load(cluster.url, num_conversations=4, seed=2) as load:
        wait_for(lambda: load.num_done >= 4, "4 turns before the fault")
        failures = decode_metric(cluster, "num_set_failures")
        if l3_mount.is_tmpfs:
            l3_mount.remount("ro")  # EROFS, even for root; reads still work
        else:  # root ignores permissions: a file where the directory was
            l3_mount.path.rename(away)
            l3_mount.path.write_text("not a directory")
        try:
            wait_for(lambda: decode_metric(cluster, "num_set_failures") > failures,
                     "L3 writes fail")  # fmt: skip
            done = load.num_done
            wait_for(lambda: load.num_done >= done + 4, "4 turns with L3 unwritable")
        finally:
            if l3_mount.is_tmpfs:
                l3_mount.remount("rw")
            else:
                l3_mount.path.unlink()
                away.rename(l3_mount.path)
        num_sets = decode_metric(cluster, "num_sets")
        wait_for(lambda: decode_metric(cluster, "num_sets") > num_sets, "L3 writes work again")
    finish(cluster, load, reference)


def test_l3_disk_full_mid_run(cluster: FaultCluster, l3_mount: Mount, reference: Reference) -> None:
    if not l3_mount.is_tmpfs:
        pytest.skip(f"no tmpfs here ({l3_mount.why_not}); a size-capped directory needs one")
    filler = l3_mount.path / "filler"
    with Load(cluster.url, num_conversations=4, seed=4) as load:
        wait_for(lambda: load.num_done >= 4, "4 turns before the fault")
        failures = decode_metric(cluster, "num_set_failures")
        try:
            # Unbuffered, so closing it has nothing left to write (a buffered file raised
            # ENOSPC again at close when the free space was not a multiple of the chunk).
            with filler.open("wb", buffering=0) as f:  # take every free block
                chunk = b"\0" * (64 << 10)
                try:
                    while True:
                        f.write(chunk)
                except OSError:
                    pass
            wait_for(lambda: decode_metric(cluster, "num_set_failures") > failures,
                     "L3 writes fail with ENOSPC")  # fmt: skip
            done = load.num_done
            wait_for(lambda: load.num_done >= done + 4, "4 turns with L3 full")
        finally:
            filler.unlink(missing_ok=True)  # also after a failure: later tests share L3
        num_sets = decode_metric(cluster, "num_sets")
        wait_for(lambda: decode_metric(cluster, "num_sets") > num_sets, "L3 writes work again")
    finish(cluster, load, reference)
    flush(cluster)  # waits for every L3 write in flight
    # A failed write leaves no partial file behind.
    assert not [p for p in l3_mount.path.rglob("*") if p.name.endswith(".tmp")]
    assert os.statvfs(l3_mount.path).f_bfree > 0


def test_l2_exhausted_by_concurrent_prefetches(cluster: FaultCluster, reference: Reference) -> None:
    with Load(cluster.url, num_conversations=6, seed=5, max_turns=2) as load:
        warm = load.join()
    assert judge(warm, reference)["completed"] == len(warm) == 12
    flush(cluster)  # every conversation's pages now live in L3 only
    replayed = replay(cluster, warm, 6)  # 6 prefetches compete for 24 L2 pages
    assert judge(replayed, reference)["completed"] == 6
    assert sum(o.usage["kvstrata"]["cached_tokens_l3"] for o in replayed) > 0
    counts = cluster.invariants(cluster.decode[0])["counts"]
    assert counts["l2_total_pages"] == NUM_L2_PAGES
    cluster.settle()
    serves_correctly(cluster.url, reference)


def test_l1_exhausted_preempts_and_recomputes(cluster: FaultCluster, reference: Reference) -> None:
    decode = cluster.decode[0]
    preemptions = cluster.invariants(decode)["counts"]["num_preemptions"]
    rng = random.Random(6)
    prompts = [[rng.randrange(500) for _ in range(100)] for _ in range(4)]
    results: list[Outcome] = []

    def one(prompt: list[int]) -> None:  # 140 tokens: 35 of the 64 pages each
        with httpx.Client(base_url=cluster.url, timeout=120) as client:
            results.append(generate(client, prompt, stream=True, max_new_tokens=40))

    # With the prefill rank frozen, the decode rank preallocates rooms for two of them (25
    # pages each) and queues the rest; thawed, both rooms start decoding together, so their
    # growth to 35 pages each must preempt, however the four arrivals were spread in time.
    frozen = cluster.prefill[0]
    threads = [threading.Thread(target=one, args=(p,)) for p in prompts]
    frozen.freeze()
    try:
        for thread in threads:
            thread.start()

        def two_rooms_and_a_queue() -> bool:
            counts = cluster.invariants(decode)["counts"]
            return counts["decode_rooms"] >= 2 and counts["decode_queued"] >= 1

        wait_for(two_rooms_and_a_queue, "two rooms preallocated, the others queued")
    finally:
        frozen.thaw()
    for thread in threads:
        thread.join(180)
    assert judge(results, reference)["completed"] == 4
    assert cluster.invariants(decode)["counts"]["num_preemptions"] > preemptions
    cluster.settle()
    serves_correctly(cluster.url, reference)
