"""Protobuf wire pieces the hot paths write by hand (replies and stream items)."""

from __future__ import annotations

__all__ = ["take", "varint"]

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


def take(entries: list[bytes], max_count: int, max_bytes: int) -> bytes:
    """The first ``entries`` joined, removed from the list: up to ``max_count`` of
    them, or up to the one that reaches ``max_bytes`` (a message of repeated
    fields written entry by entry)."""
    count = size = 0
    for entry in entries:
        count += 1
        size += len(entry)
        if count >= max_count or size >= max_bytes:
            break
    if count == len(entries):
        out = b"".join(entries)
        entries.clear()
    else:
        out = b"".join(entries[:count])
        del entries[:count]
    return out
