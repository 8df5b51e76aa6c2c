"""L3 storage on CPU: the page format, the `file` backend (contract, on-disk faults,
several processes sharing a directory), the factory, Mooncake option parsing and the
bounded-time caller. The real Mooncake Store is in tests/e2e/test_mooncake_storage.py."""

from __future__ import annotations

import logging
import multiprocessing
import shutil
import subprocess
import threading
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import pytest
import storage_contract as contract
import torch

from kvstrata.kvcache.storage import make_storage_backend
from kvstrata.kvcache.storage.blocking import BlockingCaller, CallTimeout
from kvstrata.kvcache.storage.file import FileStorage
from kvstrata.kvcache.storage.mooncake_config import MooncakeConfig, parse_bytes
from kvstrata.kvcache.storage.page_format import (
    HEADER_BYTES,
    PageCheck,
    PageMac,
    check_header,
    encode_header,
    verify,
)

PAGE_BYTES = contract.PAGE_BYTES
NS = contract.NAMESPACE


@pytest.fixture
def store(tmp_path: Path) -> FileStorage:
    return FileStorage(tmp_path / "l3", PAGE_BYTES, NS)


def one_page(backend: FileStorage, salt: int = 0) -> tuple[bytes, torch.Tensor, Path]:
    key, page = contract.keys(1, salt)[0], contract.random_pages(1, seed=salt)[0]
    assert backend.batch_set([key], [page]) == [True]
    return key, page, backend.path_of(key)


def files_under(directory: Path) -> list[str]:
    return sorted(p.name for p in directory.rglob("*") if p.is_file())


# ---- page format -----------------------------------------------------------------------


def test_page_format_detects_each_kind_of_mismatch() -> None:
    key, other_key = contract.keys(2)
    payload = bytes(range(256)) * 4
    mac = PageMac(b"k" * 32)
    header = encode_header(NS, key, payload, mac)
    assert len(header) == HEADER_BYTES
    assert verify(header, payload, NS, key, len(payload), mac) is PageCheck.OK
    flipped = bytearray(payload)
    flipped[100] ^= 1
    assert verify(header, flipped, NS, key, len(payload), mac) is PageCheck.BAD_MAC
    assert verify(header, payload, NS, key, len(payload), PageMac(b"x" * 32)) is PageCheck.BAD_MAC
    assert verify(header, payload, contract.OTHER_NAMESPACE, key, len(payload), mac) is (
        PageCheck.FOREIGN_NAMESPACE
    )
    assert verify(header, payload, NS, other_key, len(payload), mac) is PageCheck.WRONG_HASH
    assert verify(header, payload, NS, key, len(payload) + 1, mac) is PageCheck.WRONG_LENGTH
    assert verify(header, payload[:-1], NS, key, len(payload), mac) is PageCheck.SHORT
    assert check_header(header[:-1], NS, key, len(payload)) is PageCheck.SHORT
    assert check_header(b"XXXX" + header[4:], NS, key, len(payload)) is PageCheck.BAD_MAGIC
    assert check_header(header[:-1] + b"\x01", NS, key, len(payload)) is PageCheck.BAD_MAGIC


# ---- the contract, file backend ----------------------------------------------------------


@pytest.mark.parametrize("check", contract.ALL_CHECKS, ids=lambda c: c.__name__)
def test_file_backend_contract(store: FileStorage, check: Callable[[FileStorage], None]) -> None:
    check(store)


def test_file_backend_contract_one_page_at_a_time(tmp_path: Path) -> None:
    """threads=1, the off switch of reading and writing a batch's pages in parallel."""
    for check in contract.ALL_CHECKS:
        check(FileStorage(tmp_path / check.__name__, PAGE_BYTES, NS, threads=1))


def test_file_layout_fans_out_and_leaves_no_temp_files(tmp_path: Path) -> None:
    backend = FileStorage(tmp_path, PAGE_BYTES, NS, fsync=True)
    page_keys = contract.keys(8)
    assert all(backend.batch_set(page_keys, contract.random_pages(8)))
    for key in page_keys:
        path = backend.path_of(key)
        assert path == tmp_path / key.hex()[:2] / f"{key.hex()}.kvpage"
        assert path.stat().st_size == HEADER_BYTES + PAGE_BYTES
    # The pages, and the directory's own MAC key (made on first use: no key was given).
    assert files_under(tmp_path) == sorted(
        [f"{k.hex()}.kvpage" for k in page_keys] + ["kvstrata-l3.key"]
    )


def test_clear_removes_only_this_namespace_and_its_own_files(tmp_path: Path) -> None:
    mine = FileStorage(tmp_path, PAGE_BYTES, NS)
    theirs = FileStorage(tmp_path, PAGE_BYTES, contract.OTHER_NAMESPACE)
    their_keys = contract.keys(3, salt=50)  # keys are opaque here: any 32 bytes
    assert all(theirs.batch_set(their_keys, contract.random_pages(3)))
    assert all(mine.batch_set(contract.keys(4), contract.random_pages(4)))
    (tmp_path / "README.txt").write_text("not a page")
    (tmp_path / "ab").mkdir(exist_ok=True)
    (tmp_path / "ab" / "notes.kvpage").write_text("not a page name")
    assert mine.clear() == 4
    assert theirs.batch_exists(their_keys) == 3
    assert (tmp_path / "README.txt").exists() and (tmp_path / "ab" / "notes.kvpage").exists()


# ---- on-disk faults: a miss, counted, never wrong bytes ---------------------------------


def test_flipped_payload_byte_is_a_counted_miss_logged_once(
    store: FileStorage, caplog: pytest.LogCaptureFixture
) -> None:
    key, page, path = one_page(store)
    good_bytes = path.read_bytes()
    damaged = bytearray(good_bytes)
    damaged[HEADER_BYTES + 1234] ^= 0x40
    out = contract.host_pool(1)
    with caplog.at_level(logging.WARNING, logger="kvstrata.kvcache.storage"):
        for _ in range(2):  # the read removes the bad file; damage it again
            path.write_bytes(bytes(damaged))
            assert store.batch_get([key], out) == [False]
    stats = store.stats()
    assert (stats.num_corrupt_pages, stats.num_misses, stats.num_hits) == (2, 2, 0)
    assert stats.num_mac_refused == 2
    assert [r.getMessage() for r in caplog.records].count(
        f"file storage: page {key.hex()} is unusable (bad_mac: not written with this rank's "
        "L3 key, or changed since); treated as a miss"
    ) == 1
    # The bad file was dropped, so the next set stores a good copy again.
    assert not path.exists()
    assert store.batch_set([key], [page]) == [True] and store.stats().num_sets == 2
    assert store.batch_get([key], out) == [True] and torch.equal(out[0], page)


def test_page_copied_from_another_namespace_is_a_miss(tmp_path: Path, store: FileStorage) -> None:
    foreign = FileStorage(tmp_path / "other", PAGE_BYTES, contract.OTHER_NAMESPACE)
    key, _, foreign_path = one_page(foreign, salt=7)
    store.path_of(key).parent.mkdir(parents=True, exist_ok=True)
    shutil.copy(foreign_path, store.path_of(key))
    assert store.batch_exists([key]) == 1  # present by name and size ...
    assert store.batch_get([key], contract.host_pool(1)) == [False]  # ... but not ours
    assert store.stats().num_corrupt_pages == 1


def test_page_under_another_key_and_truncated_file_are_misses(store: FileStorage) -> None:
    key_a, _, path_a = one_page(store, salt=1)
    key_b, _, path_b = one_page(store, salt=2)
    shutil.copy(path_a, path_b)  # a's page under b's key: wrong hash
    assert store.batch_get([key_b], contract.host_pool(1)) == [False]
    path_a.write_bytes(path_a.read_bytes()[: HEADER_BYTES + PAGE_BYTES // 2])
    assert store.batch_exists([key_a]) == 0  # a short file does not count as present
    assert store.batch_get([key_a], contract.host_pool(1)) == [False]
    path_a.write_bytes(b"KVSP")  # shorter than a header
    assert store.batch_get([key_a], contract.host_pool(1)) == [False]
    stats = store.stats()
    assert (stats.num_corrupt_pages, stats.num_errors) == (3, 0)


def test_directory_under_a_regular_file_fails_sets_without_raising(tmp_path: Path) -> None:
    (tmp_path / "plain-file").write_text("x")  # root ignores chmod, not ENOTDIR
    backend = FileStorage(tmp_path / "plain-file" / "l3", PAGE_BYTES, NS)
    page_keys = contract.keys(3)
    assert backend.batch_set(page_keys, contract.random_pages(3)) == [False] * 3
    assert backend.batch_get(page_keys, contract.host_pool(3)) == [False] * 3
    assert backend.batch_exists(page_keys) == 0
    assert backend.clear() == 0
    stats = backend.stats()
    assert (stats.num_sets, stats.num_set_failures, stats.num_misses) == (0, 3, 3)


@pytest.fixture
def mounted_tmpfs(tmp_path: Path) -> Iterator[Callable[[str], Path]]:
    """Mounts small tmpfs file systems (root only); skips where mounting is not allowed."""
    mounts: list[Path] = []

    def mount(options: str) -> Path:
        target = tmp_path / f"mnt{len(mounts)}"
        target.mkdir()
        done = subprocess.run(
            # mode=0700: a tmpfs root is 1777, which the file backend refuses (shared).
            ["mount", "-t", "tmpfs", "-o", f"{options},mode=0700", "tmpfs", str(target)],
            capture_output=True,
            check=False,
        )
        if done.returncode != 0:
            pytest.skip(f"cannot mount tmpfs here: {done.stderr.decode().strip()}")
        mounts.append(target)
        return target

    try:
        yield mount
    finally:
        for target in mounts:
            subprocess.run(["umount", "-l", str(target)], check=False)


def test_read_only_file_system_fails_sets_without_raising(
    mounted_tmpfs: Callable[[str], Path],
) -> None:
    backend = FileStorage(mounted_tmpfs("ro,size=1m"), PAGE_BYTES, NS)  # EROFS, even as root
    assert backend.batch_set(contract.keys(2), contract.random_pages(2)) == [False, False]
    assert backend.stats().num_set_failures == 2


def test_full_disk_fails_some_sets_and_keeps_the_rest_whole(
    mounted_tmpfs: Callable[[str], Path],
) -> None:
    directory = mounted_tmpfs("size=64k")  # room for a few pages only
    backend = FileStorage(directory, PAGE_BYTES, NS)
    page_keys, pages = contract.keys(40), contract.random_pages(40)
    results = backend.batch_set(page_keys, pages)
    assert any(results) and not all(results)
    assert backend.stats().num_set_failures == results.count(False)
    assert not [name for name in files_under(directory) if name.endswith(".tmp")]
    out = contract.host_pool(40)
    assert backend.batch_get(page_keys, out) == results
    assert all(torch.equal(out[i], pages[i]) for i, ok in enumerate(results) if ok)


# ---- several processes sharing one directory ---------------------------------------------


def _page_for(key: bytes) -> torch.Tensor:
    rng = np.random.default_rng(int.from_bytes(key[:8], "little"))
    return torch.from_numpy(rng.integers(0, 256, PAGE_BYTES, dtype=np.uint8))


def _share_directory(
    directory: str, worker: int, rounds: int, results: multiprocessing.Queue
) -> None:
    backend = FileStorage(directory, PAGE_BYTES, NS)
    page_keys = contract.keys(24)  # the same keys in every process
    expected = [_page_for(key) for key in page_keys]
    rng = np.random.default_rng(worker)
    num_wrong = num_hits = 0
    for _ in range(rounds):
        order = rng.permutation(len(page_keys))
        backend.batch_set([page_keys[i] for i in order], [expected[i] for i in order])
        if worker == 0:  # one process keeps deleting, so others read during rewrites
            backend.delete([page_keys[i] for i in order[:8]])
        out = contract.host_pool(len(page_keys))
        for i, ok in enumerate(backend.batch_get(page_keys, out)):
            num_hits += ok
            num_wrong += ok and not torch.equal(out[i], expected[i])
    stats = backend.stats()
    results.put((num_wrong, num_hits, stats.num_corrupt_pages, stats.num_errors))


def test_processes_sharing_a_directory_only_ever_read_valid_pages(tmp_path: Path) -> None:
    # spawn, not fork: a forked child deadlocks in torch's OpenMP pool if the parent used it.
    context = multiprocessing.get_context("spawn")
    results = context.Queue()
    workers = [
        context.Process(target=_share_directory, args=(str(tmp_path), w, 12, results))
        for w in range(3)
    ]
    for process in workers:
        process.start()
    outcomes = [results.get(timeout=120) for _ in workers]
    for process in workers:
        process.join(timeout=30)
        assert process.exitcode == 0
    assert all(
        wrong == 0 and corrupt == 0 and errors == 0 for wrong, _, corrupt, errors in outcomes
    )
    assert sum(hits for _, hits, _, _ in outcomes) > 0
    backend = FileStorage(tmp_path, PAGE_BYTES, NS)
    page_keys = contract.keys(24)
    backend.batch_set(page_keys, [_page_for(k) for k in page_keys])
    out = contract.host_pool(24)
    assert backend.batch_get(page_keys, out) == [True] * 24
    assert all(torch.equal(out[i], _page_for(k)) for i, k in enumerate(page_keys))
    assert not [name for name in files_under(tmp_path) if name.endswith(".tmp")]


# ---- factory, Mooncake options, bounded calls --------------------------------------------


def test_factory_builds_file_backend_and_refuses_bad_names_and_options(tmp_path: Path) -> None:
    backend = make_storage_backend("file", PAGE_BYTES, NS, {"directory": str(tmp_path)})
    assert isinstance(backend, FileStorage) and backend.page_bytes == PAGE_BYTES
    with pytest.raises(ValueError, match="--hicache-storage-backend"):
        make_storage_backend("s3", PAGE_BYTES, NS, {})
    with pytest.raises(ValueError, match="--hicache-storage-dir"):
        make_storage_backend("file", PAGE_BYTES, NS, {})
    with pytest.raises(ValueError, match="threads"):
        make_storage_backend("file", PAGE_BYTES, NS, {"directory": str(tmp_path), "threads": 0})
    with pytest.raises(ValueError, match="direcotry"):
        make_storage_backend("file", PAGE_BYTES, NS, {"direcotry": str(tmp_path)})
    with pytest.raises(ValueError, match="master_server_address"):
        make_storage_backend("mooncake", PAGE_BYTES, NS, {"protocol": "tcp"})


def test_mooncake_options_parse_sizes_and_refuse_typos() -> None:
    config = MooncakeConfig.from_options(
        {"master_server_address": "10.0.0.1:50051", "global_segment_size": "4gb",
         "local_buffer_size": "512MiB", "staging_bytes": 1024, "timeout_s": 2}
    )  # fmt: skip
    assert (config.global_segment_size, config.local_buffer_size) == (4 << 30, 512 << 20)
    assert (config.staging_bytes, config.timeout_s, config.protocol) == (1024, 2, "tcp")
    assert parse_bytes("1.5k", "x") == 1536 and parse_bytes("7", "x") == 7
    with pytest.raises(ValueError, match="master_addr"):
        MooncakeConfig.from_options({"master_server_address": "a:1", "master_addr": "b"})
    with pytest.raises(ValueError, match="protocol"):
        MooncakeConfig.from_options({"master_server_address": "a:1", "protocol": "udp"})
    with pytest.raises(ValueError, match="size"):
        MooncakeConfig.from_options({"master_server_address": "a:1", "staging_bytes": "lots"})


def test_blocking_caller_bounds_the_wait_and_drops_abandoned_calls() -> None:
    caller = BlockingCaller(1, "test")
    release = threading.Event()
    ran: list[str] = []
    assert caller.call(lambda x: x + 1, 1, timeout_s=5) == 2
    with pytest.raises(ZeroDivisionError):
        caller.call(lambda: 1 / 0, timeout_s=5)
    with pytest.raises(CallTimeout):
        caller.call(release.wait, timeout_s=0.05)  # occupies the only worker
    with pytest.raises(CallTimeout):
        caller.call(ran.append, "abandoned", timeout_s=0.05)  # queued behind it
    release.set()
    assert caller.call(ran.append, "later", timeout_s=5) is None
    assert ran == ["later"]
    assert caller.shutdown(wait_s=5)
    assert caller.submit(ran.append, "after shutdown").cancelled()
