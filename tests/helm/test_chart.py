"""The Helm chart, rendered by Helm's own engine and validated against Kubernetes schemas.

Needs the ``helm`` extra (``helm-python-sdk``: Helm v4's Go engine as a library,
``kubernetes-validate``: the Kubernetes OpenAPI schemas, bundled), which
``make setup`` installs. Nothing here contacts a cluster or the network.
"""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import helm_python
import kubernetes_validate
import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "helm" / "kvmesh"
EXAMPLE = ROOT / "helm" / "examples" / "engine-with-xfer"
#: Oldest Kubernetes minor the chart supports (Chart.yaml kubeVersion), and the newest
#: whose schemas the installed kubernetes-validate bundles.
KUBE_VERSIONS = ["1.30", kubernetes_validate.latest_version()]

EXTERNAL_REDIS: dict[str, Any] = {
    "redis": {
        "internal": {"enabled": False},
        "external": {
            "url": "rediss://redis.example.internal:6380/0",
            "passwordSecret": {"name": "kvmesh-redis", "key": "password"},
            "tls": {"enabled": True, "caSecret": {"name": "kvmesh-redis-ca", "key": "ca.crt"}},
        },
    }
}
CLUSTER_REDIS: dict[str, Any] = {
    "indexer": {"autoscaling": {"enabled": True, "minReplicas": 2, "maxReplicas": 6}},
    "redis": {
        "cluster": True,
        "internal": {"enabled": False},
        "external": {"url": "redis://redis-cluster.cache:6379"},
    },
}
TEE_OFF: dict[str, Any] = {"tee": {"enabled": False}, "cachesim": {"enabled": False}}
MEMORY_ONE: dict[str, Any] = {
    "indexer": {"backend": "memory", "replicas": 1},
    "redis": {"internal": {"enabled": False}},
}
PERSISTENT: dict[str, Any] = {
    "redis": {"internal": {"persistence": {"enabled": True, "size": "20Gi"}, "maxmemory": "8gb"}},
    "tee": {"extraSinks": [{"type": "http", "url": "http://sim.other:8470", "name": "other"}]},
}

VALUE_SETS: dict[str, dict[str, Any]] = {
    "defaults": {},
    "external-redis": EXTERNAL_REDIS,
    "redis-cluster": CLUSTER_REDIS,
    "tee-off": TEE_OFF,
    "memory-one-replica": MEMORY_ONE,
    "persistent-redis": PERSISTENT,
}


def render(values: dict[str, Any] | None = None, chart: Path = CHART) -> dict[str, str]:
    """Template path -> rendered text, for release ``rel`` in namespace ``ns``."""
    loaded = helm_python.Chart.load(str(chart))
    out: dict[str, str] = loaded.render(values, name="rel", namespace="ns")
    return out


def manifests(rendered: dict[str, str]) -> list[dict[str, Any]]:
    """Every Kubernetes object of a render (NOTES.txt and empty templates left out)."""
    docs: list[dict[str, Any]] = []
    for path, text in sorted(rendered.items()):
        if not path.endswith(".yaml"):
            continue
        docs += [d for d in yaml.safe_load_all(text) if d]
    return docs


def by_kind(docs: list[dict[str, Any]], kind: str) -> dict[str, dict[str, Any]]:
    return {d["metadata"]["name"]: d for d in docs if d["kind"] == kind}


def env_of(container: dict[str, Any]) -> dict[str, Any]:
    """Container env as name -> value (or the valueFrom mapping)."""
    return {e["name"]: e.get("value", e.get("valueFrom")) for e in container.get("env", [])}


def containers(doc: dict[str, Any]) -> list[dict[str, Any]]:
    spec = doc["spec"] if doc["kind"] == "Pod" else doc["spec"]["template"]["spec"]
    result: list[dict[str, Any]] = spec["containers"]
    return result


def validate_all(docs: list[dict[str, Any]]) -> None:
    for version in KUBE_VERSIONS:
        for doc in docs:
            kubernetes_validate.validate(doc, version, strict=True)


@pytest.fixture(scope="module")
def engine_chart(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """The example engine chart with this kvmesh chart vendored under charts/."""
    dest = tmp_path_factory.mktemp("engine") / "engine-with-xfer"
    shutil.copytree(EXAMPLE, dest)
    shutil.copytree(CHART, dest / "charts" / "kvmesh")
    yield dest


# -- every value set renders, lints and validates -------------------------------------


@pytest.mark.parametrize("name", sorted(VALUE_SETS))
def test_value_set_renders_and_validates_strictly(name: str) -> None:
    docs = manifests(render(VALUE_SETS[name]))
    assert docs, "nothing rendered"
    validate_all(docs)


@pytest.mark.parametrize("name", sorted(VALUE_SETS))
def test_value_set_lints_strict(name: str) -> None:
    report = helm_python.lint(str(CHART), VALUE_SETS[name], strict=True, kube_version="v1.30.0")
    problems = [m for m in report["messages"] if m["severity"] >= 2]
    assert report["errors"] == [] and problems == [], report


def test_strict_validation_catches_an_unknown_field() -> None:
    """The validator used above is strict: a misspelled field fails it."""
    doc = by_kind(manifests(render()), "Service")["rel-kvmesh-indexer"]
    doc["spec"]["ports"][0]["targetPortt"] = "grpc"
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(doc, "1.30", strict=True)


# -- what the defaults install ---------------------------------------------------------


def test_defaults_install_indexer_on_in_chart_redis() -> None:
    docs = manifests(render())
    deps = by_kind(docs, "Deployment")
    assert set(deps) == {"rel-kvmesh-indexer", "rel-kvmesh-tee", "rel-kvmesh-cachesim"}
    assert set(by_kind(docs, "StatefulSet")) == {"rel-kvmesh-redis"}
    assert "rel-kvmesh-indexer" in by_kind(docs, "PodDisruptionBudget")
    assert by_kind(docs, "HorizontalPodAutoscaler") == {}

    indexer = deps["rel-kvmesh-indexer"]
    assert indexer["spec"]["replicas"] == 2
    (c,) = containers(indexer)
    env = env_of(c)
    assert c["args"] == ["indexer", "serve"]
    assert env["KVMESH_INDEXER_HOST"] == "0.0.0.0"
    assert env["KVMESH_INDEXER_PORT"] == "50051"
    assert env["KVMESH_INDEXER_METRICS_PORT"] == "9464"
    assert env["KVMESH_INDEXER_BACKEND"] == "redis"
    assert env["KVMESH_INDEXER_REDIS__URL"] == "redis://rel-kvmesh-redis.ns.svc:6379/0"
    assert "KVMESH_INDEXER_REDIS__CLUSTER" not in env
    assert c["readinessProbe"]["grpc"]["port"] == 50051
    # Liveness must not follow Redis health (a Redis outage would restart every replica).
    assert "tcpSocket" in c["livenessProbe"]

    svc = by_kind(docs, "Service")["rel-kvmesh-indexer"]
    assert {p["name"]: p["port"] for p in svc["spec"]["ports"]} == {
        "grpc": 50051,
        "metrics": 9464,
    }


def test_in_chart_redis_has_no_persistence_by_default() -> None:
    sts = by_kind(manifests(render()), "StatefulSet")["rel-kvmesh-redis"]
    assert "volumeClaimTemplates" not in sts["spec"]
    volumes = {v["name"]: v for v in sts["spec"]["template"]["spec"]["volumes"]}
    assert "emptyDir" in volumes["data"]
    (c,) = containers(sts)
    assert c["args"][c["args"].index("--appendonly") + 1] == "no"


def test_persistent_redis_claims_a_volume() -> None:
    sts = by_kind(manifests(render(PERSISTENT)), "StatefulSet")["rel-kvmesh-redis"]
    (claim,) = sts["spec"]["volumeClaimTemplates"]
    assert claim["spec"]["resources"]["requests"]["storage"] == "20Gi"
    (c,) = containers(sts)
    assert c["args"][c["args"].index("--appendonly") + 1] == "yes"
    assert c["args"][c["args"].index("--maxmemory") + 1] == "8gb"


def test_every_pod_is_non_root_read_only_without_capabilities() -> None:
    docs = manifests(render(PERSISTENT))
    pods = [d for d in docs if d["kind"] in ("Deployment", "StatefulSet", "Pod")]
    assert len(pods) == 5  # indexer, tee, cachesim, redis, test pod
    for doc in pods:
        spec = doc["spec"] if doc["kind"] == "Pod" else doc["spec"]["template"]["spec"]
        assert spec["securityContext"]["runAsNonRoot"] is True, doc["metadata"]["name"]
        for c in spec["containers"]:
            sc = c["securityContext"]
            assert sc["readOnlyRootFilesystem"] is True, c["name"]
            assert sc["allowPrivilegeEscalation"] is False, c["name"]
            assert sc["capabilities"]["drop"] == ["ALL"], c["name"]


def test_services_are_probed_on_grpc_health() -> None:
    deps = by_kind(manifests(render()), "Deployment")
    for name, port in [("rel-kvmesh-tee", 50061), ("rel-kvmesh-cachesim", 50062)]:
        (c,) = containers(deps[name])
        assert c["readinessProbe"]["grpc"]["port"] == port
        assert c["livenessProbe"]["grpc"]["port"] == port


def test_tee_forwards_to_the_cache_simulator_and_extra_sinks() -> None:
    import json

    deps = by_kind(manifests(render(PERSISTENT)), "Deployment")
    (c,) = containers(deps["rel-kvmesh-tee"])
    sinks = json.loads(env_of(c)["KVMESH_TEE_SINKS"])
    assert sinks == [
        {"type": "grpc", "target": "rel-kvmesh-cachesim.ns.svc:50062", "name": "cachesim"},
        {"type": "http", "url": "http://sim.other:8470", "name": "other"},
    ]


def test_helm_test_pod_checks_every_deployed_service() -> None:
    rendered = render()
    (pod,) = manifests({"t.yaml": rendered["kvmesh/templates/tests/test-health.yaml"]})
    assert pod["metadata"]["annotations"]["helm.sh/hook"] == "test"
    (c,) = containers(pod)
    assert c["command"][3:] == [
        "rel-kvmesh-indexer.ns.svc:50051",
        "rel-kvmesh-tee.ns.svc:50061",
        "rel-kvmesh-cachesim.ns.svc:50062",
    ]
    # The script is real Python that checks grpc.health.v1.
    compile(c["command"][2], "<test-health>", "exec")
    assert "HealthStub" in c["command"][2]


def test_notes_list_the_endpoints() -> None:
    notes = render()["kvmesh/templates/NOTES.txt"]
    for endpoint in (
        "rel-kvmesh-indexer.ns.svc:50051",
        "rel-kvmesh-indexer.ns.svc:9464/metrics",
        "rel-kvmesh-tee.ns.svc:50061",
        "rel-kvmesh-cachesim.ns.svc:8470",
        "rel-kvmesh-cachesim.ns.svc:50062",
        "helm test rel",
    ):
        assert endpoint in notes
    assert "tee" not in render(TEE_OFF)["kvmesh/templates/NOTES.txt"].split("Endpoints")[1]


def test_image_tag_is_the_app_version() -> None:
    chart = yaml.safe_load((CHART / "Chart.yaml").read_text())
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    assert values["image"]["tag"] == chart["appVersion"]


# -- other value sets ------------------------------------------------------------------


def test_external_redis_password_from_secret_and_tls() -> None:
    docs = manifests(render(EXTERNAL_REDIS))
    assert by_kind(docs, "StatefulSet") == {}
    (c,) = containers(by_kind(docs, "Deployment")["rel-kvmesh-indexer"])
    env = env_of(c)
    assert env["KVMESH_REDIS_PASSWORD"] == {
        "secretKeyRef": {"name": "kvmesh-redis", "key": "password"}
    }
    # Kubernetes expands $(KVMESH_REDIS_PASSWORD), defined before it, into the URL.
    names = [e["name"] for e in c["env"]]
    assert names.index("KVMESH_REDIS_PASSWORD") < names.index("KVMESH_INDEXER_REDIS__URL")
    assert env["KVMESH_INDEXER_REDIS__URL"] == (
        "rediss://:$(KVMESH_REDIS_PASSWORD)@redis.example.internal:6380/0"
        "?ssl_ca_certs=/etc/kvmesh/redis-tls/ca.crt"
    )
    mounts = {m["name"]: m["mountPath"] for m in c["volumeMounts"]}
    assert mounts["redis-tls"] == "/etc/kvmesh/redis-tls"
    spec = by_kind(docs, "Deployment")["rel-kvmesh-indexer"]["spec"]["template"]["spec"]
    vols = {v["name"]: v for v in spec["volumes"]}
    assert vols["redis-tls"]["secret"] == {
        "secretName": "kvmesh-redis-ca",
        "items": [{"key": "ca.crt", "path": "ca.crt"}],
    }


def test_redis_cluster_backend_sets_the_cluster_flag_and_hpa() -> None:
    docs = manifests(render(CLUSTER_REDIS))
    indexer = by_kind(docs, "Deployment")["rel-kvmesh-indexer"]
    (c,) = containers(indexer)
    env = env_of(c)
    assert env["KVMESH_INDEXER_REDIS__CLUSTER"] == "true"
    assert env["KVMESH_INDEXER_REDIS__URL"] == "redis://redis-cluster.cache:6379"
    assert "KVMESH_REDIS_PASSWORD" not in env
    # The HPA owns the replica count.
    assert "replicas" not in indexer["spec"]
    hpa = by_kind(docs, "HorizontalPodAutoscaler")["rel-kvmesh-indexer"]
    assert (hpa["spec"]["minReplicas"], hpa["spec"]["maxReplicas"]) == (2, 6)
    assert hpa["spec"]["scaleTargetRef"]["name"] == "rel-kvmesh-indexer"


def test_tee_off_renders_no_tee_or_simulator() -> None:
    docs = manifests(render(TEE_OFF))
    assert set(by_kind(docs, "Deployment")) == {"rel-kvmesh-indexer"}
    assert set(by_kind(docs, "Service")) == {
        "rel-kvmesh-indexer",
        "rel-kvmesh-redis",
        "rel-kvmesh-redis-headless",
    }


def test_memory_backend_single_replica_has_no_redis_and_no_pdb() -> None:
    docs = manifests(render(MEMORY_ONE))
    assert by_kind(docs, "StatefulSet") == {}
    assert by_kind(docs, "PodDisruptionBudget") == {}
    (c,) = containers(by_kind(docs, "Deployment")["rel-kvmesh-indexer"])
    env = env_of(c)
    assert env["KVMESH_INDEXER_BACKEND"] == "memory"
    assert not any(k.startswith("KVMESH_INDEXER_REDIS__") for k in env)


# -- the xfer sidecar snippet ----------------------------------------------------------


def test_sidecar_snippet_in_an_engine_chart(engine_chart: Path) -> None:
    docs = manifests(render(None, chart=engine_chart))
    validate_all(docs)
    deps = by_kind(docs, "Deployment")
    # The example turns every kvmesh service off: only the two engines render.
    assert set(deps) == {"rel-prefill", "rel-decode"}
    for role in ("prefill", "decode"):
        spec = deps[f"rel-{role}"]["spec"]["template"]["spec"]
        names = [c["name"] for c in spec["containers"]]
        assert names == ["engine", "kvmesh-xfer"]
        side = spec["containers"][1]
        assert side["args"] == ["xfer", "serve", "--role", role]
        env = env_of(side)
        assert env["KVMESH_XFER_HOST"] == "$(POD_IP)"
        assert env["POD_IP"] == {"fieldRef": {"fieldPath": "status.podIP"}}
        assert env["KVMESH_XFER_TRANSPORT"] == "tcp"
        assert env["KVMESH_XFER_POOL__PATH"] == "/dev/shm/kvmesh-pool-0"
        assert side["readinessProbe"]["grpc"]["port"] == 50061
        assert side["securityContext"]["readOnlyRootFilesystem"] is True
        shm = {v["name"]: v for v in spec["volumes"]}["kvmesh-shm"]
        assert shm["emptyDir"]["medium"] == "Memory"
        # Engine and sidecar share the pool through the same /dev/shm volume.
        for c in spec["containers"]:
            assert {"name": "kvmesh-shm", "mountPath": "/dev/shm"} in c["volumeMounts"]


def test_sidecar_snippet_rejects_a_bad_role(engine_chart: Path, tmp_path: Path) -> None:
    bad = tmp_path / "engine"
    shutil.copytree(engine_chart, bad)
    tpl = bad / "templates" / "engines.yaml"
    tpl.write_text(tpl.read_text().replace('"role" $role', '"role" "prefil"'))
    with pytest.raises(helm_python.HelmRenderError, match="role must be prefill or decode"):
        render(None, chart=bad)


# -- bad values are rejected -----------------------------------------------------------


@pytest.mark.parametrize(
    ("values", "message"),
    [
        ({"indexer": {"replicas": "two"}}, "/indexer/replicas"),
        ({"indexer": {"backend": "sqlite"}}, "/indexer/backend"),
        ({"image": {"tag": 1}}, "/image/tag"),
        ({"redis": {"external": {"url": 6379}}}, "/redis/external/url"),
        ({"tee": {"extraSinks": [{"type": "http"}]}}, "/tee/extraSinks/0"),
        ({"xfer": {"pool": {"pageSize": 0}}}, "/xfer/pool/pageSize"),
    ],
)
def test_wrong_types_are_rejected(values: dict[str, Any], message: str) -> None:
    with pytest.raises(helm_python.HelmValuesError, match=message):
        render(values)


@pytest.mark.parametrize(
    ("values", "key"),
    [
        ({"replicas": 3}, "replicas"),
        ({"indexer": {"replica": 3}}, "replica"),
        ({"redis": {"internal": {"persistance": {"enabled": True}}}}, "persistance"),
        ({"xfer": {"pool": {"pages": 1}}}, "pages"),
    ],
)
def test_unknown_keys_are_rejected(values: dict[str, Any], key: str) -> None:
    with pytest.raises(helm_python.HelmValuesError, match=f"additional properties '{key}'"):
        render(values)


@pytest.mark.parametrize(
    ("values", "message"),
    [
        (
            {"redis": {"internal": {"enabled": False}}},
            "indexer.backend is redis but no Redis is configured",
        ),
        (
            {"redis": {"external": {"url": "redis://r:6379/0"}}},
            "redis.internal.enabled and redis.external.url are both set",
        ),
        (
            {"indexer": {"backend": "memory"}, "redis": {"internal": {"enabled": False}}},
            "indexer.backend is memory .* but indexer.replicas is 2",
        ),
        ({"redis": {"cluster": True}}, "redis.cluster is true but the in-chart Redis"),
        (
            {"redis": {"internal": {"enabled": False}, "external": {"url": "redis://:pw@r/0"}}},
            "without a password",
        ),
        (
            {"redis": {"internal": {"enabled": False}, "external": {"url": "rediss://r:6380/0"}}},
            "starts with rediss:// .*tls.enabled=true",
        ),
        (
            {
                "redis": {
                    "internal": {"enabled": False},
                    "external": {"url": "redis://r:6379/0", "tls": {"enabled": True}},
                }
            },
            "does not start with rediss://",
        ),
        ({"cachesim": {"enabled": False}}, "the tee has no sink"),
        (
            {"indexer": {"autoscaling": {"enabled": True, "minReplicas": 5, "maxReplicas": 3}}},
            r"minReplicas \(5\) exceeds maxReplicas \(3\)",
        ),
        ({"xfer": {"pool": {"path": "/data/pool"}}}, "must lie under /dev/shm/"),
    ],
)
def test_cross_field_checks_fail_with_a_clear_message(values: dict[str, Any], message: str) -> None:
    with pytest.raises(helm_python.HelmRenderError, match=message):
        render(values)
