"""Notification tags and run merging: the bytes the two sides agree on.

A tag rides on every transfer (NIXL's notification message, or the TCP
frame's tag) and names what landed: room, generation, chunk and flags. The
generation is the decode side's count of room registrations, so a
notification from an earlier use of a recycled room id never completes the
current one.
"""

from __future__ import annotations

import struct
from collections.abc import Sequence
from dataclasses import dataclass

#: Tag magic and wire version: a notification without it is not ours and is ignored.
TAG_MAGIC = b"kvx1"

#: Magic of a notification that lists several tags.
TAG_MAGIC_MULTI = b"kvxM"

_TAG = struct.Struct("<4sQQIBI")  # magic, room, generation, chunk, flags, n_chunks

#: Flag: this chunk is the room's last one (``n_chunks`` is then meaningful).
FLAG_LAST = 1
#: Flag: the aux slot was written with this chunk.
FLAG_AUX = 2


@dataclass(frozen=True)
class Tag:
    """What one notification says landed."""

    room: int
    generation: int
    chunk: int
    flags: int = 0
    n_chunks: int = 0

    def encode(self) -> bytes:
        """The tag's wire form (29 bytes)."""
        return _TAG.pack(
            TAG_MAGIC, self.room, self.generation, self.chunk, self.flags, self.n_chunks
        )

    @staticmethod
    def decode(data: bytes) -> Tag | None:
        """Parse a tag; ``None`` when ``data`` is not a kvmesh tag of this version."""
        if len(data) != _TAG.size or not data.startswith(TAG_MAGIC):
            return None
        _, room, gen, chunk, flags, n = _TAG.unpack(data)
        return Tag(room, gen, chunk, flags, n)


_COUNT = struct.Struct("<4sH")  # magic, entries


def encode_tags(tags: Sequence[Tag]) -> bytes:
    """Several chunks' tags as one notification (a coalesced write carries them all)."""
    if len(tags) == 1:
        return tags[0].encode()
    return _COUNT.pack(TAG_MAGIC_MULTI, len(tags)) + b"".join(t.encode() for t in tags)


def decode_tags(data: bytes) -> list[Tag] | None:
    """Every tag in a notification; ``None`` when it is not a kvmesh notification."""
    if data.startswith(TAG_MAGIC):
        one = Tag.decode(data)
        return None if one is None else [one]
    if not data.startswith(TAG_MAGIC_MULTI) or len(data) < _COUNT.size:
        return None
    _, n = _COUNT.unpack_from(data)
    if len(data) != _COUNT.size + n * _TAG.size:
        return None
    out = []
    for i in range(n):
        off = _COUNT.size + i * _TAG.size
        t = Tag.decode(data[off : off + _TAG.size])
        if t is None:
            return None
        out.append(t)
    return out


#: A write of ``length`` bytes from source offset to destination offset.
Run = tuple[int, int, int]


def merge_runs(src_pages: Sequence[int], dst_pages: Sequence[int]) -> list[tuple[int, int, int]]:
    """Merge page pairs into runs contiguous on both sides: ``(src_start, dst_start, n_pages)``.

    ``src_pages[i]`` goes to ``dst_pages[i]``; a run grows while both the next
    source and the next destination page follow the previous ones, so a
    fragmented allocation costs one descriptor per contiguous stretch, not one
    per page.
    """
    if len(src_pages) != len(dst_pages):
        raise ValueError("source and destination page counts differ")
    runs: list[tuple[int, int, int]] = []
    if not src_pages:
        return runs
    s0, d0, n = src_pages[0], dst_pages[0], 1
    for s, d in zip(src_pages[1:], dst_pages[1:], strict=True):
        if s == s0 + n and d == d0 + n:
            n += 1
        else:
            runs.append((s0, d0, n))
            s0, d0, n = s, d, 1
    runs.append((s0, d0, n))
    return runs


def byte_runs(
    page_runs: Sequence[tuple[int, int, int]], page_size: int
) -> list[tuple[int, int, int]]:
    """Page runs as byte runs ``(src_offset, dst_offset, length)``."""
    return [(s * page_size, d * page_size, n * page_size) for s, d, n in page_runs]
