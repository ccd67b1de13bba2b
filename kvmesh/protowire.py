"""Protobuf wire pieces the hot paths write by hand (replies and stream items)."""

from __future__ import annotations

__all__ = ["varint"]

_SMALL = tuple(bytes((i,)) for i in range(0x80))


def varint(value: int) -> bytes:
    """Protobuf base-128 varint of a non-negative int."""
    if value < 0x80:
        return _SMALL[value]
    out = bytearray()
    while value > 0x7F:
        out.append((value & 0x7F) | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)
