"""The Responses API's parts without a server: input items become the chat messages the
chat path serves (calls joined into one assistant message, outputs as tool messages,
reasoning not rendered), stored responses are bounded in count and age, and the router's
table of which rank holds a response is bounded too."""

from __future__ import annotations

import pytest

from kvstrata.http.responses_api import ResponsesRequest, chat_request
from kvstrata.router.response_homes import ResponseHomes
from kvstrata.server import response_store
from kvstrata.server.response_store import ResponseStore


def test_input_items_become_chat_messages() -> None:
    body = ResponsesRequest.model_validate(
        {
            "instructions": "Be brief.",
            "input": [
                {"role": "user", "content": "Weather?"},
                {"type": "reasoning", "id": "rs_1", "summary": []},
                {"type": "function_call", "call_id": "c1", "name": "w", "arguments": "{}"},
                {"type": "function_call", "call_id": "c2", "name": "t", "arguments": "{}"},
                {"type": "function_call_output", "call_id": "c1", "output": "sun"},
                {"type": "function_call_output", "call_id": "c2", "output": "noon"},
                {
                    "type": "message",
                    "role": "assistant",
                    "content": [{"type": "output_text", "text": "Sunny.", "annotations": []}],
                },
            ],
            "tools": [{"type": "function", "name": "w"}, {"type": "function", "name": "t"}],
            "tool_choice": {"type": "function", "name": "w"},
            "max_output_tokens": 7,
        }
    )
    chat = chat_request(body, [])
    roles = [m.role for m in chat.messages]
    assert roles == ["system", "user", "assistant", "tool", "tool", "assistant"]
    calls = chat.messages[2].tool_calls or []
    assert [c.id for c in calls] == ["c1", "c2"]
    assert chat.messages[3].tool_call_id == "c1" and chat.messages[5].text() == "Sunny."
    assert chat.max_tokens == 7 and chat.tools is not None and len(chat.tools) == 2
    assert chat.tool_choice is not None and not isinstance(chat.tool_choice, str)
    assert chat.tool_choice.function.name == "w"


def test_stored_responses_are_bounded_in_count_and_age(monkeypatch: pytest.MonkeyPatch) -> None:
    now = [1000.0]
    monkeypatch.setattr(response_store.time, "monotonic", lambda: now[0])
    store = ResponseStore(max_count=2, max_age_s=60.0)
    for name in ("a", "b", "c"):
        store.put(name, {"id": name}, [])
    assert store.get("a") is None and store.get("b") is not None and len(store) == 2
    now[0] += 61.0
    assert store.get("c") is None and len(store) == 0
    off = ResponseStore(max_count=0, max_age_s=60.0)
    off.put("a", {}, [])
    assert off.get("a") is None


def test_the_routers_table_of_homes_is_bounded() -> None:
    homes = ResponseHomes(max_responses=2)
    homes.learn("r1", "http://a")
    homes.learn("r2", "http://b")
    assert homes.home_of("r1") == "http://a"  # used: r2 is now the oldest
    homes.learn("r3", "http://a")
    assert homes.home_of("r2") is None and len(homes) == 2
    homes.learn("x" * 500, "http://a")  # not a rank's id: ignored
    assert len(homes) == 2 and homes.home_of(None) is None
