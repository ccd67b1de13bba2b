"""The Node.js client (clients/node) over TLS against real indexers with an authorization policy.

Two indexers with the test PKI and policy: one requiring client certificates
(mutual TLS), one where a certificate is optional (bearer tokens). ``node
--test`` then runs every client test: the indexer suite over mutual TLS as
``admin`` (the only role that may call all it calls), and test/tls.test.js:
Match as ``router-a``, no certificate → UNAVAILABLE, ``engine-a`` publishing
for its own instance and refused (PERMISSION_DENIED) for ``engine-b``'s, the
router token → Match, a wrong token → UNAUTHENTICATED, the server-name override,
certificate files re-read for new connections. A third indexer (mutual TLS, a
per-client Match rate) answers test/status.test.js's retry delay.
"""

from __future__ import annotations

from tests.integration.test_node_client import (
    LIMITED,
    install_node_client,
    passed,
    run_node_tests,
    serve_indexer,
)
from tests.security.pki import ROUTER_TOKEN, Pki

TLS_TESTS = [
    "tls: the router certificate may Match over mutual TLS",
    "tls: without a client certificate the call fails UNAVAILABLE",
    "tls: an engine publishes for its own instances only",
    "tls: a bearer token over TLS (client certificate optional)",
    "tls: serverName overrides the name the server certificate is checked against",
    "tls: certificate files watched for rotation (reloadIntervalMs)",
]


def test_node_client_over_mutual_tls_with_a_policy(pki: Pki) -> None:
    client = install_node_client()
    auth = {"policy_file": pki.policy}
    optional_tls = {**pki.server_tls(), "client_auth": "optional"}
    with (
        serve_indexer(tls=pki.server_tls(), auth=auth) as mtls,
        serve_indexer(tls=optional_tls, auth=auth) as optional,
        serve_indexer(tls=pki.server_tls(), auth=auth, **LIMITED) as limited,
    ):
        lines = run_node_tests(
            client,
            {
                "KVMESH_INDEXER_ADDR": mtls,
                "KVMESH_INDEXER_LIMITED_ADDR": limited,
                "KVMESH_CLIENT_CA_FILE": pki.ca,
                "KVMESH_CLIENT_CERT_FILE": pki.cert("admin"),
                "KVMESH_CLIENT_KEY_FILE": pki.key("admin"),
                "KVMESH_TLS_PKI": str(pki.root),
                "KVMESH_TLS_MTLS_ADDR": mtls,
                "KVMESH_TLS_OPTIONAL_ADDR": optional,
                "KVMESH_TLS_ROUTER_TOKEN": ROUTER_TOKEN,
            },
        )
    out = "\n".join(lines)
    assert "# skipped 0" in lines, out
    status_tests = ["status: INVALID_ARGUMENT carries", "status: a rate refusal carries"]
    for name in [*TLS_TESTS, *status_tests, "indexer: register", "INVALID_ARGUMENT names"]:
        assert passed(lines, name), f"{name!r} did not pass:\n{out}"
