"""Content-addressed block keys: the one implementation of docs/spec/block-keys.md.

A prompt is cut into blocks of ``block_size`` tokens; block ``i`` gets the key
``k_i = XXH3_64(LE64(k_{i-1}) || LE32(t_0) || ... || LE32(t_{B-1}))`` where
``k_{-1}`` is the namespace seed ``XXH3_64(UTF8(model) || 0x00 || UTF8(lora))``.
The partial last block has no key. Keys are unsigned 64-bit integers.

Both the indexer and router_client import this module, so keys computed by a
router and keys derived by the indexer from engine events agree bit for bit.
"""

from __future__ import annotations

import sys
from array import array
from collections.abc import Sequence

import xxhash

#: Version of the key derivation. Bumped on any change to the byte layout.
BLOCK_KEY_VERSION = 1

TOKEN_ID_LIMIT = 1 << 32
KEY_MASK = (1 << 64) - 1

_xxh3 = xxhash.xxh3_64_intdigest
_LITTLE = sys.byteorder == "little"


class TokenIdError(ValueError):
    """A token id outside [0, 2^32); ``index`` is its position in the input."""

    def __init__(self, index: int, value: int) -> None:
        super().__init__(f"token id {value} at index {index} is outside [0, 2^32)")
        self.index = index
        self.value = value


def namespace_seed(model: str, lora_name: str = "") -> int:
    """Return the seed (``k_{-1}``) of the namespace ``(model, lora_name)``."""
    return _xxh3(model.encode("utf-8") + b"\x00" + lora_name.encode("utf-8"))


def _token_bytes(token_ids: Sequence[int]) -> bytes:
    try:
        arr = array("I", token_ids)
    except (OverflowError, TypeError):
        for i, t in enumerate(token_ids):
            if not isinstance(t, int) or t < 0 or t >= TOKEN_ID_LIMIT:
                raise TokenIdError(i, t) from None
        raise
    if arr.itemsize != 4:  # pragma: no cover - no such platform in practice
        raise RuntimeError("array('I') is not 32-bit here")
    if not _LITTLE:  # pragma: no cover - big-endian hosts
        arr.byteswap()
    return arr.tobytes()


def chain_keys(parent_key: int, token_ids: Sequence[int], block_size: int) -> list[int]:
    """Keys of the full blocks of ``token_ids``, chained after ``parent_key``.

    ``parent_key`` is the namespace seed for a chain that starts a prompt, or
    the key of the block just before ``token_ids[0]``. A trailing partial
    block is ignored. Raises :class:`TokenIdError` for an id outside
    [0, 2^32) and ``ValueError`` for a block size below 1.
    """
    if block_size < 1:
        raise ValueError(f"block_size must be >= 1, got {block_size}")
    n_blocks = len(token_ids) // block_size
    if n_blocks == 0:
        return []
    data = _token_bytes(token_ids[: n_blocks * block_size])
    step = 4 * block_size
    keys: list[int] = []
    key = parent_key & KEY_MASK
    for off in range(0, n_blocks * step, step):
        key = _xxh3(key.to_bytes(8, "little") + data[off : off + step])
        keys.append(key)
    return keys


def block_keys(
    token_ids: Sequence[int], block_size: int, model: str, lora_name: str = ""
) -> list[int]:
    """Keys of the full blocks of a prompt that starts at token 0."""
    return chain_keys(namespace_seed(model, lora_name), token_ids, block_size)


def to_signed(key: int) -> int:
    """Map an unsigned key to the signed 64-bit int with the same bits."""
    return key - (1 << 64) if key >= 1 << 63 else key


def to_unsigned(key: int) -> int:
    """Map a signed 64-bit int (e.g. an ``sfixed64`` wire value) to its key."""
    return key & KEY_MASK
