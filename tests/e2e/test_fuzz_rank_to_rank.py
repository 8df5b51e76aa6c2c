"""Schemathesis over the rank-to-rank endpoints of a live prefill rank, with the cluster key:
an OpenAPI document built from the wire schemas (disagg/wire.py) drives valid and invalid
/pd/prefill and /pd/abort bodies; no answer is a 5xx, every 4xx has the OpenAI shape, and
the rank is idle, healthy and free of tracebacks afterwards."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import schemathesis
from cluster_key import ROUTER_KEY
from hypothesis import HealthCheck, given, settings
from pd_harness import assert_rank_idle, start_prefill
from server_harness import ServerProcess

from kvstrata.disagg.wire import WireAbort, WirePrefillTask

MAX_EXAMPLES = 40  # per operation and mode
_REF = "#/components/schemas/{model}"


def rank_to_rank_document() -> dict[str, Any]:
    schemas: dict[str, Any] = {}
    paths: dict[str, Any] = {}
    for path, model in (("/pd/prefill", WirePrefillTask), ("/pd/abort", WireAbort)):
        schema = model.model_json_schema(ref_template=_REF)
        schemas.update(schema.pop("$defs", {}))
        schemas[model.__name__] = schema
        paths[path] = {"post": {
            "requestBody": {"required": True, "content": {"application/json": {
                "schema": {"$ref": _REF.format(model=model.__name__)}}}},
            "responses": {"200": {"description": "done"}, "400": {"description": "refused"}},
        }}  # fmt: skip
    return {"openapi": "3.1.0", "info": {"title": "kvstrata ranks", "version": "1"},
            "paths": paths, "components": {"schemas": schemas}}  # fmt: skip


@pytest.fixture(scope="module")
def prefill_rank(
    tiny_llama: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[ServerProcess]:
    server = start_prefill(tiny_llama, tmp_path_factory.mktemp("fuzz-pd-logs"))
    yield server
    assert server.stop() == 0, server.log()
    assert "Traceback" not in server.log(), server.log()


@pytest.mark.parametrize("mode", list(schemathesis.GenerationMode), ids=str)
def test_rank_to_rank_fuzz_gets_no_server_errors(
    prefill_rank: ServerProcess, mode: schemathesis.GenerationMode
) -> None:
    schema = schemathesis.openapi.from_dict(rank_to_rank_document())
    operations = [result.ok() for result in schema.get_all_operations()]
    assert len(operations) == 2
    statuses: list[int] = []
    for operation in operations:

        @given(case=operation.as_strategy(generation_mode=mode))
        @settings(
            max_examples=MAX_EXAMPLES,
            deadline=None,
            suppress_health_check=list(HealthCheck),
            derandomize=True,
            database=None,
        )
        def check(case: schemathesis.Case) -> None:
            response = case.call(base_url=prefill_rank.base_url, headers=ROUTER_KEY, timeout=60)
            statuses.append(response.status_code)
            assert response.status_code < 500, (case.as_curl_command(), response.text)
            if response.status_code >= 400:
                error = response.json()["error"]
                assert set(error) == {"message", "type", "param", "code"}, response.text

        check()
    assert len(statuses) >= 2 * 10
    with httpx.Client(base_url=prefill_rank.base_url, timeout=30) as http:
        assert http.get("/health").status_code == 200
        assert_rank_idle(http)
