from pdmesh.v1 import common_pb2 as _common_pb2
from pdmesh.v1 import worker_pb2 as _worker_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class DisaggMode(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    DISAGG_MODE_UNSPECIFIED: _ClassVar[DisaggMode]
    DISAGG_MODE_LOCAL: _ClassVar[DisaggMode]
    DISAGG_MODE_REMOTE: _ClassVar[DisaggMode]
DISAGG_MODE_UNSPECIFIED: DisaggMode
DISAGG_MODE_LOCAL: DisaggMode
DISAGG_MODE_REMOTE: DisaggMode

class PrefillCandidate(_message.Message):
    __slots__ = ("worker_id", "address", "overlap_blocks", "estimated_wait_ms")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    OVERLAP_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    ESTIMATED_WAIT_MS_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    address: str
    overlap_blocks: int
    estimated_wait_ms: float
    def __init__(self, worker_id: _Optional[str] = ..., address: _Optional[str] = ..., overlap_blocks: _Optional[int] = ..., estimated_wait_ms: _Optional[float] = ...) -> None: ...

class DecodeServiceGenerateRequest(_message.Message):
    __slots__ = ("request_id", "prompt_token_ids", "resume_token_ids", "sampling", "tenant", "priority", "workflow", "prefill_candidates", "disagg_mode", "prefix_pull", "waited_s", "front")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    RESUME_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    TENANT_FIELD_NUMBER: _ClassVar[int]
    PRIORITY_FIELD_NUMBER: _ClassVar[int]
    WORKFLOW_FIELD_NUMBER: _ClassVar[int]
    PREFILL_CANDIDATES_FIELD_NUMBER: _ClassVar[int]
    DISAGG_MODE_FIELD_NUMBER: _ClassVar[int]
    PREFIX_PULL_FIELD_NUMBER: _ClassVar[int]
    WAITED_S_FIELD_NUMBER: _ClassVar[int]
    FRONT_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    resume_token_ids: _containers.RepeatedScalarFieldContainer[int]
    sampling: _common_pb2.SamplingParams
    tenant: str
    priority: int
    workflow: _common_pb2.WorkflowContext
    prefill_candidates: _containers.RepeatedCompositeFieldContainer[PrefillCandidate]
    disagg_mode: DisaggMode
    prefix_pull: PrefixPullHint
    waited_s: float
    front: bool
    def __init__(self, request_id: _Optional[str] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., resume_token_ids: _Optional[_Iterable[int]] = ..., sampling: _Optional[_Union[_common_pb2.SamplingParams, _Mapping]] = ..., tenant: _Optional[str] = ..., priority: _Optional[int] = ..., workflow: _Optional[_Union[_common_pb2.WorkflowContext, _Mapping]] = ..., prefill_candidates: _Optional[_Iterable[_Union[PrefillCandidate, _Mapping]]] = ..., disagg_mode: _Optional[_Union[DisaggMode, str]] = ..., prefix_pull: _Optional[_Union[PrefixPullHint, _Mapping]] = ..., waited_s: _Optional[float] = ..., front: _Optional[bool] = ...) -> None: ...

class PrefixPullHint(_message.Message):
    __slots__ = ("worker_id", "address", "kv_agent_name", "blocks")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    KV_AGENT_NAME_FIELD_NUMBER: _ClassVar[int]
    BLOCKS_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    address: str
    kv_agent_name: str
    blocks: int
    def __init__(self, worker_id: _Optional[str] = ..., address: _Optional[str] = ..., kv_agent_name: _Optional[str] = ..., blocks: _Optional[int] = ...) -> None: ...

class DecodeServiceGenerateResponse(_message.Message):
    __slots__ = ("tokens", "final")
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    FINAL_FIELD_NUMBER: _ClassVar[int]
    tokens: TokenIdsDelta
    final: DecodeFinal
    def __init__(self, tokens: _Optional[_Union[TokenIdsDelta, _Mapping]] = ..., final: _Optional[_Union[DecodeFinal, _Mapping]] = ...) -> None: ...

class TokenIdsDelta(_message.Message):
    __slots__ = ("token_ids",)
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class DecodeFinal(_message.Message):
    __slots__ = ("finish_reason", "usage", "prefill_path", "disagg_reason", "prefill_worker_id", "kv_bytes_transferred", "pulled_prefix_tokens")
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    USAGE_FIELD_NUMBER: _ClassVar[int]
    PREFILL_PATH_FIELD_NUMBER: _ClassVar[int]
    DISAGG_REASON_FIELD_NUMBER: _ClassVar[int]
    PREFILL_WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    KV_BYTES_TRANSFERRED_FIELD_NUMBER: _ClassVar[int]
    PULLED_PREFIX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    finish_reason: _common_pb2.FinishReason
    usage: _common_pb2.Usage
    prefill_path: str
    disagg_reason: str
    prefill_worker_id: str
    kv_bytes_transferred: int
    pulled_prefix_tokens: int
    def __init__(self, finish_reason: _Optional[_Union[_common_pb2.FinishReason, str]] = ..., usage: _Optional[_Union[_common_pb2.Usage, _Mapping]] = ..., prefill_path: _Optional[str] = ..., disagg_reason: _Optional[str] = ..., prefill_worker_id: _Optional[str] = ..., kv_bytes_transferred: _Optional[int] = ..., pulled_prefix_tokens: _Optional[int] = ...) -> None: ...

class DecodeServiceLinkRequest(_message.Message):
    __slots__ = ("open", "cancel")
    OPEN_FIELD_NUMBER: _ClassVar[int]
    CANCEL_FIELD_NUMBER: _ClassVar[int]
    open: LinkOpen
    cancel: LinkCancel
    def __init__(self, open: _Optional[_Union[LinkOpen, _Mapping]] = ..., cancel: _Optional[_Union[LinkCancel, _Mapping]] = ...) -> None: ...

class LinkOpen(_message.Message):
    __slots__ = ("link_id", "request", "timeout_s", "notify_started")
    LINK_ID_FIELD_NUMBER: _ClassVar[int]
    REQUEST_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_S_FIELD_NUMBER: _ClassVar[int]
    NOTIFY_STARTED_FIELD_NUMBER: _ClassVar[int]
    link_id: int
    request: DecodeServiceGenerateRequest
    timeout_s: float
    notify_started: bool
    def __init__(self, link_id: _Optional[int] = ..., request: _Optional[_Union[DecodeServiceGenerateRequest, _Mapping]] = ..., timeout_s: _Optional[float] = ..., notify_started: _Optional[bool] = ...) -> None: ...

class LinkCancel(_message.Message):
    __slots__ = ("link_id",)
    LINK_ID_FIELD_NUMBER: _ClassVar[int]
    link_id: int
    def __init__(self, link_id: _Optional[int] = ...) -> None: ...

class DecodeServiceLinkResponse(_message.Message):
    __slots__ = ("tokens", "ends", "status", "started")
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    ENDS_FIELD_NUMBER: _ClassVar[int]
    STATUS_FIELD_NUMBER: _ClassVar[int]
    STARTED_FIELD_NUMBER: _ClassVar[int]
    tokens: _containers.RepeatedCompositeFieldContainer[LinkTokens]
    ends: _containers.RepeatedCompositeFieldContainer[LinkEnd]
    status: LinkStatus
    started: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, tokens: _Optional[_Iterable[_Union[LinkTokens, _Mapping]]] = ..., ends: _Optional[_Iterable[_Union[LinkEnd, _Mapping]]] = ..., status: _Optional[_Union[LinkStatus, _Mapping]] = ..., started: _Optional[_Iterable[int]] = ...) -> None: ...

class LinkTokens(_message.Message):
    __slots__ = ("link_id", "token_ids")
    LINK_ID_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    link_id: int
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, link_id: _Optional[int] = ..., token_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class LinkEnd(_message.Message):
    __slots__ = ("link_id", "final", "error")
    LINK_ID_FIELD_NUMBER: _ClassVar[int]
    FINAL_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    link_id: int
    final: DecodeFinal
    error: LinkStatus
    def __init__(self, link_id: _Optional[int] = ..., final: _Optional[_Union[DecodeFinal, _Mapping]] = ..., error: _Optional[_Union[LinkStatus, _Mapping]] = ...) -> None: ...

class LinkStatus(_message.Message):
    __slots__ = ("code", "message")
    CODE_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    code: int
    message: str
    def __init__(self, code: _Optional[int] = ..., message: _Optional[str] = ...) -> None: ...
