"""`StagingSlots`: a bounce buffer cut into fixed-size slots that storage calls read into
and write from, handed out and returned under a condition variable."""

from __future__ import annotations

import threading

import numpy as np


class StagingSlots:
    """A registered bounce buffer cut into slots of one stored object (header + page).

    Why not read straight into the L2 page: a call that times out may still write its
    buffer later, after the caller has reused that L2 page. Store calls only ever touch
    slots, and a slot goes back to the free list when its call has really returned."""

    def __init__(self, num_slots: int, object_bytes: int) -> None:
        self.object_bytes = object_bytes
        self.slot_bytes = -(-object_bytes // 64) * 64
        self.buffer = np.zeros(num_slots * self.slot_bytes, dtype=np.uint8)
        self.base_ptr = self.buffer.ctypes.data
        self._free = list(range(num_slots))
        self._changed = threading.Condition()

    def acquire(self, max_slots: int, timeout_s: float) -> list[int]:
        """Up to `max_slots` free slots, waiting up to `timeout_s` for at least one."""
        with self._changed:
            self._changed.wait_for(lambda: self._free, timeout=timeout_s)
            slots = self._free[:max_slots]
            del self._free[: len(slots)]
            return slots

    def release(self, slots: list[int]) -> None:
        with self._changed:
            self._free.extend(slots)
            self._changed.notify_all()

    def view(self, slot: int) -> np.ndarray:
        start = slot * self.slot_bytes
        return self.buffer[start : start + self.object_bytes]

    def ptr(self, slot: int) -> int:
        return self.base_ptr + slot * self.slot_bytes
