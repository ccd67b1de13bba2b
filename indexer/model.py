"""Domain types of the index: instances, events, batches, match queries and results, stats.

Plain dataclasses with no transport types, shared by the interface
(indexer/index.py), both backends, the service logic (indexer/logic.py) and
the conversions (indexer/convert.py, indexer/sglang/compat.py). Block keys and
engine block hashes are unsigned 64-bit ints; see docs/spec/block-keys.md.
"""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

from kvmesh.blockkeys import encode_extras
from kvmesh.errors import FailedPrecondition


class Tier(enum.IntEnum):
    """Storage tier of a cached block; a lower value is a faster tier."""

    GPU = 1
    CPU = 2
    DISK = 3

    @property
    def bit(self) -> int:
        """This tier's bit in a tier mask."""
        return 1 << (self.value - 1)


ALL_TIERS_MASK = 0b111

#: The namespace (LoRA name) of the marker a hybrid-attention instance holds
#: (indexer/logic.py says why): a reader without its group presence, another
#: replica or a router's follower, leaves such instances to the replica that
#: ingests them.
HYBRID_LORA = "kvmesh:hybrid"
#: Engine hash and block key of the marker ("kvmesh-h" in ASCII).
HYBRID_MARKER = 0x6B766D6573682D68


def fastest_tier(mask: int) -> Tier:
    """The fastest tier present in a non-zero tier mask."""
    for tier in Tier:
        if mask & tier.bit:
            return tier
    raise ValueError("empty tier mask")


class InstanceId(NamedTuple):
    """One KV-cache holder: an engine (worker) and its data-parallel rank.

    A NamedTuple, not a dataclass: it is a dict key on every hot path, and a
    tuple's hash and equality run in C.
    """

    worker_id: str
    dp_rank: int = 0

    def __str__(self) -> str:
        return f"{self.worker_id}/dp{self.dp_rank}"


class Namespace(NamedTuple):
    """Model plus LoRA adapter; nothing matches across namespaces."""

    model: str
    lora_name: str = ""

    def __str__(self) -> str:
        return f"{self.model}+{self.lora_name}" if self.lora_name else self.model


@dataclass(frozen=True, slots=True)
class Quota:
    """The caps a registration or a batch is held to (indexer/index.py, "Quotas").

    ``identity``: who the write is made for; a new instance counts under it
    (its *owner*) until it goes. '' makes an instance nobody's (only the
    per-instance cap then applies to it). Each cap 0: none. ``free_loras``:
    LoRA names of the service's own marker blocks, outside every cap.
    """

    identity: str = ""
    max_instances: int = 0
    max_namespaces: int = 0
    max_blocks: int = 0
    max_blocks_per_instance: int = 0
    free_loras: tuple[str, ...] = ()


@dataclass(frozen=True, slots=True)
class QuotaUsage:
    """What the instances one identity owns hold, as the quotas count it."""

    instances: int = 0
    namespaces: int = 0
    blocks: int = 0


@dataclass(frozen=True, slots=True)
class InstanceSpec:
    """What a registration says about an instance."""

    instance: InstanceId
    model: str
    address: str = ""
    lease_ttl_s: float = 30.0
    incarnation: str = ""
    #: The registering identity's quota (None: none). Not part of the
    #: instance's state: backends do not return it, equality ignores it.
    quota: Quota | None = field(default=None, compare=False, repr=False)


@dataclass(slots=True)
class InstanceState:
    """An instance as the index knows it (returned by register/list)."""

    spec: InstanceSpec
    lease_expires_at: float
    live: bool
    stale: bool
    applied_sequence: int | None
    blocks: int = 0  # (block, tier) entries held


@dataclass(frozen=True, slots=True)
class BlockExtras:
    """What an engine mixed into one block's hash besides its tokens.

    ``salt``: the request's ``cache_salt`` (vLLM adds it to a prompt's first
    block only, so it scopes the whole chain). ``media``: ``(identifier,
    offset)`` of each multimodal item the block overlaps, the offset of the
    item's first placeholder token relative to the block's first token (may be
    negative: the item began in an earlier block). ``other``: anything else
    the engine sent (prompt-embedding digests), kept as opaque bytes.
    """

    salt: str = ""
    media: tuple[tuple[str, int], ...] = ()
    other: tuple[bytes, ...] = ()


def encoded_extras(extras: Sequence[BlockExtras | None] | None) -> list[bytes] | None:
    """``E_i`` of each block (docs/spec/block-keys.md, "Extra keys"); None when there are none."""
    if not extras:
        return None
    out = [b"" if e is None else encode_extras(e.salt, e.media, e.other) for e in extras]
    return out if any(out) else None


@dataclass(frozen=True, slots=True)
class BlockStored:
    """Blocks entering an instance's cache on one tier.

    Content keys come from ``block_keys`` when given, else from ``token_ids``
    chained after the content key of ``parent_block_hash`` (or the namespace
    seed when there is no parent).

    ``position_known`` is False when the event does not say where its blocks
    sit in their chain: no ``parent_block_hash``, yet ``block_hashes[0]`` need
    not start a prompt (SGLang's REPORT names pages without their position).
    Only the Redis Cluster layout reads it (it places blocks by chain position;
    indexer/redis/KEYS.md, "Unplaced blocks"); the contract ignores it.
    """

    block_hashes: tuple[int, ...]
    parent_block_hash: int | None = None
    #: A tuple as decoded; ``array('I')`` once the service checked the ids
    #: (IndexerLogic._validate_stored), so that the key chaining takes their bytes.
    token_ids: Sequence[int] = ()
    block_size: int = 0
    lora_name: str = ""
    tier: Tier = Tier.GPU
    block_keys: tuple[int, ...] | None = None
    position_known: bool = True
    #: What the engine mixed into each block's hash besides its tokens, one
    #: entry per block (None: nothing): :class:`BlockExtras`. Enters the
    #: content keys (docs/spec/block-keys.md, "Extra keys").
    extras: tuple[BlockExtras | None, ...] | None = None
    #: The engine's KV-cache group (vLLM ``group_idx``; 0 when not said) and
    #: what it holds (``kv_cache_spec_kind``, '' unknown; its sliding window
    #: in tokens, 0 none). Only full-attention groups make a block matchable;
    #: the others constrain a hit (indexer/groups.py).
    group: int = 0
    group_kind: str = ""
    sliding_window: int = 0
    #: The engine hashed tokens past each block into its hash (speculative
    #: lookahead): its key cannot be derived from ``token_ids``.
    lookahead: bool = False


@dataclass(frozen=True, slots=True)
class BlockRemoved:
    """Blocks leaving one tier (``tier=None``: every tier) of an instance."""

    block_hashes: tuple[int, ...]
    tier: Tier | None = None
    group: int = 0


@dataclass(frozen=True, slots=True)
class AllBlocksCleared:
    """The instance dropped its whole cache; also starts a resync."""


Event = BlockStored | BlockRemoved | AllBlocksCleared


def event_piece(ev: BlockStored | BlockRemoved, i: int, j: int) -> BlockStored | BlockRemoved:
    """Blocks ``i`` to ``j`` of ``ev`` as an event of their own (``ev`` itself
    when that is all of it). A stored chain's piece is chained after the block
    before it (its parent), with its own token ids, keys and extras; the last
    piece keeps a trailing partial block's tokens. Applied one after the
    other, the pieces of an event are the event."""
    n = len(ev.block_hashes)
    if i == 0 and j >= n:
        return ev
    if isinstance(ev, BlockRemoved):
        return dataclasses.replace(ev, block_hashes=ev.block_hashes[i:j])
    bs = ev.block_size if ev.block_keys is None else 0
    return dataclasses.replace(
        ev,
        block_hashes=ev.block_hashes[i:j],
        parent_block_hash=ev.block_hashes[i - 1] if i else ev.parent_block_hash,
        token_ids=ev.token_ids[i * bs : (j * bs if j < n else None)] if bs else (),
        block_keys=None if ev.block_keys is None else ev.block_keys[i:j],
        extras=None if ev.extras is None else ev.extras[i:j],
    )


@dataclass(frozen=True, slots=True)
class EventBatch:
    """Events of one instance, applied atomically and in order."""

    instance: InstanceId
    sequence: int
    events: tuple[Event, ...]
    timestamp: float = 0.0
    #: A fence: when set, the batch applies only while the instance is
    #: registered with this incarnation, checked in the same step as the
    #: apply (else :func:`fenced_out`, nothing applied, the lease not renewed).
    #: A writer that another may have superseded (re-registered the instance)
    #: sets it; '' applies to whatever incarnation is registered.
    incarnation: str = ""
    #: A fence like ``incarnation``: the batch applies only while the instance
    #: is registered at this address (else :func:`fenced_out` on "address").
    address: str = ""
    #: Stored events count physical copies (an engine's own event stream: vLLM
    #: publishes a store per physical block, so one hash may be stored twice):
    #: a block leaves only when as many removals came. False (the API's set
    #: semantics): a store of a held block changes nothing, one removal drops it.
    counts_copies: bool = False
    #: The quota of the identity sending the batch: caps on its stores
    #: (indexer/index.py, "Quotas"); None: none.
    quota: Quota | None = field(default=None, compare=False, repr=False)


def fenced_out(batch: EventBatch, what: str = "incarnation") -> FailedPrecondition:
    """The error for a batch whose fence (``batch.incarnation`` or ``batch.address``,
    named by ``what``) the instance no longer has."""
    value = batch.incarnation if what == "incarnation" else batch.address
    return FailedPrecondition(
        f"instance {batch.instance} is no longer registered with {what} {value!r}",
        field=what,
    )


class BatchOutcome(enum.Enum):
    """What apply did with a batch."""

    APPLIED = "applied"
    DUPLICATE = "duplicate"
    APPLIED_AFTER_GAP = "applied_after_gap"


@dataclass(frozen=True, slots=True)
class ApplyResult:
    """Result of applying one batch."""

    outcome: BatchOutcome
    applied_sequence: int
    blocks_stored: int = 0
    blocks_removed: int = 0
    blocks_orphaned: int = 0
    stale: bool = False
    #: Blocks of events the service left out (counted by reason in
    #: ``Counters.events_skipped``): set by the service, not the index.
    blocks_skipped: int = 0
    #: Stored blocks the index left out past a quota (EventBatch.quota).
    blocks_over_quota: int = 0


class InstanceMatch(NamedTuple):
    """One instance's hit: it holds ``keys[0:depth)`` with no gap.

    ``gpu_blocks``, ``cpu_blocks`` and ``disk_blocks`` count the blocks of that
    prefix whose fastest copy is on each tier (they sum to ``depth``). A
    NamedTuple because a Match builds one per holder of the first block.
    ``tokens``: the hit in tokens when it ends inside block ``depth`` (an
    engine hashing in units finer than its blocks, indexer/groups.py); 0
    when it is ``depth`` whole blocks. ``predicted_depth``: only when the
    Match asked for predictions (``include_predicted``), the longest gap-free
    prefix held confirmed or predicted (>= ``depth``; an instance holding
    ``keys[0]`` by prediction alone has ``depth`` 0); 0 otherwise.
    """

    instance: InstanceId
    address: str
    depth: int
    gpu_blocks: int = 0
    cpu_blocks: int = 0
    disk_blocks: int = 0
    stale: bool = False
    tokens: int = 0
    predicted_depth: int = 0


@dataclass(frozen=True, slots=True)
class NamespaceStats:
    """Size of one namespace."""

    namespace: Namespace
    blocks: int
    block_instances: int


@dataclass(slots=True)
class IndexStats:
    """Size of the whole index (shared state, not per-replica counters)."""

    backend: str
    instances: int = 0
    instances_live: int = 0
    instances_stale: int = 0
    blocks: int = 0
    block_instances: int = 0
    namespaces: list[NamespaceStats] = field(default_factory=list)
    #: (block, instance) predictions held and not yet expired (PredictPlacement).
    predicted_blocks: int = 0


@dataclass(slots=True)
class IndexDump:
    """Canonical content of an index, for tests and debugging.

    ``blocks[ns][key][instance] = tier mask``; ``engine_hashes[instance][h] =
    (ns, key)``; ``instances`` keyed by id. Two backends with equal dumps
    answer every Match identically.
    """

    blocks: dict[Namespace, dict[int, dict[InstanceId, int]]]
    engine_hashes: dict[InstanceId, dict[int, tuple[Namespace, int]]]
    instances: dict[InstanceId, InstanceState]


@dataclass(frozen=True, slots=True)
class MatchQuery:
    """A Match request: token ids or precomputed block keys, not both."""

    namespace: Namespace
    token_ids: Sequence[int] = ()
    block_keys: Sequence[int] = ()
    max_blocks: int = 0
    include_stale: bool = False
    #: Keep only the deepest this many hits (0: all).
    max_instances: int = 0
    #: What the request gives the engine besides its tokens, which the engine
    #: mixes into its block hashes (docs/spec/block-keys.md, "Extra keys"):
    #: its ``cache_salt`` and ``(identifier, offset, length)`` of each
    #: multimodal item's placeholder tokens. Only with ``token_ids``.
    cache_salt: str = ""
    media: Sequence[tuple[str, int, int]] = ()
    #: Also count route-time predictions (:class:`Prediction`): fills
    #: ``InstanceMatch.predicted_depth`` and adds instances holding the first
    #: block by prediction alone (depth 0).
    include_predicted: bool = False


@dataclass(frozen=True, slots=True)
class Prediction:
    """A route-time prediction (PredictPlacement): a router sent a request for
    ``keys`` (in order) of ``namespace`` to ``instance``, whose engine will hold
    them once its prefill runs. Held for ``ttl_s`` seconds (0: the server's
    default) unless the engine's events confirm or drop them first; never
    counted as held (indexer/index.py, "Predictions"), counted as pending
    prefill for ``pending_s`` at most ("Pending prefill")."""

    namespace: Namespace
    instance: InstanceId
    keys: Sequence[int]
    ttl_s: float = 0.0
    #: How long the keys count as pending prefill (None: while predicted).
    pending_s: float | None = None


@dataclass(frozen=True, slots=True)
class MatchResult:
    """Match answer: hits deepest first, blocks looked at, block size used (0 for keys)."""

    matches: list[InstanceMatch]
    total_blocks: int
    block_size: int
    #: With ``include_predicted``: unconfirmed predicted blocks per live
    #: instance of the model (indexer/index.py, "Pending prefill"); None: not
    #: asked, or the backend does not count them.
    pending: dict[InstanceId, int] | None = None


@dataclass(slots=True)
class Counters:
    """Counters of this replica since it started (not shared between replicas)."""

    batches_applied: int = 0
    batches_duplicate: int = 0
    batches_rejected: int = 0
    sequence_gaps: int = 0
    matches: int = 0
    #: Sum over Matches of the deepest hit (blocks a router could reuse).
    matched_blocks: int = 0
    instances_reaped: int = 0
    reap_errors: int = 0
    #: Blocks of events left out, by reason (indexer.logic.SKIP_REASONS).
    events_skipped: dict[str, int] = field(default_factory=dict)
    #: Stored blocks whose parent the instance did not hold (not keyable).
    blocks_orphaned: int = 0
    #: (block, instance) predictions recorded by PredictPlacement.
    predictions_recorded: int = 0
    #: Matches whose answer a prediction deepened (some predicted_depth > depth).
    predicted_matches: int = 0


@dataclass(slots=True)
class ServiceStats:
    """Shared index sizes plus this replica's counters."""

    index: IndexStats
    counters: Counters = field(default_factory=Counters)
