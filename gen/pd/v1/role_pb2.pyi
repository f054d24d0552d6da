from pd.v1 import common_pb2 as _common_pb2
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class SetRoleRequest(_message.Message):
    __slots__ = ("role", "drain_timeout_ms", "reason")
    ROLE_FIELD_NUMBER: _ClassVar[int]
    DRAIN_TIMEOUT_MS_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    role: _common_pb2.WorkerRole
    drain_timeout_ms: int
    reason: str
    def __init__(self, role: _Optional[_Union[_common_pb2.WorkerRole, str]] = ..., drain_timeout_ms: _Optional[int] = ..., reason: _Optional[str] = ...) -> None: ...

class SetRoleResponse(_message.Message):
    __slots__ = ("previous_role", "role", "drained", "draining_calls")
    PREVIOUS_ROLE_FIELD_NUMBER: _ClassVar[int]
    ROLE_FIELD_NUMBER: _ClassVar[int]
    DRAINED_FIELD_NUMBER: _ClassVar[int]
    DRAINING_CALLS_FIELD_NUMBER: _ClassVar[int]
    previous_role: _common_pb2.WorkerRole
    role: _common_pb2.WorkerRole
    drained: bool
    draining_calls: int
    def __init__(self, previous_role: _Optional[_Union[_common_pb2.WorkerRole, str]] = ..., role: _Optional[_Union[_common_pb2.WorkerRole, str]] = ..., drained: _Optional[bool] = ..., draining_calls: _Optional[int] = ...) -> None: ...

class GetRoleRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class GetRoleResponse(_message.Message):
    __slots__ = ("role", "draining_role", "prefill_calls", "decode_calls", "switches")
    ROLE_FIELD_NUMBER: _ClassVar[int]
    DRAINING_ROLE_FIELD_NUMBER: _ClassVar[int]
    PREFILL_CALLS_FIELD_NUMBER: _ClassVar[int]
    DECODE_CALLS_FIELD_NUMBER: _ClassVar[int]
    SWITCHES_FIELD_NUMBER: _ClassVar[int]
    role: _common_pb2.WorkerRole
    draining_role: _common_pb2.WorkerRole
    prefill_calls: int
    decode_calls: int
    switches: int
    def __init__(self, role: _Optional[_Union[_common_pb2.WorkerRole, str]] = ..., draining_role: _Optional[_Union[_common_pb2.WorkerRole, str]] = ..., prefill_calls: _Optional[int] = ..., decode_calls: _Optional[int] = ..., switches: _Optional[int] = ...) -> None: ...
