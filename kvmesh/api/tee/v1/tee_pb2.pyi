from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class EventKind(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    EVENT_KIND_UNSPECIFIED: _ClassVar[EventKind]
    EVENT_KIND_INGEST: _ClassVar[EventKind]
    EVENT_KIND_EXTEND: _ClassVar[EventKind]
EVENT_KIND_UNSPECIFIED: EventKind
EVENT_KIND_INGEST: EventKind
EVENT_KIND_EXTEND: EventKind

class RoutedEvent(_message.Message):
    __slots__ = ("kind", "model", "input_ids", "request_id", "prompt_len", "choice_index", "choice_count", "output_tokens", "worker")
    KIND_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    INPUT_IDS_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LEN_FIELD_NUMBER: _ClassVar[int]
    CHOICE_INDEX_FIELD_NUMBER: _ClassVar[int]
    CHOICE_COUNT_FIELD_NUMBER: _ClassVar[int]
    OUTPUT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    WORKER_FIELD_NUMBER: _ClassVar[int]
    kind: EventKind
    model: str
    input_ids: _containers.RepeatedScalarFieldContainer[int]
    request_id: str
    prompt_len: int
    choice_index: int
    choice_count: int
    output_tokens: int
    worker: str
    def __init__(self, kind: _Optional[_Union[EventKind, str]] = ..., model: _Optional[str] = ..., input_ids: _Optional[_Iterable[int]] = ..., request_id: _Optional[str] = ..., prompt_len: _Optional[int] = ..., choice_index: _Optional[int] = ..., choice_count: _Optional[int] = ..., output_tokens: _Optional[int] = ..., worker: _Optional[str] = ...) -> None: ...

class SinkStats(_message.Message):
    __slots__ = ("sink", "offered", "sent", "dropped_full", "dropped_closed", "dropped_invalid", "failed_http", "failed_error", "failed_timeout", "queued", "in_flight")
    SINK_FIELD_NUMBER: _ClassVar[int]
    OFFERED_FIELD_NUMBER: _ClassVar[int]
    SENT_FIELD_NUMBER: _ClassVar[int]
    DROPPED_FULL_FIELD_NUMBER: _ClassVar[int]
    DROPPED_CLOSED_FIELD_NUMBER: _ClassVar[int]
    DROPPED_INVALID_FIELD_NUMBER: _ClassVar[int]
    FAILED_HTTP_FIELD_NUMBER: _ClassVar[int]
    FAILED_ERROR_FIELD_NUMBER: _ClassVar[int]
    FAILED_TIMEOUT_FIELD_NUMBER: _ClassVar[int]
    QUEUED_FIELD_NUMBER: _ClassVar[int]
    IN_FLIGHT_FIELD_NUMBER: _ClassVar[int]
    sink: str
    offered: int
    sent: int
    dropped_full: int
    dropped_closed: int
    dropped_invalid: int
    failed_http: int
    failed_error: int
    failed_timeout: int
    queued: int
    in_flight: int
    def __init__(self, sink: _Optional[str] = ..., offered: _Optional[int] = ..., sent: _Optional[int] = ..., dropped_full: _Optional[int] = ..., dropped_closed: _Optional[int] = ..., dropped_invalid: _Optional[int] = ..., failed_http: _Optional[int] = ..., failed_error: _Optional[int] = ..., failed_timeout: _Optional[int] = ..., queued: _Optional[int] = ..., in_flight: _Optional[int] = ...) -> None: ...

class OfferEventsRequest(_message.Message):
    __slots__ = ("events",)
    EVENTS_FIELD_NUMBER: _ClassVar[int]
    events: _containers.RepeatedCompositeFieldContainer[RoutedEvent]
    def __init__(self, events: _Optional[_Iterable[_Union[RoutedEvent, _Mapping]]] = ...) -> None: ...

class OfferEventsResponse(_message.Message):
    __slots__ = ("accepted", "dropped")
    ACCEPTED_FIELD_NUMBER: _ClassVar[int]
    DROPPED_FIELD_NUMBER: _ClassVar[int]
    accepted: int
    dropped: int
    def __init__(self, accepted: _Optional[int] = ..., dropped: _Optional[int] = ...) -> None: ...

class StreamEventsRequest(_message.Message):
    __slots__ = ("events",)
    EVENTS_FIELD_NUMBER: _ClassVar[int]
    events: _containers.RepeatedCompositeFieldContainer[RoutedEvent]
    def __init__(self, events: _Optional[_Iterable[_Union[RoutedEvent, _Mapping]]] = ...) -> None: ...

class StreamEventsResponse(_message.Message):
    __slots__ = ("accepted", "dropped")
    ACCEPTED_FIELD_NUMBER: _ClassVar[int]
    DROPPED_FIELD_NUMBER: _ClassVar[int]
    accepted: int
    dropped: int
    def __init__(self, accepted: _Optional[int] = ..., dropped: _Optional[int] = ...) -> None: ...

class GetTeeStatsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class GetTeeStatsResponse(_message.Message):
    __slots__ = ("sinks",)
    SINKS_FIELD_NUMBER: _ClassVar[int]
    sinks: _containers.RepeatedCompositeFieldContainer[SinkStats]
    def __init__(self, sinks: _Optional[_Iterable[_Union[SinkStats, _Mapping]]] = ...) -> None: ...

class HitStats(_message.Message):
    __slots__ = ("requests", "blocks", "hit_blocks", "hit_rate")
    REQUESTS_FIELD_NUMBER: _ClassVar[int]
    BLOCKS_FIELD_NUMBER: _ClassVar[int]
    HIT_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    HIT_RATE_FIELD_NUMBER: _ClassVar[int]
    requests: int
    blocks: int
    hit_blocks: int
    hit_rate: float
    def __init__(self, requests: _Optional[int] = ..., blocks: _Optional[int] = ..., hit_blocks: _Optional[int] = ..., hit_rate: _Optional[float] = ...) -> None: ...

class WorkerHitStats(_message.Message):
    __slots__ = ("worker", "stats")
    WORKER_FIELD_NUMBER: _ClassVar[int]
    STATS_FIELD_NUMBER: _ClassVar[int]
    worker: str
    stats: HitStats
    def __init__(self, worker: _Optional[str] = ..., stats: _Optional[_Union[HitStats, _Mapping]] = ...) -> None: ...

class CacheFigures(_message.Message):
    __slots__ = ("requests", "blocks", "routed", "pooled_bound", "infinite_bound", "worker_cv", "workers", "available", "optimal_decisions")
    REQUESTS_FIELD_NUMBER: _ClassVar[int]
    BLOCKS_FIELD_NUMBER: _ClassVar[int]
    ROUTED_FIELD_NUMBER: _ClassVar[int]
    POOLED_BOUND_FIELD_NUMBER: _ClassVar[int]
    INFINITE_BOUND_FIELD_NUMBER: _ClassVar[int]
    WORKER_CV_FIELD_NUMBER: _ClassVar[int]
    WORKERS_FIELD_NUMBER: _ClassVar[int]
    AVAILABLE_FIELD_NUMBER: _ClassVar[int]
    OPTIMAL_DECISIONS_FIELD_NUMBER: _ClassVar[int]
    requests: int
    blocks: int
    routed: HitStats
    pooled_bound: HitStats
    infinite_bound: HitStats
    worker_cv: float
    workers: _containers.RepeatedCompositeFieldContainer[WorkerHitStats]
    available: HitStats
    optimal_decisions: int
    def __init__(self, requests: _Optional[int] = ..., blocks: _Optional[int] = ..., routed: _Optional[_Union[HitStats, _Mapping]] = ..., pooled_bound: _Optional[_Union[HitStats, _Mapping]] = ..., infinite_bound: _Optional[_Union[HitStats, _Mapping]] = ..., worker_cv: _Optional[float] = ..., workers: _Optional[_Iterable[_Union[WorkerHitStats, _Mapping]]] = ..., available: _Optional[_Union[HitStats, _Mapping]] = ..., optimal_decisions: _Optional[int] = ...) -> None: ...

class ModelReport(_message.Message):
    __slots__ = ("model", "workers", "total", "window", "window_seconds")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    WORKERS_FIELD_NUMBER: _ClassVar[int]
    TOTAL_FIELD_NUMBER: _ClassVar[int]
    WINDOW_FIELD_NUMBER: _ClassVar[int]
    WINDOW_SECONDS_FIELD_NUMBER: _ClassVar[int]
    model: str
    workers: int
    total: CacheFigures
    window: CacheFigures
    window_seconds: float
    def __init__(self, model: _Optional[str] = ..., workers: _Optional[int] = ..., total: _Optional[_Union[CacheFigures, _Mapping]] = ..., window: _Optional[_Union[CacheFigures, _Mapping]] = ..., window_seconds: _Optional[float] = ...) -> None: ...

class GetReportRequest(_message.Message):
    __slots__ = ("model",)
    MODEL_FIELD_NUMBER: _ClassVar[int]
    model: str
    def __init__(self, model: _Optional[str] = ...) -> None: ...

class GetReportResponse(_message.Message):
    __slots__ = ("models",)
    MODELS_FIELD_NUMBER: _ClassVar[int]
    models: _containers.RepeatedCompositeFieldContainer[ModelReport]
    def __init__(self, models: _Optional[_Iterable[_Union[ModelReport, _Mapping]]] = ...) -> None: ...
