"""Content-addressed block keys: the one implementation of docs/spec/block-keys.md.

A prompt is cut into blocks of ``block_size`` tokens; block ``i`` gets the key
``k_i = XXH3_64(LE64(k_{i-1}) || LE32(t_0) || ... || LE32(t_{B-1}) || E_i)`` where
``k_{-1}`` is the namespace seed ``XXH3_64(UTF8(model) || 0x00 || UTF8(lora))``
and ``E_i`` the block's *extra keys* (empty for a plain text block, so such
keys are those of version 1): what the engine mixed into the block's hash
besides its tokens, encoded by :func:`encode_extras` — the request's
``cache_salt`` (on block 0 only, as vLLM does: it scopes the whole chain) and
``(identifier, offset)`` of each multimodal item the block overlaps.
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
#: 2: extra keys (salt, multimodal items) appended to a block's bytes; a
#: block without any keeps its version-1 key.
BLOCK_KEY_VERSION = 2

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
    if type(token_ids) is array and token_ids.typecode == "I":
        # Already checked and converted (indexer.logic.token_array): no copy per id.
        arr = token_ids if _LITTLE else array("I", token_ids)
        if not _LITTLE:  # pragma: no cover - big-endian hosts
            arr.byteswap()
        return arr.tobytes()
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


#: Tags of the extra-key items in :func:`encode_extras`.
_SALT, _MEDIA, _OTHER = b"\x01", b"\x02", b"\x03"


def _item(tag: bytes, data: bytes) -> bytes:
    return tag + len(data).to_bytes(4, "little") + data


def encode_extras(
    salt: str = "", media: Sequence[tuple[str, int]] = (), other: Sequence[bytes] = ()
) -> bytes:
    """``E_i`` of one block: its salt, its multimodal items, then opaque extras.

    Each item is ``tag || LE32(length) || data``: salt ``0x01`` + UTF-8;
    a multimodal item ``0x02`` + UTF-8 identifier followed by ``LE64`` of its
    offset (two's complement; the item's first token relative to the block's
    first, negative when the item began in an earlier block); anything else
    ``0x03`` + its bytes. Empty for a block with none (the version-1 key).
    """
    out = b""
    if salt:
        out += _item(_SALT, salt.encode("utf-8"))
    for ident, offset in media:
        out += _item(_MEDIA, ident.encode("utf-8") + (offset & KEY_MASK).to_bytes(8, "little"))
    for o in other:
        out += _item(_OTHER, bytes(o))
    return out


def prompt_extras(
    n_blocks: int,
    block_size: int,
    cache_salt: str = "",
    media: Sequence[tuple[str, int, int]] = (),
) -> list[bytes] | None:
    """``E_i`` of each of a prompt's first ``n_blocks`` blocks, as the engine scopes them.

    ``media``: ``(identifier, offset, length)`` of each multimodal item, by
    the position of its placeholder tokens in the prompt. The salt enters
    block 0; an item enters every block its tokens overlap, with its offset
    relative to that block. None when no block has any (plain text).
    """
    if not cache_salt and not media:
        return None
    out: list[bytes] = []
    for i in range(n_blocks):
        start, end = i * block_size, (i + 1) * block_size
        items = [
            (ident, off - start)
            for ident, off, length in media
            if off < end and start < off + length
        ]
        out.append(encode_extras(cache_salt if i == 0 else "", items))
    return out


def chain_keys(
    parent_key: int,
    token_ids: Sequence[int],
    block_size: int,
    extras: Sequence[bytes] | None = None,
) -> list[int]:
    """Keys of the full blocks of ``token_ids``, chained after ``parent_key``.

    ``parent_key`` is the namespace seed for a chain that starts a prompt, or
    the key of the block just before ``token_ids[0]``. ``extras``: ``E_i`` of
    each block (:func:`encode_extras`); missing entries are empty. A trailing
    partial block is ignored. Raises :class:`TokenIdError` for an id outside
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
    if extras:
        for i in range(n_blocks):
            e = extras[i] if i < len(extras) else b""
            key = _xxh3(key.to_bytes(8, "little") + data[i * step : (i + 1) * step] + e)
            keys.append(key)
        return keys
    for off in range(0, n_blocks * step, step):
        key = _xxh3(key.to_bytes(8, "little") + data[off : off + step])
        keys.append(key)
    return keys


def block_keys(
    token_ids: Sequence[int],
    block_size: int,
    model: str,
    lora_name: str = "",
    *,
    cache_salt: str = "",
    media: Sequence[tuple[str, int, int]] = (),
) -> list[int]:
    """Keys of the full blocks of a prompt that starts at token 0.

    ``cache_salt`` and ``media`` (``(identifier, offset, length)`` per
    multimodal item) as the request gives them to the engine.
    """
    if block_size < 1:
        raise ValueError(f"block_size must be >= 1, got {block_size}")
    extras = prompt_extras(len(token_ids) // block_size, block_size, cache_salt, media)
    return chain_keys(namespace_seed(model, lora_name), token_ids, block_size, extras)


def to_signed(key: int) -> int:
    """Map an unsigned key to the signed 64-bit int with the same bits."""
    return key - (1 << 64) if key >= 1 << 63 else key


def to_unsigned(key: int) -> int:
    """Map a signed 64-bit int (e.g. an ``sfixed64`` wire value) to its key."""
    return key & KEY_MASK
