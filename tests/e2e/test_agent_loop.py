"""A real agent framework (the `openai-agents` SDK on Chat Completions) runs a 3-step tool
loop with forced tool choice to completion through the router of a 1 prefill + 2 decode
cluster serving SmolLM2: three calls in order, each valid against its tool's schema."""

from __future__ import annotations

import asyncio
import json
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Annotated, Any

import httpx
import httpx2
import jsonschema
import pytest
from agents import (
    Agent,
    FunctionTool,
    ModelSettings,
    OpenAIChatCompletionsModel,
    RunContextWrapper,
    Runner,
    RunResult,
    StopAtTools,
    Tool,
    function_tool,
    set_tracing_disabled,
)
from agents.agent import AgentBase
from openai import AsyncOpenAI
from pydantic import Field
from real_model import smollm2  # noqa: F401 - the session fixture

from kvstrata.cluster.launch import Cluster, launch_cluster
from kvstrata.cluster.launch_config import LaunchConfig

NAME = "smollm2"
RANK_FLAGS = (
    "--page-size",
    "16",
    "--num-kv-pages",
    "256",
    "--max-model-len",
    "2048",
    "--disaggregation-decode-enable-radix-cache",
    "--served-model-name",
    NAME,
    "--log-level",
    "warning",
)
ROUTER_OPTIONS = {"load_balance_method": "cache_aware", "log_level": "warning"}
STEPS = ("find_capital", "get_weather", "send_report")
# Bounded strings: a 135M model may fill a free string until max_tokens cuts the call.
Short = Annotated[str, Field(max_length=24)]


@pytest.fixture(scope="module")
def cluster(smollm2: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:  # noqa: F811
    config = LaunchConfig(
        model=str(smollm2),
        num_prefill=1,
        num_decode=2,
        port=0,
        log_dir=str(tmp_path_factory.mktemp("agent-loop-logs")),
    )
    with launch_cluster(config, RANK_FLAGS, ROUTER_OPTIONS) as launched:
        yield launched


class Workflow:
    """Three tools the agent must call in order: each is offered only at its own step
    (the SDK's `is_enabled`), and `tool_choice="required"` forces a call of it. Owns the
    record of the calls the tools received."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, dict[str, str]]] = []

    def _at_step(self, name: str) -> Any:
        def enabled(context: RunContextWrapper[Any], agent: AgentBase) -> bool:
            return len(self.calls) == STEPS.index(name)

        return enabled

    def tools(self) -> list[FunctionTool]:
        @function_tool(is_enabled=self._at_step("find_capital"))
        def find_capital(country: Short) -> str:
            """The capital city of a country."""
            self.calls.append(("find_capital", {"country": country}))
            return "Paris"

        @function_tool(is_enabled=self._at_step("get_weather"))
        def get_weather(city: Short) -> str:
            """Today's weather in a city."""
            self.calls.append(("get_weather", {"city": city}))
            return "sunny, 21 C"

        @function_tool(is_enabled=self._at_step("send_report"))
        def send_report(summary: Short) -> str:
            """Send the final weather report to the user."""
            self.calls.append(("send_report", {"summary": summary}))
            return "report sent"

        return [find_capital, get_weather, send_report]


async def run_agent(
    router_url: str, tools: list[FunctionTool]
) -> tuple[RunResult, list[tuple[int, str]]]:
    """Runs the agent to its stop at the last tool; returns its result and the HTTP
    answers it got, (status, body), kept by a response hook before the SDK parses them."""
    answers: list[tuple[int, str]] = []  # (status, body)

    async def keep_answer(response: httpx2.Response) -> None:
        await response.aread()
        answers.append((response.status_code, response.text))

    # httpx2: the `openai` client's own HTTP library.
    async with httpx2.AsyncClient(event_hooks={"response": [keep_answer]}, timeout=300) as http:
        client = AsyncOpenAI(
            base_url=router_url + "/v1", api_key="unused", http_client=http, max_retries=0
        )
        agent = Agent(
            name="weather",
            instructions="Find the capital of France, get its weather, then send a report.",
            model=OpenAIChatCompletionsModel(model=NAME, openai_client=client),
            tools=list[Tool](tools),
            model_settings=ModelSettings(
                temperature=0.0, max_tokens=64, tool_choice="required", parallel_tool_calls=False
            ),
            reset_tool_choice=False,  # keep forcing calls after the first one
            tool_use_behavior=StopAtTools(stop_at_tool_names=[STEPS[-1]]),
        )
        prompt = "What is the weather in the capital of France?"
        result = await Runner.run(agent, prompt, max_turns=len(STEPS))
    return result, answers


def test_agent_runs_a_three_step_tool_loop_through_the_router(cluster: Cluster) -> None:
    set_tracing_disabled(True)  # traces would go to OpenAI's servers
    workflow = Workflow()
    tools = workflow.tools()
    result, responses = asyncio.run(run_agent(cluster.router_url, tools))
    assert [status for status, _ in responses] == [200] * len(STEPS), responses
    answers = [json.loads(body) for _, body in responses]

    schemas = {tool.name: tool.params_json_schema for tool in tools}
    assert [name for name, _ in workflow.calls] == list(STEPS)
    for name, arguments in workflow.calls:
        jsonschema.validate(arguments, schemas[name])
    assert result.final_output == "report sent"  # stopped at the last tool's result
    assert len(result.raw_responses) == len(STEPS)

    # Each answer is one call, the step's tool, its arguments as the tool received them.
    for answer, (name, arguments) in zip(answers, workflow.calls, strict=True):
        choice = answer["choices"][0]
        assert choice["finish_reason"] == "tool_calls"
        [call] = choice["message"]["tool_calls"]
        assert call["function"]["name"] == name
        assert json.loads(call["function"]["arguments"]) == arguments

    # Every request went through the router to a decode rank, as the router counted them.
    answered_by = Counter(answer["usage"]["kvstrata"]["rank"] for answer in answers)
    assert set(answered_by) <= set(range(len(cluster.decode)))
    assert _router_decode_requests(cluster.router_url) == answered_by


def _router_decode_requests(router_url: str) -> Counter[int]:
    """kvstrata_router_requests_total per decode rank, from the router's /metrics."""
    text = httpx.get(router_url + "/metrics", timeout=10).text
    counts: Counter[int] = Counter()
    for line in text.splitlines():
        if line.startswith("kvstrata_router_requests_total{") and 'role="decode"' in line:
            rank = int(line.split('rank="')[1].split('"')[0])
            counts[rank] += int(float(line.split()[-1]))
    return counts
