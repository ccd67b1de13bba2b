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

A component may run several replicas (:meth:`Cluster.add_replica`). A
headless Service's name then resolves to all of them, as the cluster's DNS
lists every ready pod: ``dns:///svc:port`` becomes one ``ipv4:`` target of
every replica's address, a bare ``svc:port`` the replicas' addresses joined by
commas (the form :func:`kvmesh.balancing.channel_target` takes); a Service
with a cluster IP reaches one replica (the first, where kube-proxy would pick
any). The containers of one pod share its loopback: pass one ``loopback`` map
to :func:`localize` for each of them, and every ``127.0.0.1:<port>`` they name
(a container port or not) gets a local port of its own for that pod, so two
pods may both use, say, 127.0.0.1:5557, as in a cluster.
"""

from __future__ import annotations

import random
import re
import socket
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from lab.redisproc import ephemeral_range

POD_IP = "127.0.0.1"

_VAR = re.compile(r"\$\((\w+)\)")
_HOST_PORT = re.compile(r"(?P<dns>dns:///)?(?P<host>[a-z0-9][-a-z0-9.]*):(?P<port>\d+)")


#: Ports handed out by this process (never twice).
_GIVEN: set[int] = set()


def free_port() -> int:
    """A TCP port of 127.0.0.1 that is free now and that the kernel will not
    hand to anything else: below its ephemeral range, never given twice.

    A port is given out seconds before the process that binds it starts (the
    engines' publishers import vLLM meanwhile). Drawn from the ephemeral range
    (``bind(port 0)``), the same port could meanwhile become the local end of
    another process's connection (a bridge dialling an indexer), and the
    bind failed with EADDRINUSE (seen once in a full run).
    """
    low, _ = ephemeral_range()
    floor = max(1024, low - 12_000)
    rnd = random.Random()
    for _ in range(1000):
        port = rnd.randrange(floor, low)
        if port in _GIVEN or port == 6379:
            continue
        with socket.socket() as s:
            try:
                s.bind((POD_IP, port))
            except OSError:
                continue
        _GIVEN.add(port)
        return port
    raise RuntimeError(f"no free port below {low} after 1,000 tries")


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
    #: The pod's loopback ports (port the spec names -> local port), when given one.
    loopback: dict[int, int] = field(default_factory=dict)

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
    #: Component label -> the local pods of its replicas (:meth:`add_replica`).
    replicas: dict[str, list[LocalPod]] = field(default_factory=dict)
    #: Names of the headless Services (``clusterIP: None``).
    headless: set[str] = field(default_factory=set)
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
            if d["spec"].get("clusterIP") == "None":
                self.headless.add(d["metadata"]["name"])

    def add_replica(self, component: str, pod: LocalPod) -> None:
        """One more replica of ``component`` (the first is also its pod in :attr:`pods`)."""
        self.replicas.setdefault(component, []).append(pod)
        self.pods.setdefault(component, pod)

    def resolve_all(self, host: str, port: int) -> list[str] | None:
        """Every local address ``host:port`` reaches when host names a known Service, else None.

        A headless Service reaches every replica of its component, any other
        Service one.
        """
        service = host.split(".")[0]
        if service not in self.services:
            return None
        if f"{service}:{port}" in self.outside:
            return [self.outside[f"{service}:{port}"]]
        component, ports = self.services[service]
        pod = self.pods.get(component)
        if pod is None or port not in ports:
            raise ValueError(f"{host}:{port}: no local pod serves component {component!r}")
        behind = self.replicas.get(component, [pod]) if service in self.headless else [pod]
        target = ports[port]
        return [
            f"{POD_IP}:{p.ports[target] if isinstance(target, str) else p.port_map[int(target)]}"
            for p in behind
        ]

    def resolve(self, host: str, port: int) -> str | None:
        """The local address of ``host:port`` when host names a known Service, else None.

        Several replicas behind a headless Service: their addresses joined by commas.
        """
        found = self.resolve_all(host, port)
        return None if found is None else ",".join(found)


def _substitute_addresses(
    value: str, cluster: Cluster, own: Mapping[int, int], loopback: dict[int, int] | None = None
) -> str:
    def sub(m: re.Match[str]) -> str:
        host, port, dns = m["host"], int(m["port"]), m["dns"] or ""
        if host == POD_IP and port in own:
            return f"{dns}{POD_IP}:{own[port]}"
        if host == POD_IP and loopback is not None:
            if port not in loopback:
                loopback[port] = free_port()
            return f"{dns}{POD_IP}:{loopback[port]}"
        found = cluster.resolve_all(host, port)
        if found is None:
            return m.group(0)
        if dns and len(found) > 1:
            return "ipv4:" + ",".join(found)
        return dns + ",".join(found)

    return _HOST_PORT.sub(sub, value)


def localize(
    spec: dict[str, Any],
    *,
    name: str,
    cluster: Cluster,
    mounts: Mapping[str, Path],
    base_env: Mapping[str, str],
    downward: Mapping[str, str] | None = None,
    loopback: dict[int, int] | None = None,
) -> LocalPod:
    """The local process of container ``spec`` (see the module docstring).

    ``mounts`` maps each of the container's mount paths to a local folder, and
    ``/tmp`` to the working directory (the image's WORKDIR is /tmp, which the
    chart mounts as an emptyDir where the component may write); ``base_env``
    is the image's environment (its ENV lines, PATH). ``downward`` gives the
    pod's fields an env ``fieldRef`` may name besides ``status.podIP``
    (``metadata.name``, ``metadata.uid``). ``loopback``: the pod's loopback,
    shared by its containers (filled in here; see the module docstring);
    None: only the container's own ports of 127.0.0.1 are mapped, in its env.
    """
    ports: dict[str, int] = {}
    for p in spec.get("ports", []):
        number = int(p["containerPort"])
        if loopback is not None and number not in loopback:
            loopback[number] = free_port()
        ports[p["name"]] = loopback[number] if loopback is not None else free_port()
    port_map = {int(p["containerPort"]): ports[p["name"]] for p in spec.get("ports", [])}
    own: Mapping[int, int] = port_map if loopback is None else loopback
    fields = {**(downward or {}), "status.podIP": POD_IP}
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
        elif e.get("valueFrom", {}).get("fieldRef", {}).get("fieldPath") in fields:
            value = fields[e["valueFrom"]["fieldRef"]["fieldPath"]]
        else:
            raise ValueError(f"{name}: env {e['name']} comes from {e.get('valueFrom')}")
        # The kubelet expands $(VAR) from the variables defined before this one.
        value = _VAR.sub(lambda m: env.get(m[1], m.group(0)), value)
        if value == "0.0.0.0":
            value = POD_IP
        if e["name"].endswith("PORT") and value.isdigit() and int(value) in port_map:
            value = str(port_map[int(value)])
        value = _substitute_addresses(value, cluster, own, loopback)
        for path, local in local_mounts.items():
            if value == path or value.startswith(path + "/"):
                value = str(local) + value[len(path) :]
        if "$(" in value:
            raise ValueError(f"{name}: env {e['name']}={value!r} refers to an unknown variable")
        env[e["name"]] = value
    argv = [
        _substitute_addresses(
            _VAR.sub(lambda m: env.get(m[1], m.group(0)), str(a)),
            cluster,
            {} if loopback is None else loopback,
            loopback,
        )
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
    return LocalPod(
        name, argv, env, cwd, ports, port_map, grpc_probe, {} if loopback is None else loopback
    )
