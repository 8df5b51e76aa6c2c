"""The tensor-parallel group of one rank: its workers (one per device) and the collectives
the sharded model runs (`all_reduce`, `all_gather_last`) and the leader's step broadcast
(`broadcast_object`). `SINGLE`, the group of one, communicates nothing: a TP 1 rank never
touches torch.distributed."""

from __future__ import annotations

import contextlib
import pickle
from datetime import timedelta
from typing import Any, Protocol, cast

import torch
import torch.distributed as dist


class Collectives(Protocol):
    rank: int
    size: int

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum `x` over the group in place; returns it."""
        ...

    def all_gather_last(self, x: torch.Tensor) -> torch.Tensor:
        """[..., n] on each worker -> [..., size * n], worker 0's columns first."""
        ...

    def all_reduce_max(self, x: torch.Tensor) -> torch.Tensor:
        """The elementwise largest `x` over the group, in place; returns it."""
        ...


class _Single:
    """The group of one worker."""

    rank = 0
    size = 1

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        return x

    def all_gather_last(self, x: torch.Tensor) -> torch.Tensor:
        return x

    def all_reduce_max(self, x: torch.Tensor) -> torch.Tensor:
        return x


SINGLE: Collectives = _Single()


def leader_store(host: str, size: int, timeout_s: float) -> dist.TCPStore:
    """The TCP store a TP group meets at, hosted by its leader on a port the system picks
    (taken before any follower starts: no window for another process to take it)."""
    timeout = timedelta(seconds=timeout_s)
    return dist.TCPStore(host, 0, size, is_master=True, timeout=timeout, wait_for_workers=False)


class TPGroup:
    """Worker `rank` of `size`, meeting at the leader's TCP store (`store` on the leader,
    `host:port` on a follower). Two process groups over it: `compute` for the model's
    collectives (NCCL on CUDA, gloo on CPU) and `control` (gloo, host memory) for the
    leader's step broadcast. Standalone groups, not torch.distributed's default one: a
    process may hold several engines, and nothing global is left behind by `close`. Every
    collective waits at most `timeout_s` for a worker that stopped answering, then raises."""

    def __init__(
        self,
        store: dist.TCPStore | tuple[str, int],
        rank: int,
        size: int,
        device: torch.device,
        timeout_s: float,
    ) -> None:
        self.rank, self.size, self.device = rank, size, device
        timeout = timedelta(seconds=timeout_s)
        if isinstance(store, tuple):
            host, port = store
            store = dist.TCPStore(host, port, size, is_master=False, timeout=timeout)
        self._store = store
        control_store = dist.PrefixStore("control", store)
        self.control = dist.ProcessGroupGloo(control_store, rank, size, timeout)
        if device.type == "cuda":
            options = dist.ProcessGroupNCCL.Options()
            options._timeout = timeout
            compute_store = dist.PrefixStore("compute", store)
            self.compute: Any = dist.ProcessGroupNCCL(compute_store, rank, size, options)
        else:
            self.compute = dist.ProcessGroupGloo(
                dist.PrefixStore("compute", store), rank, size, timeout
            )

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        self.compute.allreduce([x]).wait()
        return x

    def all_reduce_max(self, x: torch.Tensor) -> torch.Tensor:
        options = dist.AllreduceOptions()
        options.reduceOp = cast(Any, dist.ReduceOp.MAX)  # the stubs: RedOpType
        self.compute.allreduce([x], options).wait()
        return x

    def all_gather_last(self, x: torch.Tensor) -> torch.Tensor:
        x = x.contiguous()
        parts = [torch.empty_like(x) for _ in range(self.size)]
        self.compute.allgather([parts], [x]).wait()
        return torch.cat(parts, dim=-1)

    def broadcast_tensor(self, x: torch.Tensor) -> torch.Tensor:
        """The leader's `x` on every worker (followers pass a tensor of its shape)."""
        self.compute.broadcast([x], dist.BroadcastOptions()).wait()
        return x

    def min_over_group(self, value: int) -> int:
        """The smallest of every worker's `value` (control group, host memory)."""
        tensor = torch.tensor([value], dtype=torch.int64)
        options = dist.AllreduceOptions()
        options.reduceOp = cast(Any, dist.ReduceOp.MIN)  # the stubs: RedOpType
        control: Any = self.control
        control.allreduce([tensor], options).wait()
        return int(tensor.item())

    def broadcast_object(self, obj: object = None) -> Any:
        """The leader's `obj` (pickled) on every worker; followers pass nothing."""
        if self.rank == 0:
            payload = torch.frombuffer(bytearray(pickle.dumps(obj)), dtype=torch.uint8)
            size = torch.tensor([payload.numel()], dtype=torch.int64)
        else:
            size = torch.zeros(1, dtype=torch.int64)
        control: Any = self.control  # the stubs lack its collectives
        control.broadcast([size], dist.BroadcastOptions()).wait()
        if self.rank != 0:
            payload = torch.empty(int(size.item()), dtype=torch.uint8)
        control.broadcast([payload], dist.BroadcastOptions()).wait()
        if self.rank == 0:
            return obj
        return pickle.loads(payload.numpy().tobytes())

    def publish(self, key: str, value: str) -> None:
        """Leave `value` under `key` in the group's store (a follower's description of
        itself, read once by the leader)."""
        self._store.set(key, value)

    def read(self, key: str) -> str:
        """The value under `key`, waiting (up to the group's timeout) for it to be set."""
        return self._store.get(key).decode()

    def close(self) -> None:
        for group in (self.compute, self.control):
            # An older torch has no shutdown; a dead peer may have torn the group down.
            with contextlib.suppress(AttributeError, RuntimeError):
                group.shutdown()
