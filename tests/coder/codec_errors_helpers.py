"""Crafted malicious codec streams for the typed-error tests (``test_codec_crafted*``).

A crafted stream is framed as an encoder frames it (valid crc32s, the right mu
fingerprint) and its symbols are chosen by the test. Each chunk carries the raw
digest of exactly the KV that a decoder WITHOUT the symbol checks would return
(``_lenient``), so a crafted stream that is rejected is rejected by the symbol or
raw-section check the test names, never by the final checksum: with that check
switched off the same stream decodes (``test_the_named_check_alone_rejects``), and
crafted streams of symbols an encoder may emit decode bit for bit
(``test_crafted_legit_streams_decode``), which shows the digests are right."""

from __future__ import annotations

import contextlib
from dataclasses import replace
from unittest import mock

import numpy as np
import pytest
from codec_helpers import LAYERS, bf16_from_float, bf16_tensor, ids_for, shape

from speckv.coder import container as ct
from speckv.coder import model
from speckv.coder import reference as reference_module
from speckv.coder.bitpack import pack_fields, pack_unary
from speckv.coder.codec import Codec, digest, prompt_digest
from speckv.coder.model import BF16, E4M3, FP32, context, fp8_log2_sigma, low_bits, magnitude
from speckv.coder.rans import LANES, rans_encode
from speckv.coder.tables import NOOP_TABLE
from speckv.digests import algorithm_of
from speckv.errors import IntegrityError

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
               NOT_ESCAPED: (reference_module, "desymbolize", _desymbolize_any_mu),
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
            raw_digest = digest(aux, kv[sl], algorithm=algorithm_of(h.version))  # what codec.verified compares
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
            mu_fingerprint=digest(m.tobytes(), algorithm=algorithm_of(h.version)), raw_digest=raw_digest, aux=aux,
            states=rb.states,
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


def _one_too_far(limit, rng):
    d = np.zeros(len(limit), np.int64)
    d[0] = limit[0] + 1  # an exponent field of -1
    return d


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
