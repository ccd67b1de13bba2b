"""Run a container of a rendered Helm chart as a process on this machine.

:func:`localize` turns a container spec into a command line and an
environment the way the kubelet would build them, with this machine standing
in for the cluster: the pod IP is 127.0.0.1 (and ``0.0.0.0`` listens there),
each container port gets a free local port, ``$(VAR)`` references expand, a
Service name (``rel-kvmesh-cachesim.ns.svc:50062``) resolves to the local
address of the pod behind it, and each volume mount is a local folder. Any
part of the spec it cannot stand in for (a Secret reference, a mount without a
folder) raises ``ValueError`` naming it, so the chart cannot silently ask for
something the test does not provide.
"""

from __future__ import annotations

import re
import socket
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

POD_IP = "127.0.0.1"

_VAR = re.compile(r"\$\((\w+)\)")
_HOST_PORT = re.compile(r"(?P<host>[a-z0-9][-a-z0-9.]*):(?P<port>\d+)")


def free_port() -> int:
    """A TCP port of 127.0.0.1 that was free a moment ago."""
    with socket.socket() as s:
        s.bind((POD_IP, 0))
        port: int = s.getsockname()[1]
        return port


def manifests(rendered: Mapping[str, str]) -> list[dict[str, Any]]:
    """Every Kubernetes object of a render (NOTES.txt and empty templates left out)."""
    docs: list[dict[str, Any]] = []
    for path, text in sorted(rendered.items()):
        if path.endswith(".yaml"):
            docs += [d for d in yaml.safe_load_all(text) if d]
    return docs


def container(docs: Iterable[dict[str, Any]], kind: str, name: str, c: str) -> dict[str, Any]:
    """Container ``c`` of the ``kind`` object ``name`` (a Deployment or a Pod)."""
    for d in docs:
        if d["kind"] == kind and d["metadata"]["name"] == name:
            spec = d["spec"] if kind == "Pod" else d["spec"]["template"]["spec"]
            for item in spec["containers"]:
                if item["name"] == c:
                    found: dict[str, Any] = item
                    return found
    raise KeyError(f"no container {c} in {kind} {name}")


@dataclass
class LocalPod:
    """A container translated to this machine: what to run, and where it listens."""

    name: str
    argv: list[str]
    env: dict[str, str]
    cwd: Path
    #: Container port name -> local port.
    ports: dict[str, int] = field(default_factory=dict)
    #: Container port number -> local port.
    port_map: dict[int, int] = field(default_factory=dict)
    #: Local port of the readiness probe's gRPC health check (None: no such probe).
    grpc_probe_port: int | None = None

    def address(self, port_name: str) -> str:
        """``127.0.0.1:<local port>`` of the named container port."""
        return f"{POD_IP}:{self.ports[port_name]}"


@dataclass
class Cluster:
    """The Services of a render and the local pods (or outside addresses) behind them."""

    #: Service name -> (component label, {service port: target port name or number}).
    services: dict[str, tuple[str, dict[int, int | str]]] = field(default_factory=dict)
    #: Component label -> its local pod.
    pods: dict[str, LocalPod] = field(default_factory=dict)
    #: "service:port" -> address, for what runs outside the chart's pods (e.g. Redis).
    outside: dict[str, str] = field(default_factory=dict)

    def add_services(self, docs: Iterable[dict[str, Any]]) -> None:
        """Learn the Services of a render."""
        for d in docs:
            if d["kind"] != "Service":
                continue
            component = d["spec"]["selector"].get("app.kubernetes.io/component", "")
            ports = {int(p["port"]): p.get("targetPort", p["port"]) for p in d["spec"]["ports"]}
            self.services[d["metadata"]["name"]] = (component, ports)

    def resolve(self, host: str, port: int) -> str | None:
        """The local address of ``host:port`` when host names a known Service, else None."""
        service = host.split(".")[0]
        if service not in self.services:
            return None
        if f"{service}:{port}" in self.outside:
            return self.outside[f"{service}:{port}"]
        component, ports = self.services[service]
        pod = self.pods.get(component)
        if pod is None or port not in ports:
            raise ValueError(f"{host}:{port}: no local pod serves component {component!r}")
        target = ports[port]
        local = pod.ports[target] if isinstance(target, str) else pod.port_map[int(target)]
        return f"{POD_IP}:{local}"


def _substitute_addresses(value: str, cluster: Cluster, own: Mapping[int, int]) -> str:
    def sub(m: re.Match[str]) -> str:
        host, port = m["host"], int(m["port"])
        if host == POD_IP and port in own:
            return f"{POD_IP}:{own[port]}"
        resolved = cluster.resolve(host, port)
        return resolved if resolved is not None else m.group(0)

    return _HOST_PORT.sub(sub, value)


def localize(
    spec: dict[str, Any],
    *,
    name: str,
    cluster: Cluster,
    mounts: Mapping[str, Path],
    base_env: Mapping[str, str],
) -> LocalPod:
    """The local process of container ``spec`` (see the module docstring).

    ``mounts`` maps each of the container's mount paths to a local folder, and
    ``/tmp`` to the working directory (the image's WORKDIR is /tmp, which the
    chart mounts as an emptyDir where the component may write); ``base_env``
    is the image's environment (its ENV lines, PATH).
    """
    ports = {p["name"]: free_port() for p in spec.get("ports", [])}
    port_map = {int(p["containerPort"]): ports[p["name"]] for p in spec.get("ports", [])}
    local_mounts: dict[str, Path] = {}
    for m in spec.get("volumeMounts", []):
        path = m["mountPath"]
        if path not in mounts:
            raise ValueError(f"{name}: the chart mounts {m['name']!r} at {path}; no local folder")
        local_mounts[path] = mounts[path]
    env: dict[str, str] = dict(base_env)
    for e in spec.get("env", []):
        if "value" in e:
            value = str(e["value"])
        elif e.get("valueFrom", {}).get("fieldRef", {}).get("fieldPath") == "status.podIP":
            value = POD_IP
        else:
            raise ValueError(f"{name}: env {e['name']} comes from {e.get('valueFrom')}")
        # The kubelet expands $(VAR) from the variables defined before this one.
        value = _VAR.sub(lambda m: env.get(m[1], m.group(0)), value)
        if value == "0.0.0.0":
            value = POD_IP
        if e["name"].endswith("PORT") and value.isdigit() and int(value) in port_map:
            value = str(port_map[int(value)])
        value = _substitute_addresses(value, cluster, port_map)
        for path, local in local_mounts.items():
            if value == path or value.startswith(path + "/"):
                value = str(local) + value[len(path) :]
        if "$(" in value:
            raise ValueError(f"{name}: env {e['name']}={value!r} refers to an unknown variable")
        env[e["name"]] = value
    argv = [
        _substitute_addresses(_VAR.sub(lambda m: env.get(m[1], m.group(0)), str(a)), cluster, {})
        for a in [*spec.get("command", []), *spec.get("args", [])]
    ]
    probe = spec.get("readinessProbe", {}).get("grpc", {}).get("port")
    grpc_probe = None
    if probe is not None:
        grpc_probe = ports[probe] if isinstance(probe, str) else port_map[int(probe)]
    if "/tmp" not in mounts:
        raise ValueError(f"{name}: no local folder for /tmp, the image's working directory")
    cwd = mounts["/tmp"]
    env["TMPDIR"] = str(cwd)
    return LocalPod(name, argv, env, cwd, ports, port_map, grpc_probe)
