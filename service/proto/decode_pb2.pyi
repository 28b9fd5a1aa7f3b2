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
FINISH_REASON_UNSPECIFIED: FinishReason
FINISH_REASON_STOP: FinishReason
FINISH_REASON_LENGTH: FinishReason

class TokenIds(_message.Message):
    __slots__ = ("ids",)
    IDS_FIELD_NUMBER: _ClassVar[int]
    ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, ids: _Optional[_Iterable[int]] = ...) -> None: ...

class SamplingParams(_message.Message):
    __slots__ = ("temperature", "top_k", "top_p", "seed")
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    temperature: float
    top_k: int
    top_p: float
    seed: int
    def __init__(self, temperature: _Optional[float] = ..., top_k: _Optional[int] = ..., top_p: _Optional[float] = ..., seed: _Optional[int] = ...) -> None: ...

class GenerateRequest(_message.Message):
    __slots__ = ("request_id", "text", "token_ids", "max_tokens", "sampling", "stop_strings", "stop_token_ids", "no_prefix_cache", "ignore_eos", "min_tokens")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    MAX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    STOP_STRINGS_FIELD_NUMBER: _ClassVar[int]
    STOP_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    NO_PREFIX_CACHE_FIELD_NUMBER: _ClassVar[int]
    IGNORE_EOS_FIELD_NUMBER: _ClassVar[int]
    MIN_TOKENS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    text: str
    token_ids: TokenIds
    max_tokens: int
    sampling: SamplingParams
    stop_strings: _containers.RepeatedScalarFieldContainer[str]
    stop_token_ids: _containers.RepeatedScalarFieldContainer[int]
    no_prefix_cache: bool
    ignore_eos: bool
    min_tokens: int
    def __init__(self, request_id: _Optional[str] = ..., text: _Optional[str] = ..., token_ids: _Optional[_Union[TokenIds, _Mapping]] = ..., max_tokens: _Optional[int] = ..., sampling: _Optional[_Union[SamplingParams, _Mapping]] = ..., stop_strings: _Optional[_Iterable[str]] = ..., stop_token_ids: _Optional[_Iterable[int]] = ..., no_prefix_cache: _Optional[bool] = ..., ignore_eos: _Optional[bool] = ..., min_tokens: _Optional[int] = ...) -> None: ...

class Usage(_message.Message):
    __slots__ = ("input_tokens", "output_tokens")
    INPUT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    OUTPUT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    input_tokens: int
    output_tokens: int
    def __init__(self, input_tokens: _Optional[int] = ..., output_tokens: _Optional[int] = ...) -> None: ...

class GenerateResponse(_message.Message):
    __slots__ = ("request_id", "index", "token_ids", "text", "finish_reason", "usage", "step", "batch_size")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    INDEX_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    USAGE_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    BATCH_SIZE_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    index: int
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    text: str
    finish_reason: FinishReason
    usage: Usage
    step: int
    batch_size: int
    def __init__(self, request_id: _Optional[str] = ..., index: _Optional[int] = ..., token_ids: _Optional[_Iterable[int]] = ..., text: _Optional[str] = ..., finish_reason: _Optional[_Union[FinishReason, str]] = ..., usage: _Optional[_Union[Usage, _Mapping]] = ..., step: _Optional[int] = ..., batch_size: _Optional[int] = ...) -> None: ...

class GenerateUnaryResponse(_message.Message):
    __slots__ = ("request_id", "token_ids", "text", "finish_reason", "usage")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    USAGE_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    text: str
    finish_reason: FinishReason
    usage: Usage
    def __init__(self, request_id: _Optional[str] = ..., token_ids: _Optional[_Iterable[int]] = ..., text: _Optional[str] = ..., finish_reason: _Optional[_Union[FinishReason, str]] = ..., usage: _Optional[_Union[Usage, _Mapping]] = ...) -> None: ...

class TokenizeRequest(_message.Message):
    __slots__ = ("text",)
    TEXT_FIELD_NUMBER: _ClassVar[int]
    text: str
    def __init__(self, text: _Optional[str] = ...) -> None: ...

class TokenizeResponse(_message.Message):
    __slots__ = ("token_ids",)
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class ModelInfoRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ModelInfoResponse(_message.Message):
    __slots__ = ("model_name", "max_seq_len", "batch_slots", "max_queue", "vocab_size", "eos_token_ids", "default_max_tokens", "tensor_parallel", "allreduce_strategy", "ready", "active_slots", "queue_depth", "kv_tokens", "kv_block_size", "step_tokens", "kv_blocks_held", "startup", "startup_done", "startup_total", "compile_cache", "weights", "kv_cache")
    MODEL_NAME_FIELD_NUMBER: _ClassVar[int]
    MAX_SEQ_LEN_FIELD_NUMBER: _ClassVar[int]
    BATCH_SLOTS_FIELD_NUMBER: _ClassVar[int]
    MAX_QUEUE_FIELD_NUMBER: _ClassVar[int]
    VOCAB_SIZE_FIELD_NUMBER: _ClassVar[int]
    EOS_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    DEFAULT_MAX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TENSOR_PARALLEL_FIELD_NUMBER: _ClassVar[int]
    ALLREDUCE_STRATEGY_FIELD_NUMBER: _ClassVar[int]
    READY_FIELD_NUMBER: _ClassVar[int]
    ACTIVE_SLOTS_FIELD_NUMBER: _ClassVar[int]
    QUEUE_DEPTH_FIELD_NUMBER: _ClassVar[int]
    KV_TOKENS_FIELD_NUMBER: _ClassVar[int]
    KV_BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    STEP_TOKENS_FIELD_NUMBER: _ClassVar[int]
    KV_BLOCKS_HELD_FIELD_NUMBER: _ClassVar[int]
    STARTUP_FIELD_NUMBER: _ClassVar[int]
    STARTUP_DONE_FIELD_NUMBER: _ClassVar[int]
    STARTUP_TOTAL_FIELD_NUMBER: _ClassVar[int]
    COMPILE_CACHE_FIELD_NUMBER: _ClassVar[int]
    WEIGHTS_FIELD_NUMBER: _ClassVar[int]
    KV_CACHE_FIELD_NUMBER: _ClassVar[int]
    model_name: str
    max_seq_len: int
    batch_slots: int
    max_queue: int
    vocab_size: int
    eos_token_ids: _containers.RepeatedScalarFieldContainer[int]
    default_max_tokens: int
    tensor_parallel: int
    allreduce_strategy: str
    ready: bool
    active_slots: int
    queue_depth: int
    kv_tokens: int
    kv_block_size: int
    step_tokens: int
    kv_blocks_held: int
    startup: str
    startup_done: int
    startup_total: int
    compile_cache: str
    weights: str
    kv_cache: str
    def __init__(self, model_name: _Optional[str] = ..., max_seq_len: _Optional[int] = ..., batch_slots: _Optional[int] = ..., max_queue: _Optional[int] = ..., vocab_size: _Optional[int] = ..., eos_token_ids: _Optional[_Iterable[int]] = ..., default_max_tokens: _Optional[int] = ..., tensor_parallel: _Optional[int] = ..., allreduce_strategy: _Optional[str] = ..., ready: _Optional[bool] = ..., active_slots: _Optional[int] = ..., queue_depth: _Optional[int] = ..., kv_tokens: _Optional[int] = ..., kv_block_size: _Optional[int] = ..., step_tokens: _Optional[int] = ..., kv_blocks_held: _Optional[int] = ..., startup: _Optional[str] = ..., startup_done: _Optional[int] = ..., startup_total: _Optional[int] = ..., compile_cache: _Optional[str] = ..., weights: _Optional[str] = ..., kv_cache: _Optional[str] = ...) -> None: ...

class GetTracesRequest(_message.Message):
    __slots__ = ("request_id", "limit")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    LIMIT_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    limit: int
    def __init__(self, request_id: _Optional[str] = ..., limit: _Optional[int] = ...) -> None: ...

class RequestTrace(_message.Message):
    __slots__ = ("request_id", "model", "prompt_tokens", "finish_reason", "start_unix_nano", "queue_seconds", "prefill_seconds", "duration_seconds", "token_seconds", "token_steps", "token_batch_sizes", "max_tokens", "chunk_seconds", "chunk_steps", "chunk_tokens", "cached_tokens", "preemptions")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    START_UNIX_NANO_FIELD_NUMBER: _ClassVar[int]
    QUEUE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    PREFILL_SECONDS_FIELD_NUMBER: _ClassVar[int]
    DURATION_SECONDS_FIELD_NUMBER: _ClassVar[int]
    TOKEN_SECONDS_FIELD_NUMBER: _ClassVar[int]
    TOKEN_STEPS_FIELD_NUMBER: _ClassVar[int]
    TOKEN_BATCH_SIZES_FIELD_NUMBER: _ClassVar[int]
    MAX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    CHUNK_SECONDS_FIELD_NUMBER: _ClassVar[int]
    CHUNK_STEPS_FIELD_NUMBER: _ClassVar[int]
    CHUNK_TOKENS_FIELD_NUMBER: _ClassVar[int]
    CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PREEMPTIONS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    model: str
    prompt_tokens: int
    finish_reason: str
    start_unix_nano: int
    queue_seconds: float
    prefill_seconds: float
    duration_seconds: float
    token_seconds: _containers.RepeatedScalarFieldContainer[float]
    token_steps: _containers.RepeatedScalarFieldContainer[int]
    token_batch_sizes: _containers.RepeatedScalarFieldContainer[int]
    max_tokens: int
    chunk_seconds: _containers.RepeatedScalarFieldContainer[float]
    chunk_steps: _containers.RepeatedScalarFieldContainer[int]
    chunk_tokens: _containers.RepeatedScalarFieldContainer[int]
    cached_tokens: int
    preemptions: int
    def __init__(self, request_id: _Optional[str] = ..., model: _Optional[str] = ..., prompt_tokens: _Optional[int] = ..., finish_reason: _Optional[str] = ..., start_unix_nano: _Optional[int] = ..., queue_seconds: _Optional[float] = ..., prefill_seconds: _Optional[float] = ..., duration_seconds: _Optional[float] = ..., token_seconds: _Optional[_Iterable[float]] = ..., token_steps: _Optional[_Iterable[int]] = ..., token_batch_sizes: _Optional[_Iterable[int]] = ..., max_tokens: _Optional[int] = ..., chunk_seconds: _Optional[_Iterable[float]] = ..., chunk_steps: _Optional[_Iterable[int]] = ..., chunk_tokens: _Optional[_Iterable[int]] = ..., cached_tokens: _Optional[int] = ..., preemptions: _Optional[int] = ...) -> None: ...

class GetTracesResponse(_message.Message):
    __slots__ = ("traces",)
    TRACES_FIELD_NUMBER: _ClassVar[int]
    traces: _containers.RepeatedCompositeFieldContainer[RequestTrace]
    def __init__(self, traces: _Optional[_Iterable[_Union[RequestTrace, _Mapping]]] = ...) -> None: ...
