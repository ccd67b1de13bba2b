"""Test PKI: a fleet CA with one certificate per identity, a rogue CA, and a policy file.

Identities (SANs are SPIFFE URIs, as a mesh would issue them):

- ``server``: every kvmesh server (localhost, 127.0.0.1);
- ``engine-a`` / ``engine-b``: engines owning instances ``engine-a*`` / ``engine-b*``;
- ``router-a`` / ``router-b``: routers;
- ``admin``: operators;
- ``tee``: the request tee (sends to the cache simulator);
- ``prefill`` / ``decode``: xfer sidecars (role ``peer``);
- ``stranger``: signed by the fleet CA but absent from the policy.

``rogue/`` holds a second CA and a ``router-a`` certificate it signed: same
SAN, wrong issuer. ``ADMIN_TOKEN`` / ``ROUTER_TOKEN`` are bearer tokens the
policy lists by hash.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import yaml

from kvmesh.auth import token_sha256
from lab.devcerts import Authority, write_bundle

ADMIN_TOKEN = "admin-token-5c1f0b9e"
ROUTER_TOKEN = "router-token-77d2aa41"

IDENTITIES: dict[str, list[str]] = {
    "server": ["localhost", "127.0.0.1", "spiffe://kvmesh/server"],
    "engine-a": ["spiffe://kvmesh/engine/engine-a"],
    "engine-b": ["spiffe://kvmesh/engine/engine-b"],
    "router-a": ["spiffe://kvmesh/router/router-a"],
    "router-b": ["spiffe://kvmesh/router/router-b"],
    "admin": ["spiffe://kvmesh/admin/ops"],
    "tee": ["spiffe://kvmesh/tee/tee-0"],
    "prefill": ["spiffe://kvmesh/xfer/prefill-0", "localhost", "127.0.0.1"],
    "decode": ["spiffe://kvmesh/xfer/decode-0", "localhost", "127.0.0.1"],
    "stranger": ["spiffe://kvmesh/stranger/x"],
}

POLICY = {
    "identities": [
        {
            "name": "engine-a",
            "roles": ["engine"],
            "san": ["spiffe://kvmesh/engine/engine-a"],
            "instances": ["engine-a*"],
        },
        {
            "name": "engine-b",
            "roles": ["engine"],
            "san": ["spiffe://kvmesh/engine/engine-b"],
            "instances": ["engine-b*"],
        },
        {"name": "router-a", "roles": ["router"], "san": ["spiffe://kvmesh/router/router-a"]},
        {"name": "router-b", "roles": ["router"], "san": ["spiffe://kvmesh/router/router-b"]},
        {"name": "admin", "roles": ["admin"], "san": ["spiffe://kvmesh/admin/*"]},
        {"name": "tee", "roles": ["tee"], "san": ["spiffe://kvmesh/tee/*"]},
        {"name": "xfer-peers", "roles": ["peer"], "san": ["spiffe://kvmesh/xfer/*"]},
        {"name": "ops-token", "roles": ["admin"], "token_sha256": [token_sha256(ADMIN_TOKEN)]},
        {
            "name": "router-token",
            "roles": ["router"],
            "token_sha256": [token_sha256(ROUTER_TOKEN)],
        },
    ]
}


@dataclass
class Pki:
    """Paths of the test PKI."""

    root: Path

    @property
    def ca(self) -> str:
        return str(self.root / "ca.crt")

    def cert(self, name: str) -> str:
        return str(self.root / f"{name}.crt")

    def key(self, name: str) -> str:
        return str(self.root / f"{name}.key")

    @property
    def policy(self) -> str:
        return str(self.root / "policy.yaml")

    @property
    def rogue_ca(self) -> str:
        return str(self.root / "rogue" / "ca.crt")

    def rogue_cert(self, name: str = "router-a") -> str:
        return str(self.root / "rogue" / f"{name}.crt")

    def rogue_key(self, name: str = "router-a") -> str:
        return str(self.root / "rogue" / f"{name}.key")

    def server_tls(self, *, mutual: bool = True) -> dict[str, str]:
        """A server's ``tls`` config section."""
        out = {"cert_file": self.cert("server"), "key_file": self.key("server")}
        if mutual:
            out["client_ca_file"] = self.ca
        return out

    def client_tls(self, name: str | None) -> dict[str, str]:
        """A client's ``tls`` section presenting ``name``'s certificate (None: none)."""
        out = {"ca_file": self.ca}
        if name is not None:
            out["cert_file"] = self.cert(name)
            out["key_file"] = self.key(name)
        return out

    def token_file(self, token: str) -> str:
        path = self.root / f"token-{token_sha256(token)[:8]}"
        path.write_text(token + "\n")
        return str(path)


def make_pki(root: Path) -> Pki:
    """Write the fleet CA, every identity, the rogue CA and the policy under ``root``."""
    write_bundle(root, IDENTITIES, authority=Authority("kvmesh test fleet CA"))
    write_bundle(
        root / "rogue",
        {"router-a": IDENTITIES["router-a"], "server": IDENTITIES["server"]},
        authority=Authority("rogue CA"),
    )
    (root / "policy.yaml").write_text(yaml.safe_dump(POLICY))
    return Pki(root)
