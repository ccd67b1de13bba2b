"""vLLM's block hashes computed from tokens (indexer/enginehash.py).

The vectors were computed by vLLM 0.33.0 itself (``hash_block_tokens`` after
``init_none_hash``, in the vLLM virtualenv ``make setup`` creates), 16-token
units of tokens 100.. . The conformance suite (tests/conformance/test_vllm.py,
row ``mamba``) checks the same hashes against a live engine's events.
"""

from __future__ import annotations

import pytest

from indexer.enginehash import EngineHasher, candidates, cbor, unit_extras

TOKENS = tuple(range(100, 164))

#: Units 0..3 with unit 0's extra keys (("mm", "img-1", 3), ("cache_salt", "s")).
MM_SALT = {
    "sha256": [
        "99bed8250876279921a927f016a3db635504228da16ec5b41b87e859280deb73",
        "8a7daa76531fa90d17b3f889db64260d1d279d8ede02f099b452619e06e350eb",
        "3c7454828662cef893bf4371e328129092fea219a5496b1b17ef5a74ee187a4b",
        "a471734dc254c4ec00cd8c316c5b178a86dfcd3d8c3fda0af0126a4d65c9b314",
    ],
    "sha256_cbor": [
        "1ab32c94dabfa4bd4413ee57563e42d7a2a6eaa119a29cff1d82cba7edc0a1da",
        "29fa184ba11d691f6d6671f46f5e876997e958b406e8521c0c4cdaa7c1ba59fa",
        "846361c5dc05a5134de2f8d8c48935c046b03f2add600c17c310153497408e2c",
        "344c56dcdf035995f99bb37b0c8c7086969f5c64b3d43c01c513a89e41a4b0f5",
    ],
}
#: Plain text, sha256: the default seed, and ``PYTHONHASHSEED=123``.
PLAIN = {
    "vllm-none-hash": [
        "605fd9e311c0890137f4c7df65be59449fb378632eecf434d1ecdf87c874fd55",
        "f1a08810157991d5280c49952540afc2feab260cd65a24bb2e94951059393917",
        "dc5a0111b9f2919d4789af4cfceb558c50750d1cc0f56692144e9e182eba6c69",
    ],
    "123": [
        "7154302e1babaedf5a7d800c2d8b32e2dc8b0378db3c1d54a925c02931d09a03",
        "b76b7199a525f589c945ef053b6e2632e786288ce5912a760ee43b90d9cc4a2e",
        "21a64ea7560483dc78b2e100442f77262c3a7484d41b1e8595c1d42fbf73af2a",
    ],
}


@pytest.mark.parametrize("algorithm", ["sha256", "sha256_cbor"])
def test_hashes_with_extra_keys_are_vllms(algorithm: str) -> None:
    extras = unit_extras(4, 16, cache_salt="s", media=[("img-1", 3, 4)])
    assert extras == [(("mm", "img-1", 3), ("cache_salt", "s")), None, None, None]
    low, full = EngineHasher(algorithm).units(TOKENS, 16, 4, extras)
    assert [h.hex() for h in full] == MM_SALT[algorithm]
    assert low == [int(h, 16) & (1 << 64) - 1 for h in MM_SALT[algorithm]]


@pytest.mark.parametrize("seed", ["vllm-none-hash", "123"])
def test_the_seed_is_none_hashs(seed: str) -> None:
    _, full = EngineHasher("sha256", seed).units(TOKENS, 16, 3)
    assert [h.hex() for h in full] == PLAIN[seed]


def test_going_on_from_a_remembered_prefix_gives_the_same_hashes() -> None:
    hasher = EngineHasher()
    low, full = hasher.units(TOKENS, 16, 3)
    more, _ = hasher.units(TOKENS, 16, 3, start=(1, full[0]))
    assert more == low[1:]


def test_an_item_spanning_units_is_an_extra_key_of_each_with_its_offset() -> None:
    extras = unit_extras(3, 16, media=[("a", 10, 20), ("b", 40, 2)])
    assert extras == [(("mm", "a", 10),), (("mm", "a", -6),), (("mm", "b", 8),)]
    assert unit_extras(3, 16) is None


def test_candidates_try_the_default_seed_first_and_every_algorithm() -> None:
    got = candidates(["123", "vllm-none-hash"])
    assert [(h.algorithm, h.seed) for h in got] == [
        ("sha256", "vllm-none-hash"),
        ("sha256_cbor", "vllm-none-hash"),
        ("sha256", "123"),
        ("sha256_cbor", "123"),
    ]
    with pytest.raises(ValueError, match="xxhash"):
        EngineHasher("xxhash")


def test_cbor_heads_are_the_shortest() -> None:
    assert cbor(23) == b"\x17"
    assert cbor(24) == b"\x18\x18"
    assert cbor(256) == b"\x19\x01\x00"
    assert cbor(-1) == b"\x20"
    assert cbor(1 << 32) == b"\x1b\x00\x00\x00\x01\x00\x00\x00\x00"
    assert cbor((None, "a", b"b")) == b"\x83\xf6\x61a\x41b"
