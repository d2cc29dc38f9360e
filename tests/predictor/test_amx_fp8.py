"""The predictor's replay of vLLM's CPU ``amx`` attention over an FP8 cache
(speckv.predictor.amx_fp8, coder/kernels/spk_fp8_amx.h): its products on AMX tiles in the
kernel's operand order, checked against outputs of vLLM's own op on hand-made inputs (recorded
here; benchmarks/research/vllm_amx_attention.py --crafted measures them), against the float model
where nothing can flush, and in the predictor: the flag changes mu past layer 0, deterministically,
and a CPU without AMX keeps the FP32 model. The tests that run AMX tiles need them (hardware).
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from speckv.kv import Fp8Attention, bf16_bits
from speckv.predictor import amx_fp8
from speckv.v1 import common_pb2 as pb
from speckv.wire import fp8_attention_msg, fp8_attention_of

H, HK, D = 9, 3, 64
SCALING = 1 / math.sqrt(D)
FA = Fp8Attention((1.0,), (1.0,), toward_zero=True, amx=True)
SMALL, MINUS = 0.125, -0.1171875  # e4m3-exact; their sum, 2^-7, lies below the kernel's flush line (2^-6)

needs_amx = pytest.mark.skipif(not amx_fp8.amx_ready(), reason="no AMX BF16 tiles on this CPU (hardware)")


def run(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, fn=amx_fp8.attention) -> torch.Tensor:
    """q (T, H, D), k/v (T, HK, D) as the research script lays them out -> (T, H, D) float."""
    return fn(q.float().transpose(0, 1), k.float().transpose(0, 1), v.float().transpose(0, 1), FA, 0,
              SCALING).float()


@needs_amx
@pytest.mark.parametrize("vals, want", [
    ([SMALL, MINUS, 0.5, 0.0], 0.50781),   # the tiny sum arises inside one pair of products: kept
    ([SMALL, 0.0, MINUS, 0.5], 0.5),       # between the accumulator and a pair's first product: lost
    ([0.5, MINUS, -0.375, 0.0], 0.0),      # 2^-7 at the end: lost
    ([SMALL, MINUS] + [0.0] * 30 + [0.5, 0.0], 0.50012),  # across a 32-key instruction: lost
])
def test_value_sums_flush_as_vllms_kernel_does(vals, want):
    """Every weight 1 (all scores 0): the last row's output times its key count is the sum of the
    values as the tiles form it; ``want`` is what vLLM's amx op returned (vec: the exact sum)."""
    t = len(vals)
    v = torch.zeros(t, HK, D)
    v[:, :, 0] = torch.tensor(vals)[:, None]
    out = run(torch.zeros(t, H, D), torch.zeros(t, HK, D), v)
    assert round(out[-1, 0, 0].item() * t, 5) == want


@needs_amx
@pytest.mark.parametrize("dims, want", [([(2 * i, 2 * i + 1) for i in range(16)], 0.50391),
                                        ([(4 * i, 4 * i + 2) for i in range(16)], 0.5)])
def test_scores_flush_as_vllms_kernel_does(dims, want):
    """q = 1 in every dim; key 0 holds 0.125 and -0.1171875 at each (a, b) of ``dims``: kept when they
    share a BF16 pair, flushed when two dims apart (vLLM's amx op: 0.50391 and 0.5; vec: 0.50391)."""
    k = torch.zeros(2, HK, D)
    for a, b in dims:
        k[0, :, a], k[0, :, b] = SMALL, MINUS
    v = torch.zeros(2, HK, D)
    v[0, :, 0] = v[1, :, 1] = 1.0
    out = run(torch.ones(2, H, D), k, v)
    assert round(out[1, 0, 0].item(), 5) == want


@needs_amx
def test_where_nothing_flushes_it_is_fp32_attention_with_bf16_weights():
    """Scores exact in any order (q in multiples of 1/8 in two dims, keys small integers), positive
    values of at least 1: no product or partial sum is tiny, so the tiles add as FP32 does and the
    output is FP32 attention with its weights rounded to BF16 (their sum unrounded); the reference
    (torch's exp) gives those bits exactly."""
    torch.manual_seed(0)
    t = 16
    q = torch.zeros(t, H, D)
    q[:, :, :2] = torch.randint(-4, 5, (t, H, 2)) / 8
    k = torch.randint(-3, 4, (t, HK, D)).float()
    v = FA.round(1 + torch.rand(t, HK, D) * 3, 0, 1)
    s = torch.einsum("thd,uhd->htu", q.to(torch.bfloat16).float(), k.repeat_interleave(H // HK, 1)) * SCALING
    s = s.masked_fill(~torch.ones(t, t, dtype=torch.bool).tril(), float("-inf"))
    p = torch.exp(s - s.max(-1, keepdim=True).values)
    want = torch.einsum("htu,uhd->thd", p.to(torch.bfloat16).float(), v.repeat_interleave(H // HK, 1))
    want = (want / p.sum(-1).transpose(0, 1)[..., None]).to(torch.bfloat16).float()
    assert torch.equal(run(q, k, v, amx_fp8.reference), want)
    assert (run(q, k, v) == want).float().mean().item() >= 0.99  # its own exp: a last bit, rarely


@needs_amx
def test_one_call_follows_the_reference_and_is_deterministic():
    torch.manual_seed(1)
    t = 300
    q = torch.randn(t, H, D) * 1.5
    k, v = FA.round(torch.randn(t, HK, D) * 3, 0, 0), FA.round(torch.randn(t, HK, D), 0, 1)
    a, b = run(q, k, v), run(q, k, v)
    assert torch.equal(a, b)
    assert (a == run(q, k, v, amx_fp8.reference)).float().mean().item() >= 0.997  # measured 0.9983-0.9990


def test_the_flag_travels_in_the_header_and_keys_the_mu_cache():
    fa = Fp8Attention((0.5,) * 2, (0.25,) * 2, toward_zero=True, amx=True)
    assert fp8_attention_of(fp8_attention_msg(fa), 2, pb.DTYPE_FP8_E4M3) == fa
    plain = Fp8Attention(fa.k_scales, fa.v_scales, toward_zero=True)
    assert fp8_attention_of(fp8_attention_msg(plain), 2, pb.DTYPE_FP8_E4M3) == plain and plain.key != fa.key


@pytest.fixture(scope="module")
def amx_mu(embedded_session):
    ids = np.arange(100, 228)
    L = embedded_session.target.config.num_hidden_layers
    plain = Fp8Attention((1.0,) * L, (1.0,) * L, toward_zero=True)
    amx = Fp8Attention(plain.k_scales, plain.v_scales, toward_zero=True, amx=True)
    return ids, plain, amx, embedded_session.predictor.mu(ids, fp8_attention=plain)


@needs_amx
def test_the_predictor_replays_the_kernel_past_layer_0(embedded_session, amx_mu):
    ids, _, amx, plain_mu = amx_mu
    mu = embedded_session.predictor.mu(ids, fp8_attention=amx)
    again = embedded_session.predictor.mu(ids, fp8_attention=amx)
    assert np.array_equal(bf16_bits(mu), bf16_bits(again))
    assert torch.equal(mu[0], plain_mu[0])  # layer 0's K/V precede any attention
    assert not torch.equal(mu[1], plain_mu[1])


def test_without_amx_tiles_the_predictor_keeps_the_fp32_model(embedded_session, amx_mu, monkeypatch):
    ids, _, amx, plain_mu = amx_mu
    monkeypatch.setattr(amx_fp8, "amx_ready", lambda: False)
    mu = embedded_session.predictor.mu(ids, fp8_attention=amx)
    assert np.array_equal(bf16_bits(mu), bf16_bits(plain_mu))


def test_head_sizes_the_tiles_do_not_take_keep_the_fp32_model():
    from speckv.predictor.llama import amx_attend

    q, k = torch.randn(1, 4, 8, 128), torch.randn(1, 2, 8, 128)
    assert amx_attend(q, k, k, Fp8Attention((1.0,), (1.0,), toward_zero=True, amx=True), 0) is None
