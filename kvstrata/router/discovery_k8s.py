"""`--discovery kubernetes`: the ready pods of a label selector, found by list-then-watch
through the Kubernetes API (the official `kubernetes` client, imported only here; its
blocking calls run on one daemon thread that publishes to the router's event loop)."""

from __future__ import annotations

import asyncio
import json
import logging
import os
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from kvstrata.config import ConfigError, RouterConfig
from kvstrata.router.discovery_source import DiscoveredRank, Publish
from kvstrata.router.workers import Role

logger = logging.getLogger("kvstrata.router")
PORT_ANNOTATION = "kvstrata.io/port"
ROLES = {"prefill": Role.PREFILL, "decode": Role.DECODE, "unified": Role.DECODE}
WATCH_TIMEOUT_S = 240  # the API server ends a watch after this; the thread watches again
CONNECT_TIMEOUT_S = 10.0
BACKOFF_S = (0.5, 30.0)  # first and longest wait before trying again after an error
HTTP_GONE = 410


class ResourceVersionGone(Exception):
    """410 Gone: the watch's resourceVersion is too old; only a fresh LIST recovers."""


@dataclass(frozen=True)
class PodRules:
    """How a pod becomes a rank: the label naming its role, the port if not annotated."""

    role_label: str
    default_port: int

    def rank_of(self, pod: dict[str, Any]) -> DiscoveredRank | None:
        """The rank a pod serves, or None while it should get no requests: no IP yet, not
        Ready, being deleted, or no usable role label or port annotation."""
        metadata = pod.get("metadata") or {}
        status = pod.get("status") or {}
        ip = status.get("podIP")
        conditions = status.get("conditions") or []
        ready = any(c.get("type") == "Ready" and c.get("status") == "True" for c in conditions)
        if not ip or not ready or metadata.get("deletionTimestamp"):
            return None
        role = ROLES.get((metadata.get("labels") or {}).get(self.role_label, ""))
        port = (metadata.get("annotations") or {}).get(PORT_ANNOTATION, self.default_port)
        try:
            port = int(port)
        except ValueError:
            port = 0
        if role is None or not 0 < port < 65536:
            logger.warning(
                "pod %s: no rank (label %s must be prefill, decode or unified, annotation "
                "%s a port)",
                metadata.get("name"),
                self.role_label,
                PORT_ANNOTATION,
            )
            return None
        host = f"[{ip}]" if ":" in ip else ip
        return DiscoveredRank(f"http://{host}:{port}", role)


class PodSource:
    """LIST the pods, then WATCH from the list's resourceVersion (bookmarks advance it); a
    410 Gone (HTTP status or ERROR event) lists again and the new set replaces the old;
    other errors retry with exponential backoff. Publishes after every change."""

    name = "kubernetes"

    def __init__(self, api: Any, namespace: str, selector: str, rules: PodRules) -> None:
        self.api = api  # a kubernetes.client.CoreV1Api
        self.namespace = namespace
        self.selector = selector
        self.rules = rules
        self.pods: dict[str, DiscoveredRank | None] = {}  # by pod name (thread-owned)
        self._stopped = threading.Event()

    @classmethod
    def of(cls, config: RouterConfig) -> PodSource:
        try:
            from kubernetes import client
            from kubernetes import config as kube_config
        except ImportError as e:
            raise ConfigError(
                "--discovery kubernetes needs the kubernetes client: pip install 'kvstrata[k8s]'"
            ) from e
        configuration = client.Configuration()
        try:
            if os.environ.get("KUBERNETES_SERVICE_HOST"):
                kube_config.load_incluster_config(client_configuration=configuration)
            else:
                kube_config.load_kube_config(
                    config_file=config.discovery_kubeconfig, client_configuration=configuration
                )
        except (kube_config.ConfigException, OSError) as e:
            raise ConfigError(f"--discovery-kubeconfig: {e}") from e
        api = client.CoreV1Api(client.ApiClient(configuration))
        rules = PodRules(config.discovery_role_label, config.discovery_rank_port)
        return cls(api, config.discovery_namespace, config.discovery_label_selector, rules)

    async def run(self, publish: Publish) -> None:
        loop = asyncio.get_running_loop()

        def publish_now() -> None:  # on the thread: a copy of the set, to the loop
            ranks = frozenset(rank for rank in self.pods.values() if rank is not None)
            loop.call_soon_threadsafe(publish, ranks)

        # A daemon thread: a watch blocked on its socket does not hold up the router's exit.
        thread = threading.Thread(
            target=self._follow, args=(publish_now,), name="kvstrata-k8s-watch", daemon=True
        )
        thread.start()
        try:
            await asyncio.Event().wait()
        finally:
            self._stopped.set()

    def _follow(self, publish: Any) -> None:
        backoff_s = BACKOFF_S[0]
        while not self._stopped.is_set():
            try:
                version = self._list(publish)
                while not self._stopped.is_set():
                    version = self._watch(version, publish)
                    backoff_s = BACKOFF_S[0]
            except ResourceVersionGone:
                logger.info("kubernetes: resourceVersion too old (410 Gone); listing again")
            except Exception as e:  # the API server away, a broken stream, a bad answer
                logger.warning("kubernetes: %s; trying again in %.1f s", e, backoff_s)
                self._stopped.wait(backoff_s)
                backoff_s = min(backoff_s * 2, BACKOFF_S[1])

    def _list(self, publish: Any) -> str:
        """LIST: the set replaces what the watch had; returns its resourceVersion."""
        response = self._call(timeout=(CONNECT_TIMEOUT_S, WATCH_TIMEOUT_S))
        body = json.loads(response.data)
        self.pods = {
            item["metadata"]["name"]: self.rules.rank_of(item) for item in body.get("items") or []
        }
        publish()
        return str(body["metadata"]["resourceVersion"])

    def _watch(self, version: str, publish: Any) -> str:
        """One WATCH from `version` until the server ends it; returns where to resume."""
        response = self._call(
            watch=True,
            resource_version=version,
            allow_watch_bookmarks=True,
            timeout_seconds=WATCH_TIMEOUT_S,
            timeout=(CONNECT_TIMEOUT_S, WATCH_TIMEOUT_S + 30),
        )
        try:
            for event in _events(response):
                kind, pod = event.get("type"), event.get("object") or {}
                if kind == "ERROR":
                    if pod.get("code") == HTTP_GONE:
                        raise ResourceVersionGone(pod.get("message"))
                    raise RuntimeError(f"watch ERROR event: {pod.get('message')}")
                metadata = pod.get("metadata") or {}
                version = str(metadata.get("resourceVersion") or version)
                if kind in ("ADDED", "MODIFIED"):
                    self.pods[metadata["name"]] = self.rules.rank_of(pod)
                elif kind == "DELETED":
                    self.pods.pop(metadata.get("name", ""), None)
                if kind != "BOOKMARK":
                    publish()
                if self._stopped.is_set():
                    break
        finally:
            response.release_conn()
        return version

    def _call(self, timeout: tuple[float, float], **watch: Any) -> Any:
        """GET the pods (a list, or with `watch` a watch); the raw response, 2xx only."""
        from kubernetes.client.exceptions import ApiException

        try:
            response = self.api.list_namespaced_pod(
                self.namespace,
                label_selector=self.selector,
                _preload_content=False,
                _request_timeout=timeout,
                **watch,
            )
        except ApiException as e:
            if e.status == HTTP_GONE:
                raise ResourceVersionGone(e.reason) from e
            raise
        if response.status == HTTP_GONE:
            raise ResourceVersionGone(response.data[:200])
        if not 200 <= response.status < 300:
            raise RuntimeError(f"the API server answered {response.status}")
        return response


def _events(response: Any) -> Iterator[dict[str, Any]]:
    """The watch events of a streamed answer: one JSON object a line."""
    buffer = b""
    for chunk in response.stream(amt=None, decode_content=False):
        buffer += chunk
        *lines, buffer = buffer.split(b"\n")
        for line in lines:
            if line.strip():
                yield json.loads(line)
    if buffer.strip():
        yield json.loads(buffer)
