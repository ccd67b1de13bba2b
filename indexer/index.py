"""The index interface: one contract, two backends (memory, redis).

Semantics (every backend; tests/contract checks them against both):

Instances
  ``register`` creates an instance or renews it. Registering again with a
  different ``incarnation`` or ``model`` *resets* it: its blocks, engine-hash
  map, sequence and staleness are dropped (a restarted engine has an empty
  cache). Each registration, heartbeat and applied batch renews the lease to
  ``now + lease_ttl_s``. An instance whose lease has expired is invisible to
  ``match`` at once; ``reap_expired`` later drops it with its blocks.

Events (``apply``)
  The instance must be registered, else :class:`FailedPrecondition`. With
  ``last`` the highest applied sequence (``None`` before the first batch):
  ``seq <= last`` is a DUPLICATE and changes nothing; ``seq == last + 1`` (or
  ``last is None``) is APPLIED; ``seq > last + 1`` is APPLIED_AFTER_GAP and
  marks the instance stale. A batch containing ``AllBlocksCleared`` leaves the
  instance fresh (what follows the clear is a full replay). Events apply in
  order; the outcome and counts are the whole batch's, and once it is
  acknowledged all of it is there (a read while it is in flight may see it
  applied up to some point: indexer/CONSISTENCY.md):

  - ``BlockStored``: namespace ``(instance model, lora_name)``. Content keys
    are ``block_keys`` if given, else the chain of ``token_ids`` after the
    content key of ``parent_block_hash`` (the namespace seed when absent). A
    parent hash unknown to the instance makes every block of the event an
    *orphan*: counted, not stored. Each engine hash maps to its (namespace,
    key); a hash already mapped to another key is first removed. The tier
    bit is set on ``(key, instance)``.
  - ``BlockRemoved``: for each known engine hash, clear the tier bit (all
    bits when ``tier`` is None); an entry with no bit left is dropped with its
    engine-hash mapping. Unknown hashes are ignored.
  - ``AllBlocksCleared``: drop every entry and mapping of the instance.

  ``blocks_stored`` / ``blocks_removed`` count (key, tier) bits that changed.
  Several engine hashes mapping to one content key share one entry: removing
  any of them removes it (under-reporting a hit is safe; affinity is advice).

Match
  For namespace ``ns`` and keys ``k[0..n)``: every live instance (stale ones
  only with ``include_stale``, then flagged) holding ``k[0]``, with the largest
  ``d`` such that it holds ``k[0..d)`` on any tier, and per tier how many of
  those ``d`` blocks have their fastest copy there. Sorted by depth
  descending, then worker id, then dp rank. Unknown namespace: empty.

Predictions (``predict``; Match with ``include_predicted``)
  A prediction is (namespace, instance, ordered keys, expiry ``now + ttl``):
  a router sent the instance a request for those blocks, which its engine
  will hold once the prefill runs and its events arrive. ``predict`` needs
  the instance registered and live (:class:`NotFound` otherwise) and serving
  the namespace's model (:class:`FailedPrecondition` on "model"); keys the
  instance holds confirmed (any tier) are not recorded, the others are (a
  key predicted again takes the new expiry), and it returns how many were.
  Past ``max_per_instance`` predicted keys of one instance the oldest go
  first. A prediction is never held: ``depth``, the tier counts and every
  other read ignore it. Match with ``include_predicted`` adds, per instance,
  ``predicted_depth``: the largest ``p`` such that each of ``k[0..p)`` is
  held confirmed or predicted unexpired for it (``p >= depth``); an instance
  (visible as above) that has ``k[0]`` by prediction only is returned with
  ``depth`` 0 and tiers 0. Sorted by depth descending, then predicted_depth
  descending, then worker id, dp rank. A store of a key confirms it (its
  prediction is dropped); a removal finds none (a key is never both held and
  predicted); a clear, a reset, removal or reap drops every prediction of
  the instance. Without ``include_predicted`` nothing of this shows.

Pending prefill (``pending_predicted``)
  Per live (not stale) instance of a model, how many (namespace, key)
  predictions it has unexpired: the uncached prefill every router sent it
  that its engine's events have not confirmed yet, in blocks (a key two
  requests predicted counts once). Instances with none are left out. It is
  the load every router's dispatches put on an instance, seen by every
  router at its next Match, where each router alone sees only its own. None:
  the backend does not count it. A prediction recorded with ``pending_s``
  counts for that long at most (the router's predicted end of the request's
  prefill: past it the engine's own load report has the request, and the
  events that confirm the blocks may lag); recorded again, a key takes the
  newer deadline (or none).

Quotas (``InstanceSpec.quota``, ``EventBatch.quota``; None: none)
  An instance created with a quota naming an identity counts under it (its
  *owner*) until it is removed or reaped; registering it again, by anyone,
  does not change that. A new instance whose owner already holds
  ``max_instances`` is refused (:class:`ResourceExhausted`, field
  ``quotas.max_instances_per_identity``), and so is a registration that would
  give its owner a namespace beyond ``max_namespaces`` (field
  ``quotas.max_namespaces_per_identity``): an owner's namespaces are its
  instances' models, and each LoRA namespace one of them stored a block in
  since it was registered, reset or cleared. Nothing changes on a refusal.

  A batch's stores are held to its quota; the instance's *usage* is the
  larger of its (block, tier) entries and its engine hashes, an owner's the
  sum over its instances. Walking the batch in order, each ``BlockStored``
  block takes one unit of room, whether it is then stored or not; the room
  is ``max_blocks_per_instance`` less the instance's usage and ``max_blocks``
  less its owner's, at the batch's start, less what earlier stores of the
  batch took; an ``AllBlocksCleared`` gives the instance's usage back.
  Removals free room for later batches only. Blocks past the room are left
  out (an event keeps its first blocks: their children are then orphans),
  and a store in a LoRA namespace new to the owner beyond ``max_namespaces``
  is left out whole; both are counted in ``ApplyResult.blocks_over_quota``
  and the rest of the batch applies as it would. ``free_loras`` are outside
  every cap. The counts are the index's (shared by every replica), kept in
  the same step as each write: :meth:`Index.quota_usage` reads them.

Across replicas and faults: indexer/CONSISTENCY.md states what a fleet of
replicas answers, what a replica may lag by, and what must never happen.

Thread-safety: backends are used from one asyncio event loop; all methods are
coroutines and each is atomic with respect to the others (redis: one script or
one transaction; memory: no await inside a mutation), except that the memory
backend applies a long batch a slice at a time (reads run between slices;
writes of that instance wait for it).
"""

from __future__ import annotations

import abc
from collections.abc import Sequence

from indexer.model import (
    ApplyResult,
    EventBatch,
    IndexDump,
    IndexStats,
    InstanceId,
    InstanceMatch,
    InstanceSpec,
    InstanceState,
    Namespace,
    QuotaUsage,
)
from kvmesh.errors import FailedPrecondition


class Index(abc.ABC):
    """A KV-block index shared by all instances of a fleet."""

    #: Short backend name reported in stats ("memory", "redis").
    name: str = "abstract"

    @abc.abstractmethod
    async def register(self, spec: InstanceSpec) -> tuple[InstanceState, bool]:
        """Create or renew an instance; return its state and whether it was reset."""

    @abc.abstractmethod
    async def heartbeat(self, instance: InstanceId) -> InstanceState:
        """Renew the lease. Raises NotFound for an unknown instance."""

    @abc.abstractmethod
    async def remove_instance(self, instance: InstanceId) -> int:
        """Drop an instance and its blocks; return the (key, tier) entries dropped.

        Raises NotFound for an unknown instance.
        """

    @abc.abstractmethod
    async def list_instances(self, model: str = "") -> list[InstanceState]:
        """All registered instances (of ``model`` when given), sorted by id."""

    @abc.abstractmethod
    async def apply(self, batch: EventBatch) -> ApplyResult:
        """Apply one batch (see the module docstring). Idempotent per sequence."""

    @abc.abstractmethod
    async def match(
        self,
        namespace: Namespace,
        keys: Sequence[int],
        *,
        include_stale: bool = False,
        include_predicted: bool = False,
    ) -> list[InstanceMatch]:
        """Per-instance longest gap-free prefix of ``keys``, deepest first
        (``include_predicted``: see "Predictions" above)."""

    async def predict(
        self,
        namespace: Namespace,
        instance: InstanceId,
        keys: Sequence[int],
        ttl_s: float,
        max_per_instance: int,
        pending_s: float | None = None,
    ) -> int:
        """Record a prediction (see "Predictions" above); return the keys recorded.
        ``pending_s``: how long its keys count as pending prefill (see "Pending
        prefill"); None: as long as they are predicted.

        This default refuses: a backend that cannot share predictions says so.
        """
        raise FailedPrecondition(
            f"PredictPlacement is not supported by the {self.name} backend", field="instance"
        )

    async def pending_predicted(self, model: str) -> dict[InstanceId, int] | None:
        """Unconfirmed predicted blocks per live instance of ``model`` (see
        "Pending prefill" above); this default: None, not counted."""
        return None

    async def match_with_pending(
        self, namespace: Namespace, keys: Sequence[int], *, include_stale: bool = False
    ) -> tuple[list[InstanceMatch], dict[InstanceId, int] | None]:
        """:meth:`match` with ``include_predicted`` and :meth:`pending_predicted`
        of the namespace's model, which a backend may answer together (this
        default asks one, then the other)."""
        hits = await self.match(
            namespace, keys, include_stale=include_stale, include_predicted=True
        )
        return hits, await self.pending_predicted(namespace.model)

    @abc.abstractmethod
    async def reap_expired(self) -> list[InstanceId]:
        """Drop every instance whose lease has expired; return their ids."""

    @abc.abstractmethod
    async def stats(self) -> IndexStats:
        """Sizes of the whole index."""

    @abc.abstractmethod
    async def dump(self) -> IndexDump:
        """The whole content in canonical form (for tests and debugging)."""

    async def dump_blocks(
        self, model: str, cap: int
    ) -> tuple[list[tuple[Namespace, int, dict[InstanceId, int]]], bool]:
        """At most ``cap`` blocks ``(namespace, key, {instance: tier mask})`` in
        (namespace, key) order, of ``model``'s namespaces ("" = all), and whether
        there were more. A backend overrides it to hold no more than ``cap``
        blocks' holders at a time (this default reads the whole :meth:`dump`)."""
        content = await self.dump()
        out: list[tuple[Namespace, int, dict[InstanceId, int]]] = []
        for ns in sorted(content.blocks):
            if model and ns.model != model:
                continue
            for key in sorted(content.blocks[ns]):
                if len(out) == cap:
                    return out, True
                out.append((ns, key, content.blocks[ns][key]))
        return out, False

    async def ping(self) -> None:  # noqa: B027 - optional hook
        """Raise Unavailable when the backend cannot serve."""

    async def generation(self) -> int | None:
        """A number that moves whenever an instance's registration may have
        changed (registered, reset, removed, reaped; every replica's writes),
        read from the shared index; None when the backend has none. Cheaper
        than :meth:`list_instances`: a caller that read the table may ask it
        whether reading again could tell it anything new."""
        return None

    async def quota_usage(self, identity: str) -> QuotaUsage:
        """What the instances ``identity`` owns hold, as the quotas count it."""
        return QuotaUsage()

    async def close(self) -> None:  # noqa: B027 - optional hook
        """Release connections."""
