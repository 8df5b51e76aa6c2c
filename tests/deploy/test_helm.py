"""The Helm chart (deploy/helm/kvstrata) rendered with each values file shipped beside it:
`helm lint` passes, every object validates against the Kubernetes schemas, and the
rendered pods do what the chart promises (the cluster key only as a mounted file, probes
on /health, a grace period covering --shutdown-grace-s, the router's discovery flags, rank
flags that `kvstrata serve` accepts, one PodDisruptionBudget per workload, ...)."""

from __future__ import annotations

import base64
import json
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from helm_tool import HelmUnavailable, helm_binary

yaml = pytest.importorskip("yaml")
kubernetes_validate = pytest.importorskip("kubernetes_validate")

REPO = Path(__file__).resolve().parents[2]
CHART = REPO / "deploy" / "helm" / "kvstrata"
VALUES = {
    name: REPO / "deploy" / "helm" / f"values-{name}.yaml"
    for name in ("single-host", "pd-file-l3", "pd-mooncake")
}
RELEASE, NAMESPACE = "kv", "serving"
KUBERNETES_VERSION = "1.35"
RANK_ROLES = ("prefill", "decode")
# Kinds of CRDs (no schema in kubernetes-validate): checked field by field below.
CRD_KINDS = {"ServiceMonitor"}
DISCOVERY_FLAGS = [
    "--discovery",
    "kubernetes",
    "--discovery-namespace",
    NAMESPACE,
    "--discovery-label-selector",
    f"app.kubernetes.io/instance={RELEASE},app.kubernetes.io/name=kvstrata",
    "--discovery-role-label",
    "kvstrata.io/role",
    "--discovery-rank-port",
    "30000",
]

Doc = dict[str, Any]


@pytest.fixture(scope="session")
def helm(request: pytest.FixtureRequest) -> Path:
    try:
        return helm_binary(request.config.cache.mkdir("kvstrata-helm"))
    except HelmUnavailable as e:
        pytest.skip(f"no helm binary: {e}")


def render(helm: Path, values: str, *sets: str) -> list[Doc]:
    command = [str(helm), "template", RELEASE, str(CHART), "-n", NAMESPACE, "-f", values]
    for each in sets:
        command += ["--set", each]
    done = subprocess.run(command, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    return [doc for doc in yaml.safe_load_all(done.stdout) if doc]


@pytest.fixture(scope="module", params=sorted(VALUES))
def case(request: pytest.FixtureRequest, helm: Path) -> tuple[str, list[Doc]]:
    return request.param, render(helm, str(VALUES[request.param]))


def values_of(name: str) -> Doc:
    """The chart's defaults under the values file `name` (dicts merged, as Helm does)."""
    merged = yaml.safe_load((CHART / "values.yaml").read_text())

    def merge(into: Doc, over: Doc) -> None:
        for key, value in over.items():
            if isinstance(value, dict) and isinstance(into.get(key), dict):
                merge(into[key], value)
            else:
                into[key] = value

    merge(merged, yaml.safe_load(VALUES[name].read_text()))
    return merged


def of_kind(docs: list[Doc], kind: str) -> list[Doc]:
    return [d for d in docs if d["kind"] == kind]


def workload(docs: list[Doc], component: str) -> Doc | None:
    found = [
        d
        for d in of_kind(docs, "Deployment")
        if d["spec"]["template"]["metadata"]["labels"].get("app.kubernetes.io/component")
        == component
    ]
    assert len(found) <= 1
    return found[0] if found else None


def pod_specs(docs: list[Doc]) -> Iterator[tuple[str, Doc]]:
    for d in of_kind(docs, "Deployment"):
        labels = d["spec"]["template"]["metadata"]["labels"]
        yield labels["app.kubernetes.io/component"], d["spec"]["template"]["spec"]


def containers(pod: Doc) -> list[Doc]:
    return pod.get("initContainers", []) + pod["containers"]


def main_container(pod: Doc) -> Doc:
    assert len(pod["containers"]) == 1
    return pod["containers"][0]


def rank_roles(name: str) -> tuple[str, ...]:
    return RANK_ROLES if values_of(name)["pd"]["enabled"] else ("decode",)


@pytest.mark.parametrize("name", sorted(VALUES))
def test_helm_lint(helm: Path, name: str) -> None:
    done = subprocess.run(
        [str(helm), "lint", str(CHART), "--strict", "-f", str(VALUES[name])],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stdout + done.stderr


def test_every_object_matches_the_kubernetes_schemas(case: tuple[str, list[Doc]]) -> None:
    _, docs = case
    for doc in docs:
        if doc["kind"] in CRD_KINDS:
            continue
        # strict: an unknown field (a misspelt key) fails too.
        kubernetes_validate.validate(doc, KUBERNETES_VERSION, strict=True)


def test_the_workloads_each_values_file_asks_for(case: tuple[str, list[Doc]]) -> None:
    name, docs = case
    values = values_of(name)
    assert workload(docs, "router")["spec"]["replicas"] == values["router"]["replicas"]
    for role in RANK_ROLES:
        deployment = workload(docs, role)
        if role not in rank_roles(name):
            assert deployment is None
            continue
        assert deployment["spec"]["replicas"] == values[role]["replicas"]
        pod = deployment["spec"]["template"]
        assert pod["metadata"]["labels"]["kvstrata.io/role"] == role
        assert pod["metadata"]["annotations"]["kvstrata.io/port"] == "30000"
        assert pod["spec"].get("nodeSelector", {}) == values[role]["nodeSelector"]
        assert pod["spec"].get("tolerations", []) == values[role]["tolerations"]
        limits = main_container(pod["spec"])["resources"]["limits"]
        assert limits["nvidia.com/gpu"] == values[role]["gpus"] > 0
    masters = [d for d in docs if "mooncake-master" in d["metadata"]["name"]]
    if values["l3"]["backend"] == "mooncake":
        assert sorted(d["kind"] for d in masters) == ["Deployment", "Service"]
    else:
        assert masters == []


def test_replicas_and_placement_come_from_values(helm: Path) -> None:
    docs = render(
        helm,
        str(VALUES["pd-file-l3"]),
        "prefill.replicas=3",
        "decode.replicas=5",
        "router.replicas=2",
        "decode.gpus=2",
        "prefill.nodeSelector.pool=prefill-pool",
    )
    assert [workload(docs, c)["spec"]["replicas"] for c in ("prefill", "decode", "router")] == [
        3,
        5,
        2,
    ]
    decode_pod = workload(docs, "decode")["spec"]["template"]["spec"]
    assert main_container(decode_pod)["resources"]["limits"]["nvidia.com/gpu"] == 2
    prefill_pod = workload(docs, "prefill")["spec"]["template"]["spec"]
    assert prefill_pod["nodeSelector"]["pool"] == "prefill-pool"


def test_labels_the_router_discovers_ranks_by(case: tuple[str, list[Doc]]) -> None:
    name, docs = case
    for component, _ in pod_specs(docs):
        deployment = workload(docs, component)
        labels = deployment["spec"]["template"]["metadata"]["labels"]
        assert labels["app.kubernetes.io/name"] == "kvstrata"
        assert labels["app.kubernetes.io/instance"] == RELEASE
        assert ("kvstrata.io/role" in labels) == (component in RANK_ROLES)
        # The Deployment's selector picks its own pods only.
        assert deployment["spec"]["selector"]["matchLabels"].items() <= labels.items()
    components = {component for component, _ in pod_specs(docs)}
    assert components - {"router", "mooncake-master"} == set(rank_roles(name))


def test_the_cluster_key_is_a_mounted_file_never_an_env_var(case: tuple[str, list[Doc]]) -> None:
    _, docs = case
    (secret,) = of_kind(docs, "Secret")
    key = base64.b64decode(secret["data"]["cluster-key"]).decode()
    assert len(key) >= 32
    key_file = "/etc/kvstrata/cluster-key/cluster-key"
    for component, pod in pod_specs(docs):
        for container in containers(pod):
            for env in container.get("env", []):
                assert "secretKeyRef" not in env.get("valueFrom", {}), (component, env)
                assert key not in env.get("value", ""), component
            assert all("secretRef" not in source for source in container.get("envFrom", []))
            assert all(key not in arg for arg in container.get("args", []))
        if component == "mooncake-master":
            assert all("secret" not in v for v in pod.get("volumes", []))
            continue
        (volume,) = [v for v in pod["volumes"] if "secret" in v]
        assert volume["secret"]["secretName"] == secret["metadata"]["name"]
        mount = next(m for m in main_container(pod)["volumeMounts"] if m["name"] == volume["name"])
        assert mount["readOnly"] and key_file.startswith(mount["mountPath"] + "/")
        assert f"--cluster-key-file={key_file}" in main_container(pod)["args"]
    rendered = json.dumps([d for d in docs if d["kind"] != "Secret"])
    assert key not in rendered and secret["data"]["cluster-key"] not in rendered


def test_an_existing_secret_replaces_the_generated_one(helm: Path) -> None:
    docs = render(helm, str(VALUES["single-host"]), "clusterKey.existingSecret=my-key")
    assert of_kind(docs, "Secret") == []
    for component, pod in pod_specs(docs):
        (volume,) = [v for v in pod["volumes"] if "secret" in v]
        assert volume["secret"]["secretName"] == "my-key", component
    # Without a cluster to look the Secret up in, each render draws a new random key.
    first, second = (
        of_kind(render(helm, str(VALUES["single-host"])), "Secret")[0] for _ in range(2)
    )
    assert first["data"] != second["data"]


def test_probes_check_health(case: tuple[str, list[Doc]]) -> None:
    _, docs = case
    for component, pod in pod_specs(docs):
        container = main_container(pod)
        for probe in ("readinessProbe", "livenessProbe"):
            if component == "mooncake-master":
                assert container[probe]["tcpSocket"]["port"] == "rpc"
                continue
            assert container[probe]["httpGet"] == {"path": "/health", "port": "http"}
        ports = {p["name"]: p["containerPort"] for p in container["ports"]}
        if component != "mooncake-master":
            assert ports == {"http": 30000}


def test_grace_period_covers_the_shutdown_grace(case: tuple[str, list[Doc]]) -> None:
    name, docs = case
    shutdown = values_of(name)["shutdown"]
    for role in rank_roles(name):
        pod = workload(docs, role)["spec"]["template"]["spec"]
        args = main_container(pod)["args"]
        (grace,) = [a.split("=", 1)[1] for a in args if a.startswith("--shutdown-grace-s=")]
        assert float(grace) == shutdown["graceS"]
        assert pod["terminationGracePeriodSeconds"] >= float(grace) + shutdown["marginS"]
    router = workload(docs, "router")["spec"]["template"]["spec"]
    assert router["terminationGracePeriodSeconds"] >= shutdown["graceS"]


def test_ranks_listen_everywhere_and_advertise_their_pod_ip(case: tuple[str, list[Doc]]) -> None:
    name, docs = case
    for role in rank_roles(name):
        container = main_container(workload(docs, role)["spec"]["template"]["spec"])
        assert container["command"] == ["kvstrata"] and container["args"][0] == "serve"
        assert "--host=0.0.0.0" in container["args"]
        assert "--advertise-url=http://$(POD_IP):30000" in container["args"]
        (pod_ip,) = [e for e in container["env"] if e["name"] == "POD_IP"]
        assert pod_ip["valueFrom"]["fieldRef"]["fieldPath"] == "status.podIP"


def parse_serve_args(args: list[str]) -> Any:
    """`kvstrata serve` args as the real CLI parses them ($(POD_IP) as Kubernetes fills it)."""
    from kvstrata.__main__ import build_parser

    filled = [a.replace("$(POD_IP)", "10.1.2.3") for a in args]
    parsed, unknown = build_parser().parse_known_args(filled)
    assert unknown == [], f"kvstrata serve does not know {unknown}"
    return parsed


def test_rank_flags_are_flags_kvstrata_serve_accepts(case: tuple[str, list[Doc]]) -> None:
    name, docs = case
    values = values_of(name)
    for role in rank_roles(name):
        pod = workload(docs, role)["spec"]["template"]["spec"]
        args = parse_serve_args(main_container(pod)["args"])
        # Flags not given parse as None (their defaults: null, none).
        mode = role if values["pd"]["enabled"] else None
        assert args.disaggregation_mode == mode
        backend = values["l3"]["backend"]
        assert args.hicache_storage_backend == (None if backend == "none" else backend)
        (model_mount,) = [m for m in main_container(pod)["volumeMounts"] if m["name"] == "model"]
        assert Path(model_mount["mountPath"]) in (Path(args.model), *Path(args.model).parents)
        if values["pd"]["enabled"]:
            transport = json.loads(args.disaggregation_mooncake_config)
            assert transport["local_hostname"] == "10.1.2.3"
        if values["l3"]["backend"] == "file":
            (l3_mount,) = [m for m in main_container(pod)["volumeMounts"] if m["name"] == "l3"]
            assert args.hicache_storage_dir.startswith(l3_mount["mountPath"] + "/")
            (l3_volume,) = [v for v in pod["volumes"] if v["name"] == "l3"]
            assert l3_volume["persistentVolumeClaim"]["claimName"] == "kvstrata-l3"
        if values["l3"]["backend"] == "mooncake":
            store = json.loads(args.hicache_storage_backend_extra_config)
            (service,) = [
                d for d in of_kind(docs, "Service") if "mooncake-master" in d["metadata"]["name"]
            ]
            rpc = next(p["port"] for p in service["spec"]["ports"] if p["name"] == "rpc")
            assert store["master_server_address"] == f"{service['metadata']['name']}:{rpc}"
            assert store["local_hostname"] == "10.1.2.3"


def test_the_model_comes_from_a_volume_or_an_init_container(case: tuple[str, list[Doc]]) -> None:
    name, docs = case
    model = values_of(name)["model"]
    for component, pod in pod_specs(docs):
        if component == "mooncake-master":
            continue
        (volume,) = [v for v in pod["volumes"] if v["name"] == "model"]
        if model["source"] == "fetch":
            assert "emptyDir" in volume
            (init,) = pod["initContainers"]
            assert init["args"][:2] == ["fetch-model", model["fetch"]["name"]]
            assert any(f"--model={init['args'][2]}" == a for a in main_container(pod)["args"])
        else:
            assert "initContainers" not in pod
            source = volume.get("persistentVolumeClaim", {}).get("claimName")
            assert source or volume["hostPath"]["path"] == model["hostPath"]


def test_the_router_discovers_ranks_through_kubernetes(case: tuple[str, list[Doc]]) -> None:
    _, docs = case
    pod = workload(docs, "router")["spec"]["template"]["spec"]
    args = main_container(pod)["args"]
    assert args[0] == "router" and "--host=0.0.0.0" in args
    start = args.index("--discovery")
    assert args[start : start + len(DISCOVERY_FLAGS)] == DISCOVERY_FLAGS
    from kvstrata.__main__ import build_parser

    parsed, unknown = build_parser().parse_known_args(args)
    assert unknown == [] and parsed.discovery == "kubernetes", unknown
    assert parsed.discovery_rank_port == 30000
    (account,) = of_kind(docs, "ServiceAccount")
    assert pod["serviceAccountName"] == account["metadata"]["name"]
    for component, other in pod_specs(docs):
        if component != "router":
            assert other["automountServiceAccountToken"] is False
    (service,) = [d for d in of_kind(docs, "Service") if d["metadata"]["name"].endswith("-router")]
    assert service["spec"]["selector"]["app.kubernetes.io/component"] == "router"


def test_router_rbac_reads_pods_and_endpointslices_only(case: tuple[str, list[Doc]]) -> None:
    _, docs = case
    (role,) = of_kind(docs, "Role")
    granted = {
        (group, resource): sorted(rule["verbs"])
        for rule in role["rules"]
        for group in rule["apiGroups"]
        for resource in rule["resources"]
    }
    assert granted == {
        ("", "pods"): ["get", "list", "watch"],
        ("discovery.k8s.io", "endpointslices"): ["get", "list", "watch"],
    }
    (binding,) = of_kind(docs, "RoleBinding")
    (account,) = of_kind(docs, "ServiceAccount")
    assert binding["roleRef"]["name"] == role["metadata"]["name"]
    assert binding["subjects"] == [
        {"kind": "ServiceAccount", "name": account["metadata"]["name"], "namespace": NAMESPACE}
    ]


def test_one_disruption_budget_per_workload(case: tuple[str, list[Doc]]) -> None:
    name, docs = case
    budgets = {
        d["spec"]["selector"]["matchLabels"]["app.kubernetes.io/component"]: d
        for d in of_kind(docs, "PodDisruptionBudget")
    }
    assert set(budgets) == {"router", *rank_roles(name)}
    for component, budget in budgets.items():
        labels = workload(docs, component)["spec"]["template"]["metadata"]["labels"]
        assert budget["spec"]["selector"]["matchLabels"].items() <= labels.items()
        assert budget["spec"]["maxUnavailable"] == 1


def test_the_service_monitor_only_when_enabled(helm: Path) -> None:
    for name in sorted(VALUES):
        for enabled in (False, True):
            docs = render(helm, str(VALUES[name]), f"serviceMonitor.enabled={enabled}")
            monitors = of_kind(docs, "ServiceMonitor")
            assert len(monitors) == int(enabled)
            if not enabled:
                continue
            (monitor,) = monitors
            assert monitor["apiVersion"] == "monitoring.coreos.com/v1"
            assert monitor["spec"]["endpoints"] == [
                {"port": "http", "path": "/metrics", "interval": "15s"}
            ]
            selector = monitor["spec"]["selector"]["matchLabels"]
            scraped = {
                d["metadata"]["labels"]["app.kubernetes.io/component"]
                for d in of_kind(docs, "Service")
                if selector.items() <= d["metadata"]["labels"].items()
                and any(p["name"] == "http" for p in d["spec"]["ports"])
            }
            assert scraped == {"router", *rank_roles(name)}
    defaults = yaml.safe_load((CHART / "values.yaml").read_text())
    assert defaults["serviceMonitor"]["enabled"] is False
