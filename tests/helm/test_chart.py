"""The Helm chart, rendered by Helm's own engine and validated against Kubernetes schemas.

Needs the ``helm`` extra (``helm-python-sdk``: Helm v4's Go engine as a library,
``kubernetes-validate``: the Kubernetes OpenAPI schemas, bundled), which
``make setup`` installs. Nothing here contacts a cluster or the network.
"""

from __future__ import annotations

import base64
import json
import shutil
import subprocess
import time
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

#: The user's own Redis: an ACL user name from a Secret, the password from a Secret (a
#: file in the pod), TLS with a private CA and a client certificate.
EXTERNAL_REDIS: dict[str, Any] = {
    "redis": {
        "internal": {"enabled": False},
        "external": {
            "url": "rediss://redis.example.internal:6380/0",
            "usernameSecret": {"name": "kvmesh-redis", "key": "username"},
            "passwordSecret": {"name": "kvmesh-redis", "key": "password"},
            "tls": {
                "enabled": True,
                "caSecret": {"name": "kvmesh-redis-ca", "key": "ca.crt"},
                "clientCertSecret": {"name": "kvmesh-redis-client"},
            },
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
#: A Redis Cluster with an ACL user, a password and TLS (no client certificate).
CLUSTER_REDIS_SECURE: dict[str, Any] = {
    "redis": {
        "cluster": True,
        "internal": {"enabled": False},
        "external": {
            "url": "rediss://redis-cluster.cache:6380",
            "username": "kvmesh-indexer",
            "passwordSecret": {"name": "redis-cluster-auth", "key": "pw"},
            "tls": {
                "enabled": True,
                "checkHostname": False,
                "caSecret": {"name": "redis-cluster-ca", "key": "ca.pem"},
            },
        },
    }
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
#: An inline policy (kvmesh/auth.py format).
POLICY: dict[str, Any] = {
    "identities": [
        {
            "name": "engines",
            "roles": ["engine"],
            "san": ["spiffe://fleet/engine/*"],
            "instances": ["engine-*"],
        },
        {"name": "routers", "roles": ["router"], "san": ["spiffe://fleet/router/*"]},
        {"name": "ops", "roles": ["admin"], "token_sha256": ["9f86d081884c7d65" * 4]},
    ]
}
#: One shared TLS Secret, mutual TLS, the policy inline.
TLS_MTLS_POLICY: dict[str, Any] = {
    "tls": {"secretName": "kvmesh-tls", "clientAuth": "require"},
    "auth": {"enabled": True, "policy": POLICY},
}
#: A Secret per component, the client CA in its own Secret, the policy in a Secret,
#: bearer tokens allowed (clientAuth optional).
TLS_EXISTING: dict[str, Any] = {
    "tls": {
        "secretNames": {"indexer": "ix-tls", "tee": "tee-tls", "cachesim": "sim-tls"},
        "caSecret": {"name": "fleet-ca", "key": "bundle.pem"},
        "clientAuth": "optional",
        "reloadIntervalSeconds": 30,
    },
    "auth": {"enabled": True, "existingSecret": {"name": "kvmesh-policy", "key": "policy.yaml"}},
}
INTERNAL_REDIS_GIVEN_SECRET: dict[str, Any] = {
    "redis": {"internal": {"auth": {"existingSecret": {"name": "my-redis-pw", "key": "pw"}}}}
}
NETPOL: dict[str, Any] = {
    "networkPolicy": {
        "enabled": True,
        "indexer": {
            "from": [{"podSelector": {"matchLabels": {"app": "router"}}}],
            "eventPorts": [5600],
            "eventsFrom": [{"podSelector": {"matchLabels": {"app": "engine"}}}],
        },
        "tee": {"from": [{"podSelector": {"matchLabels": {"app": "router"}}}]},
        "metrics": {
            "from": [{"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "mon"}}}]
        },
    },
    "tls": {"secretName": "kvmesh-tls"},
}
CERT_MANAGER: dict[str, Any] = {
    "tls": {
        "certManager": {
            "issuerRef": {"name": "fleet-ca", "kind": "ClusterIssuer"},
            "trustDomain": "fleet.example",
        }
    },
    "auth": {"enabled": True, "policy": POLICY},
    # A sink outside the release, over TLS with the tee's own certificate.
    "tee": {
        "extraSinks": [
            {
                "type": "grpc",
                "target": "tee.other:50061",
                "name": "other",
                "tls": {
                    "ca_file": "/etc/kvmesh/tls/ca.crt",
                    "cert_file": "/etc/kvmesh/tls/tls.crt",
                    "key_file": "/etc/kvmesh/tls/tls.key",
                    "server_name": "tee.other.svc",
                },
            }
        ]
    },
}

VALUE_SETS: dict[str, dict[str, Any]] = {
    "defaults": {},
    "external-redis": EXTERNAL_REDIS,
    "redis-cluster": CLUSTER_REDIS,
    "redis-cluster-secure": CLUSTER_REDIS_SECURE,
    "tee-off": TEE_OFF,
    "memory-one-replica": MEMORY_ONE,
    "persistent-redis": PERSISTENT,
    "tls-mtls-policy": TLS_MTLS_POLICY,
    "tls-existing-secrets": TLS_EXISTING,
    "internal-redis-given-secret": INTERNAL_REDIS_GIVEN_SECRET,
    "network-policy": NETPOL,
    "cert-manager": CERT_MANAGER,
}
#: The value sets whose in-chart servers serve TLS.
TLS_SETS = ["tls-mtls-policy", "tls-existing-secrets", "network-policy", "cert-manager"]
#: Kinds the Kubernetes schemas do not know (CRDs): checked by structure instead.
CRD_API_GROUPS = ("cert-manager.io/",)


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
            if doc["apiVersion"].startswith(CRD_API_GROUPS):
                continue
            kubernetes_validate.validate(doc, version, strict=True)


def pod_spec(doc: dict[str, Any]) -> dict[str, Any]:
    spec: dict[str, Any] = doc["spec"] if doc["kind"] == "Pod" else doc["spec"]["template"]["spec"]
    return spec


def workloads(docs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [d for d in docs if d["kind"] in ("Deployment", "StatefulSet", "Pod")]


def mounted_file(doc: dict[str, Any], container: dict[str, Any], path: str) -> dict[str, Any]:
    """The volume ``path`` lies in: the container must mount it as a directory (no subPath)."""
    for m in container.get("volumeMounts", []):
        if path.startswith(m["mountPath"].rstrip("/") + "/"):
            assert "subPath" not in m, m
            vols = {v["name"]: v for v in pod_spec(doc)["volumes"]}
            volume: dict[str, Any] = vols[m["name"]]
            return volume
    raise AssertionError(f"{path} is on no volume of {container['name']}")


def env_for_loader(container: dict[str, Any]) -> dict[str, str]:
    """The container's literal env, with Secret references and $(POD_IP) given stand-ins."""
    env: dict[str, str] = {}
    for e in container.get("env", []):
        env[e["name"]] = e.get("value", "from-secret")
    return {k: v.replace("$(POD_IP)", "10.0.0.7") for k, v in env.items()}


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
    # No certificate given: plaintext, probed on the gRPC port, no health-only port.
    assert not any("TLS__" in k or "AUTH__" in k for k in env)
    assert "KVMESH_INDEXER_HEALTH_PORT" not in env
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


def test_external_redis_acl_user_password_file_and_client_certificate() -> None:
    docs = manifests(render(EXTERNAL_REDIS))
    assert by_kind(docs, "StatefulSet") == {}
    assert by_kind(docs, "Secret") == {}  # the chart creates no Secret for an external Redis
    indexer = by_kind(docs, "Deployment")["rel-kvmesh-indexer"]
    (c,) = containers(indexer)
    env = env_of(c)
    # The URL carries no credentials; the password is a file, never an env var.
    assert env["KVMESH_INDEXER_REDIS__URL"] == "rediss://redis.example.internal:6380/0"
    assert "KVMESH_REDIS_PASSWORD" not in env
    assert env["KVMESH_INDEXER_REDIS__USERNAME"] == {
        "secretKeyRef": {"name": "kvmesh-redis", "key": "username"}
    }
    refs = [e["valueFrom"]["secretKeyRef"] for e in c["env"] if "valueFrom" in e]
    assert {"name": "kvmesh-redis", "key": "password"} not in refs
    files = {
        "KVMESH_INDEXER_REDIS__PASSWORD_FILE": ("kvmesh-redis", "password", "password"),
        "KVMESH_INDEXER_REDIS__TLS_CA_FILE": ("kvmesh-redis-ca", "ca.crt", "ca.crt"),
        "KVMESH_INDEXER_REDIS__TLS_CERT_FILE": ("kvmesh-redis-client", "tls.crt", "tls.crt"),
        "KVMESH_INDEXER_REDIS__TLS_KEY_FILE": ("kvmesh-redis-client", "tls.key", "tls.key"),
    }
    for name, (secret, key, file) in files.items():
        path = env[name]
        assert path.startswith("/etc/kvmesh/redis-") and path.endswith("/" + file), path
        vol = mounted_file(indexer, c, path)
        assert vol["secret"]["secretName"] == secret
        assert {"key": key, "path": file} in vol["secret"]["items"]
    assert env["KVMESH_INDEXER_REDIS__TLS_CHECK_HOSTNAME"] == "true"
    from indexer.config import load_config

    redis = load_config(environ=env_for_loader(c)).redis
    assert (redis.username, redis.password_file) == (
        "from-secret",
        "/etc/kvmesh/redis-auth/password",
    )
    assert redis.tls_cert_file == "/etc/kvmesh/redis-client-tls/tls.crt"


def test_redis_cluster_with_acl_user_password_and_tls() -> None:
    docs = manifests(render(CLUSTER_REDIS_SECURE))
    indexer = by_kind(docs, "Deployment")["rel-kvmesh-indexer"]
    (c,) = containers(indexer)
    env = env_of(c)
    assert env["KVMESH_INDEXER_REDIS__CLUSTER"] == "true"
    assert env["KVMESH_INDEXER_REDIS__URL"] == "rediss://redis-cluster.cache:6380"
    assert env["KVMESH_INDEXER_REDIS__USERNAME"] == "kvmesh-indexer"
    assert env["KVMESH_INDEXER_REDIS__TLS_CHECK_HOSTNAME"] == "false"
    assert "KVMESH_INDEXER_REDIS__TLS_CERT_FILE" not in env
    pw = mounted_file(indexer, c, env["KVMESH_INDEXER_REDIS__PASSWORD_FILE"])
    assert pw["secret"]["secretName"] == "redis-cluster-auth"
    assert pw["secret"]["items"] == [{"key": "pw", "path": "password"}]
    ca = mounted_file(indexer, c, env["KVMESH_INDEXER_REDIS__TLS_CA_FILE"])
    assert ca["secret"]["items"] == [{"key": "ca.pem", "path": "ca.crt"}]
    from indexer.config import load_config

    cfg = load_config(environ=env_for_loader(c))
    assert cfg.redis.cluster and cfg.redis.tls_check_hostname is False


def test_redis_cluster_backend_sets_the_cluster_flag_and_hpa() -> None:
    docs = manifests(render(CLUSTER_REDIS))
    indexer = by_kind(docs, "Deployment")["rel-kvmesh-indexer"]
    (c,) = containers(indexer)
    env = env_of(c)
    assert env["KVMESH_INDEXER_REDIS__CLUSTER"] == "true"
    assert env["KVMESH_INDEXER_REDIS__URL"] == "redis://redis-cluster.cache:6379"
    assert not any(
        k.startswith(("KVMESH_INDEXER_REDIS__PASSWORD", "KVMESH_INDEXER_REDIS__TLS")) for k in env
    )
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
        "rel-kvmesh-indexer-headless",
        "rel-kvmesh-redis",
        "rel-kvmesh-redis-headless",
    }
    assert set(by_kind(docs, "NetworkPolicy")) == {"rel-kvmesh-redis"}


def test_memory_backend_single_replica_has_no_redis_and_no_pdb() -> None:
    docs = manifests(render(MEMORY_ONE))
    assert by_kind(docs, "StatefulSet") == {}
    assert by_kind(docs, "PodDisruptionBudget") == {}
    (c,) = containers(by_kind(docs, "Deployment")["rel-kvmesh-indexer"])
    env = env_of(c)
    assert env["KVMESH_INDEXER_BACKEND"] == "memory"
    assert not any(k.startswith("KVMESH_INDEXER_REDIS__") for k in env)


def test_indexer_replicas_are_reachable_one_by_one_and_age_their_connections() -> None:
    """A headless Service lists every ready replica (routers balance over them, see
    tests/integration/test_replica_spread.py); connections age out so that clients
    resolve it again; the ClusterIP Service stays for engines and probes."""
    from indexer.config import load_config

    rendered = render()
    docs = manifests(rendered)
    services = by_kind(docs, "Service")
    headless = services["rel-kvmesh-indexer-headless"]["spec"]
    assert headless["clusterIP"] == "None" and headless["publishNotReadyAddresses"] is False
    assert headless["selector"] == services["rel-kvmesh-indexer"]["spec"]["selector"]
    assert [(p["name"], p["port"], p["targetPort"]) for p in headless["ports"]] == [
        ("grpc", 50051, "grpc")
    ]
    notes = rendered["kvmesh/templates/NOTES.txt"]
    assert "routers dns:///rel-kvmesh-indexer-headless.ns.svc:50051" in notes
    (c,) = containers(by_kind(docs, "Deployment")["rel-kvmesh-indexer"])
    limits = load_config(environ=env_for_loader(c)).limits
    assert (limits.max_connection_age_s, limits.max_connection_age_grace_s) == (300, 30)

    values = {"indexer": {"maxConnectionAgeSeconds": 0, "service": {"headless": False}}}
    rendered = render(values)
    docs = manifests(rendered)
    assert "rel-kvmesh-indexer-headless" not in by_kind(docs, "Service")
    assert "dns:///" not in rendered["kvmesh/templates/NOTES.txt"]
    (c,) = containers(by_kind(docs, "Deployment")["rel-kvmesh-indexer"])
    assert load_config(environ=env_for_loader(c)).limits.max_connection_age_s == 0

    # With cert-manager the indexer's certificate names the headless Service too.
    certs = by_kind(manifests(render(CERT_MANAGER)), "Certificate")
    names = certs["rel-kvmesh-indexer"]["spec"]["dnsNames"]
    assert "rel-kvmesh-indexer-headless.ns.svc" in names
    assert not any("headless" in n for n in certs["rel-kvmesh-tee"]["spec"]["dnsNames"])


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


def test_sidecar_advertises_its_pod_ip_from_the_downward_api(engine_chart: Path) -> None:
    """Peers call the sidecar back at KVMESH_XFER_ADVERTISE_ADDRESS: the pod IP from
    status.podIP (defined earlier in env, so $(POD_IP) expands) and the sidecar's port."""
    values = {"kvmesh": {"xfer": {"grpcPort": 50071, "metricsPort": 9475}}}
    docs = manifests(render(values, chart=engine_chart))
    validate_all(docs)
    from xfer.config import load_config as load_xfer_config

    for role in ("prefill", "decode"):
        side = pod_spec(by_kind(docs, "Deployment")[f"rel-{role}"])["containers"][1]
        names = [e["name"] for e in side["env"]]
        env = env_of(side)
        assert env["POD_IP"] == {"fieldRef": {"fieldPath": "status.podIP"}}
        assert env["KVMESH_XFER_ADVERTISE_ADDRESS"] == "$(POD_IP):50071"
        assert names.index("POD_IP") < names.index("KVMESH_XFER_ADVERTISE_ADDRESS")
        cfg = load_xfer_config(environ=env_for_loader(side), cli={"role": role})
        assert cfg.advertise_address == "10.0.0.7:50071" and cfg.port == 50071


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


# -- TLS, mutual TLS and the policy --------------------------------------------------

#: Component -> (Deployment, env prefix, Service ports, health port default).
COMPONENTS = {
    "indexer": ("rel-kvmesh-indexer", "KVMESH_INDEXER_", 50052),
    "tee": ("rel-kvmesh-tee", "KVMESH_TEE_", 50063),
    "cachesim": ("rel-kvmesh-cachesim", "KVMESH_CACHESIM_", 50064),
}


def loaded_config(component: str, container: dict[str, Any]) -> Any:
    """The service's own config loader run on the rendered env: every name must be a key."""
    env = env_for_loader(container)
    if component == "indexer":
        from indexer.config import load_config

        return load_config(environ=env)
    from tee.cachesim.config import load_cachesim_config
    from tee.config import load_tee_config

    return (load_tee_config if component == "tee" else load_cachesim_config)(environ=env)


@pytest.mark.parametrize("name", TLS_SETS)
def test_tls_env_points_at_files_of_mounted_secret_volumes(name: str) -> None:
    values = VALUE_SETS[name]
    docs = manifests(render(values))
    deps = by_kind(docs, "Deployment")
    for component, (dep, prefix, _) in COMPONENTS.items():
        (c,) = containers(deps[dep])
        env = env_of(c)
        cert = env[f"{prefix}TLS__CERT_FILE"]
        assert cert == "/etc/kvmesh/tls/tls.crt"
        assert env[f"{prefix}TLS__KEY_FILE"] == "/etc/kvmesh/tls/tls.key"
        tls_volume = mounted_file(deps[dep], c, cert)
        assert mounted_file(deps[dep], c, env[f"{prefix}TLS__KEY_FILE"]) == tls_volume
        # A whole Secret as a directory: Kubernetes swaps in a rotated Secret.
        assert "items" not in tls_volume["secret"]
        expected_secret = {
            "tls-mtls-policy": "kvmesh-tls",
            "network-policy": "kvmesh-tls",
            "tls-existing-secrets": {"indexer": "ix-tls", "tee": "tee-tls", "cachesim": "sim-tls"}[
                component
            ],
            "cert-manager": f"{dep}-tls",
        }[name]
        assert tls_volume["secret"]["secretName"] == expected_secret
        ca = env[f"{prefix}TLS__CLIENT_CA_FILE"]
        ca_volume = mounted_file(deps[dep], c, ca)
        if name == "tls-existing-secrets":
            assert ca == "/etc/kvmesh/tls-ca/ca.crt"
            assert ca_volume["secret"] == {
                "secretName": "fleet-ca",
                "defaultMode": 0o440,
                "items": [{"key": "bundle.pem", "path": "ca.crt"}],
            }
            assert env[f"{prefix}TLS__CLIENT_AUTH"] == "optional"
            assert env[f"{prefix}TLS__RELOAD_INTERVAL_S"] == "30"
        else:
            assert ca == "/etc/kvmesh/tls/ca.crt" and ca_volume == tls_volume
            assert env[f"{prefix}TLS__CLIENT_AUTH"] == "require"
        if values.get("auth", {}).get("enabled"):
            policy = env[f"{prefix}AUTH__POLICY_FILE"]
            assert policy == "/etc/kvmesh/policy/policy.yaml"
            pv = mounted_file(deps[dep], c, policy)
            if name == "tls-existing-secrets":
                assert pv["secret"]["secretName"] == "kvmesh-policy"
                assert pv["secret"]["items"] == [{"key": "policy.yaml", "path": "policy.yaml"}]
            else:
                assert pv["configMap"] == {"name": "rel-kvmesh-policy"}
        else:
            assert f"{prefix}AUTH__POLICY_FILE" not in env
        # The service's own loader accepts what the chart renders.
        cfg = loaded_config(component, c)
        assert cfg.tls.cert_file == cert and cfg.tls.mutual
        if component == "tee" and name == "cert-manager":
            assert cfg.sinks[1].tls.server_name == "tee.other.svc"
        assert cfg.auth.policy_file == env.get(f"{prefix}AUTH__POLICY_FILE", "")


def test_no_volume_is_mounted_with_subpath_in_any_value_set() -> None:
    """subPath mounts never see a rotated Secret or ConfigMap."""
    for name, values in VALUE_SETS.items():
        for doc in workloads(manifests(render(values))):
            for c in pod_spec(doc)["containers"]:
                for m in c.get("volumeMounts", []):
                    assert "subPath" not in m and "subPathExpr" not in m, (name, c["name"], m)


@pytest.mark.parametrize("name", TLS_SETS)
def test_probes_use_the_plaintext_health_port_when_tls_is_on(name: str) -> None:
    docs = manifests(render(VALUE_SETS[name]))
    deps = by_kind(docs, "Deployment")
    services = by_kind(docs, "Service")
    for component, (dep, prefix, health) in COMPONENTS.items():
        (c,) = containers(deps[dep])
        env = env_of(c)
        assert env[f"{prefix}HEALTH_PORT"] == str(health)
        assert {"name": "health", "containerPort": health, "protocol": "TCP"} in c["ports"]
        assert c["readinessProbe"]["grpc"]["port"] == health
        if component == "indexer":
            # Liveness stays the listening socket (a Redis outage restarts nothing).
            assert c["livenessProbe"]["tcpSocket"]["port"] == "grpc"
        else:
            assert c["livenessProbe"]["grpc"]["port"] == health
        svc_ports = {p["port"] for p in services[dep]["spec"]["ports"]}
        assert health not in svc_ports
        assert "health" not in {p["targetPort"] for p in services[dep]["spec"]["ports"]}
        assert loaded_config(component, c).health_port == health


def test_tls_is_off_without_a_secret_and_notes_warn() -> None:
    notes = render()["kvmesh/templates/NOTES.txt"]
    assert "WARNING: indexer, tee, cachesim serve PLAINTEXT" in notes
    secure = render(TLS_MTLS_POLICY)["kvmesh/templates/NOTES.txt"]
    assert "PLAINTEXT" not in secure and "authorization is off" not in secure
    assert "(kvmesh.indexer.v1.IndexerService; routers and engines; mutual TLS)" in secure
    assert "https://rel-kvmesh-cachesim.ns.svc:8470" in secure
    tls_no_auth = render({"tls": {"secretName": "kvmesh-tls"}})["kvmesh/templates/NOTES.txt"]
    assert "WARNING: authorization is off" in tls_no_auth
    for text in (notes, secure):
        assert "vLLM's ZMQ publisher has no CURVE" in text
        assert "only the indexer pods" in text


def test_tls_enabled_false_serves_plaintext_even_with_a_secret() -> None:
    docs = manifests(render({"tls": {"enabled": False, "secretName": "kvmesh-tls"}}))
    for doc in workloads(docs):
        for c in pod_spec(doc)["containers"]:
            assert not any("TLS__" in k for k in env_of(c)), c["name"]
        volumes = pod_spec(doc).get("volumes", [])
        assert "kvmesh-tls" not in [v.get("secret", {}).get("secretName") for v in volumes]


def test_mutual_false_serves_tls_without_client_certificates() -> None:
    docs = manifests(render({"tls": {"secretName": "kvmesh-tls", "mutual": False}}))
    (c,) = containers(by_kind(docs, "Deployment")["rel-kvmesh-indexer"])
    env = env_of(c)
    assert env["KVMESH_INDEXER_TLS__CERT_FILE"] == "/etc/kvmesh/tls/tls.crt"
    assert "KVMESH_INDEXER_TLS__CLIENT_CA_FILE" not in env
    assert "KVMESH_INDEXER_TLS__CLIENT_AUTH" not in env


def test_inline_policy_is_a_valid_policy_file_with_the_tee_identity() -> None:
    from kvmesh.auth import PolicyFile

    for values, tee_san in [
        (TLS_MTLS_POLICY, "rel-kvmesh-tee.ns.svc"),
        (CERT_MANAGER, "spiffe://fleet.example/ns/ns/kvmesh/tee"),
    ]:
        cm = by_kind(manifests(render(values)), "ConfigMap")["rel-kvmesh-policy"]
        policy = PolicyFile.model_validate(yaml.safe_load(cm["data"]["policy.yaml"]))
        by_name = {i.name: i for i in policy.identities}
        assert by_name["engines"].instances == ["engine-*"]
        assert by_name["ops"].token_sha256 == ["9f86d081884c7d65" * 4]
        assert by_name["rel-kvmesh-tee"].roles == ["tee"]
        assert by_name["rel-kvmesh-tee"].san == [tee_san]
    off = {"auth": {"enabled": True, "policy": POLICY, "chartIdentities": False}}
    cm = by_kind(manifests(render({**TLS_MTLS_POLICY, **off})), "ConfigMap")["rel-kvmesh-policy"]
    names = [i["name"] for i in yaml.safe_load(cm["data"]["policy.yaml"])["identities"]]
    assert names == ["engines", "routers", "ops"]


def test_existing_policy_secret_renders_no_configmap() -> None:
    docs = manifests(render(TLS_EXISTING))
    assert by_kind(docs, "ConfigMap") == {}
    cm_values = {
        **TLS_EXISTING,
        "auth": {"enabled": True, "existingConfigMap": {"name": "pol", "key": "p.json"}},
    }
    dep = by_kind(manifests(render(cm_values)), "Deployment")["rel-kvmesh-tee"]
    (c,) = containers(dep)
    path = env_of(c)["KVMESH_TEE_AUTH__POLICY_FILE"]
    assert path == "/etc/kvmesh/policy/p.json"
    assert mounted_file(dep, c, path)["configMap"] == {
        "name": "pol",
        "items": [{"key": "p.json", "path": "p.json"}],
    }


@pytest.mark.parametrize("name", ["tls-mtls-policy", "tls-existing-secrets"])
def test_tee_dials_the_cache_simulator_with_tls_and_its_own_certificate(name: str) -> None:
    dep = by_kind(manifests(render(VALUE_SETS[name])), "Deployment")["rel-kvmesh-tee"]
    (c,) = containers(dep)
    (sink,) = json.loads(env_of(c)["KVMESH_TEE_SINKS"])
    ca = "/etc/kvmesh/tls-ca/ca.crt" if name == "tls-existing-secrets" else "/etc/kvmesh/tls/ca.crt"
    assert sink == {
        "type": "grpc",
        "target": "rel-kvmesh-cachesim.ns.svc:50062",
        "name": "cachesim",
        "tls": {
            "enabled": True,
            "ca_file": ca,
            "cert_file": "/etc/kvmesh/tls/tls.crt",
            "key_file": "/etc/kvmesh/tls/tls.key",
        },
    }
    for path in sink["tls"].values():
        if isinstance(path, str):
            assert "secret" in mounted_file(dep, c, path)
    cfg = loaded_config("tee", c)
    assert cfg.sinks[0].tls.active and cfg.sinks[0].tls.cert_file == "/etc/kvmesh/tls/tls.crt"


def test_helm_test_pod_checks_tls_services_over_tls() -> None:
    rendered = render(TLS_EXISTING)
    (pod,) = manifests({"t.yaml": rendered["kvmesh/templates/tests/test-health.yaml"]})
    (c,) = containers(pod)
    assert c["command"][3:] == [
        "rel-kvmesh-indexer.ns.svc:50051|/etc/kvmesh/tls/indexer|/etc/kvmesh/tls-ca/ca.crt",
        "rel-kvmesh-tee.ns.svc:50061|/etc/kvmesh/tls/tee|/etc/kvmesh/tls-ca/ca.crt",
        "rel-kvmesh-cachesim.ns.svc:50062|/etc/kvmesh/tls/cachesim|/etc/kvmesh/tls-ca/ca.crt",
    ]
    compile(c["command"][2], "<test-health>", "exec")
    assert "ssl_channel_credentials" in c["command"][2]
    for arg in c["command"][3:]:
        _, tls_dir, ca = arg.split("|")
        assert mounted_file(pod, c, f"{tls_dir}/tls.crt")["secret"]["secretName"].endswith("-tls")
        assert mounted_file(pod, c, ca)["secret"]["secretName"] == "fleet-ca"


# -- Redis credentials -----------------------------------------------------------------


def _all_text(rendered: dict[str, str]) -> str:
    return "\n".join(rendered.values())


def test_internal_redis_password_appears_only_in_its_secret() -> None:
    rendered = render()
    docs = manifests(rendered)
    secret = by_kind(docs, "Secret")["rel-kvmesh-redis-auth"]
    encoded = secret["data"]["password"]
    password = base64.b64decode(encoded).decode()
    assert len(password) == 40
    text = _all_text(rendered)
    # The password itself is nowhere, its base64 only in the Secret's data.
    assert password not in text
    assert text.count(encoded) == 1
    without_secret = [d for d in docs if d["kind"] != "Secret"]
    assert encoded not in json.dumps(without_secret)

    sts = by_kind(docs, "StatefulSet")["rel-kvmesh-redis"]
    (redis,) = containers(sts)
    assert mounted_file(sts, redis, "/etc/kvmesh/redis-auth/password")["secret"] == {
        "secretName": "rel-kvmesh-redis-auth",
        "defaultMode": 0o440,
        "items": [{"key": "password", "path": "password"}],
    }
    renv = env_of(redis)
    assert renv["REDIS_USERNAME"] == "kvmesh" and renv["REDIS_KEY_PREFIX"] == "kvm"
    indexer = by_kind(docs, "Deployment")["rel-kvmesh-indexer"]
    (c,) = containers(indexer)
    env = env_of(c)
    assert env["KVMESH_INDEXER_REDIS__USERNAME"] == "kvmesh"
    vol = mounted_file(indexer, c, env["KVMESH_INDEXER_REDIS__PASSWORD_FILE"])
    assert vol["secret"]["secretName"] == "rel-kvmesh-redis-auth"


def test_internal_redis_with_a_given_secret_renders_none() -> None:
    docs = manifests(render(INTERNAL_REDIS_GIVEN_SECRET))
    assert by_kind(docs, "Secret") == {}
    sts = by_kind(docs, "StatefulSet")["rel-kvmesh-redis"]
    (redis,) = containers(sts)
    assert mounted_file(sts, redis, "/etc/kvmesh/redis-auth/password")["secret"]["items"] == [
        {"key": "pw", "path": "password"}
    ]
    indexer = by_kind(docs, "Deployment")["rel-kvmesh-indexer"]
    (c,) = containers(indexer)
    vol = mounted_file(indexer, c, env_of(c)["KVMESH_INDEXER_REDIS__PASSWORD_FILE"])
    assert vol["secret"]["secretName"] == "my-redis-pw"


def test_internal_redis_without_auth_warns() -> None:
    values = {"redis": {"internal": {"auth": {"enabled": False}}}}
    rendered = render(values)
    (redis,) = containers(by_kind(manifests(rendered), "StatefulSet")["rel-kvmesh-redis"])
    assert redis["command"] == ["redis-server"]
    assert "has no password" in rendered["kvmesh/templates/NOTES.txt"]


def test_in_chart_redis_start_script_admits_only_the_indexer_user(tmp_path: Path) -> None:
    """The rendered start script, run against a real redis-server: the default user is
    off, the ACL user gets in with the Secret's password (a trailing newline ignored, as
    the indexer does), and the ACL rules let the Redis index do its work."""
    import asyncio

    import redis as redis_py

    from indexer.redis.backend import RedisIndex
    from lab.redisproc import find_redis_server, free_port

    binary = find_redis_server()
    assert binary, "redis-server is needed (make setup installs it)"
    (c,) = containers(by_kind(manifests(render()), "StatefulSet")["rel-kvmesh-redis"])
    assert c["command"][:2] == ["sh", "-c"]
    script = c["command"][2].replace("/etc/kvmesh/redis-auth", str(tmp_path))
    script = script.replace("/tmp/users.acl", str(tmp_path / "users.acl"))
    (tmp_path / "password").write_text("fake-Pa55word-for-the-test\n")
    port = free_port()
    args = list(c["args"])
    args[args.index("--port") + 1] = str(port)
    args[args.index("--dir") + 1] = str(tmp_path)
    env = {e["name"]: e["value"] for e in c["env"]}
    proc = subprocess.Popen(
        ["sh", "-c", script, binary, *args, "--bind", "127.0.0.1"],
        env={"PATH": f"{Path(binary).parent}:/usr/bin:/bin", **env},
        stdout=subprocess.DEVNULL,
    )
    try:
        acl = (tmp_path / "users.acl").read_text() if _wait_for(port) else ""
        assert "fake-Pa55word" not in acl and "#" in acl  # the hash only
        anon = redis_py.Redis(port=port, socket_timeout=5)
        with pytest.raises(redis_py.AuthenticationError):
            anon.ping()
        user = redis_py.Redis(
            port=port, username="kvmesh", password="fake-Pa55word-for-the-test", socket_timeout=5
        )
        assert user.ping() is True
        with pytest.raises(redis_py.exceptions.NoPermissionError):
            user.set("not-the-prefix", "1")
        with pytest.raises(redis_py.exceptions.NoPermissionError):
            user.flushall()

        async def use_index() -> int:
            from indexer.model import InstanceId, InstanceSpec

            idx = RedisIndex(
                f"redis://127.0.0.1:{port}/0",
                prefix="kvm",
                username="kvmesh",
                password_file=str(tmp_path / "password"),
            )
            try:
                await idx.ping()
                await idx.register(InstanceSpec(InstanceId("w", 0), "m", "http://w", 30.0, "x"))
                return (await idx.stats()).instances
            finally:
                await idx.close()

        assert asyncio.run(use_index()) == 1
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def _wait_for(port: int) -> bool:
    """Whether something accepts connections on 127.0.0.1:``port`` within 10 s."""
    import socket

    for _ in range(200):
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            return True
        except OSError:
            time.sleep(0.05)
    return False


# -- NetworkPolicies -------------------------------------------------------------------


def _ingress(doc: dict[str, Any]) -> dict[int, list[dict[str, Any]] | None]:
    """port -> allowed sources (None: any source)."""
    out: dict[int, list[dict[str, Any]] | None] = {}
    for rule in doc["spec"]["ingress"]:
        for p in rule["ports"]:
            out[p["port"]] = rule.get("from")
    return out


def test_network_policies_open_only_the_served_ports() -> None:
    docs = manifests(render(NETPOL))
    pols = by_kind(docs, "NetworkPolicy")
    assert set(pols) == {
        "rel-kvmesh-indexer",
        "rel-kvmesh-tee",
        "rel-kvmesh-cachesim",
        "rel-kvmesh-redis",
    }
    for pol in pols.values():
        assert pol["spec"]["policyTypes"] == ["Ingress"]
    router = {"podSelector": {"matchLabels": {"app": "router"}}}
    test_pod = {
        "podSelector": {
            "matchLabels": {
                "app.kubernetes.io/name": "kvmesh",
                "app.kubernetes.io/instance": "rel",
                "app.kubernetes.io/component": "test",
            }
        }
    }
    mon = NETPOL["networkPolicy"]["metrics"]["from"]
    ix = _ingress(pols["rel-kvmesh-indexer"])
    # The health-only port is absent: kubelet's probes come from the node.
    assert ix == {
        50051: [router, test_pod],
        9464: mon,
        5600: [{"podSelector": {"matchLabels": {"app": "engine"}}}],
    }
    assert pols["rel-kvmesh-indexer"]["spec"]["podSelector"]["matchLabels"] == {
        "app.kubernetes.io/name": "kvmesh",
        "app.kubernetes.io/instance": "rel",
        "app.kubernetes.io/component": "indexer",
    }
    assert _ingress(pols["rel-kvmesh-tee"]) == {50061: [router, test_pod], 9465: mon}
    tee_pod = {
        "podSelector": {
            "matchLabels": {
                "app.kubernetes.io/name": "kvmesh",
                "app.kubernetes.io/instance": "rel",
                "app.kubernetes.io/component": "tee",
            }
        }
    }
    assert _ingress(pols["rel-kvmesh-cachesim"]) == {8470: None, 50062: [tee_pod, test_pod]}
    indexer_pod = {
        "podSelector": {
            "matchLabels": {
                "app.kubernetes.io/name": "kvmesh",
                "app.kubernetes.io/instance": "rel",
                "app.kubernetes.io/component": "indexer",
            }
        }
    }
    assert _ingress(pols["rel-kvmesh-redis"]) == {6379: [indexer_pod]}
    assert "networkPolicy.indexer.eventPorts" in render(NETPOL)["kvmesh/templates/NOTES.txt"]


def test_network_policies_are_off_by_default_except_redis() -> None:
    assert set(by_kind(manifests(render()), "NetworkPolicy")) == {"rel-kvmesh-redis"}
    off = {"redis": {"internal": {"networkPolicy": {"enabled": False}}}}
    assert by_kind(manifests(render(off)), "NetworkPolicy") == {}


# -- cert-manager ----------------------------------------------------------------------


def test_cert_manager_certificates_write_the_secrets_the_pods_mount() -> None:
    docs = manifests(render(CERT_MANAGER))
    certs = {d["metadata"]["name"]: d for d in docs if d["kind"] == "Certificate"}
    assert set(certs) == {"rel-kvmesh-indexer", "rel-kvmesh-tee", "rel-kvmesh-cachesim"}
    deps = by_kind(docs, "Deployment")
    for component, (dep, _, _) in COMPONENTS.items():
        cert = certs[dep]
        assert cert["apiVersion"] == "cert-manager.io/v1"
        spec = cert["spec"]
        assert spec["secretName"] == f"{dep}-tls"
        assert spec["issuerRef"] == {
            "name": "fleet-ca",
            "kind": "ClusterIssuer",
            "group": "cert-manager.io",
        }
        # The indexer's also names its headless Service (routers dial every replica).
        services = [dep, f"{dep}-headless"] if component == "indexer" else [dep]
        assert spec["dnsNames"] == [
            name
            for svc in services
            for name in (svc, f"{svc}.ns", f"{svc}.ns.svc", f"{svc}.ns.svc.cluster.local")
        ]
        assert spec["uris"] == [f"spiffe://fleet.example/ns/ns/kvmesh/{component}"]
        assert {"server auth", "client auth"} <= set(spec["usages"])
        assert spec["privateKey"] == {"algorithm": "ECDSA", "size": 256, "rotationPolicy": "Always"}
        assert spec["duration"] == "2160h" and spec["renewBefore"] == "360h"
        (c,) = containers(deps[dep])
        vol = mounted_file(deps[dep], c, env_of(c)[f"{COMPONENTS[component][1]}TLS__CERT_FILE"])
        assert vol["secret"]["secretName"] == spec["secretName"]
    # The helm test pod dials each Service by the name its certificate carries.
    (pod,) = [d for d in docs if d["kind"] == "Pod"]
    (c,) = containers(pod)
    for arg in c["command"][3:]:
        host = arg.split(":")[0]
        assert any(host in cert["spec"]["dnsNames"] for cert in certs.values())


def test_no_certificates_without_an_issuer() -> None:
    assert not [d for d in manifests(render(TLS_MTLS_POLICY)) if d["kind"] == "Certificate"]


# -- schema and cross-field checks of the security values -------------------------------


@pytest.mark.parametrize(
    ("values", "message"),
    [
        ({"tls": {"clientAuth": "maybe"}}, "/tls/clientAuth"),
        ({"tls": {"secretName": "Not_A_Name"}}, "/tls/secretName"),
        ({"tls": {"reloadIntervalSeconds": 0}}, "/tls/reloadIntervalSeconds"),
        ({"tls": {"certManager": {"privateKeyAlgorithm": "DSA"}}}, "privateKeyAlgorithm"),
        ({"tls": {"certManager": {"duration": "90 days"}}}, "/tls/certManager/duration"),
        (
            {"auth": {"policy": {"identities": [{"name": "x", "roles": ["superuser"]}]}}},
            "/auth/policy/identities/0/roles/0",
        ),
        (
            {
                "auth": {
                    "policy": {
                        "identities": [
                            {"name": "x", "roles": ["admin"], "token_sha256": ["s3cret"]}
                        ]
                    }
                }
            },
            "/auth/policy/identities/0/token_sha256/0",
        ),
        ({"auth": {"existingConfigMap": {"name": "p", "key": "policy.txt"}}}, "existingConfigMap"),
        ({"redis": {"internal": {"auth": {"username": "two words"}}}}, "username"),
        ({"networkPolicy": {"indexer": {"from": [{}]}}}, "/networkPolicy/indexer/from/0"),
        ({"indexer": {"healthPort": 0}}, "/indexer/healthPort"),
    ],
)
def test_wrong_security_values_fail_the_schema(values: dict[str, Any], message: str) -> None:
    with pytest.raises(helm_python.HelmValuesError, match=message):
        render(values)


@pytest.mark.parametrize(
    ("values", "key"),
    [
        ({"tls": {"secretNames": {"indexr": "x"}}}, "indexr"),
        ({"tls": {"certManager": {"issuer": {"name": "x"}}}}, "issuer"),
        ({"auth": {"policyFile": "x"}}, "policyFile"),
        (
            {"auth": {"policy": {"identities": [{"name": "x", "roles": ["admin"], "sans": []}]}}},
            "sans",
        ),
        ({"redis": {"internal": {"auth": {"usernam": "x"}}}}, "usernam"),
        ({"redis": {"external": {"tls": {"clientCert": {"name": "x"}}}}}, "clientCert"),
        ({"networkPolicy": {"indexer": {"form": []}}}, "form"),
        ({"xfer": {"peers": {"sharedSecrets": {}}}}, "sharedSecrets"),
    ],
)
def test_unknown_security_keys_are_rejected(values: dict[str, Any], key: str) -> None:
    with pytest.raises(helm_python.HelmValuesError, match=f"additional properties '{key}'"):
        render(values)


@pytest.mark.parametrize(
    ("values", "message"),
    [
        ({"auth": {"enabled": True}}, "auth.enabled is true but there is no policy"),
        ({"auth": {"enabled": True, "policy": POLICY}}, "auth.enabled needs TLS .* indexer"),
        ({"auth": {"policy": POLICY}}, "but auth.enabled is false"),
        (
            {
                "tls": {"secretName": "t"},
                "auth": {"enabled": True, "policy": POLICY, "existingSecret": {"name": "p"}},
            },
            "give the policy in one place",
        ),
        (
            {"tls": {"secretName": "t", "certManager": {"issuerRef": {"name": "ca"}}}},
            "issuerRef.name and tls.secretName are both set",
        ),
        ({"tls": {"secretNames": {"cachesim": "sim-tls"}}}, "the tee has no certificate"),
        ({"tee": {"healthPort": 50061}}, "tee.healthPort 50061 is also a port of its Service"),
        (
            {"networkPolicy": {"enabled": True, "indexer": {"eventPorts": [5600]}}},
            "eventPorts needs networkPolicy.indexer.eventsFrom",
        ),
        (
            {
                "redis": {
                    "internal": {"enabled": False},
                    "external": {
                        "url": "redis://r:6379/0",
                        "tls": {"clientCertSecret": {"name": "c"}},
                    },
                }
            },
            "clientCertSecret.name is set but redis.external.tls.enabled is false",
        ),
        (
            {
                "redis": {
                    "internal": {"enabled": False},
                    "external": {
                        "url": "redis://r:6379/0",
                        "username": "u",
                        "usernameSecret": {"name": "s"},
                    },
                }
            },
            "give the user name in one place",
        ),
        (
            {"redis": {"external": {"passwordSecret": {"name": "p"}}}},
            "redis.external credentials or TLS are set but redis.external.url is empty",
        ),
        (
            {"redis": {"internal": {"auth": {"enabled": False, "existingSecret": {"name": "s"}}}}},
            "existingSecret.name is set but redis.internal.auth.enabled is false",
        ),
    ],
)
def test_security_cross_field_checks(values: dict[str, Any], message: str) -> None:
    with pytest.raises(helm_python.HelmRenderError, match=message):
        render(values)


# -- the sidecar with TLS, peers and the engines' NetworkPolicy --------------------------


def test_sidecar_serves_mutual_tls_with_peer_settings(engine_chart: Path) -> None:
    values = {
        "kvmesh": {
            "tls": {"secretNames": {"xfer": "engine-xfer-tls"}},
            "auth": {"enabled": True, "existingConfigMap": {"name": "fleet-policy"}},
            "xfer": {
                "peers": {
                    "allowedIdentities": ["spiffe://fleet/xfer/*"],
                    "sharedSecret": {"name": "xfer-peer-secret"},
                    "serverName": "xfer.fleet.internal",
                }
            },
        }
    }
    docs = manifests(render(values, chart=engine_chart))
    validate_all(docs)
    from xfer.config import load_config as load_xfer_config

    for role in ("prefill", "decode"):
        dep = by_kind(docs, "Deployment")[f"rel-{role}"]
        side = pod_spec(dep)["containers"][1]
        env = env_of(side)
        files = {
            "KVMESH_XFER_TLS__CERT_FILE": "engine-xfer-tls",
            "KVMESH_XFER_TLS__KEY_FILE": "engine-xfer-tls",
            "KVMESH_XFER_TLS__CLIENT_CA_FILE": "engine-xfer-tls",
            "KVMESH_XFER_PEERS__TLS__CERT_FILE": "engine-xfer-tls",
            "KVMESH_XFER_PEERS__TLS__CA_FILE": "engine-xfer-tls",
            "KVMESH_XFER_PEERS__SHARED_SECRET_FILE": "xfer-peer-secret",
        }
        for name, secret in files.items():
            assert mounted_file(dep, side, env[name])["secret"]["secretName"] == secret, name
        policy = mounted_file(dep, side, env["KVMESH_XFER_AUTH__POLICY_FILE"])
        assert policy["configMap"]["name"] == "fleet-policy"
        assert json.loads(env["KVMESH_XFER_PEERS__ALLOWED_IDENTITIES"]) == ["spiffe://fleet/xfer/*"]
        assert side["readinessProbe"]["grpc"]["port"] == 50060
        assert side["livenessProbe"]["grpc"]["port"] == 50060
        # Volume names of the sidecar cannot clash with the engine's.
        assert all(v["name"].startswith("kvmesh-") for v in pod_spec(dep)["volumes"])
        cfg = load_xfer_config(environ=env_for_loader(side), cli={"role": role})
        assert cfg.tls.mutual and cfg.health_port == 50060
        assert cfg.peer_tls().server_name == "xfer.fleet.internal"
        assert cfg.peers.shared_secret_file == "/etc/kvmesh/xfer-peer/secret"


def test_sidecar_with_an_inline_policy_needs_its_configmap(engine_chart: Path) -> None:
    values = {
        "kvmesh": {
            "tls": {"secretNames": {"xfer": "engine-xfer-tls"}},
            "auth": {"enabled": True, "policy": POLICY},
        }
    }
    with pytest.raises(helm_python.HelmRenderError, match='pass "policyConfigMap"'):
        render(values, chart=engine_chart)


def test_engine_event_ports_are_open_to_the_indexer_only(engine_chart: Path) -> None:
    docs = manifests(render(None, chart=engine_chart))
    (pol,) = by_kind(docs, "NetworkPolicy").values()
    rules = pol["spec"]["ingress"]
    zmq = [r for r in rules if {p["port"] for p in r["ports"]} & {5557, 5558}]
    assert len(zmq) == 1
    assert {p["port"] for p in zmq[0]["ports"]} == {5557, 5558}
    assert zmq[0]["from"] == [
        {
            "podSelector": {
                "matchLabels": {
                    "app.kubernetes.io/name": "kvmesh",
                    "app.kubernetes.io/component": "indexer",
                }
            }
        }
    ]
    # No other rule opens a range that holds the event ports.
    for r in rules:
        if r is zmq[0]:
            continue
        for p in r["ports"]:
            low, high = p["port"], p.get("endPort", p["port"])
            assert not any(low <= port <= high for port in (5557, 5558)), r
    other_ns = {"networkPolicy": {"indexer": {"namespace": "kvmesh"}}}
    (pol,) = by_kind(manifests(render(other_ns, chart=engine_chart)), "NetworkPolicy").values()
    assert pol["spec"]["ingress"][0]["from"][0]["namespaceSelector"] == {
        "matchLabels": {"kubernetes.io/metadata.name": "kvmesh"}
    }


@pytest.mark.parametrize("block_size", [16, 64, 512])
def test_the_indexer_env_loads_at_every_model_block_size(block_size: int) -> None:
    """The chart's defaults start an indexer whatever block size the model has (an
    explicit Match cap of 8,192 blocks of 512 tokens could not fit a message, and
    the config refused to load); a cap given in values still reaches the config."""
    from indexer.config import load_config

    docs = manifests(render({"indexer": {"modelBlockSizes": {"m": block_size}}}))
    (c,) = containers(by_kind(docs, "Deployment")["rel-kvmesh-indexer"])
    cfg = load_config(environ=env_for_loader(c))
    assert cfg.model_block_sizes == {"m": block_size}
    assert cfg.limits.max_match_blocks * block_size * 5 < cfg.limits.max_message_bytes
    docs = manifests(render({"indexer": {"maxMatchBlocks": 1000}}))
    (c,) = containers(by_kind(docs, "Deployment")["rel-kvmesh-indexer"])
    assert load_config(environ=env_for_loader(c)).limits.max_match_blocks == 1000


def test_the_bundled_redis_users_rights_are_the_indexers_least_rule() -> None:
    """The chart's default ACL rights and SECURITY.md's rule are the commands
    the indexer sends (indexer.redis.connection.acl_rule): a right missing from
    either refuses a feature on that install (the chart's once lacked the TTLs
    of route-time predictions, so PredictPlacement failed there)."""
    from indexer.redis.connection import acl_rule

    want = {r for r in acl_rule().split() if r.startswith(("+", "-"))}
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    rules = values["redis"]["internal"]["auth"]["aclRules"].split()
    assert {r for r in rules if r.startswith(("+", "-"))} == want
    security = (ROOT / "SECURITY.md").read_text()
    line = next(x for x in security.splitlines() if x.startswith("ACL SETUSER kvmesh"))
    assert {r for r in line.split() if r.startswith(("+", "-"))} == want
