from pagedserve.v1 import generation_pb2 as _generation_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class Submit(_message.Message):
    __slots__ = ("request_id", "prompt_token_ids", "sampling", "priority", "cache_salt", "follows", "generated_token_ids", "cache_ttl_seconds", "tenant")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    PRIORITY_FIELD_NUMBER: _ClassVar[int]
    CACHE_SALT_FIELD_NUMBER: _ClassVar[int]
    FOLLOWS_FIELD_NUMBER: _ClassVar[int]
    GENERATED_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    CACHE_TTL_SECONDS_FIELD_NUMBER: _ClassVar[int]
    TENANT_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    sampling: _generation_pb2.SamplingParams
    priority: int
    cache_salt: str
    follows: str
    generated_token_ids: _containers.RepeatedScalarFieldContainer[int]
    cache_ttl_seconds: int
    tenant: str
    def __init__(self, request_id: _Optional[str] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., sampling: _Optional[_Union[_generation_pb2.SamplingParams, _Mapping]] = ..., priority: _Optional[int] = ..., cache_salt: _Optional[str] = ..., follows: _Optional[str] = ..., generated_token_ids: _Optional[_Iterable[int]] = ..., cache_ttl_seconds: _Optional[int] = ..., tenant: _Optional[str] = ...) -> None: ...

class WorkerRequest(_message.Message):
    __slots__ = ("submit", "abort")
    SUBMIT_FIELD_NUMBER: _ClassVar[int]
    ABORT_FIELD_NUMBER: _ClassVar[int]
    submit: _containers.RepeatedCompositeFieldContainer[Submit]
    abort: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, submit: _Optional[_Iterable[_Union[Submit, _Mapping]]] = ..., abort: _Optional[_Iterable[str]] = ...) -> None: ...

class RequestOutput(_message.Message):
    __slots__ = ("request_id", "token_ids", "logprobs", "finish_reason", "prompt_tokens", "cached_prompt_tokens", "error", "error_code", "prompt_logprobs")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    CACHED_PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    ERROR_CODE_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    logprobs: _containers.RepeatedCompositeFieldContainer[_generation_pb2.TokenLogprobs]
    finish_reason: _generation_pb2.GenerateResponse.FinishReason
    prompt_tokens: int
    cached_prompt_tokens: int
    error: str
    error_code: int
    prompt_logprobs: _containers.RepeatedCompositeFieldContainer[_generation_pb2.TokenLogprobs]
    def __init__(self, request_id: _Optional[str] = ..., token_ids: _Optional[_Iterable[int]] = ..., logprobs: _Optional[_Iterable[_Union[_generation_pb2.TokenLogprobs, _Mapping]]] = ..., finish_reason: _Optional[_Union[_generation_pb2.GenerateResponse.FinishReason, str]] = ..., prompt_tokens: _Optional[int] = ..., cached_prompt_tokens: _Optional[int] = ..., error: _Optional[str] = ..., error_code: _Optional[int] = ..., prompt_logprobs: _Optional[_Iterable[_Union[_generation_pb2.TokenLogprobs, _Mapping]]] = ...) -> None: ...

class StepOutputs(_message.Message):
    __slots__ = ("outputs", "load")
    OUTPUTS_FIELD_NUMBER: _ClassVar[int]
    LOAD_FIELD_NUMBER: _ClassVar[int]
    outputs: _containers.RepeatedCompositeFieldContainer[RequestOutput]
    load: Load
    def __init__(self, outputs: _Optional[_Iterable[_Union[RequestOutput, _Mapping]]] = ..., load: _Optional[_Union[Load, _Mapping]] = ...) -> None: ...

class GetLoadRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class Load(_message.Message):
    __slots__ = ("running", "waiting", "kv_pages_in_use", "kv_pages_total", "unavailable")
    RUNNING_FIELD_NUMBER: _ClassVar[int]
    WAITING_FIELD_NUMBER: _ClassVar[int]
    KV_PAGES_IN_USE_FIELD_NUMBER: _ClassVar[int]
    KV_PAGES_TOTAL_FIELD_NUMBER: _ClassVar[int]
    UNAVAILABLE_FIELD_NUMBER: _ClassVar[int]
    running: int
    waiting: int
    kv_pages_in_use: int
    kv_pages_total: int
    unavailable: str
    def __init__(self, running: _Optional[int] = ..., waiting: _Optional[int] = ..., kv_pages_in_use: _Optional[int] = ..., kv_pages_total: _Optional[int] = ..., unavailable: _Optional[str] = ...) -> None: ...

class GetInfoRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class WorkerInfo(_message.Message):
    __slots__ = ("model_id", "model_dir", "max_model_len", "vocab_size", "eos_token_ids", "dtype", "device", "page_size", "worker_name", "kv_cache_dtype", "kv_namespace")
    MODEL_ID_FIELD_NUMBER: _ClassVar[int]
    MODEL_DIR_FIELD_NUMBER: _ClassVar[int]
    MAX_MODEL_LEN_FIELD_NUMBER: _ClassVar[int]
    VOCAB_SIZE_FIELD_NUMBER: _ClassVar[int]
    EOS_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    PAGE_SIZE_FIELD_NUMBER: _ClassVar[int]
    WORKER_NAME_FIELD_NUMBER: _ClassVar[int]
    KV_CACHE_DTYPE_FIELD_NUMBER: _ClassVar[int]
    KV_NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    model_id: str
    model_dir: str
    max_model_len: int
    vocab_size: int
    eos_token_ids: _containers.RepeatedScalarFieldContainer[int]
    dtype: str
    device: str
    page_size: int
    worker_name: str
    kv_cache_dtype: str
    kv_namespace: str
    def __init__(self, model_id: _Optional[str] = ..., model_dir: _Optional[str] = ..., max_model_len: _Optional[int] = ..., vocab_size: _Optional[int] = ..., eos_token_ids: _Optional[_Iterable[int]] = ..., dtype: _Optional[str] = ..., device: _Optional[str] = ..., page_size: _Optional[int] = ..., worker_name: _Optional[str] = ..., kv_cache_dtype: _Optional[str] = ..., kv_namespace: _Optional[str] = ...) -> None: ...
