"""Regression tests from the coder review: hostile geometry, open-ended sections,
wrong input dtypes, partial chunk lists, stream-controlled FP8 scales."""

from __future__ import annotations

import struct
import warnings
import zlib

import numpy as np
import pytest
import torch

from speckv.coder import container as ct
from speckv.coder.codec import MAX_ELEMS_PER_LANE, Codec, CodecConfig, Fp8KV
from speckv.errors import IntegrityError, SpeckvError
from speckv.predictor.checkpoint import load_checkpoint
from speckv.predictor.store import default_checkpoint_dir

SHAPE = (30, 2, 3, 2, 64)


@pytest.fixture(scope="module")
def codec() -> Codec:
    ck = load_checkpoint(default_checkpoint_dir())
    return Codec(ck.tables, ck.calib.sigma_log2_q, ck.pin, config=CodecConfig(elems_per_lane=8, threads=1))


def sample(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, np.ndarray]:
    rng = np.random.default_rng(seed)
    mu = torch.from_numpy(rng.standard_normal(SHAPE).astype(np.float32)).to(torch.bfloat16)
    kv = (mu.float() + 0.05 * torch.from_numpy(rng.standard_normal(SHAPE).astype(np.float32))).to(torch.bfloat16)
    return kv, mu, np.arange(SHAPE[3], dtype=np.int64)


def restamp_header(rec: bytes, elems_per_lane: int) -> bytes:
    """The header record with another elems_per_lane and a valid crc."""
    h, _ = ct.unpack_header(rec)
    body = bytearray(ct.pack_header(h)[:-4])
    off = 4 + 2 + 2 + 1 + 1 + 32 + 20 + 32 + 2  # magic, version, len, dtype, model, pin, shape, digest, lanes
    struct.pack_into("<I", body, off, elems_per_lane)
    return bytes(body) + struct.pack("<I", zlib.crc32(body))


def test_decoder_rejects_huge_block_geometry(codec):
    kv, mu, ids = sample()
    recs = list(codec.encode(kv, ids, mu))
    with pytest.raises(IntegrityError, match="elems_per_lane"):
        codec.decode([restamp_header(recs[0], MAX_ELEMS_PER_LANE + 1)] + recs[1:], ids, mu)


def test_unary_section_is_bounded_before_expansion(codec):
    kv, mu, ids = sample(1)
    recs = list(codec.encode(kv, ids, mu))
    h, _ = ct.unpack_header(recs[0])
    c, _ = ct.unpack_chunk(recs[1], h)
    fat = ct.Chunk(index=c.index, layer_start=c.layer_start, layer_count=c.layer_count, steps=c.steps,
                   mu_fingerprint=c.mu_fingerprint, raw_digest=c.raw_digest, aux=c.aux, states=c.states,
                   word_counts=c.word_counts, words=c.words, bits=c.bits + b"\xff" * (1 << 20))
    with pytest.raises(IntegrityError):
        codec.decode([recs[0], ct.pack_chunk(fat)] + recs[2:], ids, mu)


def test_wrong_input_dtypes_are_type_errors(codec):
    kv, mu, ids = sample(2)
    with pytest.raises(TypeError):
        list(codec.encode(kv.float().numpy(), ids, mu))  # float32 numpy is not bit patterns
    with pytest.raises(TypeError):
        list(codec.encode(kv, ids, mu.float()))
    codes = np.zeros(SHAPE, np.int64)
    with pytest.raises(TypeError):
        list(codec.encode(Fp8KV(codes, np.ones((30, 2), np.float32)), ids, mu))


def test_decode_chunks_needs_the_whole_stream(codec):
    kv, mu, ids = sample(3)
    recs = list(codec.encode(kv, ids, mu))
    h, _ = ct.unpack_header(recs[0])
    chunks = [ct.unpack_chunk(r, h)[0] for r in recs[1:]]
    for subset in (chunks[:-1], chunks[1:], [chunks[0]] * len(chunks)):
        with pytest.raises(IntegrityError):
            codec.decode_chunks(h, subset, ids, mu)


@pytest.mark.parametrize("scale", [0.0, 1e-45, float("inf"), float("nan")])
def test_stream_scales_raise_no_float_warnings(codec, scale):
    kv, mu, ids = sample(4)
    codes = np.random.default_rng(5).integers(0, 256, SHAPE).astype(np.uint8)
    fp8 = Fp8KV(codes, np.full((30, 2), scale, np.float32))
    with warnings.catch_warnings(), np.errstate(all="raise"):
        warnings.simplefilter("error")
        recs = list(codec.encode(fp8, ids, mu))
        back = codec.decode(recs, ids, mu)
    assert np.array_equal(back.codes, codes)
    assert np.array_equal(back.scales.view(np.uint32), fp8.scales.view(np.uint32))


def test_every_limit_error_is_typed(codec):
    kv, mu, ids = sample(6)
    recs = list(codec.encode(kv, ids, mu))
    for bad in ([restamp_header(recs[0], 0xFFFFFFFF)] + recs[1:], recs[:1] + recs[2:]):
        with pytest.raises(SpeckvError):
            codec.decode(bad, ids, mu)
