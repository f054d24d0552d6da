from pd.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class StoreStatus(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    STORE_STATUS_UNSPECIFIED: _ClassVar[StoreStatus]
    STORE_STATUS_OK: _ClassVar[StoreStatus]
    STORE_STATUS_NOT_FOUND: _ClassVar[StoreStatus]
    STORE_STATUS_NOT_READY: _ClassVar[StoreStatus]
    STORE_STATUS_ALREADY_EXISTS: _ClassVar[StoreStatus]
    STORE_STATUS_NO_SPACE: _ClassVar[StoreStatus]
    STORE_STATUS_HAS_LEASE: _ClassVar[StoreStatus]
    STORE_STATUS_LEASE_EXPIRED: _ClassVar[StoreStatus]
    STORE_STATUS_INVALID: _ClassVar[StoreStatus]
    STORE_STATUS_NO_SEGMENT: _ClassVar[StoreStatus]
    STORE_STATUS_WRITE_REVOKED: _ClassVar[StoreStatus]

class ObjectState(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    OBJECT_STATE_UNSPECIFIED: _ClassVar[ObjectState]
    OBJECT_STATE_PROCESSING: _ClassVar[ObjectState]
    OBJECT_STATE_COMPLETE: _ClassVar[ObjectState]
    OBJECT_STATE_REMOVED: _ClassVar[ObjectState]
STORE_STATUS_UNSPECIFIED: StoreStatus
STORE_STATUS_OK: StoreStatus
STORE_STATUS_NOT_FOUND: StoreStatus
STORE_STATUS_NOT_READY: StoreStatus
STORE_STATUS_ALREADY_EXISTS: StoreStatus
STORE_STATUS_NO_SPACE: StoreStatus
STORE_STATUS_HAS_LEASE: StoreStatus
STORE_STATUS_LEASE_EXPIRED: StoreStatus
STORE_STATUS_INVALID: StoreStatus
STORE_STATUS_NO_SEGMENT: StoreStatus
STORE_STATUS_WRITE_REVOKED: StoreStatus
OBJECT_STATE_UNSPECIFIED: ObjectState
OBJECT_STATE_PROCESSING: ObjectState
OBJECT_STATE_COMPLETE: ObjectState
OBJECT_STATE_REMOVED: ObjectState

class Replica(_message.Message):
    __slots__ = ("node_id", "endpoint", "offset", "size")
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    ENDPOINT_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    SIZE_FIELD_NUMBER: _ClassVar[int]
    node_id: str
    endpoint: str
    offset: int
    size: int
    def __init__(self, node_id: _Optional[str] = ..., endpoint: _Optional[str] = ..., offset: _Optional[int] = ..., size: _Optional[int] = ...) -> None: ...

class MountSegmentRequest(_message.Message):
    __slots__ = ("node_id", "endpoint", "size")
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    ENDPOINT_FIELD_NUMBER: _ClassVar[int]
    SIZE_FIELD_NUMBER: _ClassVar[int]
    node_id: str
    endpoint: str
    size: int
    def __init__(self, node_id: _Optional[str] = ..., endpoint: _Optional[str] = ..., size: _Optional[int] = ...) -> None: ...

class MountSegmentResponse(_message.Message):
    __slots__ = ("heartbeat_interval_ms", "heartbeat_timeout_ms")
    HEARTBEAT_INTERVAL_MS_FIELD_NUMBER: _ClassVar[int]
    HEARTBEAT_TIMEOUT_MS_FIELD_NUMBER: _ClassVar[int]
    heartbeat_interval_ms: int
    heartbeat_timeout_ms: int
    def __init__(self, heartbeat_interval_ms: _Optional[int] = ..., heartbeat_timeout_ms: _Optional[int] = ...) -> None: ...

class UnmountSegmentRequest(_message.Message):
    __slots__ = ("node_id",)
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    node_id: str
    def __init__(self, node_id: _Optional[str] = ...) -> None: ...

class UnmountSegmentResponse(_message.Message):
    __slots__ = ("replicas_dropped",)
    REPLICAS_DROPPED_FIELD_NUMBER: _ClassVar[int]
    replicas_dropped: int
    def __init__(self, replicas_dropped: _Optional[int] = ...) -> None: ...

class HeartbeatRequest(_message.Message):
    __slots__ = ("node_id",)
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    node_id: str
    def __init__(self, node_id: _Optional[str] = ...) -> None: ...

class HeartbeatResponse(_message.Message):
    __slots__ = ("known",)
    KNOWN_FIELD_NUMBER: _ClassVar[int]
    known: bool
    def __init__(self, known: _Optional[bool] = ...) -> None: ...

class PutStartRequest(_message.Message):
    __slots__ = ("key", "size", "replicas")
    KEY_FIELD_NUMBER: _ClassVar[int]
    SIZE_FIELD_NUMBER: _ClassVar[int]
    REPLICAS_FIELD_NUMBER: _ClassVar[int]
    key: str
    size: int
    replicas: int
    def __init__(self, key: _Optional[str] = ..., size: _Optional[int] = ..., replicas: _Optional[int] = ...) -> None: ...

class PutStartResponse(_message.Message):
    __slots__ = ("key", "status", "put_id", "replicas", "detail")
    KEY_FIELD_NUMBER: _ClassVar[int]
    STATUS_FIELD_NUMBER: _ClassVar[int]
    PUT_ID_FIELD_NUMBER: _ClassVar[int]
    REPLICAS_FIELD_NUMBER: _ClassVar[int]
    DETAIL_FIELD_NUMBER: _ClassVar[int]
    key: str
    status: StoreStatus
    put_id: int
    replicas: _containers.RepeatedCompositeFieldContainer[Replica]
    detail: str
    def __init__(self, key: _Optional[str] = ..., status: _Optional[_Union[StoreStatus, str]] = ..., put_id: _Optional[int] = ..., replicas: _Optional[_Iterable[_Union[Replica, _Mapping]]] = ..., detail: _Optional[str] = ...) -> None: ...

class PutEndRequest(_message.Message):
    __slots__ = ("key", "put_id", "checksum")
    KEY_FIELD_NUMBER: _ClassVar[int]
    PUT_ID_FIELD_NUMBER: _ClassVar[int]
    CHECKSUM_FIELD_NUMBER: _ClassVar[int]
    key: str
    put_id: int
    checksum: int
    def __init__(self, key: _Optional[str] = ..., put_id: _Optional[int] = ..., checksum: _Optional[int] = ...) -> None: ...

class PutEndResponse(_message.Message):
    __slots__ = ("key", "status", "detail")
    KEY_FIELD_NUMBER: _ClassVar[int]
    STATUS_FIELD_NUMBER: _ClassVar[int]
    DETAIL_FIELD_NUMBER: _ClassVar[int]
    key: str
    status: StoreStatus
    detail: str
    def __init__(self, key: _Optional[str] = ..., status: _Optional[_Union[StoreStatus, str]] = ..., detail: _Optional[str] = ...) -> None: ...

class PutRevokeRequest(_message.Message):
    __slots__ = ("key", "put_id", "failed_node_ids")
    KEY_FIELD_NUMBER: _ClassVar[int]
    PUT_ID_FIELD_NUMBER: _ClassVar[int]
    FAILED_NODE_IDS_FIELD_NUMBER: _ClassVar[int]
    key: str
    put_id: int
    failed_node_ids: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, key: _Optional[str] = ..., put_id: _Optional[int] = ..., failed_node_ids: _Optional[_Iterable[str]] = ...) -> None: ...

class PutRevokeResponse(_message.Message):
    __slots__ = ("key", "status", "detail")
    KEY_FIELD_NUMBER: _ClassVar[int]
    STATUS_FIELD_NUMBER: _ClassVar[int]
    DETAIL_FIELD_NUMBER: _ClassVar[int]
    key: str
    status: StoreStatus
    detail: str
    def __init__(self, key: _Optional[str] = ..., status: _Optional[_Union[StoreStatus, str]] = ..., detail: _Optional[str] = ...) -> None: ...

class GetReplicaListRequest(_message.Message):
    __slots__ = ("key",)
    KEY_FIELD_NUMBER: _ClassVar[int]
    key: str
    def __init__(self, key: _Optional[str] = ...) -> None: ...

class GetReplicaListResponse(_message.Message):
    __slots__ = ("key", "status", "replicas", "size", "checksum", "lease_ms", "detail", "state")
    KEY_FIELD_NUMBER: _ClassVar[int]
    STATUS_FIELD_NUMBER: _ClassVar[int]
    REPLICAS_FIELD_NUMBER: _ClassVar[int]
    SIZE_FIELD_NUMBER: _ClassVar[int]
    CHECKSUM_FIELD_NUMBER: _ClassVar[int]
    LEASE_MS_FIELD_NUMBER: _ClassVar[int]
    DETAIL_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    key: str
    status: StoreStatus
    replicas: _containers.RepeatedCompositeFieldContainer[Replica]
    size: int
    checksum: int
    lease_ms: int
    detail: str
    state: ObjectState
    def __init__(self, key: _Optional[str] = ..., status: _Optional[_Union[StoreStatus, str]] = ..., replicas: _Optional[_Iterable[_Union[Replica, _Mapping]]] = ..., size: _Optional[int] = ..., checksum: _Optional[int] = ..., lease_ms: _Optional[int] = ..., detail: _Optional[str] = ..., state: _Optional[_Union[ObjectState, str]] = ...) -> None: ...

class ExistRequest(_message.Message):
    __slots__ = ("key",)
    KEY_FIELD_NUMBER: _ClassVar[int]
    key: str
    def __init__(self, key: _Optional[str] = ...) -> None: ...

class ExistResponse(_message.Message):
    __slots__ = ("exists",)
    EXISTS_FIELD_NUMBER: _ClassVar[int]
    exists: bool
    def __init__(self, exists: _Optional[bool] = ...) -> None: ...

class RemoveRequest(_message.Message):
    __slots__ = ("key", "ignore_lease")
    KEY_FIELD_NUMBER: _ClassVar[int]
    IGNORE_LEASE_FIELD_NUMBER: _ClassVar[int]
    key: str
    ignore_lease: bool
    def __init__(self, key: _Optional[str] = ..., ignore_lease: _Optional[bool] = ...) -> None: ...

class RemoveResponse(_message.Message):
    __slots__ = ("key", "status", "detail")
    KEY_FIELD_NUMBER: _ClassVar[int]
    STATUS_FIELD_NUMBER: _ClassVar[int]
    DETAIL_FIELD_NUMBER: _ClassVar[int]
    key: str
    status: StoreStatus
    detail: str
    def __init__(self, key: _Optional[str] = ..., status: _Optional[_Union[StoreStatus, str]] = ..., detail: _Optional[str] = ...) -> None: ...

class BatchPutStartRequest(_message.Message):
    __slots__ = ("keys", "size", "replicas")
    KEYS_FIELD_NUMBER: _ClassVar[int]
    SIZE_FIELD_NUMBER: _ClassVar[int]
    REPLICAS_FIELD_NUMBER: _ClassVar[int]
    keys: _containers.RepeatedScalarFieldContainer[str]
    size: int
    replicas: int
    def __init__(self, keys: _Optional[_Iterable[str]] = ..., size: _Optional[int] = ..., replicas: _Optional[int] = ...) -> None: ...

class BatchPutStartResponse(_message.Message):
    __slots__ = ("results",)
    RESULTS_FIELD_NUMBER: _ClassVar[int]
    results: _containers.RepeatedCompositeFieldContainer[PutStartResponse]
    def __init__(self, results: _Optional[_Iterable[_Union[PutStartResponse, _Mapping]]] = ...) -> None: ...

class BatchPutEndRequest(_message.Message):
    __slots__ = ("items",)
    ITEMS_FIELD_NUMBER: _ClassVar[int]
    items: _containers.RepeatedCompositeFieldContainer[PutEndRequest]
    def __init__(self, items: _Optional[_Iterable[_Union[PutEndRequest, _Mapping]]] = ...) -> None: ...

class BatchPutEndResponse(_message.Message):
    __slots__ = ("results",)
    RESULTS_FIELD_NUMBER: _ClassVar[int]
    results: _containers.RepeatedCompositeFieldContainer[PutEndResponse]
    def __init__(self, results: _Optional[_Iterable[_Union[PutEndResponse, _Mapping]]] = ...) -> None: ...

class BatchPutRevokeRequest(_message.Message):
    __slots__ = ("items",)
    ITEMS_FIELD_NUMBER: _ClassVar[int]
    items: _containers.RepeatedCompositeFieldContainer[PutRevokeRequest]
    def __init__(self, items: _Optional[_Iterable[_Union[PutRevokeRequest, _Mapping]]] = ...) -> None: ...

class BatchPutRevokeResponse(_message.Message):
    __slots__ = ("results",)
    RESULTS_FIELD_NUMBER: _ClassVar[int]
    results: _containers.RepeatedCompositeFieldContainer[PutRevokeResponse]
    def __init__(self, results: _Optional[_Iterable[_Union[PutRevokeResponse, _Mapping]]] = ...) -> None: ...

class BatchGetReplicaListRequest(_message.Message):
    __slots__ = ("keys", "prefix")
    KEYS_FIELD_NUMBER: _ClassVar[int]
    PREFIX_FIELD_NUMBER: _ClassVar[int]
    keys: _containers.RepeatedScalarFieldContainer[str]
    prefix: bool
    def __init__(self, keys: _Optional[_Iterable[str]] = ..., prefix: _Optional[bool] = ...) -> None: ...

class BatchGetReplicaListResponse(_message.Message):
    __slots__ = ("results",)
    RESULTS_FIELD_NUMBER: _ClassVar[int]
    results: _containers.RepeatedCompositeFieldContainer[GetReplicaListResponse]
    def __init__(self, results: _Optional[_Iterable[_Union[GetReplicaListResponse, _Mapping]]] = ...) -> None: ...

class BatchExistRequest(_message.Message):
    __slots__ = ("keys",)
    KEYS_FIELD_NUMBER: _ClassVar[int]
    keys: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, keys: _Optional[_Iterable[str]] = ...) -> None: ...

class BatchExistResponse(_message.Message):
    __slots__ = ("exists",)
    EXISTS_FIELD_NUMBER: _ClassVar[int]
    exists: _containers.RepeatedScalarFieldContainer[bool]
    def __init__(self, exists: _Optional[_Iterable[bool]] = ...) -> None: ...
