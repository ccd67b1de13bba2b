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

:class:`GroupTracker` keeps, per instance fed through this replica, a copy
count per (block, tier) of the full-attention groups, and for every other
group the content keys it holds. It filters each batch before the index sees
it: a full-attention block leaves the index only when its last copy goes
(a removal the tracker has no count for passes, so a replica that restarted
under-reports at worst); the other groups' events never reach the index
(their blocks are not matchable by themselves) and feed the hit rule,
:meth:`GroupTracker.cut`, applied to Match depths. Their content keys are
chained here from the events' tokens (the full-attention group's events
teach the parent keys), only for instances that announced a non-full group.

Limits: the state is this replica's. Another replica answering Match for a
hybrid instance it does not ingest has no group presence and answers the
full-attention depth cut to 0 for it (under-reporting, never over; the
embedded memory backend is one process, so it always knows). Groups whose
kind has another hit rule (chunked local attention, encoder-only, cross
attention) are counted as skipped and left out.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from indexer.model import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    Event,
    InstanceId,
    encoded_extras,
)
from kvmesh.blockkeys import chain_keys, namespace_seed

_MISSING = object()

#: Group kinds whose blocks make a prefix matchable.
FULL_KINDS = frozenset({"", "full_attention", "mla_attention", "sink_full_attention"})
SLIDING_KINDS = frozenset({"sliding_window", "sliding_window_mla"})
MAMBA_KINDS = frozenset({"mamba"})


@dataclass(frozen=True, slots=True)
class GroupSpec:
    """One non-full group of an engine: its kind and sliding window (tokens)."""

    kind: str
    window: int = 0


@dataclass(slots=True)
class _Instance:
    #: Non-full groups: group index -> its spec.
    specs: dict[int, GroupSpec] = field(default_factory=dict)
    #: Non-full groups: group index -> content key -> copies.
    held: dict[int, dict[int, int]] = field(default_factory=dict)
    #: Engine hash -> content key, learned from stored events of a hybrid instance.
    keys: dict[int, int] = field(default_factory=dict)


@dataclass(slots=True)
class Filtered:
    """A batch's events as the index must see them, and what was left out (by reason)."""

    events: tuple[Event, ...]
    skipped: dict[str, int] = field(default_factory=dict)
    #: How to undo what filtering counted (GroupTracker.rollback), newest last.
    undo: list[Callable[[], None]] = field(default_factory=list)


class GroupTracker:
    """Group presence of the instances this replica ingests (see the module docstring)."""

    def __init__(self) -> None:
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
        """The events of one validated batch, as the index applies them."""
        self._undo = []
        st = self._by.get(instance)
        if st is None:
            st = self._by[instance] = _Instance()
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
                old = (st.held, st.keys)
                st.held, st.keys = {}, {}

                def restore(st: _Instance = st, old: tuple[Any, Any] = old) -> None:
                    st.held, st.keys = old

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
        if full:
            if st.specs:
                self._learn_keys(st, model, ev, block_size)
            return ev
        if kind not in SLIDING_KINDS and kind not in MAMBA_KINDS:
            skipped["group_kind"] = skipped.get("group_kind", 0) + len(ev.block_hashes)
            return None
        # Its group was registered by filter() before the batch's events.
        keys = self._learn_keys(st, model, ev, block_size)
        if keys is None:
            skipped["group_unplaced"] = skipped.get("group_unplaced", 0) + len(ev.block_hashes)
            return None
        held = st.held.get(ev.group)
        if held is None:
            held = {}
            self._put(st.held, ev.group, held)
        for key in keys:
            self._put(held, key, held.get(key, 0) + 1)
        return None

    def _learn_keys(
        self, st: _Instance, model: str, ev: BlockStored, block_size: int
    ) -> list[int] | None:
        """Content keys of a stored event's blocks (remembered by hash); None if unknown.

        A hash the full-attention group stored has its key already; another
        group's event may name one hash for several blocks' tokens (a Mamba
        state), so its tokens are used only when a hash is new here.
        """
        known = [st.keys.get(h) for h in ev.block_hashes]
        if ev.group_kind not in FULL_KINDS and all(k is not None for k in known):
            return [k for k in known if k is not None]
        if ev.block_keys is not None:
            keys = list(ev.block_keys)
        else:
            if ev.parent_block_hash is None:
                parent = namespace_seed(model, ev.lora_name)
            else:
                got = st.keys.get(ev.parent_block_hash)
                if got is None:
                    return None
                parent = got
            size = ev.block_size or block_size
            if size <= 0 or len(ev.token_ids) != size * len(ev.block_hashes):
                return None
            keys = chain_keys(parent, ev.token_ids, size, encoded_extras(ev.extras))
        for h, key in zip(ev.block_hashes, keys, strict=False):
            self._put(st.keys, h, key)
        return keys

    def _removed(self, st: _Instance, ev: BlockRemoved) -> BlockRemoved | None:
        spec_group = ev.group in st.specs
        if spec_group:
            held = st.held.get(ev.group)
            if held is not None:
                for h in ev.block_hashes:
                    key = st.keys.get(h)
                    if key is None:
                        continue
                    n = held.get(key, 0) - 1
                    self._put(held, key, n if n > 0 else None)
            return None
        return ev

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

    def cut(self, instance: InstanceId, keys: Sequence[int], depth: int, block_size: int) -> int:
        """The hit of a prompt of block ``keys`` (of ``block_size`` tokens) whose
        full-attention prefix is ``depth`` blocks."""
        st = self._by.get(instance)
        if st is None or not st.specs:
            return depth
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
