"""Shared helpers of the codec tests (geometry, stream surgery, adversarial inputs)."""

from __future__ import annotations

import dataclasses
import struct
import zlib

import numpy as np
import torch
from hypothesis import settings

from speckv.coder import container as ct
from speckv.coder.codec import Codec, Fp8KV, bf16_bits
from speckv.errors import (
    SpeckvError,
)
from speckv.predictor.fp8 import e4m3_values

LAYERS, HEADS, DIM = 30, 3, 64  # geometry of the shipped default predictor
PER_TOKEN = LAYERS * 2 * HEADS * DIM  # 11520 scalars per token


PROPERTY = settings(max_examples=30, deadline=None, database=None)

# ------------------------------------------------------------------ helpers


def shape(T: int) -> tuple[int, int, int, int, int]:
    return (LAYERS, 2, HEADS, T, DIM)


def ids_for(T: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 49152, T).astype(np.int64)


def bf16_tensor(bits: np.ndarray) -> torch.Tensor:
    """A torch.bfloat16 tensor holding exactly these uint16 bit patterns."""
    a = np.ascontiguousarray(bits, dtype=np.uint16)
    return torch.from_numpy(a.view(np.int16).copy()).view(torch.bfloat16)


def bf16_from_float(a: np.ndarray) -> np.ndarray:
    """Round float values to BF16 (nearest even, as torch does); uint16 patterns."""
    return bf16_bits(torch.from_numpy(np.asarray(a, np.float32)).to(torch.bfloat16))


def tile(values: np.ndarray, T: int, seed: int | None = 0) -> np.ndarray:
    """``values`` repeated (and shuffled, unless seed is None) into a KV shape."""
    n = PER_TOKEN * T
    out = np.resize(np.asarray(values), n)
    if seed is not None and n:
        out = out[np.random.default_rng(seed).permutation(n)]
    return out.reshape(shape(T))


def stream_bytes(records: list[bytes]) -> int:
    return sum(len(r) for r in records)


def round_trip_bf16(codec: Codec, x: np.ndarray, mu_bits: np.ndarray, ids: np.ndarray,
                    decoder: Codec | None = None) -> list[bytes]:
    """Encode (x as uint16 patterns), decode, compare bit for bit; the records."""
    mu = bf16_tensor(mu_bits)
    records = list(codec.encode(x, ids, mu))
    assert len(records) == 1 + -(-LAYERS // min(codec.config.layers_per_chunk, LAYERS))
    out = (decoder or codec).decode(records, ids, mu)
    assert isinstance(out, np.ndarray) and out.dtype == np.uint16 and out.shape == x.shape
    assert np.array_equal(out, x)
    return records


def round_trip_fp8(codec: Codec, codes: np.ndarray, scales: np.ndarray, mu_bits: np.ndarray,
                   ids: np.ndarray, decoder: Codec | None = None) -> list[bytes]:
    mu = bf16_tensor(mu_bits)
    kv = Fp8KV(np.ascontiguousarray(codes, np.uint8), np.ascontiguousarray(scales, np.float32))
    records = list(codec.encode(kv, ids, mu))
    out = (decoder or codec).decode(records, ids, mu)
    assert isinstance(out, Fp8KV)
    assert out.codes.dtype == np.uint8 and out.codes.shape == codes.shape
    assert np.array_equal(out.codes, codes)
    assert out.scales.dtype == np.float32 and out.scales.shape == (LAYERS, 2)
    assert np.array_equal(out.scales.view(np.uint32), kv.scales.view(np.uint32))
    return records


def with_aux(h: ct.StreamHeader, rec: bytes, aux: bytes) -> bytes:
    """Chunk record ``rec`` with another ``aux``: a valid record (its crc recomputed)."""
    c = ct.unpack_chunk(rec, h)[0]
    return ct.pack_chunk(dataclasses.replace(c, aux=aux))


def versioned_records(codec: Codec, kv, ids: np.ndarray, mu, version: int) -> list[bytes]:
    """``kv``'s stream under a header of format ``version`` (the bytes that version's writers wrote)."""
    x, scales = (kv.codes, kv.scales) if isinstance(kv, Fp8KV) else (bf16_bits(kv), None)
    h = dataclasses.replace(codec.stream_header(scales is None, x.shape, ids), version=version)
    chunks = codec.encode_chunks(h, range(h.n_chunks), x, mu, scales)
    return [ct.pack_header(h)] + [ct.pack_chunk(c) for c in chunks]


def unguarded_records(codec: Codec, kv, ids: np.ndarray, mu) -> list[bytes]:
    """``kv``'s stream under a version 2 header: every chunk coded, even one larger than its
    stored form (version 3's size guard would store it). The bytes version 2 writers wrote."""
    return versioned_records(codec, kv, ids, mu, 2)


def without_digests(rec: bytes) -> bytes:
    """A chunk record less its mu_fingerprint and raw_digest (offsets 32..64) and crc32: what
    one chunk's version 2 and version 3 records share (blake2b-128 there, XXH3-128 here)."""
    return rec[:32] + rec[64:-4]


def recrc(rec: bytes | bytearray) -> bytes:
    """The record with its trailing crc32 recomputed over everything before it."""
    rec = bytearray(rec)
    rec[-4:] = struct.pack("<I", zlib.crc32(bytes(rec[:-4])))
    return bytes(rec)


def flip(rec: bytes, pos: int, mask: int = 0x01) -> bytes:
    b = bytearray(rec)
    b[pos] ^= mask
    return bytes(b)


def chunk_areas(header_rec: bytes, rec: bytes) -> dict[str, tuple[int, int]]:
    """Byte ranges [start, end) of one chunk record's fields (FORMAT.md)."""
    h, _ = ct.unpack_header(header_rec)
    c, _ = ct.unpack_chunk(rec, h)
    s = 68 + len(c.aux)
    w = s + 128 * c.n_blocks
    d = w + 4 * c.n_blocks
    b = d + 2 * c.words.size
    return {"fixed": (4, 68), "aux": (68, s), "states": (s, w), "word_counts": (w, d),
            "words": (d, b), "bits_len": (b, b + 8), "bits": (b + 8, len(rec) - 4)}


def assert_rejected(codec: Codec, records: list[bytes], ids: np.ndarray, mu,
                    expect: type[SpeckvError] | tuple = SpeckvError) -> SpeckvError:
    """decode must raise a SpeckvError (of ``expect``) and nothing else."""
    try:
        out = codec.decode(records, ids, mu)
    except SpeckvError as e:
        assert isinstance(e, expect), f"{type(e).__name__}: {e} (expected {expect})"
        return e
    raise AssertionError(f"corrupt stream decoded without error (shape {getattr(out, 'shape', None)})")


# ------------------------------------------------------- adversarial BF16

NAN_PAYLOADS = [0x7FC0, 0x7F81, 0x7FFF, 0x7FA5, 0xFFFF, 0xFF81, 0xFFC0, 0xFFA5]
SPECIALS = NAN_PAYLOADS + [
    0x7F80, 0xFF80,  # +-Inf
    0x0000, 0x8000,  # +-0
    0x7F7F, 0xFF7F,  # max / min finite
    0x0080, 0x8080,  # smallest normals
    0x3F80, 0xBF80, 0x3F7F, 0x4000, 0x7F00, 0x0100,  # +-1, binade edges
]
SUBNORMALS = list(range(0x0001, 0x0080)) + list(range(0x8001, 0x8080))
ADVERSARIAL = np.array(SPECIALS + SUBNORMALS, np.uint16)


def mu_variant(x: np.ndarray, mode: str, seed: int = 1) -> np.ndarray:
    """A mu (uint16 patterns) for x: the truth, near it, or wildly wrong."""
    rng = np.random.default_rng(seed)
    if mode == "true":
        return x.copy()
    if mode == "ulp":  # neighbouring pattern (crosses binades / into NaN at the edges)
        return x ^ np.uint16(1)
    if mode == "shifted":  # +-3% in value, rounded to bf16
        xf = (x.astype(np.uint32) << 16).view(np.float32)
        return bf16_from_float(xf * np.where(rng.random(x.shape) < 0.5, 1.03, 0.97).astype(np.float32))
    if mode == "random":
        return rng.integers(0, 1 << 16, x.shape).astype(np.uint16)
    if mode == "negated":
        return x ^ np.uint16(0x8000)
    const = {"nan": 0x7FC0, "nan_payload": 0xFF81, "inf": 0x7F80, "-inf": 0xFF80, "zero": 0x0000,
             "negzero": 0x8000, "one": 0x3F80, "max": 0x7F7F, "tiny": 0x0001}
    return np.full(x.shape, const[mode], np.uint16)


MU_MODES = ["true", "ulp", "shifted", "random", "negated", "nan", "nan_payload", "inf", "-inf",
            "zero", "negzero", "one", "max", "tiny"]


# ------------------------------------------------------------------- FP8

ALL_CODES = np.arange(256, dtype=np.uint8)
E4M3_VALUES = e4m3_values()  # float64 value of each code (NaN for 0x7F / 0xFF)


def fp8_mu(codes: np.ndarray, scales: np.ndarray, mode: str, seed: int = 3) -> np.ndarray:
    """mu (bf16 patterns) for FP8 codes: dequantised, perturbed, zero, random or NaN."""
    rng = np.random.default_rng(seed)
    deq = (E4M3_VALUES[codes] * scales.astype(np.float64)[:, :, None, None, None]).astype(np.float32)
    if mode == "true":
        return bf16_from_float(deq)
    if mode == "near":
        return bf16_from_float(deq * (1 + 0.05 * rng.standard_normal(codes.shape)).astype(np.float32))
    if mode == "random":
        return rng.integers(0, 1 << 16, codes.shape).astype(np.uint16)
    if mode == "zero":
        return np.zeros(codes.shape, np.uint16)
    if mode == "nan":
        return np.full(codes.shape, 0x7FC0, np.uint16)
    raise ValueError(mode)


SCALES = {
    "one": np.ones((LAYERS, 2), np.float32),
    "tiny": np.full((LAYERS, 2), 1e-30, np.float32),
    "huge": np.full((LAYERS, 2), 1e30, np.float32),
    "mixed": np.array([[1e-30, 1e30], [1.0, 3.0e-3], [448.0, 1 / 448]] * 10, np.float32),
}

def _near_mixture(rng: np.random.Generator, mu_f: np.ndarray, p_random: float) -> np.ndarray:
    """x as BF16 patterns: mu + small noise, with a fraction of random 16-bit patterns."""
    noise = rng.standard_normal(mu_f.shape).astype(np.float32)
    rel = np.float32(10.0 ** rng.uniform(-4, -0.5))
    x = bf16_from_float(mu_f + noise * (np.abs(mu_f) * rel + np.float32(10.0 ** rng.uniform(-6, -1))))
    wild = rng.random(mu_f.shape) < p_random
    x[wild] = rng.integers(0, 1 << 16, int(wild.sum())).astype(np.uint16)
    return x


def _sample_bf16(T: int = 3, seed: int = 11) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    mu_f = rng.standard_normal(shape(T)).astype(np.float32)
    mu = bf16_from_float(mu_f)
    return _near_mixture(rng, mu_f, 0.01), mu
