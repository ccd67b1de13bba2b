"""Spreading calls over a service's replicas: connection age on servers, round robin on clients.

gRPC keeps one HTTP/2 connection per backend for as long as it works. Behind a
Kubernetes ClusterIP Service a client's connection lands on one replica and
stays there; with the default ``pick_first`` policy a client that knows every
replica still uses only the first. Two halves fix that:

- A server ends every connection after a maximum age
  (:func:`connection_age_options`: ``grpc.max_connection_age_ms``, with a grace
  for the calls in flight): the client reconnects and, with a DNS target,
  resolves the name again, so a replica added since gets connections too.
- A client dials every replica and spreads its calls over them
  (:func:`balancing_options`: the ``round_robin`` policy), given either a name
  that resolves to every replica (``dns:///indexer-headless.ns.svc:50051``, a
  headless Service) or several addresses (:func:`channel_target` turns them
  into one ``ipv4:`` or ``ipv6:`` target).

Round robin places *calls*: a long-lived stream is one call and stays on the
replica it was placed on until it ends (the router client therefore can open
several MatchStreams and rotates them; see router_client/README.md).
"""

from __future__ import annotations

import ipaddress
import json
from collections.abc import Sequence
from typing import Literal

__all__ = [
    "LoadBalancing",
    "balancing_options",
    "channel_target",
    "connection_age_options",
]

#: gRPC's client-side load-balancing policies a kvmesh client may choose.
LoadBalancing = Literal["round_robin", "pick_first"]

#: URI schemes gRPC's resolvers know; a target starting with one is used as given.
_SCHEMES = ("dns:", "ipv4:", "ipv6:", "unix:", "unix-abstract:", "vsock:", "xds:")


def connection_age_options(max_age_s: float, grace_s: float) -> list[tuple[str, int]]:
    """Server options that end every connection after ``max_age_s`` seconds.

    gRPC sends GOAWAY at the age (jittered by ±10% so that a fleet's clients do
    not reconnect at once); calls in flight then have ``grace_s`` seconds to end
    before the connection is closed, streams included. ``max_age_s`` 0: none
    (connections live as long as they work).
    """
    if max_age_s <= 0:
        return []
    return [
        ("grpc.max_connection_age_ms", max(1, round(max_age_s * 1000))),
        ("grpc.max_connection_age_grace_ms", max(1, round(grace_s * 1000))),
    ]


def balancing_options(policy: LoadBalancing) -> list[tuple[str, str]]:
    """Channel options selecting the client-side load-balancing ``policy``.

    Set as the channel's default service config (``loadBalancingConfig``), the
    form every gRPC implementation reads (grpc-js takes the same JSON).
    """
    config: dict[str, list[dict[str, dict[str, object]]]] = {"loadBalancingConfig": [{policy: {}}]}
    return [("grpc.service_config", json.dumps(config, separators=(",", ":")))]


def _ip_host(address: str) -> tuple[int, str]:
    """(IP version, address) of ``host:port`` or ``[v6]:port`` with a literal IP host.

    Raises ValueError for a host name, a missing port or a bad one.
    """
    host, sep, port = address.rpartition(":")
    if not sep or not host:
        raise ValueError(f"{address!r}: not host:port")
    if not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"{address!r}: bad port {port!r}")
    bracketed = host.startswith("[") and host.endswith("]")
    try:
        ip = ipaddress.ip_address(host[1:-1] if bracketed else host)
    except ValueError:
        raise ValueError(
            f"{address!r}: a list of replicas takes IP addresses; for a name that "
            "resolves to every replica give one dns:///name:port target"
        ) from None
    if ip.version == 6 and not bracketed:
        raise ValueError(f"{address!r}: write an IPv6 address in brackets, [addr]:port")
    return ip.version, address


def channel_target(target: str | Sequence[str]) -> str:
    """The gRPC target of one address, a resolver URI, or several replica addresses.

    - ``"host:port"`` and URIs gRPC resolves (``dns:///name:port``,
      ``ipv4:…``, ``unix:…``) are returned as given.
    - Several addresses, as a sequence or one string joined by commas
      (``"10.0.0.5:50051,10.0.0.6:50051"``), become one ``ipv4:`` (or
      ``ipv6:``) target listing them all; they must be IP literals of one
      family (a name would need a resolver: use ``dns:///name:port``).

    Raises ValueError naming the address at fault.
    """
    if isinstance(target, str):
        text = target.strip()
        if text.startswith(_SCHEMES) or "," not in text:
            if not text:
                raise ValueError("empty target")
            return text
        parts = [p.strip() for p in text.split(",")]
    else:
        parts = [str(p).strip() for p in target]
    parts = [p for p in parts if p]
    if not parts:
        raise ValueError("no address given")
    if len(parts) == 1:
        return channel_target(parts[0])
    hosts = [_ip_host(p) for p in parts]
    versions = {v for v, _ in hosts}
    if len(versions) > 1:
        raise ValueError(f"{', '.join(parts)}: mixes IPv4 and IPv6 addresses (one family)")
    scheme = "ipv6" if versions == {6} else "ipv4"
    return f"{scheme}:{','.join(a for _, a in hosts)}"
