"""The valid streams the coder targets mutate: small synthetic container streams of
many geometries (with stored chunks in coded streams, format version 3), and real
BF16/FP8 speckv and stored streams of a random KV: the speckv ones in format version 2
(every chunk coded, as the rANS checks need) and in version 3 (``mixed-*``: the size
guard stores some of their chunks)."""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, Sequence

import numpy as np

from speckv.coder import container as ct
from speckv.coder.codec import Codec, Fp8KV, stored_chunk
from speckv.predictor.fp8 import e4m3_values

from .mutate import record_fields

# (shape, elems_per_lane, layers_per_chunk, model, dtype, version) of the synthetic streams
GEOMETRIES = [((3, 2, 2, 5, 4), 2, 2, 3, 1, 2), ((4, 2, 1, 0, 8), 1, 3, 1, 2, 3),
              ((1, 2, 1, 1, 1), 1000, 1, 1, 1, 3), ((5, 2, 3, 7, 2), 1, 65535, 7, 2, 3),
              ((2, 2, 2, 64, 16), 4, 1, 1, 1, 3), ((6, 2, 1, 3, 4), 1, 4, 0, 1, 3), ((5, 2, 2, 3, 4), 3, 1, 2, 2, 3)]
# BF16 escapes, zero-bin and normal elements
SPECIAL_BF16 = np.array([0x7FC0, 0x7F81, 0xFFFF, 0x7F80, 0xFF80, 0x0000, 0x8000, 0x0001, 0x807F, 0x7F7F],
                        np.uint16)
Stream = tuple[ct.StreamHeader, list[bytes]]


def bf16_trunc(a: np.ndarray) -> np.ndarray:
    """BF16 bit patterns (uint16) of float32 values, truncated."""
    return (np.ascontiguousarray(a, np.float32).view(np.uint32) >> 16).astype(np.uint16)


def same_kv(out: Any, bits: np.ndarray, scales: np.ndarray | None) -> bool:
    """Bit-exact equality of a decoded/fetched KV with the original (FP8 scales compared
    as fp32 bit patterns)."""
    if scales is not None:
        return (hasattr(out, "codes") and np.array_equal(np.asarray(out.codes), bits)
                and np.array_equal(np.asarray(out.scales, np.float32).view(np.uint32),
                                   np.asarray(scales, np.float32).view(np.uint32)))
    return isinstance(out, np.ndarray) and out.dtype == np.uint16 and np.array_equal(out, bits)


def stored_records(codec: Codec, bits: np.ndarray, scales: np.ndarray | None, ids: np.ndarray,
                   layers_per_chunk: int | None = None) -> list[bytes]:
    """A stored (not entropy-coded) stream of ``bits``: header record, then the chunks."""
    h = codec.stream_header(scales is None, bits.shape, ids, layers_per_chunk=layers_per_chunk, stored=True)
    recs = [ct.pack_header(h)]
    for i in range(h.n_chunks):
        s, n = h.chunk_layers(i)
        recs.append(ct.pack_chunk(stored_chunk(h, i, bits[s:s + n], None if scales is None else scales[s:s + n])))
    return recs


def coded_records(codec: Codec, kv: Any, ids: np.ndarray, mu: np.ndarray) -> list[bytes]:
    """``kv``'s speckv stream in format version 2: every chunk coded (version 3 stores a chunk
    that would code larger than its raw bytes)."""
    x, scales = (kv.codes, kv.scales) if isinstance(kv, Fp8KV) else (kv, None)
    h = replace(codec.stream_header(scales is None, x.shape, ids), version=2)
    return [ct.pack_header(h)] + [ct.pack_chunk(c) for c in codec.encode_chunks(h, range(h.n_chunks), x, mu, scales)]


def synthetic_stream(g: np.random.Generator, shape: tuple[int, ...], epl: int, lpc: int, model: int,
                     dtype: int, version: int = ct.FORMAT_VERSION) -> Stream:
    """A container stream of random chunk contents (valid records, not a decodable KV); in
    a version 3 coded stream, every other chunk is stored (no blocks)."""
    h = ct.StreamHeader(dtype=dtype, model=model, pin=g.bytes(32), shape=shape, prompt_digest=g.bytes(32),
                        elems_per_lane=epl, layers_per_chunk=lpc, version=version)
    recs = [ct.pack_header(h)]
    for i in range(h.n_chunks):
        nb = 0 if version >= 3 and i % 2 else h.chunk_blocks(i)
        counts = g.integers(0, 6, nb).astype(np.uint32)
        start, count = h.chunk_layers(i)
        recs.append(ct.pack_chunk(ct.Chunk(
            index=i, layer_start=start, layer_count=count, steps=min(3, 16 * epl) if nb else 0,
            mu_fingerprint=g.bytes(16), raw_digest=g.bytes(16), aux=g.bytes(int(g.integers(0, 9))),
            states=g.integers(0, 2**32, (nb, ct.LANES), dtype=np.uint32), word_counts=counts,
            words=g.integers(0, 2**16, int(counts.sum()), dtype=np.uint16),
            bits=g.bytes(int(g.integers(0, 12))))))
    return h, recs


@dataclass
class Base:
    """A valid stream: records (header first), what it decodes to, and how to decode it."""

    name: str
    records: list[bytes]
    ids: np.ndarray
    mu: np.ndarray | None
    bits: np.ndarray  # uint16 BF16 patterns or uint8 e4m3 codes
    scales: np.ndarray | None  # FP8 scales

    def __post_init__(self) -> None:
        self.header, _ = ct.unpack_header(self.records[0])
        self.fields = record_fields(self.records)  # per record


def _random_kv(g: np.random.Generator, shape: tuple[int, ...]) -> dict[str, np.ndarray]:
    """A BF16 KV ``x`` near its mu, FP8 ``codes``/``scales`` near ``mu8``, with special
    values: escapes, non-finite mu, 0 / inf / NaN scales (their elements escape)."""
    L = shape[0]
    mu_f = g.standard_normal(shape).astype(np.float32)
    mu = bf16_trunc(mu_f)
    x = bf16_trunc(mu_f + 0.05 * g.standard_normal(shape).astype(np.float32))
    x.reshape(-1)[:len(SPECIAL_BF16)] = SPECIAL_BF16
    mu.reshape(-1)[-3:] = (0x7FC0, 0x7F80, 0x0000)
    codes = g.integers(0, 256, shape).astype(np.uint8)
    scales = (g.random((L, 2)) * 0.1 + 1e-3).astype(np.float32)
    scales[0, 0] = 0.0
    scales[1, 1] = np.inf
    with np.errstate(all="ignore"):
        deq = (e4m3_values()[codes] * scales.astype(np.float64)[:, :, None, None, None]).astype(np.float32)
        mu8 = bf16_trunc(np.nan_to_num(deq) * (1 + 0.05 * g.standard_normal(shape)).astype(np.float32))
    return {"x": x, "mu": mu, "codes": codes, "scales": scales, "mu8": mu8}


def real_bases(codec: Codec, seed: int) -> list[Base]:
    """Speckv (version 2: every chunk coded; version 3, ``mixed-*``: as the codec writes them)
    and stored, BF16 and FP8 streams of one random 1-token KV under ``codec``."""
    g = np.random.default_rng(seed)
    sig = codec.log2_sigma.shape
    ids = g.integers(0, 49152, 1).astype(np.int64)
    kv = _random_kv(g, (sig[0], 2, sig[2], 1, sig[3]))
    x, codes, scales = kv["x"], kv["codes"], kv["scales"]
    fp8 = Fp8KV(codes, scales)
    return [Base("speckv-bf16", coded_records(codec, x, ids, kv["mu"]), ids, kv["mu"], x, None),
            Base("speckv-fp8", coded_records(codec, fp8, ids, kv["mu8"]), ids, kv["mu8"], codes, scales),
            Base("mixed-bf16", list(codec.encode(x, ids, kv["mu"])), ids, kv["mu"], x, None),
            Base("mixed-fp8", list(codec.encode(fp8, ids, kv["mu8"])), ids, kv["mu8"], codes, scales),
            Base("stored-bf16", stored_records(codec, x, None, ids), ids, None, x, None),
            Base("stored-fp8", stored_records(codec, codes, scales, ids), ids, None, codes, scales)]


class CoderEnv:
    """Valid streams to mutate: synthetic container streams and real codec streams
    (BF16/FP8, speckv/stored) of a random KV with 1 token, under ``codec``."""

    def __init__(self, codec: Codec, seed: int = 0) -> None:
        self.codec = codec
        self.bases = {b.name: b for b in real_bases(codec, seed)}
        for b in self.bases.values():  # the harness must start from streams that decode
            out = codec.decode(b.records, b.ids, b.mu)
            assert same_kv(out, b.bits, b.scales), f"base stream {b.name} does not round-trip"
        self.synthetic: list[Stream] = [synthetic_stream(np.random.default_rng(seed + k), *geo)
                                        for k, geo in enumerate(GEOMETRIES)]
        self.streams: list[Stream] = self.synthetic + [(b.header, b.records) for b in self.bases.values()]
        self.donors: Sequence[bytes] = [r for _, recs in self.streams for r in recs]
