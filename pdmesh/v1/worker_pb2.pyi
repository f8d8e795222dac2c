from pdmesh.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class SubscribeKvEventsRequest(_message.Message):
    __slots__ = ("subscriber",)
    SUBSCRIBER_FIELD_NUMBER: _ClassVar[int]
    subscriber: str
    def __init__(self, subscriber: _Optional[str] = ...) -> None: ...

class SubscribeKvEventsResponse(_message.Message):
    __slots__ = ("worker_id", "snapshot", "events")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    SNAPSHOT_FIELD_NUMBER: _ClassVar[int]
    EVENTS_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    snapshot: KvCacheSnapshot
    events: KvEventBatch
    def __init__(self, worker_id: _Optional[str] = ..., snapshot: _Optional[_Union[KvCacheSnapshot, _Mapping]] = ..., events: _Optional[_Union[KvEventBatch, _Mapping]] = ...) -> None: ...

class KvCacheSnapshot(_message.Message):
    __slots__ = ("seq", "chains")
    SEQ_FIELD_NUMBER: _ClassVar[int]
    CHAINS_FIELD_NUMBER: _ClassVar[int]
    seq: int
    chains: _containers.RepeatedCompositeFieldContainer[_common_pb2.KvBlocksStored]
    def __init__(self, seq: _Optional[int] = ..., chains: _Optional[_Iterable[_Union[_common_pb2.KvBlocksStored, _Mapping]]] = ...) -> None: ...

class KvEventBatch(_message.Message):
    __slots__ = ("events",)
    EVENTS_FIELD_NUMBER: _ClassVar[int]
    events: _containers.RepeatedCompositeFieldContainer[_common_pb2.KvEvent]
    def __init__(self, events: _Optional[_Iterable[_Union[_common_pb2.KvEvent, _Mapping]]] = ...) -> None: ...

class StatsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class StatsResponse(_message.Message):
    __slots__ = ("info", "load", "counters", "cached_blocks", "leases", "transfers", "disagg_decisions", "requests_total", "requests_failed", "requests_cancelled", "prefix_pulls", "prefix_pull_tokens_saved")
    class DisaggDecisionsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    class PrefixPullsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    INFO_FIELD_NUMBER: _ClassVar[int]
    LOAD_FIELD_NUMBER: _ClassVar[int]
    COUNTERS_FIELD_NUMBER: _ClassVar[int]
    CACHED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    LEASES_FIELD_NUMBER: _ClassVar[int]
    TRANSFERS_FIELD_NUMBER: _ClassVar[int]
    DISAGG_DECISIONS_FIELD_NUMBER: _ClassVar[int]
    REQUESTS_TOTAL_FIELD_NUMBER: _ClassVar[int]
    REQUESTS_FAILED_FIELD_NUMBER: _ClassVar[int]
    REQUESTS_CANCELLED_FIELD_NUMBER: _ClassVar[int]
    PREFIX_PULLS_FIELD_NUMBER: _ClassVar[int]
    PREFIX_PULL_TOKENS_SAVED_FIELD_NUMBER: _ClassVar[int]
    info: _common_pb2.WorkerInfo
    load: _common_pb2.WorkerLoad
    counters: _common_pb2.EngineCounters
    cached_blocks: int
    leases: LeaseCounters
    transfers: TransferCounters
    disagg_decisions: _containers.ScalarMap[str, int]
    requests_total: int
    requests_failed: int
    requests_cancelled: int
    prefix_pulls: _containers.ScalarMap[str, int]
    prefix_pull_tokens_saved: int
    def __init__(self, info: _Optional[_Union[_common_pb2.WorkerInfo, _Mapping]] = ..., load: _Optional[_Union[_common_pb2.WorkerLoad, _Mapping]] = ..., counters: _Optional[_Union[_common_pb2.EngineCounters, _Mapping]] = ..., cached_blocks: _Optional[int] = ..., leases: _Optional[_Union[LeaseCounters, _Mapping]] = ..., transfers: _Optional[_Union[TransferCounters, _Mapping]] = ..., disagg_decisions: _Optional[_Mapping[str, int]] = ..., requests_total: _Optional[int] = ..., requests_failed: _Optional[int] = ..., requests_cancelled: _Optional[int] = ..., prefix_pulls: _Optional[_Mapping[str, int]] = ..., prefix_pull_tokens_saved: _Optional[int] = ...) -> None: ...

class LeaseCounters(_message.Message):
    __slots__ = ("held", "held_blocks", "issued", "pulled", "released", "expired")
    HELD_FIELD_NUMBER: _ClassVar[int]
    HELD_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    ISSUED_FIELD_NUMBER: _ClassVar[int]
    PULLED_FIELD_NUMBER: _ClassVar[int]
    RELEASED_FIELD_NUMBER: _ClassVar[int]
    EXPIRED_FIELD_NUMBER: _ClassVar[int]
    held: int
    held_blocks: int
    issued: int
    pulled: int
    released: int
    expired: int
    def __init__(self, held: _Optional[int] = ..., held_blocks: _Optional[int] = ..., issued: _Optional[int] = ..., pulled: _Optional[int] = ..., released: _Optional[int] = ..., expired: _Optional[int] = ...) -> None: ...

class TransferCounters(_message.Message):
    __slots__ = ("count", "bytes", "failures", "total_ms", "fallbacks")
    COUNT_FIELD_NUMBER: _ClassVar[int]
    BYTES_FIELD_NUMBER: _ClassVar[int]
    FAILURES_FIELD_NUMBER: _ClassVar[int]
    TOTAL_MS_FIELD_NUMBER: _ClassVar[int]
    FALLBACKS_FIELD_NUMBER: _ClassVar[int]
    count: int
    bytes: int
    failures: int
    total_ms: float
    fallbacks: int
    def __init__(self, count: _Optional[int] = ..., bytes: _Optional[int] = ..., failures: _Optional[int] = ..., total_ms: _Optional[float] = ..., fallbacks: _Optional[int] = ...) -> None: ...
