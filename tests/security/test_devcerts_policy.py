"""``kvmesh certs`` writes a least-privilege policy: each engine owns its own worker id only."""

from __future__ import annotations

from pathlib import Path

import yaml

from kvmesh.auth import PolicyFile, Principal, _principal
from lab.devcerts import main as certs_main


def _principals(out: Path) -> dict[str, Principal]:
    policy = PolicyFile.model_validate(yaml.safe_load((out / "policy.yaml").read_text()))
    return {rule.name: _principal(rule, "mtls") for rule in policy.identities}


def test_each_engine_identity_owns_exactly_its_own_worker(tmp_path: Path) -> None:
    out = tmp_path / "certs"
    assert (
        certs_main(
            [
                "--out",
                str(out),
                "--identity",
                "engine-0=spiffe://kvmesh/engine/engine-0",
                "--identity",
                "engine-1=spiffe://kvmesh/engine/engine-1",
                "--identity",
                "router=spiffe://kvmesh/router/router-0",
            ]
        )
        == 0
    )
    p = _principals(out)
    e0, e1 = p["engine-0"], p["engine-1"]
    assert e0.instances == ("engine-0",) and e1.instances == ("engine-1",)
    assert e1.owns("m", "engine-1")
    # Neither for another engine, nor for names that merely start like its own.
    for worker in ("engine-0", "engine-01", "engine-10", "engine-1x"):
        assert not e1.owns("m", worker), worker
    assert not e0.owns("m", "engine-01")


def test_the_default_engine_owns_its_worker_only(tmp_path: Path) -> None:
    out = tmp_path / "certs"
    assert certs_main(["--out", str(out)]) == 0
    engine = _principals(out)["engine"]
    assert engine.instances == ("engine-0",)
    assert not engine.owns("m", "engine-00")
