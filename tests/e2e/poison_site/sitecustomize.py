"""Fault injection for tests/e2e/test_containment.py and tests/gpu/test_containment_gpu.py,
loaded by every Python process that has this folder on PYTHONPATH: with
$KVSTRATA_TEST_POISON set, an engine step over a request whose prompt opens with
POISON_PREFIX fails in the forward as a device-side assert would ("raise": an exception
standing for one) or does ("device_assert": an out-of-bounds index on the GPU, which
breaks the CUDA context for good): errors the engine cannot pin on one request."""

import os

POISON_PREFIX = [424, 242, 424, 242]
MODE = os.environ.get("KVSTRATA_TEST_POISON")

if MODE:
    from kvstrata.engine import stepper

    _real_run = stepper.SyncStepper.run

    def _run(self, batch):  # type: ignore[no-untyped-def]
        if any(item.request.prompt_ids[:4] == POISON_PREFIX for item in batch.items):
            if MODE == "device_assert":
                import torch

                device = self.engine.device
                values = torch.zeros(4, device=device)
                values[torch.tensor([1 << 20], device=device)] += 1.0  # out of bounds
                torch.cuda.synchronize(device)
            raise RuntimeError("CUDA error: device-side assert triggered (injected by a test)")
        return _real_run(self, batch)

    stepper.SyncStepper.run = _run  # type: ignore[method-assign]
