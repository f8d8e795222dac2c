from pdmesh.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class MemoryRegion(_message.Message):
    __slots__ = ("address", "length", "device_id", "memory_type")
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    LENGTH_FIELD_NUMBER: _ClassVar[int]
    DEVICE_ID_FIELD_NUMBER: _ClassVar[int]
    MEMORY_TYPE_FIELD_NUMBER: _ClassVar[int]
    address: int
    length: int
    device_id: int
    memory_type: str
    def __init__(self, address: _Optional[int] = ..., length: _Optional[int] = ..., device_id: _Optional[int] = ..., memory_type: _Optional[str] = ...) -> None: ...

class AgentInfo(_message.Message):
    __slots__ = ("name", "metadata", "region", "layout", "num_blocks", "worker_id", "kv_source_address", "incarnation")
    NAME_FIELD_NUMBER: _ClassVar[int]
    METADATA_FIELD_NUMBER: _ClassVar[int]
    REGION_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_FIELD_NUMBER: _ClassVar[int]
    NUM_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    KV_SOURCE_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    INCARNATION_FIELD_NUMBER: _ClassVar[int]
    name: str
    metadata: bytes
    region: MemoryRegion
    layout: _common_pb2.KvLayout
    num_blocks: int
    worker_id: str
    kv_source_address: str
    incarnation: int
    def __init__(self, name: _Optional[str] = ..., metadata: _Optional[bytes] = ..., region: _Optional[_Union[MemoryRegion, _Mapping]] = ..., layout: _Optional[_Union[_common_pb2.KvLayout, _Mapping]] = ..., num_blocks: _Optional[int] = ..., worker_id: _Optional[str] = ..., kv_source_address: _Optional[str] = ..., incarnation: _Optional[int] = ...) -> None: ...

class RegisterAgentRequest(_message.Message):
    __slots__ = ("agent", "lease_ms", "owner_secret")
    AGENT_FIELD_NUMBER: _ClassVar[int]
    LEASE_MS_FIELD_NUMBER: _ClassVar[int]
    OWNER_SECRET_FIELD_NUMBER: _ClassVar[int]
    agent: AgentInfo
    lease_ms: int
    owner_secret: bytes
    def __init__(self, agent: _Optional[_Union[AgentInfo, _Mapping]] = ..., lease_ms: _Optional[int] = ..., owner_secret: _Optional[bytes] = ...) -> None: ...

class RegisterAgentResponse(_message.Message):
    __slots__ = ("incarnation", "lease_ms")
    INCARNATION_FIELD_NUMBER: _ClassVar[int]
    LEASE_MS_FIELD_NUMBER: _ClassVar[int]
    incarnation: int
    lease_ms: int
    def __init__(self, incarnation: _Optional[int] = ..., lease_ms: _Optional[int] = ...) -> None: ...

class HeartbeatRequest(_message.Message):
    __slots__ = ("name", "incarnation", "owner_secret")
    NAME_FIELD_NUMBER: _ClassVar[int]
    INCARNATION_FIELD_NUMBER: _ClassVar[int]
    OWNER_SECRET_FIELD_NUMBER: _ClassVar[int]
    name: str
    incarnation: int
    owner_secret: bytes
    def __init__(self, name: _Optional[str] = ..., incarnation: _Optional[int] = ..., owner_secret: _Optional[bytes] = ...) -> None: ...

class HeartbeatResponse(_message.Message):
    __slots__ = ("lease_ms",)
    LEASE_MS_FIELD_NUMBER: _ClassVar[int]
    lease_ms: int
    def __init__(self, lease_ms: _Optional[int] = ...) -> None: ...

class DeregisterAgentRequest(_message.Message):
    __slots__ = ("name", "incarnation", "owner_secret")
    NAME_FIELD_NUMBER: _ClassVar[int]
    INCARNATION_FIELD_NUMBER: _ClassVar[int]
    OWNER_SECRET_FIELD_NUMBER: _ClassVar[int]
    name: str
    incarnation: int
    owner_secret: bytes
    def __init__(self, name: _Optional[str] = ..., incarnation: _Optional[int] = ..., owner_secret: _Optional[bytes] = ...) -> None: ...

class DeregisterAgentResponse(_message.Message):
    __slots__ = ("removed",)
    REMOVED_FIELD_NUMBER: _ClassVar[int]
    removed: bool
    def __init__(self, removed: _Optional[bool] = ...) -> None: ...

class GetAgentRequest(_message.Message):
    __slots__ = ("name",)
    NAME_FIELD_NUMBER: _ClassVar[int]
    name: str
    def __init__(self, name: _Optional[str] = ...) -> None: ...

class GetAgentResponse(_message.Message):
    __slots__ = ("agent",)
    AGENT_FIELD_NUMBER: _ClassVar[int]
    agent: AgentInfo
    def __init__(self, agent: _Optional[_Union[AgentInfo, _Mapping]] = ...) -> None: ...

class TransferRecord(_message.Message):
    __slots__ = ("transport", "source_agent", "target_agent", "bytes", "duration_ms", "ok", "error")
    TRANSPORT_FIELD_NUMBER: _ClassVar[int]
    SOURCE_AGENT_FIELD_NUMBER: _ClassVar[int]
    TARGET_AGENT_FIELD_NUMBER: _ClassVar[int]
    BYTES_FIELD_NUMBER: _ClassVar[int]
    DURATION_MS_FIELD_NUMBER: _ClassVar[int]
    OK_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    transport: str
    source_agent: str
    target_agent: str
    bytes: int
    duration_ms: float
    ok: bool
    error: str
    def __init__(self, transport: _Optional[str] = ..., source_agent: _Optional[str] = ..., target_agent: _Optional[str] = ..., bytes: _Optional[int] = ..., duration_ms: _Optional[float] = ..., ok: _Optional[bool] = ..., error: _Optional[str] = ...) -> None: ...

class ReportTransfersRequest(_message.Message):
    __slots__ = ("records",)
    RECORDS_FIELD_NUMBER: _ClassVar[int]
    records: _containers.RepeatedCompositeFieldContainer[TransferRecord]
    def __init__(self, records: _Optional[_Iterable[_Union[TransferRecord, _Mapping]]] = ...) -> None: ...

class ReportTransfersResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class KvTransferServiceStatsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class KvTransferServiceStatsResponse(_message.Message):
    __slots__ = ("agents", "registrations", "expirations", "transfers", "transfer_failures", "bytes", "latency_ms_p50", "latency_ms_p99")
    AGENTS_FIELD_NUMBER: _ClassVar[int]
    REGISTRATIONS_FIELD_NUMBER: _ClassVar[int]
    EXPIRATIONS_FIELD_NUMBER: _ClassVar[int]
    TRANSFERS_FIELD_NUMBER: _ClassVar[int]
    TRANSFER_FAILURES_FIELD_NUMBER: _ClassVar[int]
    BYTES_FIELD_NUMBER: _ClassVar[int]
    LATENCY_MS_P50_FIELD_NUMBER: _ClassVar[int]
    LATENCY_MS_P99_FIELD_NUMBER: _ClassVar[int]
    agents: int
    registrations: int
    expirations: int
    transfers: int
    transfer_failures: int
    bytes: int
    latency_ms_p50: float
    latency_ms_p99: float
    def __init__(self, agents: _Optional[int] = ..., registrations: _Optional[int] = ..., expirations: _Optional[int] = ..., transfers: _Optional[int] = ..., transfer_failures: _Optional[int] = ..., bytes: _Optional[int] = ..., latency_ms_p50: _Optional[float] = ..., latency_ms_p99: _Optional[float] = ...) -> None: ...

class ReadBlocksRequest(_message.Message):
    __slots__ = ("handle_id", "requester_id", "chunk_bytes", "release_after", "block_ids", "layout")
    HANDLE_ID_FIELD_NUMBER: _ClassVar[int]
    REQUESTER_ID_FIELD_NUMBER: _ClassVar[int]
    CHUNK_BYTES_FIELD_NUMBER: _ClassVar[int]
    RELEASE_AFTER_FIELD_NUMBER: _ClassVar[int]
    BLOCK_IDS_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_FIELD_NUMBER: _ClassVar[int]
    handle_id: str
    requester_id: str
    chunk_bytes: int
    release_after: bool
    block_ids: _containers.RepeatedScalarFieldContainer[int]
    layout: _common_pb2.KvLayout
    def __init__(self, handle_id: _Optional[str] = ..., requester_id: _Optional[str] = ..., chunk_bytes: _Optional[int] = ..., release_after: _Optional[bool] = ..., block_ids: _Optional[_Iterable[int]] = ..., layout: _Optional[_Union[_common_pb2.KvLayout, _Mapping]] = ...) -> None: ...

class ReadBlocksResponse(_message.Message):
    __slots__ = ("offset", "data", "total_bytes")
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    TOTAL_BYTES_FIELD_NUMBER: _ClassVar[int]
    offset: int
    data: bytes
    total_bytes: int
    def __init__(self, offset: _Optional[int] = ..., data: _Optional[bytes] = ..., total_bytes: _Optional[int] = ...) -> None: ...

class LeasePrefixRequest(_message.Message):
    __slots__ = ("request_id", "prompt_token_ids", "max_blocks", "requester_id", "requester_agent", "lease_ms")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    MAX_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    REQUESTER_ID_FIELD_NUMBER: _ClassVar[int]
    REQUESTER_AGENT_FIELD_NUMBER: _ClassVar[int]
    LEASE_MS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    max_blocks: int
    requester_id: str
    requester_agent: str
    lease_ms: int
    def __init__(self, request_id: _Optional[str] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., max_blocks: _Optional[int] = ..., requester_id: _Optional[str] = ..., requester_agent: _Optional[str] = ..., lease_ms: _Optional[int] = ...) -> None: ...

class LeasePrefixResponse(_message.Message):
    __slots__ = ("handle",)
    HANDLE_FIELD_NUMBER: _ClassVar[int]
    handle: _common_pb2.KvHandle
    def __init__(self, handle: _Optional[_Union[_common_pb2.KvHandle, _Mapping]] = ...) -> None: ...

class ReleasePrefixRequest(_message.Message):
    __slots__ = ("handle_id",)
    HANDLE_ID_FIELD_NUMBER: _ClassVar[int]
    handle_id: str
    def __init__(self, handle_id: _Optional[str] = ...) -> None: ...

class ReleasePrefixResponse(_message.Message):
    __slots__ = ("released",)
    RELEASED_FIELD_NUMBER: _ClassVar[int]
    released: bool
    def __init__(self, released: _Optional[bool] = ...) -> None: ...
