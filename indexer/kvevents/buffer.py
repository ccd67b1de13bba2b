"""A bounded buffer of live engine messages between a socket reader and the stream logic.

The reader task puts every message it takes off the SUB socket here and goes
back to the socket at once, so it never waits on the index (the engine's PUB
socket never blocks either: ZMQ drops what a full subscriber queue cannot
take). When the buffer holds ``max_batches`` messages or ``max_bytes`` bytes,
a new message is **dropped** and counted: the newest, so that what stays is
one run the stream logic applies in order and the dropped ones form one gap
after it, which one replay request to the engine fills. The buffer remembers
the highest sequence it dropped (:meth:`FrameBuffer.take_drops`), so the stream
logic can settle the gap once the buffer runs empty even when no later
message comes to show it (indexer/kvevents/subscriber.py).
"""

from __future__ import annotations

import asyncio
from collections import deque
from dataclasses import dataclass

from indexer.kvevents.decode import MalformedFrame, decode_seq


@dataclass(frozen=True, slots=True)
class BufferLimits:
    """How much a :class:`FrameBuffer` holds before it drops."""

    max_batches: int
    max_bytes: int

    def __post_init__(self) -> None:
        if self.max_batches < 1 or self.max_bytes < 1:
            raise ValueError("buffer limits must be at least 1")


@dataclass(slots=True)
class BufferCounters:
    """What a buffer took and dropped since it was made."""

    accepted: int = 0
    dropped: int = 0
    bytes_dropped: int = 0
    #: Most messages held at once.
    high_water: int = 0


class FrameBuffer:
    """Live messages (their ZMQ frames), bounded, filled without waiting, drained in order.

    Not thread-safe: one event loop puts and gets.
    """

    def __init__(self, limits: BufferLimits) -> None:
        self.limits = limits
        self.counters = BufferCounters()
        self.bytes = 0
        self._items: deque[tuple[list[bytes], int]] = deque()
        self._ready = asyncio.Event()
        self._dropped_through: int | None = None
        self._drops_pending = False

    def __len__(self) -> int:
        return len(self._items)

    def put(self, frames: list[bytes]) -> bool:
        """Hold ``frames``; False when the buffer is full and they were dropped."""
        size = sum(len(f) for f in frames)
        lim = self.limits
        if self._items and (
            len(self._items) >= lim.max_batches or self.bytes + size > lim.max_bytes
        ):
            self.counters.dropped += 1
            self.counters.bytes_dropped += size
            self._drops_pending = True
            if len(frames) == 3:
                try:
                    seq = decode_seq(frames[1])
                except MalformedFrame:
                    pass  # not a batch: nothing of the stream is lost with it
                else:
                    if self._dropped_through is None or seq > self._dropped_through:
                        self._dropped_through = seq
            return False
        # An empty buffer always takes one message, however large: a batch above
        # max_bytes must still reach the stream logic (which may refuse it).
        self._items.append((frames, size))
        self.bytes += size
        self.counters.accepted += 1
        self.counters.high_water = max(self.counters.high_water, len(self._items))
        self._ready.set()
        return True

    def get_nowait(self) -> list[bytes] | None:
        """The oldest message, or None when empty."""
        if not self._items:
            return None
        frames, size = self._items.popleft()
        self.bytes -= size
        if not self._items:
            self._ready.clear()
        return frames

    async def get(self) -> list[bytes]:
        """The oldest message, waiting for one."""
        while True:
            frames = self.get_nowait()
            if frames is not None:
                return frames
            await self._ready.wait()

    def take_drops(self) -> tuple[bool, int | None]:
        """Whether messages were dropped since the last call, and the highest sequence
        among them (None: none had a readable one); resets both."""
        pending, through = self._drops_pending, self._dropped_through
        self._drops_pending = False
        self._dropped_through = None
        return pending, through
