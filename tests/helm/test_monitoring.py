"""prometheus-operator scrape objects of the chart (templates/monitoring.yaml).

The monitoring.coreos.com CRDs are not among the Kubernetes schemas that
kubernetes-validate bundles, so their kinds are handled apart: every other
object of a render is validated strictly as in test_chart.py, and each
ServiceMonitor and PodMonitor is checked against :data:`MONITOR_SCHEMA` (the
fields the chart renders, named and typed as prometheus-operator v0.93's CRDs
define them, unknown fields refused) and then followed to what it scrapes: the
Service its selector picks, the port it names on that Service, the container
port behind it, and the port the server is told to serve metrics on.
"""

from __future__ import annotations

import re
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import helm_python
import jsonschema
import kubernetes_validate
import pytest

from tests.helm.test_chart import (
    CHART,
    EXAMPLE,
    KUBE_VERSIONS,
    containers,
    env_of,
    manifests,
    render,
)

MONITORING = "monitoring.coreos.com/"
#: CRD kinds of other groups the chart renders (cert-manager): skipped, as test_chart does.
OTHER_CRDS = ("cert-manager.io/",)

_DURATION = (
    "^(0|(([0-9]+)y)?(([0-9]+)w)?(([0-9]+)d)?(([0-9]+)h)?(([0-9]+)m)?(([0-9]+)s)?(([0-9]+)ms)?)$"
)
_SELECTOR: dict[str, Any] = {
    "type": "object",
    "additionalProperties": False,
    "properties": {
        "matchLabels": {"type": "object", "additionalProperties": {"type": "string"}},
        "matchExpressions": {"type": "array", "items": {"type": "object"}},
    },
}
_KEY_REF: dict[str, Any] = {
    "type": "object",
    "additionalProperties": False,
    "required": ["key"],
    "properties": {
        "name": {"type": "string"},
        "key": {"type": "string"},
        "optional": {"type": "boolean"},
    },
}
_SECRET_OR_CM: dict[str, Any] = {
    "type": "object",
    "additionalProperties": False,
    "properties": {"secret": _KEY_REF, "configMap": _KEY_REF},
}
_RELABEL: dict[str, Any] = {
    "type": "array",
    "items": {
        "type": "object",
        "additionalProperties": False,
        "properties": {
            "sourceLabels": {"type": "array", "items": {"type": "string"}},
            "separator": {"type": "string"},
            "targetLabel": {"type": "string"},
            "regex": {"type": "string"},
            "modulus": {"type": "integer"},
            "replacement": {"type": "string"},
            "action": {"type": "string"},
        },
    },
}
_ENDPOINT: dict[str, Any] = {
    "type": "object",
    "additionalProperties": False,
    "required": ["port"],
    "properties": {
        "port": {"type": "string", "minLength": 1},
        "path": {"type": "string"},
        "interval": {"type": "string", "pattern": _DURATION},
        "scrapeTimeout": {"type": "string", "pattern": _DURATION},
        "scheme": {"enum": ["http", "https", "HTTP", "HTTPS"]},
        "tlsConfig": {
            "type": "object",
            "additionalProperties": False,
            "properties": {
                "ca": _SECRET_OR_CM,
                "cert": _SECRET_OR_CM,
                "keySecret": _KEY_REF,
                "serverName": {"type": "string"},
                "insecureSkipVerify": {"type": "boolean"},
            },
        },
        "relabelings": _RELABEL,
        "metricRelabelings": _RELABEL,
    },
}
_METADATA: dict[str, Any] = {
    "type": "object",
    "required": ["name", "namespace", "labels"],
    "properties": {
        "labels": {"type": "object", "additionalProperties": {"type": "string"}},
        "name": {"type": "string", "maxLength": 63},
    },
}


def _monitor_schema(kind: str, endpoints: str) -> dict[str, Any]:
    return {
        "type": "object",
        "additionalProperties": False,
        "required": ["apiVersion", "kind", "metadata", "spec"],
        "properties": {
            "apiVersion": {"const": "monitoring.coreos.com/v1"},
            "kind": {"const": kind},
            "metadata": _METADATA,
            "spec": {
                "type": "object",
                "additionalProperties": False,
                "required": ["selector", endpoints],
                "properties": {
                    "namespaceSelector": {
                        "type": "object",
                        "additionalProperties": False,
                        "properties": {
                            "any": {"type": "boolean"},
                            "matchNames": {"type": "array", "items": {"type": "string"}},
                        },
                    },
                    "selector": _SELECTOR,
                    endpoints: {"type": "array", "minItems": 1, "items": _ENDPOINT},
                },
            },
        },
    }


#: The part of the monitoring.coreos.com/v1 CRDs the chart renders, strict.
MONITOR_SCHEMA: dict[str, dict[str, Any]] = {
    "ServiceMonitor": _monitor_schema("ServiceMonitor", "endpoints"),
    "PodMonitor": _monitor_schema("PodMonitor", "podMetricsEndpoints"),
}


def validate(docs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Validate every object of a render; return the monitoring.coreos.com ones."""
    monitors = []
    for doc in docs:
        api = doc["apiVersion"]
        if api.startswith(MONITORING):
            jsonschema.validate(doc, MONITOR_SCHEMA[doc["kind"]])
            monitors.append(doc)
        elif not api.startswith(OTHER_CRDS):
            for version in KUBE_VERSIONS:
                kubernetes_validate.validate(doc, version, strict=True)
    return monitors


def _sm(**extra: Any) -> dict[str, Any]:
    return {"metrics": {"serviceMonitor": {"enabled": True, **extra}}}


ENGINE_PODS = {"matchLabels": {"app.kubernetes.io/name": "engine"}}
ALL_ON: dict[str, Any] = {
    "indexer": _sm(labels={"release": "prometheus"}),
    "tee": _sm(interval="15s", scrapeTimeout="10s"),
    "cachesim": _sm(
        metricRelabelings=[
            {"action": "drop", "sourceLabels": ["__name__"], "regex": "python_gc_.*"}
        ]
    ),
    "xfer": {"metrics": {"podMonitor": {"enabled": True, "selector": ENGINE_PODS}}},
}
#: Prometheus's client certificate, as a user of mutual TLS gives it.
PROM_CLIENT = {
    "cert": {"secret": {"name": "prometheus-client", "key": "tls.crt"}},
    "keySecret": {"name": "prometheus-client", "key": "tls.key"},
}
VALUE_SETS: dict[str, dict[str, Any]] = {
    "plaintext": ALL_ON,
    "tls-optional-client-auth": {
        **ALL_ON,
        "tls": {"secretName": "kvmesh-tls", "clientAuth": "optional"},
    },
    "mtls-prometheus-certificate": {
        **ALL_ON,
        "tls": {"secretName": "kvmesh-tls", "caSecret": {"name": "fleet-ca", "key": "ca.pem"}},
        "cachesim": _sm(tlsConfig={**PROM_CLIENT, "serverName": "sim.example"}),
    },
    "cert-manager": {
        **ALL_ON,
        "tls": {"certManager": {"issuerRef": {"name": "fleet-ca", "kind": "ClusterIssuer"}}},
        "cachesim": _sm(tlsConfig=PROM_CLIENT),
    },
}
#: Component -> (its Service, the env var telling the server its metrics port).
SCRAPED = {
    "indexer": ("rel-kvmesh-indexer", "KVMESH_INDEXER_METRICS_PORT"),
    "tee": ("rel-kvmesh-tee", "KVMESH_TEE_METRICS_PORT"),
    "cachesim": ("rel-kvmesh-cachesim", "KVMESH_CACHESIM_HTTP_PORT"),
}


def _selects(selector: dict[str, Any], labels: dict[str, str]) -> bool:
    assert set(selector) == {"matchLabels"}, selector  # what the chart renders
    return all(labels.get(k) == v for k, v in selector["matchLabels"].items())


def _of_kind(docs: list[dict[str, Any]], kind: str) -> list[dict[str, Any]]:
    return [d for d in docs if d["kind"] == kind]


def test_no_monitor_unless_asked() -> None:
    rendered = render()
    assert rendered.get("kvmesh/templates/monitoring.yaml", "").strip() == ""
    assert not [d for d in manifests(rendered) if d["apiVersion"].startswith(MONITORING)]


@pytest.mark.parametrize("name", sorted(VALUE_SETS))
def test_service_monitors_scrape_each_servers_metrics_port(name: str) -> None:
    docs = manifests(render(VALUE_SETS[name]))
    monitors = validate(docs)
    services = _of_kind(docs, "Service")
    deployments = _of_kind(docs, "Deployment")
    sms = {m["metadata"]["name"]: m for m in monitors if m["kind"] == "ServiceMonitor"}
    assert set(sms) == {svc for svc, _ in SCRAPED.values()}
    for component, (service_name, port_env) in SCRAPED.items():
        sm = sms[service_name]
        assert sm["metadata"]["namespace"] == "ns"
        assert sm["metadata"]["labels"]["app.kubernetes.io/component"] == component
        assert sm["spec"]["namespaceSelector"] == {"matchNames": ["ns"]}
        [endpoint] = sm["spec"]["endpoints"]
        assert endpoint["path"] == "/metrics"
        # The selector picks the component's Services; of those, exactly one has the port.
        picked = [s for s in services if _selects(sm["spec"]["selector"], s["metadata"]["labels"])]
        assert picked and all(
            s["metadata"]["labels"]["app.kubernetes.io/component"] == component for s in picked
        )
        with_port = [
            s for s in picked if endpoint["port"] in {p["name"] for p in s["spec"]["ports"]}
        ]
        assert [s["metadata"]["name"] for s in with_port] == [service_name]
        [port] = [p for p in with_port[0]["spec"]["ports"] if p["name"] == endpoint["port"]]
        # ...whose target is the container port the server serves metrics on.
        [dep] = [
            d
            for d in deployments
            if _selects(
                {"matchLabels": with_port[0]["spec"]["selector"]},
                d["spec"]["template"]["metadata"]["labels"],
            )
        ]
        (c,) = containers(dep)
        ports = {p["name"]: p["containerPort"] for p in c["ports"]}
        assert str(ports[port["targetPort"]]) == env_of(c)[port_env]


def test_monitor_options_reach_the_endpoint() -> None:
    monitors = validate(manifests(render(ALL_ON)))
    by_name = {m["metadata"]["name"]: m for m in monitors}
    assert by_name["rel-kvmesh-indexer"]["metadata"]["labels"]["release"] == "prometheus"
    [ix] = by_name["rel-kvmesh-indexer"]["spec"]["endpoints"]
    assert ix["interval"] == "30s" and "scrapeTimeout" not in ix
    [tee] = by_name["rel-kvmesh-tee"]["spec"]["endpoints"]
    assert (tee["interval"], tee["scrapeTimeout"]) == ("15s", "10s")
    [sim] = by_name["rel-kvmesh-cachesim"]["spec"]["endpoints"]
    assert sim["metricRelabelings"][0]["regex"] == "python_gc_.*"
    assert "scheme" not in sim and "tlsConfig" not in sim  # plaintext without certificates


def test_cache_simulator_is_scraped_over_tls_with_its_ca() -> None:
    monitors = validate(manifests(render(VALUE_SETS["tls-optional-client-auth"])))
    [sim] = [m for m in monitors if m["metadata"]["name"] == "rel-kvmesh-cachesim"]
    [endpoint] = sim["spec"]["endpoints"]
    assert endpoint["scheme"] == "https"
    assert endpoint["tlsConfig"] == {
        "serverName": "rel-kvmesh-cachesim.ns.svc",
        "ca": {"secret": {"name": "kvmesh-tls", "key": "ca.crt"}},
    }
    # The plaintext metrics ports of the indexer and the tee stay http.
    sms = [m for m in monitors if m["kind"] == "ServiceMonitor"]
    https = [m["metadata"]["name"] for m in sms if "scheme" in m["spec"]["endpoints"][0]]
    assert https == ["rel-kvmesh-cachesim"]


def test_given_tls_config_is_merged_over_the_charts() -> None:
    mtls = validate(manifests(render(VALUE_SETS["mtls-prometheus-certificate"])))
    [sim] = [m for m in mtls if m["metadata"]["name"] == "rel-kvmesh-cachesim"]
    assert sim["spec"]["endpoints"][0]["tlsConfig"] == {
        **PROM_CLIENT,
        "serverName": "sim.example",  # the user's wins
        "ca": {"secret": {"name": "fleet-ca", "key": "ca.pem"}},  # tls.caSecret
    }


def test_cert_manager_certificate_names_the_server_name_scraped() -> None:
    docs = manifests(render(VALUE_SETS["cert-manager"]))
    [sim] = [m for m in validate(docs) if m["metadata"]["name"] == "rel-kvmesh-cachesim"]
    tls = sim["spec"]["endpoints"][0]["tlsConfig"]
    assert tls["ca"] == {"secret": {"name": "rel-kvmesh-cachesim-tls", "key": "ca.crt"}}
    [cert] = [
        d
        for d in docs
        if d["kind"] == "Certificate" and d["spec"]["secretName"] == "rel-kvmesh-cachesim-tls"
    ]
    assert tls["serverName"] in cert["spec"]["dnsNames"]


def test_mutual_tls_without_prometheus_certificate_fails_clearly() -> None:
    values = {**ALL_ON, "tls": {"secretName": "kvmesh-tls"}}  # mutual, clientAuth require
    with pytest.raises(
        helm_python.HelmRenderError, match=re.escape("tlsConfig.cert and .keySecret")
    ):
        render(values)


def test_pod_monitor_needs_the_engine_pods_selector() -> None:
    values = {"xfer": {"metrics": {"podMonitor": {"enabled": True}}}}
    with pytest.raises(
        helm_python.HelmRenderError, match=re.escape("xfer.metrics.podMonitor.selector")
    ):
        render(values)


@pytest.mark.parametrize(
    ("values", "message"),
    [
        ({"indexer": _sm(interval="30 seconds")}, "interval"),
        ({"tee": _sm(scrapeIntervall="30s")}, "scrapeIntervall"),
        ({"indexer": _sm(tlsConfig={})}, "tlsConfig"),  # only the cache simulator serves TLS
    ],
)
def test_values_schema_refuses_bad_monitor_settings(values: dict[str, Any], message: str) -> None:
    with pytest.raises(helm_python.HelmValuesError, match=message):
        render(values)


def test_monitor_schema_is_strict() -> None:
    """A misspelled field (the pre-v0.40 `metricRelabelConfigs`) fails the check used above."""
    [sm] = [
        m for m in validate(manifests(render(ALL_ON))) if m["metadata"]["name"] == "rel-kvmesh-tee"
    ]
    sm["spec"]["endpoints"][0]["metricRelabelConfigs"] = []
    with pytest.raises(jsonschema.ValidationError, match="metricRelabelConfigs"):
        validate([sm])


@pytest.mark.parametrize("name", sorted(VALUE_SETS))
def test_monitors_lint_strict(name: str) -> None:
    report = helm_python.lint(str(CHART), VALUE_SETS[name], strict=True, kube_version="v1.30.0")
    problems = [m for m in report["messages"] if m["severity"] >= 2]
    assert report["errors"] == [] and problems == [], report


# -- the xfer sidecar in an engine chart ---------------------------------------------


@pytest.fixture(scope="module")
def engine_chart(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """The example engine chart with this kvmesh chart vendored under charts/."""
    dest = tmp_path_factory.mktemp("engine") / "engine-with-xfer"
    shutil.copytree(EXAMPLE, dest)
    shutil.copytree(CHART, dest / "charts" / "kvmesh")
    yield dest


def test_pod_monitor_scrapes_the_sidecars_of_the_engine_pods(engine_chart: Path) -> None:
    values = {"kvmesh": {"xfer": ALL_ON["xfer"]}}
    docs = manifests(render(values, chart=engine_chart))
    [pm] = validate(docs)
    assert pm["kind"] == "PodMonitor" and pm["metadata"]["name"] == "rel-kvmesh-xfer"
    [endpoint] = pm["spec"]["podMetricsEndpoints"]
    assert endpoint["path"] == "/metrics"
    engines = [
        d
        for d in docs
        if d["kind"] in ("Deployment", "StatefulSet")
        and _selects(pm["spec"]["selector"], d["spec"]["template"]["metadata"]["labels"])
    ]
    assert len(engines) == 2  # prefill and decode
    for engine in engines:
        [sidecar] = [
            c
            for c in containers(engine)
            if endpoint["port"] in {p["name"] for p in c.get("ports", [])}
        ]
        [port] = [p for p in sidecar["ports"] if p["name"] == endpoint["port"]]
        assert str(port["containerPort"]) == env_of(sidecar)["KVMESH_XFER_METRICS_PORT"]
