"""The L3 storage contract (`StorageBackend`) and what every backend shares: its counters
(`StorageStats`), argument checks, and the rule that a fault is a logged, counted miss."""

from __future__ import annotations

import logging
import threading
import time
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

import torch

from kvstrata.kvcache.hashing import HASH_BYTES, hash_hex
from kvstrata.kvcache.storage.page_format import PageCheck, PageMac

log = logging.getLogger("kvstrata.kvcache.storage")

_MAX_WARNED_KEYS = 100_000  # bounds the memory of "corrupt page already logged"
_ERROR_LOG_INTERVAL_S = 5.0  # a dead store logs one line per operation kind this often


@dataclass(frozen=True)
class StorageStats:
    """Counters since the backend was created. Keys are counted one by one."""

    num_gets: int = 0  # keys asked for by batch_get
    num_hits: int = 0  # of which filled with an intact page
    num_misses: int = 0  # of which absent, corrupt, foreign, short or failed
    num_sets: int = 0  # keys written by batch_set
    num_set_skipped: int = 0  # keys batch_set found already present
    num_set_failures: int = 0  # keys batch_set could not write (I/O error, full, timeout)
    num_corrupt_pages: int = 0  # stored pages whose header or MAC did not match
    # of which the MAC did not verify: written without this rank's L3 key (forged, or by a
    # rank with another key) or changed since; refused before any byte reached L2
    num_mac_refused: int = 0
    num_errors: int = 0  # keys of failed exists/get/delete calls: I/O errors, timeouts
    bytes_read: int = 0  # payload bytes of hits
    bytes_written: int = 0  # payload bytes of sets
    read_s: float = 0.0  # wall time spent in batch_get
    write_s: float = 0.0  # wall time spent in batch_set


class StorageBackend(ABC):
    """L3 store of whole pages keyed by page hash. Thread-safe: called from I/O threads.

    Contract: no method raises for a storage fault (absent, corrupt, foreign namespace,
    short read, I/O error, timeout, store down): it answers a miss / False, counts it in
    `stats()` and logs it. Only caller bugs (wrong argument shapes) raise ValueError.
    A page returned True by `batch_get` is byte-exact what `batch_set` of a backend with
    the same MAC key stored under that key in this namespace; after a False its host page
    holds unspecified bytes (none of them from a page that failed its checks).
    """

    name: str = "?"

    def __init__(self, page_bytes: int, namespace: bytes, mac: PageMac) -> None:
        if page_bytes < 1:
            raise ValueError(f"page_bytes must be positive, got {page_bytes}")
        if len(namespace) != HASH_BYTES:
            raise ValueError(f"the namespace seed is {HASH_BYTES} bytes, got {len(namespace)}")
        self.page_bytes = page_bytes
        self.namespace = namespace
        self.mac = mac  # signs every page written, verifies every page read
        self._lock = threading.Lock()
        self._counts: dict[str, Any] = asdict(StorageStats())  # StorageStats' fields
        self._warned_keys: set[bytes] = set()
        self._last_error_log_s: dict[str, float] = {}
        self._suppressed_errors: dict[str, int] = {}

    @abstractmethod
    def batch_exists(self, keys: Sequence[bytes]) -> int:
        """Number of LEADING keys present (stops at the first miss)."""

    @abstractmethod
    def batch_get(self, keys: Sequence[bytes], host_pages: Sequence[torch.Tensor]) -> list[bool]:
        """Fill host_pages[i] (1-D contiguous uint8 CPU tensor of page_bytes, a view into
        the L2 pool) in place with page keys[i]; False = miss."""

    @abstractmethod
    def batch_set(self, keys: Sequence[bytes], host_pages: Sequence[torch.Tensor]) -> list[bool]:
        """Store host_pages[i] under keys[i]; a key already present is skipped (True).
        The caller keeps host_pages unchanged until the call returns."""

    @abstractmethod
    def delete(self, keys: Sequence[bytes]) -> int:
        """Remove these keys; returns how many were removed."""

    @abstractmethod
    def clear(self) -> int:
        """Remove every page of this namespace; returns how many were removed."""

    def close(self) -> None:  # noqa: B027 - optional hook: most backends hold nothing
        """Release connections and buffers; the backend answers misses afterwards."""

    @property
    def key_id(self) -> str:
        """A fingerprint of the MAC key (not the key): ranks with equal ids read each
        other's pages."""
        return self.mac.key_id

    def stats(self) -> StorageStats:
        with self._lock:
            return StorageStats(**self._counts)

    # ---- shared by implementations ---------------------------------------------------

    def _check_args(self, keys: Sequence[bytes], host_pages: Sequence[torch.Tensor]) -> None:
        if len(keys) != len(host_pages):
            raise ValueError(f"{len(keys)} keys but {len(host_pages)} host pages")
        for key in keys:
            check_key(key)
        for page in host_pages:
            if (
                page.dtype != torch.uint8
                or page.dim() != 1
                or page.numel() != self.page_bytes
                or page.device.type != "cpu"
                or not page.is_contiguous()
            ):
                raise ValueError(
                    f"a host page must be a contiguous 1-D uint8 CPU tensor of "
                    f"{self.page_bytes} bytes, got {page.dtype} {tuple(page.shape)} "
                    f"on {page.device}"
                )

    def _count(self, **deltas: float) -> None:
        with self._lock:
            for name, delta in deltas.items():
                self._counts[name] += delta

    def _count_gets(self, results: Sequence[bool], start_s: float) -> None:
        """Counts one `batch_get`: its keys, hits and misses, the hits' bytes and the
        wall time since `start_s` (a `time.perf_counter()` reading)."""
        num_hits = sum(results)
        self._count(
            num_gets=len(results),
            num_hits=num_hits,
            num_misses=len(results) - num_hits,
            bytes_read=num_hits * self.page_bytes,
            read_s=time.perf_counter() - start_s,
        )

    def _count_sets(self, num_written: int, num_skipped: int, start_s: float) -> None:
        """Counts one `batch_set`: keys written and found present, the written bytes and
        the wall time since `start_s` (failures are counted where they happen)."""
        self._count(
            num_sets=num_written,
            num_set_skipped=num_skipped,
            bytes_written=num_written * self.page_bytes,
            write_s=time.perf_counter() - start_s,
        )

    def _note_corrupt(self, key: bytes, why: PageCheck | str) -> None:
        """Counts a stored page that failed its check; warns once per key."""
        reason = why.value if isinstance(why, PageCheck) else why
        if why is PageCheck.BAD_MAC:
            reason += ": not written with this rank's L3 key, or changed since"
        with self._lock:
            self._counts["num_corrupt_pages"] += 1
            self._counts["num_mac_refused"] += int(why is PageCheck.BAD_MAC)
            first = key not in self._warned_keys
            if first and len(self._warned_keys) < _MAX_WARNED_KEYS:
                self._warned_keys.add(key)
        if first:
            log.warning(
                "%s storage: page %s is unusable (%s); treated as a miss",
                self.name,
                hash_hex(key),
                reason,
            )

    def _note_error(
        self, op: str, num_keys: int, detail: object, counter: str = "num_errors"
    ) -> None:
        """Counts the keys of a failed storage call in `counter` (`num_set_failures` for
        writes); logs it, at most one line per `op` every few seconds (a store that is
        down must not flood the log)."""
        now = time.monotonic()
        with self._lock:
            self._counts[counter] += num_keys
            last = self._last_error_log_s.get(op)
            if last is not None and now - last < _ERROR_LOG_INTERVAL_S:
                self._suppressed_errors[op] = self._suppressed_errors.get(op, 0) + 1
                return
            self._last_error_log_s[op] = now
            suppressed = self._suppressed_errors.pop(op, 0)
        more = f" ({suppressed} similar errors not logged)" if suppressed else ""
        log.warning(
            "%s storage: %s failed for %d keys: %s%s", self.name, op, num_keys, detail, more
        )


def check_key(key: bytes) -> None:
    if not isinstance(key, bytes) or len(key) != HASH_BYTES:
        raise ValueError(f"a storage key is a {HASH_BYTES}-byte page hash, got {key!r}")
