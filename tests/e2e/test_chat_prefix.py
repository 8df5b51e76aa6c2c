"""Prefix-stable chat history (issue 30.4) through the router of a 1 prefill + 2 decode
cluster: a 10-turn tool loop (the openai client; calls forced on even turns, free text on
odd ones, the answers sent back as the client got them, with tool results), where every
turn's prompt extends the previous turn's prompt and output token for token, so its cached
tokens are all the previous turn's KV (whole pages: the prompt and every output token but
the last, whose KV no step computed)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest

from kvstrata.cluster.launch import Cluster, launch_cluster
from kvstrata.cluster.launch_config import LaunchConfig

PAGE = 4
NUM_TURNS = 10
RANK_FLAGS = (
    "--page-size",
    str(PAGE),
    "--max-model-len",
    "2048",
    "--num-kv-pages",
    "2048",
    "--disaggregation-decode-enable-radix-cache",
    "--served-model-name",
    "tiny",
    "--log-level",
    "warning",
)
ROUTER_OPTIONS = {
    "load_balance_method": "cache_aware",
    "dp_routing_digest_chunk_size": PAGE,
    "load_poll_interval_s": 0.1,
    "log_level": "warning",
}
LOOKUP = {
    "type": "function",
    "function": {
        "name": "lookup",
        "parameters": {
            "type": "object",
            "properties": {"key": {"type": "string", "maxLength": 6}},
            "required": ["key"],
        },
    },
}


@pytest.fixture(scope="module")
def cluster(tiny_llama: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    config = LaunchConfig(
        model=str(tiny_llama),
        num_prefill=1,
        num_decode=2,
        port=0,
        log_dir=str(tmp_path_factory.mktemp("chat-prefix-logs")),
    )
    with launch_cluster(config, RANK_FLAGS, ROUTER_OPTIONS) as launched:
        yield launched


def test_every_turn_hits_the_whole_previous_turn(cluster: Cluster) -> None:
    client = openai.OpenAI(base_url=cluster.router_url + "/v1", api_key="unused", max_retries=0)
    messages: list[dict] = [{"role": "user", "content": "Look up the keys, one at a time."}]
    previous: tuple[int, int] | None = None  # (prompt tokens, completion tokens)
    ranks, hits = set(), []
    for turn in range(NUM_TURNS):
        answer = client.chat.completions.create(
            model="tiny",
            messages=messages,
            tools=[LOOKUP],  # type: ignore[list-item]
            tool_choice="required" if turn % 2 == 0 else "none",
            max_tokens=24,
            temperature=0.8,
            seed=turn,
        )
        usage = answer.usage
        assert usage is not None
        cached = usage.prompt_tokens_details.cached_tokens  # type: ignore[union-attr]
        if previous is not None:
            prompt_len, output_len = previous
            assert usage.prompt_tokens > prompt_len + output_len
            expected = (prompt_len + output_len - 1) // PAGE * PAGE
            hits.append((cached, expected))
        previous = (usage.prompt_tokens, usage.completion_tokens)
        ranks.add(json.loads(answer.model_dump_json())["usage"]["kvstrata"]["rank"])
        message = answer.choices[0].message
        messages.append(
            message.model_dump(exclude_none=True, include={"role", "content", "tool_calls"})
        )
        for call in message.tool_calls or []:
            messages.append({"role": "tool", "tool_call_id": call.id, "content": '"found"'})
        if not message.tool_calls:
            messages.append({"role": "user", "content": "Next one."})
    assert [cached for cached, _ in hits] == [expected for _, expected in hits], hits
    assert len(ranks) == 1  # the router kept the conversation on the rank holding it
    spliced = sum(_spliced_turns(rank.url) for rank in cluster.decode)
    assert spliced == sum(range(NUM_TURNS))  # turn k's history holds k answers, all spliced


def _spliced_turns(url: str) -> float:
    text = httpx.get(url + "/metrics", timeout=10).text
    lines = [ln for ln in text.splitlines() if ln.startswith("kvstrata_chat_spliced_turns_total")]
    return float(lines[0].split()[-1])


def test_responses_follow_ups_go_to_the_rank_holding_them(cluster: Cluster) -> None:
    """Responses API through the router: each follow-up (`previous_response_id`, whose
    history only the rank that stored it has) goes to that rank and hits all of the last
    turn's KV; GET and DELETE of a response reach it too."""
    client = openai.OpenAI(base_url=cluster.router_url + "/v1", api_key="unused", max_retries=0)
    ranks, previous_id, previous_tokens = set(), None, 0
    for turn in range(5):
        response = client.responses.create(
            model="tiny",
            input=f"Turn {turn}: go on.",
            previous_response_id=previous_id,
            max_output_tokens=12,
            temperature=0,
        )
        usage = json.loads(response.model_dump_json())["usage"]
        if previous_id is not None:
            expected = (previous_tokens - 1) // PAGE * PAGE
            assert usage["input_tokens_details"]["cached_tokens"] == expected
        ranks.add(usage["kvstrata"]["rank"])
        previous_id, previous_tokens = response.id, usage["input_tokens"] + usage["output_tokens"]
    assert len(ranks) == 1
    assert client.responses.retrieve(previous_id).id == previous_id
    client.responses.delete(previous_id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(previous_id)
