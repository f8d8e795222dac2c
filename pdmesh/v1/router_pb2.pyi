from pdmesh.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class WorkerHealth(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    WORKER_HEALTH_UNSPECIFIED: _ClassVar[WorkerHealth]
    WORKER_HEALTH_SERVING: _ClassVar[WorkerHealth]
    WORKER_HEALTH_NOT_SERVING: _ClassVar[WorkerHealth]
    WORKER_HEALTH_BREAKER_OPEN: _ClassVar[WorkerHealth]
WORKER_HEALTH_UNSPECIFIED: WorkerHealth
WORKER_HEALTH_SERVING: WorkerHealth
WORKER_HEALTH_NOT_SERVING: WorkerHealth
WORKER_HEALTH_BREAKER_OPEN: WorkerHealth

class GenerateRequest(_message.Message):
    __slots__ = ("request_id", "text", "token_ids", "sampling", "tenant", "priority", "workflow", "model")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    TENANT_FIELD_NUMBER: _ClassVar[int]
    PRIORITY_FIELD_NUMBER: _ClassVar[int]
    WORKFLOW_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    text: str
    token_ids: _common_pb2.TokenIds
    sampling: _common_pb2.SamplingParams
    tenant: str
    priority: int
    workflow: _common_pb2.WorkflowContext
    model: str
    def __init__(self, request_id: _Optional[str] = ..., text: _Optional[str] = ..., token_ids: _Optional[_Union[_common_pb2.TokenIds, _Mapping]] = ..., sampling: _Optional[_Union[_common_pb2.SamplingParams, _Mapping]] = ..., tenant: _Optional[str] = ..., priority: _Optional[int] = ..., workflow: _Optional[_Union[_common_pb2.WorkflowContext, _Mapping]] = ..., model: _Optional[str] = ...) -> None: ...

class GenerateResponse(_message.Message):
    __slots__ = ("delta", "final")
    DELTA_FIELD_NUMBER: _ClassVar[int]
    FINAL_FIELD_NUMBER: _ClassVar[int]
    delta: TokenDelta
    final: GenerateFinal
    def __init__(self, delta: _Optional[_Union[TokenDelta, _Mapping]] = ..., final: _Optional[_Union[GenerateFinal, _Mapping]] = ...) -> None: ...

class TokenDelta(_message.Message):
    __slots__ = ("token_ids", "text")
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    text: str
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ..., text: _Optional[str] = ...) -> None: ...

class GenerateFinal(_message.Message):
    __slots__ = ("finish_reason", "usage", "request_id", "worker_id", "migrations", "prefill_path")
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    USAGE_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    MIGRATIONS_FIELD_NUMBER: _ClassVar[int]
    PREFILL_PATH_FIELD_NUMBER: _ClassVar[int]
    finish_reason: _common_pb2.FinishReason
    usage: _common_pb2.Usage
    request_id: str
    worker_id: str
    migrations: int
    prefill_path: str
    def __init__(self, finish_reason: _Optional[_Union[_common_pb2.FinishReason, str]] = ..., usage: _Optional[_Union[_common_pb2.Usage, _Mapping]] = ..., request_id: _Optional[str] = ..., worker_id: _Optional[str] = ..., migrations: _Optional[int] = ..., prefill_path: _Optional[str] = ...) -> None: ...

class CancelRequest(_message.Message):
    __slots__ = ("request_id", "tenant")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TENANT_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    tenant: str
    def __init__(self, request_id: _Optional[str] = ..., tenant: _Optional[str] = ...) -> None: ...

class CancelResponse(_message.Message):
    __slots__ = ("cancelled",)
    CANCELLED_FIELD_NUMBER: _ClassVar[int]
    cancelled: bool
    def __init__(self, cancelled: _Optional[bool] = ...) -> None: ...

class ListWorkersRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class WorkerStatus(_message.Message):
    __slots__ = ("info", "load", "health", "indexed_blocks", "source", "inflight", "measured_prefill_s_per_token", "measured_decode_s_per_token", "prefill_speed_factor", "decode_speed_factor")
    INFO_FIELD_NUMBER: _ClassVar[int]
    LOAD_FIELD_NUMBER: _ClassVar[int]
    HEALTH_FIELD_NUMBER: _ClassVar[int]
    INDEXED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    SOURCE_FIELD_NUMBER: _ClassVar[int]
    INFLIGHT_FIELD_NUMBER: _ClassVar[int]
    MEASURED_PREFILL_S_PER_TOKEN_FIELD_NUMBER: _ClassVar[int]
    MEASURED_DECODE_S_PER_TOKEN_FIELD_NUMBER: _ClassVar[int]
    PREFILL_SPEED_FACTOR_FIELD_NUMBER: _ClassVar[int]
    DECODE_SPEED_FACTOR_FIELD_NUMBER: _ClassVar[int]
    info: _common_pb2.WorkerInfo
    load: _common_pb2.WorkerLoad
    health: WorkerHealth
    indexed_blocks: int
    source: str
    inflight: int
    measured_prefill_s_per_token: float
    measured_decode_s_per_token: float
    prefill_speed_factor: float
    decode_speed_factor: float
    def __init__(self, info: _Optional[_Union[_common_pb2.WorkerInfo, _Mapping]] = ..., load: _Optional[_Union[_common_pb2.WorkerLoad, _Mapping]] = ..., health: _Optional[_Union[WorkerHealth, str]] = ..., indexed_blocks: _Optional[int] = ..., source: _Optional[str] = ..., inflight: _Optional[int] = ..., measured_prefill_s_per_token: _Optional[float] = ..., measured_decode_s_per_token: _Optional[float] = ..., prefill_speed_factor: _Optional[float] = ..., decode_speed_factor: _Optional[float] = ...) -> None: ...

class ListWorkersResponse(_message.Message):
    __slots__ = ("workers",)
    WORKERS_FIELD_NUMBER: _ClassVar[int]
    workers: _containers.RepeatedCompositeFieldContainer[WorkerStatus]
    def __init__(self, workers: _Optional[_Iterable[_Union[WorkerStatus, _Mapping]]] = ...) -> None: ...

class RegisterWorkerRequest(_message.Message):
    __slots__ = ("worker", "lease_ms", "incarnation")
    WORKER_FIELD_NUMBER: _ClassVar[int]
    LEASE_MS_FIELD_NUMBER: _ClassVar[int]
    INCARNATION_FIELD_NUMBER: _ClassVar[int]
    worker: _common_pb2.WorkerInfo
    lease_ms: int
    incarnation: str
    def __init__(self, worker: _Optional[_Union[_common_pb2.WorkerInfo, _Mapping]] = ..., lease_ms: _Optional[int] = ..., incarnation: _Optional[str] = ...) -> None: ...

class RegisterWorkerResponse(_message.Message):
    __slots__ = ("heartbeat_interval_ms", "lease_ms", "incarnation")
    HEARTBEAT_INTERVAL_MS_FIELD_NUMBER: _ClassVar[int]
    LEASE_MS_FIELD_NUMBER: _ClassVar[int]
    INCARNATION_FIELD_NUMBER: _ClassVar[int]
    heartbeat_interval_ms: int
    lease_ms: int
    incarnation: str
    def __init__(self, heartbeat_interval_ms: _Optional[int] = ..., lease_ms: _Optional[int] = ..., incarnation: _Optional[str] = ...) -> None: ...

class RouterServiceHeartbeatRequest(_message.Message):
    __slots__ = ("worker_id", "load", "incarnation")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    LOAD_FIELD_NUMBER: _ClassVar[int]
    INCARNATION_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    load: _common_pb2.WorkerLoad
    incarnation: str
    def __init__(self, worker_id: _Optional[str] = ..., load: _Optional[_Union[_common_pb2.WorkerLoad, _Mapping]] = ..., incarnation: _Optional[str] = ...) -> None: ...

class RouterServiceHeartbeatResponse(_message.Message):
    __slots__ = ("known",)
    KNOWN_FIELD_NUMBER: _ClassVar[int]
    known: bool
    def __init__(self, known: _Optional[bool] = ...) -> None: ...

class DeregisterWorkerRequest(_message.Message):
    __slots__ = ("worker_id", "incarnation")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    INCARNATION_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    incarnation: str
    def __init__(self, worker_id: _Optional[str] = ..., incarnation: _Optional[str] = ...) -> None: ...

class DeregisterWorkerResponse(_message.Message):
    __slots__ = ("removed",)
    REMOVED_FIELD_NUMBER: _ClassVar[int]
    removed: bool
    def __init__(self, removed: _Optional[bool] = ...) -> None: ...

class RouterServiceStatsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class RouterServiceStatsResponse(_message.Message):
    __slots__ = ("requests_total", "requests_succeeded", "requests_failed", "requests_cancelled", "requests_shed", "retries", "retries_denied", "migrations", "tokens_per_successful_request", "wasted_tokens", "computed_tokens", "inflight", "queued", "prompt_tokens", "completion_tokens", "ttft", "itl")
    REQUESTS_TOTAL_FIELD_NUMBER: _ClassVar[int]
    REQUESTS_SUCCEEDED_FIELD_NUMBER: _ClassVar[int]
    REQUESTS_FAILED_FIELD_NUMBER: _ClassVar[int]
    REQUESTS_CANCELLED_FIELD_NUMBER: _ClassVar[int]
    REQUESTS_SHED_FIELD_NUMBER: _ClassVar[int]
    RETRIES_FIELD_NUMBER: _ClassVar[int]
    RETRIES_DENIED_FIELD_NUMBER: _ClassVar[int]
    MIGRATIONS_FIELD_NUMBER: _ClassVar[int]
    TOKENS_PER_SUCCESSFUL_REQUEST_FIELD_NUMBER: _ClassVar[int]
    WASTED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    COMPUTED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    INFLIGHT_FIELD_NUMBER: _ClassVar[int]
    QUEUED_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    COMPLETION_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TTFT_FIELD_NUMBER: _ClassVar[int]
    ITL_FIELD_NUMBER: _ClassVar[int]
    requests_total: int
    requests_succeeded: int
    requests_failed: int
    requests_cancelled: int
    requests_shed: int
    retries: int
    retries_denied: int
    migrations: int
    tokens_per_successful_request: float
    wasted_tokens: int
    computed_tokens: int
    inflight: int
    queued: int
    prompt_tokens: int
    completion_tokens: int
    ttft: LatencyHistogram
    itl: LatencyHistogram
    def __init__(self, requests_total: _Optional[int] = ..., requests_succeeded: _Optional[int] = ..., requests_failed: _Optional[int] = ..., requests_cancelled: _Optional[int] = ..., requests_shed: _Optional[int] = ..., retries: _Optional[int] = ..., retries_denied: _Optional[int] = ..., migrations: _Optional[int] = ..., tokens_per_successful_request: _Optional[float] = ..., wasted_tokens: _Optional[int] = ..., computed_tokens: _Optional[int] = ..., inflight: _Optional[int] = ..., queued: _Optional[int] = ..., prompt_tokens: _Optional[int] = ..., completion_tokens: _Optional[int] = ..., ttft: _Optional[_Union[LatencyHistogram, _Mapping]] = ..., itl: _Optional[_Union[LatencyHistogram, _Mapping]] = ...) -> None: ...

class LatencyHistogram(_message.Message):
    __slots__ = ("upper_bounds_s", "counts", "sum_s")
    UPPER_BOUNDS_S_FIELD_NUMBER: _ClassVar[int]
    COUNTS_FIELD_NUMBER: _ClassVar[int]
    SUM_S_FIELD_NUMBER: _ClassVar[int]
    upper_bounds_s: _containers.RepeatedScalarFieldContainer[float]
    counts: _containers.RepeatedScalarFieldContainer[int]
    sum_s: float
    def __init__(self, upper_bounds_s: _Optional[_Iterable[float]] = ..., counts: _Optional[_Iterable[int]] = ..., sum_s: _Optional[float] = ...) -> None: ...
