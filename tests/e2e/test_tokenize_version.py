"""/tokenize, /detokenize, /version and /v1/models/{id} of a live rank (vLLM's shapes),
exactly against the model's own tokenizer, with 4xx bodies naming the bad field; and
`kvstrata --version`."""

from __future__ import annotations

import importlib.metadata
import subprocess
import sys
from pathlib import Path

import httpx
import openai
import pytest
from server_harness import MAX_MODEL_LEN, MODEL_NAME, ServerProcess

from kvstrata.model.tokenizer import Tokenizer

PROMPT = "The keeper climbed the stairs every evening."
MESSAGES = [{"role": "user", "content": "Hi there"}]
VERSION = importlib.metadata.version("kvstrata")


@pytest.fixture(scope="module")
def tokenizer(tiny_llama: Path) -> Tokenizer:
    return Tokenizer(tiny_llama)


def assert_error(
    response: httpx.Response, status: int, param: str, code: str | None = None
) -> None:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert error["param"] == param
    assert error["type"] == ("not_found_error" if status == 404 else "invalid_request_error")
    if code is not None:
        assert error["code"] == code


def test_tokenize_a_prompt(http: httpx.Client, tokenizer: Tokenizer) -> None:
    expected = tokenizer.encode(PROMPT)
    answer = http.post("/tokenize", json={"model": MODEL_NAME, "prompt": PROMPT})
    assert answer.status_code == 200
    assert answer.json() == {
        "tokens": expected,
        "count": len(expected),
        "max_model_len": MAX_MODEL_LEN,
    }
    plain = http.post("/tokenize", json={"prompt": PROMPT, "add_special_tokens": False}).json()
    assert plain["tokens"] == tokenizer.encode(PROMPT, add_special_tokens=False)


def test_tokenize_messages_counts_what_chat_completions_prefills(
    http: httpx.Client, tokenizer: Tokenizer
) -> None:
    answer = http.post("/tokenize", json={"messages": MESSAGES}).json()
    assert answer["tokens"] == tokenizer.apply_chat_template(MESSAGES)
    chat = http.post(
        "/v1/chat/completions", json={"messages": MESSAGES, "max_tokens": 1, "temperature": 0}
    ).json()
    assert chat["usage"]["prompt_tokens"] == answer["count"]
    no_prompt = http.post(
        "/tokenize", json={"messages": MESSAGES, "add_generation_prompt": False}
    ).json()
    assert no_prompt["tokens"] == tokenizer.apply_chat_template(
        MESSAGES, add_generation_prompt=False
    )


def test_detokenize_inverts_tokenize(http: httpx.Client, tokenizer: Tokenizer) -> None:
    tokens = http.post("/tokenize", json={"prompt": PROMPT}).json()["tokens"]
    answer = http.post("/detokenize", json={"model": MODEL_NAME, "tokens": tokens})
    assert answer.status_code == 200
    assert answer.json() == {"prompt": tokenizer.decode(tokens, skip_special_tokens=False)}
    assert PROMPT in answer.json()["prompt"]
    assert http.post("/detokenize", json={"tokens": []}).json() == {"prompt": ""}


@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        ("/tokenize", {}, "prompt"),
        ("/tokenize", {"prompt": PROMPT, "messages": MESSAGES}, "prompt"),
        ("/tokenize", {"prompt": 5}, "prompt"),
        ("/tokenize", {"messages": []}, "messages"),
        ("/tokenize", {"prompt": PROMPT, "add_special_tokens": "yes"}, "add_special_tokens"),
        ("/detokenize", {}, "tokens"),
        ("/detokenize", {"tokens": "abc"}, "tokens"),
        ("/detokenize", {"tokens": [1, -2]}, "tokens"),
    ],
)
def test_bad_input_is_a_400_naming_the_field(
    http: httpx.Client, path: str, body: dict, param: str
) -> None:
    assert_error(http.post(path, json=body), 400, param)


def test_a_token_outside_the_vocabulary_is_refused(
    http: httpx.Client, tokenizer: Tokenizer
) -> None:
    response = http.post("/detokenize", json={"tokens": [1, tokenizer.vocab_size]})
    assert_error(response, 400, "tokens", "invalid_token_id")


def test_another_model_is_not_found(http: httpx.Client) -> None:
    for path, body in (("/tokenize", {"prompt": "x"}), ("/detokenize", {"tokens": [1]})):
        response = http.post(path, json=body | {"model": "other"})
        assert_error(response, 404, "model", "model_not_found")


def test_version(http: httpx.Client) -> None:
    assert http.get("/version").json() == {"version": VERSION}
    cli = subprocess.run(
        [sys.executable, "-m", "kvstrata", "--version"], capture_output=True, text=True, check=True
    )
    assert cli.stdout == f"kvstrata {VERSION}\n"


def test_retrieve_a_model(http: httpx.Client, server: ServerProcess) -> None:
    card = http.get(f"/v1/models/{MODEL_NAME}")
    assert card.status_code == 200
    assert card.json() == http.get("/v1/models").json()["data"][0]
    client = openai.OpenAI(base_url=server.base_url + "/v1", api_key="unused", max_retries=0)
    assert client.models.retrieve(MODEL_NAME).id == MODEL_NAME
    for other in ("other", "org/other"):
        assert_error(http.get(f"/v1/models/{other}"), 404, "model", "model_not_found")
