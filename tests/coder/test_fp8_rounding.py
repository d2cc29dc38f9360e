"""FP8 rounding (format version 5, coder/plan.py, coder/adapt.py): an engine that rounds its
e4m3 codes toward zero (vLLM's CPU cache writer does) gets chunks that carry the rounding
byte and code with mu moved half a step toward zero. Exact arithmetic of the move, the
encoder's choice, round trips bit for bit on both CPU coders with the numpy reference's
bytes, nearest-rounded KV keeping its version 4 chunk bytes, version 4 streams decoding,
and a malformed or misplaced rounding byte rejected.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch
from codec_helpers import bf16_from_float, bf16_tensor, ids_for, shape, versioned_records, with_aux

from speckv.coder import container as ct
from speckv.coder.codec import Fp8KV
from speckv.coder.plan import ROUND_TOWARD_ZERO, chunk_aux, toward_zero_mu
from speckv.errors import IntegrityError, SpeckvError
from speckv.predictor.fp8 import e4m3_values, kv_to_fp8

pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning")

T = 48
EPL, LPC = 256, 2


def _kv(toward_zero: bool, seed: int = 7) -> tuple[Fp8KV, np.ndarray]:
    """(FP8 KV, BF16 mu): x = mu + noise well under the model's sigma, quantised per layer."""
    rng = np.random.default_rng(seed)
    mu_f = rng.standard_normal(shape(T)).astype(np.float32)
    mu = bf16_from_float(mu_f)
    x = bf16_from_float(mu_f + 0.01 * rng.standard_normal(shape(T)).astype(np.float32))
    q, s = kv_to_fp8(torch.from_numpy(x.view(np.int16)).view(torch.bfloat16), toward_zero=toward_zero)
    return Fp8KV(q.numpy(), s.numpy()), mu


def _encoded(make_codec, toward_zero: bool):
    """(codec, kv, mu, ids, records, header) of ``_kv(toward_zero)`` as the codec writes it."""
    codec = make_codec(EPL, LPC)
    kv, mu = _kv(toward_zero)
    ids = ids_for(T)
    records = list(codec.encode(kv, ids, bf16_tensor(mu)))
    return codec, kv, mu, ids, records, ct.unpack_header(records[0])[0]


def _rounding(h: ct.StreamHeader, records: list[bytes]) -> list[bool]:
    return [chunk_aux(h, ct.unpack_chunk(r, h)[0])[2] for r in records[1:]]


def test_toward_zero_codes_are_truncations():
    """kv_to_fp8(toward_zero=True): each code is the largest magnitude not above the value's."""
    x = torch.linspace(-9, 9, 4000).to(torch.bfloat16).reshape(1, 2, 1, -1, 1)
    q, s = kv_to_fp8(x, toward_zero=True)
    v = e4m3_values()[q.numpy().reshape(-1)] * np.repeat(s.numpy().reshape(-1), x.shape[3])
    y = x.float().numpy().reshape(-1)
    assert (np.abs(v) <= np.abs(y) + 1e-6).all() and (np.sign(v) * np.sign(y) >= 0).all()
    q_near, _ = kv_to_fp8(x)
    assert 0.3 < (q != q_near).float().mean().item() < 0.7


def test_toward_zero_mu_is_exact():
    """sign(mu) max(|mu| - 2^(E-4), 0) with E = max(exponent, -6), exactly (float64 check);
    non-finite mu unchanged; a sign never flips."""
    rng = np.random.default_rng(1)
    f = np.concatenate([rng.standard_normal(20000) * 10.0 ** rng.uniform(-4, 2.7, 20000),
                        e4m3_values()[np.isfinite(e4m3_values())], [0.0, -0.0, 2.0 ** -10, -(2.0 ** -11)]])
    f = f.astype(np.float32)
    out = toward_zero_mu(f.view(np.uint32)).view(np.float32).astype(np.float64)
    e = np.maximum(np.floor(np.log2(np.maximum(np.abs(f.astype(np.float64)), 2.0 ** -149))), -6)
    want = np.sign(f) * np.maximum(np.abs(f.astype(np.float64)) - 2.0 ** (e - 4), 0)
    assert np.array_equal(out, want)
    assert (np.signbit(out) == np.signbit(f)).all()
    odd = np.array([np.inf, -np.inf, np.nan], np.float32).view(np.uint32)
    assert np.array_equal(toward_zero_mu(odd), odd)


@pytest.mark.parametrize("toward_zero", [True, False], ids=["toward_zero", "nearest"])
def test_the_encoder_picks_the_engines_rounding(make_codec, toward_zero):
    codec, kv, mu, ids, records, h = _encoded(make_codec, toward_zero)
    assert h.version == ct.FORMAT_VERSION == 5
    assert _rounding(h, records) == [toward_zero] * h.n_chunks
    back = codec.decode(records, ids, bf16_tensor(mu))
    assert np.array_equal(back.codes, kv.codes) and np.array_equal(back.scales, kv.scales)
    v4 = versioned_records(codec, kv, ids, bf16_tensor(mu), 4)
    back4 = codec.decode(v4, ids, bf16_tensor(mu))
    assert np.array_equal(back4.codes, kv.codes)  # version 4 (no rounding byte) still decodes
    bits, bits4 = (8 * sum(map(len, r)) / kv.codes.size for r in (records, v4))
    print(f"\n{toward_zero=}: {bits:.3f} vs version 4 {bits4:.3f} bits a code")
    if toward_zero:  # measured 1.915 vs 2.395 bits a code on this synthetic KV (0.80x)
        assert sum(map(len, records)) < 0.82 * sum(map(len, v4))
    else:  # nearest: every chunk is its version 4 record, byte for byte
        assert records[1:] == v4[1:]


def test_native_writes_the_references_bytes(make_codec):
    kv, mu = _kv(True)
    ids = ids_for(T)
    a = list(make_codec(EPL, LPC, coder="numpy").encode(kv, ids, bf16_tensor(mu)))
    b = list(make_codec(EPL, LPC, coder="native").encode(kv, ids, bf16_tensor(mu)))
    assert a == b
    back = make_codec(EPL, LPC, coder="numpy").decode(b, ids, bf16_tensor(mu))
    assert np.array_equal(back.codes, kv.codes)


@pytest.mark.parametrize("how", ["zero_byte", "two", "dropped", "v4_header", "bf16"])
def test_a_bad_rounding_byte_is_rejected(make_codec, how):
    codec, kv, mu, ids, records, h = _encoded(make_codec, True)
    c = ct.unpack_chunk(records[1], h)[0]
    n_scales = 8 * c.layer_count
    assert c.aux[n_scales] == ROUND_TOWARD_ZERO
    aux, bad, match = bytearray(c.aux), list(records), "rounding byte"
    if how in ("zero_byte", "two"):
        aux[n_scales] = 0 if how == "zero_byte" else 2
        bad[1] = with_aux(h, records[1], bytes(aux))
    elif how == "dropped":  # decodes as rounded to nearest: another KV, caught by the raw digest
        bad[1], match = with_aux(h, records[1], bytes(aux[:n_scales] + aux[n_scales + 1:])), None
    elif how == "v4_header":  # version 4 has no rounding byte: the aux length is wrong there
        bad[0], match = ct.pack_header(dataclasses.replace(h, version=4)), "aux"
    else:  # BF16 chunks never carry one
        x = bf16_from_float(np.random.default_rng(2).standard_normal(shape(T)).astype(np.float32))
        bf = list(codec.encode(x, ids, bf16_tensor(x)))
        hb = ct.unpack_header(bf[0])[0]
        cb = ct.unpack_chunk(bf[1], hb)[0]
        bad = [bf[0], with_aux(hb, bf[1], bytes(cb.aux) + bytes([ROUND_TOWARD_ZERO]))] + bf[2:]
        mu, match = x, "aux"
    with pytest.raises(SpeckvError, match=match) as info:
        codec.decode(bad, ids, bf16_tensor(mu))
    if how != "dropped":
        assert isinstance(info.value, IntegrityError)


@pytest.mark.parametrize("coster", ["numpy", "native"])
def test_the_roundings_prices_are_the_shift_search_base(ckpt, coster):
    """choose_rounding hands choose_shifts each group's cost and surprises at shift 0 under the
    rounding it chose (one pricing fewer an FP8 encode): the same arrays a fresh pricing of the
    rounded mu gives, so the same shifts and bytes, here with some layers moved and some not."""
    from speckv.coder import adapt
    from speckv.coder.model import E4M3, FP32, fp8_log2_sigma
    from speckv.coder.native import NativeCoder
    from speckv.coder.residual import models_of

    m = models_of(ckpt)[2]
    layers = 6
    near, mu = _kv(False, seed=3)
    trunc, _ = _kv(True, seed=3)
    codes = near.codes[:layers].copy()
    codes[2:4] = trunc.codes[2:4]  # an engine that truncated two layers (one chunk of two)
    scales = near.scales[:layers]
    mu2 = NativeCoder(1).prepare_mu(mu[:layers], None, None, scales)
    lg = np.ascontiguousarray(fp8_log2_sigma(m.log2_sigma[:layers].astype(np.int64),
                                             scales.view(np.uint32)[:, :, None, None]), np.int64)
    backend = NativeCoder(1) if coster == "native" else None
    base: list = []
    tz = adapt.choose_rounding(E4M3, FP32, m.tables, codes, mu2, toward_zero_mu, lg, [2, 2, 2], backend,
                               base_out=base)
    assert tz.tolist() == [False, False, True, True, False, False]
    moved = mu2.copy()
    moved[tz] = toward_zero_mu(mu2[tz])
    tok = adapt.sample_tokens(codes.shape[3])
    xs = codes[:, :, :, tok].reshape(-1, len(range(*tok.indices(codes.shape[3]))), codes.shape[4])
    fresh = adapt._group_costs(E4M3, FP32, m.tables, xs, moved[:, :, :, tok].reshape(xs.shape),
                               lg.reshape(-1, codes.shape[4]), np.zeros(len(xs), np.int64), backend)
    assert all(np.array_equal(a, b) for a, b in zip(base[0], fresh, strict=True))
    assert np.array_equal(adapt.choose_shifts(E4M3, FP32, m.tables, codes, moved, lg, backend, base=base[0]),
                          adapt.choose_shifts(E4M3, FP32, m.tables, codes, moved, lg, backend))
