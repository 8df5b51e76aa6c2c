"""The router's HTTP API hardened, on a 1 prefill + 1 decode cluster launched with an API
key (`launch_cluster`): ranks refuse whoever does not hold the key the router sends them,
every process listens on loopback only, and a bounded fuzz of the router (schemathesis
over the public API document, hypothesis over raw bodies) gets no 5xx and crashes nothing."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvstrata.cluster.launch import Cluster, launch_cluster
from kvstrata.cluster.launch_config import LaunchConfig

pytestmark = pytest.mark.slow

API_KEY = "fuzz-key"
AUTH = {"authorization": f"Bearer {API_KEY}"}
MAX_EXAMPLES = 25  # per operation and mode: bounds the fuzzing to well under a minute
ERROR_FIELDS = {"message", "type", "param", "code"}
GENERATION_PATHS = ("/generate", "/v1/completions", "/v1/chat/completions")
FUZZ_SETTINGS = settings(
    max_examples=MAX_EXAMPLES, deadline=None, suppress_health_check=list(HealthCheck),
    derandomize=True, database=None,
)  # fmt: skip


@pytest.fixture(scope="module")
def cluster(tiny_llama: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    config = LaunchConfig(
        model=str(tiny_llama), num_prefill=1, num_decode=1, port=0,
        log_dir=str(tmp_path_factory.mktemp("fuzz-logs")), stop_grace_s=30,
    )  # fmt: skip
    rank_flags = [
        "--max-model-len", "48", "--num-kv-pages", "64", "--page-size", "4",
        "--disaggregation-decode-enable-radix-cache", "--log-level", "warning",
    ]  # fmt: skip
    # cache_aware tokenizes every request in the router: fuzzed bodies reach that code too.
    options = {"api_key": API_KEY, "load_balance_method": "cache_aware", "log_level": "warning"}
    with launch_cluster(config, rank_flags, options) as started:
        yield started
    for child in started.children:
        log = child.log_path.read_text(errors="replace")
        assert "Traceback" not in log, f"{child.name}:\n{log[-3000:]}"


def assert_answered_well(response: Any, what: str) -> None:
    assert response.status_code < 500, (what, response.status_code, response.text[:300])
    if response.status_code >= 400:
        assert set(response.json()["error"]) == ERROR_FIELDS, (what, response.text[:300])


def test_ranks_accept_only_the_key_the_router_sends(cluster: Cluster) -> None:
    body = {"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 2}}
    for rank in cluster.prefill + cluster.decode:
        # Not even the client key: `kvstrata launch` gave the ranks a key of their own.
        for headers in ({}, {"authorization": "Bearer not-the-key"}, AUTH):
            refused = httpx.post(rank.url + "/generate", json=body, headers=headers, timeout=30)
            assert refused.status_code == 401, rank.name
            assert set(refused.json()["error"]) == ERROR_FIELDS
    # Through the router, with the client key: the router, then decode -> prefill
    # (rank to rank) present the rank key that `kvstrata launch` gave them.
    served = httpx.post(cluster.router_url + "/generate", json=body, headers=AUTH, timeout=60)
    assert served.status_code == 200, served.text
    refused = httpx.post(cluster.router_url + "/generate", json=body, timeout=30)
    assert refused.status_code == 401


def listening_addresses(port: int) -> set[str]:
    """Local addresses of the sockets listening on `port` (IPv4, from /proc/net/tcp)."""
    found = set()
    for line in Path("/proc/net/tcp").read_text().splitlines()[1:]:
        local, state = line.split()[1], line.split()[3]
        address_hex, port_hex = local.split(":")
        if state == "0A" and int(port_hex, 16) == port:  # 0A: LISTEN
            raw = bytes.fromhex(address_hex)[::-1]
            found.add(".".join(str(b) for b in raw))
    return found


def test_every_process_listens_on_loopback_only(cluster: Cluster) -> None:
    for child in cluster.children:
        port = int(child.url.rsplit(":", 1)[1])
        assert listening_addresses(port) == {"127.0.0.1"}, child.name


@pytest.mark.parametrize("mode", list(schemathesis.GenerationMode), ids=str)
def test_router_fuzz_gets_no_server_errors(
    cluster: Cluster, mode: schemathesis.GenerationMode
) -> None:
    # The router forwards bodies as-is, so the rank's API document describes its public
    # routes; requests go to the router. Operations are driven one by one, as in
    # tests/e2e/test_fuzz.py.
    rank = cluster.decode[0].url
    rank_auth = {"authorization": f"Bearer {cluster.rank_api_key}"}
    document = httpx.get(rank + "/openapi.json", headers=rank_auth, timeout=30).json()
    schema = schemathesis.openapi.from_dict(document)
    operations = [result.ok() for result in schema.get_all_operations()]
    if mode is schemathesis.GenerationMode.NEGATIVE:  # nothing to get wrong without inputs
        operations = [op for op in operations if op.body or op.query]
    assert len(operations) >= (9 if mode is schemathesis.GenerationMode.POSITIVE else 4)
    calls: list[str] = []
    for operation in operations:

        @given(case=operation.as_strategy(generation_mode=mode))
        @FUZZ_SETTINGS
        def check(case: schemathesis.Case) -> None:
            calls.append(case.operation.path)
            response = case.call(base_url=cluster.router_url, headers=AUTH, timeout=60)
            assert_answered_well(response, case.as_curl_command())

        check()
    assert set(calls) == {operation.path for operation in operations}  # each exercised
    assert httpx.get(cluster.router_url + "/health", timeout=10).status_code == 200


JSON_VALUES = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats() | st.text(max_size=40),
    lambda children: (
        st.lists(children, max_size=5) | st.dictionaries(st.text(max_size=12), children, max_size=5)
    ),
    max_leaves=20,
)
FIELDS = ("model", "prompt", "messages", "input_ids", "text", "max_tokens", "stream",
          "sampling_params", "stream_options", "temperature", "n", "stop")  # fmt: skip
BODIES = st.one_of(
    st.binary(max_size=200),
    JSON_VALUES.map(lambda value: json.dumps(value).encode()),
    st.dictionaries(st.sampled_from(FIELDS), JSON_VALUES, max_size=6).map(
        lambda value: json.dumps(value).encode()
    ),
)


@pytest.mark.parametrize("path", GENERATION_PATHS)
def test_router_raw_body_fuzz_gets_no_server_errors(cluster: Cluster, path: str) -> None:
    with httpx.Client(base_url=cluster.router_url, headers=AUTH, timeout=60) as client:

        @given(body=BODIES)
        @settings(FUZZ_SETTINGS, max_examples=4 * MAX_EXAMPLES)
        def check(body: bytes) -> None:
            response = client.post(path, content=body, headers={"content-type": "application/json"})
            assert_answered_well(response, repr(body))
            if response.headers.get("content-type", "").startswith("text/event-stream"):
                assert response.text.rstrip().endswith("data: [DONE]")

        check()
    assert httpx.get(cluster.router_url + "/health", timeout=10).status_code == 200
