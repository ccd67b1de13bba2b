"""The bridge sidecar snippet (``kvmesh.bridgeSidecar``) in the example engine chart.

Rendered by Helm's own engine and validated against the Kubernetes schemas, as
tests/helm/test_chart.py does for the rest of the chart; the sidecar's
environment must load as a valid bridge config (indexer/bridge/config.py).
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import helm_python
import pytest

from indexer.bridge.config import BridgeConfig, load_config
from tests.helm.test_chart import (
    CHART,
    ROOT,
    by_kind,
    env_of,
    manifests,
    mounted_file,
    pod_spec,
    render,
    validate_all,
)

EXAMPLE = ROOT / "helm" / "examples" / "engine-with-bridge"

#: Stand-ins for the downward API values the sidecar's env expands.
DOWNWARD = {"$(POD_NAME)": "rel-engine-7d9f-x2k", "$(POD_IP)": "10.0.0.7", "$(POD_UID)": "0b1c-uid"}


@pytest.fixture(scope="module")
def engine_chart(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """The example engine chart with this kvmesh chart vendored under charts/."""
    dest = tmp_path_factory.mktemp("engine") / "engine-with-bridge"
    shutil.copytree(EXAMPLE, dest)
    shutil.copytree(CHART, dest / "charts" / "kvmesh")
    yield dest


def sidecar(docs: list[dict[str, Any]]) -> tuple[dict[str, Any], dict[str, Any]]:
    """The engine Deployment and its bridge container."""
    dep = by_kind(docs, "Deployment")["rel-engine"]
    containers = pod_spec(dep)["containers"]
    assert [c["name"] for c in containers] == ["engine", "kvmesh-bridge"]
    return dep, containers[1]


def loaded(container: dict[str, Any]) -> BridgeConfig:
    """The bridge config the container's environment gives (downward API values filled in)."""
    env: dict[str, str] = {}
    for e in container["env"]:
        value = e.get("value")
        if value is None:
            continue
        for k, v in DOWNWARD.items():
            value = value.replace(k, v)
        env[e["name"]] = value
    return load_config(environ=env)


def test_the_example_renders_a_bridge_per_engine_pod(engine_chart: Path) -> None:
    docs = manifests(render(None, chart=engine_chart))
    validate_all(docs)
    # Every kvmesh service is off in the example: the engines and their policy only.
    assert {d["kind"] for d in docs} == {"Deployment", "NetworkPolicy"}
    dep, side = sidecar(docs)
    env = env_of(side)
    names = [e["name"] for e in side["env"]]
    for field in ("POD_NAME", "POD_IP", "POD_UID"):
        # Defined before the values that expand them.
        assert names.index(field) < names.index("KVMESH_BRIDGE_ENGINE_EVENTS__ENDPOINTS")
    assert env["POD_UID"] == {"fieldRef": {"fieldPath": "metadata.uid"}}
    cfg = loaded(side)
    (ep,) = cfg.engine_events.endpoints
    assert (ep.worker_id, ep.dp_rank, ep.model) == (
        "rel-engine-7d9f-x2k",
        0,
        "meta-llama/Llama-3.1-8B-Instruct",
    )
    assert ep.address == "http://10.0.0.7:8000"
    # The stream stays on the pod's loopback: the bridge binds, the engine connects.
    assert (ep.endpoint, ep.bind, ep.replay_endpoint) == (
        "tcp://127.0.0.1:5557",
        True,
        "tcp://127.0.0.1:5558",
    )
    assert cfg.indexer.target == "dns:///kvmesh-indexer-headless.kvmesh.svc:50051"
    assert cfg.indexer.load_balancing == "round_robin"
    assert cfg.incarnation_prefix == "0b1c-uid" and cfg.host == "10.0.0.7"
    assert side["readinessProbe"]["grpc"]["port"] == cfg.health_port == 50066
    assert side["securityContext"]["readOnlyRootFilesystem"] is True
    # The engine is told the same endpoints.
    engine = pod_spec(dep)["containers"][0]
    events = json.loads(engine["args"][engine["args"].index("--kv-events-config") + 1])
    assert (events["endpoint"], events["replay_endpoint"]) == (ep.endpoint, ep.replay_endpoint)
    assert engine["args"][engine["args"].index("--block-size") + 1] == "16"
    # No event port is opened to the network.
    (policy,) = by_kind(docs, "NetworkPolicy").values()
    ports = {p["port"] for rule in policy["spec"]["ingress"] for p in rule["ports"]}
    assert ports == {8000, 9466}


def test_sglang_and_data_parallel_ranks(engine_chart: Path) -> None:
    values = {
        "engine": {"kind": "sglang", "blockSize": 1},
        "kvmesh": {
            "bridge": {
                "dataParallelSize": 2,
                "eventsEndpoint": "tcp://127.0.0.1:5557",
                "replayEndpoint": "tcp://127.0.0.1:5567",
                "keys": "engine_hashes",
            }
        },
    }
    docs = manifests(render(values, chart=engine_chart))
    validate_all(docs)
    dep, side = sidecar(docs)
    eps = loaded(side).engine_events.endpoints
    assert [(e.dp_rank, e.endpoint, e.replay_endpoint, e.keys) for e in eps] == [
        (0, "tcp://127.0.0.1:5557", "tcp://127.0.0.1:5567", "engine_hashes"),
        (1, "tcp://127.0.0.1:5558", "tcp://127.0.0.1:5568", "engine_hashes"),
    ]
    engine = pod_spec(dep)["containers"][0]
    assert engine["command"] == ["python3", "-m", "sglang.launch_server"]
    assert engine["args"][engine["args"].index("--page-size") + 1] == "1"


def test_tls_client_certificate_ca_and_token_are_mounted_files(engine_chart: Path) -> None:
    values = {
        "kvmesh": {
            "bridge": {
                "tls": {
                    "enabled": True,
                    "secretName": "engine-bridge-tls",
                    "caSecret": {"name": "fleet-ca", "key": "bundle.pem"},
                    "serverName": "kvmesh-indexer.kvmesh.svc",
                },
                "tokenSecret": {"name": "engine-token", "key": "token"},
            }
        }
    }
    docs = manifests(render(values, chart=engine_chart))
    validate_all(docs)
    dep, side = sidecar(docs)
    tls = loaded(side).indexer.tls
    assert tls.active and tls.server_name == "kvmesh-indexer.kvmesh.svc"
    for path, secret in (
        (tls.ca_file, "fleet-ca"),
        (tls.cert_file, "engine-bridge-tls"),
        (tls.key_file, "engine-bridge-tls"),
        (tls.token_file, "engine-token"),
    ):
        assert mounted_file(dep, side, path)["secret"]["secretName"] == secret


@pytest.mark.parametrize(
    ("values", "message"),
    [
        ({"kvmesh": {"bridge": {"indexerTarget": ""}}}, "bridge.indexerTarget is required"),
        ({"engine": {"model": ""}}, "the engine's model is required"),
        (
            {
                "kvmesh": {
                    "bridge": {
                        "dataParallelSize": 2,
                        "eventsEndpoint": "ipc:///run/e/pub",
                        "bindEvents": False,
                    }
                }
            },
            "needs tcp:// endpoints",
        ),
        ({"kvmesh": {"bridge": {"dataParallelSize": 2}}}, "overlap once offset"),
        (
            {"kvmesh": {"bridge": {"eventsEndpoint": "tcp://0.0.0.0:5557"}}},
            "peers outside the pod could reach",
        ),
        (
            {"kvmesh": {"bridge": {"tokenSecret": {"name": "t", "key": "token"}}}},
            "bearer token never travels in plaintext",
        ),
        ({"engine": {"kind": "trtllm"}}, "engine.kind must be vllm or sglang"),
    ],
)
def test_bad_bridge_values_fail_with_a_clear_message(
    engine_chart: Path, values: dict[str, Any], message: str
) -> None:
    with pytest.raises(helm_python.HelmRenderError, match=message):
        render(values, chart=engine_chart)


@pytest.mark.parametrize(
    ("values", "message"),
    [
        ({"bridge": {"loadBalancing": "random"}}, "/bridge/loadBalancing"),
        ({"bridge": {"buffer": {"maxBatches": 0}}}, "/bridge/buffer/maxBatches"),
        ({"bridge": {"keyz": "tokens"}}, "additional properties 'keyz'"),
    ],
)
def test_the_schema_checks_bridge_values(values: dict[str, Any], message: str) -> None:
    with pytest.raises(helm_python.HelmValuesError, match=message):
        render(values)


def test_the_kvmesh_chart_alone_renders_no_bridge() -> None:
    docs = manifests(render())
    for doc in docs:
        if doc["kind"] in ("Deployment", "StatefulSet"):
            assert "kvmesh-bridge" not in [c["name"] for c in pod_spec(doc)["containers"]]
