"""vLLM's own block hashes of a prompt, computed from its tokens.

An engine that hashes in units finer than its blocks (vLLM ``hash_block_size``
under a Mamba group in ``align`` mode) publishes a prompt's tail as a
partial-block entry whose parent is the previous unit's hash. When that unit
is not the block's first, no event ever carried its tokens, so the entry
cannot be keyed from tokens (indexer/groups.py, ``partial_unplaced``). Its
engine hash can still be reached from the other side: vLLM's hash of a prefix
is a public function of its tokens, so a Match computes the prompt's engine
hashes and looks the entry up by them.

vLLM 0.33 (``vllm/v1/core/kv_cache_utils.py``, ``hash_block_tokens``) hashes
unit ``i`` as ``H((parent, tuple(tokens of unit i), extra_keys))``, the parent
of unit 0 being ``NONE_HASH = H(seed)``, where

- ``H`` is ``prefix_caching_hash_algo``: ``sha256`` (the default: SHA-256 of
  the pickle, protocol 5) or ``sha256_cbor`` (SHA-256 of canonical CBOR). The
  ``xxhash`` algorithms take a random seed per process unless
  ``PYTHONHASHSEED`` is set, and are not computed here;
- ``seed`` is ``PYTHONHASHSEED`` when the engine has it, else
  ``"vllm-none-hash"`` (the default this module assumes; an operator whose
  engines set it names it in ``groups.vllm_hash_seeds``);
- ``extra_keys`` is None or the tuple of the unit's LoRA key
  ``("lora", name, path)``, its multimodal items ``("mm", identifier,
  offset in the unit)`` and, on unit 0, ``("cache_salt", salt)``. The
  adapter's path is not in a Match, so a LoRA prompt is not computed.

Events carry the low 64 bits of each hash (vLLM's default
``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES``; indexer/kvevents/decode.py takes the
same bits of a hash sent as bytes), and so does :meth:`EngineHasher.units`.
Which algorithm and seed an engine uses is never assumed: the tracker takes
a hasher only once it reproduced a hash the instance itself published for the
same prompt (indexer/groups.py), so a wrong guess finds nothing (the hit
stays what the events key: under, never over).
"""

from __future__ import annotations

import hashlib
import pickle
import struct
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

#: vLLM's seed of ``NONE_HASH`` without ``PYTHONHASHSEED``.
DEFAULT_SEED = "vllm-none-hash"
#: ``prefix_caching_hash_algo`` values computed here.
ALGORITHMS = ("sha256", "sha256_cbor")
_LOW64 = (1 << 64) - 1


def _cbor_head(major: int, n: int) -> bytes:
    if n < 24:
        return bytes([major << 5 | n])
    if n < 1 << 8:
        return bytes([major << 5 | 24, n])
    if n < 1 << 16:
        return bytes([major << 5 | 25]) + struct.pack(">H", n)
    if n < 1 << 32:
        return bytes([major << 5 | 26]) + struct.pack(">I", n)
    return bytes([major << 5 | 27]) + struct.pack(">Q", n)


_UINT = tuple(bytes([n]) for n in range(24))
_U8, _U16, _U32 = struct.Struct(">BB"), struct.Struct(">BH"), struct.Struct(">BI")


def _uint32(n: int) -> bytes:
    if n < 1 << 8:
        return _U8.pack(24, n)
    if n < 1 << 16:
        return _U16.pack(25, n)
    return _U32.pack(26, n)


def cbor(value: Any) -> bytes:
    """Canonical CBOR (RFC 8949 §4.2: shortest heads) of what a block hash holds:
    None, ints below 2^64 in magnitude, bytes, str and tuples of them."""
    if value is None:
        return b"\xf6"
    if isinstance(value, bool):
        return b"\xf5" if value else b"\xf4"
    if isinstance(value, int):
        return _cbor_head(0, value) if value >= 0 else _cbor_head(1, -1 - value)
    if isinstance(value, bytes):
        return _cbor_head(2, len(value)) + value
    if isinstance(value, str):
        raw = value.encode("utf-8")
        return _cbor_head(3, len(raw)) + raw
    if isinstance(value, tuple | list):
        head = _cbor_head(4, len(value))
        if all(type(v) is int and 0 <= v < 1 << 32 for v in value):  # token ids
            return head + b"".join(_UINT[v] if v < 24 else _uint32(v) for v in value)
        return head + b"".join(cbor(v) for v in value)
    raise TypeError(f"no CBOR encoding here for {type(value).__name__}")


def _sha256_pickle(value: Any) -> bytes:
    return hashlib.sha256(pickle.dumps(value, protocol=5)).digest()


def _sha256_cbor(value: Any) -> bytes:
    return hashlib.sha256(cbor(value)).digest()


_FUNCTIONS = {"sha256": _sha256_pickle, "sha256_cbor": _sha256_cbor}


@dataclass(frozen=True, slots=True)
class EngineHasher:
    """One way an engine may hash: its algorithm and ``NONE_HASH`` seed."""

    algorithm: str = "sha256"
    seed: str = DEFAULT_SEED

    def __post_init__(self) -> None:
        if self.algorithm not in _FUNCTIONS:
            raise ValueError(f"unknown algorithm {self.algorithm!r}; one of {ALGORITHMS}")

    @property
    def none_hash(self) -> bytes:
        return _none_hash(self.algorithm, self.seed)

    def units(
        self,
        tokens: Sequence[int],
        unit: int,
        count: int,
        extras: Sequence[tuple[Any, ...] | None] | None = None,
        start: tuple[int, bytes] | None = None,
    ) -> tuple[list[int], list[bytes]]:
        """The engine hashes of the prompt's first ``count`` units of ``unit`` tokens:
        (low 64 bits of each, the full hashes). ``extras``: each unit's ``extra_keys``
        (None: none). ``start``: (units already hashed, the hash of the last of them)
        to go on from, e.g. a remembered prefix.
        """
        fn = _FUNCTIONS[self.algorithm]
        first, parent = start if start is not None else (0, self.none_hash)
        low: list[int] = []
        full: list[bytes] = []
        for i in range(first, count):
            ex = extras[i] if extras is not None and i < len(extras) else None
            parent = fn((parent, tuple(tokens[i * unit : (i + 1) * unit]), ex))
            full.append(parent)
            low.append(int.from_bytes(parent, "big") & _LOW64)
        return low, full


_NONE: dict[tuple[str, str], bytes] = {}


def _none_hash(algorithm: str, seed: str) -> bytes:
    got = _NONE.get((algorithm, seed))
    if got is None:
        got = _NONE[(algorithm, seed)] = _FUNCTIONS[algorithm](seed)
    return got


def candidates(seeds: Sequence[str] = ()) -> tuple[EngineHasher, ...]:
    """The hashers to try for an engine: every algorithm with the default seed and
    with each of ``seeds`` (the engines' ``PYTHONHASHSEED`` values an operator gave)."""
    out = [EngineHasher(a, DEFAULT_SEED) for a in ALGORITHMS]
    out += [EngineHasher(a, s) for s in seeds if s != DEFAULT_SEED for a in ALGORITHMS]
    return tuple(out)


def unit_extras(
    n_units: int,
    unit: int,
    cache_salt: str = "",
    media: Sequence[tuple[str, int, int]] = (),
) -> list[tuple[Any, ...] | None] | None:
    """vLLM's ``extra_keys`` of each of a prompt's first ``n_units`` units (no LoRA):
    its multimodal items ``("mm", identifier, offset - unit start)`` in the order
    given (vLLM's: by position), then the salt on unit 0. None for plain text."""
    if not cache_salt and not media:
        return None
    out: list[tuple[Any, ...] | None] = []
    for i in range(n_units):
        start, end = i * unit, (i + 1) * unit
        keys: list[Any] = [
            ("mm", ident, off - start)
            for ident, off, length in media
            if off < end and start < off + length
        ]
        if i == 0 and cache_salt:
            keys.append(("cache_salt", cache_salt))
        out.append(tuple(keys) if keys else None)
    return out
