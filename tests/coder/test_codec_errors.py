"""Typed errors of the codec on corrupt, truncated, reordered and mismatched streams:
every bad input raises a ``SpeckvError`` and nothing else (crafted malicious streams:
``test_codec_crafted.py`` and ``test_codec_crafted_checks.py``)."""

from __future__ import annotations

import hashlib

import numpy as np
import pytest
from codec_helpers import (
    ADVERSARIAL,
    ALL_CODES,
    SCALES,
    _sample_bf16,
    assert_rejected,
    bf16_tensor,
    chunk_areas,
    flip,
    fp8_mu,
    ids_for,
    recrc,
    round_trip_bf16,
    round_trip_fp8,
    tile,
    unguarded_records,
)

from speckv.coder import container as ct
from speckv.coder.codec import Fp8KV, bf16_bits, prompt_digest
from speckv.coder.container import FormatError, TruncatedError
from speckv.coder.rans import RansDecodeError
from speckv.errors import IntegrityError, MuMismatchError, PinMismatchError, PromptMismatchError

# NaN / Inf / overflowing inputs are the point here: numpy's warnings are noise
pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning")


# ------------------------------------------------------------------ errors


@pytest.fixture(scope="module")
def small_stream(make_codec):
    """(codec, records, ids, mu) of a small BF16 stream: 3 chunks of 10 layers."""
    codec = make_codec(16, 10)
    x, mu = _sample_bf16(T=1, seed=4)
    x.reshape(-1)[: len(ADVERSARIAL)] = ADVERSARIAL  # escapes, zero-bin and normal elements
    ids = ids_for(1)
    records = round_trip_bf16(codec, x, mu, ids)
    return codec, records, ids, bf16_tensor(mu)


@pytest.fixture(scope="module")
def fp8_stream(make_codec):
    """(codec, records, ids, mu) of a small FP8 stream (2 chunks of 15 layers) of every code
    under extreme scales, in format version 2: every chunk coded (version 3's size guard
    stores these incompressible chunks), so the corruptions below reach the rANS sections."""
    codec = make_codec(16, 15)
    codes = tile(ALL_CODES, 1)
    scales = SCALES["mixed"]
    mu = fp8_mu(codes, scales, "near")
    ids = ids_for(1)
    round_trip_fp8(codec, codes, scales, mu, ids)  # version 3
    records = unguarded_records(codec, Fp8KV(codes, scales), ids, bf16_tensor(mu))
    out = codec.decode(records, ids, bf16_tensor(mu))
    assert np.array_equal(out.codes, codes) and np.array_equal(out.scales.view(np.uint32), scales.view(np.uint32))
    return codec, records, ids, bf16_tensor(mu)


def test_every_header_byte_flip_is_rejected(small_stream):
    codec, records, ids, mu = small_stream
    for pos in range(len(records[0])):
        for mask in (0x01, 0x80):
            assert_rejected(codec, [flip(records[0], pos, mask)] + records[1:], ids, mu,
                            (FormatError, TruncatedError))


def test_every_header_field_change_with_valid_crc_is_rejected(small_stream):
    codec, records, ids, mu = small_stream
    x = codec.decode(records, ids, mu)
    assert ct.unpack_header(records[0])[0].version == 5
    for pos in range(len(records[0]) - 4):
        for mask in (0x01, 0x40):
            bad = recrc(flip(records[0], pos, mask))
            if (pos, mask) == (4, 0x01):  # NOTE: version 5 -> 4: a BF16 stream's bytes mean the same there
                assert np.array_equal(codec.decode([bad] + records[1:], ids, mu), x)
                continue
            # NOTE: version 3 -> 2 too: a version 2 stream's digests are blake2b-128, not XXH3-128
            assert_rejected(codec, [bad] + records[1:], ids, mu)
    assert np.array_equal(codec.decode(records, ids, mu), x)


@pytest.mark.parametrize("which", ["bf16", "fp8"])
def test_byte_flips_in_chunks_fail_the_crc(small_stream, fp8_stream, which):
    codec, records, ids, mu = small_stream if which == "bf16" else fp8_stream
    for i in range(1, len(records)):
        rec = records[i]
        positions = sorted(set(range(0, len(rec), 3)) | set(range(len(rec) - 12, len(rec))))
        for pos in positions:
            bad = list(records)
            bad[i] = flip(rec, pos, 1 << (pos % 8))
            assert_rejected(codec, bad, ids, mu, FormatError)


def _positions(lo: int, hi: int, n: int) -> list[int]:
    if hi <= lo:
        return []
    return sorted(set(np.linspace(lo, hi - 1, min(n, hi - lo)).astype(int).tolist()))


@pytest.mark.parametrize("which", ["bf16", "fp8"])
@pytest.mark.parametrize("area", ["fixed", "aux", "states", "word_counts", "words", "bits_len", "bits"])
def test_bit_flips_with_valid_crc_are_rejected(small_stream, fp8_stream, which, area):
    """A corrupted chunk whose crc32 was recomputed: the codec's own checks
    (rANS final states, bit sections, raw digest, mu fingerprint) must catch it."""
    codec, records, ids, mu = small_stream if which == "bf16" else fp8_stream
    expect = (IntegrityError, RansDecodeError, FormatError, MuMismatchError)
    n_tried = 0
    for i in range(1, len(records)):
        lo, hi = chunk_areas(records[0], records[i])[area]
        for k, pos in enumerate(_positions(lo, hi, 40)):
            bad = list(records)
            bad[i] = recrc(flip(records[i], pos, 1 << ((pos + k) % 8)))
            assert_rejected(codec, bad, ids, mu, expect)
            n_tried += 1
    assert n_tried or area == "aux" and which == "bf16"


def test_dropped_last_record(small_stream):
    codec, records, ids, mu = small_stream
    assert_rejected(codec, records[:-1], ids, mu, IntegrityError)
    assert_rejected(codec, records[:1], ids, mu, IntegrityError)


def test_empty_stream(small_stream):
    codec, records, ids, mu = small_stream
    assert_rejected(codec, [], ids, mu)
    assert_rejected(codec, iter([]), ids, mu)


@pytest.mark.parametrize("cut", [0, 1, 3, 4, 11, 12, 79, 80, -5, -4, -1])
def test_record_cut_short(small_stream, cut):
    codec, records, ids, mu = small_stream
    for i in range(len(records)):
        bad = list(records)
        bad[i] = records[i][:cut]
        assert_rejected(codec, bad, ids, mu, (TruncatedError, FormatError))


def test_extra_trailing_record(small_stream):
    codec, records, ids, mu = small_stream
    assert_rejected(codec, records + [records[-1]], ids, mu, IntegrityError)  # duplicate
    assert_rejected(codec, records + [records[1]], ids, mu, IntegrityError)
    assert_rejected(codec, records + [b"garbage!" * 20], ids, mu, FormatError)
    assert_rejected(codec, records + [b""], ids, mu, TruncatedError)
    assert_rejected(codec, records + [records[0]], ids, mu, FormatError)  # a second header


def test_trailing_bytes_inside_a_record(small_stream):
    """A record followed by extra bytes (e.g. two records glued together) is not a
    valid record: FORMAT.md forbids anything after the last chunk record."""
    codec, records, ids, mu = small_stream
    for i in range(len(records)):
        for extra in (b"\0", b"junk", records[-1]):
            bad = list(records)
            bad[i] = records[i] + extra
            assert_rejected(codec, bad, ids, mu, FormatError)
    # the whole stream passed as one record
    assert_rejected(codec, [b"".join(records)], ids, mu)


def test_garbage_bytes(small_stream):
    codec, records, ids, mu = small_stream
    rng = np.random.default_rng(0)
    for n in (1, 4, 50, 110, 111, 500, 5000):
        junk = rng.integers(0, 256, n).astype(np.uint8).tobytes()
        assert_rejected(codec, [junk] + records[1:], ids, mu, FormatError)
        assert_rejected(codec, records[:1] + [junk] + records[2:], ids, mu, FormatError)
        # valid magic, garbage after it
        assert_rejected(codec, [b"SPKV" + junk] + records[1:], ids, mu, FormatError)
        assert_rejected(codec, records[:1] + [b"SPKC" + junk] + records[2:], ids, mu, FormatError)


def test_chunks_reordered(small_stream):
    codec, records, ids, mu = small_stream
    h, c = records[0], records[1:]
    for order in ([1, 0, 2], [0, 2, 1], [2, 1, 0], [0, 0, 2], [0, 1, 1]):
        assert_rejected(codec, [h] + [c[k] for k in order], ids, mu, IntegrityError)
    assert_rejected(codec, [c[0], h] + c[1:], ids, mu, FormatError)  # header not first


def test_wrong_pin(small_stream, make_codec, ckpt):
    codec, records, ids, mu = small_stream
    for pin in ("00" * 32, hashlib.sha256(b"another predictor").hexdigest(),
                ckpt.pin[:-1] + ("0" if ckpt.pin[-1] != "0" else "1")):
        other = make_codec(16, 10, pin=pin)
        assert_rejected(other, records, ids, mu, PinMismatchError)
        # and a stream written under another pin is refused by the real one
        x = codec.decode(records, ids, mu)
        assert_rejected(codec, list(other.encode(x, ids, mu)), ids, mu, PinMismatchError)


def test_mu_mismatch(small_stream):
    """A changed mu in the first, a middle and the last chunk. NOTE: the change must survive the tuned
    model's bf16(a mu + b): one ULP at position 5000 does not under the w8a8x:4 tables (the coder then
    predicts the same, the chunk decodes right, and that is no error), so the top mantissa bit flips."""
    codec, records, ids, mu = small_stream
    bits = bf16_bits(mu).copy()
    for pos in (0, 5000, bits.size - 1):  # first, middle and last chunk
        other = bits.copy()
        other.reshape(-1)[pos] ^= 0x40  # one scalar, by up to half its magnitude
        e = assert_rejected(codec, records, ids, bf16_tensor(other), MuMismatchError)
        assert "chunk" in str(e)


def test_mu_mismatch_fp8(fp8_stream):
    codec, records, ids, mu = fp8_stream
    other = bf16_bits(mu).copy()
    other.reshape(-1)[1234] ^= 1
    assert_rejected(codec, records, ids, bf16_tensor(other), MuMismatchError)


def test_wrong_prompt(small_stream):
    codec, records, ids, mu = small_stream
    assert_rejected(codec, records, ids + 1, mu, PromptMismatchError)
    assert_rejected(codec, records, np.concatenate([ids, ids]), mu, PromptMismatchError)
    assert_rejected(codec, records, ids[:0], mu, PromptMismatchError)
    assert_rejected(codec, records, ids.astype(np.int32) + 7, mu, PromptMismatchError)
    # the digest is of the int64 values, whatever the caller's dtype
    assert prompt_digest(ids.astype(np.int32)) == prompt_digest(ids)


def test_stream_dtype_swapped(small_stream, fp8_stream):
    """A BF16 header claiming FP8 (and vice versa), crc recomputed."""
    for codec, records, ids, mu in (small_stream, fp8_stream):
        hdr = bytearray(records[0])
        hdr[8] = 3 - hdr[8]
        assert_rejected(codec, [recrc(hdr)] + records[1:], ids, mu)
