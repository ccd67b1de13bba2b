"""Fixtures of the security tests: the test PKI (see pki.py)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.security.pki import Pki, make_pki


@pytest.fixture(scope="session")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Pki:
    """The fleet CA, identities, rogue CA and policy file, once per session."""
    return make_pki(Path(tmp_path_factory.mktemp("pki")))
