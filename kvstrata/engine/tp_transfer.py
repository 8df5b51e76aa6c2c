"""The PD transfers of a tensor-parallel rank, engine side: each follower's end of the
transport (`WorkerTransfer`: its receiver's endpoint on a decode rank, its sender on a
prefill rank), the writes the leader asks of the followers (`SendPages`), the follower's
thread that reports each write's outcome (`FollowerWrites`), and the leader's record of
those outcomes (`TPTransfers`). The transport itself is disagg's (disagg/tp_transfer.py)."""

from __future__ import annotations

import json
import threading
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, NamedTuple, Protocol

if TYPE_CHECKING:
    from multiprocessing.connection import Connection

    from kvstrata.model.tp import TPGroup

WATCH_POLL_S = 0.0005  # how often a follower polls its writes in flight
ENDPOINT_KEY = "transfer-endpoint/{rank}"


class Pollable(Protocol):
    """A write under way (disagg's `PendingWrite`): True once in place; raises if failed."""

    def poll(self) -> bool: ...


class Followers(Protocol):
    """What the leader's record needs of its followers (`tp_runner.TPWorkers`)."""

    group: TPGroup
    reports: list[Connection]  # each follower's WriteReports, in rank order

    def send(self, command: object) -> None: ...

    def lost(self) -> str | None: ...


class WorkerTransfer(Protocol):
    """A follower's end of the rank's PD transport, built by the rank's role factory."""

    def endpoint(self) -> dict[str, Any] | None:
        """Its receiver's endpoint (decode rank), or None."""
        ...

    def start(
        self, endpoint: dict[str, Any], src_page_ids: list[int], dst_page_ids: list[int]
    ) -> Pollable:
        """Start writing its head slice of `src_page_ids` into `endpoint` (prefill rank)."""
        ...

    def close(self) -> None: ...


@dataclass(frozen=True)
class SendPages:
    """Write each follower's slice of pages `src_page_ids` into `dst_page_ids` of the
    endpoint `endpoints[rank - 1]` (the decode rank's matching worker)."""

    write_id: int
    endpoints: list[dict[str, Any]]
    src_page_ids: list[int]
    dst_page_ids: list[int]


class WriteReport(NamedTuple):
    """A follower's write `write_id` ended: landed (`error` None) or failed."""

    rank: int
    write_id: int
    error: str | None


def publish_endpoint(group: TPGroup, transfer: WorkerTransfer | None) -> None:
    """Put this follower's receiver endpoint (or null) where the leader reads it."""
    endpoint = transfer.endpoint() if transfer is not None else None
    group.publish(ENDPOINT_KEY.format(rank=group.rank), json.dumps(endpoint))


def follower_endpoints(group: TPGroup) -> list[dict[str, Any]]:
    """The followers' receiver endpoints, in rank order ([] where they have none)."""
    found = [json.loads(group.read(ENDPOINT_KEY.format(rank=r))) for r in range(1, group.size)]
    return [endpoint for endpoint in found if endpoint is not None]


class FollowerWrites:
    """A follower's writes in flight, polled on their own thread (the command loop waits
    in the leader's broadcast); each one's outcome goes to the leader once."""

    def __init__(self, rank: int, transfer: WorkerTransfer, reports: Connection) -> None:
        self.rank, self.transfer, self.reports = rank, transfer, reports
        self._send_lock = threading.Lock()  # the command loop and the watch both report
        self._pending: list[tuple[int, Pollable]] = []
        self._wake = threading.Condition()
        self._closed = False
        self._thread = threading.Thread(target=self._watch, name="kvstrata-tp-writes", daemon=True)
        self._thread.start()

    def start(self, command: SendPages) -> None:
        """Start this worker's slice of the write; a refusal is reported, never raised
        (the leader learns every outcome from the reports alone)."""
        try:
            endpoint = command.endpoints[self.rank - 1]
            write = self.transfer.start(endpoint, command.src_page_ids, command.dst_page_ids)
        except Exception as e:  # this room's failure alone, whatever the transport raised
            self._report(command.write_id, _describe(e))
            return
        with self._wake:
            self._pending.append((command.write_id, write))
            self._wake.notify()

    def _watch(self) -> None:
        while True:
            with self._wake:
                while not self._pending and not self._closed:
                    self._wake.wait()
                if self._closed:
                    return
                pending = list(self._pending)
            ended: set[int] = set()
            for write_id, write in pending:
                try:
                    if not write.poll():
                        continue
                    error = None
                except Exception as e:
                    error = _describe(e)
                ended.add(write_id)
                self._report(write_id, error)
            with self._wake:
                self._pending = [item for item in self._pending if item[0] not in ended]
            if not ended:
                time.sleep(WATCH_POLL_S)

    def _report(self, write_id: int, error: str | None) -> None:
        with self._send_lock:
            self.reports.send(WriteReport(self.rank, write_id, error))

    def close(self) -> None:
        with self._wake:
            self._closed = True
            self._wake.notify()
        self._thread.join()
        self.transfer.close()


def _describe(error: Exception) -> str:
    return str(error) or type(error).__name__


class WriteOutcome(NamedTuple):
    """Every follower's slice of one write ended; `error` is the first failure's."""

    error: str | None


class TPTransfers:
    """The leader's side: the followers' receiver endpoints (decode rank) and the writes
    it asked of them (prefill rank), settled as their reports arrive."""

    def __init__(self, workers: Followers, endpoints: list[dict[str, Any]]) -> None:
        self.workers = workers
        self.size = workers.group.size
        self.endpoints = endpoints
        self._next_write_id = 0
        self._reports: dict[int, list[WriteReport]] = {}

    def start(
        self, endpoints: list[dict[str, Any]], src_page_ids: list[int], dst_page_ids: list[int]
    ) -> int:
        """Ask every follower to write its slice; returns the write's id."""
        write_id, self._next_write_id = self._next_write_id, self._next_write_id + 1
        self._reports[write_id] = []
        self.workers.send(SendPages(write_id, endpoints, list(src_page_ids), list(dst_page_ids)))
        return write_id

    def outcome(self, write_id: int) -> WriteOutcome | None:
        """The write's outcome once every follower reported (given once), else None; a
        lost follower fails it (its slice can never be confirmed)."""
        self._drain()
        reports = self._reports[write_id]
        if len(reports) < self.size - 1:
            if self.workers.lost() is None:
                return None
            reports = [*reports, WriteReport(0, write_id, self.workers.lost())]
        del self._reports[write_id]
        errors = [report.error for report in reports if report.error is not None]
        return WriteOutcome(errors[0] if errors else None)

    def _drain(self) -> None:
        for reports in self.workers.reports:
            try:
                while reports.poll():
                    report: WriteReport = reports.recv()
                    if report.write_id in self._reports:
                        self._reports[report.write_id].append(report)
            except (EOFError, OSError):  # its follower is gone: `lost` says so
                continue
