"""The transport contract. A decode rank's `KVReceiver` exposes its L1 pool and describes
it as a JSON-able endpoint; a prefill rank's `KVSender` connects to endpoints and writes
whole pages (all layers, K and V) into them, synchronously or as a `PendingWrite`."""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Protocol

from kvstrata.disagg.transport.endpoints import Endpoint
from kvstrata.kvcache.pages import KVPool


class TransferError(RuntimeError):
    """A write could not complete; the room fails, the rank keeps serving."""


class KVReceiver(ABC):
    """Decode side: owns nothing but the description of its pool."""

    @abstractmethod
    def endpoint(self) -> Endpoint:
        """What a sender needs to reach this pool (must round-trip through JSON)."""

    def close(self) -> None:  # noqa: B027 - optional
        """Release transport resources (shared segments, registrations)."""


class PendingWrite(Protocol):
    """A write on its way. The local pages it reads must stay put until it settles."""

    def poll(self) -> bool:
        """True once the data is in place, False while in flight; raises TransferError if
        the write failed or was given up (then it may still land: see the transport)."""
        ...


class _Written:
    def poll(self) -> bool:
        return True


WRITTEN: PendingWrite = _Written()  # a write that completed before `start` returned


class KVSender(ABC):
    """Prefill side: writes pages of its own pool into remote pools."""

    def __init__(self, pool: KVPool) -> None:
        self.pool = pool

    @property
    def page_bytes(self) -> int:
        """The bytes one page's write moves (a tensor-parallel rank's: every slice's)."""
        return self.pool.page_bytes

    @abstractmethod
    def write(self, endpoint: Endpoint, src_page_ids: list[int], dst_page_ids: list[int]) -> None:
        """Copy local pages `src_page_ids` into the endpoint's pages `dst_page_ids`.
        Returns when the data is in place; raises TransferError otherwise."""

    def start(
        self, endpoint: Endpoint, src_page_ids: list[int], dst_page_ids: list[int]
    ) -> PendingWrite:
        """`write`, returning once it is under way (poll it); raises TransferError for a
        write refused up front. This default writes before returning."""
        self.write(endpoint, src_page_ids, dst_page_ids)
        return WRITTEN

    def close(self) -> None:  # noqa: B027 - optional
        """Drop cached connections."""


def check_shapes(local: KVPool, remote_shape: list[int], remote_dtype: str) -> None:
    """A remote pool must have this pool's layout apart from its page count."""
    local_shape = list(local.data.shape)
    if remote_shape[:2] != local_shape[:2] or remote_shape[3:] != local_shape[3:]:
        raise TransferError(f"remote KV pool shape {remote_shape} does not match {local_shape}")
    if remote_dtype != str(local.data.dtype):
        raise TransferError(f"remote KV dtype {remote_dtype} differs from {local.data.dtype}")
