import datetime

from google.protobuf import duration_pb2 as _duration_pb2
from google.protobuf import timestamp_pb2 as _timestamp_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class HintPriority(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    HINT_PRIORITY_UNSPECIFIED: _ClassVar[HintPriority]
    HINT_PRIORITY_NORMAL: _ClassVar[HintPriority]
    HINT_PRIORITY_HIGH: _ClassVar[HintPriority]

class RouteReason(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    ROUTE_REASON_UNSPECIFIED: _ClassVar[RouteReason]
    ROUTE_REASON_READY: _ClassVar[RouteReason]
    ROUTE_REASON_LOADING: _ClassVar[RouteReason]
    ROUTE_REASON_STAGED: _ClassVar[RouteReason]
    ROUTE_REASON_COLD: _ClassVar[RouteReason]

class ReadinessState(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    READINESS_STATE_UNSPECIFIED: _ClassVar[ReadinessState]
    READINESS_STATE_READY: _ClassVar[ReadinessState]
    READINESS_STATE_NOT_READY: _ClassVar[ReadinessState]

class RelayedCommandKind(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    RELAYED_COMMAND_KIND_UNSPECIFIED: _ClassVar[RelayedCommandKind]
    RELAYED_COMMAND_KIND_PREFETCH: _ClassVar[RelayedCommandKind]
    RELAYED_COMMAND_KIND_EVICT: _ClassVar[RelayedCommandKind]
    RELAYED_COMMAND_KIND_STAGE: _ClassVar[RelayedCommandKind]
    RELAYED_COMMAND_KIND_RANKING: _ClassVar[RelayedCommandKind]

class ResidencyState(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    RESIDENCY_STATE_UNSPECIFIED: _ClassVar[ResidencyState]
    RESIDENCY_STATE_LOADING: _ClassVar[ResidencyState]
    RESIDENCY_STATE_READY: _ClassVar[ResidencyState]
    RESIDENCY_STATE_IN_USE: _ClassVar[ResidencyState]
    RESIDENCY_STATE_GONE: _ClassVar[ResidencyState]
    RESIDENCY_STATE_FAILED: _ClassVar[ResidencyState]
    RESIDENCY_STATE_HOST_STAGED: _ClassVar[ResidencyState]
    RESIDENCY_STATE_HOST_DROPPED: _ClassVar[ResidencyState]
    RESIDENCY_STATE_NO_ROOM: _ClassVar[ResidencyState]
    RESIDENCY_STATE_CAPACITY: _ClassVar[ResidencyState]
HINT_PRIORITY_UNSPECIFIED: HintPriority
HINT_PRIORITY_NORMAL: HintPriority
HINT_PRIORITY_HIGH: HintPriority
ROUTE_REASON_UNSPECIFIED: RouteReason
ROUTE_REASON_READY: RouteReason
ROUTE_REASON_LOADING: RouteReason
ROUTE_REASON_STAGED: RouteReason
ROUTE_REASON_COLD: RouteReason
READINESS_STATE_UNSPECIFIED: ReadinessState
READINESS_STATE_READY: ReadinessState
READINESS_STATE_NOT_READY: ReadinessState
RELAYED_COMMAND_KIND_UNSPECIFIED: RelayedCommandKind
RELAYED_COMMAND_KIND_PREFETCH: RelayedCommandKind
RELAYED_COMMAND_KIND_EVICT: RelayedCommandKind
RELAYED_COMMAND_KIND_STAGE: RelayedCommandKind
RELAYED_COMMAND_KIND_RANKING: RelayedCommandKind
RESIDENCY_STATE_UNSPECIFIED: ResidencyState
RESIDENCY_STATE_LOADING: ResidencyState
RESIDENCY_STATE_READY: ResidencyState
RESIDENCY_STATE_IN_USE: ResidencyState
RESIDENCY_STATE_GONE: ResidencyState
RESIDENCY_STATE_FAILED: ResidencyState
RESIDENCY_STATE_HOST_STAGED: ResidencyState
RESIDENCY_STATE_HOST_DROPPED: ResidencyState
RESIDENCY_STATE_NO_ROOM: ResidencyState
RESIDENCY_STATE_CAPACITY: ResidencyState

class PrefetchHint(_message.Message):
    __slots__ = ("hint_id", "adapter", "replica", "expected_in", "priority")
    HINT_ID_FIELD_NUMBER: _ClassVar[int]
    ADAPTER_FIELD_NUMBER: _ClassVar[int]
    REPLICA_FIELD_NUMBER: _ClassVar[int]
    EXPECTED_IN_FIELD_NUMBER: _ClassVar[int]
    PRIORITY_FIELD_NUMBER: _ClassVar[int]
    hint_id: str
    adapter: str
    replica: str
    expected_in: _duration_pb2.Duration
    priority: HintPriority
    def __init__(self, hint_id: _Optional[str] = ..., adapter: _Optional[str] = ..., replica: _Optional[str] = ..., expected_in: _Optional[_Union[datetime.timedelta, _duration_pb2.Duration, _Mapping]] = ..., priority: _Optional[_Union[HintPriority, str]] = ...) -> None: ...

class HintRequest(_message.Message):
    __slots__ = ("hints",)
    HINTS_FIELD_NUMBER: _ClassVar[int]
    hints: _containers.RepeatedCompositeFieldContainer[PrefetchHint]
    def __init__(self, hints: _Optional[_Iterable[_Union[PrefetchHint, _Mapping]]] = ...) -> None: ...

class HintResponse(_message.Message):
    __slots__ = ("accepted", "ignored", "rejections")
    ACCEPTED_FIELD_NUMBER: _ClassVar[int]
    IGNORED_FIELD_NUMBER: _ClassVar[int]
    REJECTIONS_FIELD_NUMBER: _ClassVar[int]
    accepted: int
    ignored: int
    rejections: _containers.RepeatedCompositeFieldContainer[HintRejection]
    def __init__(self, accepted: _Optional[int] = ..., ignored: _Optional[int] = ..., rejections: _Optional[_Iterable[_Union[HintRejection, _Mapping]]] = ...) -> None: ...

class HintRejection(_message.Message):
    __slots__ = ("index", "hint_id", "code", "message")
    INDEX_FIELD_NUMBER: _ClassVar[int]
    HINT_ID_FIELD_NUMBER: _ClassVar[int]
    CODE_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    index: int
    hint_id: str
    code: int
    message: str
    def __init__(self, index: _Optional[int] = ..., hint_id: _Optional[str] = ..., code: _Optional[int] = ..., message: _Optional[str] = ...) -> None: ...

class CancelHintRequest(_message.Message):
    __slots__ = ("hint_ids",)
    HINT_IDS_FIELD_NUMBER: _ClassVar[int]
    hint_ids: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, hint_ids: _Optional[_Iterable[str]] = ...) -> None: ...

class CancelHintResponse(_message.Message):
    __slots__ = ("cancelled",)
    CANCELLED_FIELD_NUMBER: _ClassVar[int]
    cancelled: int
    def __init__(self, cancelled: _Optional[int] = ...) -> None: ...

class QueuedRequest(_message.Message):
    __slots__ = ("adapter", "arrival_time")
    ADAPTER_FIELD_NUMBER: _ClassVar[int]
    ARRIVAL_TIME_FIELD_NUMBER: _ClassVar[int]
    adapter: str
    arrival_time: _timestamp_pb2.Timestamp
    def __init__(self, adapter: _Optional[str] = ..., arrival_time: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ...) -> None: ...

class ReportQueueRequest(_message.Message):
    __slots__ = ("replica", "requests")
    REPLICA_FIELD_NUMBER: _ClassVar[int]
    REQUESTS_FIELD_NUMBER: _ClassVar[int]
    replica: str
    requests: _containers.RepeatedCompositeFieldContainer[QueuedRequest]
    def __init__(self, replica: _Optional[str] = ..., requests: _Optional[_Iterable[_Union[QueuedRequest, _Mapping]]] = ...) -> None: ...

class ReportQueueResponse(_message.Message):
    __slots__ = ("queue_depth",)
    QUEUE_DEPTH_FIELD_NUMBER: _ClassVar[int]
    queue_depth: int
    def __init__(self, queue_depth: _Optional[int] = ...) -> None: ...

class LookupRequest(_message.Message):
    __slots__ = ("adapter",)
    ADAPTER_FIELD_NUMBER: _ClassVar[int]
    adapter: str
    def __init__(self, adapter: _Optional[str] = ...) -> None: ...

class LookupResponse(_message.Message):
    __slots__ = ("adapter", "version", "ready_replicas", "loading_replicas")
    ADAPTER_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    READY_REPLICAS_FIELD_NUMBER: _ClassVar[int]
    LOADING_REPLICAS_FIELD_NUMBER: _ClassVar[int]
    adapter: str
    version: str
    ready_replicas: _containers.RepeatedScalarFieldContainer[str]
    loading_replicas: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, adapter: _Optional[str] = ..., version: _Optional[str] = ..., ready_replicas: _Optional[_Iterable[str]] = ..., loading_replicas: _Optional[_Iterable[str]] = ...) -> None: ...

class RouteItem(_message.Message):
    __slots__ = ("adapter", "version", "request_id", "tokens")
    ADAPTER_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    adapter: str
    version: str
    request_id: str
    tokens: int
    def __init__(self, adapter: _Optional[str] = ..., version: _Optional[str] = ..., request_id: _Optional[str] = ..., tokens: _Optional[int] = ...) -> None: ...

class RouteRequest(_message.Message):
    __slots__ = ("items", "outstanding_requests", "max_replicas", "finished_requests")
    class OutstandingRequestsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    ITEMS_FIELD_NUMBER: _ClassVar[int]
    OUTSTANDING_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    MAX_REPLICAS_FIELD_NUMBER: _ClassVar[int]
    FINISHED_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    items: _containers.RepeatedCompositeFieldContainer[RouteItem]
    outstanding_requests: _containers.ScalarMap[str, int]
    max_replicas: int
    finished_requests: _containers.RepeatedCompositeFieldContainer[FinishedRequest]
    def __init__(self, items: _Optional[_Iterable[_Union[RouteItem, _Mapping]]] = ..., outstanding_requests: _Optional[_Mapping[str, int]] = ..., max_replicas: _Optional[int] = ..., finished_requests: _Optional[_Iterable[_Union[FinishedRequest, _Mapping]]] = ...) -> None: ...

class FinishedRequest(_message.Message):
    __slots__ = ("replica", "adapter")
    REPLICA_FIELD_NUMBER: _ClassVar[int]
    ADAPTER_FIELD_NUMBER: _ClassVar[int]
    replica: str
    adapter: str
    def __init__(self, replica: _Optional[str] = ..., adapter: _Optional[str] = ...) -> None: ...

class RankedReplica(_message.Message):
    __slots__ = ("replica", "reason", "expected_wait", "within_bound")
    REPLICA_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    EXPECTED_WAIT_FIELD_NUMBER: _ClassVar[int]
    WITHIN_BOUND_FIELD_NUMBER: _ClassVar[int]
    replica: str
    reason: RouteReason
    expected_wait: _duration_pb2.Duration
    within_bound: bool
    def __init__(self, replica: _Optional[str] = ..., reason: _Optional[_Union[RouteReason, str]] = ..., expected_wait: _Optional[_Union[datetime.timedelta, _duration_pb2.Duration, _Mapping]] = ..., within_bound: _Optional[bool] = ...) -> None: ...

class RouteError(_message.Message):
    __slots__ = ("code", "message")
    CODE_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    code: int
    message: str
    def __init__(self, code: _Optional[int] = ..., message: _Optional[str] = ...) -> None: ...

class RouteAdvice(_message.Message):
    __slots__ = ("adapter", "version", "request_id", "replicas", "error")
    ADAPTER_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    REPLICAS_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    adapter: str
    version: str
    request_id: str
    replicas: _containers.RepeatedCompositeFieldContainer[RankedReplica]
    error: RouteError
    def __init__(self, adapter: _Optional[str] = ..., version: _Optional[str] = ..., request_id: _Optional[str] = ..., replicas: _Optional[_Iterable[_Union[RankedReplica, _Mapping]]] = ..., error: _Optional[_Union[RouteError, _Mapping]] = ...) -> None: ...

class RouteResponse(_message.Message):
    __slots__ = ("items",)
    ITEMS_FIELD_NUMBER: _ClassVar[int]
    items: _containers.RepeatedCompositeFieldContainer[RouteAdvice]
    def __init__(self, items: _Optional[_Iterable[_Union[RouteAdvice, _Mapping]]] = ...) -> None: ...

class WatchReadinessRequest(_message.Message):
    __slots__ = ("replica", "adapter", "after_seq")
    REPLICA_FIELD_NUMBER: _ClassVar[int]
    ADAPTER_FIELD_NUMBER: _ClassVar[int]
    AFTER_SEQ_FIELD_NUMBER: _ClassVar[int]
    replica: str
    adapter: str
    after_seq: int
    def __init__(self, replica: _Optional[str] = ..., adapter: _Optional[str] = ..., after_seq: _Optional[int] = ...) -> None: ...

class ReadinessEvent(_message.Message):
    __slots__ = ("seq", "replica", "adapter", "version", "state")
    SEQ_FIELD_NUMBER: _ClassVar[int]
    REPLICA_FIELD_NUMBER: _ClassVar[int]
    ADAPTER_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    seq: int
    replica: str
    adapter: str
    version: str
    state: ReadinessState
    def __init__(self, seq: _Optional[int] = ..., replica: _Optional[str] = ..., adapter: _Optional[str] = ..., version: _Optional[str] = ..., state: _Optional[_Union[ReadinessState, str]] = ...) -> None: ...

class ReadyResidency(_message.Message):
    __slots__ = ("replica", "adapter", "version")
    REPLICA_FIELD_NUMBER: _ClassVar[int]
    ADAPTER_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    replica: str
    adapter: str
    version: str
    def __init__(self, replica: _Optional[str] = ..., adapter: _Optional[str] = ..., version: _Optional[str] = ...) -> None: ...

class ReadinessResync(_message.Message):
    __slots__ = ("resume_after_seq", "lost_after_seq", "ready_residencies", "reason")
    RESUME_AFTER_SEQ_FIELD_NUMBER: _ClassVar[int]
    LOST_AFTER_SEQ_FIELD_NUMBER: _ClassVar[int]
    READY_RESIDENCIES_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    resume_after_seq: int
    lost_after_seq: int
    ready_residencies: _containers.RepeatedCompositeFieldContainer[ReadyResidency]
    reason: str
    def __init__(self, resume_after_seq: _Optional[int] = ..., lost_after_seq: _Optional[int] = ..., ready_residencies: _Optional[_Iterable[_Union[ReadyResidency, _Mapping]]] = ..., reason: _Optional[str] = ...) -> None: ...

class WatchReadinessResponse(_message.Message):
    __slots__ = ("events", "resync")
    EVENTS_FIELD_NUMBER: _ClassVar[int]
    RESYNC_FIELD_NUMBER: _ClassVar[int]
    events: _containers.RepeatedCompositeFieldContainer[ReadinessEvent]
    resync: ReadinessResync
    def __init__(self, events: _Optional[_Iterable[_Union[ReadinessEvent, _Mapping]]] = ..., resync: _Optional[_Union[ReadinessResync, _Mapping]] = ...) -> None: ...

class RegisterAdapterRequest(_message.Message):
    __slots__ = ("name", "path", "request_id")
    NAME_FIELD_NUMBER: _ClassVar[int]
    PATH_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    name: str
    path: str
    request_id: str
    def __init__(self, name: _Optional[str] = ..., path: _Optional[str] = ..., request_id: _Optional[str] = ...) -> None: ...

class RegisterAdapterResponse(_message.Message):
    __slots__ = ("name", "version", "previous_version", "pending_ranks")
    NAME_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    PREVIOUS_VERSION_FIELD_NUMBER: _ClassVar[int]
    PENDING_RANKS_FIELD_NUMBER: _ClassVar[int]
    name: str
    version: str
    previous_version: str
    pending_ranks: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, name: _Optional[str] = ..., version: _Optional[str] = ..., previous_version: _Optional[str] = ..., pending_ranks: _Optional[_Iterable[str]] = ...) -> None: ...

class PushAdapterRequest(_message.Message):
    __slots__ = ("name", "tag", "config_json", "total_bytes", "weights")
    NAME_FIELD_NUMBER: _ClassVar[int]
    TAG_FIELD_NUMBER: _ClassVar[int]
    CONFIG_JSON_FIELD_NUMBER: _ClassVar[int]
    TOTAL_BYTES_FIELD_NUMBER: _ClassVar[int]
    WEIGHTS_FIELD_NUMBER: _ClassVar[int]
    name: str
    tag: str
    config_json: bytes
    total_bytes: int
    weights: bytes
    def __init__(self, name: _Optional[str] = ..., tag: _Optional[str] = ..., config_json: _Optional[bytes] = ..., total_bytes: _Optional[int] = ..., weights: _Optional[bytes] = ...) -> None: ...

class FetchPushedRequest(_message.Message):
    __slots__ = ("name", "tag")
    NAME_FIELD_NUMBER: _ClassVar[int]
    TAG_FIELD_NUMBER: _ClassVar[int]
    name: str
    tag: str
    def __init__(self, name: _Optional[str] = ..., tag: _Optional[str] = ...) -> None: ...

class FetchPushedResponse(_message.Message):
    __slots__ = ("config_json", "total_bytes", "weights")
    CONFIG_JSON_FIELD_NUMBER: _ClassVar[int]
    TOTAL_BYTES_FIELD_NUMBER: _ClassVar[int]
    WEIGHTS_FIELD_NUMBER: _ClassVar[int]
    config_json: bytes
    total_bytes: int
    weights: bytes
    def __init__(self, config_json: _Optional[bytes] = ..., total_bytes: _Optional[int] = ..., weights: _Optional[bytes] = ...) -> None: ...

class PushAdapterResponse(_message.Message):
    __slots__ = ("name", "tag", "version", "previous_version", "pending_ranks")
    NAME_FIELD_NUMBER: _ClassVar[int]
    TAG_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    PREVIOUS_VERSION_FIELD_NUMBER: _ClassVar[int]
    PENDING_RANKS_FIELD_NUMBER: _ClassVar[int]
    name: str
    tag: str
    version: str
    previous_version: str
    pending_ranks: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, name: _Optional[str] = ..., tag: _Optional[str] = ..., version: _Optional[str] = ..., previous_version: _Optional[str] = ..., pending_ranks: _Optional[_Iterable[str]] = ...) -> None: ...

class RegisterAdaptersRequest(_message.Message):
    __slots__ = ("adapters",)
    ADAPTERS_FIELD_NUMBER: _ClassVar[int]
    adapters: _containers.RepeatedCompositeFieldContainer[RegisterAdapterRequest]
    def __init__(self, adapters: _Optional[_Iterable[_Union[RegisterAdapterRequest, _Mapping]]] = ...) -> None: ...

class RegisteredAdapter(_message.Message):
    __slots__ = ("name", "version", "previous_version", "error", "rank_errors", "pending_ranks")
    NAME_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    PREVIOUS_VERSION_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    RANK_ERRORS_FIELD_NUMBER: _ClassVar[int]
    PENDING_RANKS_FIELD_NUMBER: _ClassVar[int]
    name: str
    version: str
    previous_version: str
    error: RegisterError
    rank_errors: _containers.RepeatedScalarFieldContainer[str]
    pending_ranks: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, name: _Optional[str] = ..., version: _Optional[str] = ..., previous_version: _Optional[str] = ..., error: _Optional[_Union[RegisterError, _Mapping]] = ..., rank_errors: _Optional[_Iterable[str]] = ..., pending_ranks: _Optional[_Iterable[str]] = ...) -> None: ...

class RegisterError(_message.Message):
    __slots__ = ("code", "message")
    CODE_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    code: int
    message: str
    def __init__(self, code: _Optional[int] = ..., message: _Optional[str] = ...) -> None: ...

class RegisterAdaptersResponse(_message.Message):
    __slots__ = ("adapters",)
    ADAPTERS_FIELD_NUMBER: _ClassVar[int]
    adapters: _containers.RepeatedCompositeFieldContainer[RegisteredAdapter]
    def __init__(self, adapters: _Optional[_Iterable[_Union[RegisteredAdapter, _Mapping]]] = ...) -> None: ...

class ResolveAdapterRequest(_message.Message):
    __slots__ = ("name",)
    NAME_FIELD_NUMBER: _ClassVar[int]
    name: str
    def __init__(self, name: _Optional[str] = ...) -> None: ...

class ResolveAdapterResponse(_message.Message):
    __slots__ = ("name", "version")
    NAME_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    name: str
    version: str
    def __init__(self, name: _Optional[str] = ..., version: _Optional[str] = ...) -> None: ...

class UnregisterAdapterRequest(_message.Message):
    __slots__ = ("name", "drain_timeout")
    NAME_FIELD_NUMBER: _ClassVar[int]
    DRAIN_TIMEOUT_FIELD_NUMBER: _ClassVar[int]
    name: str
    drain_timeout: _duration_pb2.Duration
    def __init__(self, name: _Optional[str] = ..., drain_timeout: _Optional[_Union[datetime.timedelta, _duration_pb2.Duration, _Mapping]] = ...) -> None: ...

class UnregisterAdapterResponse(_message.Message):
    __slots__ = ("name", "evicted_versions")
    NAME_FIELD_NUMBER: _ClassVar[int]
    EVICTED_VERSIONS_FIELD_NUMBER: _ClassVar[int]
    name: str
    evicted_versions: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, name: _Optional[str] = ..., evicted_versions: _Optional[_Iterable[str]] = ...) -> None: ...

class StatusRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ResizePoolRequest(_message.Message):
    __slots__ = ("replica", "lent_bytes", "keep_adapters")
    REPLICA_FIELD_NUMBER: _ClassVar[int]
    LENT_BYTES_FIELD_NUMBER: _ClassVar[int]
    KEEP_ADAPTERS_FIELD_NUMBER: _ClassVar[int]
    replica: str
    lent_bytes: int
    keep_adapters: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, replica: _Optional[str] = ..., lent_bytes: _Optional[int] = ..., keep_adapters: _Optional[_Iterable[str]] = ...) -> None: ...

class RankPool(_message.Message):
    __slots__ = ("rank", "capacity_bytes", "lent_bytes", "page_bytes", "evicted_adapters")
    RANK_FIELD_NUMBER: _ClassVar[int]
    CAPACITY_BYTES_FIELD_NUMBER: _ClassVar[int]
    LENT_BYTES_FIELD_NUMBER: _ClassVar[int]
    PAGE_BYTES_FIELD_NUMBER: _ClassVar[int]
    EVICTED_ADAPTERS_FIELD_NUMBER: _ClassVar[int]
    rank: int
    capacity_bytes: int
    lent_bytes: int
    page_bytes: int
    evicted_adapters: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, rank: _Optional[int] = ..., capacity_bytes: _Optional[int] = ..., lent_bytes: _Optional[int] = ..., page_bytes: _Optional[int] = ..., evicted_adapters: _Optional[_Iterable[str]] = ...) -> None: ...

class ResizePoolResponse(_message.Message):
    __slots__ = ("replica", "ranks")
    REPLICA_FIELD_NUMBER: _ClassVar[int]
    RANKS_FIELD_NUMBER: _ClassVar[int]
    replica: str
    ranks: _containers.RepeatedCompositeFieldContainer[RankPool]
    def __init__(self, replica: _Optional[str] = ..., ranks: _Optional[_Iterable[_Union[RankPool, _Mapping]]] = ...) -> None: ...

class CacheCounters(_message.Message):
    __slots__ = ("gpu_hits", "gpu_misses", "host_hits", "host_misses", "gpu_hit_rate", "host_hit_rate")
    GPU_HITS_FIELD_NUMBER: _ClassVar[int]
    GPU_MISSES_FIELD_NUMBER: _ClassVar[int]
    HOST_HITS_FIELD_NUMBER: _ClassVar[int]
    HOST_MISSES_FIELD_NUMBER: _ClassVar[int]
    GPU_HIT_RATE_FIELD_NUMBER: _ClassVar[int]
    HOST_HIT_RATE_FIELD_NUMBER: _ClassVar[int]
    gpu_hits: int
    gpu_misses: int
    host_hits: int
    host_misses: int
    gpu_hit_rate: float
    host_hit_rate: float
    def __init__(self, gpu_hits: _Optional[int] = ..., gpu_misses: _Optional[int] = ..., host_hits: _Optional[int] = ..., host_misses: _Optional[int] = ..., gpu_hit_rate: _Optional[float] = ..., host_hit_rate: _Optional[float] = ...) -> None: ...

class WorkerStatus(_message.Message):
    __slots__ = ("worker", "rank", "reachable", "slots", "slots_ready", "slots_loading", "counters")
    WORKER_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    REACHABLE_FIELD_NUMBER: _ClassVar[int]
    SLOTS_FIELD_NUMBER: _ClassVar[int]
    SLOTS_READY_FIELD_NUMBER: _ClassVar[int]
    SLOTS_LOADING_FIELD_NUMBER: _ClassVar[int]
    COUNTERS_FIELD_NUMBER: _ClassVar[int]
    worker: str
    rank: int
    reachable: bool
    slots: int
    slots_ready: int
    slots_loading: int
    counters: CacheCounters
    def __init__(self, worker: _Optional[str] = ..., rank: _Optional[int] = ..., reachable: _Optional[bool] = ..., slots: _Optional[int] = ..., slots_ready: _Optional[int] = ..., slots_loading: _Optional[int] = ..., counters: _Optional[_Union[CacheCounters, _Mapping]] = ...) -> None: ...

class ReplicaStatus(_message.Message):
    __slots__ = ("replica", "queue_depth", "workers", "counters")
    REPLICA_FIELD_NUMBER: _ClassVar[int]
    QUEUE_DEPTH_FIELD_NUMBER: _ClassVar[int]
    WORKERS_FIELD_NUMBER: _ClassVar[int]
    COUNTERS_FIELD_NUMBER: _ClassVar[int]
    replica: str
    queue_depth: int
    workers: _containers.RepeatedCompositeFieldContainer[WorkerStatus]
    counters: CacheCounters
    def __init__(self, replica: _Optional[str] = ..., queue_depth: _Optional[int] = ..., workers: _Optional[_Iterable[_Union[WorkerStatus, _Mapping]]] = ..., counters: _Optional[_Union[CacheCounters, _Mapping]] = ...) -> None: ...

class StatusResponse(_message.Message):
    __slots__ = ("epoch", "adapters", "workers", "replicas", "ready_residencies", "held_residencies", "commands_sent", "hints_received", "hints_accepted", "counters", "ingest_queued_hints", "ingest_queue_capacity", "ingest_rejected_calls")
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    ADAPTERS_FIELD_NUMBER: _ClassVar[int]
    WORKERS_FIELD_NUMBER: _ClassVar[int]
    REPLICAS_FIELD_NUMBER: _ClassVar[int]
    READY_RESIDENCIES_FIELD_NUMBER: _ClassVar[int]
    HELD_RESIDENCIES_FIELD_NUMBER: _ClassVar[int]
    COMMANDS_SENT_FIELD_NUMBER: _ClassVar[int]
    HINTS_RECEIVED_FIELD_NUMBER: _ClassVar[int]
    HINTS_ACCEPTED_FIELD_NUMBER: _ClassVar[int]
    COUNTERS_FIELD_NUMBER: _ClassVar[int]
    INGEST_QUEUED_HINTS_FIELD_NUMBER: _ClassVar[int]
    INGEST_QUEUE_CAPACITY_FIELD_NUMBER: _ClassVar[int]
    INGEST_REJECTED_CALLS_FIELD_NUMBER: _ClassVar[int]
    epoch: int
    adapters: int
    workers: int
    replicas: _containers.RepeatedCompositeFieldContainer[ReplicaStatus]
    ready_residencies: int
    held_residencies: int
    commands_sent: int
    hints_received: int
    hints_accepted: int
    counters: CacheCounters
    ingest_queued_hints: int
    ingest_queue_capacity: int
    ingest_rejected_calls: int
    def __init__(self, epoch: _Optional[int] = ..., adapters: _Optional[int] = ..., workers: _Optional[int] = ..., replicas: _Optional[_Iterable[_Union[ReplicaStatus, _Mapping]]] = ..., ready_residencies: _Optional[int] = ..., held_residencies: _Optional[int] = ..., commands_sent: _Optional[int] = ..., hints_received: _Optional[int] = ..., hints_accepted: _Optional[int] = ..., counters: _Optional[_Union[CacheCounters, _Mapping]] = ..., ingest_queued_hints: _Optional[int] = ..., ingest_queue_capacity: _Optional[int] = ..., ingest_rejected_calls: _Optional[int] = ...) -> None: ...

class AttachHello(_message.Message):
    __slots__ = ("replica", "rank", "tp", "num_slots", "model", "incarnation", "liveness_s", "start_s", "name_wait_s", "max_adapters", "max_running")
    REPLICA_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    TP_FIELD_NUMBER: _ClassVar[int]
    NUM_SLOTS_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    INCARNATION_FIELD_NUMBER: _ClassVar[int]
    LIVENESS_S_FIELD_NUMBER: _ClassVar[int]
    START_S_FIELD_NUMBER: _ClassVar[int]
    NAME_WAIT_S_FIELD_NUMBER: _ClassVar[int]
    MAX_ADAPTERS_FIELD_NUMBER: _ClassVar[int]
    MAX_RUNNING_FIELD_NUMBER: _ClassVar[int]
    replica: str
    rank: int
    tp: int
    num_slots: int
    model: str
    incarnation: int
    liveness_s: float
    start_s: float
    name_wait_s: float
    max_adapters: int
    max_running: int
    def __init__(self, replica: _Optional[str] = ..., rank: _Optional[int] = ..., tp: _Optional[int] = ..., num_slots: _Optional[int] = ..., model: _Optional[str] = ..., incarnation: _Optional[int] = ..., liveness_s: _Optional[float] = ..., start_s: _Optional[float] = ..., name_wait_s: _Optional[float] = ..., max_adapters: _Optional[int] = ..., max_running: _Optional[int] = ...) -> None: ...

class RelayedCommand(_message.Message):
    __slots__ = ("kind", "adapter", "version", "priority", "epoch", "speculative", "disk", "names")
    KIND_FIELD_NUMBER: _ClassVar[int]
    ADAPTER_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    PRIORITY_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    SPECULATIVE_FIELD_NUMBER: _ClassVar[int]
    DISK_FIELD_NUMBER: _ClassVar[int]
    NAMES_FIELD_NUMBER: _ClassVar[int]
    kind: RelayedCommandKind
    adapter: str
    version: str
    priority: int
    epoch: int
    speculative: bool
    disk: bool
    names: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, kind: _Optional[_Union[RelayedCommandKind, str]] = ..., adapter: _Optional[str] = ..., version: _Optional[str] = ..., priority: _Optional[int] = ..., epoch: _Optional[int] = ..., speculative: _Optional[bool] = ..., disk: _Optional[bool] = ..., names: _Optional[_Iterable[str]] = ...) -> None: ...

class ApplyCommands(_message.Message):
    __slots__ = ("commands",)
    COMMANDS_FIELD_NUMBER: _ClassVar[int]
    commands: _containers.RepeatedCompositeFieldContainer[RelayedCommand]
    def __init__(self, commands: _Optional[_Iterable[_Union[RelayedCommand, _Mapping]]] = ...) -> None: ...

class DescribeRank(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class RegisterRankAdapter(_message.Message):
    __slots__ = ("name", "path", "known")
    NAME_FIELD_NUMBER: _ClassVar[int]
    PATH_FIELD_NUMBER: _ClassVar[int]
    KNOWN_FIELD_NUMBER: _ClassVar[int]
    name: str
    path: str
    known: KnownVersion
    def __init__(self, name: _Optional[str] = ..., path: _Optional[str] = ..., known: _Optional[_Union[KnownVersion, _Mapping]] = ...) -> None: ...

class FileIdentity(_message.Message):
    __slots__ = ("dev", "ino", "size", "mtime_ns", "ctime_ns")
    DEV_FIELD_NUMBER: _ClassVar[int]
    INO_FIELD_NUMBER: _ClassVar[int]
    SIZE_FIELD_NUMBER: _ClassVar[int]
    MTIME_NS_FIELD_NUMBER: _ClassVar[int]
    CTIME_NS_FIELD_NUMBER: _ClassVar[int]
    dev: int
    ino: int
    size: int
    mtime_ns: int
    ctime_ns: int
    def __init__(self, dev: _Optional[int] = ..., ino: _Optional[int] = ..., size: _Optional[int] = ..., mtime_ns: _Optional[int] = ..., ctime_ns: _Optional[int] = ...) -> None: ...

class KnownVersion(_message.Message):
    __slots__ = ("version", "config_digest", "host", "weights_path", "identity", "header_bytes", "header_crc", "block_crcs", "registered_ns", "store", "meta", "device")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    CONFIG_DIGEST_FIELD_NUMBER: _ClassVar[int]
    HOST_FIELD_NUMBER: _ClassVar[int]
    WEIGHTS_PATH_FIELD_NUMBER: _ClassVar[int]
    IDENTITY_FIELD_NUMBER: _ClassVar[int]
    HEADER_BYTES_FIELD_NUMBER: _ClassVar[int]
    HEADER_CRC_FIELD_NUMBER: _ClassVar[int]
    BLOCK_CRCS_FIELD_NUMBER: _ClassVar[int]
    REGISTERED_NS_FIELD_NUMBER: _ClassVar[int]
    STORE_FIELD_NUMBER: _ClassVar[int]
    META_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    version: str
    config_digest: str
    host: str
    weights_path: str
    identity: FileIdentity
    header_bytes: int
    header_crc: int
    block_crcs: bytes
    registered_ns: int
    store: StoreObject
    meta: bytes
    device: DeviceImage
    def __init__(self, version: _Optional[str] = ..., config_digest: _Optional[str] = ..., host: _Optional[str] = ..., weights_path: _Optional[str] = ..., identity: _Optional[_Union[FileIdentity, _Mapping]] = ..., header_bytes: _Optional[int] = ..., header_crc: _Optional[int] = ..., block_crcs: _Optional[bytes] = ..., registered_ns: _Optional[int] = ..., store: _Optional[_Union[StoreObject, _Mapping]] = ..., meta: _Optional[bytes] = ..., device: _Optional[_Union[DeviceImage, _Mapping]] = ...) -> None: ...

class DeviceImage(_message.Message):
    __slots__ = ("tag", "size", "ahead")
    TAG_FIELD_NUMBER: _ClassVar[int]
    SIZE_FIELD_NUMBER: _ClassVar[int]
    AHEAD_FIELD_NUMBER: _ClassVar[int]
    tag: str
    size: int
    ahead: bool
    def __init__(self, tag: _Optional[str] = ..., size: _Optional[int] = ..., ahead: _Optional[bool] = ...) -> None: ...

class StoreObject(_message.Message):
    __slots__ = ("bucket", "key", "etag", "version_id", "size")
    BUCKET_FIELD_NUMBER: _ClassVar[int]
    KEY_FIELD_NUMBER: _ClassVar[int]
    ETAG_FIELD_NUMBER: _ClassVar[int]
    VERSION_ID_FIELD_NUMBER: _ClassVar[int]
    SIZE_FIELD_NUMBER: _ClassVar[int]
    bucket: str
    key: str
    etag: str
    version_id: str
    size: int
    def __init__(self, bucket: _Optional[str] = ..., key: _Optional[str] = ..., etag: _Optional[str] = ..., version_id: _Optional[str] = ..., size: _Optional[int] = ...) -> None: ...

class RegisterRankAdapters(_message.Message):
    __slots__ = ("adapters",)
    ADAPTERS_FIELD_NUMBER: _ClassVar[int]
    adapters: _containers.RepeatedCompositeFieldContainer[RegisterRankAdapter]
    def __init__(self, adapters: _Optional[_Iterable[_Union[RegisterRankAdapter, _Mapping]]] = ...) -> None: ...

class RankRegistration(_message.Message):
    __slots__ = ("version", "error")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    version: str
    error: str
    def __init__(self, version: _Optional[str] = ..., error: _Optional[str] = ...) -> None: ...

class RankRegistrations(_message.Message):
    __slots__ = ("results",)
    RESULTS_FIELD_NUMBER: _ClassVar[int]
    results: _containers.RepeatedCompositeFieldContainer[RankRegistration]
    def __init__(self, results: _Optional[_Iterable[_Union[RankRegistration, _Mapping]]] = ...) -> None: ...

class UnregisterRankAdapter(_message.Message):
    __slots__ = ("name",)
    NAME_FIELD_NUMBER: _ClassVar[int]
    name: str
    def __init__(self, name: _Optional[str] = ...) -> None: ...

class RankStatsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class RelayedCall(_message.Message):
    __slots__ = ("call_id", "apply", "describe", "register_adapter", "unregister_adapter", "stats", "register_adapters", "drop_pushed")
    CALL_ID_FIELD_NUMBER: _ClassVar[int]
    APPLY_FIELD_NUMBER: _ClassVar[int]
    DESCRIBE_FIELD_NUMBER: _ClassVar[int]
    REGISTER_ADAPTER_FIELD_NUMBER: _ClassVar[int]
    UNREGISTER_ADAPTER_FIELD_NUMBER: _ClassVar[int]
    STATS_FIELD_NUMBER: _ClassVar[int]
    REGISTER_ADAPTERS_FIELD_NUMBER: _ClassVar[int]
    DROP_PUSHED_FIELD_NUMBER: _ClassVar[int]
    call_id: int
    apply: ApplyCommands
    describe: DescribeRank
    register_adapter: RegisterRankAdapter
    unregister_adapter: UnregisterRankAdapter
    stats: RankStatsRequest
    register_adapters: RegisterRankAdapters
    drop_pushed: DropPushedCopies
    def __init__(self, call_id: _Optional[int] = ..., apply: _Optional[_Union[ApplyCommands, _Mapping]] = ..., describe: _Optional[_Union[DescribeRank, _Mapping]] = ..., register_adapter: _Optional[_Union[RegisterRankAdapter, _Mapping]] = ..., unregister_adapter: _Optional[_Union[UnregisterRankAdapter, _Mapping]] = ..., stats: _Optional[_Union[RankStatsRequest, _Mapping]] = ..., register_adapters: _Optional[_Union[RegisterRankAdapters, _Mapping]] = ..., drop_pushed: _Optional[_Union[DropPushedCopies, _Mapping]] = ...) -> None: ...

class DropPushedCopies(_message.Message):
    __slots__ = ("name", "tags", "node", "area")
    NAME_FIELD_NUMBER: _ClassVar[int]
    TAGS_FIELD_NUMBER: _ClassVar[int]
    NODE_FIELD_NUMBER: _ClassVar[int]
    AREA_FIELD_NUMBER: _ClassVar[int]
    name: str
    tags: _containers.RepeatedScalarFieldContainer[str]
    node: str
    area: str
    def __init__(self, name: _Optional[str] = ..., tags: _Optional[_Iterable[str]] = ..., node: _Optional[str] = ..., area: _Optional[str] = ...) -> None: ...

class DroppedCopies(_message.Message):
    __slots__ = ("tags",)
    TAGS_FIELD_NUMBER: _ClassVar[int]
    tags: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, tags: _Optional[_Iterable[str]] = ...) -> None: ...

class ApplyResult(_message.Message):
    __slots__ = ("accepted", "rejected_stale", "errors")
    ACCEPTED_FIELD_NUMBER: _ClassVar[int]
    REJECTED_STALE_FIELD_NUMBER: _ClassVar[int]
    ERRORS_FIELD_NUMBER: _ClassVar[int]
    accepted: int
    rejected_stale: int
    errors: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, accepted: _Optional[int] = ..., rejected_stale: _Optional[int] = ..., errors: _Optional[_Iterable[str]] = ...) -> None: ...

class RankResidency(_message.Message):
    __slots__ = ("adapter", "version", "state", "refs", "acquired")
    ADAPTER_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    REFS_FIELD_NUMBER: _ClassVar[int]
    ACQUIRED_FIELD_NUMBER: _ClassVar[int]
    adapter: str
    version: str
    state: ResidencyState
    refs: int
    acquired: bool
    def __init__(self, adapter: _Optional[str] = ..., version: _Optional[str] = ..., state: _Optional[_Union[ResidencyState, str]] = ..., refs: _Optional[int] = ..., acquired: _Optional[bool] = ...) -> None: ...

class WorkerReport(_message.Message):
    __slots__ = ("replica", "rank", "tp", "model", "incarnation", "seq", "node", "slots", "host_bytes", "adapters", "epoch", "residencies", "host_shards", "reports_host", "gpu_bytes", "page_bytes", "disk_bytes")
    class AdaptersEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    REPLICA_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    TP_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    INCARNATION_FIELD_NUMBER: _ClassVar[int]
    SEQ_FIELD_NUMBER: _ClassVar[int]
    NODE_FIELD_NUMBER: _ClassVar[int]
    SLOTS_FIELD_NUMBER: _ClassVar[int]
    HOST_BYTES_FIELD_NUMBER: _ClassVar[int]
    ADAPTERS_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    RESIDENCIES_FIELD_NUMBER: _ClassVar[int]
    HOST_SHARDS_FIELD_NUMBER: _ClassVar[int]
    REPORTS_HOST_FIELD_NUMBER: _ClassVar[int]
    GPU_BYTES_FIELD_NUMBER: _ClassVar[int]
    PAGE_BYTES_FIELD_NUMBER: _ClassVar[int]
    DISK_BYTES_FIELD_NUMBER: _ClassVar[int]
    replica: str
    rank: int
    tp: int
    model: str
    incarnation: int
    seq: int
    node: str
    slots: int
    host_bytes: int
    adapters: _containers.ScalarMap[str, str]
    epoch: int
    residencies: _containers.RepeatedCompositeFieldContainer[RankResidency]
    host_shards: _containers.RepeatedCompositeFieldContainer[HostShard]
    reports_host: bool
    gpu_bytes: int
    page_bytes: int
    disk_bytes: int
    def __init__(self, replica: _Optional[str] = ..., rank: _Optional[int] = ..., tp: _Optional[int] = ..., model: _Optional[str] = ..., incarnation: _Optional[int] = ..., seq: _Optional[int] = ..., node: _Optional[str] = ..., slots: _Optional[int] = ..., host_bytes: _Optional[int] = ..., adapters: _Optional[_Mapping[str, str]] = ..., epoch: _Optional[int] = ..., residencies: _Optional[_Iterable[_Union[RankResidency, _Mapping]]] = ..., host_shards: _Optional[_Iterable[_Union[HostShard, _Mapping]]] = ..., reports_host: _Optional[bool] = ..., gpu_bytes: _Optional[int] = ..., page_bytes: _Optional[int] = ..., disk_bytes: _Optional[int] = ...) -> None: ...

class HostShard(_message.Message):
    __slots__ = ("adapter", "version")
    ADAPTER_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    adapter: str
    version: str
    def __init__(self, adapter: _Optional[str] = ..., version: _Optional[str] = ...) -> None: ...

class CallError(_message.Message):
    __slots__ = ("error_class", "message")
    ERROR_CLASS_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    error_class: str
    message: str
    def __init__(self, error_class: _Optional[str] = ..., message: _Optional[str] = ...) -> None: ...

class CallAnswer(_message.Message):
    __slots__ = ("call_id", "apply", "describe", "registered_version", "unregistered", "stats_json", "error", "registered", "dropped")
    CALL_ID_FIELD_NUMBER: _ClassVar[int]
    APPLY_FIELD_NUMBER: _ClassVar[int]
    DESCRIBE_FIELD_NUMBER: _ClassVar[int]
    REGISTERED_VERSION_FIELD_NUMBER: _ClassVar[int]
    UNREGISTERED_FIELD_NUMBER: _ClassVar[int]
    STATS_JSON_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    REGISTERED_FIELD_NUMBER: _ClassVar[int]
    DROPPED_FIELD_NUMBER: _ClassVar[int]
    call_id: int
    apply: ApplyResult
    describe: WorkerReport
    registered_version: str
    unregistered: bool
    stats_json: str
    error: CallError
    registered: RankRegistrations
    dropped: DroppedCopies
    def __init__(self, call_id: _Optional[int] = ..., apply: _Optional[_Union[ApplyResult, _Mapping]] = ..., describe: _Optional[_Union[WorkerReport, _Mapping]] = ..., registered_version: _Optional[str] = ..., unregistered: _Optional[bool] = ..., stats_json: _Optional[str] = ..., error: _Optional[_Union[CallError, _Mapping]] = ..., registered: _Optional[_Union[RankRegistrations, _Mapping]] = ..., dropped: _Optional[_Union[DroppedCopies, _Mapping]] = ...) -> None: ...

class ResidencyDelta(_message.Message):
    __slots__ = ("seq", "adapter", "version", "state", "error", "read_s", "acquired")
    SEQ_FIELD_NUMBER: _ClassVar[int]
    ADAPTER_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    READ_S_FIELD_NUMBER: _ClassVar[int]
    ACQUIRED_FIELD_NUMBER: _ClassVar[int]
    seq: int
    adapter: str
    version: str
    state: ResidencyState
    error: str
    read_s: float
    acquired: bool
    def __init__(self, seq: _Optional[int] = ..., adapter: _Optional[str] = ..., version: _Optional[str] = ..., state: _Optional[_Union[ResidencyState, str]] = ..., error: _Optional[str] = ..., read_s: _Optional[float] = ..., acquired: _Optional[bool] = ...) -> None: ...

class ResidencyDeltas(_message.Message):
    __slots__ = ("incarnation", "deltas")
    INCARNATION_FIELD_NUMBER: _ClassVar[int]
    DELTAS_FIELD_NUMBER: _ClassVar[int]
    incarnation: int
    deltas: _containers.RepeatedCompositeFieldContainer[ResidencyDelta]
    def __init__(self, incarnation: _Optional[int] = ..., deltas: _Optional[_Iterable[_Union[ResidencyDelta, _Mapping]]] = ...) -> None: ...

class RankAlive(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class AttachRankRequest(_message.Message):
    __slots__ = ("hello", "answer", "deltas", "alive")
    HELLO_FIELD_NUMBER: _ClassVar[int]
    ANSWER_FIELD_NUMBER: _ClassVar[int]
    DELTAS_FIELD_NUMBER: _ClassVar[int]
    ALIVE_FIELD_NUMBER: _ClassVar[int]
    hello: AttachHello
    answer: CallAnswer
    deltas: ResidencyDeltas
    alive: RankAlive
    def __init__(self, hello: _Optional[_Union[AttachHello, _Mapping]] = ..., answer: _Optional[_Union[CallAnswer, _Mapping]] = ..., deltas: _Optional[_Union[ResidencyDeltas, _Mapping]] = ..., alive: _Optional[_Union[RankAlive, _Mapping]] = ...) -> None: ...

class Attached(_message.Message):
    __slots__ = ("model", "max_rank", "adapter_roots", "keep_versions", "worker_name", "service")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    MAX_RANK_FIELD_NUMBER: _ClassVar[int]
    ADAPTER_ROOTS_FIELD_NUMBER: _ClassVar[int]
    KEEP_VERSIONS_FIELD_NUMBER: _ClassVar[int]
    WORKER_NAME_FIELD_NUMBER: _ClassVar[int]
    SERVICE_FIELD_NUMBER: _ClassVar[int]
    model: str
    max_rank: int
    adapter_roots: _containers.RepeatedScalarFieldContainer[str]
    keep_versions: int
    worker_name: str
    service: str
    def __init__(self, model: _Optional[str] = ..., max_rank: _Optional[int] = ..., adapter_roots: _Optional[_Iterable[str]] = ..., keep_versions: _Optional[int] = ..., worker_name: _Optional[str] = ..., service: _Optional[str] = ...) -> None: ...

class RankAdopted(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class AttachRankResponse(_message.Message):
    __slots__ = ("attached", "call", "adopted")
    ATTACHED_FIELD_NUMBER: _ClassVar[int]
    CALL_FIELD_NUMBER: _ClassVar[int]
    ADOPTED_FIELD_NUMBER: _ClassVar[int]
    attached: Attached
    call: RelayedCall
    adopted: RankAdopted
    def __init__(self, attached: _Optional[_Union[Attached, _Mapping]] = ..., call: _Optional[_Union[RelayedCall, _Mapping]] = ..., adopted: _Optional[_Union[RankAdopted, _Mapping]] = ...) -> None: ...
