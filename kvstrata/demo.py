"""`kvstrata demo`: the embedded default job. Makes a tiny random model, then serves a
short multi-turn conversation through the offline engine and shows prefix-cache hits."""

from __future__ import annotations

import tempfile
import time
from pathlib import Path

from kvstrata.core import SamplingParams
from kvstrata.llm import LLM
from kvstrata.model.tiny import make_tiny_model

QUESTIONS = (
    "You are a helpful assistant. Tell me about the history of caches in computers.",
    "And how does a radix tree help an LLM server reuse work between turns?",
    "Summarise both answers in one sentence.",
)


def run_demo(model_dir: str | None = None) -> None:
    with tempfile.TemporaryDirectory(prefix="kvstrata-demo-") as tmp:
        path = Path(model_dir) if model_dir else Path(tmp) / "tiny-llama"
        if not (path / "config.json").is_file():
            make_tiny_model(path, arch="llama", seed=0)
            print(f"made a tiny random llama model in {path}")
        llm = LLM(str(path), page_size=16)
        tokenizer = llm.tokenizer
        params = SamplingParams(max_tokens=24, temperature=0.0)
        messages: list[dict[str, str]] = []
        for turn, question in enumerate(QUESTIONS, start=1):
            messages.append({"role": "user", "content": question})
            prompt_ids = tokenizer.apply_chat_template(messages)
            start_s = time.perf_counter()
            (out,) = llm.generate(input_ids=[prompt_ids], sampling_params=params)
            elapsed_ms = (time.perf_counter() - start_s) * 1e3
            messages.append({"role": "assistant", "content": out.text})
            print(
                f"turn {turn}: prompt {len(prompt_ids)} tokens, cached {out.cached_tokens}, "
                f"generated {len(out.output_ids)} in {elapsed_ms:.0f} ms"
            )
            print(f"  completion: {out.text!r}")
        load = llm.engine.load()
        print(
            f"L1 pages: {load.num_cached_pages} cached, {load.num_free_pages} free, "
            f"{load.num_total_pages} total"
        )
