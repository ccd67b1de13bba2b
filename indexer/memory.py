"""In-process index backend: the embedded default for a single replica.

Layout: per namespace a map ``block key -> holders``, where holders is one
int ``instance number << 3 | tier mask`` while a single instance holds the
block (most blocks of a fleet: a conversation lives on one worker) and the
signature of its holders (an int of 2^63 or more, below) once several do, their
``{instance number: tier mask}`` then in the index's table of holder sets,
one per distinct set (interned by signature); per instance its engine-hash map
``engine hash -> (namespace, key)``, which is also the reverse index used to
clear or remove the instance. Instance numbers are small ints given at
registration and never reused. Match walks the keys in order and narrows the
set of instances still holding the prefix, so its cost is the number of
(block, instance) pairs visited, never the size of the index.

Signatures: a shared block's table entry is ``2^63 | x``, ``x`` the XOR over its
holders of a 63-bit mix of ``(number, tier mask)`` (:func:`_signature`), kept
up to date by every store and drop in O(1). Equal holders give equal
entries, so Match tells a block held exactly by its walkers with one int
comparison (a dict comparison over 64 holders cost 0.6 us a block), and
measures the whole run they hold alike in one C-level pass over the
prompt's keys against the members of that set (below); different holders
give equal entries with probability 2^-63, the order of a content-key
collision.

Interned holder sets: a set is never changed in place; a block whose holders
change moves to the set of its new signature (made, a copy, only if no block
holds it yet), and a set goes when no block names it: each set keeps its
member blocks per namespace (``{key: 1}``, untracked by the collector). The
blocks of a prefix that 64 instances hold share one set: a store or drop
there costs O(1) dict operations after the first block of a run, and the
memory of a shared block is its table entry.

Tables: the block tables and the engine-hash maps are preshed maps (C
arrays of 64-bit key and value cells, open addressing, linear probing), not
dicts. A dict entry and the int object of its 64-bit key took about 90
bytes; a cell takes 16, at a load of 0.3 to 0.6. The conversation trace at
16-token blocks in process (``tools/memory_pairs.py``): 125 bytes of RSS a
(block, instance) pair with dicts, 82 with the maps.

Such a map finds a key's first cell from the key's low bits. A client giving
block keys, or an engine its hashes, could send keys whose low bits are equal,
and each store would probe past all the others: quadratic. So a key enters a
map mixed (:func:`_mixed`): multiplied by an odd number drawn per process,
then folded by 32 and by 16 bits. Multiplication carries a difference between
keys only upward, and the folds bring the top bits down, so keys that differ
anywhere differ in the low bits too, where only the process knows how. All
three steps are bijections of 64-bit ints, so the map's key is the key
(:func:`_unmixed` gives it back for dumps). In Python the mix costs about
200 ns a key; a stored event's hashes and keys, and a walk's next keys, are
mixed in one numpy step (about 10 ns a key).

A map deletes by leaving a tombstone, and grows when entries and tombstones
together reach 0.6 of its cells: under churn (engines evicting what they
stored) a map would double again and again with a constant number of
entries. Each shard counts its deletions, and once they pass half of what
it holds (and :data:`REBUILD_MIN`), the shard is copied without them. The
copy goes through Python, about 150 ns an entry: 14 ms for a shard of 88 k
entries (5.6 M keys over 64 shards), once per 44 k deletions there, about
0.3 us a deletion. A map's own length counts its tombstones, so the index
keeps its block and engine-hash counts itself.

Memory, with dicts: a dict per block cost about 230 of the 470 bytes a (block, instance)
pair took at 16-token blocks; the single-holder int is 28. With holder sets
interned, 64 holders of 20 k blocks take 62 bytes a pair (97 with a dict per
shared block), 4 holders of 200 k blocks 77 (123). An engine-hash entry names
its namespace by its place among the instance's own (``_Instance.nids``), 0
for the one it stored in first, where the entry is the content key itself,
the int the block table already holds: with the index's number of the
namespace instead, every model but the index's first paid a new int a pair,
189 bytes a pair against 151 (tests/unit/test_memory_places.py).

Shards: each namespace's tables are :data:`SHARDS` maps, a key in the one
its mixed value's high bits name. A map grows by copying itself whole, in one step no
slice can cut: one table of the conversation trace at 16-token blocks grew
from 2.8 M to 5.6 M keys in 290 ms, and every Match and health probe waited
for it. A shard grows a sixty-fourth as far at a time. But shards of equal
share fill alike (keys are hashes), so all of them crossed a growth point within
a few thousand keys of each other: the same 290 ms, in one or two slices of
an apply (17 to 47 ms each; Match p99 during a 16-token ingest 80 to 170
ms, in plateaus of a few hundred ms). So the shards' shares are uneven: the
mixed key's high bits name one of :data:`SLOTS` slots, and shard ``i`` has slots in
proportion to ``2 ** (i / 256)``. Their sizes then spread over a factor of
two, and their growth points over the whole doubling of the table: one
shard's copy at a time. With dicts, 256 of them, not 64: one copy of a
dict of 2 % of the table still took 16 ms of the loop at 5.6 M keys. A map
copies its cells in C, about 50 ns an entry (one of 157 k entries grew in 9
ms, one of 629 k in 33), so 64 shards: the largest holds about 2.1 % of the
table, a copy of about 6 ms at 5.6 M keys. A namespace's tables cost about
50 KB empty (the 1,024 slots and 64 maps of some 700 bytes each), as the 256
dicts did; an instance's engine-hash map, 16 shards, 13 KB (its largest
shard, about 8 % of it, copies in about 4 ms at the 1 M-block quota). Its
cost is a list index per key, as before.

Garbage collection: a collection walks every container the collector
tracks. With a tracked dict per block key and a tuple per engine hash, that
paused the process (every Match and health check with it) for 20 to 100 ms
at a time while the conversation trace was ingested. So none is tracked: the
block tables and the engine-hash maps hold C ints (a map is tracked, but a
collection visits it once, never its cells), an engine-hash entry being the
content key (``place << 64 | content key`` at a later place, in a dict of ints).
A dict among a table's values would make the table tracked, and each
collection that reached it would walk every block (60 ms at 721 k blocks):
that is why shared blocks' holders live apart. What is left to walk is the
table of holder sets, one visit per distinct set (a table of holder dicts
per shared block cost 64.5 ms a full collection at 1 M shared blocks; the
interned sets 1.9 ms).

Predictions (indexer/index.py, "Predictions"): per namespace ``key ->
{instance number: expiry}``, and per instance its predicted entries oldest
first (the cap, and dropping them all on a clear, reset, removal or reap),
plus one heap of expiries that each prediction call and each Match asking for
predictions purge a bounded amount of (:data:`PURGE_BUDGET`): a prediction is
pushed once and popped once, so expired ones cost their own record, never a
Match. A store drops the instance's prediction of the key it stores (a key is
never both held and predicted). Times come from the index's ``clock`` (a
replay in virtual time builds the index with its virtual clock).

Semantics are those of :mod:`indexer.index`. Every method runs to completion
without awaiting, so each is atomic on the event loop, except the apply of a
long batch: it goes a slice at a time and lets the loop run between slices
(:meth:`MemoryIndex._apply_sliced`), so that a burst of engine events does not
hold every Match and health probe until it is applied.
"""

from __future__ import annotations

import asyncio
import contextlib
import copyreg
import heapq
import math
import operator
import secrets
import time
from collections.abc import AsyncIterator, Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field, replace
from itertools import chain, takewhile
from typing import Any

from preshed.maps import PreshMap

from indexer.index import Index
from indexer.model import (
    ALL_TIERS_MASK,
    AllBlocksCleared,
    ApplyResult,
    BatchOutcome,
    BlockRemoved,
    BlockStored,
    Event,
    EventBatch,
    IndexDump,
    IndexStats,
    InstanceId,
    InstanceMatch,
    InstanceSpec,
    InstanceState,
    Namespace,
    NamespaceStats,
    Quota,
    QuotaUsage,
    Tier,
    encoded_extras,
    event_piece,
    fenced_out,
)
from indexer.pacing import loop_pacer
from indexer.watch import WatchHub, keyed_stores
from kvmesh.blockkeys import chain_keys, namespace_seed
from kvmesh.errors import FailedPrecondition, NotFound, ResourceExhausted

np: Any
try:  # a server's dependency; a router's follower (router-only install) mixes in Python
    import numpy

    np = numpy
except ImportError:  # pragma: no cover - the router-only install's test covers it
    np = None


def _uncopied(copies: dict[int, int], h: int, mask: int) -> int:
    """The tier bits of ``mask`` whose last copy of block ``h`` goes (one copy
    of every other tier is taken from ``copies``)."""
    out = 0
    for t in range(3):
        if mask >> t & 1:
            k = h << 2 | t
            n = copies.get(k)
            if n is None:
                out |= 1 << t
            elif n > 1:
                copies[k] = n - 1
            else:
                del copies[k]
    return out


# Index of the fastest tier (0 gpu, 1 cpu, 2 disk) for each tier mask 1..7.
_FASTEST = (-1, 0, 1, 0, 2, 0, 1, 0)
# (gpu, cpu, disk) block counts of a one-block prefix, by tier mask 1..7.
_DEPTH1_TIERS: tuple[tuple[int, int, int], ...] = tuple(
    (int(f == 0), int(f == 1), int(f == 2)) for f in _FASTEST
)
# Number of bits set in each tier mask 0..7.
_POPCOUNT = (0, 1, 1, 2, 1, 2, 2, 3)
# Low 64 bits of an engine-hash entry: the content key.
_U64 = (1 << 64) - 1
#: Block-table entries at or above this are holder-set signatures (see
#: "Signatures" above); below, ``number << 3 | mask`` of the one holder.
_SHARED = 1 << 63

#: The key mix (see "Tables" above): an odd multiplier drawn per process, and
#: its inverse modulo 2^64.
_MIX = secrets.randbits(64) | 1
_UNMIX = pow(_MIX, -1, 1 << 64)


def _mixed(k: int) -> int:
    """The tables' key of ``k``: a bijection of 64-bit values, secret per process."""
    m = k * _MIX & _U64
    m ^= m >> 32
    return m ^ m >> 16


def _unmixed(m: int) -> int:
    """The key whose :func:`_mixed` is ``m``."""
    m ^= m >> 16 ^ m >> 32 ^ m >> 48
    return (m ^ m >> 32) * _UNMIX & _U64


#: Keys from which :func:`_mixed_all` mixes in numpy (an element costs about
#: 10 ns there, 200 in Python; the call about 4 us), if numpy is installed.
MIX_VECTOR_FROM = 20 if np is not None else 1 << 62
_S32, _S16 = (np.uint64(32), np.uint64(16)) if np is not None else (None, None)


def _mixed_all(keys: Sequence[int]) -> list[int]:
    """:func:`_mixed` of each of ``keys`` (64-bit unsigned ints)."""
    if len(keys) < MIX_VECTOR_FROM:
        out = []
        mix, u64 = _MIX, _U64
        for k in keys:
            m = k * mix & u64
            m ^= m >> 32
            out.append(m ^ m >> 16)
        return out
    a = np.array(keys, dtype=np.uint64)
    a *= np.uint64(_MIX)
    a ^= a >> _S32
    a ^= a >> _S16
    got: list[int] = a.tolist()
    return got


#: Maps per namespace table: see "Shards" above.
SHARDS = 64
#: Slots a mixed key's high bits pick among (a power of two), each naming a shard.
SLOTS = 1024
#: A mixed key's slot is ``m >> _SLOT_SHIFT``.
_SLOT_SHIFT = 64 - SLOTS.bit_length() + 1


def _slot_shards(shards: int, slots: int) -> tuple[int, ...]:
    """The shard of each slot: slot ``i < shards`` is shard ``i``, and shard
    ``i`` has slots in proportion to ``2 ** (i / shards)`` (largest
    remainders), dealt round so that each shard's slots are spread out.

    Uneven on purpose: with as many slots each, the shards fill alike and
    cross a dict's growth point together (see "Shards" above).
    """
    weights = [2 ** (i / shards) for i in range(shards)]
    total = sum(weights)
    exact = [slots * w / total for w in weights]
    counts = [int(x) for x in exact]
    for i in sorted(range(shards), key=lambda i: exact[i] - counts[i], reverse=True)[
        : slots - sum(counts)
    ]:
        counts[i] += 1
    out = list(range(shards))
    left = [c - 1 for c in counts]
    while len(out) < slots:
        for i in range(shards):
            if left[i]:
                out.append(i)
                left[i] -= 1
    return tuple(out)


_SLOT_SHARD = _slot_shards(SHARDS, SLOTS)

#: Maps of one instance's engine-hash map, and the slots naming them (as
#: the block tables', smaller: an instance holds a part of a namespace).
HASH_SHARDS = 16
HASH_SLOTS = 256
_HASH_SHIFT = 64 - HASH_SLOTS.bit_length() + 1
_HASH_SLOT_SHARD = _slot_shards(HASH_SHARDS, HASH_SLOTS)


def _map_from(items: Iterable[tuple[int, int]], capacity: int) -> PreshMap:
    """A map of ``items``, made with ``capacity`` cells (it grows as it fills)."""
    m = PreshMap(initial_size=capacity)
    for k, v in items:
        m[k] = v
    return m


def _map_items(m: PreshMap) -> tuple[Callable[..., PreshMap], tuple[list[tuple[int, int]], int]]:
    """How to copy or pickle a map (``copy.deepcopy`` of a whole index: the
    fault harness's shadow of one)."""
    return _map_from, (list(m.items()), m.capacity)


copyreg.pickle(PreshMap, _map_items)


def _shard_slots(slot_shard: tuple[int, ...], shards: int) -> tuple[tuple[int, ...], ...]:
    """The slots naming each shard (the inverse of :func:`_slot_shards`)."""
    out: list[list[int]] = [[] for _ in range(shards)]
    for slot, shard in enumerate(slot_shard):
        out[shard].append(slot)
    return tuple(map(tuple, out))


_SHARD_SLOTS = _shard_slots(_SLOT_SHARD, SHARDS)
_HASH_SHARD_SLOTS = _shard_slots(_HASH_SLOT_SHARD, HASH_SHARDS)

#: Deletions a map takes before it may be copied without their tombstones
#: (see "Tables" above), at least.
REBUILD_MIN = 64


def _rebuilt(old: PreshMap, live: int) -> PreshMap:
    """``old``'s entries in a new map sized for ``live`` of them (no tombstones)."""
    return _map_from(old.items(), max(8, 1 << (2 * live).bit_length()))


def _deleted(
    slots: list[PreshMap], dead: list[int], shard_slots: tuple[tuple[int, ...], ...], i: int
) -> None:
    """A deletion from shard ``i`` (of the maps named by ``slots``), counted in
    ``dead``; past half its entries (and :data:`REBUILD_MIN`) the shard is
    copied without its tombstones, in every slot naming it."""
    d = dead[i] = dead[i] + 1
    shard = slots[i]  # slot i < shards names shard i
    if d >= REBUILD_MIN and d * 2 > len(shard):
        new = _rebuilt(shard, len(shard) - d)
        for slot in shard_slots[i]:
            slots[slot] = new
        dead[i] = 0


class _HashMap:
    """One instance's engine hash -> ``place << 64 | content key``
    (``_Instance.nids``). Entries at place 0 (an instance's first namespace:
    nearly all) are in :data:`HASH_SHARDS` maps of 64-bit values by the mixed
    hash ("Tables" above), of uneven share like a namespace's block table
    ("Shards" above: as one dict, an engine's map of 90 k hashes grew in one
    step of up to 16 ms, about every 3 s of a 64-engine ingest; as one map, 4
    ms); the others, which do not fit 64 bits, in :attr:`other` by the hash
    itself. The hot path indexes :attr:`slots` itself while :attr:`other` is
    empty, and adds what it stores there to :attr:`n`; the rest goes through
    the dict methods it needs."""

    __slots__ = ("dead", "n", "other", "slots")

    def __init__(self) -> None:
        shards = [PreshMap() for _ in range(HASH_SHARDS)]
        #: Shard of each slot (``_mixed(h) >> _HASH_SHIFT``); slot ``i`` below
        #: HASH_SHARDS names shard ``i``.
        self.slots: list[PreshMap] = [shards[i] for i in _HASH_SLOT_SHARD]
        #: Entries at a place above 0, by engine hash.
        self.other: dict[int, int] = {}
        #: Entries in the shards.
        self.n = 0
        #: Deletions per shard since it was last copied (at least its tombstones).
        self.dead = [0] * HASH_SHARDS

    def get(self, h: int) -> int | None:
        m = _mixed(h)
        e: int | None = self.slots[m >> _HASH_SHIFT][m]
        if e is None and self.other:
            return self.other.get(h)
        return e

    def __setitem__(self, h: int, entry: int) -> None:
        m = _mixed(h)
        shard = self.slots[m >> _HASH_SHIFT]
        if entry >> 64:
            if m in shard:
                self._delete(shard, m)
            self.other[h] = entry
        else:
            if self.other:
                self.other.pop(h, None)
            if m not in shard:
                self.n += 1
            shard[m] = entry

    def __delitem__(self, h: int) -> None:
        m = _mixed(h)
        shard = self.slots[m >> _HASH_SHIFT]
        if m in shard:
            self._delete(shard, m)
        else:
            del self.other[h]

    @property
    def shards(self) -> list[PreshMap]:
        return self.slots[:HASH_SHARDS]

    def _delete(self, shard: PreshMap, m: int) -> None:
        del shard[m]
        self.n -= 1
        _deleted(self.slots, self.dead, _HASH_SHARD_SLOTS, _HASH_SLOT_SHARD[m >> _HASH_SHIFT])

    def __len__(self) -> int:
        return self.n + len(self.other)

    def __bool__(self) -> bool:
        return self.n > 0 or bool(self.other)

    def values(self) -> Iterator[int]:
        return chain(chain.from_iterable(d.values() for d in self.shards), self.other.values())

    def items(self) -> Iterator[tuple[int, int]]:
        return chain(
            ((_unmixed(m), e) for d in self.shards for m, e in d.items()), self.other.items()
        )


#: Answers of runs held alike kept made (MemoryIndex._alike_cache), at most.
ALIKE_CACHE_SIZE = 4096
#: Hits with predicted_depth kept made (MemoryIndex._pred_twins), at most.
PRED_TWINS_SIZE = 65536
#: Deeper hits one instance keeps made (_Instance.hits).
HIT_CACHE_SIZE = 64
#: Blocks a capped dump resolves between two turns of the loop.
DUMP_SLICE_BLOCKS = 4096
#: Expired predictions one call purges at most (see _purge_predictions).
PURGE_BUDGET = 4096
#: Predicted keys one instance holds at most when the caller names no cap
#: (the service passes limits.max_predicted_blocks_per_instance).
MAX_PREDICTED_PER_INSTANCE = 65536

#: A block table's entry: ``number << 3 | mask`` (one instance holds the
#: block: positive), or the signature of its holders (several do: negative;
#: their ``{number: mask}`` in the index's interned holder sets).
Holders = int


def _share(no: int, mask: int) -> int:
    """Instance ``no``'s share of a shared block's signature while it holds
    the block on tier ``mask`` (1..7): splitmix64 of ``no << 3 | mask``, 63 bits."""
    z = ((no << 3 | mask) + 0x9E3779B97F4A7C15) & _U64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _U64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _U64
    return (z ^ (z >> 31)) >> 1


def _signature(no: int) -> tuple[int, ...]:
    """Instance ``no``'s shares by tier mask 0..7 (0 for mask 0: not held)."""
    return (0, *(_share(no, mask) for mask in range(1, 8)))


def _holders_dict(holders: int, sets: dict[int, dict[int, int]]) -> dict[int, int]:
    """A block's holders as ``{number: mask}`` from its table entry (a new dict
    for one holder; the interned set, never to be changed, for several)."""
    if holders < _SHARED:
        return {holders >> 3: holders & 7}
    return sets[holders]


def _walk_alone(
    tables: list[PreshMap],
    sets: dict[int, dict[int, int]],
    keys: Sequence[int],
    start: int,
    n: int,
    counts: list[int],
) -> None:
    """Walk instance ``n`` on from ``keys[start]`` while it holds each block,
    adding to its ``counts`` (blocks by fastest tier)."""
    gpu_only = n << 3 | 1  # the usual entry: this instance alone, on the GPU
    gpu = 0
    # Keys mixed a chunk at a time: a walk may stop at the first.
    for lo in range(start, len(keys), WALK_CHUNK):
        for m in _mixed_all(keys[lo : lo + WALK_CHUNK]):
            h = tables[m >> _SLOT_SHIFT][m]
            if h == gpu_only:
                gpu += 1
                continue
            if h is None:
                break
            if h < _SHARED:
                if h >> 3 != n:
                    break
                counts[_FASTEST[h & 7]] += 1
            else:
                held = sets[h].get(n)
                if held is None:
                    break
                counts[_FASTEST[held]] += 1
        else:
            continue
        break
    counts[0] += gpu


#: Keys :func:`_walk_alone` mixes at a time.
WALK_CHUNK = 128

#: InstanceMatch fields 0 (instance), 2 (depth) and 8 (predicted_depth), for sorting in C.
_BY_INSTANCE = operator.itemgetter(0)
_BY_DEPTH = operator.itemgetter(2)
_BY_PREDICTED = operator.itemgetter(8)


_new_tuple = tuple.__new__


def _with_predicted(m: InstanceMatch, predicted_depth: int) -> InstanceMatch:
    """``m`` with ``predicted_depth`` (half the cost of ``_replace``)."""
    return _new_tuple(InstanceMatch, (*m[:8], predicted_depth))


def _no_depth1() -> list[InstanceMatch | None]:
    return [None] * 8


@dataclass(slots=True)
class _Instance:
    spec: InstanceSpec
    lease_expires_at: float
    #: ``(worker_id, dp_rank)`` as a plain tuple: the key of the instance table.
    key: tuple[str, int]
    #: The instance's number in holder entries (see the module docstring).
    no: int
    #: Its share of shared blocks' signatures by tier mask (_signature(no)).
    sig: tuple[int, ...] = ()
    stale: bool = False
    applied_sequence: int | None = None
    bits: int = 0
    #: engine hash -> ``place << 64 | content key``, the namespace's number
    #: being ``nids[place]`` (see "Memory" above: at place 0 an entry is the
    #: content key itself, no new int).
    engine_hashes: _HashMap = field(default_factory=_HashMap)
    #: Namespace numbers by place, in the order the instance first stored in
    #: them (one for most instances, one more per LoRA adapter).
    nids: list[int] = field(default_factory=list)
    #: The InstanceMatch of a depth-1 hit, by tier mask of block 0 (1..7): most
    #: holders of a shared first block go no deeper. Kept on the instance so
    #: that it goes with it (remove, reap) and is bounded by 7 per instance;
    #: replaced by a fresh list whenever the address or the stale flag changes.
    depth1: list[InstanceMatch | None] = field(default_factory=_no_depth1)
    #: The InstanceMatch of a deeper hit by its (gpu, cpu, disk) blocks: the
    #: holders of a shared prefix answer the same hits Match after Match, and
    #: building 64 of them was a third of a 32-block Match. Bounded by
    #: HIT_CACHE_SIZE; replaced whenever depth1 is (address, stale flag).
    hits: dict[tuple[int, int, int], InstanceMatch] = field(default_factory=dict)
    #: Batches that count copies (EventBatch.counts_copies): engine hash << 2 |
    #: tier index -> copies beyond the first, for (block, tier)s held twice or more.
    copies: dict[int, int] = field(default_factory=dict)
    #: Resets so far (a new incarnation or model): a long apply that paused
    #: stops if the instance was reset meanwhile.
    resets: int = 0
    #: The long batch being applied a slice at a time (MemoryIndex._apply_sliced):
    #: later applies of the instance wait for it.
    applying: asyncio.Future[ApplyResult] | None = None
    #: Quotas (indexer/index.py): the identity the instance counts under ('':
    #: none), its usage as last added to that identity's count (with the room
    #: a batch in flight reserved), and the LoRA namespaces it stored in since
    #: it was registered, reset or cleared (None: none).
    owner: str = ""
    counted: int = 0
    loras: set[Namespace] | None = None
    #: Route-time predictions (indexer/index.py, "Predictions"): namespace
    #: number << 64 | key -> expiry, oldest recorded first (None: none).
    predicted: dict[int, float] | None = None
    #: Predictions that stop counting as pending prefill before they expire
    #: (a router's ``pending_s``): entry -> when; ``(when, entry)`` soonest
    #: first; and the entries whose time has come, still predicted
    #: (pending_predicted counts ``predicted`` less these). None: none.
    pend_until: dict[int, float] | None = None
    pend_heap: list[tuple[float, int]] | None = None
    settled: set[int] | None = None


@dataclass(slots=True)
class _Owner:
    """What the instances of one identity hold, as the quotas count it."""

    instances: int = 0
    blocks: int = 0
    #: namespace -> how many of the identity's instances hold it.
    namespaces: dict[Namespace, int] = field(default_factory=dict)

    def hold(self, ns: Namespace) -> None:
        self.namespaces[ns] = self.namespaces.get(ns, 0) + 1

    def drop(self, ns: Namespace) -> None:
        left = self.namespaces[ns] - 1
        if left:
            self.namespaces[ns] = left
        else:
            del self.namespaces[ns]


_NO_QUOTA = Quota()


def _first_blocks(ev: BlockStored, k: int) -> BlockStored | None:
    """``ev`` cut to its first ``k`` blocks (None for none)."""
    if not k:
        return None
    return replace(
        ev,
        block_hashes=ev.block_hashes[:k],
        token_ids=ev.token_ids[: k * ev.block_size] if ev.block_size else ev.token_ids,
        block_keys=None if ev.block_keys is None else ev.block_keys[:k],
        extras=None if ev.extras is None else ev.extras[:k],
    )


#: Work of one slice of a long batch (MemoryIndex._apply_sliced), in entries:
#: a block stored or removed, or an entry cleared, is one; a stored block
#: costs one more for each TOKENS_PER_WORK of its tokens (its key is chained
#: from them). About a millisecond here at 16- and at 512-token blocks. A
#: batch of more is applied in slices; most batches are far below it.
SLICE_WORK = 2048
TOKENS_PER_WORK = 8


def _work(events: Sequence[Event], inst: _Instance) -> int:
    """Slice work of applying ``events`` to ``inst`` (see :data:`SLICE_WORK`)."""
    work = 0
    for ev in events:
        if isinstance(ev, BlockStored):
            per_block = 1 if ev.block_keys is not None else 1 + ev.block_size // TOKENS_PER_WORK
            work += len(ev.block_hashes) * per_block
        elif isinstance(ev, BlockRemoved):
            work += len(ev.block_hashes)
        elif isinstance(ev, AllBlocksCleared):
            work += len(inst.engine_hashes)
    return work


@dataclass(frozen=True, slots=True)
class _ClearSlice:
    """A run of an instance's engine-hash entries to drop, one slice of a clear."""

    entries: list[int]


def _retrieve(task: asyncio.Future[ApplyResult]) -> None:
    """Done callback of a long apply: its error is retrieved (its caller may be gone)."""
    if not task.cancelled():
        task.exception()


class MemoryIndex(Index):
    """The in-memory backend. ``clock`` returns seconds (tests pass a fake one)."""

    name = "memory"

    def __init__(self, *, clock: Callable[[], float] = time.time) -> None:
        self._clock = clock
        # Keyed by _Instance.key; an InstanceId finds its entry too (equal tuples).
        self._instances: dict[tuple[str, int], _Instance] = {}
        #: The same instances by number (holder entries name them so).
        self._by_no: dict[int, _Instance] = {}
        self._next_no = 1
        #: Per namespace, its block table: :data:`SLOTS` references to its
        #: :data:`SHARDS` maps, the first SHARDS of them each map once (a key
        #: in the map of slot ``_mixed(key) >> _SLOT_SHIFT``, by its mixed value).
        self._blocks: dict[Namespace, list[PreshMap]] = {}
        #: The holder sets of shared blocks, interned by signature (a shared
        #: block's table entry): ``{number: mask}``, one per distinct set
        #: however many blocks it holds, and never changed in place (a block
        #: whose holders change moves to another set). Apart so that the
        #: block table holds only ints: the garbage collector then never walks
        #: it (a dict value would make it tracked: 60 ms for a full walk of
        #: 721 k blocks); interned, so that what it walks is one entry per
        #: distinct set, not per shared block (a holder dict per shared block
        #: cost a full collection 64.5 ms at 1 M shared blocks; now 1.9 ms).
        self._sets: dict[int, dict[int, int]] = {}
        #: Per interned set's signature, per namespace number, the block keys
        #: whose entry it is, as ``{key: 1}`` (a dict of ints, which the
        #: collector does not track): a set goes with its last block, and
        #: Match tells whether a prompt's blocks are all held alike in one
        #: C-level pass over them. By namespace, since a client that gives
        #: block keys may give two namespaces the same ones.
        self._members: dict[int, dict[int, dict[int, int]]] = {}
        self._ns_pairs: dict[Namespace, int] = {}
        #: Blocks per namespace (a map's length counts its tombstones too), and
        #: deletions per shard of its table since the shard was last copied.
        self._ns_blocks: dict[Namespace, int] = {}
        self._dead: dict[Namespace, list[int]] = {}
        # Namespace numbers of engine-hash entries, and back (never reused).
        self._ns_ids: dict[Namespace, int] = {}
        self._ns_list: list[Namespace] = []
        # Match fast path: while clock() < _visible_until every registered
        # instance is live and fresh, so Match skips the per-holder checks.
        # Renewals only raise leases, so the bound stays valid through them;
        # anything that can make an instance visible again sets _dirty.
        self._visible_until = -math.inf
        self._dirty = True
        #: Moves with every registration, reset, removal and reap (Index.generation).
        self._gen = 0
        #: Per identity, what its instances hold (quotas, indexer/index.py).
        self._owners: dict[str, _Owner] = {}
        #: Followers of this index (WatchIndex): every applied change is
        #: published here when set (see "Watching" below); None: nobody may watch.
        self.watch: WatchHub | None = None
        #: Per namespace, the predicted holders of each key: ``{number: expiry}``
        #: (see "Predictions" below; each also in its _Instance.predicted).
        self._pred: dict[Namespace, dict[int, dict[int, float]]] = {}
        #: ``(expiry, number, entry)`` of every prediction recorded, soonest
        #: first, for the purge; an entry re-predicted or dropped since is skipped.
        self._pred_heap: list[tuple[float, int, int]] = []
        #: Predictions held (expired ones not purged yet included).
        self._pred_count = 0
        #: Instances that have held predictions, by number (pending_predicted):
        #: those that hold none any more, or are gone, leave at its next call.
        self._predicting: dict[int, _Instance] = {}
        #: Answers of runs held alike, by (the set's signature, depth): see
        #: _alike_answers (a prompt's shared prefix, asked again and again).
        self._alike_cache: dict[tuple[int, int], list[InstanceMatch]] = {}
        #: A hit with predictions asked for and none beyond it: by id of the
        #: hit (kept made, as hits are), the hit and its twin carrying
        #: predicted_depth = depth (the hit kept so that its id is not reused).
        self._pred_twins: dict[int, tuple[InstanceMatch, InstanceMatch]] = {}

    # -- instances -----------------------------------------------------------

    def _state(self, inst: _Instance, now: float) -> InstanceState:
        return InstanceState(
            spec=inst.spec,
            lease_expires_at=inst.lease_expires_at,
            live=inst.lease_expires_at > now,
            stale=inst.stale,
            applied_sequence=inst.applied_sequence,
            blocks=inst.bits,
        )

    async def register(self, spec: InstanceSpec) -> tuple[InstanceState, bool]:
        """Create or renew an instance (see :mod:`indexer.index`)."""
        now = self._clock()
        iid = spec.instance
        inst = self._instances.get(iid)
        old_model = inst.spec.model if inst is not None else None
        reset = False
        quota = spec.quota
        if quota is not None:
            spec = replace(spec, quota=None)
        if inst is None:
            owner = quota.identity if quota is not None else ""
            if owner:
                self._quota_check(owner, quota or _NO_QUOTA, Namespace(spec.model))
            key = (str(iid.worker_id), int(iid.dp_rank))
            no = self._next_no
            self._next_no += 1
            inst = _Instance(
                spec=spec,
                lease_expires_at=now + spec.lease_ttl_s,
                key=key,
                no=no,
                sig=_signature(no),
            )
            self._instances[key] = inst
            self._by_no[no] = inst
            if owner:
                self._quota_join(inst, owner)
            reset = True
        else:
            if inst.spec.incarnation != spec.incarnation or inst.spec.model != spec.model:
                if inst.owner and quota is not None and inst.spec.model != spec.model:
                    self._quota_check(inst.owner, quota, Namespace(spec.model), leaving=inst)
                self._clear(inst)
                self._quota_reset(inst, spec.model)
                inst.resets += 1
                inst.stale = False
                inst.applied_sequence = None
                reset = True
            if reset or inst.spec.address != spec.address:
                self._forget_hits(inst)
            inst.spec = spec
            inst.lease_expires_at = now + spec.lease_ttl_s
        self._renewed(inst.lease_expires_at)
        self._gen += 1
        if reset:
            self._dirty = True
        state = self._state(inst, now)
        if self.watch is not None and self.watch.active:
            if old_model is not None and old_model != spec.model:
                # Its followers of the old model see it leave (those of the new
                # one see it registered, reset).
                self.watch.publish("gone", Namespace(old_model), iid, 0, ("removed", now))
            self.watch.publish("registered", Namespace(spec.model), iid, 0, (state, reset, now))
        return state, reset

    async def heartbeat(self, instance: InstanceId) -> InstanceState:
        """Renew the lease; NotFound for an unknown instance."""
        inst = self._get(instance, NotFound)
        now = self._clock()
        inst.lease_expires_at = now + inst.spec.lease_ttl_s
        self._renewed(inst.lease_expires_at)
        if self.watch is not None and self.watch.active:
            self.watch.publish("renewed", Namespace(inst.spec.model), instance, 0, now)
        return self._state(inst, now)

    async def remove_instance(self, instance: InstanceId) -> int:
        """Drop an instance and its blocks; return the entries dropped."""
        inst = self._get(instance, NotFound)
        removed = self._clear(inst)
        self._quota_leave(inst)
        del self._instances[inst.key]
        del self._by_no[inst.no]
        self._alike_cache.clear()  # nothing kept of an instance gone
        self._dirty = True
        self._gen += 1
        if self.watch is not None and self.watch.active:
            self.watch.publish(
                "gone", Namespace(inst.spec.model), instance, 0, ("removed", self._clock())
            )
        return removed

    async def generation(self) -> int | None:
        """See :meth:`Index.generation`."""
        return self._gen

    async def list_instances(self, model: str = "") -> list[InstanceState]:
        """Registered instances, sorted by id."""
        now = self._clock()
        return [
            self._state(inst, now)
            for _, inst in sorted(self._instances.items())
            if not model or inst.spec.model == model
        ]

    async def reap_expired(self) -> list[InstanceId]:
        """Drop instances whose lease has expired."""
        now = self._clock()
        dead = [key for key, inst in self._instances.items() if inst.lease_expires_at <= now]
        gone = []
        for key in dead:
            inst = self._instances.pop(key)
            del self._by_no[inst.no]
            self._clear(inst)
            self._quota_leave(inst)
            gone.append(inst.spec.instance)
            if self.watch is not None and self.watch.active:
                self.watch.publish(
                    "gone", Namespace(inst.spec.model), inst.spec.instance, 0, ("expired", now)
                )
        if dead:
            self._alike_cache.clear()
            self._dirty = True
            self._gen += 1
        return sorted(gone)

    def _renewed(self, expires_at: float) -> None:
        if expires_at < self._visible_until:
            self._visible_until = expires_at
        elif self._visible_until == -math.inf:
            self._dirty = True  # a renewal may have revived an expired instance

    def _all_visible(self, now: float) -> bool:
        """Whether every instance is live and fresh now (cached; see __init__)."""
        if self._dirty or (now >= self._visible_until > -math.inf):
            self._dirty = False
            insts = self._instances.values()
            if any(i.stale for i in insts):
                self._visible_until = -math.inf
            else:
                until = min((i.lease_expires_at for i in insts), default=math.inf)
                self._visible_until = until if until > now else -math.inf
        return now < self._visible_until

    def _get(self, iid: InstanceId, err: type[NotFound] | type[FailedPrecondition]) -> _Instance:
        inst = self._instances.get(iid)
        if inst is None:
            raise err(f"instance {iid} is not registered", field="instance")
        return inst

    # -- events --------------------------------------------------------------

    async def apply(self, batch: EventBatch) -> ApplyResult:
        """Apply one batch (see :mod:`indexer.index`; a long one in slices, see below)."""
        inst = self._get(batch.instance, FailedPrecondition)
        while inst.applying is not None:
            # A long batch of this instance is still being applied: this one
            # comes after it (it may be a duplicate of it, or find it reset).
            await asyncio.shield(inst.applying)
            inst = self._get(batch.instance, FailedPrecondition)
        if batch.incarnation and batch.incarnation != inst.spec.incarnation:
            raise fenced_out(batch)
        if batch.address and batch.address != inst.spec.address:
            raise fenced_out(batch, "address")
        now = self._clock()
        inst.lease_expires_at = now + inst.spec.lease_ttl_s
        self._renewed(inst.lease_expires_at)
        last = inst.applied_sequence
        seq = batch.sequence
        if last is not None and seq <= last:
            return ApplyResult(BatchOutcome.DUPLICATE, last, stale=inst.stale)
        gap = last is not None and seq > last + 1
        over = 0
        if batch.quota is not None or inst.owner:
            batch, over = self._quota_walk(inst, batch)
        if _work(batch.events, inst) > SLICE_WORK:
            task = asyncio.ensure_future(self._apply_sliced(inst, batch, gap))
            inst.applying = task
            task.add_done_callback(_retrieve)
            # Shielded: a caller that gives up (a deadline, a closed stream)
            # does not stop the batch midway; it completes as a whole.
            result = await asyncio.shield(task)
        else:
            counts = [0, 0, 0]
            cleared = False
            for ev in batch.events:
                cleared |= self._apply_event(inst, ev, batch.counts_copies, counts)
            result = self._applied(inst, seq, gap, cleared, counts)
            self._recount(inst)
            if self.watch is not None and self.watch.active:
                self._watch_batch(inst, batch, now)
        return replace(result, blocks_over_quota=over) if over else result

    def _apply_event(
        self, inst: _Instance, ev: Event, counts_copies: bool, counts: list[int]
    ) -> bool:
        """Apply one event, adding to ``counts`` (stored, removed, orphaned); True for a clear."""
        if isinstance(ev, BlockStored):
            s, r, o = self._store(inst, ev, counts_copies)
            counts[0] += s
            counts[1] += r
            counts[2] += o
        elif isinstance(ev, BlockRemoved):
            mask = ALL_TIERS_MASK if ev.tier is None else ev.tier.bit
            copies = inst.copies if counts_copies else None
            removed = 0
            if not copies and not inst.copies and not inst.engine_hashes.other:
                removed = self._remove_hashes(inst, ev.block_hashes, mask)
            else:
                for h in ev.block_hashes:
                    m = mask if not copies else _uncopied(copies, h, mask)
                    if m:
                        removed += self._remove_hash(inst, h, m)
            counts[1] += removed
        elif isinstance(ev, AllBlocksCleared):
            counts[1] += self._clear(inst)
            return True
        return False

    def _applied(
        self, inst: _Instance, seq: int, gap: bool, cleared: bool, counts: list[int]
    ) -> ApplyResult:
        """Record batch ``seq`` as applied to ``inst``: its sequence and staleness."""
        inst.applied_sequence = seq
        stale = (inst.stale or gap) and not cleared
        if stale != inst.stale:
            inst.stale = stale
            self._forget_hits(inst)
            if stale:
                self._visible_until = -math.inf
            else:
                self._dirty = True
        outcome = BatchOutcome.APPLIED_AFTER_GAP if gap else BatchOutcome.APPLIED
        return ApplyResult(outcome, seq, counts[0], counts[1], counts[2], inst.stale)

    async def _apply_sliced(self, inst: _Instance, batch: EventBatch, gap: bool) -> ApplyResult:
        """Apply a long batch a slice at a time, giving the loop its turn between slices.

        Each event is cut into slices of about :data:`SLICE_WORK` (a stored
        chain into consecutive pieces, each chained after the last block of
        the one before; a removal into runs of hashes; a clear into runs of
        the instance's entries), and the loop's budget
        (:func:`indexer.pacing.loop_pacer`, shared with the ZMQ subscribers)
        is checked between slices: a Match or a health probe waits a budget,
        not the batch. A read meanwhile may see the batch applied up to some
        slice: blocks of a chain not yet stored, removals not yet made (what
        a replica lagging by part of a batch answers). The batch's outcome,
        counts and sequence are the whole batch's. Should the instance be
        removed, reaped or reset while the batch waits for its turn, the rest
        is not applied (the batch was applied before the instance went, which
        drops it): the outcome is as if it had been, without a sequence.
        """
        try:
            return await self._apply_slices(inst, batch, gap)
        finally:
            inst.applying = None  # later applies of the instance may go on
            self._recount(inst)

    async def _apply_slices(self, inst: _Instance, batch: EventBatch, gap: bool) -> ApplyResult:
        pacer = loop_pacer()
        resets = inst.resets
        counts = [0, 0, 0]
        cleared = False
        outcome = BatchOutcome.APPLIED_AFTER_GAP if gap else BatchOutcome.APPLIED
        for ev in batch.events:
            done = 0  # blocks of a stored chain applied so far
            for piece in self._slices(inst, ev):
                await pacer.pace()
                if self._instances.get(inst.key) is not inst or inst.resets != resets:
                    return ApplyResult(
                        outcome, batch.sequence, counts[0], counts[1], counts[2], inst.stale
                    )
                if isinstance(piece, _ClearSlice):
                    counts[1] += self._clear_entries(inst, piece.entries)
                    continue
                if isinstance(piece, AllBlocksCleared):
                    if inst.predicted:
                        self._drop_predictions(inst)
                    inst.engine_hashes = _HashMap()
                    inst.nids = []
                    inst.copies.clear()
                    inst.bits = 0
                    cleared = True
                    continue
                before = counts[2]
                self._apply_event(inst, piece, batch.counts_copies, counts)
                if isinstance(piece, BlockStored):
                    done += len(piece.block_hashes)
                    if counts[2] > before:  # an unknown parent: every block is an orphan
                        assert isinstance(ev, BlockStored)
                        counts[2] += len(ev.block_hashes) - done
                        break
        result = self._applied(inst, batch.sequence, gap, cleared, counts)
        if self.watch is not None and self.watch.active:
            self._watch_batch(inst, batch, self._clock())
        return result

    def _slices(self, inst: _Instance, ev: Event) -> Iterator[Event | _ClearSlice]:
        """``ev`` as consecutive pieces of about :data:`SLICE_WORK` (see _apply_sliced)."""
        if isinstance(ev, BlockStored):
            n = len(ev.block_hashes)
            bs = ev.block_size if ev.block_keys is None else 0
            step = max(1, SLICE_WORK // (1 + bs // TOKENS_PER_WORK))
            for i in range(0, n, step):
                yield event_piece(ev, i, i + step)
        elif isinstance(ev, BlockRemoved):
            n = len(ev.block_hashes)
            for i in range(0, n, SLICE_WORK):
                yield event_piece(ev, i, i + SLICE_WORK)
        elif isinstance(ev, AllBlocksCleared):
            entries = list(inst.engine_hashes.values())
            for i in range(0, len(entries), SLICE_WORK):
                yield _ClearSlice(entries[i : i + SLICE_WORK])
            yield ev
        else:
            yield ev

    def _tables(self, ns: Namespace) -> list[PreshMap]:
        """The shards of ``ns``'s block table by slot (made on first use)."""
        tables = self._blocks.get(ns)
        if tables is None:
            shards = [PreshMap() for _ in range(SHARDS)]
            tables = self._blocks[ns] = [shards[i] for i in _SLOT_SHARD]
            self._dead[ns] = [0] * SHARDS
            self._ns_blocks[ns] = 0
        return tables

    def _delete(self, ns: Namespace, table: PreshMap, m: int) -> None:
        """Block ``m`` (mixed) of ``ns`` goes from ``table``; a shard that has
        taken as many deletions as half its entries is copied without their
        tombstones ("Tables" above)."""
        del table[m]
        self._ns_blocks[ns] -= 1
        _deleted(self._blocks[ns], self._dead[ns], _SHARD_SLOTS, _SLOT_SHARD[m >> _SLOT_SHIFT])

    def _moved(
        self, nid: int, key: int, old: int, new: int, held: dict[int, int], no: int, mask: int
    ) -> int:
        """Block ``key`` of namespace number ``nid`` leaves the set of
        signature ``old`` (0: it was held by one instance, ``held`` then the
        new set) for the set ``held`` with ``no`` at ``mask`` (0: without
        ``no``), of signature ``new``; returns ``new``. The new set is made (a
        copy) only when no block holds it yet."""
        by_ns = self._members.get(new)
        if by_ns is None:
            if old:
                held = dict(held)
                if mask:
                    held[no] = mask
                else:
                    del held[no]
            self._sets[new] = held
            self._members[new] = {nid: {key: 1}}
        else:
            members = by_ns.get(nid)
            if members is None:
                by_ns[nid] = {key: 1}
            else:
                members[key] = 1
        if old:
            self._unref(nid, old, key)
        return new

    def _unref(self, nid: int, sig: int, key: int) -> None:
        """Block ``key`` of namespace number ``nid`` no longer holds the set of
        signature ``sig``."""
        by_ns = self._members[sig]
        members = by_ns[nid]
        del members[key]
        if not members:
            del by_ns[nid]
            if not by_ns:
                del self._members[sig]
                del self._sets[sig]

    def _ns_id(self, ns: Namespace) -> int:
        nid = self._ns_ids.get(ns)
        if nid is None:
            nid = self._ns_ids[ns] = len(self._ns_list)
            self._ns_list.append(ns)
        return nid

    def _store(
        self, inst: _Instance, ev: BlockStored, counts_copies: bool = False
    ) -> tuple[int, int, int]:
        ns = Namespace(inst.spec.model, ev.lora_name)
        nid = self._ns_id(ns)
        try:
            place = inst.nids.index(nid)
        except ValueError:
            place = len(inst.nids)
            inst.nids.append(nid)
        hmap = inst.engine_hashes
        ehs = hmap.slots
        if ev.block_keys is not None:
            keys: Sequence[int] = ev.block_keys
        else:
            if ev.parent_block_hash is None:
                parent = namespace_seed(ns.model, ns.lora_name)
            else:
                mapped = hmap.get(ev.parent_block_hash)
                if mapped is None or mapped >> 64 != place:
                    return 0, 0, len(ev.block_hashes)
                parent = mapped & _U64
            keys = chain_keys(parent, ev.token_ids, ev.block_size, encoded_extras(ev.extras))
        tables = self._tables(ns)
        sets = self._sets
        bit = ev.tier.bit
        base = place << 64
        no = inst.no
        sig = inst.sig
        mine = no << 3 | bit
        stored = removed = pairs = fresh = added = 0
        # Entries at place 0 with none elsewhere (nearly always): straight
        # into the shards; otherwise through the map's methods.
        direct = not base and not hmap.other
        hashes = ev.block_hashes
        n = min(len(hashes), len(keys))
        # Added up after the loop; a re-keyed hash may drop a pair meanwhile.
        self._ns_pairs.setdefault(ns, 0)
        for h, key, mh, m in zip(
            hashes, keys, _mixed_all(hashes[:n]), _mixed_all(keys[:n]), strict=False
        ):
            if direct:
                mine_hs = ehs[mh >> _HASH_SHIFT]
                prev = mine_hs[mh]
                if prev != key:
                    if prev is None:
                        mine_hs[mh] = key
                        added += 1
                    else:
                        # A re-keyed hash (its shard may be copied meanwhile).
                        removed += self._remove_hash(inst, h, ALL_TIERS_MASK)
                        hmap[h] = key
            else:
                entry = base | key
                prev = hmap.get(h)
                if prev != entry:
                    if prev is not None:
                        removed += self._remove_hash(inst, h, ALL_TIERS_MASK)
                    hmap[h] = entry
            table = tables[m >> _SLOT_SHIFT]
            cur = table[m]
            if cur is None:
                table[m] = mine
                pairs += 1
                stored += 1
                fresh += 1
            elif cur < _SHARED:
                if cur >> 3 != no:
                    new = _share(cur >> 3, cur & 7) ^ sig[bit] ^ _SHARED
                    table[m] = self._moved(nid, key, 0, new, {cur >> 3: cur & 7, no: bit}, no, bit)
                    pairs += 1
                    stored += 1
                elif not cur & bit:
                    table[m] = cur | bit
                    stored += 1
                elif counts_copies:
                    k = h << 2 | (ev.tier.value - 1)
                    inst.copies[k] = inst.copies.get(k, 0) + 1
            else:
                held = sets[cur]
                old = held.get(no, 0)
                if not old & bit:
                    if not old:
                        pairs += 1
                    new = cur ^ sig[old] ^ sig[old | bit]
                    table[m] = self._moved(nid, key, cur, new, held, no, old | bit)
                    stored += 1
                elif counts_copies:
                    k = h << 2 | (ev.tier.value - 1)
                    inst.copies[k] = inst.copies.get(k, 0) + 1
        hmap.n += added
        if pairs:
            self._ns_pairs[ns] += pairs
        if fresh:
            self._ns_blocks[ns] += fresh
        inst.bits += stored
        if inst.predicted:
            self._confirm(inst, nid << 64, keys[: len(ev.block_hashes)])
        return stored, removed, 0

    def _remove_hash(self, inst: _Instance, h: int, mask: int) -> int:
        entry = inst.engine_hashes.get(h)
        if entry is None:
            return 0
        ns, key = self._ns_list[inst.nids[entry >> 64]], entry & _U64
        tables = self._blocks.get(ns)
        old = new = 0
        if tables is not None:
            m = _mixed(key)
            table = tables[m >> _SLOT_SHIFT]
            holders = table[m]
            if holders is not None:
                old, new = self._drop(ns, table, m, key, holders, inst, mask)
        if not new:
            del inst.engine_hashes[h]
        if inst.copies:
            for t in range(3):
                if mask >> t & 1:
                    inst.copies.pop(h << 2 | t, None)
        cleared = _POPCOUNT[old] - _POPCOUNT[new]
        inst.bits -= cleared
        return cleared

    def _remove_hashes(self, inst: _Instance, hashes: Sequence[int], mask: int) -> int:
        """:meth:`_remove_hash` of each of ``hashes``, for an instance with
        every entry at place 0 and no copies counted: the hashes mixed in one
        step, then the keys they name; a block this instance alone holds is
        dropped here, the rest by :meth:`_drop`."""
        hmap = inst.engine_hashes
        slots = hmap.slots
        # By mixed hash: a hash given twice is dropped once.
        found = {
            mh: key
            for mh in _mixed_all(hashes)
            if (key := slots[mh >> _HASH_SHIFT][mh]) is not None
        }
        if not found:
            return 0
        ns = self._ns_list[inst.nids[0]]
        tables = self._blocks[ns]
        dead, hdead = self._dead[ns], hmap.dead
        no = inst.no
        cleared = blocks = hashes_gone = 0
        for (mh, key), m in zip(found.items(), _mixed_all(list(found.values())), strict=True):
            table = tables[m >> _SLOT_SHIFT]
            holders = table[m]
            old = new = 0
            if holders is None:
                pass
            elif holders < _SHARED:
                if holders >> 3 == no:
                    old = holders & 7
                    new = old & ~mask
                    if new:
                        table[m] = no << 3 | new
                    else:
                        del table[m]
                        blocks += 1
                        _deleted(tables, dead, _SHARD_SLOTS, _SLOT_SHARD[m >> _SLOT_SHIFT])
            else:
                old, new = self._drop(ns, table, m, key, holders, inst, mask)
            if not new:
                del slots[mh >> _HASH_SHIFT][mh]
                hashes_gone += 1
                _deleted(slots, hdead, _HASH_SHARD_SLOTS, _HASH_SLOT_SHARD[mh >> _HASH_SHIFT])
            cleared += _POPCOUNT[old] - _POPCOUNT[new]
        hmap.n -= hashes_gone
        if blocks:
            self._ns_blocks[ns] -= blocks
            self._ns_pairs[ns] -= blocks
        inst.bits -= cleared
        return cleared

    def _drop(
        self,
        ns: Namespace,
        table: PreshMap,
        m: int,
        key: int,
        holders: Holders,
        inst: _Instance,
        mask: int,
    ) -> tuple[int, int]:
        """Clear ``mask`` of ``inst`` on block ``key`` (``m`` its mixed value,
        in ``table``): (old mask, new mask)."""
        no = inst.no
        if holders < _SHARED:
            if holders >> 3 != no:
                return 0, 0
            old = holders & 7
            new = old & ~mask
            if new:
                table[m] = no << 3 | new
            else:
                self._delete(ns, table, m)
                self._ns_pairs[ns] -= 1
            return old, new
        held = self._sets[holders]
        old = held.get(no, 0)
        if not old:
            return 0, 0
        new = old & ~mask
        if new == old:
            return old, new  # none of those tiers held: the block stays in its set
        if not new:
            self._ns_pairs[ns] -= 1
            if len(held) == 2:
                # One holder is left: the block leaves the shared sets.
                ((n, left),) = ((n, t) for n, t in held.items() if n != no)
                table[m] = n << 3 | left
                self._unref(self._ns_ids[ns], holders, key)
                return old, new
        sig = holders ^ inst.sig[old] ^ inst.sig[new]
        table[m] = self._moved(self._ns_ids[ns], key, holders, sig, held, no, new)
        return old, new

    def _clear(self, inst: _Instance) -> int:
        removed = self._clear_entries(inst, inst.engine_hashes.values())
        if inst.predicted:
            self._drop_predictions(inst)
        inst.engine_hashes = _HashMap()
        inst.nids = []
        inst.copies.clear()
        inst.bits = 0
        return removed

    def _clear_entries(self, inst: _Instance, entries: Iterable[int]) -> int:
        """Drop ``inst``'s holder bits of the engine-hash ``entries`` (its maps stay)."""
        removed = 0
        ns_list = self._ns_list
        nids = inst.nids
        blocks = self._blocks
        for entry in entries:
            ns = ns_list[nids[entry >> 64]]
            tables = blocks.get(ns)
            if tables is None:
                continue
            key = entry & _U64
            m = _mixed(key)
            table = tables[m >> _SLOT_SHIFT]
            holders = table[m]
            if holders is None:
                continue
            old, _ = self._drop(ns, table, m, key, holders, inst, ALL_TIERS_MASK)
            removed += _POPCOUNT[old]
        return removed

    # -- watching (WatchIndex) -----------------------------------------------

    def _watch_batch(self, inst: _Instance, batch: EventBatch, now: float) -> None:
        """Publish a batch as applied: what the quota walk let through, without
        its fences (its followers hold the registration it applied under)."""
        assert self.watch is not None
        applied = replace(batch, incarnation="", address="", quota=None)
        self.watch.publish(
            "batch", Namespace(inst.spec.model), inst.spec.instance, batch.sequence, (applied, now)
        )

    async def watch_snapshot(
        self, models: frozenset[str]
    ) -> AsyncIterator[tuple[int, float, InstanceState, EventBatch]]:
        """Each instance of ``models`` (empty: all) as ``(position, time, state,
        content)``: ``content`` the stores that give an empty instance its blocks
        (see the proto's WatchedInstance), read while the instance's applies wait,
        a slice at a time; ``position`` the hub's when it was read. Subscribe
        first: a follower applies an instance's changes after its position only.

        An instance registered after the call started is not in it: its changes
        (its registration first) are all after the subscription. One reset or
        removed while it is read is read again, or left out.
        """
        assert self.watch is not None
        for key in sorted(self._instances):
            while True:
                inst = self._instances.get(key)
                if inst is None or (models and inst.spec.model not in models):
                    break
                if inst.applying is not None:
                    with contextlib.suppress(Exception):
                        await asyncio.shield(inst.applying)
                    continue
                got = await self._read_instance(inst)
                if got is not None:
                    yield got
                    break

    async def _read_instance(
        self, inst: _Instance
    ) -> tuple[int, float, InstanceState, EventBatch] | None:
        """One instance for :meth:`watch_snapshot`, or None when it was reset or
        removed meanwhile. Its applies wait on ``inst.applying`` until it is read."""
        assert self.watch is not None
        gate: asyncio.Future[ApplyResult] = asyncio.get_running_loop().create_future()
        inst.applying = gate
        resets = inst.resets
        try:
            hashes = inst.engine_hashes
            entries = list(hashes.items())
            copies = list(inst.copies.items())
            # (lora, tier) -> (hashes, keys)
            runs: dict[tuple[str, Tier], tuple[list[int], list[int]]] = {}
            ns_list = self._ns_list
            no = inst.no
            for lo in range(0, len(entries), DUMP_SLICE_BLOCKS):
                if lo:
                    await asyncio.sleep(0)
                    if (
                        self._instances.get(inst.key) is not inst
                        or inst.resets != resets
                        or inst.engine_hashes is not hashes  # cleared: its places went too
                    ):
                        return None
                for h, entry in entries[lo : lo + DUMP_SLICE_BLOCKS]:
                    ns = ns_list[inst.nids[entry >> 64]]
                    key = entry & _U64
                    tables = self._blocks.get(ns)
                    if tables is None:
                        continue
                    m = _mixed(key)
                    held = tables[m >> _SLOT_SHIFT][m]
                    if held is None:
                        continue
                    if held < _SHARED:
                        mask = held & 7 if held >> 3 == no else 0
                    else:
                        mask = self._sets[held].get(no, 0)
                    for tier in Tier:
                        if mask & tier.bit:
                            run = runs.setdefault((ns.lora_name, tier), ([], []))
                            run[0].append(h)
                            run[1].append(key)
            extra = []
            for k, n in copies:
                h, tier = k >> 2, Tier((k & 3) + 1)
                found = inst.engine_hashes.get(h)
                if found is not None:
                    lora = ns_list[inst.nids[found >> 64]].lora_name
                    extra.append((h, found & _U64, lora, tier, n))
            events = keyed_stores(runs, extra)
            now = self._clock()
            state = self._state(inst, now)
            content = EventBatch(
                inst.spec.instance, inst.applied_sequence or 0, tuple(events), counts_copies=True
            )
            return self.watch.position, now, state, content
        finally:
            inst.applying = None
            gate.set_result(ApplyResult(BatchOutcome.DUPLICATE, inst.applied_sequence or 0))

    async def load_instance(self, state: InstanceState, content: EventBatch) -> None:
        """Hold an instance as a snapshot gave it (a follower's copy): registered
        anew with ``state``'s spec, its blocks from ``content``, its applied
        sequence, staleness and lease as ``state`` says.

        The lease is the snapshot's, not a fresh one: an instance whose lease
        ran out at the replica before it was reaped must not come back for a
        whole lease period in the copy (the replica's renewals reach the copy
        as changes).
        """
        spec = state.spec
        if spec.instance in self._instances:
            await self.remove_instance(spec.instance)  # it starts empty
        await self.register(spec)
        inst = self._get(spec.instance, NotFound)
        inst.lease_expires_at = state.lease_expires_at
        self._visible_until = -math.inf
        self._dirty = True
        if content.events:
            counts = [0, 0, 0]
            for ev in content.events:
                self._apply_event(inst, ev, True, counts)
            self._recount(inst)
        inst.applied_sequence = state.applied_sequence
        if state.stale != inst.stale:
            inst.stale = state.stale
            self._forget_hits(inst)
            self._visible_until = -math.inf
            self._dirty = True

    def renewed_at(self, instance: InstanceId, at: float) -> None:
        """The instance's lease as renewed at ``at`` by another index (a
        follower's copy: the replica's time of the change, not the copy's).

        A copy that applies a change late would otherwise renew from its own
        clock, and keep an instance the replica has let expire for that much
        longer.
        """
        inst = self._instances.get(instance)
        if inst is None:
            return
        expires = at + inst.spec.lease_ttl_s
        if expires < inst.lease_expires_at:
            # Lowered: the fast path's bound may no longer hold (see _visible_until).
            self._visible_until = -math.inf
            self._dirty = True
        inst.lease_expires_at = expires

    # -- quotas (indexer/index.py, "Quotas") ----------------------------------

    def _quota_check(
        self, owner: str, quota: Quota, ns: Namespace, leaving: _Instance | None = None
    ) -> None:
        """Refuse a new instance of ``owner`` serving namespace ``ns`` beyond ``quota``
        (``leaving``: an instance of it moving to ``ns`` from its namespaces)."""
        o = self._owners.get(owner)
        if o is None:
            return
        if leaving is None and quota.max_instances and o.instances >= quota.max_instances:
            raise ResourceExhausted(
                f"identity {owner!r} already holds {o.instances} instances, its quota",
                field="quotas.max_instances_per_identity",
            )
        cap = quota.max_namespaces
        if not cap or ns in o.namespaces:
            return
        held = len(o.namespaces)
        if leaving is not None:
            # The namespaces only the resetting instance holds go with the reset.
            mine = [Namespace(leaving.spec.model), *(leaving.loras or ())]
            held -= sum(1 for m in mine if o.namespaces.get(m) == 1)
        if held >= cap:
            raise ResourceExhausted(
                f"identity {owner!r} already holds {held} namespaces, its quota",
                field="quotas.max_namespaces_per_identity",
            )

    def _quota_join(self, inst: _Instance, owner: str) -> None:
        o = self._owners.get(owner)
        if o is None:
            o = self._owners[owner] = _Owner()
        o.instances += 1
        o.hold(Namespace(inst.spec.model))
        inst.owner = owner

    def _release_loras(self, inst: _Instance, o: _Owner) -> None:
        for ns in inst.loras or ():
            o.drop(ns)
        inst.loras = None

    def _quota_reset(self, inst: _Instance, model: str) -> None:
        """A reset (just cleared) of ``inst`` to ``model``: its LoRA namespaces and
        blocks leave its owner's count, the model's namespace follows."""
        o = self._owners.get(inst.owner) if inst.owner else None
        if o is not None:
            self._release_loras(inst, o)
            if model != inst.spec.model:
                o.drop(Namespace(inst.spec.model))
                o.hold(Namespace(model))
            o.blocks -= inst.counted
        inst.loras = None
        inst.counted = 0

    def _quota_leave(self, inst: _Instance) -> None:
        """``inst`` goes (removed, reaped): everything it counted leaves its owner."""
        o = self._owners.get(inst.owner) if inst.owner else None
        if o is None:
            return
        self._release_loras(inst, o)
        o.drop(Namespace(inst.spec.model))
        o.blocks -= inst.counted
        o.instances -= 1
        if not o.instances:
            del self._owners[inst.owner]

    def _recount(self, inst: _Instance) -> None:
        """Bring ``inst``'s share of its owner's count to its usage (after an apply)."""
        if self._instances.get(inst.key) is not inst:
            return  # removed, reaped: nothing of it counts any more
        used = max(inst.bits, len(inst.engine_hashes))
        if used != inst.counted:
            if inst.owner:
                self._owners[inst.owner].blocks += used - inst.counted
            inst.counted = used

    def _quota_walk(self, inst: _Instance, batch: EventBatch) -> tuple[EventBatch, int]:
        """The batch as its quota admits it, and the blocks it leaves out; the room
        it takes is reserved in the owner's count until :meth:`_recount`."""
        q = batch.quota or _NO_QUOTA
        o = self._owners.get(inst.owner) if inst.owner else None
        used = peak = max(inst.bits, len(inst.engine_hashes))
        per_inst = q.max_blocks_per_instance
        per_owner = q.max_blocks if o is not None else 0
        owned = o.blocks if o is not None else 0
        events: list[Event | None] | None = None
        over = 0
        for i, ev in enumerate(batch.events):
            if isinstance(ev, AllBlocksCleared):
                if o is not None:
                    self._release_loras(inst, o)
                owned -= used
                used = 0
                continue
            if not isinstance(ev, BlockStored) or ev.lora_name in q.free_loras:
                continue
            n = keep = len(ev.block_hashes)
            if ev.lora_name and o is not None:
                ns = Namespace(inst.spec.model, ev.lora_name)
                if inst.loras is None or ns not in inst.loras:
                    cap = q.max_namespaces
                    if cap and ns not in o.namespaces and len(o.namespaces) >= cap:
                        keep = 0
                    else:
                        if inst.loras is None:
                            inst.loras = set()
                        inst.loras.add(ns)
                        o.hold(ns)
            if keep and per_inst:
                keep = min(keep, per_inst - used)
            if keep and per_owner:
                keep = min(keep, per_owner - owned)
            keep = max(keep, 0)
            if keep < n:
                over += n - keep
                if events is None:
                    events = list(batch.events)
                events[i] = _first_blocks(ev, keep)
            used += keep
            owned += keep
            peak = max(peak, used)
        if peak > inst.counted:
            if o is not None:
                o.blocks += peak - inst.counted
            inst.counted = peak
        if events is None:
            return batch, 0
        return replace(batch, events=tuple(e for e in events if e is not None)), over

    async def quota_usage(self, identity: str) -> QuotaUsage:
        """See :meth:`Index.quota_usage`."""
        o = self._owners.get(identity)
        if o is None:
            return QuotaUsage()
        return QuotaUsage(o.instances, len(o.namespaces), o.blocks)

    # -- predictions (indexer/index.py, "Predictions") -----------------------

    def _holds(self, ns: Namespace, key: int, no: int) -> bool:
        """Whether instance ``no`` holds ``key`` of ``ns`` confirmed (any tier)."""
        tables = self._blocks.get(ns)
        if tables is None:
            return False
        m = _mixed(key)
        h: int | None = tables[m >> _SLOT_SHIFT][m]
        if h is None:
            return False
        if h < _SHARED:
            return h >> 3 == no
        return no in self._sets[h]

    def _drop_prediction(self, inst: _Instance, entry: int) -> None:
        """Forget ``inst``'s prediction of ``entry`` (namespace number << 64 | key)."""
        assert inst.predicted is not None
        del inst.predicted[entry]
        self._pred_count -= 1
        if inst.pend_until is not None:
            inst.pend_until.pop(entry, None)
            if inst.settled:
                inst.settled.discard(entry)
        ns = self._ns_list[entry >> 64]
        table = self._pred[ns]
        key = entry & _U64
        holders = table[key]
        del holders[inst.no]
        if not holders:
            del table[key]
            if not table:
                del self._pred[ns]

    def _drop_predictions(self, inst: _Instance) -> None:
        """Forget every prediction of ``inst`` (a clear, a reset, its removal)."""
        for entry in list(inst.predicted or ()):
            self._drop_prediction(inst, entry)
        self._none_predicted(inst)

    @staticmethod
    def _none_predicted(inst: _Instance) -> None:
        """``inst`` holds no prediction any more."""
        inst.predicted = None
        inst.pend_until = inst.pend_heap = inst.settled = None

    def _confirm(self, inst: _Instance, base: int, keys: Sequence[int]) -> None:
        """Stored ``keys`` (namespace number ``base``) are held: their predictions go."""
        predicted = inst.predicted
        assert predicted is not None
        for key in keys:
            entry = base | key
            if entry in predicted:
                self._drop_prediction(inst, entry)
        if not predicted:
            self._none_predicted(inst)

    def _purge_predictions(self, now: float, budget: int = PURGE_BUDGET) -> None:
        """Drop predictions expired by ``now``, soonest first, at most ``budget``
        heap entries a call: each entry is pushed once and popped once, so the
        purge costs the records their own share, never a Match more."""
        heap = self._pred_heap
        by_no = self._by_no
        while heap and heap[0][0] <= now and budget:
            budget -= 1
            expiry, no, entry = heapq.heappop(heap)
            inst = by_no.get(no)
            if inst is None or inst.predicted is None:
                continue
            if inst.predicted.get(entry) == expiry:
                self._drop_prediction(inst, entry)
                if not inst.predicted:
                    self._none_predicted(inst)

    async def predict(
        self,
        namespace: Namespace,
        instance: InstanceId,
        keys: Sequence[int],
        ttl_s: float,
        max_per_instance: int,
        pending_s: float | None = None,
    ) -> int:
        """See :meth:`Index.predict`."""
        return self.predict_sync(namespace, instance, keys, ttl_s, max_per_instance, pending_s)

    def predict_sync(
        self,
        namespace: Namespace,
        instance: InstanceId,
        keys: Sequence[int],
        ttl_s: float,
        max_per_instance: int = MAX_PREDICTED_PER_INSTANCE,
        pending_s: float | None = None,
    ) -> int:
        """Synchronous :meth:`predict`, on the index's clock. O(len(keys)) plus
        the purge's share."""
        now = self._clock()
        inst = self._instances.get(instance)
        if inst is None or inst.lease_expires_at <= now:
            raise NotFound(f"instance {instance} is not registered and live", field="instance")
        if namespace.model != inst.spec.model:
            raise FailedPrecondition(
                f"instance {instance} serves model {inst.spec.model!r}, not {namespace.model!r}",
                field="model",
            )
        self._purge_predictions(now)
        expiry = now + ttl_s
        base = self._ns_id(namespace) << 64
        table = self._pred.get(namespace)
        if table is None:
            table = self._pred[namespace] = {}
        predicted = inst.predicted
        if predicted is None:
            predicted = inst.predicted = {}
            self._predicting[inst.no] = inst
        no = inst.no
        recorded = 0
        heap = self._pred_heap
        # Pending for less than the prediction lives: each key's deadline, kept
        # apart (None: pending while it lives, the keys' older deadlines go).
        until = None if pending_s is None or pending_s >= ttl_s else now + max(0.0, pending_s)
        pend_until = inst.pend_until
        if until is not None and pend_until is None:
            pend_until = inst.pend_until = {}
            inst.pend_heap = []
            inst.settled = set()
        pend_heap, settled = inst.pend_heap, inst.settled
        if pend_heap:
            # Deadlines come due here too, not only where the figure is read: the
            # heap holds the predictions of one pending window, read or not.
            self._settle(inst, now)
        watch = self.watch
        told: list[int] | None = [] if watch is not None and watch.predicting else None
        for key in keys:
            if self._holds(namespace, key, no):
                continue
            if told is not None:
                told.append(key)
            entry = base | key
            if predicted.pop(entry, None) is None:
                self._pred_count += 1
            predicted[entry] = expiry  # the newest last
            holders = table.get(key)
            if holders is None:
                holders = table[key] = {}
            holders[no] = expiry
            heapq.heappush(heap, (expiry, no, entry))
            if pend_until is not None:
                assert pend_heap is not None and settled is not None
                settled.discard(entry)
                if until is None:
                    pend_until.pop(entry, None)
                else:
                    pend_until[entry] = until
                    heapq.heappush(pend_heap, (until, entry))
            recorded += 1
        while len(predicted) > max_per_instance:
            self._drop_prediction(inst, next(iter(predicted)))
        if not predicted:
            self._none_predicted(inst)
        if not table and namespace in self._pred:
            del self._pred[namespace]
        if told:
            assert watch is not None
            watch.publish(
                "predicted",
                Namespace(inst.spec.model),
                instance,
                0,
                (namespace.lora_name, told, expiry, max_per_instance, now, until or 0.0),
            )
        return recorded

    def model_of(self, instance: InstanceId) -> str | None:
        """The model ``instance`` is registered for (None: not registered)."""
        inst = self._instances.get(instance)
        return None if inst is None else inst.spec.model

    def watch_predicted(self, instance: InstanceId) -> list[tuple[str, list[int], float, float]]:
        """``instance``'s route-time predictions as ``(lora name, keys, expiry,
        pending until)`` runs, oldest first (a follower's snapshot: recorded in
        this order after its blocks, they give it the same predictions; pending
        until 0: pending while they live, a past time: no longer pending).
        Synchronous: call it in the step that read the instance's blocks."""
        inst = self._instances.get(instance)
        out: list[tuple[str, list[int], float, float]] = []
        if inst is None or not inst.predicted:
            return out
        ns_list = self._ns_list
        pend_until = inst.pend_until or {}
        settled = inst.settled or set()
        now = self._clock()
        last: tuple[int, float, float] | None = None
        for entry, expiry in inst.predicted.items():
            until = pend_until.get(entry, now if entry in settled else 0.0)
            at = (entry >> 64, expiry, until)
            if at != last:
                out.append((ns_list[at[0]].lora_name, [], expiry, until))
                last = at
            out[-1][1].append(entry & _U64)
        return out

    async def pending_predicted(self, model: str) -> dict[InstanceId, int]:
        """See :meth:`Index.pending_predicted`."""
        return self.pending_predicted_sync(model)

    def pending_predicted_sync(self, model: str) -> dict[InstanceId, int]:
        """Synchronous :meth:`pending_predicted`, on the index's clock: a purge's
        share, then a look at each instance holding predictions (a store of a
        key drops its prediction, so what is left is unconfirmed). O(instances
        with predictions); a prediction that expired but is not purged yet
        still counts (the purge drains them soonest first, a budget a call)."""
        now = self._clock()
        self._purge_predictions(now)
        out: dict[InstanceId, int] = {}
        by_no = self._by_no
        gone: list[int] = []
        for no, inst in self._predicting.items():
            predicted = inst.predicted
            if not predicted or by_no.get(no) is not inst:
                gone.append(no)
            elif inst.spec.model == model and inst.lease_expires_at > now and not inst.stale:
                n = len(predicted)
                if inst.pend_heap is not None:
                    n -= self._settle(inst, now)
                if n > 0:
                    out[inst.spec.instance] = n
        for no in gone:
            del self._predicting[no]
        return out

    @staticmethod
    def _settle(inst: _Instance, now: float) -> int:
        """How many of ``inst``'s predictions no longer count as pending at
        ``now`` (their deadline passed); amortised O(1) a prediction."""
        heap, until, settled = inst.pend_heap, inst.pend_until, inst.settled
        assert heap is not None and until is not None and settled is not None
        while heap and heap[0][0] <= now:
            when, entry = heapq.heappop(heap)
            if until.get(entry) == when:  # not re-predicted or dropped since
                del until[entry]
                settled.add(entry)
        return len(settled)

    def _match_predicted(
        self, namespace: Namespace, keys: Sequence[int], include_stale: bool
    ) -> list[InstanceMatch]:
        """Match with ``include_predicted``: the confirmed answer, each hit with its
        ``predicted_depth``, plus the instances holding ``keys[0]`` by prediction.

        Each candidate walks on from its confirmed depth while a key is
        predicted for it (a dict look-up) or held: the cost is the confirmed
        Match plus one step per candidate and per predicted block, whatever
        the number of expired predictions (those met are skipped by expiry).
        """
        hits = self.match_sync(namespace, keys, include_stale=include_stale)
        now = self._clock()
        self._purge_predictions(now)
        table = self._pred.get(namespace)
        if not keys:
            return hits
        twins = self._pred_twins
        if len(twins) > PRED_TWINS_SIZE:
            twins.clear()
        if table is None:
            return [self._twin(h) for h in hits]  # nothing predicted in the namespace
        instances = self._instances
        by_no = self._by_no
        n_keys = len(keys)
        out: list[InstanceMatch] = []
        deeper = False
        # Hits come deepest first, most of them at a few depths (runs held
        # alike): the predictions at the key after a depth are looked up once.
        last = -1
        nxt: dict[int, float] | None = None
        for h in hits:
            d = h.depth
            if d != last:
                last = d
                nxt = table.get(keys[d]) if d < n_keys else None
            # Most hits end where nothing is predicted: one look-up settles them.
            if nxt is not None and (no := instances[h.instance].no) in nxt:
                d = self._walk_predicted(namespace, table, keys, no, d, n_keys, now)
                if d != h.depth:
                    out.append(_with_predicted(h, d))
                    deeper = True
                    continue
            out.append(self._twin(h))
        first = table.get(keys[0])
        extra: list[InstanceMatch] = []
        held: set[InstanceId] | None = None
        for no, expiry in (first or {}).items():
            if expiry <= now:
                continue
            inst = by_no[no]
            if held is None:
                held = {h.instance for h in hits}
            if inst.spec.instance in held:
                continue
            if inst.lease_expires_at <= now or (inst.stale and not include_stale):
                continue
            d = self._walk_predicted(namespace, table, keys, no, 0, n_keys, now)
            extra.append(
                InstanceMatch(inst.spec.instance, inst.spec.address, 0, 0, 0, 0, inst.stale, 0, d)
            )
        if extra:
            extra.sort(key=_BY_INSTANCE)
            out += extra
            deeper = True
        if deeper:
            # (-depth, -predicted_depth, instance): the hits come by (-depth,
            # instance) and the extra ones (depth 0) by instance, so two stable
            # C-level sorts order them (a key function per hit cost a fifth of
            # a 32-block Match with 64 holders).
            out.sort(key=_BY_PREDICTED, reverse=True)
            out.sort(key=_BY_DEPTH, reverse=True)
        return out

    def _twin(self, h: InstanceMatch) -> InstanceMatch:
        """``h`` with predicted_depth = depth, made once per hit object."""
        got = self._pred_twins.get(id(h))
        if got is None or got[0] is not h:
            got = self._pred_twins[id(h)] = (h, _with_predicted(h, h.depth))
        return got[1]

    def _walk_predicted(
        self,
        namespace: Namespace,
        table: dict[int, dict[int, float]],
        keys: Sequence[int],
        no: int,
        depth: int,
        n_keys: int,
        now: float,
    ) -> int:
        """How far instance ``no`` holds ``keys`` confirmed or predicted from
        ``depth`` (its confirmed depth: ``keys[depth]`` is not held)."""
        d = depth
        get = table.get
        while d < n_keys:
            key = keys[d]
            holders = get(key)
            predicted = holders is not None and holders.get(no, 0.0) > now
            if not predicted and not (d > depth and self._holds(namespace, key, no)):
                break
            d += 1
        return d

    # -- reads ---------------------------------------------------------------

    async def match(
        self,
        namespace: Namespace,
        keys: Sequence[int],
        *,
        include_stale: bool = False,
        include_predicted: bool = False,
    ) -> list[InstanceMatch]:
        """Per-instance longest gap-free prefix of ``keys``, deepest first."""
        if include_predicted:
            return self._match_predicted(namespace, keys, include_stale)
        return self.match_sync(namespace, keys, include_stale=include_stale)

    def match_sync(
        self,
        namespace: Namespace,
        keys: Sequence[int],
        *,
        include_stale: bool = False,
        include_predicted: bool = False,
    ) -> list[InstanceMatch]:
        """Synchronous :meth:`match`, for in-process callers and benchmarks."""
        if include_predicted:
            return self._match_predicted(namespace, keys, include_stale)
        tables = self._blocks.get(namespace)
        if tables is None or not keys:
            return []
        m = _mixed(keys[0])
        first = tables[m >> _SLOT_SHIFT][m]
        if first is None:
            return []
        sets = self._sets
        by_no = self._by_no
        now = self._clock()
        # candidates: visible holders of block 0 -> their tier mask there
        cand = _holders_dict(first, sets)
        if not self._all_visible(now):
            cand = {
                n: mask
                for n, mask in cand.items()
                if (i := by_no[n]).lease_expires_at > now and (include_stale or not i.stale)
            }
            if not cand:
                return []
        # Block 1 splits the candidates: those that go no deeper are settled
        # with C-level set operations, the rest walk on with tier counters.
        active: dict[int, list[int]] = {}
        nxt = None
        if len(keys) > 1:
            m = _mixed(keys[1])
            nxt = tables[m >> _SLOT_SHIFT][m]
        all_gpu: dict[int, int] | None = None
        # The table entry (signature) of a block held exactly by the walkers,
        # each on the GPU alone, once one was seen (None: not known).
        alike: int | None = None
        depth = 2
        n_keys = len(keys)
        if nxt is not None:
            holders = _holders_dict(nxt, sets)
            if len(holders) > 1 and holders == cand and cand == (all_gpu := dict.fromkeys(cand, 1)):
                # A shared prefix's usual start: the same holders of blocks 0
                # and 1, each on the GPU alone (two C-level ==). The run they
                # hold alike is walked once; where it ends at a block nobody
                # holds (or at the prompt's end), every answer is that depth.
                alike = nxt
                depth += self._run_alike(namespace, alike, keys, 2)
                if depth == n_keys or (m := _mixed(keys[depth])) not in tables[m >> _SLOT_SHIFT]:
                    return self._alike_answers(cand, depth, alike)
                active = {n: [depth, 0, 0] for n in cand}
            else:
                all_gpu = None
                small, big = (holders, cand) if len(holders) < len(cand) else (cand, holders)
                for n in small:
                    if n in big:
                        counts = [0, 0, 0]
                        counts[_FASTEST[cand[n]]] += 1
                        counts[_FASTEST[holders[n]]] += 1
                        active[n] = counts
        # Ordered by instance id, as every answer is (numbers follow registration).
        shallow = cand.keys() - active.keys() if active else cand.keys()
        shallow_order = sorted(shallow, key=lambda n: by_no[n].key)
        done: list[tuple[int, list[int]]] = []
        if len(active) == 1:
            # One instance walks on (a conversation's own blocks): no dict to narrow.
            ((n, counts),) = active.items()
            _walk_alone(tables, sets, keys, depth, n, counts)
        else:
            # A shared prefix: while the block's holders are exactly the walkers,
            # each on the GPU alone (C-level checks), one counter stands for
            # everyone's GPU count; a walker takes it when it stops.
            common = 0
            # {walker: GPU-only mask}: a block held exactly so is one C-level ==.
            if all_gpu is None:
                all_gpu = dict.fromkeys(active, 1)
            while active and depth < n_keys:
                if len(active) == 1:
                    # The shared prefix is behind: the last walker goes on alone.
                    ((n, counts),) = active.items()
                    counts[0] += common
                    common = 0
                    _walk_alone(tables, sets, keys, depth, n, counts)
                    break
                if alike is not None:
                    run = self._run_alike(namespace, alike, keys, depth)
                    common += run
                    depth += run
                    if depth == n_keys:
                        break
                m = _mixed(keys[depth])
                h = tables[m >> _SLOT_SHIFT][m]
                if h is None:
                    break
                if h < _SHARED:
                    n1 = h >> 3
                    counts1 = active.pop(n1, None)
                    for n, counts in active.items():
                        counts[0] += common
                        done.append((n, counts))
                    active = {}
                    if counts1 is not None:
                        counts1[_FASTEST[h & 7]] += 1
                        active[n1] = counts1
                elif (hs := sets[h]) == all_gpu:
                    common += 1
                    alike = h
                else:
                    for n, counts in list(active.items()):
                        held = hs.get(n)
                        if held is None:
                            counts[0] += common
                            done.append((n, counts))
                            del active[n]
                        else:
                            counts[_FASTEST[held]] += 1
                    if len(all_gpu) != len(active):
                        all_gpu = dict.fromkeys(active, 1)
                        alike = None
                depth += 1
            for counts in active.values():
                counts[0] += common
        done.extend(active.items())
        out = []
        for n, counts in done:
            inst = by_no[n]
            tiers = (counts[0], counts[1], counts[2])
            hit = inst.hits.get(tiers)
            if hit is None:
                if len(inst.hits) >= HIT_CACHE_SIZE:
                    inst.hits.clear()
                g, c, d = tiers
                hit = inst.hits[tiers] = InstanceMatch(
                    inst.spec.instance, inst.spec.address, g + c + d, g, c, d, inst.stale
                )
            out.append(hit)
        # By depth (deepest first), then instance: two C-level stable sorts,
        # not a Python key per hit.
        out.sort(key=_BY_INSTANCE)
        out.sort(key=_BY_DEPTH, reverse=True)
        for n in shallow_order:
            mask = cand[n]
            inst = by_no[n]
            cache = inst.depth1
            hit = cache[mask]
            if hit is None:
                g, c, d = _DEPTH1_TIERS[mask]
                hit = cache[mask] = InstanceMatch(
                    inst.spec.instance, inst.spec.address, 1, g, c, d, inst.stale
                )
            out.append(hit)
        return out

    def _run_alike(self, ns: Namespace, sig: int, keys: Sequence[int], start: int) -> int:
        """How many of ``keys`` from ``start`` on have the entry ``sig`` in
        ``ns`` (its set's members there): one C-level pass, no Python step per
        block."""
        members = self._members[sig].get(self._ns_ids[ns])
        if members is None:
            return 0
        rest = keys[start:]
        if len(rest) > 1:
            # The whole rest held alike (a shared prefix to the prompt's end):
            # one C-level lookup each, about half of takewhile's cost.
            try:
                operator.itemgetter(*rest)(members)
            except KeyError:
                pass
            else:
                return len(rest)
        return len(list(takewhile(members.__contains__, rest)))

    def _forget_hits(self, inst: _Instance) -> None:
        """``inst``'s answers change (its address or staleness, a reset): drop the
        ones made (its own, and every answer of runs held alike)."""
        inst.depth1, inst.hits = _no_depth1(), {}
        self._alike_cache.clear()

    def _alike_answers(
        self, holders: dict[int, int], depth: int, sig: int | None = None
    ) -> list[InstanceMatch]:
        """Every one of ``holders`` holds the prompt's first ``depth`` blocks,
        each on the GPU: their answers, ordered by instance (equal depths).

        With ``sig``, the holders are exactly the members of the interned set
        ``sig`` (each on the GPU alone): the answer is kept by ``(sig, depth)``
        and a copy returned, until an answer of any instance changes
        (:meth:`_forget_hits`; a set's members never change under its
        signature, and instance numbers are never reused)."""
        if sig is not None:
            got = self._alike_cache.get((sig, depth))
            if got is not None:
                return list(got)
        out = self._alike_made(holders, depth)
        if sig is not None:
            cache = self._alike_cache
            if len(cache) >= ALIKE_CACHE_SIZE:
                cache.clear()
            cache[(sig, depth)] = out
            return list(out)
        return out

    def _alike_made(self, holders: dict[int, int], depth: int) -> list[InstanceMatch]:
        by_no = self._by_no
        tiers = (depth, 0, 0)
        out = []
        for n in holders:
            inst = by_no[n]
            hit = inst.hits.get(tiers)
            if hit is None:
                if len(inst.hits) >= HIT_CACHE_SIZE:
                    inst.hits.clear()
                hit = inst.hits[tiers] = InstanceMatch(
                    inst.spec.instance, inst.spec.address, depth, depth, 0, 0, inst.stale
                )
            out.append(hit)
        out.sort(key=_BY_INSTANCE)
        return out

    def pairs_by_model(self) -> dict[str, int]:
        """(block, instance) pairs held per model, every LoRA name together (cheap:
        one counter per namespace)."""
        out: dict[str, int] = {}
        for ns, pairs in self._ns_pairs.items():
            if pairs:
                out[ns.model] = out.get(ns.model, 0) + pairs
        return out

    async def stats(self) -> IndexStats:
        """Sizes of the whole index."""
        now = self._clock()
        st = IndexStats(backend=self.name, instances=len(self._instances))
        for inst in self._instances.values():
            st.instances_live += inst.lease_expires_at > now
            st.instances_stale += inst.stale
        for ns in sorted(self._blocks, key=str):
            n_blocks = self._ns_blocks[ns]
            if not n_blocks:
                continue
            pairs = self._ns_pairs.get(ns, 0)
            st.namespaces.append(NamespaceStats(ns, n_blocks, pairs))
            st.blocks += n_blocks
            st.block_instances += pairs
        self._purge_predictions(now, budget=len(self._pred_heap))
        st.predicted_blocks = self._pred_count
        return st

    async def dump_blocks(
        self, model: str, cap: int
    ) -> tuple[list[tuple[Namespace, int, dict[InstanceId, int]]], bool]:
        """See :meth:`Index.dump_blocks`: the smallest keys of one namespace at a
        time (ints), the holders of at most ``cap`` blocks.

        It gives way to the loop between shards and every
        :data:`DUMP_SLICE_BLOCKS` blocks (a capped dump of a million-block index
        held the loop for a second in one step, and every Match waited), so the
        answer is not one moment of the index: a block or holder removed while
        it runs is left out, and a block's holders are as they were when read.
        """
        out: list[tuple[Namespace, int, dict[InstanceId, int]]] = []
        for ns in sorted(self._blocks):
            if model and ns.model != model:
                continue
            want = cap - len(out)
            # The want + 1 smallest keys (one more than fits: whether the answer
            # is cut short), merged shard by shard: a sorted run plus one shard.
            best: list[int] = []
            for shard in range(SHARDS):
                now = self._blocks.get(ns)
                if now is None:
                    break  # the namespace emptied meanwhile
                best = sorted(chain(best, map(_unmixed, now[shard])))[: want + 1]
                await asyncio.sleep(0)
            tables = self._blocks.get(ns) or []
            taken = 0
            for i, key in enumerate(best):
                if taken == want:
                    return out, True
                if i % DUMP_SLICE_BLOCKS == 0:
                    if i:
                        await asyncio.sleep(0)
                    now = self._blocks.get(ns)
                    if now is None:
                        break  # the namespace emptied meanwhile
                    tables = now
                    ids = {no: inst.spec.instance for no, inst in self._by_no.items()}
                m = _mixed(key)
                h = tables[m >> _SLOT_SHIFT][m]
                if h is None:
                    continue  # removed meanwhile
                holders = _holders_dict(h, self._sets)
                named = {ids[n]: m for n, m in holders.items() if n in ids}
                if named:
                    out.append((ns, key, named))
                    taken += 1
        return out, False

    async def dump(self) -> IndexDump:
        """The whole content in canonical form."""
        now = self._clock()
        ids = {no: inst.spec.instance for no, inst in self._by_no.items()}
        ns_list = self._ns_list
        blocks = {
            ns: {
                _unmixed(k): {ids[i]: m for i, m in _holders_dict(h, self._sets).items()}
                for table in tables[:SHARDS]
                for k, h in table.items()
            }
            for ns, tables in self._blocks.items()
            if self._ns_blocks[ns]
        }
        return IndexDump(
            blocks=blocks,
            engine_hashes={
                inst.spec.instance: {
                    h: (ns_list[inst.nids[e >> 64]], e & _U64)
                    for h, e in inst.engine_hashes.items()
                }
                for inst in self._instances.values()
                if inst.engine_hashes
            },
            instances={
                inst.spec.instance: replace(self._state(inst, now))
                for inst in self._instances.values()
            },
        )
