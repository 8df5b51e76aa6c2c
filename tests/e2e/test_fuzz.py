"""Schemathesis fuzzing of a live server's OpenAPI document: for a bounded number of
generated requests per operation, valid and invalid, no answer is a 5xx and every 4xx has
the OpenAI error shape. A short context keeps each generation small."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from server_harness import ServerProcess, start_server

MAX_EXAMPLES = 50  # per operation and mode; bounds the test to well under a minute


@pytest.fixture(scope="module")
def fuzz_server(
    tiny_llama: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[ServerProcess]:
    server = start_server(
        tiny_llama, tmp_path_factory.mktemp("fuzz-logs"), "--max-model-len", "48",
        "--num-kv-pages", "64", "--log-level", "warning",
    )  # fmt: skip
    yield server
    assert server.stop() == 0, server.log()
    assert "Traceback" not in server.log(), server.log()


@pytest.mark.parametrize("mode", list(schemathesis.GenerationMode), ids=str)
def test_no_server_errors(fuzz_server: ServerProcess, mode: schemathesis.GenerationMode) -> None:
    # Operations are driven one by one so that each gets its share of examples.
    # (Schemathesis' pytest plugin needs pytest internals that pytest 9 removed.)
    schema = schemathesis.openapi.from_url(fuzz_server.base_url + "/openapi.json")
    operations = [result.ok() for result in schema.get_all_operations()]
    assert len(operations) >= 9
    calls: list[str] = []

    for operation in operations:
        if mode is schemathesis.GenerationMode.NEGATIVE and not (operation.body or operation.query):
            continue  # nothing to get wrong in a request without inputs

        @given(case=operation.as_strategy(generation_mode=mode))
        @settings(
            max_examples=MAX_EXAMPLES,
            deadline=None,
            suppress_health_check=list(HealthCheck),
            derandomize=True,
            database=None,
        )
        def check(case: schemathesis.Case) -> None:
            calls.append(case.operation.path)
            response = case.call(timeout=60)
            assert response.status_code < 500, (case.as_curl_command(), response.text)
            if response.status_code >= 400:
                error = response.json()["error"]
                assert set(error) == {"message", "type", "param", "code"}, response.text

        check()
    assert len(calls) >= len(operations)  # every operation was exercised
