"""KV-cache groups: what each group of an engine holds, and vLLM's hit rule over them.

A hybrid model's engine keeps one KV cache per *group* of layers (vLLM
``group_idx``): full attention, sliding window, Mamba state. Each group
publishes its own ``BlockStored`` / ``BlockRemoved`` under the same block
hashes, and a group may hold a block in more than one physical copy (two
requests that computed the same block before either was cached). What the
engine reuses for a prompt (vLLM ``HybridKVCacheCoordinator``) is:

1. the longest prefix of blocks the **full-attention** groups hold, at most
   ``(num_tokens - 1) // block`` blocks (the last token is always computed);
2. cut back until every **sliding-window** group holds the
   ``ceil((window - 1) / block)`` blocks ending at the hit (its rightmost such
   run at or before the hit; failing any, the run it holds from block 0), and
   every **Mamba** group holds the block the hit ends at (its rightmost held
   block at or before the hit);
3. repeated until no group cuts it further (a fixed point).

**Hash units finer than the block.** An engine may hash in units smaller than
its blocks (vLLM ``hash_block_size``, e.g. 16 tokens under 64-token blocks
with a Mamba group in ``align`` mode). Its hits then end on any unit
boundary: step 1 goes on past the whole blocks into the next block, to the
last unit the full-attention group holds a *partial-block entry* for (at
most ``num_tokens - 1`` tokens), and step 2 takes each Mamba group's
rightmost state at unit granularity. vLLM publishes such an entry as a
``BlockStored`` whose ``block_size`` is the unit: one hash (the prefix's hash
at that unit), the unit's tokens, the previous unit's hash as parent. The
rule is unit-granular only when every non-full group is a Mamba group (vLLM
turns it off for a sliding-window group); otherwise those entries cannot be
hit and only whole blocks count.

The content key of a prefix ending inside block ``j + 1`` is kvmesh's block
key ``k_j`` of the whole blocks before it, chained unit by unit over the rest
(:func:`kvmesh.blockkeys.chain_keys` at the unit, each unit with the extra
keys of its tokens): a Match derives it from the prompt's tokens, the
tracker from an entry's parent. An entry whose parent is a unit no event
keyed (a tail two or three units into a block: vLLM publishes the tokens of
the units before it in no event) cannot be keyed; it is counted as
``partial_unplaced`` and kept by its engine hash instead. A Match reaches it
through vLLM's own hash of the prompt (indexer/enginehash.py): the tracker
computes the prompt's engine hashes once it has seen one of them reproduce a
hash the instance published for a unit of the same prompt's first block (which
algorithm and ``NONE_HASH`` seed the engine hashes with is learned that way,
never assumed). Until then, and for prompts it cannot compute (a LoRA: the
adapter's path is in vLLM's hash, not in a Match), the hit is cut to what is
known (under, never over).

:class:`GroupTracker` keeps, per instance fed through this replica, the
content keys every non-full group holds and the partial-block entries of the
full-attention groups, each with its copies. It filters each batch before the
index sees it: a full-attention block leaves the index only when its last
copy goes (a removal the tracker has no count for passes, so a replica that
restarted under-reports at worst); the other groups' events and every
partial-block entry never reach the index (they are not matchable by
themselves) and feed the hit rule, :meth:`GroupTracker.hit`, applied to
Match depths. Their content keys are chained here from the events' tokens
(the full-attention group's events teach the parent keys), only for
instances that announced a non-full group. An engine hash's key is kept
while some group holds a copy of it, then among the instance's newest
:data:`RECENT_KEYS` others (a later tail may name it as parent), so the
tracker's memory follows what the engine holds, not all it ever stored.

Limits: the state is this replica's. Another replica answering Match for a
hybrid instance it does not ingest has no group presence, so it leaves the
instance out (the marker block of indexer/logic.py ``HYBRID_LORA`` tells it
which instances are hybrid): under-reporting, never over. Groups whose kind has another
hit rule (chunked local attention, encoder-only, cross attention) are counted
as skipped and left out.
"""

from __future__ import annotations

from collections.abc import Callable, Container, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from indexer.enginehash import EngineHasher, candidates, unit_extras
from indexer.model import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    Event,
    InstanceId,
    encoded_extras,
)
from kvmesh.blockkeys import KEY_MASK, chain_keys, namespace_seed, prompt_extras

_MISSING = object()

#: Group kinds whose blocks make a prefix matchable.
FULL_KINDS = frozenset({"", "full_attention", "mla_attention", "sink_full_attention"})
SLIDING_KINDS = frozenset({"sliding_window", "sliding_window_mla"})
MAMBA_KINDS = frozenset({"mamba"})

#: Keys of hashes no group holds any more that one instance keeps, at most.
RECENT_KEYS = 4096

#: Marks a remembered content key chained at the hash unit (a prefix that ends
#: inside a block), as opposed to a block key: bit 64, above every key.
_UNIT = 1 << 64


@dataclass(frozen=True, slots=True)
class GroupSpec:
    """One non-full group of an engine: its kind and sliding window (tokens)."""

    kind: str
    window: int = 0


@dataclass(slots=True)
class _Instance:
    #: Non-full groups: group index -> its spec.
    specs: dict[int, GroupSpec] = field(default_factory=dict)
    #: Non-full groups: group index -> block key -> copies.
    held: dict[int, dict[int, int]] = field(default_factory=dict)
    #: Any group: group index -> key of a prefix ending inside a block -> copies
    #: (partial-block entries; a full-attention group's never reach the index).
    units: dict[int, dict[int, int]] = field(default_factory=dict)
    #: Engine hash -> content key (| _UNIT when chained at the hash unit),
    #: learned from stored events of a hybrid instance.
    keys: dict[int, int] = field(default_factory=dict)
    #: Engine hash -> stores of it not yet removed, over every group and copy:
    #: its ``keys`` entry goes with the last, into ``recent``.
    refs: dict[int, int] = field(default_factory=dict)
    #: Keys of hashes no group holds any more, the newest :data:`RECENT_KEYS`: a
    #: partial-block entry may still name one as its parent (a unit published by
    #: an earlier request's tail and evicted since).
    recent: dict[int, int] = field(default_factory=dict)
    #: The engine's hash unit in tokens, from its partial-block entries (0: none seen).
    unit: int = 0
    #: Any group: group index -> engine hash -> copies of partial-block entries
    #: whose parent no event keyed (found by the prompt's engine hashes).
    loose: dict[int, dict[int, int]] = field(default_factory=dict)
    #: How the engine hashes, once one of its hashes was reproduced (None: not yet).
    hasher: EngineHasher | None = None
    #: The instance's model (the namespace its groups are of).
    model: str = ""


@dataclass(slots=True)
class Filtered:
    """A batch's events as the index must see them, and what was left out (by reason)."""

    events: tuple[Event, ...]
    skipped: dict[str, int] = field(default_factory=dict)
    #: How to undo what filtering counted (GroupTracker.rollback), newest last.
    undo: list[Callable[[], None]] = field(default_factory=list)


class Prompt:
    """A Match's prompt as the hit rule reads it.

    ``keys``: its block keys (of ``block_size`` tokens). ``tokens`` (None when
    the query gave block keys): its token ids, from which the keys of prefixes
    ending inside a block are derived when an engine hashes in finer units,
    with ``seed`` (the namespace seed) and the request's ``cache_salt`` and
    ``media`` as for block keys. ``limit``: the most tokens the engine may
    reuse (``len(tokens) - 1`` for a whole prompt: it computes the last
    token); default ``len(keys) x block_size``.
    """

    __slots__ = (
        "_engine",
        "_units",
        "block_size",
        "cache_salt",
        "keys",
        "limit",
        "lora_name",
        "media",
        "seed",
        "tokens",
    )

    def __init__(
        self,
        keys: Sequence[int],
        block_size: int,
        *,
        tokens: Sequence[int] | None = None,
        seed: int = 0,
        cache_salt: str = "",
        media: Sequence[tuple[str, int, int]] = (),
        limit: int | None = None,
        lora_name: str = "",
    ) -> None:
        self.keys = keys
        self.block_size = block_size
        self.tokens = tokens
        self.seed = seed
        self.cache_salt = cache_salt
        self.media = media
        self.limit = len(keys) * block_size if limit is None else limit
        self.lora_name = lora_name
        # (hasher, unit) -> the prompt's engine hashes as that hasher gives them
        self._engine: dict[tuple[EngineHasher, int], EngineUnits] = {}
        # unit -> (extras of every unit, or None; block index -> its unit keys)
        self._units: dict[int, tuple[list[bytes] | None, dict[int, list[int]]]] = {}

    def n_units(self, unit: int) -> int:
        """Whole hash units of ``unit`` tokens in the prompt."""
        n = len(self.tokens) if self.tokens is not None else len(self.keys) * self.block_size
        return n // unit

    def unit_key(self, k: int, unit: int) -> int | None:
        """Key of the prefix of ``k`` units of ``unit`` tokens, chained at the unit after
        the whole blocks before its last unit; None without token ids."""
        if self.tokens is None or k <= 0:
            return None
        per = self.block_size // unit
        j = (k - 1) // per  # the block the unit is in (0-based)
        cached = self._units.get(unit)
        if cached is None:
            n = self.n_units(unit)
            cached = self._units[unit] = (
                prompt_extras(n, unit, self.cache_salt, self.media),
                {},
            )
        extras, blocks = cached
        keys = blocks.get(j)
        if keys is None:
            parent = self.seed if j == 0 else self.keys[j - 1]
            start = j * self.block_size
            ex = extras[j * per : (j + 1) * per] if extras is not None else None
            keys = blocks[j] = chain_keys(
                parent, self.tokens[start : start + self.block_size], unit, ex
            )
        i = (k - 1) % per
        return keys[i] if i < len(keys) else None

    def engine_hashes(
        self, hasher: EngineHasher, unit: int, ends: dict[int, bytes] | None = None
    ) -> EngineUnits | None:
        """vLLM's hashes of the prompt's units as ``hasher`` computes them (low 64 bits,
        by unit index, computed as asked: :class:`EngineUnits`); None without token ids
        or for a LoRA prompt (vLLM hashes the adapter's path, which a Match lacks).
        ``ends``: full hashes at the ends of whole blocks other Matches computed, by
        the block's content key (read and added to)."""
        if self.tokens is None or self.lora_name:
            return None
        got = self._engine.get((hasher, unit))
        if got is None:
            got = self._engine[(hasher, unit)] = EngineUnits(
                self, hasher, unit, {} if ends is None else ends
            )
        return got


#: Block ends (full engine hashes by content key) a tracker remembers per way of
#: hashing, at most: what makes a Match of a known prefix hash one block, not all.
ENDS_CACHE = 65536


class EngineUnits:
    """A prompt's vLLM hashes (low 64 bits) by hash-unit index, computed a block at a
    time when asked, each block on from the nearest block end known: this prompt's,
    or one an earlier Match left in ``ends`` under the block's content key (the key
    names the block's whole prefix, salt and media included, as the hash does)."""

    __slots__ = ("_blocks", "_ends", "_extras", "_full", "_hasher", "_n", "_per", "_prompt")

    def __init__(
        self, prompt: Prompt, hasher: EngineHasher, unit: int, ends: dict[int, bytes]
    ) -> None:
        self._prompt = prompt
        self._hasher = hasher
        self._per = prompt.block_size // unit
        self._n = prompt.n_units(unit)
        self._ends = ends
        self._extras = unit_extras(self._n, unit, prompt.cache_salt, prompt.media)
        # block -> its units' hashes; block -> the full hash at its end
        self._blocks: dict[int, list[int]] = {}
        self._full: dict[int, bytes] = {}

    def __len__(self) -> int:
        return self._n

    def __getitem__(self, i: int) -> int:
        if not 0 <= i < self._n:
            raise IndexError(i)
        j = i // self._per
        got = self._blocks.get(j)
        if got is None:
            got = self._block(j)
        return got[i - j * self._per]

    def _block(self, j: int) -> list[int]:
        keys = self._prompt.keys
        b = j - 1
        start = self._hasher.none_hash
        while b >= 0:
            known = self._full.get(b)
            if known is None and b < len(keys):
                known = self._ends.get(keys[b])
            if known is not None:
                start = known
                break
            b -= 1
        per = self._per
        unit = self._prompt.block_size // per
        tokens = self._prompt.tokens
        assert tokens is not None
        for c in range(b + 1, j + 1):
            first, last = c * per, min((c + 1) * per, self._n)
            low, full = self._hasher.units(tokens, unit, last, self._extras, (first, start))
            self._blocks[c] = low
            if last == (c + 1) * per:
                start = self._full[c] = full[-1]
                if c < len(keys) and keys[c] not in self._ends:
                    if len(self._ends) >= ENDS_CACHE:
                        del self._ends[next(iter(self._ends))]  # the oldest
                    self._ends[keys[c]] = start
        return self._blocks[j]


class GroupTracker:
    """Group presence of the instances this replica ingests (see the module docstring)."""

    def __init__(self, seeds: Sequence[str] = ()) -> None:
        #: The ways an engine may hash, tried in order (indexer/enginehash.py).
        self._hashers = candidates(seeds)
        # (hasher, unit) -> full engine hashes at block ends, by content key (EngineUnits)
        self._ends: dict[tuple[EngineHasher, int], dict[int, bytes]] = {}
        self._by: dict[InstanceId, _Instance] = {}
        self._hybrids = 0  # instances with a non-full group
        # How to undo what the last filter() changed, newest last.
        self._undo: list[Callable[[], None]] = []

    def forget(self, instance: InstanceId) -> None:
        """The instance was reset, removed or reaped: its groups start empty."""
        st = self._by.pop(instance, None)
        if st is not None and st.specs:
            self._hybrids -= 1

    def hybrid_any(self) -> bool:
        """Whether any instance announced a group other than full attention."""
        return self._hybrids > 0

    def remembered(self, instance: InstanceId) -> tuple[int, int]:
        """Engine hashes whose content keys the tracker keeps for the instance: those
        some group holds, and the recent others (at most :data:`RECENT_KEYS`)."""
        st = self._by.get(instance)
        return (0, 0) if st is None else (len(st.keys), len(st.recent))

    def hybrid(self, instance: InstanceId) -> bool:
        """Whether the instance announced a group other than full attention."""
        st = self._by.get(instance)
        return st is not None and bool(st.specs)

    def filter(
        self,
        instance: InstanceId,
        model: str,
        events: Sequence[Event],
        block_size: int,
    ) -> Filtered:
        """The events of one validated batch, as the index applies them.

        ``block_size`` is the namespace's: a stored event with fewer tokens per
        block is a partial-block entry (a hash unit finer than the block).
        """
        self._undo = []
        st = self._by.get(instance)
        if st is None:
            st = self._by[instance] = _Instance(model=model)
            self._undo.append(lambda: self._drop(instance))
        # Groups announced anywhere in the batch first: the full-attention
        # events before them must teach their keys already.
        for ev in events:
            if (
                isinstance(ev, BlockStored)
                and ev.group not in st.specs
                and (ev.group_kind in SLIDING_KINDS or ev.group_kind in MAMBA_KINDS)
            ):
                if not st.specs:
                    self._hybrids += 1
                    self._undo.append(self._unhybrid)
                self._put(st.specs, ev.group, GroupSpec(ev.group_kind, ev.sliding_window))
        out: list[Event] = []
        skipped: dict[str, int] = {}
        for ev in events:
            if isinstance(ev, AllBlocksCleared):
                old = (st.held, st.units, st.keys, st.loose, st.refs, st.recent)
                st.held, st.units, st.keys, st.loose, st.refs, st.recent = {}, {}, {}, {}, {}, {}

                def restore(
                    st: _Instance = st, old: tuple[Any, Any, Any, Any, Any, Any] = old
                ) -> None:
                    st.held, st.units, st.keys, st.loose, st.refs, st.recent = old

                self._undo.append(restore)
                out.append(ev)
            elif isinstance(ev, BlockStored):
                kept = self._stored(st, model, ev, block_size, skipped)
                if kept is not None:
                    out.append(kept)
            else:
                kept_r = self._removed(st, ev)
                if kept_r is not None:
                    out.append(kept_r)
        undo, self._undo = self._undo, []
        return Filtered(tuple(out), skipped, undo)

    def _stored(
        self,
        st: _Instance,
        model: str,
        ev: BlockStored,
        block_size: int,
        skipped: dict[str, int],
    ) -> BlockStored | None:
        kind = ev.group_kind
        full = kind in FULL_KINDS and ev.group not in st.specs
        n = len(ev.block_hashes)
        partial = 0 < ev.block_size < block_size
        if full and not partial:
            if st.specs and self._learn_keys(st, model, ev, block_size) is not None:
                self._hold(st, ev.block_hashes)
            return ev
        if not full and kind not in SLIDING_KINDS and kind not in MAMBA_KINDS:
            skipped["group_kind"] = skipped.get("group_kind", 0) + n
            return None
        if full and not st.specs:
            # A unit finer than the block with full attention alone: vLLM
            # never hits such an entry (nor publishes one).
            skipped["block_size"] = skipped.get("block_size", 0) + n
            return None
        # A non-full group was registered by filter() before the batch's events.
        keys = self._learn_keys(st, model, ev, block_size)
        if keys is None:
            reason = "partial_unplaced" if partial else "group_unplaced"
            skipped[reason] = skipped.get(reason, 0) + n
            if partial:
                # Kept by engine hash: a Match finds it by the prompt's (see above).
                self._set_unit(st, ev.block_size)
                loose = st.loose.get(ev.group)
                if loose is None:
                    loose = {}
                    self._put(st.loose, ev.group, loose)
                for h in ev.block_hashes:
                    self._put(loose, h, loose.get(h, 0) + 1)
            return None
        if partial:
            self._set_unit(st, ev.block_size)
        self._hold(st, ev.block_hashes)
        for key in keys:
            where = st.units if key & _UNIT else st.held
            held = where.get(ev.group)
            if held is None:
                held = {}
                self._put(where, ev.group, held)
            k = key & KEY_MASK
            self._put(held, k, held.get(k, 0) + 1)
        return None

    def _set_unit(self, st: _Instance, unit: int) -> None:
        if st.unit != unit:
            old_unit = st.unit

            def undo_unit(st: _Instance = st, old: int = old_unit) -> None:
                st.unit = old

            st.unit = unit
            self._undo.append(undo_unit)

    def _learn_keys(
        self, st: _Instance, model: str, ev: BlockStored, block_size: int
    ) -> list[int] | None:
        """Content keys of a stored event's blocks (remembered by hash, | _UNIT when
        chained at the hash unit); None if unknown.

        A hash a full-attention block event stored has its key already;
        another group's event may name one hash for several blocks' tokens (a
        Mamba state), and a partial-block entry may name a hash another
        group's entry keyed, so their tokens are used only when a hash is new.
        """
        partial = 0 < ev.block_size < block_size
        known = [st.keys.get(h) for h in ev.block_hashes]
        if (ev.group_kind not in FULL_KINDS or partial) and all(k is not None for k in known):
            return [k for k in known if k is not None]
        if ev.block_keys is not None:
            keys = list(ev.block_keys)
        else:
            if ev.parent_block_hash is None:
                parent = namespace_seed(model, ev.lora_name)
            else:
                got = st.keys.get(ev.parent_block_hash)
                if got is None:
                    got = st.recent.get(ev.parent_block_hash)
                if got is None:
                    return None
                parent = got & KEY_MASK
            size = ev.block_size or block_size
            if size <= 0 or len(ev.token_ids) != size * len(ev.block_hashes):
                return None
            keys = chain_keys(parent, ev.token_ids, size, encoded_extras(ev.extras))
        if partial:
            keys = [k | _UNIT for k in keys]
        for h, key in zip(ev.block_hashes, keys, strict=False):
            self._put(st.keys, h, key)
        return keys

    def _removed(self, st: _Instance, ev: BlockRemoved) -> BlockRemoved | None:
        full = ev.group not in st.specs
        loose = st.loose.get(ev.group)
        if full and ev.group not in st.units and not loose:
            for h in ev.block_hashes:
                self._release(st, h)
            return ev  # a full-attention block: the index's
        kept: list[int] = []
        for h in ev.block_hashes:
            if loose and h in loose:
                # One copy of the hash's presence in the group, kept by hash or
                # by key (keyed once its parent was): the loose one goes first.
                n = loose[h] - 1
                self._put(loose, h, n if n > 0 else None)
                continue
            key = st.keys.get(h)
            self._release(st, h)
            if key is not None and key & _UNIT:
                held = st.units.get(ev.group)
            elif full:
                kept.append(h)
                continue
            else:
                held = st.held.get(ev.group)
            if held is None or key is None:
                continue
            k = key & KEY_MASK
            n = held.get(k, 0) - 1
            self._put(held, k, n if n > 0 else None)
        if not full or not kept:
            return None
        return ev if len(kept) == len(ev.block_hashes) else replace(ev, block_hashes=tuple(kept))

    def _hold(self, st: _Instance, hashes: Sequence[int]) -> None:
        """One more store of each of ``hashes`` (their keys are known)."""
        refs = st.refs
        for h in hashes:
            self._put(refs, h, refs.get(h, 0) + 1)

    def _release(self, st: _Instance, h: int) -> None:
        """One store of ``h`` removed: with the last, its key is forgotten (a removal
        of a store the tracker did not count, e.g. from before a restart, is none)."""
        n = st.refs.get(h)
        if n is None:
            return
        if n > 1:
            self._put(st.refs, h, n - 1)
            return
        self._put(st.refs, h, None)
        key = st.keys.get(h)
        if key is None:
            return
        self._put(st.keys, h, None)
        recent = st.recent
        if h in recent:
            self._put(recent, h, None)  # to the newest end
        self._put(recent, h, key)
        if len(recent) > RECENT_KEYS:
            self._put(recent, next(iter(recent)), None)

    def _put(self, d: dict[Any, Any], k: object, v: object) -> None:
        """``d[k] = v`` (None: delete), journaled for :meth:`rollback`."""
        old = d.get(k, _MISSING)
        if v is None:
            if old is _MISSING:
                return
            del d[k]
        else:
            d[k] = v

        def undo() -> None:
            if old is _MISSING:
                d.pop(k, None)
            else:
                d[k] = old

        self._undo.append(undo)

    def _unhybrid(self) -> None:
        self._hybrids -= 1

    def _drop(self, instance: InstanceId) -> None:
        self._by.pop(instance, None)

    @staticmethod
    def rollback(filtered: Filtered) -> None:
        """The index did not apply ``filtered``: undo what filtering it counted."""
        undo, filtered.undo = filtered.undo, []
        for step in reversed(undo):
            step()

    def inside_first_block(
        self, model: str, prompt: Prompt, listed: Container[InstanceId]
    ) -> list[tuple[InstanceId, int]]:
        """Hybrid instances of ``model``, other than ``listed``, whose hit ends inside
        the prompt's first block: ``(instance, tokens)``. The index lists only
        instances whose full attention holds a whole block of the prompt; one that
        holds partial-block entries of its first block alone is found here."""
        out: list[tuple[InstanceId, int]] = []
        for iid, st in self._by.items():
            if st.model != model or not st.specs or iid in listed:
                continue
            if not any(st.units.values()) and not any(st.loose.values()):
                continue
            t = self.hit(iid, prompt, 0)
            if t:
                out.append((iid, t))
        return out

    def cut(self, instance: InstanceId, keys: Sequence[int], depth: int, block_size: int) -> int:
        """The hit, in whole blocks, of a prompt of block ``keys`` (of ``block_size``
        tokens) whose full-attention prefix is ``depth`` blocks."""
        return self.hit(instance, Prompt(keys, block_size), depth) // block_size

    def hit(self, instance: InstanceId, prompt: Prompt, depth: int) -> int:
        """The tokens the instance reuses of ``prompt``, whose full-attention prefix is
        ``depth`` whole blocks (the index's answer): the rule of the module docstring.

        An instance without another group reuses ``depth`` blocks as they are
        (the caller caps them); a hybrid one at most ``prompt.limit`` tokens.
        """
        bs = prompt.block_size
        st = self._by.get(instance)
        if st is None or not st.specs:
            return depth * bs
        d = min(depth, prompt.limit // bs)
        unit = st.unit
        fine = (
            0 < unit < bs
            and bs % unit == 0
            and all(spec.kind in MAMBA_KINDS for spec in st.specs.values())
        )
        if not fine:
            return self._cut_blocks(st, prompt.keys, d, bs) * bs
        hit = d * bs
        per = bs // unit
        top = min(d * per + per - 1, prompt.limit // unit, prompt.n_units(unit))
        # Entries kept by engine hash (see "Hash units" above): the prompt's own
        # engine hashes find them, once the instance's way of hashing is known.
        engine = self._engine_hashes(st, prompt, unit) if any(st.loose.values()) else None
        # Full attention, past its whole blocks: the last unit of the next block
        # it holds a partial-block entry for.
        fa = [held for g, held in st.units.items() if g not in st.specs and held]
        fa_loose = (
            [held for g, held in st.loose.items() if g not in st.specs and held] if engine else []
        )
        if fa or fa_loose:
            for k in range(top, d * per, -1):
                key = prompt.unit_key(k, unit) if fa else None
                if (key is not None and any(key in held for held in fa)) or (
                    engine is not None
                    and k <= len(engine)
                    and any(engine[k - 1] in held for held in fa_loose)
                ):
                    hit = k * unit
                    break
        while True:
            start = hit
            for g in st.specs:
                hit = _rightmost_unit(
                    st.held.get(g, {}),
                    st.units.get(g, {}),
                    prompt,
                    hit,
                    unit,
                    st.loose.get(g) if engine else None,
                    engine,
                )
                if hit == 0:
                    return 0
            if hit == start:
                return hit

    def _engine_hashes(self, st: _Instance, prompt: Prompt, unit: int) -> EngineUnits | None:
        """The prompt's engine hashes (low 64 bits, by unit index) as the instance hashes,
        or None while that is unknown.

        The instance's hasher is learned here: the first candidate that gives one
        of the prompt's first-block units a hash the instance published (a block's
        or an entry's). Equal 64-bit digests of the same content are the proof;
        only the first block is hashed per candidate, so an engine hashing in a way
        not tried (xxhash's random seed) costs a Match that much.
        """
        if st.hasher is None:
            per = prompt.block_size // unit
            for cand in self._hashers:
                got = prompt.engine_hashes(cand, unit, self._ends.setdefault((cand, unit), {}))
                if got is None:
                    return None
                first = [got[i] for i in range(min(per, len(got)))]
                if any(h in st.keys or any(h in x for x in st.loose.values()) for h in first):
                    st.hasher = cand
                    break
            else:
                return None
        return prompt.engine_hashes(st.hasher, unit, self._ends.setdefault((st.hasher, unit), {}))

    @staticmethod
    def _cut_blocks(st: _Instance, keys: Sequence[int], depth: int, block_size: int) -> int:
        """The rule at whole blocks (the hash unit is the block, or a sliding-window group
        keeps hits on block boundaries)."""
        d = depth
        while True:
            start = d
            for g, spec in st.specs.items():
                held = st.held.get(g, {})
                if spec.kind in MAMBA_KINDS:
                    d = _rightmost(held, keys, d)
                else:
                    d = _window(held, keys, d, _window_blocks(spec.window, block_size))
                if d == 0:
                    return 0
            if d == start:
                return d


def _window_blocks(window: int, block_size: int) -> int:
    """Blocks a sliding-window group must hold at a hit: ceil((window - 1) / block)."""
    return -(-(window - 1) // block_size) if window > 1 and block_size > 0 else 0


def _rightmost(held: dict[int, int], keys: Sequence[int], d: int) -> int:
    for i in range(d - 1, -1, -1):
        if keys[i] in held:
            return i + 1
    return 0


def _rightmost_unit(
    held: dict[int, int],
    units: dict[int, int],
    prompt: Prompt,
    hit: int,
    unit: int,
    loose: dict[int, int] | None = None,
    engine: EngineUnits | None = None,
) -> int:
    """A Mamba group's rightmost state at or before ``hit`` tokens, at unit granularity:
    a block end it holds as a block (or as a unit entry), or a unit inside a block
    (keyed, or kept by the engine hash that ``engine`` gives the prompt's unit)."""
    per = prompt.block_size // unit
    keys = prompt.keys
    for k in range(min(hit // unit, prompt.n_units(unit)), 0, -1):
        if k % per == 0 and keys[k // per - 1] in held:
            return k * unit
        if units:
            key = prompt.unit_key(k, unit)
            if key is not None and key in units:
                return k * unit
        if loose and engine is not None and k <= len(engine) and engine[k - 1] in loose:
            return k * unit
    return 0


def _window(held: dict[int, int], keys: Sequence[int], d: int, need: int) -> int:
    if need == 0:
        return d
    run = 0
    for i in range(d - 1, -1, -1):
        if keys[i] in held:
            run += 1
            if run >= need:
                return i + need
        else:
            run = 0
    return run  # the run held from block 0, shorter than the window
