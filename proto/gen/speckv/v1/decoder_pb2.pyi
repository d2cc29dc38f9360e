from . import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class TransferState(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    TRANSFER_STATE_UNSPECIFIED: _ClassVar[TransferState]
    TRANSFER_STATE_RECEIVING: _ClassVar[TransferState]
    TRANSFER_STATE_READY: _ClassVar[TransferState]
    TRANSFER_STATE_FETCHED: _ClassVar[TransferState]
    TRANSFER_STATE_FAILED: _ClassVar[TransferState]
    TRANSFER_STATE_CANCELLED: _ClassVar[TransferState]
TRANSFER_STATE_UNSPECIFIED: TransferState
TRANSFER_STATE_RECEIVING: TransferState
TRANSFER_STATE_READY: TransferState
TRANSFER_STATE_FETCHED: TransferState
TRANSFER_STATE_FAILED: TransferState
TRANSFER_STATE_CANCELLED: TransferState

class TransferHeader(_message.Message):
    __slots__ = ("request_id", "predictor_pin", "model_id", "dtype", "shape", "prompt_token_ids", "header_record", "fp8_attention", "heads")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PREDICTOR_PIN_FIELD_NUMBER: _ClassVar[int]
    MODEL_ID_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    HEADER_RECORD_FIELD_NUMBER: _ClassVar[int]
    FP8_ATTENTION_FIELD_NUMBER: _ClassVar[int]
    HEADS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    predictor_pin: bytes
    model_id: str
    dtype: _common_pb2.Dtype
    shape: _common_pb2.KVShape
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    header_record: bytes
    fp8_attention: _common_pb2.Fp8Attention
    heads: _common_pb2.HeadRange
    def __init__(self, request_id: _Optional[str] = ..., predictor_pin: _Optional[bytes] = ..., model_id: _Optional[str] = ..., dtype: _Optional[_Union[_common_pb2.Dtype, str]] = ..., shape: _Optional[_Union[_common_pb2.KVShape, _Mapping]] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., header_record: _Optional[bytes] = ..., fp8_attention: _Optional[_Union[_common_pb2.Fp8Attention, _Mapping]] = ..., heads: _Optional[_Union[_common_pb2.HeadRange, _Mapping]] = ...) -> None: ...

class Chunk(_message.Message):
    __slots__ = ("index", "record", "byte_offset", "record_bytes", "stored_reason")
    INDEX_FIELD_NUMBER: _ClassVar[int]
    RECORD_FIELD_NUMBER: _ClassVar[int]
    BYTE_OFFSET_FIELD_NUMBER: _ClassVar[int]
    RECORD_BYTES_FIELD_NUMBER: _ClassVar[int]
    STORED_REASON_FIELD_NUMBER: _ClassVar[int]
    index: int
    record: bytes
    byte_offset: int
    record_bytes: int
    stored_reason: str
    def __init__(self, index: _Optional[int] = ..., record: _Optional[bytes] = ..., byte_offset: _Optional[int] = ..., record_bytes: _Optional[int] = ..., stored_reason: _Optional[str] = ...) -> None: ...

class TransferTrailer(_message.Message):
    __slots__ = ("raw_digest", "raw_bytes")
    RAW_DIGEST_FIELD_NUMBER: _ClassVar[int]
    RAW_BYTES_FIELD_NUMBER: _ClassVar[int]
    raw_digest: bytes
    raw_bytes: int
    def __init__(self, raw_digest: _Optional[bytes] = ..., raw_bytes: _Optional[int] = ...) -> None: ...

class Fallback(_message.Message):
    __slots__ = ("header_record", "reason")
    HEADER_RECORD_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    header_record: bytes
    reason: str
    def __init__(self, header_record: _Optional[bytes] = ..., reason: _Optional[str] = ...) -> None: ...

class TransferRequest(_message.Message):
    __slots__ = ("header", "chunk", "trailer", "fallback")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    CHUNK_FIELD_NUMBER: _ClassVar[int]
    TRAILER_FIELD_NUMBER: _ClassVar[int]
    FALLBACK_FIELD_NUMBER: _ClassVar[int]
    header: TransferHeader
    chunk: Chunk
    trailer: TransferTrailer
    fallback: Fallback
    def __init__(self, header: _Optional[_Union[TransferHeader, _Mapping]] = ..., chunk: _Optional[_Union[Chunk, _Mapping]] = ..., trailer: _Optional[_Union[TransferTrailer, _Mapping]] = ..., fallback: _Optional[_Union[Fallback, _Mapping]] = ...) -> None: ...

class ChunkAck(_message.Message):
    __slots__ = ("index", "bytes_received")
    INDEX_FIELD_NUMBER: _ClassVar[int]
    BYTES_RECEIVED_FIELD_NUMBER: _ClassVar[int]
    index: int
    bytes_received: int
    def __init__(self, index: _Optional[int] = ..., bytes_received: _Optional[int] = ...) -> None: ...

class TransferResult(_message.Message):
    __slots__ = ("status", "raw_bytes", "wire_bytes", "chunks", "predictor_seconds", "decode_seconds", "total_seconds", "encoding", "fallback", "stored_chunks", "mu_wait_seconds")
    STATUS_FIELD_NUMBER: _ClassVar[int]
    RAW_BYTES_FIELD_NUMBER: _ClassVar[int]
    WIRE_BYTES_FIELD_NUMBER: _ClassVar[int]
    CHUNKS_FIELD_NUMBER: _ClassVar[int]
    PREDICTOR_SECONDS_FIELD_NUMBER: _ClassVar[int]
    DECODE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    TOTAL_SECONDS_FIELD_NUMBER: _ClassVar[int]
    ENCODING_FIELD_NUMBER: _ClassVar[int]
    FALLBACK_FIELD_NUMBER: _ClassVar[int]
    STORED_CHUNKS_FIELD_NUMBER: _ClassVar[int]
    MU_WAIT_SECONDS_FIELD_NUMBER: _ClassVar[int]
    status: _common_pb2.Status
    raw_bytes: int
    wire_bytes: int
    chunks: int
    predictor_seconds: float
    decode_seconds: float
    total_seconds: float
    encoding: str
    fallback: bool
    stored_chunks: int
    mu_wait_seconds: float
    def __init__(self, status: _Optional[_Union[_common_pb2.Status, _Mapping]] = ..., raw_bytes: _Optional[int] = ..., wire_bytes: _Optional[int] = ..., chunks: _Optional[int] = ..., predictor_seconds: _Optional[float] = ..., decode_seconds: _Optional[float] = ..., total_seconds: _Optional[float] = ..., encoding: _Optional[str] = ..., fallback: _Optional[bool] = ..., stored_chunks: _Optional[int] = ..., mu_wait_seconds: _Optional[float] = ...) -> None: ...

class PredictorCheck(_message.Message):
    __slots__ = ("mu_digest", "chunk_index")
    MU_DIGEST_FIELD_NUMBER: _ClassVar[int]
    CHUNK_INDEX_FIELD_NUMBER: _ClassVar[int]
    mu_digest: bytes
    chunk_index: int
    def __init__(self, mu_digest: _Optional[bytes] = ..., chunk_index: _Optional[int] = ...) -> None: ...

class TransferResponse(_message.Message):
    __slots__ = ("chunk_ack", "result", "predictor")
    CHUNK_ACK_FIELD_NUMBER: _ClassVar[int]
    RESULT_FIELD_NUMBER: _ClassVar[int]
    PREDICTOR_FIELD_NUMBER: _ClassVar[int]
    chunk_ack: ChunkAck
    result: TransferResult
    predictor: PredictorCheck
    def __init__(self, chunk_ack: _Optional[_Union[ChunkAck, _Mapping]] = ..., result: _Optional[_Union[TransferResult, _Mapping]] = ..., predictor: _Optional[_Union[PredictorCheck, _Mapping]] = ...) -> None: ...

class FetchKVRequest(_message.Message):
    __slots__ = ("request_id", "wait_timeout_ms", "verified_only", "digest", "model_id", "heads", "token_start", "token_count", "local_mailbox")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    WAIT_TIMEOUT_MS_FIELD_NUMBER: _ClassVar[int]
    VERIFIED_ONLY_FIELD_NUMBER: _ClassVar[int]
    DIGEST_FIELD_NUMBER: _ClassVar[int]
    MODEL_ID_FIELD_NUMBER: _ClassVar[int]
    HEADS_FIELD_NUMBER: _ClassVar[int]
    TOKEN_START_FIELD_NUMBER: _ClassVar[int]
    TOKEN_COUNT_FIELD_NUMBER: _ClassVar[int]
    LOCAL_MAILBOX_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    wait_timeout_ms: int
    verified_only: bool
    digest: _common_pb2.DigestAlgorithm
    model_id: str
    heads: _common_pb2.HeadRange
    token_start: int
    token_count: int
    local_mailbox: str
    def __init__(self, request_id: _Optional[str] = ..., wait_timeout_ms: _Optional[int] = ..., verified_only: _Optional[bool] = ..., digest: _Optional[_Union[_common_pb2.DigestAlgorithm, str]] = ..., model_id: _Optional[str] = ..., heads: _Optional[_Union[_common_pb2.HeadRange, _Mapping]] = ..., token_start: _Optional[int] = ..., token_count: _Optional[int] = ..., local_mailbox: _Optional[str] = ...) -> None: ...

class LocalFetchLayer(_message.Message):
    __slots__ = ("memfd_id", "memfd_bytes", "layer", "dtype", "shape", "byte_offset", "layer_bytes", "fp8_scales")
    MEMFD_ID_FIELD_NUMBER: _ClassVar[int]
    MEMFD_BYTES_FIELD_NUMBER: _ClassVar[int]
    LAYER_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    BYTE_OFFSET_FIELD_NUMBER: _ClassVar[int]
    LAYER_BYTES_FIELD_NUMBER: _ClassVar[int]
    FP8_SCALES_FIELD_NUMBER: _ClassVar[int]
    memfd_id: str
    memfd_bytes: int
    layer: int
    dtype: _common_pb2.Dtype
    shape: _common_pb2.KVShape
    byte_offset: int
    layer_bytes: int
    fp8_scales: _containers.RepeatedScalarFieldContainer[float]
    def __init__(self, memfd_id: _Optional[str] = ..., memfd_bytes: _Optional[int] = ..., layer: _Optional[int] = ..., dtype: _Optional[_Union[_common_pb2.Dtype, str]] = ..., shape: _Optional[_Union[_common_pb2.KVShape, _Mapping]] = ..., byte_offset: _Optional[int] = ..., layer_bytes: _Optional[int] = ..., fp8_scales: _Optional[_Iterable[float]] = ...) -> None: ...

class FetchKVDone(_message.Message):
    __slots__ = ("raw_digest", "raw_bytes")
    RAW_DIGEST_FIELD_NUMBER: _ClassVar[int]
    RAW_BYTES_FIELD_NUMBER: _ClassVar[int]
    raw_digest: bytes
    raw_bytes: int
    def __init__(self, raw_digest: _Optional[bytes] = ..., raw_bytes: _Optional[int] = ...) -> None: ...

class FetchKVResponse(_message.Message):
    __slots__ = ("layer", "done", "local_layer", "digest")
    LAYER_FIELD_NUMBER: _ClassVar[int]
    DONE_FIELD_NUMBER: _ClassVar[int]
    LOCAL_LAYER_FIELD_NUMBER: _ClassVar[int]
    DIGEST_FIELD_NUMBER: _ClassVar[int]
    layer: _common_pb2.KVLayer
    done: FetchKVDone
    local_layer: LocalFetchLayer
    digest: _common_pb2.DigestAlgorithm
    def __init__(self, layer: _Optional[_Union[_common_pb2.KVLayer, _Mapping]] = ..., done: _Optional[_Union[FetchKVDone, _Mapping]] = ..., local_layer: _Optional[_Union[LocalFetchLayer, _Mapping]] = ..., digest: _Optional[_Union[_common_pb2.DigestAlgorithm, str]] = ...) -> None: ...

class TransferStatus(_message.Message):
    __slots__ = ("request_id", "state", "status", "chunks_received", "chunks_total", "chunks_decoded", "wire_bytes", "raw_bytes", "heads")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    STATUS_FIELD_NUMBER: _ClassVar[int]
    CHUNKS_RECEIVED_FIELD_NUMBER: _ClassVar[int]
    CHUNKS_TOTAL_FIELD_NUMBER: _ClassVar[int]
    CHUNKS_DECODED_FIELD_NUMBER: _ClassVar[int]
    WIRE_BYTES_FIELD_NUMBER: _ClassVar[int]
    RAW_BYTES_FIELD_NUMBER: _ClassVar[int]
    HEADS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    state: TransferState
    status: _common_pb2.Status
    chunks_received: int
    chunks_total: int
    chunks_decoded: int
    wire_bytes: int
    raw_bytes: int
    heads: _common_pb2.HeadRange
    def __init__(self, request_id: _Optional[str] = ..., state: _Optional[_Union[TransferState, str]] = ..., status: _Optional[_Union[_common_pb2.Status, _Mapping]] = ..., chunks_received: _Optional[int] = ..., chunks_total: _Optional[int] = ..., chunks_decoded: _Optional[int] = ..., wire_bytes: _Optional[int] = ..., raw_bytes: _Optional[int] = ..., heads: _Optional[_Union[_common_pb2.HeadRange, _Mapping]] = ...) -> None: ...

class GetTransferStatusRequest(_message.Message):
    __slots__ = ("request_id", "heads")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    HEADS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    heads: _common_pb2.HeadRange
    def __init__(self, request_id: _Optional[str] = ..., heads: _Optional[_Union[_common_pb2.HeadRange, _Mapping]] = ...) -> None: ...

class GetTransferStatusResponse(_message.Message):
    __slots__ = ("status",)
    STATUS_FIELD_NUMBER: _ClassVar[int]
    status: TransferStatus
    def __init__(self, status: _Optional[_Union[TransferStatus, _Mapping]] = ...) -> None: ...

class CancelTransferRequest(_message.Message):
    __slots__ = ("request_id", "heads")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    HEADS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    heads: _common_pb2.HeadRange
    def __init__(self, request_id: _Optional[str] = ..., heads: _Optional[_Union[_common_pb2.HeadRange, _Mapping]] = ...) -> None: ...

class CancelTransferResponse(_message.Message):
    __slots__ = ("status",)
    STATUS_FIELD_NUMBER: _ClassVar[int]
    status: TransferStatus
    def __init__(self, status: _Optional[_Union[TransferStatus, _Mapping]] = ...) -> None: ...
