"""A PD cluster across hosts on one box (network namespaces on a bridge): ranks register
with the router by their own addresses, KV crosses hosts over the Mooncake Transfer Engine,
and under load it survives a decode host's link going down mid-stream, a partition between
the prefill and decode hosts, and the mooncake_master host restarting. Every request is
answered with the unified reference's tokens or fails with a clear error, no page leaks,
and the cluster heals by itself; the figures go to a JSON file in the temp directory."""

from __future__ import annotations

import importlib.util
import json
import random
import tempfile
import time
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from pathlib import Path

import httpx
import pytest
from cluster_key import ROUTER_KEY
from fault_load import PAGE_SIZE, Load, Outcome, Reference, generate, judge
from mooncake_fixtures import master_binary
from netns_cluster import HOST_NAMES, Cluster, wait_for
from netns_hosts import HostNet, netns_unavailable

HEAL_TIMEOUT_S = 90.0
DRAIN_TIMEOUT_S = 60.0


def _skip_reason() -> str | None:
    if master_binary() is None or importlib.util.find_spec("mooncake.store") is None:
        return "mooncake (mooncake_master and mooncake.store) is not installed"
    return netns_unavailable()


@dataclass
class Figures:
    """What one fault did to the requests sent while it lasted and healed."""

    fault: str
    sent: int
    answered: int
    failed: int
    recomputed: int  # answered, but prefilled on the decode host (the transfer path was down)
    failure_messages: dict[str, int]
    leaked_pages: dict[str, int]
    fault_s: float  # how long the fault was held
    heal_s: float  # from the repair to a cluster that serves PD across hosts again


@pytest.fixture(scope="module")
def figures() -> Iterator[list[Figures]]:
    measured: list[Figures] = []
    yield measured
    if measured:
        name = f"kvstrata-netns-faults-{time.strftime('%Y%m%d-%H%M%S')}.json"
        path = Path(tempfile.gettempdir()) / name
        path.write_text(json.dumps([asdict(f) for f in measured], indent=2))
        print(f"\nacross-hosts fault figures ({path}):")
        for f in measured:
            print(
                f"  {f.fault}: sent {f.sent}, answered {f.answered} (recomputed "
                f"{f.recomputed}), failed {f.failed} {f.failure_messages}, leaked pages "
                f"{f.leaked_pages}, heal {f.heal_s:.1f} s"
            )


@pytest.fixture(scope="module")
def cluster(tiny_llama: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    reason = _skip_reason()
    if reason is not None:
        pytest.skip(reason)
    with HostNet(HOST_NAMES) as net:
        started = Cluster(net, tiny_llama, tmp_path_factory.mktemp("netns-logs"))
        try:
            started.start()
            yield started
        finally:
            started.stop()
    assert not net.leftovers(), net.leftovers()


@pytest.fixture(scope="module")
def reference(tiny_llama: Path) -> Reference:
    return Reference(str(tiny_llama), PAGE_SIZE)


class Prober:
    """Fresh PD requests sent straight to each decode rank, naming the prefill rank:
    completed with KV transferred means the path across hosts works again."""

    def __init__(self, cluster: Cluster, seed: int) -> None:
        self.cluster, self.rng = cluster, random.Random(seed)
        self.outcomes: list[Outcome] = []

    def pd_works(self) -> bool:
        if not self.cluster.whole():
            return False
        for decode in ("decode-0", "decode-1"):
            prompt = [self.rng.randrange(500) for _ in range(24)]  # new: nothing cached
            headers = {"X-Kvstrata-Prefill-Url": self.cluster.url("prefill"), **ROUTER_KEY}
            with httpx.Client(
                base_url=self.cluster.url(decode), timeout=60, headers=headers, trust_env=False
            ) as client:
                outcome = generate(client, prompt, stream=False)
            self.outcomes.append(outcome)
            if outcome.kind != "completed" or not outcome.usage:
                return False
            if outcome.usage["kvstrata"]["transferred_tokens"] == 0:
                return False  # recomputed on the decode rank: the transfer path is still down
        return True


def run_fault(
    cluster: Cluster,
    reference: Reference,
    fault: str,
    inject: Callable[[], None],
    repair: Callable[[], None],
    hold_s: float,
    seed: int,
    max_new_tokens: int = 6,
) -> Figures:
    """A conversation load through the router; the fault injected once requests run, held
    `hold_s`, repaired; then the heal is timed, the load drained and judged."""
    prober = Prober(cluster, seed)
    with Load(
        cluster.router_url,
        num_conversations=3,
        seed=seed,
        max_turns=40,
        max_new_tokens=max_new_tokens,
    ) as load:
        wait_for(lambda: load.num_done >= 3, 60, "the load runs")
        inject()
        time.sleep(hold_s)
        repair()
        try:
            heal_s = wait_for(prober.pd_works, HEAL_TIMEOUT_S, f"{fault}: the cluster heals")
        except AssertionError as e:
            last = [(o.kind, o.detail, o.usage) for o in prober.outcomes[-2:]]
            logs = {name: cluster.log_tail(name, 1500) for name in ("prefill", "decode-0")}
            raise AssertionError(f"{e}; last probes: {last}; logs: {logs}") from None
        num_after_heal = load.num_done
        wait_for(lambda: load.num_done >= num_after_heal + 3, 60, f"{fault}: load after heal")
        outcomes = load.stop(timeout_s=120) + prober.outcomes
    wait_for(cluster.drained, DRAIN_TIMEOUT_S, f"{fault}: every rank drained")
    failed = [o for o in outcomes if o.kind != "completed"]
    result = Figures(
        fault,
        len(outcomes),
        len(outcomes) - len(failed),
        len(failed),
        sum(bool(o.usage and o.usage["kvstrata"]["local_prefill_tokens"]) for o in outcomes),
        dict(Counter(o.detail[:160] for o in failed)),
        cluster.leaked_pages(),
        hold_s,
        round(heal_s, 2),
    )
    kinds = judge(outcomes, reference)  # exact tokens; failures are clear errors
    assert kinds["completed"] > 0
    assert not any(result.leaked_pages.values()), result
    return result


def test_ranks_register_and_serve_across_hosts(cluster: Cluster, reference: Reference) -> None:
    ranks = {rank["url"]: rank for rank in cluster.router_ranks()}
    assert ranks.keys() == {cluster.url(n) for n in ("prefill", "decode-0", "decode-1")}
    assert all(url.startswith(f"http://{cluster.net.subnet}.") for url in ranks)
    prompt = list(range(5, 40))
    body = cluster.generate_via("decode-1", prompt)
    assert body["usage"]["kvstrata"]["transferred_tokens"] == len(prompt)  # KV crossed hosts
    assert body["output_ids"] == reference.outputs([(prompt, 6)])[0]
    with Load(cluster.router_url, num_conversations=2, seed=1, max_turns=3) as load:
        outcomes = load.join()
    assert judge(outcomes, reference)["completed"] == len(outcomes) == 6


def test_decode_host_link_down_mid_stream(
    cluster: Cluster, reference: Reference, figures: list[Figures]
) -> None:
    veth = cluster.net["decode-0"]

    def busy() -> bool:
        ranks = cluster.router_ranks()
        return any(r["url"] == cluster.url("decode-0") and r["num_inflight"] for r in ranks)

    def inject() -> None:
        wait_for(busy, 30, "a request in flight on decode-0")
        cluster.net.set_link(veth, up=False)

    figures.append(
        run_fault(
            cluster,
            reference,
            "decode host link down",
            inject,
            lambda: cluster.net.set_link(veth, up=True),
            hold_s=4.0,
            seed=2,
            max_new_tokens=32,
        )
    )


def test_partition_between_prefill_and_decode_hosts(
    cluster: Cluster, reference: Reference, figures: list[Figures]
) -> None:
    prefill, decodes = cluster.net["prefill"], [cluster.net["decode-0"], cluster.net["decode-1"]]

    def inject() -> None:
        for decode in decodes:
            cluster.net.partition(prefill, decode)

    def repair() -> None:
        for decode in decodes:
            cluster.net.heal(prefill, decode)

    figures.append(
        run_fault(
            cluster, reference, "prefill/decode partition", inject, repair, hold_s=6.0, seed=3
        )
    )


def test_mooncake_master_host_restarts(
    cluster: Cluster, reference: Reference, figures: list[Figures]
) -> None:
    figures.append(
        run_fault(
            cluster,
            reference,
            "mooncake_master restart",
            cluster.kill_master,
            cluster.start_master,
            hold_s=4.0,
            seed=4,
        )
    )
