from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class Dtype(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    DTYPE_UNSPECIFIED: _ClassVar[Dtype]
    DTYPE_BF16: _ClassVar[Dtype]
    DTYPE_FP8_E4M3: _ClassVar[Dtype]

class DigestAlgorithm(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    DIGEST_ALGORITHM_UNSPECIFIED: _ClassVar[DigestAlgorithm]
    DIGEST_ALGORITHM_BLAKE2B_128: _ClassVar[DigestAlgorithm]
    DIGEST_ALGORITHM_XXH3_128: _ClassVar[DigestAlgorithm]

class Fp8Rounding(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    FP8_ROUNDING_UNSPECIFIED: _ClassVar[Fp8Rounding]
    FP8_ROUNDING_NEAREST: _ClassVar[Fp8Rounding]
    FP8_ROUNDING_TOWARD_ZERO: _ClassVar[Fp8Rounding]

class StatusCode(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    STATUS_CODE_UNSPECIFIED: _ClassVar[StatusCode]
    STATUS_CODE_OK: _ClassVar[StatusCode]
    STATUS_CODE_INVALID_ARGUMENT: _ClassVar[StatusCode]
    STATUS_CODE_PIN_MISMATCH: _ClassVar[StatusCode]
    STATUS_CODE_MODEL_MISMATCH: _ClassVar[StatusCode]
    STATUS_CODE_FORMAT_ERROR: _ClassVar[StatusCode]
    STATUS_CODE_CHECKSUM_ERROR: _ClassVar[StatusCode]
    STATUS_CODE_TRUNCATED: _ClassVar[StatusCode]
    STATUS_CODE_MU_MISMATCH: _ClassVar[StatusCode]
    STATUS_CODE_PROMPT_MISMATCH: _ClassVar[StatusCode]
    STATUS_CODE_INTEGRITY_ERROR: _ClassVar[StatusCode]
    STATUS_CODE_ALREADY_EXISTS: _ClassVar[StatusCode]
    STATUS_CODE_NOT_FOUND: _ClassVar[StatusCode]
    STATUS_CODE_CANCELLED: _ClassVar[StatusCode]
    STATUS_CODE_DEADLINE_EXCEEDED: _ClassVar[StatusCode]
    STATUS_CODE_UNAVAILABLE: _ClassVar[StatusCode]
    STATUS_CODE_RESOURCE_EXHAUSTED: _ClassVar[StatusCode]
    STATUS_CODE_INTERNAL: _ClassVar[StatusCode]
    STATUS_CODE_FAILED_PRECONDITION: _ClassVar[StatusCode]
DTYPE_UNSPECIFIED: Dtype
DTYPE_BF16: Dtype
DTYPE_FP8_E4M3: Dtype
DIGEST_ALGORITHM_UNSPECIFIED: DigestAlgorithm
DIGEST_ALGORITHM_BLAKE2B_128: DigestAlgorithm
DIGEST_ALGORITHM_XXH3_128: DigestAlgorithm
FP8_ROUNDING_UNSPECIFIED: Fp8Rounding
FP8_ROUNDING_NEAREST: Fp8Rounding
FP8_ROUNDING_TOWARD_ZERO: Fp8Rounding
STATUS_CODE_UNSPECIFIED: StatusCode
STATUS_CODE_OK: StatusCode
STATUS_CODE_INVALID_ARGUMENT: StatusCode
STATUS_CODE_PIN_MISMATCH: StatusCode
STATUS_CODE_MODEL_MISMATCH: StatusCode
STATUS_CODE_FORMAT_ERROR: StatusCode
STATUS_CODE_CHECKSUM_ERROR: StatusCode
STATUS_CODE_TRUNCATED: StatusCode
STATUS_CODE_MU_MISMATCH: StatusCode
STATUS_CODE_PROMPT_MISMATCH: StatusCode
STATUS_CODE_INTEGRITY_ERROR: StatusCode
STATUS_CODE_ALREADY_EXISTS: StatusCode
STATUS_CODE_NOT_FOUND: StatusCode
STATUS_CODE_CANCELLED: StatusCode
STATUS_CODE_DEADLINE_EXCEEDED: StatusCode
STATUS_CODE_UNAVAILABLE: StatusCode
STATUS_CODE_RESOURCE_EXHAUSTED: StatusCode
STATUS_CODE_INTERNAL: StatusCode
STATUS_CODE_FAILED_PRECONDITION: StatusCode

class KVShape(_message.Message):
    __slots__ = ("layers", "kv", "kv_heads", "tokens", "head_dim")
    LAYERS_FIELD_NUMBER: _ClassVar[int]
    KV_FIELD_NUMBER: _ClassVar[int]
    KV_HEADS_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    HEAD_DIM_FIELD_NUMBER: _ClassVar[int]
    layers: int
    kv: int
    kv_heads: int
    tokens: int
    head_dim: int
    def __init__(self, layers: _Optional[int] = ..., kv: _Optional[int] = ..., kv_heads: _Optional[int] = ..., tokens: _Optional[int] = ..., head_dim: _Optional[int] = ...) -> None: ...

class KVLayer(_message.Message):
    __slots__ = ("layer", "dtype", "shape", "part_index", "part_count", "byte_offset", "layer_bytes", "data", "fp8_scales", "token_start", "token_count")
    LAYER_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    PART_INDEX_FIELD_NUMBER: _ClassVar[int]
    PART_COUNT_FIELD_NUMBER: _ClassVar[int]
    BYTE_OFFSET_FIELD_NUMBER: _ClassVar[int]
    LAYER_BYTES_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    FP8_SCALES_FIELD_NUMBER: _ClassVar[int]
    TOKEN_START_FIELD_NUMBER: _ClassVar[int]
    TOKEN_COUNT_FIELD_NUMBER: _ClassVar[int]
    layer: int
    dtype: Dtype
    shape: KVShape
    part_index: int
    part_count: int
    byte_offset: int
    layer_bytes: int
    data: bytes
    fp8_scales: _containers.RepeatedScalarFieldContainer[float]
    token_start: int
    token_count: int
    def __init__(self, layer: _Optional[int] = ..., dtype: _Optional[_Union[Dtype, str]] = ..., shape: _Optional[_Union[KVShape, _Mapping]] = ..., part_index: _Optional[int] = ..., part_count: _Optional[int] = ..., byte_offset: _Optional[int] = ..., layer_bytes: _Optional[int] = ..., data: _Optional[bytes] = ..., fp8_scales: _Optional[_Iterable[float]] = ..., token_start: _Optional[int] = ..., token_count: _Optional[int] = ...) -> None: ...

class Fp8Attention(_message.Message):
    __slots__ = ("k_scales", "v_scales", "rounding", "amx_tiles")
    K_SCALES_FIELD_NUMBER: _ClassVar[int]
    V_SCALES_FIELD_NUMBER: _ClassVar[int]
    ROUNDING_FIELD_NUMBER: _ClassVar[int]
    AMX_TILES_FIELD_NUMBER: _ClassVar[int]
    k_scales: _containers.RepeatedScalarFieldContainer[float]
    v_scales: _containers.RepeatedScalarFieldContainer[float]
    rounding: Fp8Rounding
    amx_tiles: bool
    def __init__(self, k_scales: _Optional[_Iterable[float]] = ..., v_scales: _Optional[_Iterable[float]] = ..., rounding: _Optional[_Union[Fp8Rounding, str]] = ..., amx_tiles: _Optional[bool] = ...) -> None: ...

class HeadRange(_message.Message):
    __slots__ = ("start", "count", "total")
    START_FIELD_NUMBER: _ClassVar[int]
    COUNT_FIELD_NUMBER: _ClassVar[int]
    TOTAL_FIELD_NUMBER: _ClassVar[int]
    start: int
    count: int
    total: int
    def __init__(self, start: _Optional[int] = ..., count: _Optional[int] = ..., total: _Optional[int] = ...) -> None: ...

class Status(_message.Message):
    __slots__ = ("code", "message", "reason")
    CODE_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    code: StatusCode
    message: str
    reason: str
    def __init__(self, code: _Optional[_Union[StatusCode, str]] = ..., message: _Optional[str] = ..., reason: _Optional[str] = ...) -> None: ...
