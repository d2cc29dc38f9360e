"""speckv.predictor.silu and the w8a8x rungs' MLP: speckv's SiLU has the torch reference's bits on
every native path (scalar, AVX2, AVX-512; special values, both signs, odd widths), stays a SiLU
(within 4e-6 of the exact SiLU), and the fused MLP on AMX tiles (spk_mlp_amx.h) writes the bits of the
same stages composed (native and torch), at row counts around its 32-row blocks and 128-row tasks;
a non-finite row is a typed error on every path."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from predictor_helpers import w8a8_three_ways

from speckv.predictor import silu, w8a8, w8a8_pass
from speckv.predictor.ladder import Rung, parse_rung

NATIVE = pytest.mark.skipif(w8a8._native() is None, reason="the native extension is not built")
SPECIAL = [0.0, -0.0, 1e-38, -1e-38, 1e-45, -1e-45, 0.5, -0.5, 1.0, -1.0, 87.0, -87.0, 88.8, -88.8,
           100.0, -100.0, 3e38, -3e38, float("inf"), float("-inf")]


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.int32 if t.dtype == torch.float32 else torch.int16)


def gate_up(rows: int, n: int, seed: int) -> torch.Tensor:
    """(rows, 2n) float32: gate columns then up; the special values go into the gate columns."""
    g = torch.Generator().manual_seed(seed)
    y = torch.randn(rows, 2 * n, generator=g) * torch.logspace(-3, 2, rows)[:, None]
    gate = y[:, :n].contiguous()
    k = min(gate.numel(), len(SPECIAL))
    gate.view(-1)[:k] = torch.tensor(SPECIAL[:k])
    return torch.cat([gate, y[:, n:]], dim=1)


PATHS = {"avx512": 2, "avx2": 1, "scalar": 0}  # W8A8_PATH_* (spk_w8a8_py.h)


@NATIVE
@pytest.mark.parametrize("n", [1, 7, 16, 23, 1536])
@pytest.mark.parametrize("path", list(PATHS))
def test_native_silu_mul_has_the_reference_bits(n, path):
    """Every native path (AVX-512 lanes, AVX2 lanes, the scalar loop; tails past the lanes) writes
    the torch reference's bits wherever that is not NaN: zeros, denormals, the exp floor and
    infinities included. Each path is asked for by name and must be the one that ran."""
    nat = w8a8._native()
    y = gate_up(max(3, len(SPECIAL) // n + 2), n, seed=n)
    got = torch.empty(y.shape[0], n)
    ran = nat.w8a8_silu_mul(y.numpy(), got.numpy(), n, 2, path == "scalar", path == "avx2")
    if ran != PATHS[path]:
        pytest.skip(f"this CPU has no {path} path for speckv's SiLU (ran path {ran})")
    ref = silu.silu_mul(y, native=False)
    keep = ~torch.isnan(ref)
    assert keep.sum() > ref.numel() // 2 and torch.isinf(ref).any()
    assert torch.equal(bits(got)[keep], bits(ref)[keep]) and torch.isnan(got[~keep]).all()


def test_silu_det_is_a_silu():
    """Within 4e-6 relative of the exact SiLU for |x| <= 80 (the exp argument's rounding grows with |x|);
    silu(x) - silu(-x) = x; exactly 0 at 0 and x for large x."""
    x = torch.linspace(-80, 80, 100_001)
    got, want = silu.silu_det(x), torch.nn.functional.silu(x.double())
    keep = want.abs() > 1e-30
    # 3.7e-6 here: the rounding of -|x| log2(e) at |x| = 80
    assert ((got.double() - want).abs()[keep] / want.abs()[keep]).max() < 4e-6
    assert torch.allclose((got - silu.silu_det(-x)).double(), x.double(), rtol=2e-6, atol=0)
    assert silu.silu_det(torch.tensor([0.0, 1e4]).float()).tolist() == [0.0, 1e4]


def _mlp_case(m: int, k: int, inter: int, n: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    t = {"in_gate_up": torch.rand(k, generator=g) + 0.5, "in_down": torch.rand(inter, generator=g) + 0.5,
         "gate_up.w8": torch.randint(-127, 128, (2 * inter, k), dtype=torch.int8, generator=g),
         "gate_up.ws": torch.rand(2 * inter, generator=g) * 2e-2,
         "down.w8": torch.randint(-127, 128, (n, inter), dtype=torch.int8, generator=g),
         "down.ws": torch.rand(n, generator=g) * 1e-2}
    h = (torch.randn(m, k, generator=g) * 2).to(torch.bfloat16)
    return h, t


def _mlps(monkeypatch, h, t):
    """w8a8_pass._mlp of a w8a8x rung as it runs here (AMX where granted), composed of native stages,
    and in torch."""
    return w8a8_three_ways(monkeypatch, lambda: w8a8_pass._mlp(h, t.__getitem__, 1e-5, {}, own_silu=True).clone())


@NATIVE
@pytest.mark.parametrize("m", [1, 31, 32, 33, 129, 300])
@pytest.mark.parametrize("k, inter", [(64, 64), (128, 192), (576, 1536), (48, 64)])
def test_fused_mlp_has_the_composed_stages_bits(monkeypatch, m, k, inter):
    """The fused MLP (spk_mlp_amx.h) equals the stages composed, natively and in torch (BF16 out with
    the residual add), around its 32-row blocks and 128-row tasks; MLP_ROWS chunks of the composed
    path give the same bits too. A hidden size the tiles cannot take (48) runs the composed path."""
    h, t = _mlp_case(m, k, inter, k, seed=m + k)
    monkeypatch.setattr(w8a8_pass, "MLP_ROWS", 50)
    got, composed, ref = _mlps(monkeypatch, h, t)
    assert got.dtype == torch.bfloat16 and torch.equal(bits(got), bits(composed)) and torch.equal(bits(got), bits(ref))


@NATIVE
@pytest.mark.parametrize("where", ["input", "gate"])
def test_a_non_finite_row_is_a_typed_error_on_every_path(monkeypatch, where):
    h, t = _mlp_case(40, 64, 64, 64, seed=3)
    if where == "input":
        h[33, 5] = float("inf")
    else:  # a finite input whose gate product overflows float32
        t["gate_up.ws"][3] = 3e38
    for native, amx in [(True, True), (True, False), (False, False)]:
        monkeypatch.setattr(w8a8, "NATIVE", native)
        monkeypatch.setattr(w8a8, "NATIVE_AMX", amx)
        with pytest.raises(w8a8.ActivationRangeError):
            w8a8_pass._mlp(h, t.__getitem__, 1e-5, {}, own_silu=True)


@NATIVE
def test_fused_mlp_refuses_arguments_that_do_not_fit():
    nat = w8a8._native()
    if not (hasattr(nat, "w8a8_amx_ready") and nat.w8a8_amx_ready()):
        pytest.skip("no AMX int8 tiles on this CPU: the kernel cannot run (the other tests check the fallback)")
    h, t = _mlp_case(4, 64, 64, 64, seed=5)
    q = np.zeros((4, 64), np.int8)
    f = lambda n: np.zeros(n, np.float32)  # noqa: E731
    args = [q, f(4), t["gate_up.w8"].numpy(), f(128), f(64), t["down.w8"].numpy(), f(64),
            np.zeros((4, 64), np.uint16), np.zeros((4, 64), np.uint16), f(4)]
    for m, inter, k, n, match in [(4, 72, 64, 64, "multiples"), (5, 64, 64, 64, "not m"), (4, 64, 64, 48, "down")]:
        with pytest.raises(ValueError, match=match):
            nat.w8a8_amx_mlp(*args, m, inter, k, n, 2)


@NATIVE
def test_fused_mlp_kernel_with_a_lone_last_down_panel():
    """The kernel alone, a down product 80 wide (five 16-column panels: the last 32 x 32 block has one
    panel), against the stages composed in torch."""
    nat = w8a8._native()
    if not (hasattr(nat, "w8a8_amx_ready") and nat.w8a8_amx_ready()):
        pytest.skip("no AMX int8 tiles on this CPU: the kernel cannot run (the other tests check the fallback)")
    m, k, inter, n = 45, 64, 64, 80
    _, t = _mlp_case(m, k, inter, n, seed=9)
    g = torch.Generator().manual_seed(10)
    q = torch.randint(-127, 128, (m, k), dtype=torch.int8, generator=g)
    xs, add = torch.rand(m, generator=g) * 1e-2, torch.randn(m, n, generator=g).to(torch.bfloat16)
    y = w8a8.linear(q, xs, t["gate_up.w8"], t["gate_up.ws"], native=False)
    q2, xs2_ref = w8a8.quantise_rows(silu.silu_mul(y, native=False), t["in_down"], native=False)
    ref = w8a8.linear(q2, xs2_ref, t["down.w8"], t["down.ws"], add=add, native=False)
    out, xs2 = torch.empty(m, n, dtype=torch.bfloat16), torch.empty(m)
    nat.w8a8_amx_mlp(q.numpy(), xs.numpy(), t["gate_up.w8"].numpy(), t["gate_up.ws"].numpy(), t["in_down"].numpy(),
                     t["down.w8"].numpy(), t["down.ws"].numpy(), add.view(torch.int16).numpy(),
                     out.view(torch.int16).numpy(), xs2.numpy(), m, inter, k, n, 2)
    assert torch.equal(bits(out), bits(ref)) and torch.equal(bits(xs2), bits(xs2_ref))


@NATIVE
def test_fused_mlp_refuses_sizes_whose_products_overflow():
    """A huge m or n with small buffers: a typed error before any product of the sizes is formed."""
    nat = w8a8._native()
    if not (hasattr(nat, "w8a8_amx_ready") and nat.w8a8_amx_ready()):
        pytest.skip("no AMX int8 tiles on this CPU: the kernel cannot run (the other tests check the fallback)")
    z = np.zeros(0, np.int8)
    f = np.zeros(0, np.float32)
    for m, n in [(2**62, 64), (2**61 + 1, 64), (4, 2**62), (4, 2**40 * 16)]:
        with pytest.raises(ValueError, match="w8a8_amx_mlp"):
            nat.w8a8_amx_mlp(z, f, z, f, f, z, f, z.view(np.uint8), z.view(np.uint8), f, m, 64, 64, n, 2)


def test_rung_spelling():
    assert parse_rung("w8a8x", 30) == Rung("w8a8", 0, int_attention=True, own_silu=True)
    assert parse_rung("w8a8x:4", 30) == Rung("w8a8", 4, int_attention=True, own_silu=True)
    assert parse_rung("w8a8x:4", 30).name == "w8a8x:4" and parse_rung("w8a8x", 30).name == "w8a8x"
    assert parse_rung("w8a8i:4", 30).name == "w8a8i:4" and not parse_rung("w8a8i:4", 30).own_silu
    with pytest.raises(ValueError, match="own_silu"):
        Rung("w8a8", 4, int_attention=False, own_silu=True)  # would be named w8a8x but run float attention
