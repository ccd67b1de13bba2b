"""WatchIndex over Redis: a replica's copy of the shared index, fed by the change stream.

Followers need a consistent snapshot and then every change in order
(indexer/watch.py). The Redis backend has neither by itself: its replicas
write the shared index independently. So a replica asked to serve followers
keeps a copy of the index in its own memory, a :class:`~indexer.memory.MemoryIndex`
(the code a follower itself runs), and serves WatchIndex from that copy as a
memory replica serves its own index. The copy is fed by the change stream
that every replica's scripts append to, atomically with each change, while
someone watches (indexer/redis/KEYS.md, "Watching"):

1. ``wstart.lua`` sets ``P:wl`` (the stream's length bound, with a lease this
   feed renews) and ``P:wp``, and returns the number and id of the stream's last entry;
2. every registered instance is read at once (``wread.lua``), each with the
   number of the stream's last entry at its read: the copy skips that
   instance's entries up to that number, and applies every later one;
3. the feed reads the stream after the id of step 1 and applies each entry:
   ``b`` a batch as applied, ``g`` a registration, ``h`` a renewal, ``x`` a
   removal or reap, ``r`` "read the instance again" (a batch the quotas cut:
   not the batch its writer sent), ``q`` one part of a long batch (kept
   until the last part, then applied as the whole batch: :class:`_Parts`),
   ``p`` route-time predictions recorded
   (the feed asks for them with ``P:wp``, and step 2 reads each instance's
   unexpired ones, so that the copy answers followers' Matches with
   predictions as Redis does). A writer that does not know yet that
   someone watches is told so by its apply (nothing written) and sends the
   batch again with its message.

Entries are numbered one by one (``P:wn``); an entry that does not follow
the last one applied (trimmed past the bound, lost to a Redis restarted
empty) or a stream that stops holding the next number makes the feed copy
the index again: its followers are ended then (they come back for a new
snapshot), never left with a copy that silently misses changes. Any error
does the same after a pause.

Demand-driven: the copy is made when the first follower asks
(:meth:`RedisWatchFeed.demand`), and dropped with its stream lease once no
follower has watched for :data:`IDLE_DROP_S`, so a replica nobody follows
keeps nothing and the fleet's writes pay nothing but one GET each.

Entries carry the writer's clock (``t``): the copy applies each at that time,
so its leases are Redis's (the clocks of replicas are assumed to agree, as
for the Redis backend itself).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import math
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from indexer import convert
from indexer.memory import MemoryIndex
from indexer.model import BlockRemoved, BlockStored, Event, InstanceId, InstanceSpec, Namespace
from indexer.redis.backend import RedisIndex
from indexer.watch import WatchHub
from kvmesh.api.indexer.v1 import indexer_pb2 as pb
from kvmesh.errors import FailedPrecondition, KvmeshError, NotFound, ResourceExhausted
from kvmesh.tasks import stop_tasks

log = logging.getLogger(__name__)

#: Lease of ``P:wl``: writers stop appending this long after the last renewal
#: (a watching replica that died costs the fleet its appends this long).
LEASE_S = 30.0
#: How often the feed renews the lease and checks that the stream still holds
#: its next entry (a Redis restarted empty is found within this).
CHECK_S = 1.0
#: A copy nobody has followed for this long is dropped (and the lease left to run out).
IDLE_DROP_S = 300.0
#: Entries read per XREAD, and the longest wait of one (below any socket timeout).
READ_COUNT = 1024
READ_BLOCK_MS = 200
#: How long a replica whose copy grew past ``max_pairs`` refuses followers
#: before it tries again.
REFUSE_S = 60.0
#: Entries applied between two turns of the event loop.
YIELD_EVERY = 16
#: Pause after an error before the index is copied again.
RETRY_S = 0.5
#: Lags kept for the figures (event applied in Redis -> applied in the copy).
LAG_WINDOW = 4096


class _Resync(Exception):
    """The copy can not follow the stream any more: copy the index again."""


class _TooLarge(Exception):
    """The copy holds more pairs than its bound: drop it, refuse followers a while."""


@dataclass(slots=True)
class _Parts:
    """The parts of one instance's long batch the copy holds until its last
    (KEYS.md, "Apply in parts"): applied then as one batch, so the copy and
    its followers see the batch whole, as a memory replica publishes it.

    ``at`` is the position in the batch the next part starts at (None: any,
    the first part after a read of the instance). ``whole``: kept from the
    batch's first part; else the instance was read in the middle of the batch
    (the read holds the parts before), nothing is kept, and the batch's last
    part reads the instance again."""

    seq: int
    at: bytes | None
    events: list[Event] = field(default_factory=list)
    whole: bool = True

    @property
    def missed(self) -> bool:
        """Whether Redis holds parts of the batch the copy does not (kept, or
        seen and not kept since a read)."""
        return bool(self.events) or (not self.whole and self.at is not None)


_NO_PARTS = _Parts(0, None, whole=False)


def _joined(a: Event, b: Event) -> Event:
    """Two consecutive pieces of one event (:func:`indexer.model.event_piece`) as one."""
    if isinstance(a, BlockRemoved) and isinstance(b, BlockRemoved):
        return dataclasses.replace(a, block_hashes=a.block_hashes + b.block_hashes)
    if not (isinstance(a, BlockStored) and isinstance(b, BlockStored)):
        raise _Resync(f"a part goes on with {type(b).__name__} after {type(a).__name__}")
    na, nb = len(a.block_hashes), len(b.block_hashes)
    extras = None
    if a.extras is not None or b.extras is not None:
        extras = tuple(a.extras or (None,) * na) + tuple(b.extras or (None,) * nb)
    return dataclasses.replace(
        a,
        block_hashes=a.block_hashes + b.block_hashes,
        token_ids=tuple(a.token_ids) + tuple(b.token_ids),
        block_keys=None if a.block_keys is None else a.block_keys + (b.block_keys or ()),
        extras=extras,
    )


def _iid(name: bytes) -> InstanceId:
    worker, _, rank = name.partition(b"\0")
    return InstanceId(worker.decode("utf-8"), int(rank))


class RedisWatchFeed:
    """A replica's copy of a Redis index (standalone or Cluster), for its followers.

    ``settle_s``: how long the copy is fed before it serves followers (0: at
    once; a test's knob). ``on_lag``: called with each change's delay from its
    writer to the copy, seconds (the replica's histogram).
    """

    def __init__(
        self,
        index: RedisIndex,
        *,
        max_followers: int,
        buffer: int,
        backlog: int,
        settle_s: float = 0.0,
        idle_drop_s: float = IDLE_DROP_S,
        on_lag: Callable[[float], None] | None = None,
        max_pairs: int = 0,
    ) -> None:
        self.index = index
        self._max_followers = max_followers
        self._buffer = buffer
        self.backlog = backlog
        self.settle_s = settle_s
        self.idle_drop_s = idle_drop_s
        self._on_lag = on_lag
        #: The most (block, instance) pairs the copy may hold (0: no bound).
        self.max_pairs = max_pairs
        #: Copies dropped for the bound (each refused followers REFUSE_S).
        self.refusals = 0
        self._refused_until = -math.inf  # time.monotonic() until which followers are refused
        #: The copy followers are served from, once it holds the index (else None).
        self.mirror: MemoryIndex | None = None
        self._task: asyncio.Task[None] | None = None
        self._at: float | None = None  # the entry being applied: its writer's clock
        self._clock: Callable[[], float] = index._clock
        #: Number of the last entry applied.
        self.position = 0
        self._after = b"0-0"
        self._skip: dict[bytes, int] = {}
        #: Long batches being applied in parts, by instance name.
        self._parts: dict[bytes, _Parts] = {}
        self._wanted_at = 0.0  # time.monotonic() of the last demand
        self._hub: WatchHub | None = None  # the copy's hub (served or not yet)
        self._hub_end = 0  # the last position of the copies before
        #: Times the index was copied (the first one included).
        self.copies = 0
        #: Copies made again after a gap in the stream or an error.
        self.resyncs = 0
        #: Instances read again (an ``r`` entry, or an entry the copy could not apply).
        self.reloads = 0
        self.entries_applied = 0
        #: Redis errors met (each one made the feed copy the index again).
        self.errors = 0
        #: Why the last attempt to copy or follow failed ('' once a copy is made).
        self.last_error = ""
        #: The last lags, seconds (entry's writer clock -> applied here).
        self.lag_s: deque[float] = deque(maxlen=LAG_WINDOW)

    # -- lifecycle -------------------------------------------------------------

    def demand(self) -> MemoryIndex | None:
        """The copy to serve a follower from, or None while it is being made
        (the feed is started by the first demand). ResourceExhausted naming
        ``watch.redis_max_pairs`` for REFUSE_S after the copy outgrew it."""
        self._wanted_at = time.monotonic()
        if self._wanted_at < self._refused_until:
            raise ResourceExhausted(
                f"{self.last_error}; followers are refused for {REFUSE_S:g} s from then: "
                "ask the indexer (or raise watch.redis_max_pairs)",
                field="watch.redis_max_pairs",
            )
        if self._task is None or self._task.done():
            self._task = asyncio.create_task(self._run(), name="kvmesh-redis-watch")
        return self.mirror

    async def close(self) -> None:
        """Stop feeding and end every follower of the copy."""
        if self._task is not None:
            await stop_tasks(self._task, what="redis watch feed")
            self._task = None
        self._drop()

    def _drop(self) -> None:
        m, self.mirror = self.mirror, None
        if m is not None and m.watch is not None:
            m.watch.close()  # its followers come back for the next copy
        if self._hub is not None:
            self._hub_end = max(self._hub_end, self._hub.position)

    def _now(self) -> float:
        at = self._at
        return self._clock() if at is None else at

    # -- the loop ----------------------------------------------------------------

    async def _run(self) -> None:
        while True:
            try:
                await self._follow()
                return  # idle: dropped
            except asyncio.CancelledError:
                raise
            except _TooLarge as e:
                self.last_error = str(e)
                self.refusals += 1
                self._refused_until = time.monotonic() + REFUSE_S
                log.warning("redis watch: %s; dropping the copy", e)
                self._drop()
                return  # the stream's lease runs out unless a follower comes back later
            except _Resync as e:
                self.last_error = str(e)
                self.resyncs += 1
                log.warning("redis watch: copying the index again (%s)", e)
            except (KvmeshError, OSError) as e:
                self.last_error = str(e)
                if isinstance(e, FailedPrecondition):
                    log.error("redis watch: %s", e)
                    self._drop()
                    return
                self.errors += 1
                log.warning("redis watch: %s; copying the index again in %.1fs", e, RETRY_S)
            except Exception:  # a bug must not end the replica's followers silently
                self.errors += 1
                log.exception("redis watch: unexpected error; copying the index again")
            self._drop()
            await asyncio.sleep(RETRY_S)

    async def _follow(self) -> None:
        idx = self.index
        started = time.monotonic()
        n, after = await idx.watch_start(self.backlog, LEASE_S)
        self.position, self._after = n, after
        mirror = MemoryIndex(clock=self._now)
        # Positions go on past the last copy's: a follower of that copy (its
        # stream not ended yet) is never at a position of this one.
        mirror.watch = WatchHub(
            max_watchers=self._max_followers, buffer=self._buffer, position=self._hub_end + 1
        )
        self._hub = mirror.watch
        self._skip = {}
        self._parts = {}
        for name in await idx.watch_names():
            await self._load(mirror, name, publish=False)
            self._bound(mirror)
        self.copies += 1
        self.last_error = ""
        checked = time.monotonic()
        # A blocking read waits well within the socket's timeout.
        block_ms = max(1, min(READ_BLOCK_MS, int(idx.socket_wait_s * 400)))
        serving = self.settle_s <= 0
        if serving:
            self.mirror = mirror
        while True:
            entries = await idx.watch_tail(self._after, READ_COUNT, block_ms)
            for i, (eid, fields) in enumerate(entries):
                if i and not i % YIELD_EVERY:
                    # The copy's followers' streams run on this loop: they send
                    # what was applied so far instead of waiting for the read.
                    await asyncio.sleep(0)
                await self._apply(mirror, fields)
                self._after = eid
            mono = time.monotonic()
            if not serving and mono - started >= self.settle_s:
                self.mirror, serving = mirror, True
            if mono - checked >= CHECK_S:
                checked = mono
                if mirror.watch.watchers == 0 and mono - self._wanted_at >= self.idle_drop_s:
                    log.info(
                        "redis watch: no follower for %.0fs; dropping the copy",
                        mono - self._wanted_at,
                    )
                    self._drop()
                    return
                self._bound(mirror)
                await self._check()

    def _bound(self, mirror: MemoryIndex) -> None:
        """_TooLarge once the copy holds more pairs than ``max_pairs``."""
        if self.max_pairs:
            pairs = sum(mirror.pairs_by_model().values())
            if pairs > self.max_pairs:
                raise _TooLarge(
                    f"the copy of the index holds {pairs:,} (block, instance) pairs, "
                    f"more than watch.redis_max_pairs ({self.max_pairs:,})"
                )

    async def _check(self) -> None:
        """Renew the lease; the stream must still hold the next entry, or none yet."""
        top, _ = await self.index.watch_start(self.backlog, LEASE_S)
        if top < self.position:
            raise _Resync(f"the stream went back from entry {self.position} to {top}")
        # Entries after ours exist: the next read returns them, and a gap shows
        # there. Nothing after ours while they exist: ours are gone.
        if top > self.position and not await self.index.watch_tail(self._after, 1, None):
            raise _Resync(f"the stream holds entry {top} but nothing after {self.position}")

    # -- entries -------------------------------------------------------------------

    async def _apply(self, mirror: MemoryIndex, f: dict[bytes, bytes]) -> None:
        n = int(f[b"n"])
        if n != self.position + 1:
            raise _Resync(
                f"entry {n} after entry {self.position} (trimmed past the bound, or lost)"
            )
        self.position = n
        kind = f[b"k"]
        name = f[b"i"]
        if kind == b"s" or self._skip.get(name, 0) >= n:
            return
        at = float(f[b"t"])
        self._at = at
        try:
            if kind == b"q":
                await self._take_part(mirror, name, f)
                kind = b"s"
            elif kind in (b"b", b"g") and self._parts.pop(name, _NO_PARTS).missed:
                # Parts of a batch left midway in Redis (its writer gave up and
                # the engine went on): read the instance as Redis holds it, this
                # entry's change included.
                await self._load(mirror, name)
                kind = b"s"
            if kind == b"s":
                pass
            elif kind == b"b":
                batch = convert.batch_from_pb(pb.EventBatch.FromString(f[b"x"]))
                try:
                    await mirror.apply(batch)
                except (FailedPrecondition, NotFound):
                    await self._load(mirror, name)
            elif kind == b"g":
                spec = InstanceSpec(
                    instance=InstanceId(f[b"w"].decode("utf-8"), int(f[b"r"])),
                    model=f[b"m"].decode("utf-8"),
                    address=f[b"a"].decode("utf-8"),
                    lease_ttl_s=float(f[b"l"]),
                    incarnation=f[b"c"].decode("utf-8"),
                )
                await mirror.register(spec)
            elif kind == b"h":
                with contextlib.suppress(NotFound):
                    await mirror.heartbeat(_iid(name))
            elif kind == b"x":
                self._parts.pop(name, None)
                with contextlib.suppress(NotFound):
                    await mirror.remove_instance(_iid(name))
            elif kind == b"r":
                self._parts.pop(name, None)
                await self._load(mirror, name)
            elif kind == b"p":
                iid = _iid(name)
                model = mirror.model_of(iid)
                if model is not None:
                    blob = f[b"x"]
                    keys = [int.from_bytes(blob[i : i + 8], "big") for i in range(0, len(blob), 8)]
                    # Recorded as Redis did, at the writer's time (the copy's
                    # clock while an entry applies): the same expiry and
                    # pending deadline ('q', absent from an older writer's; one
                    # at the expiry is none, as predict_sync takes it).
                    with contextlib.suppress(KvmeshError):
                        mirror.predict_sync(
                            Namespace(model, f[b"l"].decode("utf-8")),
                            iid,
                            keys,
                            float(f[b"e"]) - at,
                            int(f[b"c"]),
                            pending_s=float(f[b"q"]) - at if f.get(b"q") else None,
                        )
            else:
                raise _Resync(f"entry {n} of unknown kind {kind!r}")
        finally:
            self._at = None
        self.entries_applied += 1
        lag = self._clock() - at
        self.lag_s.append(lag)
        if self._on_lag is not None:
            self._on_lag(max(0.0, lag))

    async def _take_part(self, mirror: MemoryIndex, name: bytes, f: dict[bytes, bytes]) -> None:
        """Keep part entry ``f`` of a long batch; its last part applies the batch."""
        seq, start, stop = f[b"z"].split(b" ")
        held = self._parts.get(name)
        if held is not None and int(seq) == held.seq and held.at in (None, start):
            pass  # the batch's next part
        elif start == b"0:0" and (held is None or not held.missed):
            held = self._parts[name] = _Parts(int(seq), start)
        else:
            # The batch's earlier parts are not kept here: they are in a read
            # of the instance made after them (the copy's start, an 'r'), or
            # were those of a batch left midway. Read the instance again
            # (this part included) and keep the batch's later parts.
            self._parts.pop(name, None)
            await self._load(mirror, name)
            if stop != b"end":
                self._parts[name] = _Parts(int(seq), None, whole=False)
            return
        if not held.whole:
            # Going on after a read of the instance: the read holds the parts
            # before, and may end inside an event, so the parts after it are
            # not events of their own: at the batch's last part, read it again.
            held.at = stop
            if stop == b"end":
                del self._parts[name]
                await self._load(mirror, name)
            return
        part = convert.batch_from_pb(pb.EventBatch.FromString(f[b"x"]))
        events = list(part.events)
        if not start.endswith(b":0") and held.events and events:
            # The part goes on with the last event of the one before: one
            # event again (an event whose parent is unknown is an orphan whole).
            held.events[-1] = _joined(held.events[-1], events.pop(0))
        held.events += events
        held.at = stop
        if stop == b"end":
            del self._parts[name]
            try:
                await mirror.apply(dataclasses.replace(part, events=tuple(held.events)))
            except (FailedPrecondition, NotFound):
                await self._load(mirror, name)

    async def _load(self, mirror: MemoryIndex, name: bytes, *, publish: bool = True) -> None:
        """Copy instance ``name`` as Redis holds it now; its entries up to then are skipped."""
        n, state, content, predicted = await self.index.watch_read(name)
        self._skip[name] = n
        iid = _iid(name)
        if publish:
            self.reloads += 1
        if state is None or content is None:
            with contextlib.suppress(NotFound):
                await mirror.remove_instance(iid)
            return
        await mirror.load_instance(state, content)
        now = self._now()
        for lora, keys, expiry, until in predicted:
            with contextlib.suppress(KvmeshError):
                mirror.predict_sync(
                    Namespace(state.spec.model, lora),
                    iid,
                    keys,
                    expiry - now,
                    pending_s=until - now if until else None,
                )
        if publish and mirror.watch is not None:
            # A copied instance is not a change a follower can apply: they take a new snapshot.
            mirror.watch.resync_all()

    # -- figures ---------------------------------------------------------------------

    def counters(self) -> dict[str, int | dict[str, int]]:
        """The feed's counters, for the replica's metrics (``kvmesh_indexer_<name>_total``)."""
        return {
            "redis_watch_copies": self.copies,
            "redis_watch_resyncs": self.resyncs,
            "redis_watch_reloads": self.reloads,
            "redis_watch_entries_applied": self.entries_applied,
            "redis_watch_errors": self.errors,
            "redis_watch_refusals": self.refusals,
        }


__all__ = ["RedisWatchFeed"]
