from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class Tier(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    TIER_UNSPECIFIED: _ClassVar[Tier]
    TIER_GPU: _ClassVar[Tier]
    TIER_CPU: _ClassVar[Tier]
    TIER_DISK: _ClassVar[Tier]

class BatchOutcome(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    BATCH_OUTCOME_UNSPECIFIED: _ClassVar[BatchOutcome]
    BATCH_OUTCOME_APPLIED: _ClassVar[BatchOutcome]
    BATCH_OUTCOME_DUPLICATE: _ClassVar[BatchOutcome]
    BATCH_OUTCOME_APPLIED_AFTER_GAP: _ClassVar[BatchOutcome]
    BATCH_OUTCOME_REJECTED: _ClassVar[BatchOutcome]
TIER_UNSPECIFIED: Tier
TIER_GPU: Tier
TIER_CPU: Tier
TIER_DISK: Tier
BATCH_OUTCOME_UNSPECIFIED: BatchOutcome
BATCH_OUTCOME_APPLIED: BatchOutcome
BATCH_OUTCOME_DUPLICATE: BatchOutcome
BATCH_OUTCOME_APPLIED_AFTER_GAP: BatchOutcome
BATCH_OUTCOME_REJECTED: BatchOutcome

class InstanceRef(_message.Message):
    __slots__ = ("worker_id", "dp_rank")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    DP_RANK_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    dp_rank: int
    def __init__(self, worker_id: _Optional[str] = ..., dp_rank: _Optional[int] = ...) -> None: ...

class BlockStored(_message.Message):
    __slots__ = ("block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_name", "tier", "block_keys", "extra_keys", "group_idx", "group_kind", "sliding_window")
    BLOCK_HASHES_FIELD_NUMBER: _ClassVar[int]
    PARENT_BLOCK_HASH_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    LORA_NAME_FIELD_NUMBER: _ClassVar[int]
    TIER_FIELD_NUMBER: _ClassVar[int]
    BLOCK_KEYS_FIELD_NUMBER: _ClassVar[int]
    EXTRA_KEYS_FIELD_NUMBER: _ClassVar[int]
    GROUP_IDX_FIELD_NUMBER: _ClassVar[int]
    GROUP_KIND_FIELD_NUMBER: _ClassVar[int]
    SLIDING_WINDOW_FIELD_NUMBER: _ClassVar[int]
    block_hashes: _containers.RepeatedScalarFieldContainer[int]
    parent_block_hash: int
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    block_size: int
    lora_name: str
    tier: Tier
    block_keys: _containers.RepeatedScalarFieldContainer[int]
    extra_keys: _containers.RepeatedCompositeFieldContainer[BlockExtraKeys]
    group_idx: int
    group_kind: str
    sliding_window: int
    def __init__(self, block_hashes: _Optional[_Iterable[int]] = ..., parent_block_hash: _Optional[int] = ..., token_ids: _Optional[_Iterable[int]] = ..., block_size: _Optional[int] = ..., lora_name: _Optional[str] = ..., tier: _Optional[_Union[Tier, str]] = ..., block_keys: _Optional[_Iterable[int]] = ..., extra_keys: _Optional[_Iterable[_Union[BlockExtraKeys, _Mapping]]] = ..., group_idx: _Optional[int] = ..., group_kind: _Optional[str] = ..., sliding_window: _Optional[int] = ...) -> None: ...

class BlockExtraKeys(_message.Message):
    __slots__ = ("cache_salt", "media")
    CACHE_SALT_FIELD_NUMBER: _ClassVar[int]
    MEDIA_FIELD_NUMBER: _ClassVar[int]
    cache_salt: str
    media: _containers.RepeatedCompositeFieldContainer[MediaInBlock]
    def __init__(self, cache_salt: _Optional[str] = ..., media: _Optional[_Iterable[_Union[MediaInBlock, _Mapping]]] = ...) -> None: ...

class MediaInBlock(_message.Message):
    __slots__ = ("identifier", "offset")
    IDENTIFIER_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    identifier: str
    offset: int
    def __init__(self, identifier: _Optional[str] = ..., offset: _Optional[int] = ...) -> None: ...

class BlockRemoved(_message.Message):
    __slots__ = ("block_hashes", "tier", "group_idx")
    BLOCK_HASHES_FIELD_NUMBER: _ClassVar[int]
    TIER_FIELD_NUMBER: _ClassVar[int]
    GROUP_IDX_FIELD_NUMBER: _ClassVar[int]
    block_hashes: _containers.RepeatedScalarFieldContainer[int]
    tier: Tier
    group_idx: int
    def __init__(self, block_hashes: _Optional[_Iterable[int]] = ..., tier: _Optional[_Union[Tier, str]] = ..., group_idx: _Optional[int] = ...) -> None: ...

class AllBlocksCleared(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class Event(_message.Message):
    __slots__ = ("stored", "removed", "cleared")
    STORED_FIELD_NUMBER: _ClassVar[int]
    REMOVED_FIELD_NUMBER: _ClassVar[int]
    CLEARED_FIELD_NUMBER: _ClassVar[int]
    stored: BlockStored
    removed: BlockRemoved
    cleared: AllBlocksCleared
    def __init__(self, stored: _Optional[_Union[BlockStored, _Mapping]] = ..., removed: _Optional[_Union[BlockRemoved, _Mapping]] = ..., cleared: _Optional[_Union[AllBlocksCleared, _Mapping]] = ...) -> None: ...

class EventBatch(_message.Message):
    __slots__ = ("instance", "sequence", "timestamp", "events", "counts_copies", "incarnation")
    INSTANCE_FIELD_NUMBER: _ClassVar[int]
    SEQUENCE_FIELD_NUMBER: _ClassVar[int]
    TIMESTAMP_FIELD_NUMBER: _ClassVar[int]
    EVENTS_FIELD_NUMBER: _ClassVar[int]
    COUNTS_COPIES_FIELD_NUMBER: _ClassVar[int]
    INCARNATION_FIELD_NUMBER: _ClassVar[int]
    instance: InstanceRef
    sequence: int
    timestamp: float
    events: _containers.RepeatedCompositeFieldContainer[Event]
    counts_copies: bool
    incarnation: str
    def __init__(self, instance: _Optional[_Union[InstanceRef, _Mapping]] = ..., sequence: _Optional[int] = ..., timestamp: _Optional[float] = ..., events: _Optional[_Iterable[_Union[Event, _Mapping]]] = ..., counts_copies: _Optional[bool] = ..., incarnation: _Optional[str] = ...) -> None: ...

class BatchError(_message.Message):
    __slots__ = ("code", "message", "field")
    CODE_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    FIELD_FIELD_NUMBER: _ClassVar[int]
    code: int
    message: str
    field: str
    def __init__(self, code: _Optional[int] = ..., message: _Optional[str] = ..., field: _Optional[str] = ...) -> None: ...

class BatchAck(_message.Message):
    __slots__ = ("instance", "sequence", "outcome", "applied_sequence", "blocks_stored", "blocks_removed", "blocks_orphaned", "stale", "error", "blocks_skipped")
    INSTANCE_FIELD_NUMBER: _ClassVar[int]
    SEQUENCE_FIELD_NUMBER: _ClassVar[int]
    OUTCOME_FIELD_NUMBER: _ClassVar[int]
    APPLIED_SEQUENCE_FIELD_NUMBER: _ClassVar[int]
    BLOCKS_STORED_FIELD_NUMBER: _ClassVar[int]
    BLOCKS_REMOVED_FIELD_NUMBER: _ClassVar[int]
    BLOCKS_ORPHANED_FIELD_NUMBER: _ClassVar[int]
    STALE_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    BLOCKS_SKIPPED_FIELD_NUMBER: _ClassVar[int]
    instance: InstanceRef
    sequence: int
    outcome: BatchOutcome
    applied_sequence: int
    blocks_stored: int
    blocks_removed: int
    blocks_orphaned: int
    stale: bool
    error: BatchError
    blocks_skipped: int
    def __init__(self, instance: _Optional[_Union[InstanceRef, _Mapping]] = ..., sequence: _Optional[int] = ..., outcome: _Optional[_Union[BatchOutcome, str]] = ..., applied_sequence: _Optional[int] = ..., blocks_stored: _Optional[int] = ..., blocks_removed: _Optional[int] = ..., blocks_orphaned: _Optional[int] = ..., stale: _Optional[bool] = ..., error: _Optional[_Union[BatchError, _Mapping]] = ..., blocks_skipped: _Optional[int] = ...) -> None: ...

class RegisterInstanceRequest(_message.Message):
    __slots__ = ("instance", "model", "address", "lease_ttl_seconds", "incarnation")
    INSTANCE_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    LEASE_TTL_SECONDS_FIELD_NUMBER: _ClassVar[int]
    INCARNATION_FIELD_NUMBER: _ClassVar[int]
    instance: InstanceRef
    model: str
    address: str
    lease_ttl_seconds: float
    incarnation: str
    def __init__(self, instance: _Optional[_Union[InstanceRef, _Mapping]] = ..., model: _Optional[str] = ..., address: _Optional[str] = ..., lease_ttl_seconds: _Optional[float] = ..., incarnation: _Optional[str] = ...) -> None: ...

class InstanceInfo(_message.Message):
    __slots__ = ("instance", "model", "address", "incarnation", "lease_ttl_seconds", "lease_expires_at", "live", "stale", "applied_sequence", "has_applied_sequence", "blocks")
    INSTANCE_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    INCARNATION_FIELD_NUMBER: _ClassVar[int]
    LEASE_TTL_SECONDS_FIELD_NUMBER: _ClassVar[int]
    LEASE_EXPIRES_AT_FIELD_NUMBER: _ClassVar[int]
    LIVE_FIELD_NUMBER: _ClassVar[int]
    STALE_FIELD_NUMBER: _ClassVar[int]
    APPLIED_SEQUENCE_FIELD_NUMBER: _ClassVar[int]
    HAS_APPLIED_SEQUENCE_FIELD_NUMBER: _ClassVar[int]
    BLOCKS_FIELD_NUMBER: _ClassVar[int]
    instance: InstanceRef
    model: str
    address: str
    incarnation: str
    lease_ttl_seconds: float
    lease_expires_at: float
    live: bool
    stale: bool
    applied_sequence: int
    has_applied_sequence: bool
    blocks: int
    def __init__(self, instance: _Optional[_Union[InstanceRef, _Mapping]] = ..., model: _Optional[str] = ..., address: _Optional[str] = ..., incarnation: _Optional[str] = ..., lease_ttl_seconds: _Optional[float] = ..., lease_expires_at: _Optional[float] = ..., live: _Optional[bool] = ..., stale: _Optional[bool] = ..., applied_sequence: _Optional[int] = ..., has_applied_sequence: _Optional[bool] = ..., blocks: _Optional[int] = ...) -> None: ...

class RegisterInstanceResponse(_message.Message):
    __slots__ = ("info", "reset")
    INFO_FIELD_NUMBER: _ClassVar[int]
    RESET_FIELD_NUMBER: _ClassVar[int]
    info: InstanceInfo
    reset: bool
    def __init__(self, info: _Optional[_Union[InstanceInfo, _Mapping]] = ..., reset: _Optional[bool] = ...) -> None: ...

class HeartbeatRequest(_message.Message):
    __slots__ = ("instance",)
    INSTANCE_FIELD_NUMBER: _ClassVar[int]
    instance: InstanceRef
    def __init__(self, instance: _Optional[_Union[InstanceRef, _Mapping]] = ...) -> None: ...

class HeartbeatResponse(_message.Message):
    __slots__ = ("lease_expires_at", "stale")
    LEASE_EXPIRES_AT_FIELD_NUMBER: _ClassVar[int]
    STALE_FIELD_NUMBER: _ClassVar[int]
    lease_expires_at: float
    stale: bool
    def __init__(self, lease_expires_at: _Optional[float] = ..., stale: _Optional[bool] = ...) -> None: ...

class RemoveInstanceRequest(_message.Message):
    __slots__ = ("instance",)
    INSTANCE_FIELD_NUMBER: _ClassVar[int]
    instance: InstanceRef
    def __init__(self, instance: _Optional[_Union[InstanceRef, _Mapping]] = ...) -> None: ...

class RemoveInstanceResponse(_message.Message):
    __slots__ = ("blocks_removed",)
    BLOCKS_REMOVED_FIELD_NUMBER: _ClassVar[int]
    blocks_removed: int
    def __init__(self, blocks_removed: _Optional[int] = ...) -> None: ...

class ListInstancesRequest(_message.Message):
    __slots__ = ("model",)
    MODEL_FIELD_NUMBER: _ClassVar[int]
    model: str
    def __init__(self, model: _Optional[str] = ...) -> None: ...

class ListInstancesResponse(_message.Message):
    __slots__ = ("instances",)
    INSTANCES_FIELD_NUMBER: _ClassVar[int]
    instances: _containers.RepeatedCompositeFieldContainer[InstanceInfo]
    def __init__(self, instances: _Optional[_Iterable[_Union[InstanceInfo, _Mapping]]] = ...) -> None: ...

class PublishEventsRequest(_message.Message):
    __slots__ = ("batch",)
    BATCH_FIELD_NUMBER: _ClassVar[int]
    batch: EventBatch
    def __init__(self, batch: _Optional[_Union[EventBatch, _Mapping]] = ...) -> None: ...

class PublishEventsResponse(_message.Message):
    __slots__ = ("ack",)
    ACK_FIELD_NUMBER: _ClassVar[int]
    ack: BatchAck
    def __init__(self, ack: _Optional[_Union[BatchAck, _Mapping]] = ...) -> None: ...

class PublishEventsStreamRequest(_message.Message):
    __slots__ = ("batch",)
    BATCH_FIELD_NUMBER: _ClassVar[int]
    batch: EventBatch
    def __init__(self, batch: _Optional[_Union[EventBatch, _Mapping]] = ...) -> None: ...

class PublishEventsStreamResponse(_message.Message):
    __slots__ = ("ack",)
    ACK_FIELD_NUMBER: _ClassVar[int]
    ack: BatchAck
    def __init__(self, ack: _Optional[_Union[BatchAck, _Mapping]] = ...) -> None: ...

class MatchRequest(_message.Message):
    __slots__ = ("model", "lora_name", "token_ids", "block_keys", "max_blocks", "include_stale", "max_instances", "cache_salt", "media", "packed_token_ids", "include_predicted")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    LORA_NAME_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    BLOCK_KEYS_FIELD_NUMBER: _ClassVar[int]
    MAX_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    INCLUDE_STALE_FIELD_NUMBER: _ClassVar[int]
    MAX_INSTANCES_FIELD_NUMBER: _ClassVar[int]
    CACHE_SALT_FIELD_NUMBER: _ClassVar[int]
    MEDIA_FIELD_NUMBER: _ClassVar[int]
    PACKED_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    INCLUDE_PREDICTED_FIELD_NUMBER: _ClassVar[int]
    model: str
    lora_name: str
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    block_keys: _containers.RepeatedScalarFieldContainer[int]
    max_blocks: int
    include_stale: bool
    max_instances: int
    cache_salt: str
    media: _containers.RepeatedCompositeFieldContainer[MediaRange]
    packed_token_ids: bytes
    include_predicted: bool
    def __init__(self, model: _Optional[str] = ..., lora_name: _Optional[str] = ..., token_ids: _Optional[_Iterable[int]] = ..., block_keys: _Optional[_Iterable[int]] = ..., max_blocks: _Optional[int] = ..., include_stale: _Optional[bool] = ..., max_instances: _Optional[int] = ..., cache_salt: _Optional[str] = ..., media: _Optional[_Iterable[_Union[MediaRange, _Mapping]]] = ..., packed_token_ids: _Optional[bytes] = ..., include_predicted: _Optional[bool] = ...) -> None: ...

class MediaRange(_message.Message):
    __slots__ = ("identifier", "offset", "length")
    IDENTIFIER_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    LENGTH_FIELD_NUMBER: _ClassVar[int]
    identifier: str
    offset: int
    length: int
    def __init__(self, identifier: _Optional[str] = ..., offset: _Optional[int] = ..., length: _Optional[int] = ...) -> None: ...

class InstanceMatch(_message.Message):
    __slots__ = ("instance", "address", "depth", "gpu_blocks", "cpu_blocks", "disk_blocks", "stale", "tokens", "predicted_depth")
    INSTANCE_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    DEPTH_FIELD_NUMBER: _ClassVar[int]
    GPU_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    CPU_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    DISK_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    STALE_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    PREDICTED_DEPTH_FIELD_NUMBER: _ClassVar[int]
    instance: InstanceRef
    address: str
    depth: int
    gpu_blocks: int
    cpu_blocks: int
    disk_blocks: int
    stale: bool
    tokens: int
    predicted_depth: int
    def __init__(self, instance: _Optional[_Union[InstanceRef, _Mapping]] = ..., address: _Optional[str] = ..., depth: _Optional[int] = ..., gpu_blocks: _Optional[int] = ..., cpu_blocks: _Optional[int] = ..., disk_blocks: _Optional[int] = ..., stale: _Optional[bool] = ..., tokens: _Optional[int] = ..., predicted_depth: _Optional[int] = ...) -> None: ...

class MatchResponse(_message.Message):
    __slots__ = ("matches", "total_blocks", "block_size", "pending", "pending_reported")
    MATCHES_FIELD_NUMBER: _ClassVar[int]
    TOTAL_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    PENDING_FIELD_NUMBER: _ClassVar[int]
    PENDING_REPORTED_FIELD_NUMBER: _ClassVar[int]
    matches: _containers.RepeatedCompositeFieldContainer[InstanceMatch]
    total_blocks: int
    block_size: int
    pending: _containers.RepeatedCompositeFieldContainer[PendingPrefill]
    pending_reported: bool
    def __init__(self, matches: _Optional[_Iterable[_Union[InstanceMatch, _Mapping]]] = ..., total_blocks: _Optional[int] = ..., block_size: _Optional[int] = ..., pending: _Optional[_Iterable[_Union[PendingPrefill, _Mapping]]] = ..., pending_reported: _Optional[bool] = ...) -> None: ...

class PendingPrefill(_message.Message):
    __slots__ = ("instance", "predicted_blocks")
    INSTANCE_FIELD_NUMBER: _ClassVar[int]
    PREDICTED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    instance: InstanceRef
    predicted_blocks: int
    def __init__(self, instance: _Optional[_Union[InstanceRef, _Mapping]] = ..., predicted_blocks: _Optional[int] = ...) -> None: ...

class MatchStreamRequest(_message.Message):
    __slots__ = ("matches",)
    MATCHES_FIELD_NUMBER: _ClassVar[int]
    matches: _containers.RepeatedCompositeFieldContainer[MatchStreamItem]
    def __init__(self, matches: _Optional[_Iterable[_Union[MatchStreamItem, _Mapping]]] = ...) -> None: ...

class MatchStreamItem(_message.Message):
    __slots__ = ("request_id", "match", "predict")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    MATCH_FIELD_NUMBER: _ClassVar[int]
    PREDICT_FIELD_NUMBER: _ClassVar[int]
    request_id: int
    match: MatchRequest
    predict: PredictPlacementRequest
    def __init__(self, request_id: _Optional[int] = ..., match: _Optional[_Union[MatchRequest, _Mapping]] = ..., predict: _Optional[_Union[PredictPlacementRequest, _Mapping]] = ...) -> None: ...

class MatchStreamResponse(_message.Message):
    __slots__ = ("replies",)
    REPLIES_FIELD_NUMBER: _ClassVar[int]
    replies: _containers.RepeatedCompositeFieldContainer[MatchStreamReply]
    def __init__(self, replies: _Optional[_Iterable[_Union[MatchStreamReply, _Mapping]]] = ...) -> None: ...

class MatchStreamReply(_message.Message):
    __slots__ = ("request_id", "match", "code", "message", "field", "predicted")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    MATCH_FIELD_NUMBER: _ClassVar[int]
    CODE_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    FIELD_FIELD_NUMBER: _ClassVar[int]
    PREDICTED_FIELD_NUMBER: _ClassVar[int]
    request_id: int
    match: MatchResponse
    code: int
    message: str
    field: str
    predicted: PredictPlacementResponse
    def __init__(self, request_id: _Optional[int] = ..., match: _Optional[_Union[MatchResponse, _Mapping]] = ..., code: _Optional[int] = ..., message: _Optional[str] = ..., field: _Optional[str] = ..., predicted: _Optional[_Union[PredictPlacementResponse, _Mapping]] = ...) -> None: ...

class GetStatsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class NamespaceStats(_message.Message):
    __slots__ = ("model", "lora_name", "blocks", "block_instances")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    LORA_NAME_FIELD_NUMBER: _ClassVar[int]
    BLOCKS_FIELD_NUMBER: _ClassVar[int]
    BLOCK_INSTANCES_FIELD_NUMBER: _ClassVar[int]
    model: str
    lora_name: str
    blocks: int
    block_instances: int
    def __init__(self, model: _Optional[str] = ..., lora_name: _Optional[str] = ..., blocks: _Optional[int] = ..., block_instances: _Optional[int] = ...) -> None: ...

class GetStatsResponse(_message.Message):
    __slots__ = ("backend", "instances", "instances_live", "instances_stale", "blocks", "block_instances", "namespaces", "batches_applied", "batches_duplicate", "batches_rejected", "sequence_gaps", "matches", "matched_blocks", "predicted_blocks", "predictions_recorded", "predicted_matches")
    BACKEND_FIELD_NUMBER: _ClassVar[int]
    INSTANCES_FIELD_NUMBER: _ClassVar[int]
    INSTANCES_LIVE_FIELD_NUMBER: _ClassVar[int]
    INSTANCES_STALE_FIELD_NUMBER: _ClassVar[int]
    BLOCKS_FIELD_NUMBER: _ClassVar[int]
    BLOCK_INSTANCES_FIELD_NUMBER: _ClassVar[int]
    NAMESPACES_FIELD_NUMBER: _ClassVar[int]
    BATCHES_APPLIED_FIELD_NUMBER: _ClassVar[int]
    BATCHES_DUPLICATE_FIELD_NUMBER: _ClassVar[int]
    BATCHES_REJECTED_FIELD_NUMBER: _ClassVar[int]
    SEQUENCE_GAPS_FIELD_NUMBER: _ClassVar[int]
    MATCHES_FIELD_NUMBER: _ClassVar[int]
    MATCHED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    PREDICTED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    PREDICTIONS_RECORDED_FIELD_NUMBER: _ClassVar[int]
    PREDICTED_MATCHES_FIELD_NUMBER: _ClassVar[int]
    backend: str
    instances: int
    instances_live: int
    instances_stale: int
    blocks: int
    block_instances: int
    namespaces: _containers.RepeatedCompositeFieldContainer[NamespaceStats]
    batches_applied: int
    batches_duplicate: int
    batches_rejected: int
    sequence_gaps: int
    matches: int
    matched_blocks: int
    predicted_blocks: int
    predictions_recorded: int
    predicted_matches: int
    def __init__(self, backend: _Optional[str] = ..., instances: _Optional[int] = ..., instances_live: _Optional[int] = ..., instances_stale: _Optional[int] = ..., blocks: _Optional[int] = ..., block_instances: _Optional[int] = ..., namespaces: _Optional[_Iterable[_Union[NamespaceStats, _Mapping]]] = ..., batches_applied: _Optional[int] = ..., batches_duplicate: _Optional[int] = ..., batches_rejected: _Optional[int] = ..., sequence_gaps: _Optional[int] = ..., matches: _Optional[int] = ..., matched_blocks: _Optional[int] = ..., predicted_blocks: _Optional[int] = ..., predictions_recorded: _Optional[int] = ..., predicted_matches: _Optional[int] = ...) -> None: ...

class DumpIndexRequest(_message.Message):
    __slots__ = ("model", "max_blocks")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    MAX_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    model: str
    max_blocks: int
    def __init__(self, model: _Optional[str] = ..., max_blocks: _Optional[int] = ...) -> None: ...

class DumpedHolder(_message.Message):
    __slots__ = ("instance", "tiers")
    INSTANCE_FIELD_NUMBER: _ClassVar[int]
    TIERS_FIELD_NUMBER: _ClassVar[int]
    instance: InstanceRef
    tiers: _containers.RepeatedScalarFieldContainer[Tier]
    def __init__(self, instance: _Optional[_Union[InstanceRef, _Mapping]] = ..., tiers: _Optional[_Iterable[_Union[Tier, str]]] = ...) -> None: ...

class DumpedBlock(_message.Message):
    __slots__ = ("model", "lora_name", "block_key", "holders")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    LORA_NAME_FIELD_NUMBER: _ClassVar[int]
    BLOCK_KEY_FIELD_NUMBER: _ClassVar[int]
    HOLDERS_FIELD_NUMBER: _ClassVar[int]
    model: str
    lora_name: str
    block_key: int
    holders: _containers.RepeatedCompositeFieldContainer[DumpedHolder]
    def __init__(self, model: _Optional[str] = ..., lora_name: _Optional[str] = ..., block_key: _Optional[int] = ..., holders: _Optional[_Iterable[_Union[DumpedHolder, _Mapping]]] = ...) -> None: ...

class DumpIndexResponse(_message.Message):
    __slots__ = ("blocks", "truncated")
    BLOCKS_FIELD_NUMBER: _ClassVar[int]
    TRUNCATED_FIELD_NUMBER: _ClassVar[int]
    blocks: _containers.RepeatedCompositeFieldContainer[DumpedBlock]
    truncated: bool
    def __init__(self, blocks: _Optional[_Iterable[_Union[DumpedBlock, _Mapping]]] = ..., truncated: _Optional[bool] = ...) -> None: ...

class PingRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class PingResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class WatchIndexRequest(_message.Message):
    __slots__ = ("models", "max_buffer", "instance_parts", "keepalive_ms", "predictions")
    MODELS_FIELD_NUMBER: _ClassVar[int]
    MAX_BUFFER_FIELD_NUMBER: _ClassVar[int]
    INSTANCE_PARTS_FIELD_NUMBER: _ClassVar[int]
    KEEPALIVE_MS_FIELD_NUMBER: _ClassVar[int]
    PREDICTIONS_FIELD_NUMBER: _ClassVar[int]
    models: _containers.RepeatedScalarFieldContainer[str]
    max_buffer: int
    instance_parts: bool
    keepalive_ms: int
    predictions: bool
    def __init__(self, models: _Optional[_Iterable[str]] = ..., max_buffer: _Optional[int] = ..., instance_parts: _Optional[bool] = ..., keepalive_ms: _Optional[int] = ..., predictions: _Optional[bool] = ...) -> None: ...

class WatchedInstance(_message.Message):
    __slots__ = ("info", "content", "part", "more", "predicted")
    INFO_FIELD_NUMBER: _ClassVar[int]
    CONTENT_FIELD_NUMBER: _ClassVar[int]
    PART_FIELD_NUMBER: _ClassVar[int]
    MORE_FIELD_NUMBER: _ClassVar[int]
    PREDICTED_FIELD_NUMBER: _ClassVar[int]
    info: InstanceInfo
    content: EventBatch
    part: int
    more: bool
    predicted: _containers.RepeatedCompositeFieldContainer[WatchPredicted]
    def __init__(self, info: _Optional[_Union[InstanceInfo, _Mapping]] = ..., content: _Optional[_Union[EventBatch, _Mapping]] = ..., part: _Optional[int] = ..., more: _Optional[bool] = ..., predicted: _Optional[_Iterable[_Union[WatchPredicted, _Mapping]]] = ...) -> None: ...

class WatchSynced(_message.Message):
    __slots__ = ("instances", "predictions")
    INSTANCES_FIELD_NUMBER: _ClassVar[int]
    PREDICTIONS_FIELD_NUMBER: _ClassVar[int]
    instances: int
    predictions: bool
    def __init__(self, instances: _Optional[int] = ..., predictions: _Optional[bool] = ...) -> None: ...

class WatchPredicted(_message.Message):
    __slots__ = ("instance", "lora_name", "block_keys", "expires_at", "max_per_instance", "pending_until")
    INSTANCE_FIELD_NUMBER: _ClassVar[int]
    LORA_NAME_FIELD_NUMBER: _ClassVar[int]
    BLOCK_KEYS_FIELD_NUMBER: _ClassVar[int]
    EXPIRES_AT_FIELD_NUMBER: _ClassVar[int]
    MAX_PER_INSTANCE_FIELD_NUMBER: _ClassVar[int]
    PENDING_UNTIL_FIELD_NUMBER: _ClassVar[int]
    instance: InstanceRef
    lora_name: str
    block_keys: _containers.RepeatedScalarFieldContainer[int]
    expires_at: float
    max_per_instance: int
    pending_until: float
    def __init__(self, instance: _Optional[_Union[InstanceRef, _Mapping]] = ..., lora_name: _Optional[str] = ..., block_keys: _Optional[_Iterable[int]] = ..., expires_at: _Optional[float] = ..., max_per_instance: _Optional[int] = ..., pending_until: _Optional[float] = ...) -> None: ...

class WatchRegistered(_message.Message):
    __slots__ = ("info", "reset")
    INFO_FIELD_NUMBER: _ClassVar[int]
    RESET_FIELD_NUMBER: _ClassVar[int]
    info: InstanceInfo
    reset: bool
    def __init__(self, info: _Optional[_Union[InstanceInfo, _Mapping]] = ..., reset: _Optional[bool] = ...) -> None: ...

class WatchGone(_message.Message):
    __slots__ = ("instance", "reason")
    INSTANCE_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    instance: InstanceRef
    reason: str
    def __init__(self, instance: _Optional[_Union[InstanceRef, _Mapping]] = ..., reason: _Optional[str] = ...) -> None: ...

class WatchResync(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class WatchChange(_message.Message):
    __slots__ = ("position", "applied_at", "snapshot", "synced", "registered", "renewed", "batch", "gone", "resync", "predicted")
    POSITION_FIELD_NUMBER: _ClassVar[int]
    APPLIED_AT_FIELD_NUMBER: _ClassVar[int]
    SNAPSHOT_FIELD_NUMBER: _ClassVar[int]
    SYNCED_FIELD_NUMBER: _ClassVar[int]
    REGISTERED_FIELD_NUMBER: _ClassVar[int]
    RENEWED_FIELD_NUMBER: _ClassVar[int]
    BATCH_FIELD_NUMBER: _ClassVar[int]
    GONE_FIELD_NUMBER: _ClassVar[int]
    RESYNC_FIELD_NUMBER: _ClassVar[int]
    PREDICTED_FIELD_NUMBER: _ClassVar[int]
    position: int
    applied_at: float
    snapshot: WatchedInstance
    synced: WatchSynced
    registered: WatchRegistered
    renewed: InstanceRef
    batch: EventBatch
    gone: WatchGone
    resync: WatchResync
    predicted: WatchPredicted
    def __init__(self, position: _Optional[int] = ..., applied_at: _Optional[float] = ..., snapshot: _Optional[_Union[WatchedInstance, _Mapping]] = ..., synced: _Optional[_Union[WatchSynced, _Mapping]] = ..., registered: _Optional[_Union[WatchRegistered, _Mapping]] = ..., renewed: _Optional[_Union[InstanceRef, _Mapping]] = ..., batch: _Optional[_Union[EventBatch, _Mapping]] = ..., gone: _Optional[_Union[WatchGone, _Mapping]] = ..., resync: _Optional[_Union[WatchResync, _Mapping]] = ..., predicted: _Optional[_Union[WatchPredicted, _Mapping]] = ...) -> None: ...

class WatchKeepalive(_message.Message):
    __slots__ = ("interval_ms", "position", "sent_at")
    INTERVAL_MS_FIELD_NUMBER: _ClassVar[int]
    POSITION_FIELD_NUMBER: _ClassVar[int]
    SENT_AT_FIELD_NUMBER: _ClassVar[int]
    interval_ms: int
    position: int
    sent_at: float
    def __init__(self, interval_ms: _Optional[int] = ..., position: _Optional[int] = ..., sent_at: _Optional[float] = ...) -> None: ...

class WatchIndexResponse(_message.Message):
    __slots__ = ("changes", "keepalive")
    CHANGES_FIELD_NUMBER: _ClassVar[int]
    KEEPALIVE_FIELD_NUMBER: _ClassVar[int]
    changes: _containers.RepeatedCompositeFieldContainer[WatchChange]
    keepalive: WatchKeepalive
    def __init__(self, changes: _Optional[_Iterable[_Union[WatchChange, _Mapping]]] = ..., keepalive: _Optional[_Union[WatchKeepalive, _Mapping]] = ...) -> None: ...

class PredictPlacementRequest(_message.Message):
    __slots__ = ("model", "lora_name", "instance", "block_keys", "ttl_ms", "pending_ms")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    LORA_NAME_FIELD_NUMBER: _ClassVar[int]
    INSTANCE_FIELD_NUMBER: _ClassVar[int]
    BLOCK_KEYS_FIELD_NUMBER: _ClassVar[int]
    TTL_MS_FIELD_NUMBER: _ClassVar[int]
    PENDING_MS_FIELD_NUMBER: _ClassVar[int]
    model: str
    lora_name: str
    instance: InstanceRef
    block_keys: _containers.RepeatedScalarFieldContainer[int]
    ttl_ms: int
    pending_ms: int
    def __init__(self, model: _Optional[str] = ..., lora_name: _Optional[str] = ..., instance: _Optional[_Union[InstanceRef, _Mapping]] = ..., block_keys: _Optional[_Iterable[int]] = ..., ttl_ms: _Optional[int] = ..., pending_ms: _Optional[int] = ...) -> None: ...

class PredictPlacementResponse(_message.Message):
    __slots__ = ("predicted_blocks", "ttl_ms")
    PREDICTED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    TTL_MS_FIELD_NUMBER: _ClassVar[int]
    predicted_blocks: int
    ttl_ms: int
    def __init__(self, predicted_blocks: _Optional[int] = ..., ttl_ms: _Optional[int] = ...) -> None: ...
