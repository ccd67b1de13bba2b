"""A small X.509 authority for development, tests and first installs.

``kvmesh certs`` writes a CA and one certificate per identity into a folder,
in the layout every kvmesh service and the Helm chart read (``ca.crt``,
``<name>.crt``, ``<name>.key``). Production fleets bring certificates from
their own issuer (cert-manager, SPIFFE/SPIRE, Vault); nothing in kvmesh
depends on this module but the tests and the command.

A SAN entry is a URI when it contains ``://`` (``spiffe://fleet/engine/a``),
an IP address when it parses as one, otherwise a DNS name. Keys are ECDSA
P-256, certificates are valid for ``days`` (default 365) from an hour ago.
"""

from __future__ import annotations

import datetime as _dt
import glob
import ipaddress
import os
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from kvmesh.tls import ClientTLS

__all__ = [
    "Authority",
    "DevIdentity",
    "DevPki",
    "Issued",
    "default_identities",
    "policy_for",
    "san_entry",
    "worker_of",
    "write_bundle",
]


@dataclass(frozen=True)
class Issued:
    """A certificate and its private key, PEM-encoded."""

    cert_pem: bytes
    key_pem: bytes


def san_entry(value: str) -> x509.GeneralName:
    """The SAN general name ``value`` denotes (URI, IP address or DNS name)."""
    if "://" in value:
        return x509.UniformResourceIdentifier(value)
    try:
        return x509.IPAddress(ipaddress.ip_address(value))
    except ValueError:
        return x509.DNSName(value)


def _key_pem(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption(),
    )


class Authority:
    """A self-signed CA that issues leaf certificates (server and client use)."""

    def __init__(self, common_name: str = "kvmesh dev CA", *, days: int = 3650) -> None:
        self._key = ec.generate_private_key(ec.SECP256R1())
        now = _dt.datetime.now(_dt.UTC)
        name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)])
        self._name = name
        self.cert = (
            x509.CertificateBuilder()
            .subject_name(name)
            .issuer_name(name)
            .public_key(self._key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - _dt.timedelta(hours=1))
            .not_valid_after(now + _dt.timedelta(days=days))
            .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
            .add_extension(
                x509.KeyUsage(
                    digital_signature=True,
                    content_commitment=False,
                    key_encipherment=False,
                    data_encipherment=False,
                    key_agreement=False,
                    key_cert_sign=True,
                    crl_sign=True,
                    encipher_only=False,
                    decipher_only=False,
                ),
                critical=True,
            )
            .add_extension(
                x509.SubjectKeyIdentifier.from_public_key(self._key.public_key()), critical=False
            )
            .sign(self._key, hashes.SHA256())
        )

    @property
    def cert_pem(self) -> bytes:
        """The CA certificate (what peers trust)."""
        return self.cert.public_bytes(serialization.Encoding.PEM)

    @property
    def key_pem(self) -> bytes:
        """The CA's private key."""
        return _key_pem(self._key)

    def issue(
        self,
        common_name: str,
        sans: Sequence[str] = (),
        *,
        days: int = 365,
        not_before: _dt.datetime | None = None,
    ) -> Issued:
        """A leaf certificate for ``common_name`` with ``sans`` (server and client auth)."""
        key = ec.generate_private_key(ec.SECP256R1())
        now = _dt.datetime.now(_dt.UTC)
        start = not_before if not_before is not None else now - _dt.timedelta(hours=1)
        builder = (
            x509.CertificateBuilder()
            .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)]))
            .issuer_name(self._name)
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(start)
            .not_valid_after(start + _dt.timedelta(days=days))
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(
                x509.ExtendedKeyUsage(
                    [ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]
                ),
                critical=False,
            )
            .add_extension(
                x509.AuthorityKeyIdentifier.from_issuer_public_key(self._key.public_key()),
                critical=False,
            )
        )
        if sans:
            builder = builder.add_extension(
                x509.SubjectAlternativeName([san_entry(s) for s in sans]), critical=False
            )
        cert = builder.sign(self._key, hashes.SHA256())
        return Issued(cert.public_bytes(serialization.Encoding.PEM), _key_pem(key))


def default_identities() -> dict[str, list[str]]:
    """The identities ``kvmesh certs`` issues by default (name -> SANs).

    ``server`` covers every kvmesh service on this host and the chart's
    service names; the others are the client roles of the example policy.
    """
    return {
        "server": [
            "localhost",
            "127.0.0.1",
            "::1",
            "*.kvmesh.svc",
            "*.kvmesh.svc.cluster.local",
            "spiffe://kvmesh/server",
        ],
        "engine": ["spiffe://kvmesh/engine/engine-0"],
        "router": ["spiffe://kvmesh/router/router-0"],
        "admin": ["spiffe://kvmesh/admin/ops"],
        "tee": ["spiffe://kvmesh/tee/tee-0"],
    }


def _write(path: Path, data: bytes, *, private: bool) -> None:
    path.write_bytes(data)
    if private:
        os.chmod(path, 0o600)


def write_bundle(
    out_dir: str | os.PathLike[str],
    identities: Mapping[str, Iterable[str]] | None = None,
    *,
    authority: Authority | None = None,
    days: int = 365,
) -> dict[str, Path]:
    """Write ``ca.crt`` (and ``ca.key``) and ``<name>.crt`` / ``<name>.key`` per identity.

    Returns the written paths by name (``ca``, ``ca_key``, ``<name>``,
    ``<name>_key``). Private keys are written with mode 0600.
    """
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    ca = authority or Authority()
    paths: dict[str, Path] = {"ca": out / "ca.crt", "ca_key": out / "ca.key"}
    _write(paths["ca"], ca.cert_pem, private=False)
    _write(paths["ca_key"], ca.key_pem, private=True)
    for name, sans in (identities if identities is not None else default_identities()).items():
        issued = ca.issue(name, list(sans), days=days)
        paths[name] = out / f"{name}.crt"
        paths[f"{name}_key"] = out / f"{name}.key"
        _write(paths[name], issued.cert_pem, private=False)
        _write(paths[f"{name}_key"], issued.key_pem, private=True)
    return paths


@dataclass(frozen=True)
class DevIdentity:
    """An identity of a :class:`DevPki`: its SANs, roles and (engines) instances."""

    sans: tuple[str, ...]
    #: Policy roles; none: a certificate only (a server's, say), not in the policy.
    roles: tuple[str, ...] = ()
    instances: tuple[str, ...] = ("*",)


def worker_of(name: str, sans: Sequence[str]) -> str:
    """The one worker id an engine identity may act for: the last path segment
    of its URI SAN (``spiffe://kvmesh/engine/<worker id>``), else its name."""
    for san in sans:
        if "://" in san:
            tail = san.rstrip("/").rsplit("/", 1)[-1]
            if tail and "://" not in tail:
                return tail
    return name


def policy_for(identities: Mapping[str, DevIdentity]) -> dict[str, object]:
    """The policy granting each identity with roles those roles, matched on its URI SANs
    (or all its SANs when it has no URI)."""
    out = []
    for name, ident in identities.items():
        if not ident.roles:
            continue
        uris = [s for s in ident.sans if "://" in s]
        entry: dict[str, object] = {
            "name": name,
            "roles": list(ident.roles),
            "san": uris or list(ident.sans),
        }
        if "engine" in ident.roles:
            entry["instances"] = list(ident.instances)
        out.append(entry)
    return {"identities": out}


class DevPki:
    """A development CA, a certificate per identity and the policy of their roles, on disk.

    Used by ``kvmesh certs``, ``kvmesh up --tls`` and ``kvmesh bench indexer
    --tls``: ``root`` gets ``ca.crt``, ``<name>.crt`` / ``<name>.key`` and
    ``policy.yaml``.
    """

    def __init__(
        self,
        root: str | os.PathLike[str],
        identities: Mapping[str, DevIdentity],
        *,
        ca_name: str = "kvmesh dev CA",
        days: int = 365,
    ) -> None:
        import yaml

        self.root = Path(root)
        self.paths = write_bundle(
            self.root,
            {name: list(i.sans) for name, i in identities.items()},
            authority=Authority(ca_name),
            days=days,
        )
        self.policy_file = self.root / "policy.yaml"
        self.policy_file.write_text(yaml.safe_dump(policy_for(identities), sort_keys=False))

    @property
    def ca(self) -> str:
        """The CA certificate every side trusts."""
        return str(self.paths["ca"])

    def cert(self, name: str) -> str:
        """``name``'s certificate file."""
        return str(self.paths[name])

    def key(self, name: str) -> str:
        """``name``'s private key file."""
        return str(self.paths[f"{name}_key"])

    def server_tls(self, name: str = "server") -> dict[str, str]:
        """A server's ``tls`` section: ``name``'s certificate, client certificates required."""
        return {"cert_file": self.cert(name), "key_file": self.key(name), "client_ca_file": self.ca}

    def client(self, name: str) -> ClientTLS:
        """The client TLS presenting ``name``'s certificate."""
        return ClientTLS(ca_file=self.ca, cert_file=self.cert(name), key_file=self.key(name))


#: Roles of ``kvmesh certs``' default identities, by name prefix.
_DEFAULT_ROLES = {"engine": "engine", "router": "router", "admin": "admin", "tee": "tee"}


def main(argv: Sequence[str] | None = None) -> int:
    """``kvmesh certs``: write a development CA, certificates and an example policy."""
    import argparse

    from kvmesh.clihelp import HelpFormatter

    p = argparse.ArgumentParser(
        prog="kvmesh certs",
        description="Write a development CA, one certificate per identity (server and client "
        "use, SANs as given) and an example policy.yaml. For development and first installs; "
        "production certificates come from your own issuer.",
        formatter_class=HelpFormatter,
    )
    p.add_argument("--out", default="kvmesh-certs", help="output folder")
    p.add_argument(
        "--identity",
        action="append",
        metavar="NAME=SAN[,SAN...]",
        help="an identity and its SANs (repeatable; default: server, engine, router, admin, tee)",
    )
    p.add_argument(
        "--days", type=int, default=365, help="validity of the leaf certificates, in days"
    )
    args = p.parse_args(argv)
    identities: dict[str, list[str]] = {}
    for spec in args.identity or []:
        name, sep, sans = spec.partition("=")
        if not sep or not name or not sans:
            p.error(f"--identity {spec!r}: expected NAME=SAN[,SAN...]")
        identities[name] = [s.strip() for s in sans.split(",") if s.strip()]
    identities = identities or default_identities()
    pki = DevPki(
        args.out,
        {
            name: DevIdentity(
                tuple(sans),
                tuple(r for prefix, r in _DEFAULT_ROLES.items() if name.startswith(prefix))[:1],
                instances=(glob.escape(worker_of(name, sans)),),
            )
            for name, sans in identities.items()
        },
        days=args.days,
    )
    for name in ("ca", *identities):
        print(f"{name:10s} {pki.paths[name]}")
    print(f"{'policy':10s} {pki.policy_file}")
    return 0
