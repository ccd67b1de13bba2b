from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class RoomStatus(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    ROOM_STATUS_FAILED: _ClassVar[RoomStatus]
    ROOM_STATUS_BOOTSTRAPPING: _ClassVar[RoomStatus]
    ROOM_STATUS_WAITING_FOR_INPUT: _ClassVar[RoomStatus]
    ROOM_STATUS_TRANSFERRING: _ClassVar[RoomStatus]
    ROOM_STATUS_SUCCESS: _ClassVar[RoomStatus]

class PrefetchState(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    PREFETCH_STATE_UNSPECIFIED: _ClassVar[PrefetchState]
    PREFETCH_STATE_PULLING: _ClassVar[PrefetchState]
    PREFETCH_STATE_READY: _ClassVar[PrefetchState]
    PREFETCH_STATE_CANCELLED: _ClassVar[PrefetchState]
    PREFETCH_STATE_FAILED: _ClassVar[PrefetchState]
    PREFETCH_STATE_EXPIRED: _ClassVar[PrefetchState]

class ClaimOutcome(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    CLAIM_OUTCOME_UNSPECIFIED: _ClassVar[ClaimOutcome]
    CLAIM_OUTCOME_READY: _ClassVar[ClaimOutcome]
    CLAIM_OUTCOME_WAITED: _ClassVar[ClaimOutcome]
    CLAIM_OUTCOME_FALLBACK: _ClassVar[ClaimOutcome]
    CLAIM_OUTCOME_FAILED: _ClassVar[ClaimOutcome]
ROOM_STATUS_FAILED: RoomStatus
ROOM_STATUS_BOOTSTRAPPING: RoomStatus
ROOM_STATUS_WAITING_FOR_INPUT: RoomStatus
ROOM_STATUS_TRANSFERRING: RoomStatus
ROOM_STATUS_SUCCESS: RoomStatus
PREFETCH_STATE_UNSPECIFIED: PrefetchState
PREFETCH_STATE_PULLING: PrefetchState
PREFETCH_STATE_READY: PrefetchState
PREFETCH_STATE_CANCELLED: PrefetchState
PREFETCH_STATE_FAILED: PrefetchState
PREFETCH_STATE_EXPIRED: PrefetchState
CLAIM_OUTCOME_UNSPECIFIED: ClaimOutcome
CLAIM_OUTCOME_READY: ClaimOutcome
CLAIM_OUTCOME_WAITED: ClaimOutcome
CLAIM_OUTCOME_FALLBACK: ClaimOutcome
CLAIM_OUTCOME_FAILED: ClaimOutcome

class RegisterRoomRequest(_message.Message):
    __slots__ = ("room", "prefill_address", "dst_page_indices", "aux_index")
    ROOM_FIELD_NUMBER: _ClassVar[int]
    PREFILL_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    DST_PAGE_INDICES_FIELD_NUMBER: _ClassVar[int]
    AUX_INDEX_FIELD_NUMBER: _ClassVar[int]
    room: int
    prefill_address: str
    dst_page_indices: _containers.RepeatedScalarFieldContainer[int]
    aux_index: int
    def __init__(self, room: _Optional[int] = ..., prefill_address: _Optional[str] = ..., dst_page_indices: _Optional[_Iterable[int]] = ..., aux_index: _Optional[int] = ...) -> None: ...

class RegisterRoomResponse(_message.Message):
    __slots__ = ("generation",)
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    generation: int
    def __init__(self, generation: _Optional[int] = ...) -> None: ...

class AddTransferRequestRequest(_message.Message):
    __slots__ = ("room", "page_indices", "index_slice_start", "index_slice_end", "is_last", "aux_index", "chunk_id")
    ROOM_FIELD_NUMBER: _ClassVar[int]
    PAGE_INDICES_FIELD_NUMBER: _ClassVar[int]
    INDEX_SLICE_START_FIELD_NUMBER: _ClassVar[int]
    INDEX_SLICE_END_FIELD_NUMBER: _ClassVar[int]
    IS_LAST_FIELD_NUMBER: _ClassVar[int]
    AUX_INDEX_FIELD_NUMBER: _ClassVar[int]
    CHUNK_ID_FIELD_NUMBER: _ClassVar[int]
    room: int
    page_indices: _containers.RepeatedScalarFieldContainer[int]
    index_slice_start: int
    index_slice_end: int
    is_last: bool
    aux_index: int
    chunk_id: int
    def __init__(self, room: _Optional[int] = ..., page_indices: _Optional[_Iterable[int]] = ..., index_slice_start: _Optional[int] = ..., index_slice_end: _Optional[int] = ..., is_last: _Optional[bool] = ..., aux_index: _Optional[int] = ..., chunk_id: _Optional[int] = ...) -> None: ...

class AddTransferRequestResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class AddTransferRequestsRequest(_message.Message):
    __slots__ = ("requests",)
    REQUESTS_FIELD_NUMBER: _ClassVar[int]
    requests: _containers.RepeatedCompositeFieldContainer[AddTransferRequestRequest]
    def __init__(self, requests: _Optional[_Iterable[_Union[AddTransferRequestRequest, _Mapping]]] = ...) -> None: ...

class AddTransferRequestsResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class PollRequest(_message.Message):
    __slots__ = ("room",)
    ROOM_FIELD_NUMBER: _ClassVar[int]
    room: int
    def __init__(self, room: _Optional[int] = ...) -> None: ...

class PollResponse(_message.Message):
    __slots__ = ("status", "failure_reason", "bytes")
    STATUS_FIELD_NUMBER: _ClassVar[int]
    FAILURE_REASON_FIELD_NUMBER: _ClassVar[int]
    BYTES_FIELD_NUMBER: _ClassVar[int]
    status: RoomStatus
    failure_reason: str
    bytes: int
    def __init__(self, status: _Optional[_Union[RoomStatus, str]] = ..., failure_reason: _Optional[str] = ..., bytes: _Optional[int] = ...) -> None: ...

class PollRoomsRequest(_message.Message):
    __slots__ = ("rooms", "wait_ms", "known")
    ROOMS_FIELD_NUMBER: _ClassVar[int]
    WAIT_MS_FIELD_NUMBER: _ClassVar[int]
    KNOWN_FIELD_NUMBER: _ClassVar[int]
    rooms: _containers.RepeatedScalarFieldContainer[int]
    wait_ms: int
    known: _containers.RepeatedScalarFieldContainer[RoomStatus]
    def __init__(self, rooms: _Optional[_Iterable[int]] = ..., wait_ms: _Optional[int] = ..., known: _Optional[_Iterable[_Union[RoomStatus, str]]] = ...) -> None: ...

class RoomState(_message.Message):
    __slots__ = ("room", "found", "status", "failure_reason", "bytes")
    ROOM_FIELD_NUMBER: _ClassVar[int]
    FOUND_FIELD_NUMBER: _ClassVar[int]
    STATUS_FIELD_NUMBER: _ClassVar[int]
    FAILURE_REASON_FIELD_NUMBER: _ClassVar[int]
    BYTES_FIELD_NUMBER: _ClassVar[int]
    room: int
    found: bool
    status: RoomStatus
    failure_reason: str
    bytes: int
    def __init__(self, room: _Optional[int] = ..., found: _Optional[bool] = ..., status: _Optional[_Union[RoomStatus, str]] = ..., failure_reason: _Optional[str] = ..., bytes: _Optional[int] = ...) -> None: ...

class PollRoomsResponse(_message.Message):
    __slots__ = ("rooms",)
    ROOMS_FIELD_NUMBER: _ClassVar[int]
    rooms: _containers.RepeatedCompositeFieldContainer[RoomState]
    def __init__(self, rooms: _Optional[_Iterable[_Union[RoomState, _Mapping]]] = ...) -> None: ...

class ClearRequest(_message.Message):
    __slots__ = ("room",)
    ROOM_FIELD_NUMBER: _ClassVar[int]
    room: int
    def __init__(self, room: _Optional[int] = ...) -> None: ...

class ClearResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class BootstrapRequest(_message.Message):
    __slots__ = ("room", "generation", "dst_page_indices", "aux_index", "peer_name", "agent_metadata", "peer_address", "page_size", "page_count", "aux_size", "aux_count", "transport")
    ROOM_FIELD_NUMBER: _ClassVar[int]
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    DST_PAGE_INDICES_FIELD_NUMBER: _ClassVar[int]
    AUX_INDEX_FIELD_NUMBER: _ClassVar[int]
    PEER_NAME_FIELD_NUMBER: _ClassVar[int]
    AGENT_METADATA_FIELD_NUMBER: _ClassVar[int]
    PEER_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    PAGE_SIZE_FIELD_NUMBER: _ClassVar[int]
    PAGE_COUNT_FIELD_NUMBER: _ClassVar[int]
    AUX_SIZE_FIELD_NUMBER: _ClassVar[int]
    AUX_COUNT_FIELD_NUMBER: _ClassVar[int]
    TRANSPORT_FIELD_NUMBER: _ClassVar[int]
    room: int
    generation: int
    dst_page_indices: _containers.RepeatedScalarFieldContainer[int]
    aux_index: int
    peer_name: str
    agent_metadata: bytes
    peer_address: str
    page_size: int
    page_count: int
    aux_size: int
    aux_count: int
    transport: str
    def __init__(self, room: _Optional[int] = ..., generation: _Optional[int] = ..., dst_page_indices: _Optional[_Iterable[int]] = ..., aux_index: _Optional[int] = ..., peer_name: _Optional[str] = ..., agent_metadata: _Optional[bytes] = ..., peer_address: _Optional[str] = ..., page_size: _Optional[int] = ..., page_count: _Optional[int] = ..., aux_size: _Optional[int] = ..., aux_count: _Optional[int] = ..., transport: _Optional[str] = ...) -> None: ...

class BootstrapResponse(_message.Message):
    __slots__ = ("instance_id", "agent_name")
    INSTANCE_ID_FIELD_NUMBER: _ClassVar[int]
    AGENT_NAME_FIELD_NUMBER: _ClassVar[int]
    instance_id: str
    agent_name: str
    def __init__(self, instance_id: _Optional[str] = ..., agent_name: _Optional[str] = ...) -> None: ...

class AbortRequest(_message.Message):
    __slots__ = ("room", "generation", "reason")
    ROOM_FIELD_NUMBER: _ClassVar[int]
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    room: int
    generation: int
    reason: str
    def __init__(self, room: _Optional[int] = ..., generation: _Optional[int] = ..., reason: _Optional[str] = ...) -> None: ...

class AbortResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class HeartbeatRequest(_message.Message):
    __slots__ = ("peer_name",)
    PEER_NAME_FIELD_NUMBER: _ClassVar[int]
    peer_name: str
    def __init__(self, peer_name: _Optional[str] = ...) -> None: ...

class HeartbeatResponse(_message.Message):
    __slots__ = ("instance_id",)
    INSTANCE_ID_FIELD_NUMBER: _ClassVar[int]
    instance_id: str
    def __init__(self, instance_id: _Optional[str] = ...) -> None: ...

class PrefetchRequest(_message.Message):
    __slots__ = ("prefetch_id", "source_address", "src_page_indices", "dst_page_indices", "ttl_ms", "deadline_ms")
    PREFETCH_ID_FIELD_NUMBER: _ClassVar[int]
    SOURCE_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    SRC_PAGE_INDICES_FIELD_NUMBER: _ClassVar[int]
    DST_PAGE_INDICES_FIELD_NUMBER: _ClassVar[int]
    TTL_MS_FIELD_NUMBER: _ClassVar[int]
    DEADLINE_MS_FIELD_NUMBER: _ClassVar[int]
    prefetch_id: int
    source_address: str
    src_page_indices: _containers.RepeatedScalarFieldContainer[int]
    dst_page_indices: _containers.RepeatedScalarFieldContainer[int]
    ttl_ms: int
    deadline_ms: int
    def __init__(self, prefetch_id: _Optional[int] = ..., source_address: _Optional[str] = ..., src_page_indices: _Optional[_Iterable[int]] = ..., dst_page_indices: _Optional[_Iterable[int]] = ..., ttl_ms: _Optional[int] = ..., deadline_ms: _Optional[int] = ...) -> None: ...

class PrefetchResponse(_message.Message):
    __slots__ = ("prefetch_id", "state")
    PREFETCH_ID_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    prefetch_id: int
    state: PrefetchState
    def __init__(self, prefetch_id: _Optional[int] = ..., state: _Optional[_Union[PrefetchState, str]] = ...) -> None: ...

class CancelPrefetchRequest(_message.Message):
    __slots__ = ("prefetch_id",)
    PREFETCH_ID_FIELD_NUMBER: _ClassVar[int]
    prefetch_id: int
    def __init__(self, prefetch_id: _Optional[int] = ...) -> None: ...

class CancelPrefetchResponse(_message.Message):
    __slots__ = ("prior_state",)
    PRIOR_STATE_FIELD_NUMBER: _ClassVar[int]
    prior_state: PrefetchState
    def __init__(self, prior_state: _Optional[_Union[PrefetchState, str]] = ...) -> None: ...

class ClaimPrefetchRequest(_message.Message):
    __slots__ = ("prefetch_id", "timeout_ms", "fallback")
    PREFETCH_ID_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_MS_FIELD_NUMBER: _ClassVar[int]
    FALLBACK_FIELD_NUMBER: _ClassVar[int]
    prefetch_id: int
    timeout_ms: int
    fallback: bool
    def __init__(self, prefetch_id: _Optional[int] = ..., timeout_ms: _Optional[int] = ..., fallback: _Optional[bool] = ...) -> None: ...

class ClaimPrefetchResponse(_message.Message):
    __slots__ = ("outcome", "prior_state", "failure_reason", "bytes")
    OUTCOME_FIELD_NUMBER: _ClassVar[int]
    PRIOR_STATE_FIELD_NUMBER: _ClassVar[int]
    FAILURE_REASON_FIELD_NUMBER: _ClassVar[int]
    BYTES_FIELD_NUMBER: _ClassVar[int]
    outcome: ClaimOutcome
    prior_state: PrefetchState
    failure_reason: str
    bytes: int
    def __init__(self, outcome: _Optional[_Union[ClaimOutcome, str]] = ..., prior_state: _Optional[_Union[PrefetchState, str]] = ..., failure_reason: _Optional[str] = ..., bytes: _Optional[int] = ...) -> None: ...

class OpenReadRequest(_message.Message):
    __slots__ = ("prefetch_id", "src_page_indices", "peer_name", "page_size", "transport")
    PREFETCH_ID_FIELD_NUMBER: _ClassVar[int]
    SRC_PAGE_INDICES_FIELD_NUMBER: _ClassVar[int]
    PEER_NAME_FIELD_NUMBER: _ClassVar[int]
    PAGE_SIZE_FIELD_NUMBER: _ClassVar[int]
    TRANSPORT_FIELD_NUMBER: _ClassVar[int]
    prefetch_id: int
    src_page_indices: _containers.RepeatedScalarFieldContainer[int]
    peer_name: str
    page_size: int
    transport: str
    def __init__(self, prefetch_id: _Optional[int] = ..., src_page_indices: _Optional[_Iterable[int]] = ..., peer_name: _Optional[str] = ..., page_size: _Optional[int] = ..., transport: _Optional[str] = ...) -> None: ...

class OpenReadResponse(_message.Message):
    __slots__ = ("instance_id", "agent_name", "agent_metadata", "page_count")
    INSTANCE_ID_FIELD_NUMBER: _ClassVar[int]
    AGENT_NAME_FIELD_NUMBER: _ClassVar[int]
    AGENT_METADATA_FIELD_NUMBER: _ClassVar[int]
    PAGE_COUNT_FIELD_NUMBER: _ClassVar[int]
    instance_id: str
    agent_name: str
    agent_metadata: bytes
    page_count: int
    def __init__(self, instance_id: _Optional[str] = ..., agent_name: _Optional[str] = ..., agent_metadata: _Optional[bytes] = ..., page_count: _Optional[int] = ...) -> None: ...
