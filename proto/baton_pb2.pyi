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
    FINISH_REASON_STOP: _ClassVar[FinishReason]
    FINISH_REASON_LENGTH: _ClassVar[FinishReason]
    FINISH_REASON_ABORT: _ClassVar[FinishReason]

class WorkerState(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    WORKER_STATE_UNSPECIFIED: _ClassVar[WorkerState]
    WORKER_STATE_UP: _ClassVar[WorkerState]
    WORKER_STATE_DRAINING: _ClassVar[WorkerState]
FINISH_REASON_UNSPECIFIED: FinishReason
FINISH_REASON_STOP: FinishReason
FINISH_REASON_LENGTH: FinishReason
FINISH_REASON_ABORT: FinishReason
WORKER_STATE_UNSPECIFIED: WorkerState
WORKER_STATE_UP: WorkerState
WORKER_STATE_DRAINING: WorkerState

class SamplingParams(_message.Message):
    __slots__ = ("temperature", "top_k", "top_p", "min_p", "repetition_penalty", "presence_penalty", "frequency_penalty", "seed", "max_tokens", "min_tokens", "stop_token_ids", "stop", "ignore_eos", "logprobs")
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    MIN_P_FIELD_NUMBER: _ClassVar[int]
    REPETITION_PENALTY_FIELD_NUMBER: _ClassVar[int]
    PRESENCE_PENALTY_FIELD_NUMBER: _ClassVar[int]
    FREQUENCY_PENALTY_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    MAX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    MIN_TOKENS_FIELD_NUMBER: _ClassVar[int]
    STOP_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    STOP_FIELD_NUMBER: _ClassVar[int]
    IGNORE_EOS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    temperature: float
    top_k: int
    top_p: float
    min_p: float
    repetition_penalty: float
    presence_penalty: float
    frequency_penalty: float
    seed: int
    max_tokens: int
    min_tokens: int
    stop_token_ids: _containers.RepeatedScalarFieldContainer[int]
    stop: _containers.RepeatedScalarFieldContainer[str]
    ignore_eos: bool
    logprobs: int
    def __init__(self, temperature: _Optional[float] = ..., top_k: _Optional[int] = ..., top_p: _Optional[float] = ..., min_p: _Optional[float] = ..., repetition_penalty: _Optional[float] = ..., presence_penalty: _Optional[float] = ..., frequency_penalty: _Optional[float] = ..., seed: _Optional[int] = ..., max_tokens: _Optional[int] = ..., min_tokens: _Optional[int] = ..., stop_token_ids: _Optional[_Iterable[int]] = ..., stop: _Optional[_Iterable[str]] = ..., ignore_eos: _Optional[bool] = ..., logprobs: _Optional[int] = ...) -> None: ...

class TokenIds(_message.Message):
    __slots__ = ("ids",)
    IDS_FIELD_NUMBER: _ClassVar[int]
    ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, ids: _Optional[_Iterable[int]] = ...) -> None: ...

class ChatMessage(_message.Message):
    __slots__ = ("role", "content")
    ROLE_FIELD_NUMBER: _ClassVar[int]
    CONTENT_FIELD_NUMBER: _ClassVar[int]
    role: str
    content: str
    def __init__(self, role: _Optional[str] = ..., content: _Optional[str] = ...) -> None: ...

class Chat(_message.Message):
    __slots__ = ("messages",)
    MESSAGES_FIELD_NUMBER: _ClassVar[int]
    messages: _containers.RepeatedCompositeFieldContainer[ChatMessage]
    def __init__(self, messages: _Optional[_Iterable[_Union[ChatMessage, _Mapping]]] = ...) -> None: ...

class Usage(_message.Message):
    __slots__ = ("prompt_tokens", "completion_tokens", "cached_prompt_tokens")
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    COMPLETION_TOKENS_FIELD_NUMBER: _ClassVar[int]
    CACHED_PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    prompt_tokens: int
    completion_tokens: int
    cached_prompt_tokens: int
    def __init__(self, prompt_tokens: _Optional[int] = ..., completion_tokens: _Optional[int] = ..., cached_prompt_tokens: _Optional[int] = ...) -> None: ...

class Timings(_message.Message):
    __slots__ = ("ttft_ms", "queue_ms", "prefill_ms", "transfer_bytes", "transfer_ms", "transfer_gbps", "transfer_blocks", "prefill_worker", "decode_worker", "route_kind", "route_reason", "decode_tokens_per_s", "e2e_ms", "predicted_ttft_ms", "transport", "kv_layerwise", "lease_released", "local_fallback", "prefill_end_unix_ms", "kv_first_layer_unix_ms", "spec_draft_tokens", "spec_accepted_tokens", "migrations", "migration_ms")
    TTFT_MS_FIELD_NUMBER: _ClassVar[int]
    QUEUE_MS_FIELD_NUMBER: _ClassVar[int]
    PREFILL_MS_FIELD_NUMBER: _ClassVar[int]
    TRANSFER_BYTES_FIELD_NUMBER: _ClassVar[int]
    TRANSFER_MS_FIELD_NUMBER: _ClassVar[int]
    TRANSFER_GBPS_FIELD_NUMBER: _ClassVar[int]
    TRANSFER_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    PREFILL_WORKER_FIELD_NUMBER: _ClassVar[int]
    DECODE_WORKER_FIELD_NUMBER: _ClassVar[int]
    ROUTE_KIND_FIELD_NUMBER: _ClassVar[int]
    ROUTE_REASON_FIELD_NUMBER: _ClassVar[int]
    DECODE_TOKENS_PER_S_FIELD_NUMBER: _ClassVar[int]
    E2E_MS_FIELD_NUMBER: _ClassVar[int]
    PREDICTED_TTFT_MS_FIELD_NUMBER: _ClassVar[int]
    TRANSPORT_FIELD_NUMBER: _ClassVar[int]
    KV_LAYERWISE_FIELD_NUMBER: _ClassVar[int]
    LEASE_RELEASED_FIELD_NUMBER: _ClassVar[int]
    LOCAL_FALLBACK_FIELD_NUMBER: _ClassVar[int]
    PREFILL_END_UNIX_MS_FIELD_NUMBER: _ClassVar[int]
    KV_FIRST_LAYER_UNIX_MS_FIELD_NUMBER: _ClassVar[int]
    SPEC_DRAFT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    SPEC_ACCEPTED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    MIGRATIONS_FIELD_NUMBER: _ClassVar[int]
    MIGRATION_MS_FIELD_NUMBER: _ClassVar[int]
    ttft_ms: float
    queue_ms: float
    prefill_ms: float
    transfer_bytes: int
    transfer_ms: float
    transfer_gbps: float
    transfer_blocks: int
    prefill_worker: str
    decode_worker: str
    route_kind: str
    route_reason: str
    decode_tokens_per_s: float
    e2e_ms: float
    predicted_ttft_ms: float
    transport: str
    kv_layerwise: bool
    lease_released: bool
    local_fallback: bool
    prefill_end_unix_ms: float
    kv_first_layer_unix_ms: float
    spec_draft_tokens: int
    spec_accepted_tokens: int
    migrations: int
    migration_ms: float
    def __init__(self, ttft_ms: _Optional[float] = ..., queue_ms: _Optional[float] = ..., prefill_ms: _Optional[float] = ..., transfer_bytes: _Optional[int] = ..., transfer_ms: _Optional[float] = ..., transfer_gbps: _Optional[float] = ..., transfer_blocks: _Optional[int] = ..., prefill_worker: _Optional[str] = ..., decode_worker: _Optional[str] = ..., route_kind: _Optional[str] = ..., route_reason: _Optional[str] = ..., decode_tokens_per_s: _Optional[float] = ..., e2e_ms: _Optional[float] = ..., predicted_ttft_ms: _Optional[float] = ..., transport: _Optional[str] = ..., kv_layerwise: _Optional[bool] = ..., lease_released: _Optional[bool] = ..., local_fallback: _Optional[bool] = ..., prefill_end_unix_ms: _Optional[float] = ..., kv_first_layer_unix_ms: _Optional[float] = ..., spec_draft_tokens: _Optional[int] = ..., spec_accepted_tokens: _Optional[int] = ..., migrations: _Optional[int] = ..., migration_ms: _Optional[float] = ...) -> None: ...

class TokenLogprob(_message.Message):
    __slots__ = ("token_id", "logprob")
    TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    LOGPROB_FIELD_NUMBER: _ClassVar[int]
    token_id: int
    logprob: float
    def __init__(self, token_id: _Optional[int] = ..., logprob: _Optional[float] = ...) -> None: ...

class Logprobs(_message.Message):
    __slots__ = ("logprob", "top")
    LOGPROB_FIELD_NUMBER: _ClassVar[int]
    TOP_FIELD_NUMBER: _ClassVar[int]
    logprob: float
    top: _containers.RepeatedCompositeFieldContainer[TokenLogprob]
    def __init__(self, logprob: _Optional[float] = ..., top: _Optional[_Iterable[_Union[TokenLogprob, _Mapping]]] = ...) -> None: ...

class KVLayout(_message.Message):
    __slots__ = ("model_fingerprint", "dtype", "block_size", "num_layers", "num_kv_heads", "head_dim", "scale_bytes", "tp_size", "tp_rank")
    MODEL_FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    NUM_LAYERS_FIELD_NUMBER: _ClassVar[int]
    NUM_KV_HEADS_FIELD_NUMBER: _ClassVar[int]
    HEAD_DIM_FIELD_NUMBER: _ClassVar[int]
    SCALE_BYTES_FIELD_NUMBER: _ClassVar[int]
    TP_SIZE_FIELD_NUMBER: _ClassVar[int]
    TP_RANK_FIELD_NUMBER: _ClassVar[int]
    model_fingerprint: bytes
    dtype: str
    block_size: int
    num_layers: int
    num_kv_heads: int
    head_dim: int
    scale_bytes: int
    tp_size: int
    tp_rank: int
    def __init__(self, model_fingerprint: _Optional[bytes] = ..., dtype: _Optional[str] = ..., block_size: _Optional[int] = ..., num_layers: _Optional[int] = ..., num_kv_heads: _Optional[int] = ..., head_dim: _Optional[int] = ..., scale_bytes: _Optional[int] = ..., tp_size: _Optional[int] = ..., tp_rank: _Optional[int] = ...) -> None: ...

class KVHandle(_message.Message):
    __slots__ = ("worker_id", "data_plane_uri", "lease_id", "block_ids", "block_hashes", "num_tokens", "layout", "lease_expires_unix_ms", "grpc_address", "first_block", "engine", "engine_params")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    DATA_PLANE_URI_FIELD_NUMBER: _ClassVar[int]
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    BLOCK_IDS_FIELD_NUMBER: _ClassVar[int]
    BLOCK_HASHES_FIELD_NUMBER: _ClassVar[int]
    NUM_TOKENS_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_FIELD_NUMBER: _ClassVar[int]
    LEASE_EXPIRES_UNIX_MS_FIELD_NUMBER: _ClassVar[int]
    GRPC_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    FIRST_BLOCK_FIELD_NUMBER: _ClassVar[int]
    ENGINE_FIELD_NUMBER: _ClassVar[int]
    ENGINE_PARAMS_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    data_plane_uri: str
    lease_id: str
    block_ids: _containers.RepeatedScalarFieldContainer[int]
    block_hashes: _containers.RepeatedScalarFieldContainer[bytes]
    num_tokens: int
    layout: KVLayout
    lease_expires_unix_ms: int
    grpc_address: str
    first_block: int
    engine: str
    engine_params: bytes
    def __init__(self, worker_id: _Optional[str] = ..., data_plane_uri: _Optional[str] = ..., lease_id: _Optional[str] = ..., block_ids: _Optional[_Iterable[int]] = ..., block_hashes: _Optional[_Iterable[bytes]] = ..., num_tokens: _Optional[int] = ..., layout: _Optional[_Union[KVLayout, _Mapping]] = ..., lease_expires_unix_ms: _Optional[int] = ..., grpc_address: _Optional[str] = ..., first_block: _Optional[int] = ..., engine: _Optional[str] = ..., engine_params: _Optional[bytes] = ...) -> None: ...

class GenerateRequest(_message.Message):
    __slots__ = ("request_id", "prompt", "token_ids", "chat", "sampling", "cache_salt", "priority", "model")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    CHAT_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    CACHE_SALT_FIELD_NUMBER: _ClassVar[int]
    PRIORITY_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    prompt: str
    token_ids: TokenIds
    chat: Chat
    sampling: SamplingParams
    cache_salt: str
    priority: int
    model: str
    def __init__(self, request_id: _Optional[str] = ..., prompt: _Optional[str] = ..., token_ids: _Optional[_Union[TokenIds, _Mapping]] = ..., chat: _Optional[_Union[Chat, _Mapping]] = ..., sampling: _Optional[_Union[SamplingParams, _Mapping]] = ..., cache_salt: _Optional[str] = ..., priority: _Optional[int] = ..., model: _Optional[str] = ...) -> None: ...

class GenerateResponse(_message.Message):
    __slots__ = ("request_id", "token_ids", "text", "finish_reason", "usage", "timings", "logprobs")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    USAGE_FIELD_NUMBER: _ClassVar[int]
    TIMINGS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    text: str
    finish_reason: FinishReason
    usage: Usage
    timings: Timings
    logprobs: _containers.RepeatedCompositeFieldContainer[Logprobs]
    def __init__(self, request_id: _Optional[str] = ..., token_ids: _Optional[_Iterable[int]] = ..., text: _Optional[str] = ..., finish_reason: _Optional[_Union[FinishReason, str]] = ..., usage: _Optional[_Union[Usage, _Mapping]] = ..., timings: _Optional[_Union[Timings, _Mapping]] = ..., logprobs: _Optional[_Iterable[_Union[Logprobs, _Mapping]]] = ...) -> None: ...

class TokenizeRequest(_message.Message):
    __slots__ = ("prompt", "chat")
    PROMPT_FIELD_NUMBER: _ClassVar[int]
    CHAT_FIELD_NUMBER: _ClassVar[int]
    prompt: str
    chat: Chat
    def __init__(self, prompt: _Optional[str] = ..., chat: _Optional[_Union[Chat, _Mapping]] = ...) -> None: ...

class TokenizeResponse(_message.Message):
    __slots__ = ("token_ids",)
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class ModelInfoRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ModelInfoResponse(_message.Message):
    __slots__ = ("model", "architecture", "max_model_len", "vocab_size", "block_size", "model_fingerprint")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    ARCHITECTURE_FIELD_NUMBER: _ClassVar[int]
    MAX_MODEL_LEN_FIELD_NUMBER: _ClassVar[int]
    VOCAB_SIZE_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    MODEL_FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    model: str
    architecture: str
    max_model_len: int
    vocab_size: int
    block_size: int
    model_fingerprint: bytes
    def __init__(self, model: _Optional[str] = ..., architecture: _Optional[str] = ..., max_model_len: _Optional[int] = ..., vocab_size: _Optional[int] = ..., block_size: _Optional[int] = ..., model_fingerprint: _Optional[bytes] = ...) -> None: ...

class PrefillRequest(_message.Message):
    __slots__ = ("request_id", "token_ids", "sampling", "cache_salt", "decode_worker_id", "priority", "store_blocks")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    CACHE_SALT_FIELD_NUMBER: _ClassVar[int]
    DECODE_WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    PRIORITY_FIELD_NUMBER: _ClassVar[int]
    STORE_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    sampling: SamplingParams
    cache_salt: str
    decode_worker_id: str
    priority: int
    store_blocks: int
    def __init__(self, request_id: _Optional[str] = ..., token_ids: _Optional[_Iterable[int]] = ..., sampling: _Optional[_Union[SamplingParams, _Mapping]] = ..., cache_salt: _Optional[str] = ..., decode_worker_id: _Optional[str] = ..., priority: _Optional[int] = ..., store_blocks: _Optional[int] = ...) -> None: ...

class PrefillResponse(_message.Message):
    __slots__ = ("first_token", "logprobs", "handle", "timings", "finish_reason", "num_cached_tokens", "kv_pending")
    FIRST_TOKEN_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    HANDLE_FIELD_NUMBER: _ClassVar[int]
    TIMINGS_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    NUM_CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    KV_PENDING_FIELD_NUMBER: _ClassVar[int]
    first_token: int
    logprobs: Logprobs
    handle: KVHandle
    timings: Timings
    finish_reason: FinishReason
    num_cached_tokens: int
    kv_pending: bool
    def __init__(self, first_token: _Optional[int] = ..., logprobs: _Optional[_Union[Logprobs, _Mapping]] = ..., handle: _Optional[_Union[KVHandle, _Mapping]] = ..., timings: _Optional[_Union[Timings, _Mapping]] = ..., finish_reason: _Optional[_Union[FinishReason, str]] = ..., num_cached_tokens: _Optional[int] = ..., kv_pending: _Optional[bool] = ...) -> None: ...

class DecodeRequest(_message.Message):
    __slots__ = ("request_id", "token_ids", "sampling", "cache_salt", "handle", "num_output_tokens_so_far", "priority", "prompt_len", "first_token_pending", "prefix_handle", "store_blocks")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    CACHE_SALT_FIELD_NUMBER: _ClassVar[int]
    HANDLE_FIELD_NUMBER: _ClassVar[int]
    NUM_OUTPUT_TOKENS_SO_FAR_FIELD_NUMBER: _ClassVar[int]
    PRIORITY_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LEN_FIELD_NUMBER: _ClassVar[int]
    FIRST_TOKEN_PENDING_FIELD_NUMBER: _ClassVar[int]
    PREFIX_HANDLE_FIELD_NUMBER: _ClassVar[int]
    STORE_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    sampling: SamplingParams
    cache_salt: str
    handle: KVHandle
    num_output_tokens_so_far: int
    priority: int
    prompt_len: int
    first_token_pending: bool
    prefix_handle: KVHandle
    store_blocks: int
    def __init__(self, request_id: _Optional[str] = ..., token_ids: _Optional[_Iterable[int]] = ..., sampling: _Optional[_Union[SamplingParams, _Mapping]] = ..., cache_salt: _Optional[str] = ..., handle: _Optional[_Union[KVHandle, _Mapping]] = ..., num_output_tokens_so_far: _Optional[int] = ..., priority: _Optional[int] = ..., prompt_len: _Optional[int] = ..., first_token_pending: _Optional[bool] = ..., prefix_handle: _Optional[_Union[KVHandle, _Mapping]] = ..., store_blocks: _Optional[int] = ...) -> None: ...

class LeasePrefixRequest(_message.Message):
    __slots__ = ("token_ids", "cache_salt", "min_tokens")
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    CACHE_SALT_FIELD_NUMBER: _ClassVar[int]
    MIN_TOKENS_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    cache_salt: str
    min_tokens: int
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ..., cache_salt: _Optional[str] = ..., min_tokens: _Optional[int] = ...) -> None: ...

class LeasePrefixResponse(_message.Message):
    __slots__ = ("handle",)
    HANDLE_FIELD_NUMBER: _ClassVar[int]
    handle: KVHandle
    def __init__(self, handle: _Optional[_Union[KVHandle, _Mapping]] = ...) -> None: ...

class FirstTokenRequest(_message.Message):
    __slots__ = ("request_id", "token_id", "recompute")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    RECOMPUTE_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    token_id: int
    recompute: bool
    def __init__(self, request_id: _Optional[str] = ..., token_id: _Optional[int] = ..., recompute: _Optional[bool] = ...) -> None: ...

class FirstTokenResponse(_message.Message):
    __slots__ = ("found",)
    FOUND_FIELD_NUMBER: _ClassVar[int]
    found: bool
    def __init__(self, found: _Optional[bool] = ...) -> None: ...

class DecodeResponse(_message.Message):
    __slots__ = ("token_ids", "finish_reason", "timings", "logprobs", "num_cached_tokens")
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    TIMINGS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    NUM_CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    finish_reason: FinishReason
    timings: Timings
    logprobs: _containers.RepeatedCompositeFieldContainer[Logprobs]
    num_cached_tokens: int
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ..., finish_reason: _Optional[_Union[FinishReason, str]] = ..., timings: _Optional[_Union[Timings, _Mapping]] = ..., logprobs: _Optional[_Iterable[_Union[Logprobs, _Mapping]]] = ..., num_cached_tokens: _Optional[int] = ...) -> None: ...

class AbortRequest(_message.Message):
    __slots__ = ("request_id",)
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    def __init__(self, request_id: _Optional[str] = ...) -> None: ...

class AbortResponse(_message.Message):
    __slots__ = ("found",)
    FOUND_FIELD_NUMBER: _ClassVar[int]
    found: bool
    def __init__(self, found: _Optional[bool] = ...) -> None: ...

class ReleaseLeaseRequest(_message.Message):
    __slots__ = ("lease_id", "read")
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    READ_FIELD_NUMBER: _ClassVar[int]
    lease_id: str
    read: bool
    def __init__(self, lease_id: _Optional[str] = ..., read: _Optional[bool] = ...) -> None: ...

class ReleaseLeaseResponse(_message.Message):
    __slots__ = ("found",)
    FOUND_FIELD_NUMBER: _ClassVar[int]
    found: bool
    def __init__(self, found: _Optional[bool] = ...) -> None: ...

class StatsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class StatsResponse(_message.Message):
    __slots__ = ("worker_id", "role", "num_running", "num_waiting", "num_free_blocks", "num_total_blocks", "num_open_leases", "queued_prefill_tokens", "kv_cache_usage", "prefix_cache_queries", "prefix_cache_hits", "num_preemptions", "kv_transfer_bytes", "kv_transfer_seconds", "num_aborted_requests", "kv_pull_fallbacks", "num_staging_blocks", "num_free_staging_blocks")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    ROLE_FIELD_NUMBER: _ClassVar[int]
    NUM_RUNNING_FIELD_NUMBER: _ClassVar[int]
    NUM_WAITING_FIELD_NUMBER: _ClassVar[int]
    NUM_FREE_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    NUM_TOTAL_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    NUM_OPEN_LEASES_FIELD_NUMBER: _ClassVar[int]
    QUEUED_PREFILL_TOKENS_FIELD_NUMBER: _ClassVar[int]
    KV_CACHE_USAGE_FIELD_NUMBER: _ClassVar[int]
    PREFIX_CACHE_QUERIES_FIELD_NUMBER: _ClassVar[int]
    PREFIX_CACHE_HITS_FIELD_NUMBER: _ClassVar[int]
    NUM_PREEMPTIONS_FIELD_NUMBER: _ClassVar[int]
    KV_TRANSFER_BYTES_FIELD_NUMBER: _ClassVar[int]
    KV_TRANSFER_SECONDS_FIELD_NUMBER: _ClassVar[int]
    NUM_ABORTED_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    KV_PULL_FALLBACKS_FIELD_NUMBER: _ClassVar[int]
    NUM_STAGING_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    NUM_FREE_STAGING_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    role: str
    num_running: int
    num_waiting: int
    num_free_blocks: int
    num_total_blocks: int
    num_open_leases: int
    queued_prefill_tokens: int
    kv_cache_usage: float
    prefix_cache_queries: int
    prefix_cache_hits: int
    num_preemptions: int
    kv_transfer_bytes: int
    kv_transfer_seconds: float
    num_aborted_requests: int
    kv_pull_fallbacks: int
    num_staging_blocks: int
    num_free_staging_blocks: int
    def __init__(self, worker_id: _Optional[str] = ..., role: _Optional[str] = ..., num_running: _Optional[int] = ..., num_waiting: _Optional[int] = ..., num_free_blocks: _Optional[int] = ..., num_total_blocks: _Optional[int] = ..., num_open_leases: _Optional[int] = ..., queued_prefill_tokens: _Optional[int] = ..., kv_cache_usage: _Optional[float] = ..., prefix_cache_queries: _Optional[int] = ..., prefix_cache_hits: _Optional[int] = ..., num_preemptions: _Optional[int] = ..., kv_transfer_bytes: _Optional[int] = ..., kv_transfer_seconds: _Optional[float] = ..., num_aborted_requests: _Optional[int] = ..., kv_pull_fallbacks: _Optional[int] = ..., num_staging_blocks: _Optional[int] = ..., num_free_staging_blocks: _Optional[int] = ...) -> None: ...

class AdminWorker(_message.Message):
    __slots__ = ("worker_id", "role", "grpc_address", "kv_uri", "state", "has_load", "num_running", "num_waiting", "num_free_blocks", "num_total_blocks", "queued_prefill_tokens", "kv_cache_usage", "load_age_ms", "prefix_cache_hit_rate", "transfer_gbps", "restarts")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    ROLE_FIELD_NUMBER: _ClassVar[int]
    GRPC_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    KV_URI_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    HAS_LOAD_FIELD_NUMBER: _ClassVar[int]
    NUM_RUNNING_FIELD_NUMBER: _ClassVar[int]
    NUM_WAITING_FIELD_NUMBER: _ClassVar[int]
    NUM_FREE_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    NUM_TOTAL_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    QUEUED_PREFILL_TOKENS_FIELD_NUMBER: _ClassVar[int]
    KV_CACHE_USAGE_FIELD_NUMBER: _ClassVar[int]
    LOAD_AGE_MS_FIELD_NUMBER: _ClassVar[int]
    PREFIX_CACHE_HIT_RATE_FIELD_NUMBER: _ClassVar[int]
    TRANSFER_GBPS_FIELD_NUMBER: _ClassVar[int]
    RESTARTS_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    role: str
    grpc_address: str
    kv_uri: str
    state: WorkerState
    has_load: bool
    num_running: int
    num_waiting: int
    num_free_blocks: int
    num_total_blocks: int
    queued_prefill_tokens: int
    kv_cache_usage: float
    load_age_ms: int
    prefix_cache_hit_rate: float
    transfer_gbps: float
    restarts: int
    def __init__(self, worker_id: _Optional[str] = ..., role: _Optional[str] = ..., grpc_address: _Optional[str] = ..., kv_uri: _Optional[str] = ..., state: _Optional[_Union[WorkerState, str]] = ..., has_load: _Optional[bool] = ..., num_running: _Optional[int] = ..., num_waiting: _Optional[int] = ..., num_free_blocks: _Optional[int] = ..., num_total_blocks: _Optional[int] = ..., queued_prefill_tokens: _Optional[int] = ..., kv_cache_usage: _Optional[float] = ..., load_age_ms: _Optional[int] = ..., prefix_cache_hit_rate: _Optional[float] = ..., transfer_gbps: _Optional[float] = ..., restarts: _Optional[int] = ...) -> None: ...

class ListWorkersRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ListWorkersResponse(_message.Message):
    __slots__ = ("workers",)
    WORKERS_FIELD_NUMBER: _ClassVar[int]
    workers: _containers.RepeatedCompositeFieldContainer[AdminWorker]
    def __init__(self, workers: _Optional[_Iterable[_Union[AdminWorker, _Mapping]]] = ...) -> None: ...

class PoolStatus(_message.Message):
    __slots__ = ("role", "desired", "actual", "draining")
    ROLE_FIELD_NUMBER: _ClassVar[int]
    DESIRED_FIELD_NUMBER: _ClassVar[int]
    ACTUAL_FIELD_NUMBER: _ClassVar[int]
    DRAINING_FIELD_NUMBER: _ClassVar[int]
    role: str
    desired: int
    actual: int
    draining: int
    def __init__(self, role: _Optional[str] = ..., desired: _Optional[int] = ..., actual: _Optional[int] = ..., draining: _Optional[int] = ...) -> None: ...

class GetPoolsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class GetPoolsResponse(_message.Message):
    __slots__ = ("pools",)
    POOLS_FIELD_NUMBER: _ClassVar[int]
    pools: _containers.RepeatedCompositeFieldContainer[PoolStatus]
    def __init__(self, pools: _Optional[_Iterable[_Union[PoolStatus, _Mapping]]] = ...) -> None: ...

class ScalePoolRequest(_message.Message):
    __slots__ = ("role", "size")
    ROLE_FIELD_NUMBER: _ClassVar[int]
    SIZE_FIELD_NUMBER: _ClassVar[int]
    role: str
    size: int
    def __init__(self, role: _Optional[str] = ..., size: _Optional[int] = ...) -> None: ...

class ScalePoolResponse(_message.Message):
    __slots__ = ("pool", "previous_desired")
    POOL_FIELD_NUMBER: _ClassVar[int]
    PREVIOUS_DESIRED_FIELD_NUMBER: _ClassVar[int]
    pool: PoolStatus
    previous_desired: int
    def __init__(self, pool: _Optional[_Union[PoolStatus, _Mapping]] = ..., previous_desired: _Optional[int] = ...) -> None: ...

class DrainRequest(_message.Message):
    __slots__ = ("worker_id",)
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    def __init__(self, worker_id: _Optional[str] = ...) -> None: ...

class DrainResponse(_message.Message):
    __slots__ = ("changed",)
    CHANGED_FIELD_NUMBER: _ClassVar[int]
    changed: bool
    def __init__(self, changed: _Optional[bool] = ...) -> None: ...

class PrefillCurve(_message.Message):
    __slots__ = ("prompt_lens", "tokens_per_s")
    PROMPT_LENS_FIELD_NUMBER: _ClassVar[int]
    TOKENS_PER_S_FIELD_NUMBER: _ClassVar[int]
    prompt_lens: _containers.RepeatedScalarFieldContainer[int]
    tokens_per_s: _containers.RepeatedScalarFieldContainer[float]
    def __init__(self, prompt_lens: _Optional[_Iterable[int]] = ..., tokens_per_s: _Optional[_Iterable[float]] = ...) -> None: ...

class DecodeCurve(_message.Message):
    __slots__ = ("batch_sizes", "itl_ms", "kv_tokens_per_worker", "context_lens", "itl_ms_grid")
    BATCH_SIZES_FIELD_NUMBER: _ClassVar[int]
    ITL_MS_FIELD_NUMBER: _ClassVar[int]
    KV_TOKENS_PER_WORKER_FIELD_NUMBER: _ClassVar[int]
    CONTEXT_LENS_FIELD_NUMBER: _ClassVar[int]
    ITL_MS_GRID_FIELD_NUMBER: _ClassVar[int]
    batch_sizes: _containers.RepeatedScalarFieldContainer[int]
    itl_ms: _containers.RepeatedScalarFieldContainer[float]
    kv_tokens_per_worker: int
    context_lens: _containers.RepeatedScalarFieldContainer[int]
    itl_ms_grid: _containers.RepeatedScalarFieldContainer[float]
    def __init__(self, batch_sizes: _Optional[_Iterable[int]] = ..., itl_ms: _Optional[_Iterable[float]] = ..., kv_tokens_per_worker: _Optional[int] = ..., context_lens: _Optional[_Iterable[int]] = ..., itl_ms_grid: _Optional[_Iterable[float]] = ...) -> None: ...

class PlanRequest(_message.Message):
    __slots__ = ("ttft_p90_ms", "itl_p90_ms", "rate", "isl", "osl", "prefill_curve", "decode_curve", "prefill_correction", "decode_correction", "apply", "from_traffic", "traffic_window_s")
    TTFT_P90_MS_FIELD_NUMBER: _ClassVar[int]
    ITL_P90_MS_FIELD_NUMBER: _ClassVar[int]
    RATE_FIELD_NUMBER: _ClassVar[int]
    ISL_FIELD_NUMBER: _ClassVar[int]
    OSL_FIELD_NUMBER: _ClassVar[int]
    PREFILL_CURVE_FIELD_NUMBER: _ClassVar[int]
    DECODE_CURVE_FIELD_NUMBER: _ClassVar[int]
    PREFILL_CORRECTION_FIELD_NUMBER: _ClassVar[int]
    DECODE_CORRECTION_FIELD_NUMBER: _ClassVar[int]
    APPLY_FIELD_NUMBER: _ClassVar[int]
    FROM_TRAFFIC_FIELD_NUMBER: _ClassVar[int]
    TRAFFIC_WINDOW_S_FIELD_NUMBER: _ClassVar[int]
    ttft_p90_ms: float
    itl_p90_ms: float
    rate: float
    isl: float
    osl: float
    prefill_curve: PrefillCurve
    decode_curve: DecodeCurve
    prefill_correction: float
    decode_correction: float
    apply: bool
    from_traffic: bool
    traffic_window_s: float
    def __init__(self, ttft_p90_ms: _Optional[float] = ..., itl_p90_ms: _Optional[float] = ..., rate: _Optional[float] = ..., isl: _Optional[float] = ..., osl: _Optional[float] = ..., prefill_curve: _Optional[_Union[PrefillCurve, _Mapping]] = ..., decode_curve: _Optional[_Union[DecodeCurve, _Mapping]] = ..., prefill_correction: _Optional[float] = ..., decode_correction: _Optional[float] = ..., apply: _Optional[bool] = ..., from_traffic: _Optional[bool] = ..., traffic_window_s: _Optional[float] = ...) -> None: ...

class PlanTerm(_message.Message):
    __slots__ = ("pool", "name", "value", "unit", "note")
    POOL_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    VALUE_FIELD_NUMBER: _ClassVar[int]
    UNIT_FIELD_NUMBER: _ClassVar[int]
    NOTE_FIELD_NUMBER: _ClassVar[int]
    pool: str
    name: str
    value: float
    unit: str
    note: str
    def __init__(self, pool: _Optional[str] = ..., name: _Optional[str] = ..., value: _Optional[float] = ..., unit: _Optional[str] = ..., note: _Optional[str] = ...) -> None: ...

class PlanResponse(_message.Message):
    __slots__ = ("prefill", "decode", "prefill_raw", "decode_raw", "feasible", "terms", "reasoning", "applied", "traffic")
    PREFILL_FIELD_NUMBER: _ClassVar[int]
    DECODE_FIELD_NUMBER: _ClassVar[int]
    PREFILL_RAW_FIELD_NUMBER: _ClassVar[int]
    DECODE_RAW_FIELD_NUMBER: _ClassVar[int]
    FEASIBLE_FIELD_NUMBER: _ClassVar[int]
    TERMS_FIELD_NUMBER: _ClassVar[int]
    REASONING_FIELD_NUMBER: _ClassVar[int]
    APPLIED_FIELD_NUMBER: _ClassVar[int]
    TRAFFIC_FIELD_NUMBER: _ClassVar[int]
    prefill: int
    decode: int
    prefill_raw: int
    decode_raw: int
    feasible: bool
    terms: _containers.RepeatedCompositeFieldContainer[PlanTerm]
    reasoning: str
    applied: bool
    traffic: TrafficWindow
    def __init__(self, prefill: _Optional[int] = ..., decode: _Optional[int] = ..., prefill_raw: _Optional[int] = ..., decode_raw: _Optional[int] = ..., feasible: _Optional[bool] = ..., terms: _Optional[_Iterable[_Union[PlanTerm, _Mapping]]] = ..., reasoning: _Optional[str] = ..., applied: _Optional[bool] = ..., traffic: _Optional[_Union[TrafficWindow, _Mapping]] = ...) -> None: ...

class StoreProfileRequest(_message.Message):
    __slots__ = ("prefill_curve", "decode_curve", "measured_on")
    PREFILL_CURVE_FIELD_NUMBER: _ClassVar[int]
    DECODE_CURVE_FIELD_NUMBER: _ClassVar[int]
    MEASURED_ON_FIELD_NUMBER: _ClassVar[int]
    prefill_curve: PrefillCurve
    decode_curve: DecodeCurve
    measured_on: str
    def __init__(self, prefill_curve: _Optional[_Union[PrefillCurve, _Mapping]] = ..., decode_curve: _Optional[_Union[DecodeCurve, _Mapping]] = ..., measured_on: _Optional[str] = ...) -> None: ...

class StoreProfileResponse(_message.Message):
    __slots__ = ("keys",)
    KEYS_FIELD_NUMBER: _ClassVar[int]
    keys: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, keys: _Optional[_Iterable[str]] = ...) -> None: ...

class GetTrafficRequest(_message.Message):
    __slots__ = ("window_s",)
    WINDOW_S_FIELD_NUMBER: _ClassVar[int]
    window_s: float
    def __init__(self, window_s: _Optional[float] = ...) -> None: ...

class LatencyPercentiles(_message.Message):
    __slots__ = ("count", "p50_ms", "p90_ms", "p99_ms")
    COUNT_FIELD_NUMBER: _ClassVar[int]
    P50_MS_FIELD_NUMBER: _ClassVar[int]
    P90_MS_FIELD_NUMBER: _ClassVar[int]
    P99_MS_FIELD_NUMBER: _ClassVar[int]
    count: int
    p50_ms: float
    p90_ms: float
    p99_ms: float
    def __init__(self, count: _Optional[int] = ..., p50_ms: _Optional[float] = ..., p90_ms: _Optional[float] = ..., p99_ms: _Optional[float] = ...) -> None: ...

class TrafficWindow(_message.Message):
    __slots__ = ("window_s", "num_requests", "rate", "mean_isl", "mean_osl", "ttft", "itl")
    WINDOW_S_FIELD_NUMBER: _ClassVar[int]
    NUM_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    RATE_FIELD_NUMBER: _ClassVar[int]
    MEAN_ISL_FIELD_NUMBER: _ClassVar[int]
    MEAN_OSL_FIELD_NUMBER: _ClassVar[int]
    TTFT_FIELD_NUMBER: _ClassVar[int]
    ITL_FIELD_NUMBER: _ClassVar[int]
    window_s: float
    num_requests: int
    rate: float
    mean_isl: float
    mean_osl: float
    ttft: LatencyPercentiles
    itl: LatencyPercentiles
    def __init__(self, window_s: _Optional[float] = ..., num_requests: _Optional[int] = ..., rate: _Optional[float] = ..., mean_isl: _Optional[float] = ..., mean_osl: _Optional[float] = ..., ttft: _Optional[_Union[LatencyPercentiles, _Mapping]] = ..., itl: _Optional[_Union[LatencyPercentiles, _Mapping]] = ...) -> None: ...
