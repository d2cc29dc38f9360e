"""speckv.predictor.int8_attention: the native kernel (AMX, AVX-512 VNNI, AVX2 and scalar paths) writes
the torch reference's bits for every shape (odd token counts across the 4- and 16-row, 16-key and
64-key tiles, head sizes the vector paths take and ones they leave to the scalar loops, GQA groups);
exp2_det is 2^x to float32 precision; a token's output reads only the tokens before it; the
result stays near float32 SDPA; bad shapes are a typed error; the w8a8i rungs parse, pin
their rung, and run the kernel inside the predictor with the reference's bits."""
from __future__ import annotations

import json

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from speckv.errors import CheckpointError
from speckv.predictor import int8_attention as ia
from speckv.predictor.calibrate import build_checkpoint
from speckv.predictor.checkpoint import load_checkpoint
from speckv.predictor.ladder import Rung, parse_rung
from speckv.predictor.predict import Predictor
from speckv.predictor.store import MANIFEST

native = pytest.importorskip("speckv.coder._native", reason="the native extension is not built")


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.int16)


def operands(H: int, Hk: int, T: int, D: int, seed: int) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(seed)
    q = (torch.randn(H, T, D, generator=g) * 3).bfloat16()
    k = (torch.randn(Hk, T, D, generator=g) * 3).bfloat16()
    v = torch.randn(Hk, T, D, generator=g).bfloat16()
    if T > 2:
        k[:, 1] = 0  # a zero key row (scale 0) and a zero value row (its softmax weight is 0)
        v[:, 2] = 0
    return q, k, v


PATHS = {"fastest": {}, "no AMX": {"amx": False}, "scalar": {"scalar": True}}


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("T", [1, 3, 4, 5, 16, 17, 31, 33, 63, 64, 65, 130, 257])
@pytest.mark.parametrize("H,Hk,D", [(9, 3, 64), (4, 4, 16), (6, 2, 24), (2, 1, 128)])
def test_native_equals_the_torch_reference(path, T, H, Hk, D):
    q, k, v = operands(H, Hk, T, D, seed=T * 7 + D)
    assert torch.equal(bits(ia.attention(q, k, v, **PATHS[path])), bits(ia.reference(q, k, v)))


@pytest.mark.parametrize("scale", [0.2, 3.0])
def test_long_prompts_the_fast_path_equals_the_scalar_loops(scale):
    """Many key blocks (1100 tokens), peaky scores (blocks skipped) and flat ones (every block read):
    the AMX, VNNI or AVX2 path (and the fastest but AMX) against the scalar reference rows."""
    q, k, v = operands(9, 3, 1100, 64, seed=11)
    q, k = (q.float() * scale / 3).bfloat16(), (k.float() * scale / 3).bfloat16()
    want = bits(ia.attention(q, k, v, scalar=True))
    assert torch.equal(bits(ia.attention(q, k, v)), want)
    assert torch.equal(bits(ia.attention(q, k, v, amx=False)), want)


@pytest.mark.parametrize("D", [64, 32])
def test_the_fastest_path_runs_where_the_cpu_has_it(D):
    """2: AMX tiles (head size 64 only), 1: AVX-512 VNNI, 0: the AVX2 or scalar loops."""
    q, k, v = operands(2, 1, 20, D, seed=1)
    out = torch.empty(20, 2, D, dtype=torch.bfloat16)
    ran = native.int8_attention(q.view(torch.int16).numpy(), k.view(torch.int16).numpy(), v.view(torch.int16).numpy(),
                                out.view(torch.int16).numpy(), 2, 1, 20, D, 1)
    flags = set(open("/proc/cpuinfo").read().split())
    vnni = {"avx512_vnni", "avx512bw"} <= flags
    assert ran == (2 if vnni and D == 64 and {"amx_int8", "amx_tile"} <= flags else 1 if vnni else 0)


def test_exp2_det_is_exp2_to_float32_precision():
    x = torch.linspace(-126.0, 0.0, 400_001, dtype=torch.float32)
    got = ia.exp2_det(x).double()
    want = torch.exp2(x.double())
    assert float(((got - want).abs() / want).max()) < 3e-7  # the fit's 1.6e-7 and float32 rounding
    assert float(ia.exp2_det(torch.tensor([0.0]))) == 1.0
    assert float(ia.exp2_det(torch.tensor([-1e4]))) == 2.0 ** -126  # the floor


@pytest.mark.parametrize("scalar", [False, True])
def test_a_token_reads_only_the_tokens_before_it(scalar):
    q, k, v = operands(4, 2, 96, 64, seed=3)
    full = ia.attention(q, k, v, scalar=scalar)
    k2, v2 = k.clone(), v.clone()
    k2[:, 50:] *= 40  # later tokens' scales and values change
    v2[:, 50:] = -v2[:, 50:] * 7
    part = ia.attention(q, k2, v2, scalar=scalar)
    assert torch.equal(bits(part[:50]), bits(full[:50]))
    assert not torch.equal(bits(part[50:]), bits(full[50:]))


def test_close_to_float32_sdpa():
    q, k, v = operands(9, 3, 512, 64, seed=5)
    ref = F.scaled_dot_product_attention(q.float()[None], k.float()[None], v.float()[None], is_causal=True,
                                         enable_gqa=True)[0].transpose(0, 1)
    err = (ia.attention(q, k, v).float() - ref).norm() / ref.norm()
    assert 0.01 < float(err) < 0.03  # measured 0.025: int8 q, k and v cost about 2.5% of the output's norm


def test_bad_shapes_are_typed_errors():
    q, k, v = operands(3, 2, 8, 16, seed=0)
    out = np.empty(8 * 3 * 16, np.int16)
    with pytest.raises(ValueError, match="multiple of kv heads"):
        native.int8_attention(q.view(torch.int16).numpy(), k.view(torch.int16).numpy(),
                              v.view(torch.int16).numpy(), out, 3, 2, 8, 16, 1)
    with pytest.raises((ValueError, BufferError)):
        native.int8_attention(q.view(torch.int16).numpy(), k.view(torch.int16).numpy(),
                              v.view(torch.int16).numpy(), out[:-1], 2, 2, 8, 16, 1)


def test_rungs_parse_and_name():
    assert parse_rung("w8a8i", 30) == Rung("w8a8", 0, int_attention=True)
    assert parse_rung("w8a8i:4", 30) == Rung("w8a8", 4, int_attention=True)
    for text in ("w8a8i", "w8a8i:4", "w8a8:4", "w8a8"):
        assert parse_rung(text, 30).name == text
    assert parse_rung("w8a8i:4", 30).nominal_cost(30) == parse_rung("w8a8:4", 30).nominal_cost(30)
    for bad in ("w8a8i:0", "w8a8i:30", "w8a8i:", "w8a8ii"):
        with pytest.raises(CheckpointError):
            parse_rung(bad, 30)


@pytest.mark.parametrize("rung", ["w8a8i", "w8a8i:1"])
def test_the_rung_runs_the_kernel_with_the_references_bits(monkeypatch, tiny_target, tiny_text, tmp_path, rung):
    pin = build_checkpoint(tiny_target, tiny_text, tmp_path, tokens=64, segment=32, rung=rung, derive_weights=True)
    assert json.loads((tmp_path / MANIFEST).read_text())["rung"] == rung
    pred = Predictor.from_checkpoint(load_checkpoint(tmp_path, pin=pin), tiny_target)
    ids = tiny_target.tokenize("Every bit the coder spends is the mismatch, and no more than that.")
    calls: list[int] = []
    kernel = ia.attention
    monkeypatch.setattr(ia, "attention", lambda *a, **k: calls.append(1) or kernel(*a, **k))
    mu = pred.mu(ids)
    L, k = tiny_target.config.num_hidden_layers, parse_rung(rung, 99).bf16_layers
    assert len(calls) == L - 1 - k  # every predicted layer but the last (its K/V need no attention)
    monkeypatch.setattr(ia, "attention", lambda q, key, v, scalar=False, amx=True: ia.reference(q, key, v))
    assert torch.equal(bits(pred.mu(ids)), bits(mu))
    plain = Predictor.from_checkpoint(load_checkpoint(tmp_path, pin=pin), tiny_target)
    # the same weights with SDPA: another mu from layer k + 1 on (layer k's K/V precede any attention)
    plain.model.int_attention = False
    other = plain.mu(ids)
    assert torch.equal(bits(other[: k + 1]), bits(mu[: k + 1]))
    assert k + 1 == L or not torch.equal(bits(other[k + 1:]), bits(mu[k + 1:]))  # tiny: 2 layers
