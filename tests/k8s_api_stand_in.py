"""A stand-in for the Kubernetes API server's pod list and watch, on a real socket, for
the router's `--discovery kubernetes` tests: GET /api/v1/namespaces/NS/pods answers a
PodList (with ?watch=true, newline-delimited watch events, chunked). The test changes the
pods; open watches stream each change. `silently` changes pods without events and drops
the event history (an etcd compaction): a watch from before it gets 410 Gone."""

from __future__ import annotations

import json
import threading
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import parse_qs, urlsplit

Pod = dict[str, Any]


def make_pod(
    name: str,
    ip: str | None,
    port: int,
    role: str = "decode",
    ready: bool = True,
    deleting: bool = False,
    labels: dict[str, str] | None = None,
) -> Pod:
    """A pod as the API server sends it (only the fields discovery reads, and a few)."""
    metadata: dict[str, Any] = {
        "name": name,
        "namespace": "kv",
        "labels": {"app": "kvstrata", "kvstrata.io/role": role} | (labels or {}),
        "annotations": {"kvstrata.io/port": str(port)},
    }
    if deleting:
        metadata["deletionTimestamp"] = "2026-01-01T00:00:00Z"
    condition = {"type": "Ready", "status": "True" if ready else "False"}
    status: dict[str, Any] = {"phase": "Running", "conditions": [condition]}
    if ip is not None:
        status["podIP"] = ip
    return {"apiVersion": "v1", "kind": "Pod", "metadata": metadata, "status": status}


class PodStore:
    """The pods, their resourceVersions and the watch event history, under one lock."""

    def __init__(self) -> None:
        self.cond = threading.Condition()
        self.version = 100
        self.pods: dict[str, Pod] = {}
        self.log: list[tuple[int, str, Pod]] = []  # (version, type, object), in order
        self.oldest_version = self.version  # a watch from before this gets 410 Gone
        self.generation = 0  # bumped to end every open watch
        self.requests: list[dict[str, str]] = []  # the query of every GET, in order

    def _event(self, kind: str, pod: Pod, bump: bool = True) -> None:
        if bump:
            self.version += 1
            pod["metadata"]["resourceVersion"] = str(self.version)
        self.log.append((self.version, kind, pod))
        self.cond.notify_all()

    def put(self, pod: Pod) -> None:
        with self.cond:
            name = pod["metadata"]["name"]
            self._event("MODIFIED" if name in self.pods else "ADDED", pod)
            self.pods[name] = pod

    def delete(self, name: str) -> None:
        with self.cond:
            self._event("DELETED", self.pods.pop(name))

    def bookmark(self) -> int:
        with self.cond:
            mark = {
                "kind": "Pod",
                "apiVersion": "v1",
                "metadata": {"resourceVersion": str(self.version)},
            }
            self._event("BOOKMARK", mark, bump=False)
            return self.version

    def silently(self, change: Callable[[dict[str, Pod]], None]) -> None:
        """Change the pods without watch events; the history before now is gone (a watch
        from an older resourceVersion gets 410)."""
        with self.cond:
            change(self.pods)
            self.version += 1
            for pod in self.pods.values():
                pod["metadata"].setdefault("resourceVersion", str(self.version))
            self.oldest_version = self.version

    def expire(self) -> None:
        """An ERROR event with a 410 Status on every open watch (which then ends)."""
        with self.cond:
            status = {
                "kind": "Status",
                "apiVersion": "v1",
                "status": "Failure",
                "code": 410,
                "reason": "Expired",
                "message": "too old resource version",
            }
            self._event("ERROR", status, bump=False)

    def end_watches(self) -> None:
        with self.cond:
            self.generation += 1
            self.cond.notify_all()

    def news(self, position: int, generation: int) -> bool:
        """Events past `position` in the log, or watches of `generation` ended."""
        return len(self.log) > position or self.generation != generation

    def matching(self, selector: str) -> list[Pod]:
        return [pod for pod in self.pods.values() if selects(selector, pod)]


def selects(selector: str, pod: Pod) -> bool:
    """Equality terms only (`a=b,c=d`): all the stand-in needs."""
    wanted = dict(term.split("=", 1) for term in selector.split(",") if term)
    return wanted.items() <= pod["metadata"]["labels"].items()


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    store: PodStore

    def log_message(self, format: str, *args: Any) -> None:
        pass

    def do_GET(self) -> None:
        url = urlsplit(self.path)
        query = {k: v[-1] for k, v in parse_qs(url.query).items()}
        with self.store.cond:
            self.store.requests.append(query)
        if url.path != "/api/v1/namespaces/kv/pods":
            self._json(404, {"kind": "Status", "code": 404, "message": "not found"})
        elif query.get("watch") == "true":
            self._watch(query)
        else:
            with self.store.cond:
                items = self.store.matching(query.get("labelSelector", ""))
                version = str(self.store.version)
            body = {
                "kind": "PodList",
                "apiVersion": "v1",
                "metadata": {"resourceVersion": version},
                "items": items,
            }
            self._json(200, body)

    def _json(self, status: int, body: Any) -> None:
        data = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def _watch(self, query: dict[str, str]) -> None:
        store, since = self.store, int(query.get("resourceVersion", "0"))
        with store.cond:
            if since < store.oldest_version:
                gone = {
                    "kind": "Status",
                    "code": 410,
                    "reason": "Expired",
                    "message": f"too old resource version: {since}",
                }
                self._json(410, gone)
                return
            generation = store.generation
            # The history after `since`, then what comes (bookmarks and errors: new only).
            position = len(store.log)
            backlog = [e for e in store.log if e[0] > since and e[1] not in ("BOOKMARK", "ERROR")]
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Transfer-Encoding", "chunked")
        self.send_header("Connection", "close")  # the stream ends with the connection
        self.end_headers()
        for event in backlog:
            self._send(event)
        selector = query.get("labelSelector", "")
        while True:
            with store.cond:
                store.cond.wait_for(lambda p=position: store.news(p, generation), timeout=1.0)
                if store.generation != generation:
                    break
                fresh, position = store.log[position:], len(store.log)
            fresh = [e for e in fresh if e[1] in ("BOOKMARK", "ERROR") or selects(selector, e[2])]
            for event in fresh:
                self._send(event)
            if any(event[1] == "ERROR" for event in fresh):
                break
        self.wfile.write(b"0\r\n\r\n")
        self.close_connection = True

    def _send(self, event: tuple[int, str, Pod]) -> None:
        line = json.dumps({"type": event[1], "object": event[2]}).encode() + b"\n"
        self.wfile.write(f"{len(line):x}\r\n".encode() + line + b"\r\n")
        self.wfile.flush()


class KubeApiStandIn:
    """The stand-in server on 127.0.0.1 (a free port) and a kubeconfig pointing at it."""

    def __init__(self) -> None:
        self.store = PodStore()
        handler = type("Handler", (_Handler,), {"store": self.store})
        self.server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self._thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def __enter__(self) -> KubeApiStandIn:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.store.end_watches()
        self.server.shutdown()
        self.server.server_close()

    def kubeconfig(self) -> str:
        """A kubeconfig (JSON is YAML) for this server, namespace `kv`."""
        return json.dumps(
            {
                "apiVersion": "v1",
                "kind": "Config",
                "current-context": "stand-in",
                "clusters": [{"name": "stand-in", "cluster": {"server": self.url}}],
                "users": [{"name": "tester", "user": {"token": "stand-in-token"}}],
                "contexts": [
                    {
                        "name": "stand-in",
                        "context": {"cluster": "stand-in", "user": "tester", "namespace": "kv"},
                    }
                ],
            }
        )
