"""pyproject's lower bounds admit nothing the committed stubs refuse at import.

The generated ``*_pb2.py`` files check the protobuf runtime they run on
(``ValidateProtobufRuntimeVersion``) and the ``*_pb2_grpc.py`` files the grpcio
version: an install that satisfies pyproject with an older runtime would fail
at the first import of the API.
"""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
API = ROOT / "kvmesh" / "api"


def _lower_bound(name: str) -> tuple[int, ...]:
    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    for d in deps:
        m = re.fullmatch(rf"{re.escape(name)}\s*(==|>=)\s*([0-9.]+).*", d)
        if m:
            return tuple(int(x) for x in m.group(2).split("."))
    raise AssertionError(f"{name} is not in pyproject's dependencies")


def _stub_protobuf_versions() -> set[tuple[int, ...]]:
    found = set()
    pattern = re.compile(
        r"ValidateProtobufRuntimeVersion\(\s*_runtime_version\.Domain\.PUBLIC,\s*(\d+),\s*(\d+),\s*(\d+),"
    )
    for f in API.rglob("*_pb2.py"):
        m = pattern.search(f.read_text())
        assert m, f"{f}: no runtime version check"
        found.add(tuple(int(x) for x in m.groups()))
    return found


def test_protobuf_lower_bound_covers_every_stub() -> None:
    needed = max(_stub_protobuf_versions())
    assert _lower_bound("protobuf") >= needed, (
        f"pyproject admits protobuf {_lower_bound('protobuf')}, the stubs need {needed}"
    )


def test_grpcio_lower_bound_covers_every_stub() -> None:
    versions = set()
    for f in API.rglob("*_pb2_grpc.py"):
        m = re.search(r"GRPC_GENERATED_VERSION = '([0-9.]+)'", f.read_text())
        assert m, f"{f}: no generated version"
        versions.add(tuple(int(x) for x in m.group(1).split(".")))
    assert _lower_bound("grpcio") >= max(versions)


def test_the_check_can_fail() -> None:
    """The comparison tells a too-low bound apart (the bound this file was written for)."""
    assert max(_stub_protobuf_versions()) > (6, 31)


def test_every_package_ships_its_annotations() -> None:
    """PEP 561: a router that embeds router_client (or any package) type-checks
    against it only when the wheel carries py.typed."""
    data = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    for pkg in ("kvmesh", "indexer", "router_client", "tee", "xfer", "lab"):
        assert (ROOT / pkg / "py.typed").is_file(), pkg
        assert "py.typed" in data["package-data"].get(pkg, []), pkg
