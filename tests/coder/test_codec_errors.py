"""Typed errors of the codec on corrupt, truncated, reordered, mismatched and crafted
streams: every bad input raises a ``SpeckvError`` and nothing else."""

from __future__ import annotations

import contextlib
import functools
import hashlib
import re
from dataclasses import replace
from unittest import mock

import numpy as np
import pytest
from codec_helpers import (
    ADVERSARIAL,
    ALL_CODES,
    LAYERS,
    SCALES,
    _sample_bf16,
    assert_rejected,
    bf16_from_float,
    bf16_tensor,
    chunk_areas,
    flip,
    fp8_mu,
    ids_for,
    recrc,
    round_trip_bf16,
    round_trip_fp8,
    shape,
    tile,
)

from speckv.coder import codec as codec_module
from speckv.coder import container as ct
from speckv.coder import model
from speckv.coder.bitpack import pack_fields, pack_unary
from speckv.coder.codec import Codec, bf16_bits, digest, prompt_digest
from speckv.coder.container import FormatError, TruncatedError
from speckv.coder.model import BF16, E4M3, FP32, context, fp8_log2_sigma, low_bits, magnitude
from speckv.coder.rans import LANES, RansDecodeError, rans_encode
from speckv.coder.tables import NOOP_TABLE
from speckv.errors import (
    IntegrityError,
    MuMismatchError,
    PinMismatchError,
    PromptMismatchError,
)

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
    codec = make_codec(16, 15)
    codes = tile(ALL_CODES, 1)
    scales = SCALES["mixed"]
    mu = fp8_mu(codes, scales, "near")
    ids = ids_for(1)
    records = round_trip_fp8(codec, codes, scales, mu, ids)
    return codec, records, ids, bf16_tensor(mu)


def test_every_header_byte_flip_is_rejected(small_stream):
    codec, records, ids, mu = small_stream
    for pos in range(len(records[0])):
        for mask in (0x01, 0x80):
            assert_rejected(codec, [flip(records[0], pos, mask)] + records[1:], ids, mu,
                            (FormatError, TruncatedError))


def test_every_header_field_change_with_valid_crc_is_rejected(small_stream):
    codec, records, ids, mu = small_stream
    for pos in range(len(records[0]) - 4):
        for mask in (0x01, 0x40):
            bad = recrc(flip(records[0], pos, mask))
            assert_rejected(codec, [bad] + records[1:], ids, mu)


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
    codec, records, ids, mu = small_stream
    bits = bf16_bits(mu).copy()
    for pos in (0, 5000, bits.size - 1):  # first, middle and last chunk
        other = bits.copy()
        other.reshape(-1)[pos] ^= 1  # one ULP in one scalar
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


# ----------------------------------------------- crafted malicious streams
#
# A crafted stream is framed as an encoder frames it (valid crc32s, the right mu
# fingerprint) and its symbols are chosen by the test. Each chunk carries the raw
# digest of exactly the KV that a decoder WITHOUT the symbol checks would return
# (``_lenient``), so a crafted stream that is rejected is rejected by the symbol or
# raw-section check the test names, never by the final checksum: with that check
# switched off the same stream decodes (``test_the_named_check_alone_rejects``), and
# crafted streams of symbols an encoder may emit decode bit for bit
# (``test_crafted_legit_streams_decode``), which shows the digests are right.

# the messages of the checks (coder/model.py desymbolize and helpers, coder/bitpack.py)
NOT_ESCAPED = "an element with a non-finite mu was not escaped"
NO_FINITE = "decoded a bin that holds no finite value of this format"
ZERO_EXP = "zero-bin exponent distance out of range"
SHORT = r"bit sections need more than the \d+ bytes present"
UNARY_LONG = "unary section longer than any encoder writes"
PADDING = "non-zero padding after bit fields"
UNARY_COUNT = r"expected \d+ unary codes, found \d+"
UNARY_TAIL = r"unary codes: \d+ bytes for \d+ bits"

NAN_MU = [0x7FC0, 0xFFFF, 0x7F81, 0xFFC0]  # mu's bin is 0 / -1 on the top grid
INF_MU = [0x7F80, 0xFF80]  # mu's bin is pinned at +-MAX_BIN: no finite value there
FINITE_MU = [0x7F7F, 0xFF7F, 0x0000, 0x8000, 0x0001, 0x3F80]

_NORMAL_BITS = model._normal_bits
_DESYMBOLIZE = model.desymbolize
_UNPACK_FIELDS = model.unpack_fields
_UNPACK_UNARY = model.unpack_unary


def _normal_bits_unchecked(fx, k, c, mag, nb, low, normal):
    return _NORMAL_BITS(fx, k, c, mag, nb, low, np.zeros_like(normal))  # ``normal`` only gates the check


def _zero_bits_unchecked(fx, k, c, man, delta):
    e = k + fx.bias - 1 - delta  # model._zero_bits without its range check
    return ((c >> 31) & 1) << (fx.bits - 1) | (e << fx.mant) | man


def _desymbolize_any_mu(fx, tab, ctx, j, raw):
    # mu_ok only gates the non-finite-mu check in desymbolize
    return _DESYMBOLIZE(fx, tab, replace(ctx, mu_ok=np.ones_like(ctx.mu_ok)), j, raw)


def _unpack_fields_any_padding(buf, widths):
    total = int(np.asarray(widths, np.int64).sum())
    if total % 8 and buf:
        buf = buf[:-1] + bytes([buf[-1] & ~((1 << (8 - total % 8)) - 1) & 0xFF])
    return _UNPACK_FIELDS(buf, widths)


def _unpack_unary_any_tail(buf, n):
    return _UNPACK_UNARY(buf.rstrip(b"\0"), n)


@contextlib.contextmanager
def _switched_off(*checks: str):
    """The real decoder with the named checks switched off (and nothing else changed)."""
    patches = {NO_FINITE: (model, "_normal_bits", _normal_bits_unchecked),
               ZERO_EXP: (model, "_zero_bits", _zero_bits_unchecked),
               NOT_ESCAPED: (codec_module, "desymbolize", _desymbolize_any_mu),
               PADDING: (model, "unpack_fields", _unpack_fields_any_padding),
               UNARY_TAIL: (model, "unpack_unary", _unpack_unary_any_tail)}
    with contextlib.ExitStack() as stack:
        for check in checks:
            stack.enter_context(mock.patch.object(*patches[check]))
        yield


def _lenient(fx, tab, ctx, j, raw) -> np.ndarray:
    """What ``desymbolize`` returns with its symbol checks off (bins holding no finite
    value, zero-bin exponents below 0, non-escaped elements of non-finite mu); the
    raw-section checks stay on (IntegrityError where the sections do not parse)."""
    with _switched_off(NO_FINITE, ZERO_EXP):
        return _desymbolize_any_mu(fx, tab, ctx, j, raw)


def _sections(fx, ctx, radius, j, rng, delta=None) -> list[bytes]:
    """Raw bit sections that fit symbols ``j`` (``model.symbolize``'s layout LOW | ZMAN |
    ESC | UNARY): random low bits (zero for FP8, where some would spell the e4m3 NaN),
    zero-bin mantissas and escaped patterns; ``delta(limit, rng)``: the unary exponent
    distances of the zero-bin elements (default 0; an encoder writes 0..limit)."""
    esc = j == 2 * radius + 1
    mag = magnitude(ctx.c_mu + (j - radius))
    zero = (mag == 0) & ~esc
    normal = ~(esc | zero)
    width = np.where(normal, np.maximum(low_bits(fx, mag), 0), 0)
    low = rng.integers(0, 1 << width) if fx is BF16 else np.zeros_like(width)
    zi, ei = np.flatnonzero(zero), np.flatnonzero(esc)
    limit = ctx.k[zi].astype(np.int64) + fx.bias - 1  # an exponent field of 0: a subnormal
    d = np.zeros(len(zi), np.int64) if delta is None else np.asarray(delta(limit, rng), np.int64)
    return [pack_fields(low, width),
            pack_fields(rng.integers(0, 1 << fx.mant, len(zi)), np.full(len(zi), fx.mant)),
            pack_fields(rng.integers(0, 1 << fx.bits, len(ei)), np.full(len(ei), fx.bits)),
            pack_unary(d)]


def _craft(codec: Codec, fmt, mu_bits: np.ndarray, ids: np.ndarray, choose, bits: bytes | None = None,
           scales: np.ndarray | None = None, delta=None, tamper=None) -> tuple[list[bytes], np.ndarray | None]:
    """(records, kv): a stream framed as an encoder frames it whose rANS symbols are
    ``choose(radius, rng)``, and the KV a decoder without symbol checks returns for it
    (None where its raw bits do not parse). Raw bits: ``bits`` verbatim when given, else
    ``_sections`` that fit the symbols, passed through ``tamper(sections) -> bytes`` when
    given. Each chunk's raw digest is that of the lenient decoder's KV of the untampered
    bits (16 zero bytes where they do not parse: no decoder gets as far as the digest)."""
    T = mu_bits.shape[3]
    h = ct.StreamHeader(dtype=ct.DTYPE_BF16 if fmt is BF16 else ct.DTYPE_FP8, model=1,
                        pin=bytes.fromhex(codec.pin), shape=shape(T), prompt_digest=prompt_digest(ids),
                        elems_per_lane=codec.config.elems_per_lane,
                        layers_per_chunk=min(codec.config.layers_per_chunk, LAYERS))
    lg = codec.log2_sigma
    if fmt is BF16:
        mu_c, fm = mu_bits, BF16
    else:
        with np.errstate(all="ignore"):
            y = (mu_bits.astype(np.uint32) << 16).view(np.float32) / scales[:, :, None, None, None]
        mu_c, fm = y.view(np.uint32), FP32
        lg = fp8_log2_sigma(lg, scales.view(np.uint32)[:, :, None, None])
    tab = codec.tables  # model 1's (the seed model: mu as predicted)
    g, rng = tab.gauss, np.random.default_rng(0)
    kv = np.zeros(h.shape, np.uint16 if fmt is BF16 else np.uint8)
    parsed = True
    records = [ct.pack_header(h)]
    for i in range(h.n_chunks):
        start, count = h.chunk_layers(i)
        sl = slice(start, start + count)
        m = mu_c[sl]
        ctx = context(fmt, fm, m.ravel(), np.broadcast_to(lg[sl][:, :, :, None, :], m.shape).ravel())
        radius = tab.radius[ctx.t]
        j = np.asarray(choose(radius, rng), np.int64)
        sections = _sections(fmt, ctx, radius, j, rng, delta) if bits is None else [bits]
        raw = b"".join(sections)
        aux = b"" if scales is None else scales[sl].astype("<f4").tobytes()
        raw_digest = bytes(16)
        try:
            kv[sl] = np.ascontiguousarray(_lenient(fmt, tab, ctx, j, raw).reshape(m.shape), kv.dtype)
            raw_digest = digest(aux, kv[sl])  # what codec.verified compares
        except IntegrityError:
            parsed = False
        n = h.chunk_elements(i)
        size = h.chunk_blocks(i) * h.elems_per_lane * LANES
        idx = np.full(size, g.offset[NOOP_TABLE], np.int64)
        idx[:n] = g.offset[ctx.t] + j
        grid = (h.chunk_blocks(i), h.elems_per_lane, LANES)
        rb = rans_encode(g.cum[idx].reshape(grid), g.freq[idx].reshape(grid))
        records.append(ct.pack_chunk(ct.Chunk(
            index=i, layer_start=start, layer_count=count, steps=h.elems_per_lane if n else 0,
            mu_fingerprint=digest(m.tobytes()), raw_digest=raw_digest, aux=aux, states=rb.states,
            word_counts=rb.word_counts, words=rb.words, bits=raw if tamper is None else tamper(sections))))
    return records, kv if parsed else None


CHOICES = {
    "centre": lambda r, rng: r,  # d = 0: mu's own bin
    "low_edge": lambda r, rng: 0 * r,  # d = -R
    "high_edge": lambda r, rng: 2 * r,  # d = +R
    "escape": lambda r, rng: 2 * r + 1,
    "random": lambda r, rng: rng.integers(0, 2 * r + 2),
}


def _one_escape(r, rng):
    """mu's own bin everywhere but the first element, which escapes."""
    j = r.copy()
    j[0] = 2 * r[0] + 1
    return j


def _bf16_case(make_codec, mu_value: int, choice, **kw):
    codec = make_codec(8, 16)
    ids = ids_for(1)
    mu = np.full(shape(1), mu_value, np.uint16)
    records, kv = _craft(codec, BF16, mu, ids, CHOICES.get(choice, choice), **kw)
    return codec, records, kv, ids, bf16_tensor(mu)


def _fp8_case(make_codec, mu_value: float, scale: float, choice, **kw):
    codec = make_codec(8, 16)
    ids = ids_for(1)
    mu = bf16_from_float(np.full(shape(1), mu_value, np.float32))
    scales = np.full((LAYERS, 2), scale, np.float32)
    records, kv = _craft(codec, E4M3, mu, ids, CHOICES.get(choice, choice), scales=scales, **kw)
    return codec, records, kv, ids, bf16_tensor(mu)


def _rejected_by(case, message: str) -> None:
    codec, records, _, ids, mu = case
    with pytest.raises(IntegrityError, match=message):
        codec.decode(records, ids, mu)


def _decodes_to(case, kv: np.ndarray | None = None) -> None:
    codec, records, lenient_kv, ids, mu = case
    want = lenient_kv if kv is None else kv
    assert want is not None
    out = codec.decode(records, ids, mu)
    assert np.array_equal(out if isinstance(out, np.ndarray) else out.codes, want)


# ------------------------------------------------------ legit crafted streams

LEGIT_BF16 = ([(m, "escape") for m in NAN_MU + INF_MU + FINITE_MU]
              + [(m, "centre") for m in FINITE_MU]
              + [(0x7F7F, "low_edge"), (0xFF7F, "high_edge")])


@pytest.mark.parametrize("mu_value,choice", LEGIT_BF16)
def test_crafted_legit_streams_decode(make_codec, mu_value, choice):
    """Symbols an encoder may emit (escapes, mu's own bin, bins towards zero from the
    largest finite value), raw sections that fit: the stream decodes to exactly what
    the lenient decoder says, so ``_craft``'s digests, fingerprints and crcs are right."""
    _decodes_to(_bf16_case(make_codec, mu_value, choice))


@pytest.mark.parametrize("mu_value,scale,choice", [(0.0, 1.0, "centre"), (1.0, 1.0, "centre"),
                                                   (-3.0, 0.01, "centre"), (1e6, 1e30, "centre"),
                                                   (float("nan"), 1.0, "escape"), (1e6, 1.0, "escape"),
                                                   (float("inf"), 1e-6, "escape")])
def test_crafted_legit_streams_decode_fp8(make_codec, mu_value, scale, choice):
    _decodes_to(_fp8_case(make_codec, mu_value, scale, choice))


@pytest.mark.parametrize("mu_value,choice", [(0x7F7F, "centre"), (0x7F7F, "low_edge"), (0xFF7F, "centre"),
                                             (0xFF7F, "high_edge")])
def test_crafted_streams_without_raw_bits_can_be_legit(make_codec, mu_value, choice):
    """Near the largest finite value every bin holds one value (no low bits): an empty
    raw section is then what an encoder writes, and the stream decodes."""
    case = _bf16_case(make_codec, mu_value, choice, bits=b"")
    assert case[2] is not None
    _decodes_to(case)


# ------------------------------------------- symbols no encoder emits

NON_ESCAPES = ["centre", "low_edge", "high_edge", "random"]


@pytest.mark.parametrize("choice", NON_ESCAPES)
@pytest.mark.parametrize("mu_value", NAN_MU)
def test_non_escaped_element_of_nan_mu(make_codec, mu_value, choice):
    _rejected_by(_bf16_case(make_codec, mu_value, choice), NOT_ESCAPED)


@pytest.mark.parametrize("scale,choice", [(s, c) for s in (1.0, 1e30) for c in NON_ESCAPES] + [(1e-6, "centre")])
def test_non_escaped_element_of_nan_mu_fp8(make_codec, scale, choice):
    """(At scale 1e-6 the window's edges lie past e4m3's largest value, which the
    bin check catches first: see test_bin_past_the_largest_finite_value_fp8.)"""
    _rejected_by(_fp8_case(make_codec, float("nan"), scale, choice), NOT_ESCAPED)


@pytest.mark.parametrize("mu_value,choice", [(m, c) for m in INF_MU for c in NON_ESCAPES]
                         + [(0x7F7F, "high_edge"), (0x7F7F, "random"), (0xFF7F, "low_edge"),
                            (0xFF7F, "random")])
def test_bin_past_the_largest_finite_value(make_codec, mu_value, choice):
    """+-Inf mu sits in bin +-MAX_BIN; bins beyond +-max finite hold no BF16 value."""
    _rejected_by(_bf16_case(make_codec, mu_value, choice), NO_FINITE)


@pytest.mark.parametrize("mu_value,scale,choice", [
    (1e6, 1.0, "centre"), (-1e6, 1.0, "centre"), (3.0e38, 1e30, "centre"), (1.0, 1e-6, "centre"),
    (float("inf"), 1.0, "centre"), (float("-inf"), 1e30, "centre"), (3.0e38, 1e-6, "centre"),
    (float("nan"), 1e-6, "low_edge"), (float("nan"), 1e-6, "high_edge"), (float("nan"), 1e-6, "random")])
def test_bin_past_the_largest_finite_value_fp8(make_codec, mu_value, scale, choice):
    """mu / scale beyond e4m3's 448 (or overflowing to Inf): mu's own bin holds no e4m3
    value; at scale 1e-6 sigma spans far more than e4m3's range, so for NaN mu (bin 0
    on the coarsest grid) the window's edges lie past 448 too."""
    _rejected_by(_fp8_case(make_codec, mu_value, scale, choice), NO_FINITE)


def _one_too_far(limit, rng):
    d = np.zeros(len(limit), np.int64)
    d[0] = limit[0] + 1  # an exponent field of -1
    return d


def test_zero_bin_exponent_below_zero(make_codec):
    _rejected_by(_bf16_case(make_codec, 0x0000, "centre", delta=_one_too_far), ZERO_EXP)


def test_zero_bin_exponent_below_zero_fp8(make_codec):
    """Scale 1e-6: a coarse grid, so the zero bin spans many binades and one extra
    unary bit stays within what the unary-length bound allows."""
    _rejected_by(_fp8_case(make_codec, 0.0, 1e-6, "centre", delta=_one_too_far), ZERO_EXP)


# ---------------------------------------------------- raw sections of the wrong size

def _set_padding_bit(sections):
    low, zman, esc, unary = sections
    return low + zman[:-1] + bytes([zman[-1] | 1]) + esc + unary


TAMPER = {  # (mu, choice, tamper, the check that must reject it)
    "cut_short": (0x3F80, "escape", lambda s: b"".join(s)[:-1], SHORT),
    "empty": (0x3F80, "escape", lambda s: b"", SHORT),
    "junk_after": (0x3F80, "escape", lambda s: b"".join(s) + b"\x01" * 8, UNARY_LONG),
    "padding_bit": (0x0000, _one_escape, _set_padding_bit, PADDING),
    "unary_code_missing": (0x0000, "centre", lambda s: b"".join(s[:3]) + pack_unary(np.zeros(6143)), UNARY_COUNT),
    "zero_byte_after_unary": (0x0000, "centre", lambda s: b"".join(s) + b"\0", UNARY_TAIL),
}


@pytest.mark.parametrize("name", list(TAMPER))
def test_raw_sections_of_the_wrong_size(make_codec, name):
    mu_value, choice, tamper, check = TAMPER[name]
    _rejected_by(_bf16_case(make_codec, mu_value, choice, tamper=tamper), check)


@pytest.mark.parametrize("bits,check", [(b"", SHORT), (b"\xff" * 64, SHORT), (bytes(range(256)) * 40, SHORT)])
@pytest.mark.parametrize("mu_value", [0x7FC0, 0x3F80, 0x0000])
def test_arbitrary_raw_bytes_for_escapes(make_codec, mu_value, bits, check):
    """Every element escaped needs 16 raw bits each; a few bytes are too few."""
    _rejected_by(_bf16_case(make_codec, mu_value, "escape", bits=bits), check)


@pytest.mark.parametrize("bits,check", [(b"\xff" * 64, SHORT), (bytes(range(256)) * 40, UNARY_COUNT),
                                        ])
def test_arbitrary_raw_bytes_for_zero_bins(make_codec, bits, check):
    """mu = 0, every element in mu's own (zero) bin: 7 mantissa bits each, then unary codes."""
    _rejected_by(_bf16_case(make_codec, 0x0000, "centre", bits=bits), check)


# ------------------------------------------------------------ every combination

SYMBOL_CHECKS = "|".join([NOT_ESCAPED, NO_FINITE, ZERO_EXP, SHORT, UNARY_LONG, PADDING, UNARY_COUNT, UNARY_TAIL])


def _decoded_or_rejected(case) -> str:
    """The stream decodes to exactly the KV its symbols and raw bits spell, or a symbol
    or raw-section check rejects it (never the checksum: its digest is right)."""
    codec, records, kv, ids, mu = case
    try:
        out = codec.decode(records, ids, mu)
    except IntegrityError as e:
        assert re.search(SYMBOL_CHECKS, str(e)), str(e)
        return str(e)
    assert kv is not None, "raw bits that do not parse were accepted"
    assert np.array_equal(out if isinstance(out, np.ndarray) else out.codes, kv)
    return "decoded"


BITS = {"fitting": None, "empty": b"", "ff64": b"\xff" * 64, "ramp": bytes(range(256)) * 40}


@pytest.mark.parametrize("bits", list(BITS))
@pytest.mark.parametrize("mu_value", INF_MU + NAN_MU[:2] + FINITE_MU)
@pytest.mark.parametrize("choice", list(CHOICES))
def test_crafted_symbols_bf16(make_codec, choice, mu_value, bits):
    """Symbols no encoder emits (non-escapes for non-finite mu, bins past the largest
    finite value, raw sections of the wrong size) are typed errors of the symbol checks;
    the rest decode to what they spell."""
    _decoded_or_rejected(_bf16_case(make_codec, mu_value, choice, bits=BITS[bits]))


@pytest.mark.parametrize("bits", ["fitting", "empty", "x55"])
@pytest.mark.parametrize("scale", [1e-6, 1.0, 1e30])
@pytest.mark.parametrize("mu_value", [1e6, -1e6, 0.0, 3.0e38, float("inf"), float("nan")])
@pytest.mark.parametrize("choice", list(CHOICES))
def test_crafted_symbols_fp8(make_codec, choice, mu_value, scale, bits):
    raw = {"fitting": None, "empty": b"", "x55": b"\x55" * 3000}[bits]
    _decoded_or_rejected(_fp8_case(make_codec, mu_value, scale, choice, bits=raw))


# ------------------------------------------- the named check alone rejects

ALONE = {  # a crafted stream, the check that rejects it, the later checks it also fails
    "nan_mu_not_escaped": (lambda mc: _bf16_case(mc, 0x7FC0, "random"), NOT_ESCAPED, ()),
    "nan_mu_not_escaped_fp8": (lambda mc: _fp8_case(mc, float("nan"), 1.0, "centre"), NOT_ESCAPED, ()),
    "inf_mu_bin": (lambda mc: _bf16_case(mc, 0x7F80, "centre"), NO_FINITE, (NOT_ESCAPED,)),
    "past_max_finite": (lambda mc: _bf16_case(mc, 0x7F7F, "high_edge"), NO_FINITE, ()),
    "past_e4m3_max": (lambda mc: _fp8_case(mc, 1e6, 1.0, "centre"), NO_FINITE, ()),
    "zero_bin_exponent": (lambda mc: _bf16_case(mc, 0x0000, "centre", delta=_one_too_far), ZERO_EXP, ()),
    "zero_bin_exponent_fp8": (lambda mc: _fp8_case(mc, 0.0, 1e-6, "centre", delta=_one_too_far), ZERO_EXP, ()),
    "padding_bit": (lambda mc: _bf16_case(mc, 0x0000, _one_escape, tamper=_set_padding_bit), PADDING, ()),
    "zero_byte_after_unary": (lambda mc: _bf16_case(mc, 0x0000, "centre", tamper=TAMPER["zero_byte_after_unary"][2]),
                              UNARY_TAIL, ()),
}


@pytest.mark.parametrize("name", list(ALONE))
def test_the_named_check_alone_rejects(make_codec, name):
    """With the named check switched off (every other check on) the same stream is
    rejected only by the later checks it also fails, and with those off too it
    decodes, to the KV its symbols and raw bits spell: nothing else, the final
    checksum included, would have caught it."""
    build, check, later = ALONE[name]
    _rejected_by(build(make_codec), check)  # numpy and native alike
    # NOTE: switching checks off patches the numpy decoder, so the rest runs on it
    case = build(functools.partial(make_codec, coder="numpy"))
    off = (check,)
    for nxt in later:
        with _switched_off(*off):
            _rejected_by(case, nxt)
        off += (nxt,)
    with _switched_off(*off):
        _decodes_to(case)
