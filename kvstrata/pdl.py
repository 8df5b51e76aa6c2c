"""Programmatic dependent launch (PDL, Hopper and later) for the Triton kernels of a step:
a kernel may be scheduled while the one before it drains, run what reads nothing an
earlier kernel writes (a GEMV's first weight tile), then `wait_for_inputs`. Owns the
one switch (`Pdl`) that each launcher passes on, and the kernel-side wait."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import triton
import triton.language as tl


@dataclass(frozen=True)
class Pdl:
    """Whether kernels are launched with PDL. Off: plain stream order, and the kernels'
    waits compile away."""

    enabled: bool = False

    def options(self) -> dict[str, Any]:
        """Launch keyword arguments for a Triton kernel (shared: unpack, never mutate)."""
        return _PDL_OPTIONS if self.enabled else _NO_OPTIONS


_PDL_OPTIONS: dict[str, Any] = {"launch_pdl": True}
_NO_OPTIONS: dict[str, Any] = {}


NO_PDL = Pdl(False)


def pdl_for(device: torch.device, disabled: bool) -> Pdl:
    """PDL on CUDA devices of compute capability 9 or more, unless `disabled`."""
    if disabled or device.type != "cuda":
        return NO_PDL
    return Pdl(torch.cuda.get_device_capability(device)[0] >= 9)


@triton.jit
def wait_for_inputs(PDL: tl.constexpr):
    # Invariant: a kernel launched with PDL reads what an earlier kernel of the stream
    # wrote, and writes anything, only after this wait (which returns once the kernel
    # before it has finished and its writes are visible). Then it lets the next kernel be
    # scheduled: that one waits in turn, so chains stay ordered.
    if PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
