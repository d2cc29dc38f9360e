"""Wire container for speckv compressed KV caches (format version 5; reads 2 to 5).

The byte layout is specified field by field in ``coder/FORMAT.md``. This module
only frames and validates; it knows nothing about rANS or the predictor.

Lifecycle. Writing: build one :class:`StreamHeader` (validated on construction);
code the KV tensor chunk by chunk (``header.chunk_layers(i)`` and
``header.chunk_blocks(i)`` give each chunk's extent); wrap each result in a
:class:`Chunk`; emit ``pack_header(h)`` then ``pack_chunk(c)`` for ``i = 0 ..
h.n_chunks - 1`` (or ``pack_stream(h, chunks)``). Reading: ``unpack_header(buf)``
returns the header and its size; ``unpack_chunk(buf[off:], header)`` is then called
``header.n_chunks`` times, each returning a chunk validated against the header and
its size (or ``unpack_stream(buf)``, which also rejects trailing bytes). The caller
then checks pin, prompt digest and mu fingerprint, decodes, and checks ``raw_digest``.

Versions. A writer emits ``FORMAT_VERSION`` (5); a reader accepts ``READ_VERSIONS``
and keeps the version in ``StreamHeader.version``. Version 3 adds *stored chunks in
a coded stream*: a chunk of a ``model != MODEL_STORED`` stream may carry its raw
bytes (``n_blocks = 0`` although ``chunk_blocks(i) > 0``); ``is_stored_chunk`` tells.
Version 4 adds sigma shifts to a coded chunk's ``aux``, version 5 an FP8 coded chunk's
rounding byte (both opaque here; the codec reads them: ``plan.chunk_aux``).

Malformed input raises :class:`FormatError` (or its subclasses :class:`TruncatedError`
and :class:`ChecksumError`) and nothing else. Sizes are checked against the bytes
present, the CRC and the global limits ``MAX_CHUNK_BYTES``, ``MAX_ELEMENTS``,
``MAX_AUX_BYTES`` and ``MAX_BITS_BYTES`` (read at call time, so an application may
change them) before anything is allocated. A non-bytes-like ``buf`` is a TypeError.
"""

from __future__ import annotations

import struct
from dataclasses import InitVar, dataclass
from typing import Iterable, Sequence, cast

import numpy as np

from speckv.errors import ChecksumError, FormatError, TruncatedError, UnsupportedVersionError

from . import framing as fr
from .framing import CHUNK_MAGIC, CHUNK_OVERHEAD, Buffer, flat, record_pieces
from .rans import LANES as RANS_LANES

__all__ = ["FormatError", "TruncatedError", "ChecksumError", "StreamHeader", "Chunk",
           "is_stored_chunk", "pack_header", "unpack_header", "pack_chunk", "unpack_chunk", "pack_stream",
           "unpack_stream", "chunk_pieces", "stored_pieces", "DTYPE_BF16", "DTYPE_FP8", "LANES", "FORMAT_VERSION",
           "READ_VERSIONS", "MAGIC",
           "CHUNK_MAGIC", "MODEL_STORED", "HEADER_LEN", "CHUNK_OVERHEAD", "MAX_CHUNK_BYTES",
           "MAX_ELEMENTS", "MAX_AUX_BYTES", "MAX_BITS_BYTES"]

DTYPE_BF16 = 1
DTYPE_FP8 = 2
LANES = RANS_LANES  # the rANS core's lanes per block (one warp)
# written: 5: an FP8 coded chunk's rounding byte (codes rounded toward zero); 4: sigma shifts in a
# coded chunk's aux; 3: stored chunks in a coded stream; 2: model 2 (tuned)
FORMAT_VERSION = 5
READ_VERSIONS = (2, 3, 4, 5)  # read (each keeps its rules: version 2 has no stored chunk in a coded stream,
# versions 2 and 3 no sigma shifts, versions 2 to 4 no rounding byte)
MAGIC = b"SPKV"

MODEL_STORED = 0  # model id of a stored stream: no rANS blocks, raw bytes in ``bits``

MAX_CHUNK_BYTES = 1 << 30
MAX_ELEMENTS = 1 << 40
MAX_AUX_BYTES = 1 << 20
MAX_BITS_BYTES = 1 << 30

_HEADER = struct.Struct("<4sHHBB32s5I32sHIHI")  # everything but the crc
_CHUNK, _U32 = fr.CHUNK, fr.U32
_uint, _digest, _blob, _need = fr.check_uint, fr.check_digest, fr.check_blob, fr.need
_check_magic, _check_crc = fr.check_magic, fr.check_crc
HEADER_LEN = _HEADER.size + 4  # 110
_BLOCK_BYTES = LANES * 4 + 4  # states plus word_count per block
_U16_MAX, _U32_MAX = 0xFFFF, 0xFFFFFFFF


@dataclass(frozen=True)
class StreamHeader:
    """Stream-wide parameters; every field is validated on construction."""

    dtype: int
    model: int
    pin: bytes
    shape: tuple[int, int, int, int, int]
    prompt_digest: bytes
    elems_per_lane: int
    layers_per_chunk: int
    version: int = FORMAT_VERSION  # of the stream read, or to write: one of READ_VERSIONS

    def __post_init__(self) -> None:
        s = object.__setattr__
        s(self, "version", _check_version(self.version))
        s(self, "dtype", _uint("dtype", self.dtype, 1, 2))
        s(self, "model", _uint("model", self.model, 0, 255))
        s(self, "pin", _digest("pin", self.pin, 32))
        s(self, "prompt_digest", _digest("prompt_digest", self.prompt_digest, 32))
        s(self, "shape", _check_shape(self.shape))
        s(self, "elems_per_lane", _uint("elems_per_lane", self.elems_per_lane, 1, _U32_MAX))
        s(self, "layers_per_chunk", _uint("layers_per_chunk", self.layers_per_chunk, 1, _U16_MAX))
        if self.chunk_blocks(0) > _U32_MAX:
            raise FormatError("blocks per chunk do not fit in u32")

    @property
    def n_chunks(self) -> int:
        return -(-self.shape[0] // self.layers_per_chunk)

    @property
    def block_elements(self) -> int:
        """Elements per block: ``LANES * elems_per_lane``."""
        return LANES * self.elems_per_lane

    def chunk_layers(self, index: int) -> tuple[int, int]:
        """``(layer_start, layer_count)`` of chunk ``index``; FormatError if out of range."""
        if not 0 <= index < self.n_chunks:
            raise FormatError(f"chunk index {index} outside [0, {self.n_chunks})")
        start = index * self.layers_per_chunk
        return start, min(self.layers_per_chunk, self.shape[0] - start)

    def chunk_elements(self, index: int) -> int:
        _, count = self.chunk_layers(index)
        _, two, heads, tokens, dim = self.shape
        return count * two * heads * tokens * dim

    def chunk_blocks(self, index: int) -> int:
        """rANS blocks of chunk ``index``: 0 in a stored stream (``model == MODEL_STORED``)."""
        if self.model == MODEL_STORED:
            return 0
        return -(-self.chunk_elements(index) // self.block_elements)


def _check_version(version: object) -> int:
    v = _uint("version", version, 0, _U16_MAX)
    if v not in READ_VERSIONS:
        raise UnsupportedVersionError(f"unsupported format version {v}")
    return v


def _check_shape(shape: object) -> tuple[int, int, int, int, int]:
    try:
        items = tuple(cast("Iterable[object]", shape))  # a non-iterable still raises TypeError
    except TypeError:
        raise FormatError("shape must be a sequence of 5 integers") from None
    if len(items) != 5:
        raise FormatError(f"shape must have 5 dims, got {len(items)}")
    names = ("layers", "shape[1]", "kv_heads", "tokens", "head_dim")
    dims = tuple(_uint(n, v, 0 if n == "tokens" else 1, _U32_MAX)
                 for n, v in zip(names, items, strict=True))
    if dims[1] != 2:
        raise FormatError(f"shape[1] must be 2 (K and V), got {dims[1]}")
    total = dims[0] * dims[1] * dims[2] * dims[3] * dims[4]
    if total > MAX_ELEMENTS:
        raise FormatError(f"{total} elements exceed MAX_ELEMENTS={MAX_ELEMENTS}")
    return cast("tuple[int, int, int, int, int]", dims)  # 5 dims: zip(strict=True) over 5 names


def _uint_array(name: str, value: object, dtype: type, ndim: int, borrow: bool = False) -> np.ndarray:
    """Validate ``value`` as a non-negative integer array fitting ``dtype``; return it
    as a C-contiguous native ``dtype`` array that owns its data (copying if needed), or
    with ``borrow`` such an array as it is, a view included (its values fit ``dtype``)."""
    arr = np.asarray(value)
    if arr.size == 0:
        arr = arr.astype(dtype)
    if arr.dtype.kind not in "ui":
        raise FormatError(f"{name} must be an unsigned integer array, got {arr.dtype}")
    if arr.ndim != ndim:
        raise FormatError(f"{name} must have {ndim} dims, got shape {arr.shape}")
    if arr.dtype == dtype and arr.flags.c_contiguous and (arr.flags.owndata or borrow):
        return arr
    if arr.size and (int(arr.min()) < 0 or int(arr.max()) > np.iinfo(dtype).max):
        raise FormatError(f"{name} values outside [0, {np.iinfo(dtype).max}]")
    return np.array(arr, dtype=dtype, copy=True, order="C")


@dataclass(frozen=True, eq=False)
class Chunk:
    """One coded chunk; validated on construction (not against a header: see
    ``pack_stream``/``unpack_chunk``). Arrays are normalised to C-contiguous native
    arrays owning their data (copied unless already so): ``states`` uint32
    ``(n_blocks, LANES)`` (a flat block-major array is reshaped), ``word_counts``
    uint32 ``(n_blocks,)``, ``words`` uint16 ``(sum(word_counts),)``; ``aux`` and
    ``bits`` (raw bit fields of the probability model) are normalised to ``bytes``. A chunk that
    ``unpack_chunk(..., borrow=True)`` returns reads its record in place: ``bits`` is a
    read-only memoryview and ``words`` a read-only view (``borrowed``)."""

    index: int
    layer_start: int
    layer_count: int
    steps: int
    mu_fingerprint: bytes
    raw_digest: bytes
    aux: bytes
    states: np.ndarray
    word_counts: np.ndarray
    words: np.ndarray
    bits: bytes
    borrowed: InitVar[bool] = False  # words may stay a view of the record (unpack_chunk's borrow)

    def __post_init__(self, borrowed: bool) -> None:
        s = object.__setattr__
        for name in ("index", "layer_start", "layer_count", "steps"):
            s(self, name, _uint(name, getattr(self, name), 0, _U32_MAX))
        s(self, "mu_fingerprint", _digest("mu_fingerprint", self.mu_fingerprint, 16))
        s(self, "raw_digest", _digest("raw_digest", self.raw_digest, 16))
        s(self, "aux", _blob("aux", self.aux, MAX_AUX_BYTES, "MAX_AUX_BYTES"))
        s(self, "bits", _blob("bits", self.bits, MAX_BITS_BYTES, "MAX_BITS_BYTES"))
        s(self, "word_counts", _uint_array("word_counts", self.word_counts, np.uint32, 1))
        states = np.asarray(self.states)
        if states.ndim == 1 and states.size == self.n_blocks * LANES:
            states = states.reshape(self.n_blocks, LANES)  # flat block-major form
        s(self, "states", _uint_array("states", states, np.uint32, 2))
        s(self, "words", _uint_array("words", self.words, np.uint16, 1, borrowed))
        if self.states.shape != (self.n_blocks, LANES):
            raise FormatError(f"states shape {self.states.shape} != ({self.n_blocks}, {LANES})")
        if int(self.word_counts.sum(dtype=np.uint64)) != self.words.size:
            raise FormatError("sum(word_counts) != len(words)")
        if self.n_blocks > _U32_MAX:
            raise FormatError("n_blocks does not fit in u32")

    @property
    def n_blocks(self) -> int:
        return len(self.word_counts)

    @property
    def record_len(self) -> int:
        """Size in bytes of this chunk's packed record."""
        return (CHUNK_OVERHEAD + len(self.aux) + _BLOCK_BYTES * self.n_blocks
                + 2 * self.words.size + len(self.bits))

    def block_words(self, block: int) -> np.ndarray:
        """The u16 words of block ``block`` (a view into ``words``)."""
        if not 0 <= block < self.n_blocks:
            raise IndexError(block)
        start = int(self.word_counts[:block].sum(dtype=np.uint64))
        return self.words[start: start + int(self.word_counts[block])]

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Chunk):
            return NotImplemented
        pairs = ((getattr(self, f), getattr(other, f)) for f in self.__dataclass_fields__)
        return all(np.array_equal(a, b) if isinstance(a, np.ndarray) else a == b for a, b in pairs)

    __hash__ = None  # type: ignore[assignment]


def is_stored_chunk(h: StreamHeader, c: Chunk) -> bool:
    """Whether ``c`` (a chunk valid against ``h``) carries its raw bytes instead of rANS
    blocks: every chunk of a stored stream, and a version 3 coded stream's chunk with
    ``n_blocks == 0`` where ``chunk_blocks`` is not 0 (FORMAT.md)."""
    if h.model == MODEL_STORED:
        return True
    return h.version >= 3 and c.n_blocks == 0 and h.chunk_blocks(c.index) > 0


def pack_header(h: StreamHeader) -> bytes:
    """Serialise ``h`` into its 110-byte header record."""
    body = _HEADER.pack(MAGIC, h.version, HEADER_LEN, h.dtype, h.model, h.pin,
                        *h.shape, h.prompt_digest, LANES, h.elems_per_lane,
                        h.layers_per_chunk, h.n_chunks)
    return body + _U32.pack(fr.crc32(body))


def unpack_header(buf: Buffer) -> tuple[StreamHeader, int]:
    """Parse and validate a header record at the start of ``buf``.

    Returns the header and the number of bytes consumed (``HEADER_LEN``)."""
    mv = memoryview(buf).cast("B")
    _check_magic(mv, MAGIC, "header")
    _need(mv, 8, "header")
    version, header_len = struct.unpack_from("<HH", mv, 4)
    _check_version(version)
    if header_len != HEADER_LEN:
        raise FormatError(f"header_len {header_len} != {HEADER_LEN}")
    _need(mv, HEADER_LEN, "header")
    _check_crc(mv[: _HEADER.size], _U32.unpack_from(mv, _HEADER.size)[0], "header")
    f = _HEADER.unpack_from(mv)
    dtype, model, pin, shape, digest = f[3], f[4], f[5], f[6:11], f[11]
    lanes, epl, lpc, n_chunks = f[12:16]
    if lanes != LANES:
        raise FormatError(f"lanes {lanes} != {LANES}")
    h = StreamHeader(dtype=dtype, model=model, pin=pin, shape=shape, prompt_digest=digest,
                     elems_per_lane=epl, layers_per_chunk=lpc, version=version)
    if n_chunks != h.n_chunks:
        raise FormatError(f"n_chunks {n_chunks} != ceil(layers/layers_per_chunk) {h.n_chunks}")
    return h, HEADER_LEN


def pack_chunk(c: Chunk) -> bytes:
    """Serialise ``c`` into a chunk record (not checked against any header)."""
    return b"".join(chunk_pieces(c))


def chunk_pieces(c: Chunk) -> list[memoryview]:
    """``c``'s record as buffers read in place (joined: ``pack_chunk(c)``)."""
    arrays = [flat(c.states, "<u4"), flat(c.word_counts, "<u4"), flat(c.words, "<u2")]
    fields = (c.index, c.layer_start, c.layer_count, c.n_blocks, c.steps, c.mu_fingerprint, c.raw_digest)
    return record_pieces(fields, c.aux, arrays, [flat(c.bits)], MAX_CHUNK_BYTES)


def stored_pieces(index: int, layer_start: int, layer_count: int, raw_digest: bytes, aux: bytes,
                  bits: Sequence["Buffer | np.ndarray"]) -> list[memoryview]:
    """The record of a chunk with no rANS blocks (a stored chunk: ``steps`` 0, ``mu_fingerprint``
    zero) whose ``bits`` are the concatenation of ``bits`` (bytes, or C-contiguous arrays of
    little-endian elements), validated as :class:`Chunk` validates it, as buffers read in place:
    joined, they are ``pack_chunk`` of that chunk, built without its bytes ever being copied."""
    fields = (_uint("index", index, 0, _U32_MAX), _uint("layer_start", layer_start, 0, _U32_MAX),
              _uint("layer_count", layer_count, 0, _U32_MAX), 0, 0, bytes(16), _digest("raw_digest", raw_digest, 16))
    views = [flat(b) for b in bits]
    if sum(len(v) for v in views) > MAX_BITS_BYTES:
        raise FormatError(f"bits of {sum(len(v) for v in views)} bytes exceeds MAX_BITS_BYTES={MAX_BITS_BYTES}")
    return record_pieces(fields,
                         _blob("aux", aux, MAX_AUX_BYTES, "MAX_AUX_BYTES"), [], views, MAX_CHUNK_BYTES)


def _check_against_header(i: int, layers: tuple[int, int], n_blocks: int, steps: int,
                          header: StreamHeader) -> None:
    """Chunk-vs-header rules of FORMAT.md (index, layer range, n_blocks, steps); from
    version 3 a coded stream's chunk may be stored (``n_blocks == 0``)."""
    if layers != header.chunk_layers(i):
        raise FormatError(f"chunk {i}: layers {layers} != header's {header.chunk_layers(i)}")
    may_store = header.version >= 3 and header.model != MODEL_STORED
    if n_blocks != header.chunk_blocks(i) and not (may_store and n_blocks == 0):
        raise FormatError(f"chunk {i}: n_blocks {n_blocks} != header's {header.chunk_blocks(i)}")
    if steps > 16 * header.elems_per_lane or (n_blocks == 0 and steps != 0):
        raise FormatError(f"chunk {i}: steps {steps} invalid for {n_blocks} blocks "
                          f"of {header.elems_per_lane} elements per lane")


def unpack_chunk(buf: Buffer, header: StreamHeader, *, borrow: bool = False) -> tuple[Chunk, int]:
    """Parse a chunk record at the start of ``buf`` and validate it against
    ``header``. Returns the chunk and the number of bytes consumed.

    ``borrow``: the chunk's ``bits`` and ``words`` are read-only views into ``buf`` instead of
    owned copies (a stored chunk's bits are its raw KV, a coded chunk's words most of its
    bytes: no copy of them; on a big-endian host the words are still copied). The caller
    hands ``buf`` over: it must not change while the chunk lives."""
    rec = fr.read_record(memoryview(buf).cast("B"), MAX_CHUNK_BYTES)
    (_, record_len, index, layer_start, layer_count, n_blocks, steps, mu, raw,
     aux_len) = _CHUNK.unpack_from(rec)
    _check_against_header(index, (layer_start, layer_count), n_blocks, steps, header)
    if aux_len > MAX_AUX_BYTES:
        raise FormatError(f"aux_len {aux_len} exceeds MAX_AUX_BYTES")
    s_off = _CHUNK.size + aux_len
    w_off = s_off + 4 * LANES * n_blocks
    d_off = w_off + 4 * n_blocks
    if d_off + 8 + 4 > record_len:
        raise FormatError(f"chunk {index}: counts need {d_off + 12} bytes > record_len")
    word_counts = fr.le_array(rec, w_off, n_blocks, "<u4", np.uint32)
    n_words = int(word_counts.sum(dtype=np.uint64))
    bits = fr.read_bits(rec, d_off + 2 * n_words, index, MAX_BITS_BYTES)  # checks the length rule
    states = fr.le_array(rec, s_off, LANES * n_blocks, "<u4", np.uint32, (n_blocks, LANES))
    chunk = Chunk(index=index, layer_start=layer_start, layer_count=layer_count, steps=steps,
                  mu_fingerprint=mu, raw_digest=raw, aux=bytes(rec[_CHUNK.size:s_off]),
                  states=states, word_counts=word_counts,
                  words=fr.le_array(rec, d_off, n_words, "<u2", np.uint16, borrow=borrow),
                  bits=b"" if borrow else bytes(bits), borrowed=borrow)
    if borrow:  # NOTE: validated above (length rule, MAX_BITS_BYTES); Chunk would copy it to bytes
        object.__setattr__(chunk, "bits", bits.toreadonly())
    return chunk, record_len


def pack_stream(h: StreamHeader, chunks: Iterable[Chunk]) -> bytes:
    """Header followed by all chunks; checks count, order and header consistency."""
    parts = [pack_header(h)]
    for i, c in enumerate(chunks):
        if c.index != i:
            raise FormatError(f"chunk at position {i} has index {c.index}")
        _check_against_header(c.index, (c.layer_start, c.layer_count), c.n_blocks, c.steps, h)
        parts.append(pack_chunk(c))
    if len(parts) - 1 != h.n_chunks:
        raise FormatError(f"got {len(parts) - 1} chunks, header needs {h.n_chunks}")
    return b"".join(parts)


def unpack_stream(buf: Buffer) -> tuple[StreamHeader, list[Chunk]]:
    """Parse a whole stream: header, exactly ``n_chunks`` chunks in index
    order, and no trailing bytes."""
    mv = memoryview(buf).cast("B")
    header, off = unpack_header(mv)
    if header.n_chunks * CHUNK_OVERHEAD > len(mv) - off:
        raise TruncatedError(f"{header.n_chunks} chunks cannot fit in {len(mv) - off} bytes")
    chunks = []
    for i in range(header.n_chunks):
        chunk, used = unpack_chunk(mv[off:], header)
        if chunk.index != i:
            raise FormatError(f"chunk at position {i} has index {chunk.index}")
        chunks.append(chunk)
        off += used
    if off != len(mv):
        raise FormatError(f"{len(mv) - off} trailing bytes after the last chunk")
    return header, chunks
