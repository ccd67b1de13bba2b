from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class TierType(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    TIER_UNKNOWN: _ClassVar[TierType]
    TIER_HBM: _ClassVar[TierType]
    TIER_DRAM: _ClassVar[TierType]
    TIER_SSD: _ClassVar[TierType]

class ExternalKvActionType(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    ACTION_UNKNOWN: _ClassVar[ExternalKvActionType]
    ACTION_REPORT: _ClassVar[ExternalKvActionType]
    ACTION_REVOKE: _ClassVar[ExternalKvActionType]
    ACTION_CLEAR_ALL_AT_TIER: _ClassVar[ExternalKvActionType]
TIER_UNKNOWN: TierType
TIER_HBM: TierType
TIER_DRAM: TierType
TIER_SSD: TierType
ACTION_UNKNOWN: ExternalKvActionType
ACTION_REPORT: ExternalKvActionType
ACTION_REVOKE: ExternalKvActionType
ACTION_CLEAR_ALL_AT_TIER: ExternalKvActionType

class WorkerCacheSpec(_message.Message):
    __slots__ = ("version", "components", "swa_window_tokens", "full_tier_mask", "swa_tier_mask", "mamba_tier_mask")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    COMPONENTS_FIELD_NUMBER: _ClassVar[int]
    SWA_WINDOW_TOKENS_FIELD_NUMBER: _ClassVar[int]
    FULL_TIER_MASK_FIELD_NUMBER: _ClassVar[int]
    SWA_TIER_MASK_FIELD_NUMBER: _ClassVar[int]
    MAMBA_TIER_MASK_FIELD_NUMBER: _ClassVar[int]
    version: int
    components: int
    swa_window_tokens: int
    full_tier_mask: int
    swa_tier_mask: int
    mamba_tier_mask: int
    def __init__(self, version: _Optional[int] = ..., components: _Optional[int] = ..., swa_window_tokens: _Optional[int] = ..., full_tier_mask: _Optional[int] = ..., swa_tier_mask: _Optional[int] = ..., mamba_tier_mask: _Optional[int] = ...) -> None: ...

class MatchExternalKvRequest(_message.Message):
    __slots__ = ("hashes", "count_as_hit")
    HASHES_FIELD_NUMBER: _ClassVar[int]
    COUNT_AS_HIT_FIELD_NUMBER: _ClassVar[int]
    hashes: _containers.RepeatedScalarFieldContainer[int]
    count_as_hit: bool
    def __init__(self, hashes: _Optional[_Iterable[int]] = ..., count_as_hit: _Optional[bool] = ...) -> None: ...

class ExternalKvAction(_message.Message):
    __slots__ = ("type", "tier", "hashes", "component_masks", "block_sizes")
    TYPE_FIELD_NUMBER: _ClassVar[int]
    TIER_FIELD_NUMBER: _ClassVar[int]
    HASHES_FIELD_NUMBER: _ClassVar[int]
    COMPONENT_MASKS_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZES_FIELD_NUMBER: _ClassVar[int]
    type: ExternalKvActionType
    tier: TierType
    hashes: _containers.RepeatedScalarFieldContainer[int]
    component_masks: _containers.RepeatedScalarFieldContainer[int]
    block_sizes: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, type: _Optional[_Union[ExternalKvActionType, str]] = ..., tier: _Optional[_Union[TierType, str]] = ..., hashes: _Optional[_Iterable[int]] = ..., component_masks: _Optional[_Iterable[int]] = ..., block_sizes: _Optional[_Iterable[int]] = ...) -> None: ...

class ApplyExternalKvBatchRequest(_message.Message):
    __slots__ = ("worker_id", "seq", "actions", "worker_address", "cache_spec", "worker_epoch", "enforce_sequence")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    SEQ_FIELD_NUMBER: _ClassVar[int]
    ACTIONS_FIELD_NUMBER: _ClassVar[int]
    WORKER_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    CACHE_SPEC_FIELD_NUMBER: _ClassVar[int]
    WORKER_EPOCH_FIELD_NUMBER: _ClassVar[int]
    ENFORCE_SEQUENCE_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    seq: int
    actions: _containers.RepeatedCompositeFieldContainer[ExternalKvAction]
    worker_address: str
    cache_spec: WorkerCacheSpec
    worker_epoch: str
    enforce_sequence: bool
    def __init__(self, worker_id: _Optional[str] = ..., seq: _Optional[int] = ..., actions: _Optional[_Iterable[_Union[ExternalKvAction, _Mapping]]] = ..., worker_address: _Optional[str] = ..., cache_spec: _Optional[_Union[WorkerCacheSpec, _Mapping]] = ..., worker_epoch: _Optional[str] = ..., enforce_sequence: _Optional[bool] = ...) -> None: ...

class ApplyExternalKvBatchResponse(_message.Message):
    __slots__ = ("applied_seq", "duplicate")
    APPLIED_SEQ_FIELD_NUMBER: _ClassVar[int]
    DUPLICATE_FIELD_NUMBER: _ClassVar[int]
    applied_seq: int
    duplicate: bool
    def __init__(self, applied_seq: _Optional[int] = ..., duplicate: _Optional[bool] = ...) -> None: ...

class TierHashes(_message.Message):
    __slots__ = ("tier", "hashes", "component_masks", "block_sizes")
    TIER_FIELD_NUMBER: _ClassVar[int]
    HASHES_FIELD_NUMBER: _ClassVar[int]
    COMPONENT_MASKS_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZES_FIELD_NUMBER: _ClassVar[int]
    tier: TierType
    hashes: _containers.RepeatedScalarFieldContainer[int]
    component_masks: _containers.RepeatedScalarFieldContainer[int]
    block_sizes: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, tier: _Optional[_Union[TierType, str]] = ..., hashes: _Optional[_Iterable[int]] = ..., component_masks: _Optional[_Iterable[int]] = ..., block_sizes: _Optional[_Iterable[int]] = ...) -> None: ...

class ExpectedWorker(_message.Message):
    __slots__ = ("worker_id", "worker_address", "cache_spec")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    WORKER_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    CACHE_SPEC_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    worker_address: str
    cache_spec: WorkerCacheSpec
    def __init__(self, worker_id: _Optional[str] = ..., worker_address: _Optional[str] = ..., cache_spec: _Optional[_Union[WorkerCacheSpec, _Mapping]] = ...) -> None: ...

class ConfigureExpectedWorkersRequest(_message.Message):
    __slots__ = ("workers",)
    WORKERS_FIELD_NUMBER: _ClassVar[int]
    workers: _containers.RepeatedCompositeFieldContainer[ExpectedWorker]
    def __init__(self, workers: _Optional[_Iterable[_Union[ExpectedWorker, _Mapping]]] = ...) -> None: ...

class ConfigureExpectedWorkersResponse(_message.Message):
    __slots__ = ("total_workers", "ready_workers")
    TOTAL_WORKERS_FIELD_NUMBER: _ClassVar[int]
    READY_WORKERS_FIELD_NUMBER: _ClassVar[int]
    total_workers: int
    ready_workers: int
    def __init__(self, total_workers: _Optional[int] = ..., ready_workers: _Optional[int] = ...) -> None: ...

class ReplaceExternalKvSnapshotRequest(_message.Message):
    __slots__ = ("worker_id", "worker_address", "worker_epoch", "applied_seq", "hashes_by_tier", "cache_spec")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    WORKER_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    WORKER_EPOCH_FIELD_NUMBER: _ClassVar[int]
    APPLIED_SEQ_FIELD_NUMBER: _ClassVar[int]
    HASHES_BY_TIER_FIELD_NUMBER: _ClassVar[int]
    CACHE_SPEC_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    worker_address: str
    worker_epoch: str
    applied_seq: int
    hashes_by_tier: _containers.RepeatedCompositeFieldContainer[TierHashes]
    cache_spec: WorkerCacheSpec
    def __init__(self, worker_id: _Optional[str] = ..., worker_address: _Optional[str] = ..., worker_epoch: _Optional[str] = ..., applied_seq: _Optional[int] = ..., hashes_by_tier: _Optional[_Iterable[_Union[TierHashes, _Mapping]]] = ..., cache_spec: _Optional[_Union[WorkerCacheSpec, _Mapping]] = ...) -> None: ...

class ReplaceExternalKvSnapshotResponse(_message.Message):
    __slots__ = ("applied_seq",)
    APPLIED_SEQ_FIELD_NUMBER: _ClassVar[int]
    applied_seq: int
    def __init__(self, applied_seq: _Optional[int] = ...) -> None: ...

class ExternalKvNodeMatch(_message.Message):
    __slots__ = ("worker_id", "address", "hashes_by_tier")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    HASHES_BY_TIER_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    address: str
    hashes_by_tier: _containers.RepeatedCompositeFieldContainer[TierHashes]
    def __init__(self, worker_id: _Optional[str] = ..., address: _Optional[str] = ..., hashes_by_tier: _Optional[_Iterable[_Union[TierHashes, _Mapping]]] = ...) -> None: ...

class MatchExternalKvResponse(_message.Message):
    __slots__ = ("matches",)
    MATCHES_FIELD_NUMBER: _ClassVar[int]
    matches: _containers.RepeatedCompositeFieldContainer[ExternalKvNodeMatch]
    def __init__(self, matches: _Optional[_Iterable[_Union[ExternalKvNodeMatch, _Mapping]]] = ...) -> None: ...

class MatchExternalKvPrefixRequest(_message.Message):
    __slots__ = ("hashes", "max_blocks")
    HASHES_FIELD_NUMBER: _ClassVar[int]
    MAX_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    hashes: _containers.RepeatedScalarFieldContainer[int]
    max_blocks: int
    def __init__(self, hashes: _Optional[_Iterable[int]] = ..., max_blocks: _Optional[int] = ...) -> None: ...

class ExternalKvPrefixMatch(_message.Message):
    __slots__ = ("worker_address", "matched_prefix_blocks", "worker_id")
    WORKER_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    MATCHED_PREFIX_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    worker_address: str
    matched_prefix_blocks: int
    worker_id: str
    def __init__(self, worker_address: _Optional[str] = ..., matched_prefix_blocks: _Optional[int] = ..., worker_id: _Optional[str] = ...) -> None: ...

class MatchExternalKvPrefixResponse(_message.Message):
    __slots__ = ("matches", "best_prefix_blocks", "blocks_read")
    MATCHES_FIELD_NUMBER: _ClassVar[int]
    BEST_PREFIX_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    BLOCKS_READ_FIELD_NUMBER: _ClassVar[int]
    matches: _containers.RepeatedCompositeFieldContainer[ExternalKvPrefixMatch]
    best_prefix_blocks: int
    blocks_read: int
    def __init__(self, matches: _Optional[_Iterable[_Union[ExternalKvPrefixMatch, _Mapping]]] = ..., best_prefix_blocks: _Optional[int] = ..., blocks_read: _Optional[int] = ...) -> None: ...

class HitCountEntry(_message.Message):
    __slots__ = ("hash", "hit_count_total")
    HASH_FIELD_NUMBER: _ClassVar[int]
    HIT_COUNT_TOTAL_FIELD_NUMBER: _ClassVar[int]
    hash: int
    hit_count_total: int
    def __init__(self, hash: _Optional[int] = ..., hit_count_total: _Optional[int] = ...) -> None: ...

class GetExternalKvHitCountsRequest(_message.Message):
    __slots__ = ("hashes",)
    HASHES_FIELD_NUMBER: _ClassVar[int]
    hashes: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, hashes: _Optional[_Iterable[int]] = ...) -> None: ...

class GetExternalKvHitCountsResponse(_message.Message):
    __slots__ = ("entries",)
    ENTRIES_FIELD_NUMBER: _ClassVar[int]
    entries: _containers.RepeatedCompositeFieldContainer[HitCountEntry]
    def __init__(self, entries: _Optional[_Iterable[_Union[HitCountEntry, _Mapping]]] = ...) -> None: ...
