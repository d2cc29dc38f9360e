from . import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class Encoding(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    ENCODING_UNSPECIFIED: _ClassVar[Encoding]
    ENCODING_SPECKV: _ClassVar[Encoding]
    ENCODING_STORED: _ClassVar[Encoding]
ENCODING_UNSPECIFIED: Encoding
ENCODING_SPECKV: Encoding
ENCODING_STORED: Encoding

class SubmitHeader(_message.Message):
    __slots__ = ("request_id", "decoder_address", "model_id", "dtype", "shape", "prompt_token_ids", "fp8_scales", "expected_predictor_pin", "encoding", "fp8_attention", "heads")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    DECODER_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    MODEL_ID_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    FP8_SCALES_FIELD_NUMBER: _ClassVar[int]
    EXPECTED_PREDICTOR_PIN_FIELD_NUMBER: _ClassVar[int]
    ENCODING_FIELD_NUMBER: _ClassVar[int]
    FP8_ATTENTION_FIELD_NUMBER: _ClassVar[int]
    HEADS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    decoder_address: str
    model_id: str
    dtype: _common_pb2.Dtype
    shape: _common_pb2.KVShape
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    fp8_scales: _containers.RepeatedScalarFieldContainer[float]
    expected_predictor_pin: bytes
    encoding: Encoding
    fp8_attention: _common_pb2.Fp8Attention
    heads: _common_pb2.HeadRange
    def __init__(self, request_id: _Optional[str] = ..., decoder_address: _Optional[str] = ..., model_id: _Optional[str] = ..., dtype: _Optional[_Union[_common_pb2.Dtype, str]] = ..., shape: _Optional[_Union[_common_pb2.KVShape, _Mapping]] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., fp8_scales: _Optional[_Iterable[float]] = ..., expected_predictor_pin: _Optional[bytes] = ..., encoding: _Optional[_Union[Encoding, str]] = ..., fp8_attention: _Optional[_Union[_common_pb2.Fp8Attention, _Mapping]] = ..., heads: _Optional[_Union[_common_pb2.HeadRange, _Mapping]] = ...) -> None: ...

class SubmitRequest(_message.Message):
    __slots__ = ("header", "layer", "local_layer")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    LAYER_FIELD_NUMBER: _ClassVar[int]
    LOCAL_LAYER_FIELD_NUMBER: _ClassVar[int]
    header: SubmitHeader
    layer: _common_pb2.KVLayer
    local_layer: LocalLayer
    def __init__(self, header: _Optional[_Union[SubmitHeader, _Mapping]] = ..., layer: _Optional[_Union[_common_pb2.KVLayer, _Mapping]] = ..., local_layer: _Optional[_Union[LocalLayer, _Mapping]] = ...) -> None: ...

class LocalLayer(_message.Message):
    __slots__ = ("handle", "layer", "byte_offset", "layer_bytes", "fp8_scales")
    HANDLE_FIELD_NUMBER: _ClassVar[int]
    LAYER_FIELD_NUMBER: _ClassVar[int]
    BYTE_OFFSET_FIELD_NUMBER: _ClassVar[int]
    LAYER_BYTES_FIELD_NUMBER: _ClassVar[int]
    FP8_SCALES_FIELD_NUMBER: _ClassVar[int]
    handle: str
    layer: int
    byte_offset: int
    layer_bytes: int
    fp8_scales: _containers.RepeatedScalarFieldContainer[float]
    def __init__(self, handle: _Optional[str] = ..., layer: _Optional[int] = ..., byte_offset: _Optional[int] = ..., layer_bytes: _Optional[int] = ..., fp8_scales: _Optional[_Iterable[float]] = ...) -> None: ...

class SubmitResponse(_message.Message):
    __slots__ = ("status", "raw_bytes", "wire_bytes", "chunks", "predictor_seconds", "encode_seconds", "transfer_seconds", "total_seconds", "message_bytes", "encoding", "fallback", "stored_chunks", "mu_wait_seconds", "wire_wait_seconds", "chunk_timings")
    STATUS_FIELD_NUMBER: _ClassVar[int]
    RAW_BYTES_FIELD_NUMBER: _ClassVar[int]
    WIRE_BYTES_FIELD_NUMBER: _ClassVar[int]
    CHUNKS_FIELD_NUMBER: _ClassVar[int]
    PREDICTOR_SECONDS_FIELD_NUMBER: _ClassVar[int]
    ENCODE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    TRANSFER_SECONDS_FIELD_NUMBER: _ClassVar[int]
    TOTAL_SECONDS_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_BYTES_FIELD_NUMBER: _ClassVar[int]
    ENCODING_FIELD_NUMBER: _ClassVar[int]
    FALLBACK_FIELD_NUMBER: _ClassVar[int]
    STORED_CHUNKS_FIELD_NUMBER: _ClassVar[int]
    MU_WAIT_SECONDS_FIELD_NUMBER: _ClassVar[int]
    WIRE_WAIT_SECONDS_FIELD_NUMBER: _ClassVar[int]
    CHUNK_TIMINGS_FIELD_NUMBER: _ClassVar[int]
    status: _common_pb2.Status
    raw_bytes: int
    wire_bytes: int
    chunks: int
    predictor_seconds: float
    encode_seconds: float
    transfer_seconds: float
    total_seconds: float
    message_bytes: int
    encoding: str
    fallback: bool
    stored_chunks: int
    mu_wait_seconds: float
    wire_wait_seconds: float
    chunk_timings: _containers.RepeatedCompositeFieldContainer[ChunkTiming]
    def __init__(self, status: _Optional[_Union[_common_pb2.Status, _Mapping]] = ..., raw_bytes: _Optional[int] = ..., wire_bytes: _Optional[int] = ..., chunks: _Optional[int] = ..., predictor_seconds: _Optional[float] = ..., encode_seconds: _Optional[float] = ..., transfer_seconds: _Optional[float] = ..., total_seconds: _Optional[float] = ..., message_bytes: _Optional[int] = ..., encoding: _Optional[str] = ..., fallback: _Optional[bool] = ..., stored_chunks: _Optional[int] = ..., mu_wait_seconds: _Optional[float] = ..., wire_wait_seconds: _Optional[float] = ..., chunk_timings: _Optional[_Iterable[_Union[ChunkTiming, _Mapping]]] = ...) -> None: ...

class ChunkTiming(_message.Message):
    __slots__ = ("chunk", "layers_in_seconds", "ready_seconds", "coded_seconds", "written_seconds", "wire_bytes", "mu_seconds", "peer_mu_seconds")
    CHUNK_FIELD_NUMBER: _ClassVar[int]
    LAYERS_IN_SECONDS_FIELD_NUMBER: _ClassVar[int]
    READY_SECONDS_FIELD_NUMBER: _ClassVar[int]
    CODED_SECONDS_FIELD_NUMBER: _ClassVar[int]
    WRITTEN_SECONDS_FIELD_NUMBER: _ClassVar[int]
    WIRE_BYTES_FIELD_NUMBER: _ClassVar[int]
    MU_SECONDS_FIELD_NUMBER: _ClassVar[int]
    PEER_MU_SECONDS_FIELD_NUMBER: _ClassVar[int]
    chunk: int
    layers_in_seconds: float
    ready_seconds: float
    coded_seconds: float
    written_seconds: float
    wire_bytes: int
    mu_seconds: float
    peer_mu_seconds: float
    def __init__(self, chunk: _Optional[int] = ..., layers_in_seconds: _Optional[float] = ..., ready_seconds: _Optional[float] = ..., coded_seconds: _Optional[float] = ..., written_seconds: _Optional[float] = ..., wire_bytes: _Optional[int] = ..., mu_seconds: _Optional[float] = ..., peer_mu_seconds: _Optional[float] = ...) -> None: ...
