"""`kvstrata router --discovery kubernetes` with real processes: two `kvstrata serve`
ranks and a router whose Kubernetes API is a stand-in for the API server
(tests/k8s_api_stand_in.py: the real pod list and watch protocol on a real socket, the
kubeconfig written here). Through the router's GET /workers: a ready pod whose rank
answers joins and requests are served; a pod not ready, without an IP, being deleted or
whose rank does not answer does not join; DELETED leaves; an IP change moves the URL; a
bookmark then a 410 Gone (an ERROR event, or HTTP 410 on a watch from the bookmark's
resourceVersion) forces a LIST after which a pod gone in the gap leaves and a new one
joins; a rank that registered itself is not removed by discovery."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from cluster_key import ROUTER_KEY
from k8s_api_stand_in import KubeApiStandIn, make_pod
from server_harness import SERVER_FLAGS, ServerProcess, _free_port, spawn
from test_kv_events import wait_for

LOOPBACK_2 = "127.0.0.2"  # the second rank's "pod IP": same port, another address


@pytest.fixture(scope="module")
def ranks(tiny_llama: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[int]:
    """Two ranks on one port: 127.0.0.1:PORT and 127.0.0.2:PORT (pods that moved)."""
    logs = tmp_path_factory.mktemp("k8s-ranks")
    port = _free_port()
    procs = [
        spawn(
            logs / f"rank-{host}.log",
            port,
            "serve",
            "--model",
            str(tiny_llama),
            "--host",
            host,
            *SERVER_FLAGS,
        )
        for host in ("127.0.0.1", LOOPBACK_2)
    ]
    try:
        for host in ("127.0.0.1", LOOPBACK_2):
            wait_for(f"http://{host}:{port}/health", lambda b: b.get("status") == "ok", 180)
        yield port
    finally:
        for proc in procs:
            proc.stop()


@pytest.fixture()
def api() -> Iterator[KubeApiStandIn]:
    with KubeApiStandIn() as stand_in:
        yield stand_in


def start_router(api: KubeApiStandIn, tmp_path: Path) -> ServerProcess:
    kubeconfig = tmp_path / "kubeconfig.yaml"
    kubeconfig.write_text(api.kubeconfig())
    router = spawn(
        tmp_path / "router.log",
        _free_port(),
        "router",
        "--discovery",
        "kubernetes",
        "--discovery-label-selector",
        "app=kvstrata",
        "--discovery-namespace",
        "kv",
        "--discovery-kubeconfig",
        str(kubeconfig),
        "--discovery-poll-interval-s",
        "0.2",
        "--load-poll-interval-s",
        "0.2",
        "--log-level",
        "info",
    )
    try:
        wait_for(f"{router.base_url}/health", lambda body: "num_decode" in body)
    except BaseException:
        router.stop()
        raise
    return router


def wait_urls(router: ServerProcess, urls: set[str]) -> None:
    """Until the router's /workers lists exactly `urls`."""
    wait_for(f"{router.base_url}/workers", lambda _: {w["url"] for w in workers(router)} == urls)


def workers(router: ServerProcess) -> list[dict[str, object]]:
    return httpx.get(f"{router.base_url}/workers", headers=ROUTER_KEY, timeout=5).json()


def generate(router: ServerProcess) -> int:
    body = {"input_ids": list(range(1, 20)), "sampling_params": {"max_new_tokens": 4}}
    return httpx.post(f"{router.base_url}/generate", json=body, timeout=60).status_code


def test_pods_join_and_leave(ranks: int, api: KubeApiStandIn, tmp_path: Path) -> None:
    port, pods = ranks, api.store
    url_1, url_2 = f"http://127.0.0.1:{port}", f"http://{LOOPBACK_2}:{port}"
    pods.put(make_pod("a", "127.0.0.1", port))
    pods.put(make_pod("b", LOOPBACK_2, port, ready=False))
    pods.put(make_pod("no-ip", None, port))
    pods.put(make_pod("leaving", LOOPBACK_2, port + 1, deleting=True))
    pods.put(make_pod("silent", "127.0.0.1", _free_port()))  # its /health never answers
    pods.put(make_pod("other", LOOPBACK_2, port, labels={"app": "other"}))
    router = start_router(api, tmp_path)
    try:
        wait_urls(router, {url_1})
        assert generate(router) == 200
        assert pods.requests[0]["labelSelector"] == "app=kvstrata"
        pods.put(make_pod("b", LOOPBACK_2, port))  # b becomes ready
        wait_urls(router, {url_1, url_2})
        pods.delete("b")
        wait_urls(router, {url_1})
        pods.put(make_pod("a", LOOPBACK_2, port))  # a's IP changes: the URL moves
        wait_urls(router, {url_2})
        assert generate(router) == 200
        # A bookmark, then pods change with no events and the watch gets ERROR 410.
        pods.bookmark()
        time.sleep(0.5)  # the router reads it (it logs nothing for a bookmark)
        pods.silently(lambda p: p.update(c=make_pod("c", "127.0.0.1", port)) or p.pop("a"))
        pods.expire()
        wait_urls(router, {url_1})
        # A change the watch does not show (another app's pod), a bookmark past it, the
        # watch ends, and the watch from the bookmark's resourceVersion gets HTTP 410.
        pods.put(make_pod("other", "127.0.0.1", port, labels={"app": "other"}))
        version = pods.bookmark()
        time.sleep(0.5)
        pods.silently(lambda p: p.update(d=make_pod("d", LOOPBACK_2, port)) or p.pop("c"))
        pods.end_watches()
        wait_urls(router, {url_2})
        assert {"watch": "true", "resourceVersion": str(version)}.items() <= next(
            q for q in reversed(pods.requests) if q.get("resourceVersion") == str(version)
        ).items()
        assert all(q.get("allowWatchBookmarks") == "true" for q in pods.requests if "watch" in q)
        assert router.log().count("410 Gone") >= 2
        assert generate(router) == 200
        # A rank that registered itself stays when discovery does not see it.
        body = {"role": "decode", "url": url_1, "rank": 0}
        assert httpx.post(f"{router.base_url}/workers", json=body, headers=ROUTER_KEY).is_success
        pods.delete("d")
        wait_urls(router, {url_1})
        assert [w["registered"] for w in workers(router)] == [True]
    finally:
        router.stop()
