"""A GGUF file as a model directory: the Hugging Face metadata files built from its header
(config.json, generation_config.json, tokenizer.json, tokenizer_config.json,
chat_template.jinja) beside the GGUF itself, which stays the weights (read by the loader).
`resolve_model_dir` maps `--model FILE.gguf` to such a directory, made once and cached."""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import tempfile
import time
from pathlib import Path

from kvstrata.model.model_dir import GGUF_SUFFIX

logger = logging.getLogger("kvstrata.model")

_LAYOUT_VERSION = "1"  # bump when the files written here change


def is_gguf_file(path: str | Path) -> bool:
    path = Path(path)
    return path.suffix.lower() == GGUF_SUFFIX and path.is_file()


def gguf_weights(model_dir: Path) -> Path | None:
    """The GGUF file holding a model directory's weights, or None when it has none (a
    directory of safetensors). More than one GGUF is ambiguous: ValueError."""
    found = sorted(p for p in model_dir.glob(f"*{GGUF_SUFFIX}") if p.is_file())
    if len(found) > 1:
        names = ", ".join(p.name for p in found)
        raise ValueError(f"{model_dir} holds several GGUF files ({names}); keep one")
    return found[0] if found else None


def write_model_dir(gguf_path: str | Path, model_dir: str | Path, copy: bool = False) -> Path:
    """Lay `gguf_path` out as a model directory at `model_dir` (replacing nothing: it must
    not exist yet). The GGUF is linked (or copied, `copy=True`) in as the weights. Built in
    a temporary sibling and renamed into place, so a reader never sees half a directory.
    Raises GgufError for an architecture, tokenizer or tensor type kvstrata cannot load."""
    gguf_path, model_dir = Path(gguf_path).resolve(), Path(model_dir)
    # Here, not at import: the GGUF reader needs torch, which a model directory does not.
    from kvstrata.model.gguf import GgufCheckpoint
    from kvstrata.model.gguf_tokenizer import tokenizer_config, tokenizer_json

    start_s = time.monotonic()
    checkpoint = GgufCheckpoint(gguf_path)
    files = {
        "config.json": checkpoint.hf_config(),
        "generation_config.json": checkpoint.generation_config(),
        "tokenizer.json": tokenizer_json(checkpoint),
        "tokenizer_config.json": tokenizer_config(checkpoint),
    }
    model_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=model_dir.parent, prefix=f".{model_dir.name}.tmp"))
    try:
        os.chmod(tmp, 0o755)  # mkdtemp's 0700 would hide the model from other users
        for name, body in files.items():
            (tmp / name).write_text(json.dumps(body, ensure_ascii=False), encoding="utf-8")
        template = checkpoint.field("tokenizer.chat_template", None)
        if template:
            (tmp / "chat_template.jinja").write_text(template, encoding="utf-8")
        if copy:
            shutil.copyfile(gguf_path, tmp / gguf_path.name)
        else:
            (tmp / gguf_path.name).symlink_to(gguf_path)
        os.rename(tmp, model_dir)  # fails if model_dir exists (another writer won)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    logger.info(
        "laid out %s as model directory %s in %.2f s",
        gguf_path,
        model_dir,
        time.monotonic() - start_s,
    )
    return model_dir


def resolve_model_dir(model: str | Path) -> Path:
    """The model directory `--model` names: itself for a directory, else (a .gguf file) a
    directory built from the file once and cached under the user's cache dir, named by
    the file's real path and stat stamp (a changed file gets a new directory; the L3
    namespace comes from the weights' contents, see identity.py)."""
    path = Path(model)
    if not is_gguf_file(path):
        return path
    real = path.resolve()
    st = real.stat()
    stamp = f"{_LAYOUT_VERSION}|{real}|{st.st_size}|{st.st_mtime_ns}|{st.st_ino}"
    key = hashlib.sha256(stamp.encode()).hexdigest()[:20]
    base = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    model_dir = base / "kvstrata" / "gguf" / f"{real.stem}-{key}"
    if (model_dir / "config.json").is_file():
        return model_dir
    try:
        return write_model_dir(real, model_dir)
    except OSError:
        if (model_dir / "config.json").is_file():
            return model_dir  # another rank of the same launch built it first
        raise
