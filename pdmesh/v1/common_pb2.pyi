from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class FinishReason(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    FINISH_REASON_UNSPECIFIED: _ClassVar[FinishReason]
    FINISH_REASON_LENGTH: _ClassVar[FinishReason]
    FINISH_REASON_STOP: _ClassVar[FinishReason]
    FINISH_REASON_ABORT: _ClassVar[FinishReason]

class WorkerRole(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    WORKER_ROLE_UNSPECIFIED: _ClassVar[WorkerRole]
    WORKER_ROLE_DECODE: _ClassVar[WorkerRole]
    WORKER_ROLE_PREFILL: _ClassVar[WorkerRole]

class AcceleratorKind(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    ACCELERATOR_KIND_UNSPECIFIED: _ClassVar[AcceleratorKind]
    ACCELERATOR_KIND_CPU: _ClassVar[AcceleratorKind]
    ACCELERATOR_KIND_CUDA: _ClassVar[AcceleratorKind]

class KvTier(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    KV_TIER_DEVICE: _ClassVar[KvTier]
    KV_TIER_HOST: _ClassVar[KvTier]
FINISH_REASON_UNSPECIFIED: FinishReason
FINISH_REASON_LENGTH: FinishReason
FINISH_REASON_STOP: FinishReason
FINISH_REASON_ABORT: FinishReason
WORKER_ROLE_UNSPECIFIED: WorkerRole
WORKER_ROLE_DECODE: WorkerRole
WORKER_ROLE_PREFILL: WorkerRole
ACCELERATOR_KIND_UNSPECIFIED: AcceleratorKind
ACCELERATOR_KIND_CPU: AcceleratorKind
ACCELERATOR_KIND_CUDA: AcceleratorKind
KV_TIER_DEVICE: KvTier
KV_TIER_HOST: KvTier

class TokenIds(_message.Message):
    __slots__ = ("ids",)
    IDS_FIELD_NUMBER: _ClassVar[int]
    ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, ids: _Optional[_Iterable[int]] = ...) -> None: ...

class SamplingParams(_message.Message):
    __slots__ = ("max_tokens", "temperature", "top_p", "top_k", "seed", "stop", "stop_token_ids", "ignore_eos")
    MAX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    STOP_FIELD_NUMBER: _ClassVar[int]
    STOP_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    IGNORE_EOS_FIELD_NUMBER: _ClassVar[int]
    max_tokens: int
    temperature: float
    top_p: float
    top_k: int
    seed: int
    stop: _containers.RepeatedScalarFieldContainer[str]
    stop_token_ids: _containers.RepeatedScalarFieldContainer[int]
    ignore_eos: bool
    def __init__(self, max_tokens: _Optional[int] = ..., temperature: _Optional[float] = ..., top_p: _Optional[float] = ..., top_k: _Optional[int] = ..., seed: _Optional[int] = ..., stop: _Optional[_Iterable[str]] = ..., stop_token_ids: _Optional[_Iterable[int]] = ..., ignore_eos: _Optional[bool] = ...) -> None: ...

class WorkflowContext(_message.Message):
    __slots__ = ("workflow_id", "step_index", "tokens_spent", "final_step")
    WORKFLOW_ID_FIELD_NUMBER: _ClassVar[int]
    STEP_INDEX_FIELD_NUMBER: _ClassVar[int]
    TOKENS_SPENT_FIELD_NUMBER: _ClassVar[int]
    FINAL_STEP_FIELD_NUMBER: _ClassVar[int]
    workflow_id: str
    step_index: int
    tokens_spent: int
    final_step: bool
    def __init__(self, workflow_id: _Optional[str] = ..., step_index: _Optional[int] = ..., tokens_spent: _Optional[int] = ..., final_step: _Optional[bool] = ...) -> None: ...

class Usage(_message.Message):
    __slots__ = ("prompt_tokens", "completion_tokens", "cached_prompt_tokens", "computed_tokens")
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    COMPLETION_TOKENS_FIELD_NUMBER: _ClassVar[int]
    CACHED_PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    COMPUTED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    prompt_tokens: int
    completion_tokens: int
    cached_prompt_tokens: int
    computed_tokens: int
    def __init__(self, prompt_tokens: _Optional[int] = ..., completion_tokens: _Optional[int] = ..., cached_prompt_tokens: _Optional[int] = ..., computed_tokens: _Optional[int] = ...) -> None: ...

class KvLayout(_message.Message):
    __slots__ = ("num_layers", "num_kv_heads", "head_dim", "dtype", "block_size", "block_bytes", "kv_quant", "kv_scale_layout", "model_fingerprint")
    NUM_LAYERS_FIELD_NUMBER: _ClassVar[int]
    NUM_KV_HEADS_FIELD_NUMBER: _ClassVar[int]
    HEAD_DIM_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    BLOCK_BYTES_FIELD_NUMBER: _ClassVar[int]
    KV_QUANT_FIELD_NUMBER: _ClassVar[int]
    KV_SCALE_LAYOUT_FIELD_NUMBER: _ClassVar[int]
    MODEL_FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: str
    block_size: int
    block_bytes: int
    kv_quant: str
    kv_scale_layout: str
    model_fingerprint: str
    def __init__(self, num_layers: _Optional[int] = ..., num_kv_heads: _Optional[int] = ..., head_dim: _Optional[int] = ..., dtype: _Optional[str] = ..., block_size: _Optional[int] = ..., block_bytes: _Optional[int] = ..., kv_quant: _Optional[str] = ..., kv_scale_layout: _Optional[str] = ..., model_fingerprint: _Optional[str] = ...) -> None: ...

class NixlBlockDescriptors(_message.Message):
    __slots__ = ("agent_name", "layout", "block_ids", "num_tokens", "kv_source_address", "block_digests", "digest_algorithm")
    AGENT_NAME_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_FIELD_NUMBER: _ClassVar[int]
    BLOCK_IDS_FIELD_NUMBER: _ClassVar[int]
    NUM_TOKENS_FIELD_NUMBER: _ClassVar[int]
    KV_SOURCE_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    BLOCK_DIGESTS_FIELD_NUMBER: _ClassVar[int]
    DIGEST_ALGORITHM_FIELD_NUMBER: _ClassVar[int]
    agent_name: str
    layout: KvLayout
    block_ids: _containers.RepeatedScalarFieldContainer[int]
    num_tokens: int
    kv_source_address: str
    block_digests: bytes
    digest_algorithm: str
    def __init__(self, agent_name: _Optional[str] = ..., layout: _Optional[_Union[KvLayout, _Mapping]] = ..., block_ids: _Optional[_Iterable[int]] = ..., num_tokens: _Optional[int] = ..., kv_source_address: _Optional[str] = ..., block_digests: _Optional[bytes] = ..., digest_algorithm: _Optional[str] = ...) -> None: ...

class EngineState(_message.Message):
    __slots__ = ("backend", "opaque_state", "first_gen_tokens", "ctx_request_id", "draft_tokens", "disagg_request_id", "ctx_dp_rank", "ctx_info_endpoint")
    BACKEND_FIELD_NUMBER: _ClassVar[int]
    OPAQUE_STATE_FIELD_NUMBER: _ClassVar[int]
    FIRST_GEN_TOKENS_FIELD_NUMBER: _ClassVar[int]
    CTX_REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    DRAFT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    DISAGG_REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    CTX_DP_RANK_FIELD_NUMBER: _ClassVar[int]
    CTX_INFO_ENDPOINT_FIELD_NUMBER: _ClassVar[int]
    backend: str
    opaque_state: bytes
    first_gen_tokens: _containers.RepeatedScalarFieldContainer[int]
    ctx_request_id: int
    draft_tokens: _containers.RepeatedScalarFieldContainer[int]
    disagg_request_id: int
    ctx_dp_rank: int
    ctx_info_endpoint: str
    def __init__(self, backend: _Optional[str] = ..., opaque_state: _Optional[bytes] = ..., first_gen_tokens: _Optional[_Iterable[int]] = ..., ctx_request_id: _Optional[int] = ..., draft_tokens: _Optional[_Iterable[int]] = ..., disagg_request_id: _Optional[int] = ..., ctx_dp_rank: _Optional[int] = ..., ctx_info_endpoint: _Optional[str] = ...) -> None: ...

class KvHandle(_message.Message):
    __slots__ = ("handle_id", "issued_to", "lease_expires_unix_ms", "model_id", "num_tokens", "nixl_blocks", "engine_state")
    HANDLE_ID_FIELD_NUMBER: _ClassVar[int]
    ISSUED_TO_FIELD_NUMBER: _ClassVar[int]
    LEASE_EXPIRES_UNIX_MS_FIELD_NUMBER: _ClassVar[int]
    MODEL_ID_FIELD_NUMBER: _ClassVar[int]
    NUM_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NIXL_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    ENGINE_STATE_FIELD_NUMBER: _ClassVar[int]
    handle_id: str
    issued_to: str
    lease_expires_unix_ms: int
    model_id: str
    num_tokens: int
    nixl_blocks: NixlBlockDescriptors
    engine_state: EngineState
    def __init__(self, handle_id: _Optional[str] = ..., issued_to: _Optional[str] = ..., lease_expires_unix_ms: _Optional[int] = ..., model_id: _Optional[str] = ..., num_tokens: _Optional[int] = ..., nixl_blocks: _Optional[_Union[NixlBlockDescriptors, _Mapping]] = ..., engine_state: _Optional[_Union[EngineState, _Mapping]] = ...) -> None: ...

class WorkerInfo(_message.Message):
    __slots__ = ("worker_id", "address", "role", "model_id", "block_size", "accelerator", "kv_capacity_blocks", "free_blocks", "engine_backend", "max_model_len", "kv_agent_name", "link_port", "accelerator_generation", "memory_headroom_bytes", "warm_models", "model_load_s")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    ROLE_FIELD_NUMBER: _ClassVar[int]
    MODEL_ID_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    ACCELERATOR_FIELD_NUMBER: _ClassVar[int]
    KV_CAPACITY_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    FREE_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    ENGINE_BACKEND_FIELD_NUMBER: _ClassVar[int]
    MAX_MODEL_LEN_FIELD_NUMBER: _ClassVar[int]
    KV_AGENT_NAME_FIELD_NUMBER: _ClassVar[int]
    LINK_PORT_FIELD_NUMBER: _ClassVar[int]
    ACCELERATOR_GENERATION_FIELD_NUMBER: _ClassVar[int]
    MEMORY_HEADROOM_BYTES_FIELD_NUMBER: _ClassVar[int]
    WARM_MODELS_FIELD_NUMBER: _ClassVar[int]
    MODEL_LOAD_S_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    address: str
    role: WorkerRole
    model_id: str
    block_size: int
    accelerator: AcceleratorKind
    kv_capacity_blocks: int
    free_blocks: int
    engine_backend: str
    max_model_len: int
    kv_agent_name: str
    link_port: int
    accelerator_generation: str
    memory_headroom_bytes: int
    warm_models: _containers.RepeatedScalarFieldContainer[str]
    model_load_s: float
    def __init__(self, worker_id: _Optional[str] = ..., address: _Optional[str] = ..., role: _Optional[_Union[WorkerRole, str]] = ..., model_id: _Optional[str] = ..., block_size: _Optional[int] = ..., accelerator: _Optional[_Union[AcceleratorKind, str]] = ..., kv_capacity_blocks: _Optional[int] = ..., free_blocks: _Optional[int] = ..., engine_backend: _Optional[str] = ..., max_model_len: _Optional[int] = ..., kv_agent_name: _Optional[str] = ..., link_port: _Optional[int] = ..., accelerator_generation: _Optional[str] = ..., memory_headroom_bytes: _Optional[int] = ..., warm_models: _Optional[_Iterable[str]] = ..., model_load_s: _Optional[float] = ...) -> None: ...

class WorkerLoad(_message.Message):
    __slots__ = ("running", "waiting", "tokens_waiting", "used_blocks", "free_blocks", "estimated_wait_ms", "active_decode_blocks", "not_serving_reason", "no_progress_ms", "host_restore_ms_per_block", "prefill_ms_per_block", "link_ms_per_block", "link_latency_ms")
    RUNNING_FIELD_NUMBER: _ClassVar[int]
    WAITING_FIELD_NUMBER: _ClassVar[int]
    TOKENS_WAITING_FIELD_NUMBER: _ClassVar[int]
    USED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    FREE_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    ESTIMATED_WAIT_MS_FIELD_NUMBER: _ClassVar[int]
    ACTIVE_DECODE_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    NOT_SERVING_REASON_FIELD_NUMBER: _ClassVar[int]
    NO_PROGRESS_MS_FIELD_NUMBER: _ClassVar[int]
    HOST_RESTORE_MS_PER_BLOCK_FIELD_NUMBER: _ClassVar[int]
    PREFILL_MS_PER_BLOCK_FIELD_NUMBER: _ClassVar[int]
    LINK_MS_PER_BLOCK_FIELD_NUMBER: _ClassVar[int]
    LINK_LATENCY_MS_FIELD_NUMBER: _ClassVar[int]
    running: int
    waiting: int
    tokens_waiting: int
    used_blocks: int
    free_blocks: int
    estimated_wait_ms: float
    active_decode_blocks: int
    not_serving_reason: str
    no_progress_ms: int
    host_restore_ms_per_block: float
    prefill_ms_per_block: float
    link_ms_per_block: float
    link_latency_ms: float
    def __init__(self, running: _Optional[int] = ..., waiting: _Optional[int] = ..., tokens_waiting: _Optional[int] = ..., used_blocks: _Optional[int] = ..., free_blocks: _Optional[int] = ..., estimated_wait_ms: _Optional[float] = ..., active_decode_blocks: _Optional[int] = ..., not_serving_reason: _Optional[str] = ..., no_progress_ms: _Optional[int] = ..., host_restore_ms_per_block: _Optional[float] = ..., prefill_ms_per_block: _Optional[float] = ..., link_ms_per_block: _Optional[float] = ..., link_latency_ms: _Optional[float] = ...) -> None: ...

class KvEvent(_message.Message):
    __slots__ = ("seq", "stored", "removed", "cleared")
    SEQ_FIELD_NUMBER: _ClassVar[int]
    STORED_FIELD_NUMBER: _ClassVar[int]
    REMOVED_FIELD_NUMBER: _ClassVar[int]
    CLEARED_FIELD_NUMBER: _ClassVar[int]
    seq: int
    stored: KvBlocksStored
    removed: KvBlocksRemoved
    cleared: KvCacheCleared
    def __init__(self, seq: _Optional[int] = ..., stored: _Optional[_Union[KvBlocksStored, _Mapping]] = ..., removed: _Optional[_Union[KvBlocksRemoved, _Mapping]] = ..., cleared: _Optional[_Union[KvCacheCleared, _Mapping]] = ...) -> None: ...

class KvBlocksStored(_message.Message):
    __slots__ = ("parent_hash", "block_hashes", "tier")
    PARENT_HASH_FIELD_NUMBER: _ClassVar[int]
    BLOCK_HASHES_FIELD_NUMBER: _ClassVar[int]
    TIER_FIELD_NUMBER: _ClassVar[int]
    parent_hash: int
    block_hashes: _containers.RepeatedScalarFieldContainer[int]
    tier: KvTier
    def __init__(self, parent_hash: _Optional[int] = ..., block_hashes: _Optional[_Iterable[int]] = ..., tier: _Optional[_Union[KvTier, str]] = ...) -> None: ...

class KvBlocksRemoved(_message.Message):
    __slots__ = ("block_hashes", "tier")
    BLOCK_HASHES_FIELD_NUMBER: _ClassVar[int]
    TIER_FIELD_NUMBER: _ClassVar[int]
    block_hashes: _containers.RepeatedScalarFieldContainer[int]
    tier: KvTier
    def __init__(self, block_hashes: _Optional[_Iterable[int]] = ..., tier: _Optional[_Union[KvTier, str]] = ...) -> None: ...

class KvCacheCleared(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class EngineCounters(_message.Message):
    __slots__ = ("prompt_tokens_computed", "decode_tokens_computed", "prompt_tokens_cached", "prompt_tokens_transferred", "preemptions", "pinned_blocks", "pins_evicted", "pins_expired", "host_blocks", "host_capacity_blocks", "host_bytes", "prompt_tokens_restored", "host_restores", "host_restore_s", "host_restores_declined", "host_rejected", "host_evicted", "admitted_ahead", "admitted_overdue", "moved_ahead")
    PROMPT_TOKENS_COMPUTED_FIELD_NUMBER: _ClassVar[int]
    DECODE_TOKENS_COMPUTED_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKENS_CACHED_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKENS_TRANSFERRED_FIELD_NUMBER: _ClassVar[int]
    PREEMPTIONS_FIELD_NUMBER: _ClassVar[int]
    PINNED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    PINS_EVICTED_FIELD_NUMBER: _ClassVar[int]
    PINS_EXPIRED_FIELD_NUMBER: _ClassVar[int]
    HOST_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    HOST_CAPACITY_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    HOST_BYTES_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKENS_RESTORED_FIELD_NUMBER: _ClassVar[int]
    HOST_RESTORES_FIELD_NUMBER: _ClassVar[int]
    HOST_RESTORE_S_FIELD_NUMBER: _ClassVar[int]
    HOST_RESTORES_DECLINED_FIELD_NUMBER: _ClassVar[int]
    HOST_REJECTED_FIELD_NUMBER: _ClassVar[int]
    HOST_EVICTED_FIELD_NUMBER: _ClassVar[int]
    ADMITTED_AHEAD_FIELD_NUMBER: _ClassVar[int]
    ADMITTED_OVERDUE_FIELD_NUMBER: _ClassVar[int]
    MOVED_AHEAD_FIELD_NUMBER: _ClassVar[int]
    prompt_tokens_computed: int
    decode_tokens_computed: int
    prompt_tokens_cached: int
    prompt_tokens_transferred: int
    preemptions: int
    pinned_blocks: int
    pins_evicted: int
    pins_expired: int
    host_blocks: int
    host_capacity_blocks: int
    host_bytes: int
    prompt_tokens_restored: int
    host_restores: int
    host_restore_s: float
    host_restores_declined: int
    host_rejected: int
    host_evicted: int
    admitted_ahead: int
    admitted_overdue: int
    moved_ahead: int
    def __init__(self, prompt_tokens_computed: _Optional[int] = ..., decode_tokens_computed: _Optional[int] = ..., prompt_tokens_cached: _Optional[int] = ..., prompt_tokens_transferred: _Optional[int] = ..., preemptions: _Optional[int] = ..., pinned_blocks: _Optional[int] = ..., pins_evicted: _Optional[int] = ..., pins_expired: _Optional[int] = ..., host_blocks: _Optional[int] = ..., host_capacity_blocks: _Optional[int] = ..., host_bytes: _Optional[int] = ..., prompt_tokens_restored: _Optional[int] = ..., host_restores: _Optional[int] = ..., host_restore_s: _Optional[float] = ..., host_restores_declined: _Optional[int] = ..., host_rejected: _Optional[int] = ..., host_evicted: _Optional[int] = ..., admitted_ahead: _Optional[int] = ..., admitted_overdue: _Optional[int] = ..., moved_ahead: _Optional[int] = ...) -> None: ...
