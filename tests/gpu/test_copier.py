"""CUDA parity of the Triton zero-copy copier with the torch copier (bf16, scattered
pages, both directions) and an end-to-end load-back through the engine."""

from __future__ import annotations

import random

import pytest
import torch

from kvstrata.kvcache.copier import TorchCopier
from kvstrata.kvcache.host_pool import HostPool
from kvstrata.kvcache.pages import KVPool

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def pools(dtype: torch.dtype) -> tuple[KVPool, HostPool]:
    l1 = KVPool(64, 16, 4, 2, 64, dtype, "cuda")
    l2 = HostPool(48, 16, 4, 2, 64, dtype, pin_memory=True)
    return l1, l2


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_triton_copier_matches_torch_copier(dtype: torch.dtype) -> None:
    from kvstrata.kvcache.copier_triton import TritonCopier

    rng = random.Random(0)
    l1, l2 = pools(dtype)
    ref_l1, ref_l2 = pools(dtype)
    l1.data.normal_()
    ref_l1.data.copy_(l1.data)
    l1_pages = rng.sample(range(64), 20)
    l2_pages = rng.sample(range(48), 20)
    copier = TritonCopier(l1, l2)
    copier.backup(l1_pages, l2_pages)
    TorchCopier(ref_l1, ref_l2).backup(l1_pages, l2_pages)
    copier.host_fence()()  # the backup may still run when backup() returns
    assert torch.equal(l2.data, ref_l2.data)

    l1.data.zero_()
    ref_l1.data.zero_()
    back_l1 = rng.sample(range(64), 20)
    TritonCopier(l1, l2).load_back(l2_pages, back_l1)
    TorchCopier(ref_l1, ref_l2).load_back(l2_pages, back_l1)
    torch.cuda.synchronize()
    assert torch.equal(l1.data, ref_l1.data)
    assert l1.data.abs().sum() > 0


def test_a_backup_never_stalls_and_its_fences_order_it() -> None:
    """backup() returns before its copy is done (a decode step is not held up by it);
    after fence_l1 the compute stream may overwrite the source pages (their copy lands
    first), and after the host fence's waiter the host pages hold the data."""
    from kvstrata.kvcache.copier_triton import TritonCopier

    l1 = KVPool(512, 16, 8, 4, 128, torch.bfloat16, "cuda")
    l2 = HostPool(512, 16, 8, 4, 128, torch.bfloat16, pin_memory=True)
    l1.data.normal_()
    expected = l1.data.clone()
    copier = TritonCopier(l1, l2)
    pages = list(range(512))
    torch.cuda._sleep(50_000_000)  # queued compute work the backup must wait for
    copier.backup(pages, pages)
    assert copier._backed_up is not None and not copier._backed_up.query()  # still running
    copier.fence_l1()
    l1.data.zero_()  # compute-stream work reusing the pages: ordered after the copy
    copier.host_fence()()
    torch.cuda.synchronize()
    ref = HostPool(512, 16, 8, 4, 128, torch.bfloat16, pin_memory=True)
    l1.data.copy_(expected)
    TorchCopier(l1, ref).backup(pages, pages)
    assert torch.equal(l2.data, ref.data)


def test_a_load_back_waits_for_its_fence_not_the_decode_steps() -> None:
    """load_back() leaves the compute stream free (other requests' decode steps run on);
    after fence_loads the compute stream reads the loaded pages."""
    from kvstrata.kvcache.copier_triton import TritonCopier

    l1 = KVPool(512, 16, 8, 4, 128, torch.bfloat16, "cuda")
    l2 = HostPool(512, 16, 8, 4, 128, torch.bfloat16, pin_memory=True)
    l2.data.normal_()
    copier = TritonCopier(l1, l2)
    pages = list(range(512))
    copier.load_back(pages, pages)
    decode = torch.cuda.Event()
    decode.record()  # compute-stream work queued after the load-back, before any fence
    decode.synchronize()
    copier.fence_loads()
    loaded = l1.data.clone()  # on the compute stream: after the copy
    torch.cuda.synchronize()
    ref = KVPool(512, 16, 8, 4, 128, torch.bfloat16, "cuda")
    TorchCopier(ref, l2).load_back(pages, pages)
    torch.cuda.synchronize()
    assert torch.equal(loaded, ref.data)
