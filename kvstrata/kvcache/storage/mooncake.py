"""`MooncakeStorage`: L3 pages in a Mooncake Store (`mooncake_master` + the store client of
the `mooncake` package), with the shared MAC-signed page header, bounded-time calls and
reconnection."""

from __future__ import annotations

import re
import socket
import threading
import time
import urllib.parse
from collections.abc import Callable, Sequence
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Any

import numpy as np
import torch

from kvstrata.kvcache.hashing import hash_hex
from kvstrata.kvcache.storage.base import StorageBackend, check_key, log
from kvstrata.kvcache.storage.blocking import BlockingCaller
from kvstrata.kvcache.storage.mooncake_config import MooncakeConfig
from kvstrata.kvcache.storage.page_format import HEADER_BYTES, PageMac, encode_header, verify
from kvstrata.kvcache.storage.staging import StagingSlots
from kvstrata.kvcache.storage.trust import L3Trust, process_mac_key

# Status codes of the store client (Mooncake's ErrorCode enum, types.h).
OBJECT_NOT_FOUND = -704
OBJECT_ALREADY_EXISTS = -705


class MooncakeStorage(StorageBackend):
    """Invariants: every store call runs on a `BlockingCaller` worker and is awaited at most
    `timeout_s`; store calls read and write only staging slots; the client is only used
    between a successful `setup` and `close`. The client library reconnects by itself
    after a master restart (the restarted master holds no pages: all are misses). Anyone
    who reaches the master can write objects: a page is used only if its MAC verifies,
    checked in its staging slot before it is copied to L2."""

    name = "mooncake"

    def __init__(
        self,
        config: MooncakeConfig,
        page_bytes: int,
        namespace: bytes,
        trust: L3Trust | None = None,
    ) -> None:
        key = (trust or L3Trust()).mac_key
        if key is None:
            # A store has no private place for a key of its own: one per process.
            log.warning(
                "mooncake storage: no L3 page key (--hicache-storage-key-file, or the "
                "cluster key of a served rank): this process signs its pages with a key of "
                "its own, so no other process can use them"
            )
            key = process_mac_key()
        super().__init__(page_bytes, namespace, PageMac(key))
        try:
            from mooncake.store import MooncakeDistributedStore
        except ImportError as e:
            raise RuntimeError(
                "--hicache-storage-backend mooncake needs the Mooncake store client: "
                "pip install mooncake-transfer-engine-non-cuda (CPU) or "
                f"mooncake-transfer-engine (CUDA); import failed: {e}"
            ) from e
        self.config = config
        self._store_class = MooncakeDistributedStore
        # Namespace tag in every key: clear() removes this namespace's pages only.
        self._key_prefix = f"kvs-{namespace[:8].hex()}-"
        object_bytes = HEADER_BYTES + page_bytes
        self._staging = StagingSlots(max(2, config.staging_bytes // object_bytes), object_bytes)
        self._caller = BlockingCaller(config.io_threads, "kv-mooncake")
        self._state_lock = threading.Lock()
        self._client: Any = None
        self._connecting = False
        self._closed = False
        self._next_connect_s = 0.0
        self._first_attempt_done = threading.Event()
        self._start_connect()
        self._first_attempt_done.wait(config.setup_timeout_s)
        if self._client is None:
            log.warning(
                "mooncake storage: no connection to master %s within %g s; L3 misses until "
                "it answers",
                config.master_server_address,
                config.setup_timeout_s,
            )

    def store_key(self, key: bytes) -> str:
        return self._key_prefix + hash_hex(key)

    # ---- connection -------------------------------------------------------------------

    def _start_connect(self) -> None:
        with self._state_lock:
            if self._connecting or self._closed or self._client is not None:
                return
            self._connecting = True
        # A plain daemon thread: setup may block for long in the library.
        threading.Thread(target=self._connect, name="kv-mooncake-setup", daemon=True).start()

    def _connect(self) -> None:
        c = self.config
        try:
            # setup() against a master that is down retries for ~90 s WITHOUT releasing
            # the GIL, freezing every thread of the process: probe the ports first.
            for address in (c.master_server_address, c.metadata_server):
                if not _accepts_connections(address, c.timeout_s):
                    raise RuntimeError(f"{address} does not accept connections")
            store = self._store_class()
            rc = store.setup(
                c.local_hostname,
                c.metadata_server,
                c.global_segment_size,
                c.local_buffer_size,
                c.protocol,
                c.device_name,
                c.master_server_address,
            )
            if rc != 0:
                raise RuntimeError(f"setup returned {rc}")
            rc = store.register_buffer(self._staging.base_ptr, self._staging.buffer.nbytes)
            if rc != 0:  # tcp copes without; rdma would fail each transfer (counted)
                log.warning("mooncake storage: register_buffer returned %d", rc)
            with self._state_lock:
                if self._closed:
                    store.close()
                    return
                self._client = store
            log.info("mooncake storage: connected to master %s", c.master_server_address)
        except Exception as e:
            self._note_error("connect", 0, f"master {c.master_server_address}: {e}")
            self._next_connect_s = time.monotonic() + c.retry_interval_s
        finally:
            with self._state_lock:
                self._connecting = False
            self._first_attempt_done.set()

    def _client_or_none(self, op: str, num_keys: int, counter: str = "num_errors") -> Any:
        client = self._client
        if client is None or self._closed:
            if time.monotonic() >= self._next_connect_s:
                self._start_connect()
            why = "backend closed" if self._closed else "not connected to the Mooncake master"
            self._note_error(op, num_keys, why, counter)
            return None
        return client

    def _call(self, op: str, num_keys: int, fn: Any, *args: Any, counter: str = "num_errors"):
        """fn(*args) with the timeout; None (counted, logged) on a timeout or an exception."""
        try:
            return self._caller.call(fn, *args, timeout_s=self.config.timeout_s)
        except Exception as e:
            self._note_error(op, num_keys, repr(e), counter)
            return None

    def _call_keys(
        self, op: str, keys: Sequence[bytes], method: Callable[[Any], Any], *args: Any
    ) -> list[int]:
        """`method(client)` over the store keys of `keys` (checked first) and `args`, with
        the timeout: its status codes, or [] with no keys, no client or a failed call."""
        for key in keys:
            check_key(key)
        if not keys or (client := self._client_or_none(op, len(keys))) is None:
            return []
        return self._call(op, len(keys), method(client), self._keys(keys), *args) or []

    # ---- the contract -------------------------------------------------------------------

    def batch_exists(self, keys: Sequence[bytes]) -> int:
        codes = self._call_keys("exists", keys, lambda client: client.batch_is_exist)
        num_present = 0
        for code in codes:
            if code != 1:
                if code < 0:
                    self._note_error("exists", 1, f"status {code}")
                break
            num_present += 1
        return num_present

    def batch_get(self, keys: Sequence[bytes], host_pages: Sequence[torch.Tensor]) -> list[bool]:
        self._check_args(keys, host_pages)
        start_s = time.perf_counter()
        results = [False] * len(keys)
        client = self._client_or_none("get", len(keys)) if keys else None
        done = 0
        while client is not None and done < len(keys):
            slots = self._staging.acquire(len(keys) - done, self.config.timeout_s)
            if not slots:
                self._note_error("get", len(keys) - done, "no free staging slot (stuck calls)")
                break
            chunk = range(done, done + len(slots))
            future = self._caller.submit(
                client.batch_get_into,
                self._keys(keys[i] for i in chunk),
                [self._staging.ptr(s) for s in slots],
                [self._staging.object_bytes] * len(slots),
            )
            codes = self._await(future, slots, "get", len(keys) - done)
            if codes is None:
                break  # a dead or frozen store: do not queue more calls behind it
            for i, slot, code in zip(chunk, slots, codes):
                results[i] = self._accept(client, keys[i], host_pages[i], slot, code)
            self._staging.release(slots)
            done += len(slots)
        self._count_gets(results, start_s)
        return results

    def _accept(self, client: Any, key: bytes, page: torch.Tensor, slot: int, code: int) -> bool:
        """Verifies the object fetched into `slot`; copies its payload into `page` if intact."""
        if code == OBJECT_NOT_FOUND:
            return False
        if code < 0:
            self._note_error("get", 1, f"status {code}")
            return False
        blob = self._staging.view(slot)[:code]
        header, payload = blob[:HEADER_BYTES], blob[HEADER_BYTES:]
        check = verify(header.data, payload.data, self.namespace, key, self.page_bytes, self.mac)
        if not check.ok:
            self._note_corrupt(key, check)
            # Drop it so a later set can store a good copy (sets skip present keys).
            self._caller.submit(client.remove, self.store_key(key), True)
            return False
        page.copy_(torch.from_numpy(payload))
        return True

    def batch_set(self, keys: Sequence[bytes], host_pages: Sequence[torch.Tensor]) -> list[bool]:
        self._check_args(keys, host_pages)
        start_s = time.perf_counter()
        results = [False] * len(keys)
        num_skipped = 0
        client = self._client_or_none("set", len(keys), "num_set_failures") if keys else None
        present = None
        if client is not None:
            present = self._call(
                "set",
                len(keys),
                client.batch_is_exist,
                self._keys(keys),
                counter="num_set_failures",
            )
        missing = []
        for i, code in enumerate(present or []):
            if code == 1:
                results[i] = True
                num_skipped += 1
            else:
                missing.append(i)
        done = 0
        while client is not None and present is not None and done < len(missing):
            slots = self._staging.acquire(len(missing) - done, self.config.timeout_s)
            if not slots:
                self._note_error(
                    "set", len(missing) - done, "no free staging slot", "num_set_failures"
                )
                break
            chunk = missing[done : done + len(slots)]
            for i, slot in zip(chunk, slots):
                self._fill(slot, keys[i], host_pages[i])
            future = self._caller.submit(
                client.batch_put_from,
                self._keys(keys[i] for i in chunk),
                [self._staging.ptr(s) for s in slots],
                [self._staging.object_bytes] * len(slots),
            )
            codes = self._await(future, slots, "set", len(missing) - done, "num_set_failures")
            if codes is None:
                break
            self._staging.release(slots)
            for i, code in zip(chunk, codes):
                results[i] = code in (0, OBJECT_ALREADY_EXISTS)
                if not results[i]:
                    self._note_error("set", 1, f"status {code}", "num_set_failures")
            done += len(slots)
        num_written = sum(results) - num_skipped
        self._count_sets(num_written, num_skipped, start_s)
        return results

    def _fill(self, slot: int, key: bytes, page: torch.Tensor) -> None:
        blob = self._staging.view(slot)
        payload = blob[HEADER_BYTES:]
        torch.from_numpy(payload).copy_(page)
        # MAC the copy, not the live L2 page: what is stored is what was signed.
        blob[:HEADER_BYTES] = np.frombuffer(
            encode_header(self.namespace, key, payload.data, self.mac), dtype=np.uint8
        )

    def _await(
        self, future: Any, slots: list[int], op: str, num_keys: int, counter: str = "num_errors"
    ) -> list[int] | None:
        """The call's status codes, or None after a timeout or an error. On a timeout the
        slots stay taken until the call really returns (it may still write them)."""
        try:
            codes = future.result(timeout=self.config.timeout_s)
            if len(codes) != len(slots):
                raise RuntimeError(f"{len(codes)} statuses for {len(slots)} keys")
            return list(codes)
        except Exception as e:
            if future.cancel() or future.done():
                self._staging.release(slots)
            else:
                future.add_done_callback(lambda _: self._staging.release(slots))
            timed_out = isinstance(e, FutureTimeout)
            detail = f"no answer within {self.config.timeout_s:g} s" if timed_out else repr(e)
            self._note_error(op, num_keys, detail, counter)
            return None

    def delete(self, keys: Sequence[bytes]) -> int:
        codes = self._call_keys("delete", keys, lambda client: client.batch_remove, True)
        return sum(1 for code in codes if code == 0)

    def clear(self) -> int:
        if (client := self._client_or_none("clear", 0)) is None:
            return 0
        pattern = "^" + re.escape(self._key_prefix)
        num_removed = self._call("clear", 0, client.remove_by_regex, pattern, True)
        if num_removed is None or num_removed < 0:
            if num_removed is not None:
                self._note_error("clear", 0, f"status {num_removed}")
            return 0
        return num_removed

    def close(self) -> None:
        with self._state_lock:
            if self._closed:
                return
            self._closed = True
            client, self._client = self._client, None
        if client is None:
            self._caller.shutdown(wait_s=0)
            return
        # Closing the client under a running call crashes the library: only when idle.
        if not self._caller.shutdown(wait_s=self.config.timeout_s):
            log.warning("mooncake storage: a store call is still running; client left open")
            return

        def close_client() -> None:
            client.unregister_buffer(self._staging.base_ptr)
            client.close()

        # close() talks to the master too: bounded like every other call.
        closer = threading.Thread(target=close_client, name="kv-mooncake-close", daemon=True)
        closer.start()
        closer.join(self.config.timeout_s)

    def _keys(self, keys: Any) -> list[str]:
        return [self.store_key(key) for key in keys]


def _accepts_connections(address: str, timeout_s: float) -> bool:
    """Whether "host:port" or "http://host:port/..." accepts a TCP connection. Addresses of
    other forms (P2PHANDSHAKE, etcd lists) are not probed: True."""
    if address.startswith(("http://", "https://")):
        parsed = urllib.parse.urlsplit(address)
        host, port = parsed.hostname, parsed.port or (443 if parsed.scheme == "https" else 80)
    else:
        host, sep, port_text = address.rpartition(":")
        if not sep or not port_text.isdigit() or not host:
            return True
        host, port = host.strip("[]"), int(port_text)
    try:
        with socket.create_connection((host, port), timeout=timeout_s):
            return True
    except OSError:
        return False
