from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class Medium(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    MEDIUM_POOL: _ClassVar[Medium]
    MEDIUM_DISK: _ClassVar[Medium]
    MEDIUM_HOST: _ClassVar[Medium]
MEDIUM_POOL: Medium
MEDIUM_DISK: Medium
MEDIUM_HOST: Medium

class PoolShape(_message.Message):
    __slots__ = ("num_layers", "num_kv_heads", "head_dim", "dtype", "page_size")
    NUM_LAYERS_FIELD_NUMBER: _ClassVar[int]
    NUM_KV_HEADS_FIELD_NUMBER: _ClassVar[int]
    HEAD_DIM_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    PAGE_SIZE_FIELD_NUMBER: _ClassVar[int]
    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: str
    page_size: int
    def __init__(self, num_layers: _Optional[int] = ..., num_kv_heads: _Optional[int] = ..., head_dim: _Optional[int] = ..., dtype: _Optional[str] = ..., page_size: _Optional[int] = ...) -> None: ...

class AttachRequest(_message.Message):
    __slots__ = ("worker_name", "model_id", "shape", "num_pages", "memory_bytes", "device")
    WORKER_NAME_FIELD_NUMBER: _ClassVar[int]
    MODEL_ID_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    NUM_PAGES_FIELD_NUMBER: _ClassVar[int]
    MEMORY_BYTES_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    worker_name: str
    model_id: str
    shape: PoolShape
    num_pages: int
    memory_bytes: int
    device: str
    def __init__(self, worker_name: _Optional[str] = ..., model_id: _Optional[str] = ..., shape: _Optional[_Union[PoolShape, _Mapping]] = ..., num_pages: _Optional[int] = ..., memory_bytes: _Optional[int] = ..., device: _Optional[str] = ...) -> None: ...

class SharedMemory(_message.Message):
    __slots__ = ("path",)
    PATH_FIELD_NUMBER: _ClassVar[int]
    path: str
    def __init__(self, path: _Optional[str] = ...) -> None: ...

class CudaIpc(_message.Message):
    __slots__ = ("ipc_handle", "offset", "device_uuid")
    IPC_HANDLE_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    DEVICE_UUID_FIELD_NUMBER: _ClassVar[int]
    ipc_handle: bytes
    offset: int
    device_uuid: str
    def __init__(self, ipc_handle: _Optional[bytes] = ..., offset: _Optional[int] = ..., device_uuid: _Optional[str] = ...) -> None: ...

class PoolDescriptor(_message.Message):
    __slots__ = ("pool_id", "shape", "num_pages", "nbytes", "shm", "cuda")
    POOL_ID_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    NUM_PAGES_FIELD_NUMBER: _ClassVar[int]
    NBYTES_FIELD_NUMBER: _ClassVar[int]
    SHM_FIELD_NUMBER: _ClassVar[int]
    CUDA_FIELD_NUMBER: _ClassVar[int]
    pool_id: int
    shape: PoolShape
    num_pages: int
    nbytes: int
    shm: SharedMemory
    cuda: CudaIpc
    def __init__(self, pool_id: _Optional[int] = ..., shape: _Optional[_Union[PoolShape, _Mapping]] = ..., num_pages: _Optional[int] = ..., nbytes: _Optional[int] = ..., shm: _Optional[_Union[SharedMemory, _Mapping]] = ..., cuda: _Optional[_Union[CudaIpc, _Mapping]] = ...) -> None: ...

class Attached(_message.Message):
    __slots__ = ("lease_id", "worker_id", "pool", "refill_pages", "lower_tier", "pin_budget_pages")
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    POOL_FIELD_NUMBER: _ClassVar[int]
    REFILL_PAGES_FIELD_NUMBER: _ClassVar[int]
    LOWER_TIER_FIELD_NUMBER: _ClassVar[int]
    PIN_BUDGET_PAGES_FIELD_NUMBER: _ClassVar[int]
    lease_id: str
    worker_id: int
    pool: PoolDescriptor
    refill_pages: int
    lower_tier: bool
    pin_budget_pages: int
    def __init__(self, lease_id: _Optional[str] = ..., worker_id: _Optional[int] = ..., pool: _Optional[_Union[PoolDescriptor, _Mapping]] = ..., refill_pages: _Optional[int] = ..., lower_tier: _Optional[bool] = ..., pin_budget_pages: _Optional[int] = ...) -> None: ...

class Reclaim(_message.Message):
    __slots__ = ("pages",)
    PAGES_FIELD_NUMBER: _ClassVar[int]
    pages: int
    def __init__(self, pages: _Optional[int] = ...) -> None: ...

class AttachEvent(_message.Message):
    __slots__ = ("attached", "reclaim")
    ATTACHED_FIELD_NUMBER: _ClassVar[int]
    RECLAIM_FIELD_NUMBER: _ClassVar[int]
    attached: Attached
    reclaim: Reclaim
    def __init__(self, attached: _Optional[_Union[Attached, _Mapping]] = ..., reclaim: _Optional[_Union[Reclaim, _Mapping]] = ...) -> None: ...

class LeaseRequest(_message.Message):
    __slots__ = ("lease_id", "need", "consumed", "idle")
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    NEED_FIELD_NUMBER: _ClassVar[int]
    CONSUMED_FIELD_NUMBER: _ClassVar[int]
    IDLE_FIELD_NUMBER: _ClassVar[int]
    lease_id: str
    need: int
    consumed: int
    idle: int
    def __init__(self, lease_id: _Optional[str] = ..., need: _Optional[int] = ..., consumed: _Optional[int] = ..., idle: _Optional[int] = ...) -> None: ...

class LeaseResponse(_message.Message):
    __slots__ = ("pages", "refill_pages", "free_pages")
    PAGES_FIELD_NUMBER: _ClassVar[int]
    REFILL_PAGES_FIELD_NUMBER: _ClassVar[int]
    FREE_PAGES_FIELD_NUMBER: _ClassVar[int]
    pages: _containers.RepeatedScalarFieldContainer[int]
    refill_pages: int
    free_pages: int
    def __init__(self, pages: _Optional[_Iterable[int]] = ..., refill_pages: _Optional[int] = ..., free_pages: _Optional[int] = ...) -> None: ...

class PublishedPage(_message.Message):
    __slots__ = ("key", "page", "parent", "token_ids")
    KEY_FIELD_NUMBER: _ClassVar[int]
    PAGE_FIELD_NUMBER: _ClassVar[int]
    PARENT_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    key: bytes
    page: int
    parent: bytes
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, key: _Optional[bytes] = ..., page: _Optional[int] = ..., parent: _Optional[bytes] = ..., token_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class UpdateRequest(_message.Message):
    __slots__ = ("lease_id", "publish", "unref", "release", "idle", "pin")
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    PUBLISH_FIELD_NUMBER: _ClassVar[int]
    UNREF_FIELD_NUMBER: _ClassVar[int]
    RELEASE_FIELD_NUMBER: _ClassVar[int]
    IDLE_FIELD_NUMBER: _ClassVar[int]
    PIN_FIELD_NUMBER: _ClassVar[int]
    lease_id: str
    publish: _containers.RepeatedCompositeFieldContainer[PublishedPage]
    unref: _containers.RepeatedScalarFieldContainer[int]
    release: _containers.RepeatedScalarFieldContainer[int]
    idle: int
    pin: _containers.RepeatedCompositeFieldContainer[PinRequest]
    def __init__(self, lease_id: _Optional[str] = ..., publish: _Optional[_Iterable[_Union[PublishedPage, _Mapping]]] = ..., unref: _Optional[_Iterable[int]] = ..., release: _Optional[_Iterable[int]] = ..., idle: _Optional[int] = ..., pin: _Optional[_Iterable[_Union[PinRequest, _Mapping]]] = ...) -> None: ...

class PinRequest(_message.Message):
    __slots__ = ("keys", "ttl_seconds", "tenant")
    KEYS_FIELD_NUMBER: _ClassVar[int]
    TTL_SECONDS_FIELD_NUMBER: _ClassVar[int]
    TENANT_FIELD_NUMBER: _ClassVar[int]
    keys: _containers.RepeatedScalarFieldContainer[bytes]
    ttl_seconds: int
    tenant: str
    def __init__(self, keys: _Optional[_Iterable[bytes]] = ..., ttl_seconds: _Optional[int] = ..., tenant: _Optional[str] = ...) -> None: ...

class CheckPinsRequest(_message.Message):
    __slots__ = ("lease_id", "tenant", "pages", "keys")
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    TENANT_FIELD_NUMBER: _ClassVar[int]
    PAGES_FIELD_NUMBER: _ClassVar[int]
    KEYS_FIELD_NUMBER: _ClassVar[int]
    lease_id: str
    tenant: str
    pages: int
    keys: _containers.RepeatedScalarFieldContainer[bytes]
    def __init__(self, lease_id: _Optional[str] = ..., tenant: _Optional[str] = ..., pages: _Optional[int] = ..., keys: _Optional[_Iterable[bytes]] = ...) -> None: ...

class CheckPinsResponse(_message.Message):
    __slots__ = ("room",)
    ROOM_FIELD_NUMBER: _ClassVar[int]
    room: int
    def __init__(self, room: _Optional[int] = ...) -> None: ...

class UpdateResponse(_message.Message):
    __slots__ = ("free_pages",)
    FREE_PAGES_FIELD_NUMBER: _ClassVar[int]
    free_pages: int
    def __init__(self, free_pages: _Optional[int] = ...) -> None: ...

class LookupRequest(_message.Message):
    __slots__ = ("lease_id", "keys")
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    KEYS_FIELD_NUMBER: _ClassVar[int]
    lease_id: str
    keys: _containers.RepeatedScalarFieldContainer[bytes]
    def __init__(self, lease_id: _Optional[str] = ..., keys: _Optional[_Iterable[bytes]] = ...) -> None: ...

class LookupResponse(_message.Message):
    __slots__ = ("pages",)
    PAGES_FIELD_NUMBER: _ClassVar[int]
    pages: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, pages: _Optional[_Iterable[int]] = ...) -> None: ...

class PrefetchRequest(_message.Message):
    __slots__ = ("lease_id", "keys")
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    KEYS_FIELD_NUMBER: _ClassVar[int]
    lease_id: str
    keys: _containers.RepeatedScalarFieldContainer[bytes]
    def __init__(self, lease_id: _Optional[str] = ..., keys: _Optional[_Iterable[bytes]] = ...) -> None: ...

class PrefetchResponse(_message.Message):
    __slots__ = ("promoted", "cached")
    PROMOTED_FIELD_NUMBER: _ClassVar[int]
    CACHED_FIELD_NUMBER: _ClassVar[int]
    promoted: int
    cached: int
    def __init__(self, promoted: _Optional[int] = ..., cached: _Optional[int] = ...) -> None: ...

class GetStatsRequest(_message.Message):
    __slots__ = ("check_invariants",)
    CHECK_INVARIANTS_FIELD_NUMBER: _ClassVar[int]
    check_invariants: bool
    def __init__(self, check_invariants: _Optional[bool] = ...) -> None: ...

class WorkerUsage(_message.Message):
    __slots__ = ("worker_id", "name", "model_id", "leased_pages", "idle_pages", "referenced_pages", "refill_pages")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    MODEL_ID_FIELD_NUMBER: _ClassVar[int]
    LEASED_PAGES_FIELD_NUMBER: _ClassVar[int]
    IDLE_PAGES_FIELD_NUMBER: _ClassVar[int]
    REFERENCED_PAGES_FIELD_NUMBER: _ClassVar[int]
    REFILL_PAGES_FIELD_NUMBER: _ClassVar[int]
    worker_id: int
    name: str
    model_id: str
    leased_pages: int
    idle_pages: int
    referenced_pages: int
    refill_pages: int
    def __init__(self, worker_id: _Optional[int] = ..., name: _Optional[str] = ..., model_id: _Optional[str] = ..., leased_pages: _Optional[int] = ..., idle_pages: _Optional[int] = ..., referenced_pages: _Optional[int] = ..., refill_pages: _Optional[int] = ...) -> None: ...

class PublisherUsage(_message.Message):
    __slots__ = ("worker_id", "name", "model_id", "cached_pages")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    MODEL_ID_FIELD_NUMBER: _ClassVar[int]
    CACHED_PAGES_FIELD_NUMBER: _ClassVar[int]
    worker_id: int
    name: str
    model_id: str
    cached_pages: int
    def __init__(self, worker_id: _Optional[int] = ..., name: _Optional[str] = ..., model_id: _Optional[str] = ..., cached_pages: _Optional[int] = ...) -> None: ...

class PoolStats(_message.Message):
    __slots__ = ("pool_id", "shape", "total_pages", "free_pages", "leased_pages", "shared_pages", "cached_pages", "evictable_pages", "evictions", "prefix_lookups", "prefix_hits", "prefix_queried_pages", "prefix_hit_pages", "workers", "storage", "publishers", "pinned_pages", "pin_budget_pages", "tenant_pin_budget_pages", "pins_refused", "tenants")
    POOL_ID_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    TOTAL_PAGES_FIELD_NUMBER: _ClassVar[int]
    FREE_PAGES_FIELD_NUMBER: _ClassVar[int]
    LEASED_PAGES_FIELD_NUMBER: _ClassVar[int]
    SHARED_PAGES_FIELD_NUMBER: _ClassVar[int]
    CACHED_PAGES_FIELD_NUMBER: _ClassVar[int]
    EVICTABLE_PAGES_FIELD_NUMBER: _ClassVar[int]
    EVICTIONS_FIELD_NUMBER: _ClassVar[int]
    PREFIX_LOOKUPS_FIELD_NUMBER: _ClassVar[int]
    PREFIX_HITS_FIELD_NUMBER: _ClassVar[int]
    PREFIX_QUERIED_PAGES_FIELD_NUMBER: _ClassVar[int]
    PREFIX_HIT_PAGES_FIELD_NUMBER: _ClassVar[int]
    WORKERS_FIELD_NUMBER: _ClassVar[int]
    STORAGE_FIELD_NUMBER: _ClassVar[int]
    PUBLISHERS_FIELD_NUMBER: _ClassVar[int]
    PINNED_PAGES_FIELD_NUMBER: _ClassVar[int]
    PIN_BUDGET_PAGES_FIELD_NUMBER: _ClassVar[int]
    TENANT_PIN_BUDGET_PAGES_FIELD_NUMBER: _ClassVar[int]
    PINS_REFUSED_FIELD_NUMBER: _ClassVar[int]
    TENANTS_FIELD_NUMBER: _ClassVar[int]
    pool_id: int
    shape: PoolShape
    total_pages: int
    free_pages: int
    leased_pages: int
    shared_pages: int
    cached_pages: int
    evictable_pages: int
    evictions: int
    prefix_lookups: int
    prefix_hits: int
    prefix_queried_pages: int
    prefix_hit_pages: int
    workers: _containers.RepeatedCompositeFieldContainer[WorkerUsage]
    storage: str
    publishers: _containers.RepeatedCompositeFieldContainer[PublisherUsage]
    pinned_pages: int
    pin_budget_pages: int
    tenant_pin_budget_pages: int
    pins_refused: int
    tenants: _containers.RepeatedCompositeFieldContainer[TenantPins]
    def __init__(self, pool_id: _Optional[int] = ..., shape: _Optional[_Union[PoolShape, _Mapping]] = ..., total_pages: _Optional[int] = ..., free_pages: _Optional[int] = ..., leased_pages: _Optional[int] = ..., shared_pages: _Optional[int] = ..., cached_pages: _Optional[int] = ..., evictable_pages: _Optional[int] = ..., evictions: _Optional[int] = ..., prefix_lookups: _Optional[int] = ..., prefix_hits: _Optional[int] = ..., prefix_queried_pages: _Optional[int] = ..., prefix_hit_pages: _Optional[int] = ..., workers: _Optional[_Iterable[_Union[WorkerUsage, _Mapping]]] = ..., storage: _Optional[str] = ..., publishers: _Optional[_Iterable[_Union[PublisherUsage, _Mapping]]] = ..., pinned_pages: _Optional[int] = ..., pin_budget_pages: _Optional[int] = ..., tenant_pin_budget_pages: _Optional[int] = ..., pins_refused: _Optional[int] = ..., tenants: _Optional[_Iterable[_Union[TenantPins, _Mapping]]] = ...) -> None: ...

class TenantPins(_message.Message):
    __slots__ = ("tenant", "pinned_pages")
    TENANT_FIELD_NUMBER: _ClassVar[int]
    PINNED_PAGES_FIELD_NUMBER: _ClassVar[int]
    tenant: str
    pinned_pages: int
    def __init__(self, tenant: _Optional[str] = ..., pinned_pages: _Optional[int] = ...) -> None: ...

class TierStats(_message.Message):
    __slots__ = ("capacity_bytes", "pages", "bytes", "demotions", "promotions", "bytes_written", "bytes_read", "promote_seconds", "dropped", "rejected")
    CAPACITY_BYTES_FIELD_NUMBER: _ClassVar[int]
    PAGES_FIELD_NUMBER: _ClassVar[int]
    BYTES_FIELD_NUMBER: _ClassVar[int]
    DEMOTIONS_FIELD_NUMBER: _ClassVar[int]
    PROMOTIONS_FIELD_NUMBER: _ClassVar[int]
    BYTES_WRITTEN_FIELD_NUMBER: _ClassVar[int]
    BYTES_READ_FIELD_NUMBER: _ClassVar[int]
    PROMOTE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    DROPPED_FIELD_NUMBER: _ClassVar[int]
    REJECTED_FIELD_NUMBER: _ClassVar[int]
    capacity_bytes: int
    pages: int
    bytes: int
    demotions: int
    promotions: int
    bytes_written: int
    bytes_read: int
    promote_seconds: float
    dropped: int
    rejected: int
    def __init__(self, capacity_bytes: _Optional[int] = ..., pages: _Optional[int] = ..., bytes: _Optional[int] = ..., demotions: _Optional[int] = ..., promotions: _Optional[int] = ..., bytes_written: _Optional[int] = ..., bytes_read: _Optional[int] = ..., promote_seconds: _Optional[float] = ..., dropped: _Optional[int] = ..., rejected: _Optional[int] = ...) -> None: ...

class DaemonStats(_message.Message):
    __slots__ = ("pools", "disk", "host")
    POOLS_FIELD_NUMBER: _ClassVar[int]
    DISK_FIELD_NUMBER: _ClassVar[int]
    HOST_FIELD_NUMBER: _ClassVar[int]
    pools: _containers.RepeatedCompositeFieldContainer[PoolStats]
    disk: TierStats
    host: TierStats
    def __init__(self, pools: _Optional[_Iterable[_Union[PoolStats, _Mapping]]] = ..., disk: _Optional[_Union[TierStats, _Mapping]] = ..., host: _Optional[_Union[TierStats, _Mapping]] = ...) -> None: ...

class DropPublishedRequest(_message.Message):
    __slots__ = ("worker_id", "worker_name", "pool_id")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    WORKER_NAME_FIELD_NUMBER: _ClassVar[int]
    POOL_ID_FIELD_NUMBER: _ClassVar[int]
    worker_id: int
    worker_name: str
    pool_id: int
    def __init__(self, worker_id: _Optional[int] = ..., worker_name: _Optional[str] = ..., pool_id: _Optional[int] = ...) -> None: ...

class DropPublishedResponse(_message.Message):
    __slots__ = ("pages",)
    PAGES_FIELD_NUMBER: _ClassVar[int]
    pages: int
    def __init__(self, pages: _Optional[int] = ...) -> None: ...

class WatchPrefixIndexRequest(_message.Message):
    __slots__ = ("model_id", "after_sequence")
    MODEL_ID_FIELD_NUMBER: _ClassVar[int]
    AFTER_SEQUENCE_FIELD_NUMBER: _ClassVar[int]
    model_id: str
    after_sequence: int
    def __init__(self, model_id: _Optional[str] = ..., after_sequence: _Optional[int] = ...) -> None: ...

class CachedPage(_message.Message):
    __slots__ = ("key", "parent", "token_ids")
    KEY_FIELD_NUMBER: _ClassVar[int]
    PARENT_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    key: bytes
    parent: bytes
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, key: _Optional[bytes] = ..., parent: _Optional[bytes] = ..., token_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class PrefixIndexChange(_message.Message):
    __slots__ = ("stored", "removed", "cleared", "medium")
    STORED_FIELD_NUMBER: _ClassVar[int]
    REMOVED_FIELD_NUMBER: _ClassVar[int]
    CLEARED_FIELD_NUMBER: _ClassVar[int]
    MEDIUM_FIELD_NUMBER: _ClassVar[int]
    stored: CachedPage
    removed: bytes
    cleared: bool
    medium: Medium
    def __init__(self, stored: _Optional[_Union[CachedPage, _Mapping]] = ..., removed: _Optional[bytes] = ..., cleared: _Optional[bool] = ..., medium: _Optional[_Union[Medium, str]] = ...) -> None: ...

class PrefixIndexBatch(_message.Message):
    __slots__ = ("sequence", "timestamp", "changes")
    SEQUENCE_FIELD_NUMBER: _ClassVar[int]
    TIMESTAMP_FIELD_NUMBER: _ClassVar[int]
    CHANGES_FIELD_NUMBER: _ClassVar[int]
    sequence: int
    timestamp: float
    changes: _containers.RepeatedCompositeFieldContainer[PrefixIndexChange]
    def __init__(self, sequence: _Optional[int] = ..., timestamp: _Optional[float] = ..., changes: _Optional[_Iterable[_Union[PrefixIndexChange, _Mapping]]] = ...) -> None: ...

class FlushPrefixIndexRequest(_message.Message):
    __slots__ = ("model_id",)
    MODEL_ID_FIELD_NUMBER: _ClassVar[int]
    model_id: str
    def __init__(self, model_id: _Optional[str] = ...) -> None: ...

class FlushPrefixIndexResponse(_message.Message):
    __slots__ = ("pages",)
    PAGES_FIELD_NUMBER: _ClassVar[int]
    pages: int
    def __init__(self, pages: _Optional[int] = ...) -> None: ...
