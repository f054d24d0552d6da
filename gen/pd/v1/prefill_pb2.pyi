from pd.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class PrefillRequest(_message.Message):
    __slots__ = ("request_id", "prompt_token_ids", "sampling", "push_bootstrap_id")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    PUSH_BOOTSTRAP_ID_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    sampling: _common_pb2.SamplingParams
    push_bootstrap_id: str
    def __init__(self, request_id: _Optional[str] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., sampling: _Optional[_Union[_common_pb2.SamplingParams, _Mapping]] = ..., push_bootstrap_id: _Optional[str] = ...) -> None: ...

class PrefillResponse(_message.Message):
    __slots__ = ("request_id", "first_token_id", "finish_reason", "kv_handle", "cached_tokens", "first_token_ids", "first_logprobs", "prompt_logprobs", "finish_reasons", "kv_pushed")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    FIRST_TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    KV_HANDLE_FIELD_NUMBER: _ClassVar[int]
    CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    FIRST_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    FIRST_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASONS_FIELD_NUMBER: _ClassVar[int]
    KV_PUSHED_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    first_token_id: int
    finish_reason: _common_pb2.FinishReason
    kv_handle: _common_pb2.KVHandle
    cached_tokens: int
    first_token_ids: _containers.RepeatedScalarFieldContainer[int]
    first_logprobs: _containers.RepeatedCompositeFieldContainer[_common_pb2.TokenLogprob]
    prompt_logprobs: _common_pb2.PromptLogprobs
    finish_reasons: _containers.RepeatedScalarFieldContainer[_common_pb2.FinishReason]
    kv_pushed: bool
    def __init__(self, request_id: _Optional[str] = ..., first_token_id: _Optional[int] = ..., finish_reason: _Optional[_Union[_common_pb2.FinishReason, str]] = ..., kv_handle: _Optional[_Union[_common_pb2.KVHandle, _Mapping]] = ..., cached_tokens: _Optional[int] = ..., first_token_ids: _Optional[_Iterable[int]] = ..., first_logprobs: _Optional[_Iterable[_Union[_common_pb2.TokenLogprob, _Mapping]]] = ..., prompt_logprobs: _Optional[_Union[_common_pb2.PromptLogprobs, _Mapping]] = ..., finish_reasons: _Optional[_Iterable[_Union[_common_pb2.FinishReason, str]]] = ..., kv_pushed: _Optional[bool] = ...) -> None: ...

class ReleaseKVRequest(_message.Message):
    __slots__ = ("transfer_id",)
    TRANSFER_ID_FIELD_NUMBER: _ClassVar[int]
    transfer_id: str
    def __init__(self, transfer_id: _Optional[str] = ...) -> None: ...

class ReleaseKVResponse(_message.Message):
    __slots__ = ("released",)
    RELEASED_FIELD_NUMBER: _ClassVar[int]
    released: bool
    def __init__(self, released: _Optional[bool] = ...) -> None: ...
