"""The Responses API on a live rank through the official `openai` client: responses
created whole and streamed (the typed events in order), stored, fetched and deleted;
`previous_response_id` continues a conversation on the KV of the previous turn (its
cached tokens are all of the previous prompt and output); tools with forced choice and
their outputs sent back as items; a text format as a JSON schema; bad requests are 400s
and a response not stored is a 404."""

from __future__ import annotations

import json

import httpx
import jsonschema
import openai
import pytest
from server_harness import MODEL_NAME, PAGE_SIZE, ServerProcess, assert_idle

LOOKUP = {
    "type": "function",
    "name": "lookup",
    "description": "Look a key up.",
    "parameters": {
        "type": "object",
        "properties": {"key": {"type": "string", "maxLength": 8}},
        "required": ["key"],
        "additionalProperties": False,
    },
}


@pytest.fixture()
def client(server: ServerProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.base_url + "/v1", api_key="unused", max_retries=0)


def test_a_response_is_created_stored_fetched_and_deleted(
    client: openai.OpenAI, http: httpx.Client
) -> None:
    response = client.responses.create(
        model=MODEL_NAME,
        instructions="Answer briefly.",
        input="Name a colour.",
        max_output_tokens=12,
        temperature=0,
        metadata={"case": "one"},
    )
    assert response.id.startswith("resp_") and response.object == "response"
    assert response.status in ("completed", "incomplete")
    assert response.output[0].type == "message" and response.output_text
    assert response.usage is not None and response.usage.output_tokens > 0
    assert response.metadata == {"case": "one"}
    fetched = client.responses.retrieve(response.id)
    assert fetched.output_text == response.output_text and fetched.id == response.id
    deleted = http.delete(f"/v1/responses/{response.id}").json()
    assert deleted == {"id": response.id, "object": "response", "deleted": True}
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(response.id)
    assert_idle(http)


def test_previous_response_id_continues_on_the_kv_of_the_last_turn(client: openai.OpenAI) -> None:
    first = client.responses.create(
        model=MODEL_NAME, input="Count with me: one, two", max_output_tokens=20, temperature=0
    )
    assert first.usage is not None
    previous = first.usage.input_tokens + first.usage.output_tokens
    second = client.responses.create(
        model=MODEL_NAME,
        previous_response_id=first.id,
        input="Go on.",
        max_output_tokens=20,
        temperature=0,
    )
    assert second.previous_response_id == first.id and second.usage is not None
    assert second.usage.input_tokens > previous
    expected = (previous - 1) // PAGE_SIZE * PAGE_SIZE  # whole pages of the last turn's KV
    assert second.usage.input_tokens_details.cached_tokens == expected
    unstored = client.responses.create(
        model=MODEL_NAME, input="Hello", max_output_tokens=4, temperature=0, store=False
    )
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(unstored.id)
    with pytest.raises(openai.NotFoundError) as missing:
        client.responses.create(model=MODEL_NAME, previous_response_id=unstored.id, input="x")
    assert missing.value.body["code"] == "previous_response_not_found"  # type: ignore[index]


def test_a_streamed_tool_loop(client: openai.OpenAI, http: httpx.Client) -> None:
    """A forced call streamed as typed events, then its output sent back as an item."""
    stream = client.responses.create(
        model=MODEL_NAME,
        input="Look up the key alpha.",
        tools=[LOOKUP],  # type: ignore[list-item]
        tool_choice="required",
        parallel_tool_calls=False,
        max_output_tokens=120,
        temperature=0,
        stream=True,
    )
    events = list(stream)
    kinds = [event.type for event in events]
    assert kinds[:2] == ["response.created", "response.in_progress"]
    assert kinds[-1] == "response.completed"
    for kind in (
        "response.output_item.added",
        "response.function_call_arguments.delta",
        "response.function_call_arguments.done",
        "response.output_item.done",
    ):
        assert kind in kinds
    assert [e.sequence_number for e in events] == list(range(len(events)))
    final = events[-1].response  # type: ignore[union-attr]
    (call,) = [item for item in final.output if item.type == "function_call"]
    jsonschema.validate(json.loads(call.arguments), LOOKUP["parameters"])
    follow = client.responses.create(
        model=MODEL_NAME,
        previous_response_id=final.id,
        input=[{"type": "function_call_output", "call_id": call.call_id, "output": '"ok"'}],
        tools=[LOOKUP],  # type: ignore[list-item]
        tool_choice="none",
        max_output_tokens=16,
        temperature=0,
    )
    assert follow.status in ("completed", "incomplete") and follow.output[0].type == "message"
    assert follow.usage is not None and follow.usage.input_tokens_details.cached_tokens > 0
    assert_idle(http)


def test_text_format_json_schema(client: openai.OpenAI) -> None:
    schema = {
        "type": "object",
        "properties": {"name": {"type": "string", "maxLength": 10}, "age": {"type": "integer"}},
        "required": ["name", "age"],
        "additionalProperties": False,
    }
    response = client.responses.create(
        model=MODEL_NAME,
        input="A person.",
        text={"format": {"type": "json_schema", "name": "person", "schema": schema}},
        max_output_tokens=200,
        temperature=0,
    )
    jsonschema.validate(json.loads(response.output_text), schema)


@pytest.mark.parametrize(
    ("extra", "param", "code"),
    [
        ({"truncation": "auto"}, "truncation", "unsupported_parameter"),
        ({"input": [{"type": "item_reference", "id": "x"}]}, None, None),
        ({"tools": [{"type": "web_search"}]}, None, None),
    ],
)
def test_bad_requests_are_400s(
    http: httpx.Client, extra: dict, param: str | None, code: str | None
) -> None:
    body = {"model": MODEL_NAME, "input": "hi", "max_output_tokens": 4} | extra
    response = http.post("/v1/responses", json=body)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    if param is not None:
        assert (error["param"], error["code"]) == (param, code)
