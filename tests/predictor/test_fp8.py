"""FP8 e4m3 quantisation against an independent brute-force reference.

The reference finds, for every scaled value, the nearest finite e4m3 value of
the same sign by exhaustive search over the 256 codes, breaking exact ties
towards the code with an even mantissa (lowest bit 0); scales are recomputed
in float32 exactly as documented (amax over finite values / 448, 1.0 for
all-zero slices). Codes are compared as bytes, never approximately.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from speckv.predictor.fp8 import E4M3_MAX, dequantize_e4m3, e4m3_values, kv_to_fp8, quantize_e4m3, weight_to_fp8

SETTINGS = settings(max_examples=60, deadline=None, database=None,
                    suppress_health_check=[HealthCheck.too_slow])

VALS = e4m3_values()
CODES = np.arange(256)
FINITE = np.isfinite(VALS)
POS_CODES = CODES[FINITE & (CODES < 0x80)]  # 0x00 .. 0x7e
NEG_CODES = CODES[FINITE & (CODES >= 0x80)]  # 0x80 .. 0xfe
NAN_CODE = 0x7F


# ------------------------------------------------------------------ reference


def ref_code(y: float) -> int:
    """Nearest e4m3 code of a float32 value y (exhaustive search, ties to even)."""
    if not np.isfinite(y):
        return NAN_CODE
    cands = NEG_CODES if np.signbit(y) else POS_CODES
    d = np.abs(VALS[cands] - float(y))
    best = cands[d == d.min()]
    if len(best) > 1:
        best = best[(best & 1) == 0]
    assert len(best) == 1, (y, best)
    return int(best[0])


def ref_scale(x: np.ndarray) -> np.float32:
    """float32(amax over finite |x|) / 448 in float32; 1.0 when that is 0."""
    a = np.abs(x.astype(np.float32))
    a = a[np.isfinite(a)]
    amax = np.float32(a.max()) if a.size else np.float32(0.0)
    if amax == 0:
        return np.float32(1.0)
    return np.float32(amax / np.float32(E4M3_MAX))


def ref_quantize(x: np.ndarray, scale: np.float32) -> np.ndarray:
    y = x.astype(np.float32) / np.float32(scale)
    return np.array([ref_code(v) for v in y.ravel()], dtype=np.uint8).reshape(x.shape)


def bf16_to_np(t: torch.Tensor) -> np.ndarray:
    return t.float().numpy()


# ------------------------------------------------------------------ the value table


def test_e4m3_values_match_torch_float8():
    """The value table against torch's own float8_e4m3fn decoding (an independent one)."""
    t = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(torch.float8_e4m3fn).double().numpy()
    assert np.array_equal(np.isnan(VALS), np.isnan(t))
    assert np.array_equal(VALS[FINITE], t[FINITE])
    assert np.array_equal(np.signbit(VALS[FINITE]), np.signbit(t[FINITE]))
    assert VALS[0x7E] == 448.0 and VALS[0xFE] == -448.0
    assert VALS[0x38] == 1.0 and VALS[0x01] == 2.0**-9 and VALS[0x08] == 2.0**-6
    assert set(np.flatnonzero(~FINITE)) == {0x7F, 0xFF}
    assert E4M3_MAX == np.nanmax(VALS)


# ------------------------------------------------------------------ kv_to_fp8


def check_kv(kv: torch.Tensor) -> None:
    q, scale = kv_to_fp8(kv)
    assert q.dtype == torch.uint8 and q.shape == kv.shape
    assert scale.dtype == torch.float32 and scale.shape == (kv.shape[0], 2)
    x = bf16_to_np(kv)
    want_q = np.empty(kv.shape, np.uint8)
    for layer in range(kv.shape[0]):
        for j in range(2):
            s = ref_scale(x[layer, j])
            assert scale[layer, j].numpy().tobytes() == np.float32(s).tobytes(), (layer, j)
            want_q[layer, j] = ref_quantize(x[layer, j], s)
    got = q.numpy()
    bad = np.argwhere(got != want_q)
    assert bad.size == 0, [(tuple(i), x[tuple(i)], got[tuple(i)], want_q[tuple(i)]) for i in bad[:5]]


@pytest.mark.parametrize("k", [-12, -3, 0, 4])
def test_kv_to_fp8_exact_ties_and_subnormals(k):
    """amax = 448 * 2^k makes the scale exactly 2^k, so every midpoint between two
    adjacent e4m3 values (normal and subnormal) is an exact tie after scaling."""
    pos = VALS[POS_CODES]  # ascending: 0, 2^-9, ..., 448
    mids = (pos[:-1] + pos[1:]) / 2.0
    quarter = pos[:-1] + (pos[1:] - pos[:-1]) / 4.0  # not a tie: rounds down
    tiny = np.array([2.0**-11, 2.0**-10, 3 * 2.0**-11, 0.0])  # below/at half the smallest subnormal
    vals = np.concatenate([[448.0], mids, quarter, pos, tiny])
    vals = np.concatenate([vals, -vals])
    n = len(vals)
    kv = torch.zeros((2, 2, 1, n, 1), dtype=torch.float64)
    kv[0, 0, 0, :, 0] = torch.from_numpy(vals * 2.0**k)
    kv[0, 1, 0, :, 0] = torch.from_numpy(vals[::-1].copy() * 2.0**k)
    kv[1, 0, 0, :, 0] = torch.from_numpy(vals * 2.0**k) / 7  # a scale that is not a power of two
    kv = kv.to(torch.bfloat16)  # layer 1, v: an all-zero slice
    # every constructed value is exact in bf16
    assert np.array_equal(kv[0, 0, 0, :, 0].double().numpy(), vals * 2.0**k)
    check_kv(kv)

    q, scale = kv_to_fp8(kv)
    assert scale[0, 0].item() == 2.0**k and scale[0, 1].item() == 2.0**k
    assert scale[1, 1].item() == 1.0
    # the ties, checked by rule too (independently of the brute force)
    got = q[0, 0, 0, 1 : len(mids) + 1, 0].numpy().astype(np.int64)
    lower = POS_CODES[:-1]
    want = np.where(lower % 2 == 0, lower, lower + 1)
    assert np.array_equal(got, want)
    # a half of the smallest subnormal is a tie between 0 and 2^-9: rounds to 0 (even)
    i = 1 + 3 * len(mids) + 1 + 1  # position of 2^-10 in `vals`
    assert vals[i] == 2.0**-10 and q[0, 0, 0, i, 0].item() == 0x00
    assert q[0, 0, 0, n // 2 + i, 0].item() == 0x80  # -2^-10 -> -0


@SETTINGS
@given(data=st.data())
def test_kv_to_fp8_matches_brute_force(data):
    layers = data.draw(st.integers(1, 2))
    heads = data.draw(st.integers(1, 2))
    tokens = data.draw(st.integers(1, 5))
    dim = data.draw(st.integers(1, 4))
    elems = st.one_of(
        st.floats(width=32, allow_nan=False, allow_infinity=False, min_value=-1e4, max_value=1e4),
        st.floats(width=32, allow_nan=True, allow_infinity=True),
        st.sampled_from([0.0, -0.0, 1.0, -1.0, 448.0, 2.0**-9, -(2.0**-10)]),
    )
    x = data.draw(hnp.arrays(np.float32, (layers, 2, heads, tokens, dim), elements=elems))
    check_kv(torch.from_numpy(x).to(torch.bfloat16))


def test_kv_to_fp8_nonfinite_and_zero_slices():
    kv = torch.zeros((1, 2, 1, 4, 2), dtype=torch.bfloat16)
    kv[0, 0, 0, :, 0] = torch.tensor([float("nan"), float("inf"), -float("inf"), 3.0])
    kv[0, 1, 0, :, 0] = torch.tensor([-0.0, 0.0, -0.0, 0.0])
    q, scale = kv_to_fp8(kv)
    # non-finite values are ignored by the scale and become the e4m3 NaN
    assert scale[0, 0].item() == np.float32(3.0) / np.float32(448.0)
    assert q[0, 0, 0, :3, 0].tolist() == [NAN_CODE] * 3
    assert q[0, 0, 0, 3, 0].item() == 0x7E  # the amax maps to 448
    # an all-zero slice: scale 1.0, signed zeros keep their sign
    assert scale[0, 1].item() == 1.0
    assert q[0, 1, 0, :, 0].tolist() == [0x80, 0x00, 0x80, 0x00]
    check_kv(kv)


def test_kv_to_fp8_empty_tokens():
    kv = torch.empty((3, 2, 2, 0, 4), dtype=torch.bfloat16)
    q, scale = kv_to_fp8(kv)
    assert q.shape == kv.shape and q.dtype == torch.uint8
    assert torch.equal(scale, torch.ones((3, 2)))


# ------------------------------------------------------------------ weights


@SETTINGS
@given(w=hnp.arrays(np.float32, st.tuples(st.integers(1, 5), st.integers(1, 6)),
                    elements=st.floats(width=32, allow_nan=False, allow_infinity=False,
                                       min_value=-100.0, max_value=100.0)))
def test_weight_to_fp8_per_row(w):
    wt = torch.from_numpy(w).to(torch.bfloat16)
    q, scale = weight_to_fp8(wt)
    assert q.dtype == torch.uint8 and q.shape == wt.shape
    assert scale.dtype == torch.float32 and scale.shape == (w.shape[0],)
    x = bf16_to_np(wt)
    for r in range(w.shape[0]):
        s = ref_scale(x[r])
        assert scale[r].numpy().tobytes() == np.float32(s).tobytes()
        assert q[r].numpy().tobytes() == ref_quantize(x[r], s).tobytes()


def test_weight_to_fp8_rows_are_independent():
    w = torch.tensor([[448.0, 1.0, -224.0], [0.5, -0.25, 0.0], [0.0, 0.0, 0.0]], dtype=torch.bfloat16)
    q, scale = weight_to_fp8(w)
    assert scale.tolist() == [1.0, np.float32(0.5) / np.float32(448.0), 1.0]
    assert q[0].tolist() == [0x7E, 0x38, 0xF6]  # 448, 1, -224
    assert q[1, 0].item() == 0x7E and q[2].tolist() == [0, 0, 0]


# ------------------------------------------------------------------ dequantisation


@pytest.mark.parametrize("scale", [1.0, 2.0**-8, 32.0, 0.37, 1e-3])
def test_dequantize_round_trip(scale):
    codes = torch.from_numpy(CODES[FINITE].astype(np.uint8))
    s = torch.tensor(scale, dtype=torch.float32)
    deq = dequantize_e4m3(codes, s)
    assert deq.dtype == torch.float32
    want = (VALS[FINITE].astype(np.float32) * np.float32(scale)).astype(np.float32)
    assert deq.numpy().tobytes() == want.tobytes()
    # exactly representable values come back as the same codes
    assert quantize_e4m3(deq, s).numpy().tobytes() == codes.numpy().tobytes()


def test_dequantize_per_row_scales_broadcast():
    codes = torch.tensor([[0x38, 0xB8], [0x40, 0x00]], dtype=torch.uint8)  # 1, -1 / 2, 0
    scale = torch.tensor([0.5, 3.0])
    assert dequantize_e4m3(codes, scale[:, None]).tolist() == [[0.5, -0.5], [6.0, 0.0]]
