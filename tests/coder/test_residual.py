"""Residual models (coder/residual.py): the mu correction's arithmetic, the affine fit,
and model selection in the codec (seed = model 1, tuned = model 2), bit-exact."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from speckv.coder import container as ct
from speckv.coder.codec import Codec, CodecConfig, Fp8KV, bf16_bits
from speckv.coder.residual import MODEL_SEED, MODEL_TUNED, AffineFit, affine_bf16, f32_to_bf16
from speckv.errors import IntegrityError
from speckv.predictor.calibrate import build_checkpoint
from speckv.predictor.checkpoint import load_checkpoint
from speckv.predictor.fp8 import kv_to_fp8
from speckv.predictor.predict import Predictor

PROMPT = "The quick brown fox jumps over the lazy dog. Lossless means bit for bit."


def torch_bf16(y: np.ndarray) -> np.ndarray:
    return bf16_bits(torch.from_numpy(y).to(torch.bfloat16))


def test_f32_to_bf16_rounds_like_torch():
    rng = np.random.default_rng(3)
    u = rng.integers(0, 1 << 32, 200_000, dtype=np.uint64).astype(np.uint32)
    u[:6] = [0x3F808000, 0x3F818000, 0x7F7FFFFF, 0x00008000, 0x80018000, 0x7F800000]  # ties, overflow, tiny
    y = u.view(np.float32)
    ok = ~np.isnan(y)
    assert np.array_equal(f32_to_bf16(y)[ok], torch_bf16(y[ok]))
    assert (f32_to_bf16(y)[~ok] == 0x7FC0).all()


def test_identity_correction_keeps_every_pattern():
    mu = np.arange(1 << 16, dtype=np.uint16)
    assert np.array_equal(affine_bf16(mu, np.float32(1.0), np.float32(0.0)), mu)  # -0.0 and NaNs too
    # anything else is computed: -0.0 * 1 + 2^-126 is no longer -0.0
    assert affine_bf16(np.array([0x8000], np.uint16), np.float32(1.0), np.float32(2.0 ** -126))[0] == 0x0080


def test_affine_fit_recovers_the_map_and_keeps_exact_channels():
    rng = np.random.default_rng(5)
    mu = rng.standard_normal((3, 2, 1, 500, 4))
    x = mu.copy()
    x[1] = 2.0 * mu[1] + 0.25 + 1e-3 * rng.standard_normal(mu[1].shape)  # layer 1: a = 2, b = 0.25
    x[2] = mu[2] + 0.1 * rng.standard_normal(mu[2].shape)  # layer 2: nothing to correct
    fit = AffineFit.empty((3, 2, 1, 4))
    fit.add(x[:, :, :, :250], mu[:, :, :, :250])
    fit.add(x[:, :, :, 250:], mu[:, :, :, 250:])
    a, b, var = fit.solve()
    assert a.dtype == np.float32 and b.dtype == np.float32
    assert (a[0] == 1).all() and (b[0] == 0).all() and (var[0] == 0).all()  # exact stays exact
    np.testing.assert_allclose(a[1], 2.0, rtol=1e-3)
    np.testing.assert_allclose(b[1], 0.25, atol=1e-3)
    assert (var[1] < 2e-6).all() and (var[2] > 5e-3).all()


def test_constant_mu_gets_a_shift_only_when_it_pays():
    x = np.random.default_rng(1).standard_normal((1, 1, 1, 64, 2))
    mean = x.mean(axis=3, keepdims=True)
    fit = AffineFit.empty((1, 1, 1, 2))
    fit.add(x, np.broadcast_to(mean, x.shape))  # rung none: mu is already the mean
    a, b, _ = fit.solve()
    assert (a == 1).all() and (b == 0).all()
    fit = AffineFit.empty((1, 1, 1, 2))
    fit.add(x, np.broadcast_to(mean - 0.5, x.shape))  # off by 0.5: shifted back, never scaled
    a, b, _ = fit.solve()
    assert (a == 1).all()
    np.testing.assert_allclose(b, 0.5, rtol=1e-6)


@pytest.fixture(scope="module")
def tiny(tiny_target, tiny_text, tmp_path_factory):
    d = tmp_path_factory.mktemp("residual")
    pin = build_checkpoint(tiny_target, tiny_text, d, tokens=256, segment=128)
    ck = load_checkpoint(d, pin)
    return ck, Predictor.from_checkpoint(ck)


def test_checkpoint_carries_both_models(tiny):
    ck, _ = tiny
    assert ck.tuned_tables is not None and ck.calib.mu_scale.shape == ck.calib.sigma2.shape
    assert ck.manifest["models"]["tuned"]["id"] == MODEL_TUNED
    assert Codec.from_checkpoint(ck).model_id == MODEL_TUNED  # auto: the best one
    assert Codec.from_checkpoint(ck, CodecConfig(model="seed")).model_id == MODEL_SEED


@pytest.mark.parametrize("model,mid", [("seed", MODEL_SEED), ("tuned", MODEL_TUNED)])
@pytest.mark.parametrize("dtype", ["bf16", "fp8"])
def test_round_trip_under_each_model(tiny, tiny_target, model, mid, dtype):
    ck, pred = tiny
    ids = tiny_target.tokenize(PROMPT)
    kv, mu = tiny_target.kv(ids), pred.mu(ids)
    if dtype == "fp8":
        q, s = kv_to_fp8(kv)
        kv = Fp8KV(q.numpy(), s.numpy())
    enc = Codec.from_checkpoint(ck, CodecConfig(model=model, elems_per_lane=16))
    records = list(enc.encode(kv, ids, mu))
    h, _ = ct.unpack_header(records[0])
    assert h.model == mid
    # the decoder follows the header, whatever model it would encode with itself
    back = Codec.from_checkpoint(ck, CodecConfig(model="seed" if model == "tuned" else "tuned")).decode(
        records, ids, mu)
    if dtype == "fp8":
        assert np.array_equal(back.codes, kv.codes)
        assert np.array_equal(back.scales.view(np.uint32), kv.scales.view(np.uint32))
    else:
        assert np.array_equal(back, bf16_bits(kv))


def test_seed_only_codec_refuses_model_2(tiny, tiny_target):
    ck, pred = tiny
    ids = tiny_target.tokenize(PROMPT)
    kv, mu = tiny_target.kv(ids), pred.mu(ids)
    records = list(Codec.from_checkpoint(ck).encode(kv, ids, mu))
    seed_only = Codec(ck.tables, ck.calib.sigma_log2_q, ck.pin)
    with pytest.raises(IntegrityError, match="model id 2"):
        seed_only.decode(records, ids, mu)
    with pytest.raises(ValueError, match="tuned"):
        Codec(ck.tables, ck.calib.sigma_log2_q, ck.pin, config=CodecConfig(model="tuned"))
    with pytest.raises(ValueError, match="model must be"):
        CodecConfig(model="gauss")
