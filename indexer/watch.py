"""Watchers of a replica's applied changes: bounded per-watcher buffers, positions, resync.

A :class:`WatchHub` numbers every change the replica applies with a stream
position (one counter per replica, moving by one a change) and hands it to the
watchers whose namespaces it concerns. Each watcher has a bounded buffer: a
watcher that falls more than its bound behind is not dropped silently and is
not allowed to grow the replica's memory; its buffer is emptied and it is told
to resync (:class:`Resync`), after which it takes a fresh snapshot.

Consistency: :meth:`WatchHub.subscribe` is synchronous and returns the
position the watcher starts after. A caller that reads its snapshot in the
same step of the event loop (no await between the two) sees every change up
to that position in the snapshot and every later one in the buffer, none
twice and none missed.

A snapshot's instance may be too large for one message (a million blocks
are some 17 MB): :func:`snapshot_parts` splits its content into parts of a
bounded size, which a follower puts back together in order.

Keepalives: :meth:`Watcher.next` with ``idle_s`` returns an empty list once
the watcher waited that long with nothing buffered, when the transport tells
the follower its stream is up and it holds everything (a follower that hears
nothing for longer knows its stream is stalled).

Cost when nobody watches: none on a backend's write path, which asks
:attr:`WatchHub.active` before it builds a change; :meth:`WatchHub.publish`
itself is then one increment and one test. No grpc here: indexer/server.py
streams what a watcher reads.
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections import deque
from collections.abc import Collection, Iterable
from dataclasses import dataclass
from typing import Any

from indexer.model import (
    BlockRemoved,
    BlockStored,
    Event,
    EventBatch,
    InstanceId,
    Namespace,
    Tier,
)
from kvmesh.errors import InvalidArgument, ResourceExhausted, Unavailable

#: Watchers one replica serves at most by default: each holds a buffer of up to
#: ``DEFAULT_BUFFER`` changes, so this bounds the replica's watch memory.
DEFAULT_MAX_WATCHERS = 64
#: Changes a watcher may fall behind by default before it is told to resync:
#: at a few thousand batches a second of ingest, about a second of slack.
DEFAULT_BUFFER = 4096


@dataclass(frozen=True, slots=True)
class Change:
    """One applied change, as a watcher reads it.

    ``kind`` is one of ``batch``, ``registered``, ``renewed``, ``gone`` or
    ``predicted`` (route-time predictions recorded, for the watchers that
    take them); ``namespace`` is the one it concerns
    (None: every namespace, e.g. an instance leaving); ``payload`` what the
    transport needs to describe it.
    """

    position: int
    kind: str
    namespace: Namespace | None
    instance: InstanceId
    sequence: int
    payload: Any = None


@dataclass(frozen=True, slots=True)
class Resync:
    """The watcher fell more than its buffer behind at ``position``: take a new snapshot."""

    position: int


class Watcher:
    """One watcher's bounded buffer. Read it with :meth:`next`; close it with
    :meth:`WatchHub.unsubscribe`."""

    def __init__(
        self, namespaces: frozenset[Namespace], buffer: int, start: int, predictions: bool = False
    ) -> None:
        #: Namespaces watched (empty: all).
        self.namespaces = namespaces
        #: Whether the watcher takes ``predicted`` changes (route-time predictions).
        self.predictions = predictions
        #: Largest number of changes held.
        self.buffer = buffer
        #: Position of the snapshot the watcher started from.
        self.start = start
        self._queue: deque[Change] = deque()
        self._resync: Resync | None = None
        self._ready = asyncio.Event()
        self._closed = False
        #: Times this watcher was told to resync.
        self.resyncs = 0

    def wants(self, namespace: Namespace | None) -> bool:
        """Whether a change of ``namespace`` concerns this watcher."""
        return namespace is None or not self.namespaces or namespace in self.namespaces

    def _offer(self, change: Change) -> None:
        if self._resync is not None:
            return  # already behind: nothing more is kept until it resyncs
        if len(self._queue) >= self.buffer:
            self._queue.clear()
            self._resync = Resync(change.position)
            self.resyncs += 1
        else:
            self._queue.append(change)
        self._ready.set()

    async def next(self, idle_s: float | None = None) -> list[Change] | Resync | None:
        """Every change buffered so far (waiting for one), or :class:`Resync` once
        the watcher fell behind (after a Resync the watcher starts anew, empty),
        or None once the hub closed and nothing is left.

        With ``idle_s``, an empty list once nothing arrived for that long: the
        watcher has read everything the replica applied for it (a keepalive is
        due). One timer a call; the wait is cancelled only at its await, before
        anything is taken from the buffer, so no change is lost to it.
        """
        if idle_s is None:
            return await self._next()
        try:
            async with asyncio.timeout(idle_s):
                return await self._next()
        except TimeoutError:
            return []

    async def _next(self) -> list[Change] | Resync | None:
        while not self._queue and self._resync is None:
            if self._closed:
                return None
            self._ready.clear()
            await self._ready.wait()
        if self._resync is not None:
            r, self._resync = self._resync, None
            return r
        out = list(self._queue)
        self._queue.clear()
        return out

    def close(self) -> None:
        """End the watcher: :meth:`next` returns what is left, then None."""
        self._closed = True
        self._ready.set()

    def restart(self, start: int) -> None:
        """Start again after a fresh snapshot taken at ``start`` (same step of the loop)."""
        self.start = start
        self._queue.clear()
        self._resync = None

    @property
    def pending(self) -> int:
        """Changes buffered and not yet read."""
        return len(self._queue)


class WatchHub:
    """The replica's watchers and its stream position. One per replica, one event loop."""

    def __init__(
        self,
        *,
        max_watchers: int = DEFAULT_MAX_WATCHERS,
        buffer: int = DEFAULT_BUFFER,
        position: int = 0,
    ) -> None:
        if max_watchers < 0:
            raise InvalidArgument("must be >= 0", field="watch.max_followers")
        if buffer < 1:
            raise InvalidArgument("must be >= 1", field="watch.buffer")
        self.max_watchers = max_watchers
        self.buffer = buffer
        #: Position of the last change published (0: none yet; ``position``: a
        #: hub that replaces another starts past it, so that no watcher of the
        #: old one is ever at a position of the new one).
        self.position = position
        self._watchers: list[Watcher] = []
        self.closed = False

    def subscribe(
        self, namespaces: Collection[Namespace] = (), buffer: int = 0, *, predictions: bool = False
    ) -> Watcher:
        """A new watcher starting after the current position; ``buffer`` (0: the
        hub's) is capped by the hub's; ``predictions``: it takes ``predicted``
        changes too. ResourceExhausted naming ``watch.max_followers`` when the
        hub is full."""
        if self.closed:
            raise Unavailable("the replica is shutting down; watch another")
        if len(self._watchers) >= self.max_watchers:
            raise ResourceExhausted(
                f"{len(self._watchers)} watchers, the cap (watch.max_followers)",
                field="watch.max_followers",
            )
        if buffer < 0:
            raise InvalidArgument("must be >= 0", field="max_buffer")
        w = Watcher(
            frozenset(namespaces),
            min(buffer or self.buffer, self.buffer),
            self.position,
            predictions,
        )
        self._watchers.append(w)
        return w

    def close(self) -> None:
        """End every watcher (the replica stops): followers go to another replica
        instead of holding its shutdown for the grace period."""
        self.closed = True
        for w in self._watchers:
            w.close()

    def resync_all(self) -> int:
        """Tell every watcher to take a new snapshot (the replica changed its index
        in a way it can not describe as changes); return how many were told."""
        for w in self._watchers:
            if w._resync is None:
                w._queue.clear()
                w._resync = Resync(self.position)
                w.resyncs += 1
                w._ready.set()
        return len(self._watchers)

    def unsubscribe(self, watcher: Watcher) -> None:
        """Forget ``watcher`` (idempotent)."""
        if watcher in self._watchers:
            self._watchers.remove(watcher)

    @property
    def active(self) -> bool:
        """Whether anyone watches: a backend builds no change for nobody (positions
        only order what watchers read, so none is needed then)."""
        return bool(self._watchers)

    @property
    def predicting(self) -> bool:
        """Whether a watcher takes route-time predictions (``predicted`` changes)."""
        return any(w.predictions for w in self._watchers)

    @property
    def watchers(self) -> int:
        """Watchers subscribed."""
        return len(self._watchers)

    def publish(
        self,
        kind: str,
        namespace: Namespace | None,
        instance: InstanceId,
        sequence: int,
        payload: Any = None,
    ) -> int:
        """Number one applied change and hand it to the watchers it concerns;
        return its position."""
        self.position += 1
        if self._watchers:
            change = Change(self.position, kind, namespace, instance, sequence, payload)
            predicted = kind == "predicted"
            for w in self._watchers:
                if w.wants(namespace) and (w.predictions or not predicted):
                    w._offer(change)
        return self.position


def keyed_stores(
    runs: dict[tuple[str, Tier], tuple[list[int], list[int]]],
    copies: Iterable[tuple[int, int, str, Tier, int]] = (),
) -> list[Event]:
    """A snapshot's content (what gives an empty instance its blocks): one store
    of precomputed keys per (LoRA name, tier) run of ``(hashes, keys)``, then,
    per ``(hash, key, LoRA name, tier, n)`` of ``copies``, a store of that
    block ``n`` times (its copies beyond the first, for a batch that counts
    copies)."""
    out: list[Event] = [
        BlockStored(
            block_hashes=tuple(hs),
            parent_block_hash=None,
            token_ids=(),
            block_size=0,
            lora_name=lora,
            tier=tier,
            block_keys=tuple(ks),
        )
        for (lora, tier), (hs, ks) in runs.items()
    ]
    for h, key, lora, tier, n in copies:
        out.append(
            BlockStored(
                block_hashes=(h,) * n,
                parent_block_hash=None,
                token_ids=(),
                block_size=0,
                lora_name=lora,
                tier=tier,
                block_keys=(key,) * n,
            )
        )
    return out


#: Wire bytes of one block of a snapshot's store, at most: a 10-byte varint
#: hash and its 8-byte key.
BLOCK_WIRE_BYTES = 18
#: Wire bytes of one event besides its blocks and LoRA name, at most: its
#: framing, the tier, the lengths of its packed fields.
EVENT_WIRE_BYTES = 32


def event_wire_bytes(ev: Event) -> int:
    """An upper bound of ``ev``'s size in an EventBatch message, for an event
    of a snapshot (a store of precomputed keys without tokens or extras)."""
    if isinstance(ev, BlockStored):
        return (
            EVENT_WIRE_BYTES + len(ev.lora_name.encode()) + BLOCK_WIRE_BYTES * len(ev.block_hashes)
        )
    if isinstance(ev, BlockRemoved):
        return EVENT_WIRE_BYTES + 10 * len(ev.block_hashes)
    return EVENT_WIRE_BYTES


def snapshot_parts(content: EventBatch, max_bytes: int) -> list[EventBatch]:
    """``content`` (one instance of a snapshot) as parts whose events take at
    most ``max_bytes`` on the wire each (:func:`event_wire_bytes`), in order:
    their events concatenated apply as ``content`` does.

    A store longer than the room left in a part is cut into consecutive stores
    (of precomputed keys, as a snapshot's are); a part holds at least one
    block, whatever ``max_bytes``. Content within the bound is one part, itself.
    """
    if sum(event_wire_bytes(ev) for ev in content.events) <= max_bytes:
        return [content]
    parts: list[EventBatch] = []
    events: list[Event] = []
    room = max_bytes

    def flush() -> None:
        nonlocal events, room
        parts.append(dataclasses.replace(content, events=tuple(events)))
        events, room = [], max_bytes

    for ev in content.events:
        if not isinstance(ev, BlockStored) or not ev.block_hashes:
            cost = event_wire_bytes(ev)
            if events and cost > room:
                flush()
            events.append(ev)
            room -= cost
            continue
        if ev.token_ids or ev.extras or ev.block_keys is None:
            raise ValueError("a snapshot's stores carry their keys only (no tokens, no extras)")
        head = EVENT_WIRE_BYTES + len(ev.lora_name.encode())
        n = len(ev.block_hashes)
        lo = 0
        while lo < n:
            fit = (room - head) // BLOCK_WIRE_BYTES
            if fit < 1:
                if events:
                    flush()
                    continue
                fit = 1
            hi = min(n, lo + fit)
            events.append(
                ev
                if lo == 0 and hi == n
                else dataclasses.replace(
                    ev, block_hashes=ev.block_hashes[lo:hi], block_keys=ev.block_keys[lo:hi]
                )
            )
            room -= head + BLOCK_WIRE_BYTES * (hi - lo)
            lo = hi
    if events:
        flush()
    return parts
