"""The portable rung's integer steps against exact references, each over its whole input range."""
from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch

from speckv.predictor import integer as ix
from speckv.predictor.int_attention import _native_exp, exp_weights

CONFIG = SimpleNamespace(head_dim=16, hidden_size=64, num_attention_heads=4, max_position_embeddings=300,
                         rope_parameters={"rope_theta": 10000.0, "rope_type": "default"})


@pytest.fixture(scope="module")
def tables():
    return ix.tables(CONFIG)


def test_to_bf16_rounds_once_to_nearest_even():
    rng = np.random.default_rng(0)
    # every |x| < 2^24 is exact in float32, whose conversion to BF16 rounds to nearest even
    x = torch.from_numpy(rng.integers(-(1 << 24) + 1, 1 << 24, 200_000))
    ties = torch.tensor([(2 * k + 1) << (s - 1) for s in range(1, 16) for k in (128, 129, 255, 200)])
    x = torch.cat([x, ties, -ties, torch.tensor([0, 1, -1, 255, 256, 257, 511, 513])])
    want = (x.double() * 2.0 ** -ix.FRAC).float().to(torch.bfloat16)
    assert torch.equal(ix.to_bf16(x).view(torch.int16), want.view(torch.int16))
    # 2^24 + 2^16 + 2^-16: just above a tie, so up (via float32 it would become a tie, rounded down
    # to 2^24); -(2^29 + 2^21): an exact tie, to the even 2^29
    big = torch.tensor([(1 << 40) + (1 << 32) + 1, -(1 << 45) - (1 << 37)])
    assert ix.to_bf16(big).tolist() == [float(2 ** 24 + 2 ** 17), -float(2 ** 29)]


def test_silu_table_over_its_whole_range(tables):
    step = ix.FRAC - ix.SILU_STEP_BITS
    x = torch.arange(-(ix.SILU_RANGE + 1) << ix.FRAC, (ix.SILU_RANGE + 1) << ix.FRAC, 1 << (step - 2))
    got = ix.silu(x, tables["portable.silu"]).double() / 2 ** ix.FRAC
    xr = x.double() / 2 ** ix.FRAC
    want = xr / (1 + torch.exp(-xr))
    # a table step of 2^-10 in x, SiLU's slope below 1.1, and the tails beyond +-16 (< 2e-6)
    assert float((got - want).abs().max()) < 1.1 * 2.0 ** -(ix.SILU_STEP_BITS + 1) + 2 ** -ix.FRAC


def test_exp_table_and_rope_tables(tables):
    e = tables["portable.exp"].double()
    z = (torch.arange(ix.EXP_LEN, dtype=torch.float64) + 0.5) / 2 ** ix.EXP_STEP_BITS
    assert float((e - torch.exp(-z) * ix.EXP_ONE).abs().max()) <= 0.5
    assert int(e.max()) < 1 << (2 * ix.EXP_SPLIT) and int(e[-1]) == 0  # hi, lo <= 63; the table ends at 0
    pos = torch.arange(300, dtype=torch.float64)[:, None]
    ang = pos * 10000.0 ** (-torch.arange(0, 16, 2, dtype=torch.float64) / 16)
    for name, fn in (("portable.rope_cos", torch.cos), ("portable.rope_sin", torch.sin)):
        assert float((tables[name].double() / 2 ** ix.ROPE_FRAC - fn(ang)).abs().max()) <= 2.0 ** -(ix.ROPE_FRAC + 1)


def test_rms_from_an_exact_integer_sum_over_the_whole_magnitude_range():
    rng = np.random.default_rng(1)
    for mag in (1e-3, 1.0, 300.0, 2e4, 3e5):  # massive activations reach 2e4 in SmolLM2
        x = torch.from_numpy(np.round(rng.normal(0, mag, (8, 576)) * 2 ** ix.FRAC).astype(np.int64))
        want = torch.sqrt((x.double() / 2 ** ix.FRAC).pow(2).mean(-1) + 1e-5)
        got = ix.rms_inv_factor(x, 1e-5)
        tol = 1e-7 if mag >= 1 else 2e-3  # tiny rows: x is on a grid of 2^-16 (the float reference is not)
        assert float(((got - want) / want).abs().max()) < tol


def test_wide_quantisation_reconstructs_14_bits():
    x = torch.from_numpy(np.random.default_rng(2).normal(0, 5, (64, 300)) * 2 ** ix.FRAC).round().long()
    hi, lo, amax = ix.quantise_wide(x)
    q = (hi.long() << ix.WIDE_SPLIT) + lo.long()
    assert int(hi.abs().max()) <= ix.B_MAX and int(lo.abs().max()) <= ix.B_MAX  # second operands
    assert int(q.abs().max()) == ix.B_MAX << ix.WIDE_SPLIT
    err = (q.double() * (amax / ix.WIDE_MAX)[:, None] - x.double()).abs().max(-1).values / amax
    assert float(err.max()) <= 0.5 / ix.WIDE_MAX + 1e-12


def test_linear_is_exact_integer_math_and_close_to_float():
    g = torch.Generator().manual_seed(3)
    w = torch.randn(96, 200, generator=g).to(torch.bfloat16)
    w8, amax = ix.quantise(w)
    ws = amax / ix.Q_MAX
    x = (torch.randn(50, 200, generator=g) * 2 ** ix.FRAC).round().long()
    y, y_ref = ix.linear(x, w8, ws), ix.linear(x, w8, ws, exact=True)
    assert torch.equal(y, y_ref)  # oneDNN's int8 product and torch.mm on int64
    want = (x.double() / 2 ** ix.FRAC) @ w.double().t()
    assert float(((y.double() / 2 ** ix.FRAC) - want).norm() / want.norm()) < 0.01


def test_native_exp_stage_is_the_torch_one_bit_for_bit(tables):
    fn = _native_exp()
    assert fn is not None, "the native extension (speckv.coder._native) is not built"
    rng = np.random.default_rng(4)
    rows, n = 97, 260
    S = torch.from_numpy(rng.integers(-(1 << 20), 1 << 20, (rows, n)).astype(np.int32))
    S[3] = 7  # all equal
    pos = torch.from_numpy(rng.integers(0, n + 40, rows))  # some rows see every key
    mf = torch.from_numpy(np.exp2(rng.uniform(-30, 4, rows))).float()
    want = exp_weights(S, pos, mf, tables["portable.exp"])
    for scalar in (False, True):  # the AVX2 path (where the CPU has it) and the fallback
        hi, lo = torch.empty((rows, n), dtype=torch.int8), torch.empty((rows, n), dtype=torch.int8)
        sums = torch.empty(rows, dtype=torch.int64)
        fn(S.numpy(), pos.numpy(), mf.numpy(), tables["portable.exp"].numpy(), hi.numpy(), lo.numpy(), sums.numpy(),
           ix.EXP_SPLIT, 2, scalar)
        for a, b in zip((hi, lo, sums), want, strict=True):
            assert torch.equal(a, b)
    assert int(sums.min()) >= int(tables["portable.exp"][0])  # each row's own maximum counts fully


def test_native_silu_mul_is_the_torch_one_over_the_whole_range(tables):
    assert ix._native() is not None, "the native extension (speckv.coder._native) is not built"
    g = torch.arange(-(ix.SILU_RANGE + 2) << ix.FRAC, (ix.SILU_RANGE + 2) << ix.FRAC, 37)[:-5].view(-1, 5)
    u = torch.from_numpy(np.random.default_rng(5).integers(-(1 << 24), 1 << 24, g.shape))
    gu = torch.cat([g, u], dim=1)  # (rows, 2 inter): gate | up, inter = 5
    got = ix.silu_mul(gu, tables["portable.silu"])
    assert torch.equal(got, ix.silu_mul(gu, tables["portable.silu"], exact=True))


def test_native_wide_linear_is_the_torch_one():
    assert ix._native() is not None, "the native extension (speckv.coder._native) is not built"
    g = torch.Generator().manual_seed(6)
    w8, amax = ix.quantise(torch.randn(70, 96, generator=g))
    x = (torch.randn(33, 96, generator=g) * 2 ** (ix.FRAC + 8)).round().long()
    norm_w, rms, add = torch.rand(96, generator=g).bfloat16(), torch.rand(33, generator=g).double() + 0.5, x[:, :70]
    for args in ((None, None, None), (norm_w, rms, None), (None, None, add)):
        native = ix.wide_linear(x, w8, amax / ix.Q_MAX, *args, exact=False)
        assert torch.equal(native, ix.wide_linear(x, w8, amax / ix.Q_MAX, *args, exact=True))


@pytest.mark.parametrize("scalar", [False, True])
@pytest.mark.parametrize(("rows", "k", "n"), [(1, 1, 1), (5, 9, 70), (33, 96, 64), (130, 576, 200), (3, 2048, 17)])
def test_fused_wide_linear_is_the_torch_one(monkeypatch, scalar, rows, k, n):
    """The fused kernel (VNNI where the CPU has it, and its scalar loops) against the int64
    reference: odd shapes (row tiles of 4, channel tiles of 64, odd K), the norm folded in (its
    rms given, and computed in the kernel),
    activations over the whole int64 range the rung uses, the residual added in place."""
    monkeypatch.setattr(ix, "FUSED_SCALAR", scalar)
    g = torch.Generator().manual_seed(rows * 7 + k)
    w8, amax = ix.quantise(torch.randn(n, k, generator=g))
    w8[0] = 127  # the int32 sums' extreme: +-127 against +-2^13 over K = 2048
    x = (torch.randn(rows, k, generator=g) * 2.0 ** torch.randint(0, 40, (rows, 1), generator=g)).round().long()
    x[0] = 1 << 40
    if not scalar and not ix.fused_hardware():
        pytest.skip("this CPU has no AVX-512 VNNI (the fused kernel's fast path; its scalar loops are tested)")
    packed = ix.wide_pack(w8)
    assert torch.equal(ix.wide_unpack(packed, n, k), w8)
    ws = amax / ix.Q_MAX
    norm_w, rms = torch.rand(k, generator=g).bfloat16(), torch.rand(rows, generator=g).double() + 0.5
    add = (torch.randn(rows, n, generator=g) * 2 ** 30).round().long()
    for args in ((None, None, None), (norm_w, rms, None), (None, None, add)):
        want = ix.wide_linear(x, w8, ws, *args, exact=True)
        assert torch.equal(ix.wide_linear(x, None, ws, *args, exact=False, packed=packed), want)
    # exact halves in the quantisation: with norm weights 1/2 and a row maximum of 2^14, q = round(x / 2)
    half_w = torch.full((k,), 0.5, dtype=torch.bfloat16)
    xt = (torch.arange(rows * k).view(rows, k) % 301 - 150).long()
    xt[:, 0] = 1 << 14
    want = ix.wide_linear(xt, w8, ws, half_w, None, None, exact=True)
    assert torch.equal(ix.wide_linear(xt, w8, ws, half_w, None, None, False, packed), want)
    # the norm's rms computed in the kernel: rows over the whole magnitude range, a zero row
    xr = x.clone()
    xr[-1] = 0
    want = ix.norm_linear(xr, norm_w, 1e-5, w8, ws, exact=True)
    assert torch.equal(ix.norm_linear(xr, norm_w, 1e-5, w8, ws, False, packed), want)
    inplace = add.clone()
    assert ix.wide_linear(x, w8, ws, None, None, inplace, False, packed, out=inplace) is inplace
    assert torch.equal(inplace, ix.wide_linear(x, w8, ws, None, None, add, exact=True))


@pytest.mark.parametrize("dim", [16, 64, 128])
def test_attention_is_softmax_attention(tables, dim):
    """Against float64 causal softmax attention with peaked scores (the integer scale, exp table and
    GQA mapping all matter here; random-init models attend almost uniformly)."""
    from speckv.predictor.int_attention import attention

    g = torch.Generator().manual_seed(dim)
    T, H, Hk = 150, 4, 2
    q, k, v = (torch.randn(T, h, dim, generator=g, dtype=torch.float64) * s
               for h, s in ((H, 3.0), (Hk, 3.0), (Hk, 1.0)))
    fx = lambda t: torch.round(t * 2 ** ix.FRAC).long()  # noqa: E731
    out = attention(fx(q), fx(k), fx(v), tables["portable.exp"]).double() / 2 ** ix.FRAC
    kk, vv = k.repeat_interleave(H // Hk, dim=1), v.repeat_interleave(H // Hk, dim=1)
    s = torch.einsum("thd,shd->hts", q, kk) / dim ** 0.5
    s = s.masked_fill(torch.ones(T, T, dtype=torch.bool).triu(1), float("-inf"))
    want = torch.einsum("hts,shd->thd", torch.softmax(s, dim=-1), vv)
    # measured 0.037-0.040 for every dim (int8 q and k on scores of spread ~9); a scale off by
    # sqrt(dim / 64), as before head_dim entered it, gave 0.16-0.36
    assert float((out - want).norm() / want.norm()) < 0.05


@pytest.mark.parametrize("heads", [0, 4])
def test_native_split_qkv_is_the_torch_one(tables, heads):
    """Rope, the q/k/v split and BF16 mu in one native call against ``rope`` and ``to_bf16``:
    magnitudes from 0 to 2^60 (past 2^53, where the bit length and frexp part), BF16 ties."""
    if ix.native_with("split_qkv") is None:
        pytest.fail("the native extension (speckv.coder._native) is not built")
    T, Hk, D = 37, 2, CONFIG.head_dim
    g = torch.Generator().manual_seed(8)
    mag = 2.0 ** torch.randint(0, 61, (T, (heads + 2 * Hk) * D), generator=g)
    qkv = (torch.rand(mag.shape, generator=g, dtype=torch.float64) * 2 - 1).mul(mag).round().long()
    vs = (heads + Hk) * D  # v is not roped: its BF16 rounding sees these ties as they are
    qkv[0, vs:vs + D] = (torch.arange(D) + 256) * (1 << 9) + (1 << 8)  # 9 significant bits + a half: ties
    qkv[1] = 0
    cos, sin = tables["portable.rope_cos"][:T], tables["portable.rope_sin"][:T]
    want = ix.split_qkv(qkv, cos, sin, heads, Hk, D, exact=True)
    got = ix.split_qkv(qkv, cos, sin, heads, Hk, D)
    for a, b in zip(got, want, strict=True):
        if a is None or b is None:
            assert a is None and b is None
        else:
            assert a.dtype == b.dtype and torch.equal(a.view(torch.int16) if a.dtype == torch.bfloat16 else a,
                                                      b.view(torch.int16) if b.dtype == torch.bfloat16 else b)


@pytest.mark.parametrize("scalar", [False, True])
def test_fused_silu_epilogue_is_silu_mul_of_the_linear(monkeypatch, tables, scalar):
    """gate_up with SiLU x up in the fused kernel's epilogue (rows interleaved per tile) against the
    reference linear then ``silu_mul``: gates below, inside and above the table's range."""
    monkeypatch.setattr(ix, "FUSED_SCALAR", scalar)
    if not scalar and not ix.fused_hardware():
        pytest.skip("this CPU has no AVX-512 VNNI (the fused kernel's fast path; its scalar loops are tested)")
    rows, k, inter = 13, 96, 128
    g = torch.Generator().manual_seed(9)
    w8, amax = ix.quantise(torch.randn(2 * inter, k, generator=g))
    spread = torch.cat([torch.logspace(-2, 4, inter, dtype=torch.float64), torch.ones(inter, dtype=torch.float64)])
    ws = amax / ix.Q_MAX * spread  # gates from inside the table to far outside it, both signs
    x = (torch.randn(rows, k, generator=g) * 2.0 ** (ix.FRAC + 6)).round().long()
    norm_w = torch.rand(k, generator=g).bfloat16()
    table = tables["portable.silu"]
    assert torch.equal(ix.wide_unpack(ix.wide_pack(ix.wide_interleave(w8)), 2 * inter, k),
                       ix.wide_interleave(w8)) and torch.equal(ix.wide_interleave(ix.wide_interleave(w8), True), w8)
    want = ix.silu_mul(ix.norm_linear(x, norm_w, 1e-5, w8, ws, exact=True), table, exact=True)
    packed = ix.wide_pack(ix.wide_interleave(w8))
    got = ix.norm_linear(x, norm_w, 1e-5, None, ws, False, packed, silu=table)
    assert got.shape == (rows, inter) and torch.equal(got, want)
    gate = ix.norm_linear(x, norm_w, 1e-5, w8, ws, exact=True)[:, :inter]
    idx = ix.round_shift(gate, ix.FRAC - ix.SILU_STEP_BITS) + (ix.SILU_RANGE << ix.SILU_STEP_BITS)
    assert bool((idx < 0).any()) and bool((idx >= ix.SILU_LEN).any()) and bool(((idx >= 0) & (idx < ix.SILU_LEN)).any())
