"""Several routers over one cluster (`kvstrata launch --num-routers 2`, cache_aware over
two unified ranks): multi-turn conversations go through the first router; it is killed
mid-run and the clients move to the second. Each conversation's next turn lands on the
rank that holds its history and hits it as before: the second router learned every
rank's cache from the event streams, not from its own routing."""

from __future__ import annotations

import signal
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from kvstrata.cluster.launch import launch_cluster
from kvstrata.cluster.launch_config import LaunchConfig

PAGE, CHUNK = 16, 32
RANK_FLAGS = ("--page-size", str(PAGE), "--max-model-len", "1024", "--num-kv-pages", "512",
              "--log-level", "warning")  # fmt: skip
NUM_CONVERSATIONS, TURNS_BEFORE, TURNS_AFTER = 6, 2, 2
NEW_TOKENS_PER_TURN, MAX_NEW_TOKENS = 20, 4


@dataclass
class Conversation:
    history: list[int]
    ranks: list[int] = field(default_factory=list)
    cached_tokens: list[int] = field(default_factory=list)
    prompt_lens: list[int] = field(default_factory=list)

    def turn(self, urls: list[str]) -> None:
        """One turn through the first router of `urls` that accepts a connection."""
        sampling = {"max_new_tokens": MAX_NEW_TOKENS, "ignore_eos": True}
        body = {"input_ids": self.history, "sampling_params": sampling}
        for url in urls:
            try:
                response = httpx.post(f"{url}/generate", json=body, timeout=60)
                break
            except httpx.TransportError:
                continue  # that router is gone: the client moves on
        else:
            raise AssertionError("no router answered")
        assert response.status_code == 200, response.text
        answer = response.json()
        self.ranks.append(answer["usage"]["kvstrata"]["rank"])
        self.cached_tokens.append(answer["usage"]["prompt_tokens_details"]["cached_tokens"])
        self.prompt_lens.append(len(self.history))
        start = 7 * len(self.history) % 400 + 1
        self.history = [
            *self.history,
            *answer["output_ids"],
            *range(start, start + NEW_TOKENS_PER_TURN),
        ]


def hit_rate(conversations: list[Conversation], turns: slice) -> float:
    cached = sum(sum(c.cached_tokens[turns]) for c in conversations)
    return cached / sum(sum(c.prompt_lens[turns]) for c in conversations)


def test_clients_moving_to_another_router_keep_affinity_and_hits(
    tiny_llama: Path, tmp_path: Path
) -> None:
    config = LaunchConfig(model=str(tiny_llama), num_prefill=0, num_decode=2, num_routers=2,
                          port=0, log_dir=str(tmp_path))  # fmt: skip
    options = {"load_balance_method": "cache_aware", "dp_routing_digest_chunk_size": CHUNK,
               "log_level": "warning"}  # fmt: skip
    with launch_cluster(config, RANK_FLAGS, options) as cluster:
        urls = cluster.router_urls
        conversations = [Conversation(list(range(10 * i + 1, 10 * i + 49)))
                         for i in range(NUM_CONVERSATIONS)]  # fmt: skip
        for _ in range(TURNS_BEFORE):
            for conversation in conversations:
                conversation.turn(urls)
        first = cluster.routers[0]
        assert first.proc is not None
        first.proc.send_signal(signal.SIGKILL)
        first.proc.wait()
        for _ in range(TURNS_AFTER):
            for conversation in conversations:
                conversation.turn(urls)
        moved = httpx.get(f"{urls[1]}/get_load", timeout=5).json()

    for conversation in conversations:
        # Every turn after the first stays on the conversation's rank, across the move.
        assert len(set(conversation.ranks)) == 1, conversation.ranks
        # And hits at least its previous prompt (whole chunks): the history is there.
        for turn in range(1, TURNS_BEFORE + TURNS_AFTER):
            held = conversation.prompt_lens[turn - 1] // CHUNK * CHUNK
            assert conversation.cached_tokens[turn] >= held, (turn, conversation)
    assert {c.ranks[0] for c in conversations} == {0, 1}  # both ranks serve
    # The second router routed only the turns after the move, yet matched like the first.
    assert sum(rank["num_routed"] for rank in moved) == NUM_CONVERSATIONS * TURNS_AFTER
    assert hit_rate(conversations, slice(TURNS_BEFORE, None)) >= hit_rate(
        conversations, slice(1, TURNS_BEFORE)
    )
