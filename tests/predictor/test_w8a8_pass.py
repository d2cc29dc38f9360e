"""speckv.predictor.w8a8_pass: several prompts in one pass give each prompt the bits of its
pass alone, whatever else is in the batch (lengths, order, FP8 readings); one prompt's error
stays its own."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from speckv.kv import Fp8Attention
from speckv.predictor import w8a8_pass
from speckv.predictor.calibrate import build_checkpoint
from speckv.predictor.checkpoint import load_checkpoint
from speckv.predictor.predict import Predictor
from speckv.server.layer_mu import PredictorStopped


@pytest.fixture(scope="module", params=["w8a8", "w8a8:1", "w8a8i", "w8a8x:1"])
def tiny_pred(request, tiny_target, tiny_text, tmp_path_factory):
    d = tmp_path_factory.mktemp(request.param.replace(":", "_"))
    pin = build_checkpoint(tiny_target, tiny_text, d, tokens=64, segment=32, rung=request.param, derive_weights=True)
    return Predictor.from_checkpoint(load_checkpoint(d, pin=pin), tiny_target)


def alone(pred: Predictor, ids: np.ndarray, fa: Fp8Attention | None = None) -> dict[int, np.ndarray]:
    got: dict[int, np.ndarray] = {}
    pred.stream(ids, lambda i, b: got.__setitem__(i, b.copy()), fa)
    return got


def batched(pred: Predictor, prompts: list, fas: list | None = None) -> tuple[list[dict], list]:
    got: list[dict[int, np.ndarray]] = [{} for _ in prompts]
    sinks = [lambda i, b, g=g: g.__setitem__(i, b.copy()) for g in got]
    fas = fas or [None] * len(prompts)
    errors = pred.stream_batch(list(zip(prompts, sinks, fas, strict=True)))
    return got, errors


def same(a: dict[int, np.ndarray], b: dict[int, np.ndarray]) -> bool:
    return sorted(a) == sorted(b) and all(np.array_equal(a[i], b[i]) for i in a)


def prompts_of(vocab: int, lengths: list[int], seed: int) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, vocab, n).astype(np.int64) for n in lengths]


@pytest.mark.parametrize("lengths", [[1, 7], [33, 1, 64, 5], [17, 17, 17]])
def test_each_prompt_of_a_batch_has_its_lone_bits(tiny_pred, lengths):
    prompts = prompts_of(tiny_pred.model.config.vocab_size, lengths, len(lengths))
    got, errors = batched(tiny_pred, prompts)
    assert errors == [None] * len(prompts) and tiny_pred.batches
    for ids, g in zip(prompts, got, strict=True):
        assert len(g) == tiny_pred.model.config.num_hidden_layers and same(g, alone(tiny_pred, ids))
    back, _ = batched(tiny_pred, prompts[::-1])  # another order, other neighbours
    assert all(same(a, b) for a, b in zip(got, back[::-1], strict=True))


def test_batch_of_real_prompts_on_the_shipped_predictor(embedded_session, embedded_target):
    """The shipped w8a8i:4 on real text: three prompts batched equal their lone passes."""
    pred = embedded_session.predictor
    text = "To be, or not to be, that is the question: whether 'tis nobler in the mind to suffer " * 8
    ids = embedded_target.tokenize(text)
    prompts = [ids[:96], ids[5:6], ids[10:150]]
    got, errors = batched(pred, prompts)
    assert errors == [None] * 3
    for p, g in zip(prompts, got, strict=True):
        assert same(g, alone(pred, p))
    mu = pred.mu(prompts[2]).contiguous().view(torch.int16).numpy().view(np.uint16)
    assert np.array_equal(np.stack([got[2][i] for i in range(len(got[2]))]), mu)


@pytest.mark.parametrize("rows", [1, 7, 64])
def test_the_mlp_in_row_chunks_has_the_whole_passes_bits(tiny_pred, monkeypatch, rows):
    """_block_rest runs the MLP MLP_ROWS rows at a time (the peak's widest activations); any chunk
    length, the last one shorter, gives the bits of one chunk of every row; so does trimming the
    heap after the exact heads (TRIM_TOKENS)."""
    ids = prompts_of(tiny_pred.model.config.vocab_size, [130], seed=4)[0]
    monkeypatch.setattr(w8a8_pass, "MLP_ROWS", 10**9)
    monkeypatch.setattr(w8a8_pass, "TRIM_TOKENS", 10**9)
    whole = alone(tiny_pred, ids)
    monkeypatch.setattr(w8a8_pass, "MLP_ROWS", rows)
    monkeypatch.setattr(w8a8_pass, "TRIM_TOKENS", 1)
    assert same(alone(tiny_pred, ids), whole)


def test_fp8_readings_stay_per_prompt(tiny_pred):
    L = tiny_pred.model.config.num_hidden_layers
    fa = Fp8Attention((0.02,) * L, (0.03,) * L, toward_zero=True)
    prompts = prompts_of(tiny_pred.model.config.vocab_size, [20, 31], 7)
    got, errors = batched(tiny_pred, prompts, [fa, None])
    assert errors == [None, None]
    assert same(got[0], alone(tiny_pred, prompts[0], fa)) and same(got[1], alone(tiny_pred, prompts[1]))
    assert not same(got[0], alone(tiny_pred, prompts[0]))  # the reading changed that prompt's mu


@pytest.mark.parametrize("at", [0, 1])
def test_a_prompts_error_stays_its_own(tiny_pred, at):
    """A prompt whose on_layer raises at layer ``at`` (w8a8:1: 0 is its exact head's, w8a8: a later
    layer's) gets nothing more, and leaves the batch: the others keep their lone bits."""
    prompts = prompts_of(tiny_pred.model.config.vocab_size, [12, 9, 30], 3)
    got: list[dict] = [{}, {}, {}]

    def stopping(i: int, b: np.ndarray) -> None:
        if i == at:
            raise PredictorStopped("its transfer ended")
        got[1][i] = b.copy()

    sinks = [lambda i, b: got[0].__setitem__(i, b.copy()), stopping, lambda i, b: got[2].__setitem__(i, b.copy())]
    errors = tiny_pred.stream_batch(list(zip(prompts, sinks, [None] * 3, strict=True)))
    assert errors[0] is None and errors[2] is None and isinstance(errors[1], PredictorStopped)
    assert same(got[0], alone(tiny_pred, prompts[0])) and same(got[2], alone(tiny_pred, prompts[2]))
    assert sorted(got[1]) == list(range(at))  # nothing from its error on


def test_kept_layers_only_when_asked(tiny_pred):
    ids = prompts_of(tiny_pred.model.config.vocab_size, [10], 9)[0]
    for keep, n in ((False, 0), (True, tiny_pred.model.config.num_hidden_layers)):
        r = w8a8_pass.MuRequest(ids, lambda i, b: None, None, keep)
        w8a8_pass.w8a8_passes(tiny_pred.model, [r])
        assert r.error is None and len(r.layers) == n


def test_a_batch_error_falls_back_to_lone_passes(tiny_pred, monkeypatch, caplog):
    """The batch fails at its first later layer, after the exact heads' layers reached their prompts
    (w8a8:1): the prompts run alone (those layers arrive again, the same bits); one that had its own
    error first stays failed."""
    prompts = prompts_of(tiny_pred.model.config.vocab_size, [12, 9, 7], 4)
    want = [alone(tiny_pred, p) for p in prompts]
    real = w8a8_pass.norm_linear

    def fail_batches(h, *a, **k):
        if h.shape[0] > max(len(p) for p in prompts):  # stacked rows: the batch, not a lone pass
            raise ValueError("a non-finite activation somewhere in the batch")
        return real(h, *a, **k)

    monkeypatch.setattr(w8a8_pass, "norm_linear", fail_batches)
    got: list[dict] = [{}, {}, {}]
    calls = [0, 0, 0]

    def sink(k: int):
        def on(i: int, b: np.ndarray) -> None:
            calls[k] += 1
            if k == 2:
                raise PredictorStopped("its transfer ended")
            got[k][i] = b.copy()
        return on

    errors = tiny_pred.stream_batch([(p, sink(k), None) for k, p in enumerate(prompts)])
    assert errors[:2] == [None, None] and isinstance(errors[2], PredictorStopped)
    assert all(same(g, w) for g, w in zip(got[:2], want[:2], strict=True))
    L, k0 = tiny_pred.model.config.num_hidden_layers, tiny_pred.model.k
    assert calls[:2] == [k0 + L] * 2 and calls[2] == 1  # the head's layers twice, the rest once; one
    assert "running them one by one" in caplog.text


def test_rungs_that_do_not_batch_run_one_by_one(tiny_target, tiny_text, tmp_path):
    pin = build_checkpoint(tiny_target, tiny_text, tmp_path, tokens=64, segment=32, rung="fp8")
    pred = Predictor.from_checkpoint(load_checkpoint(tmp_path, pin=pin))
    prompts = prompts_of(tiny_target.config.vocab_size, [8, 3], 5)
    got, errors = batched(pred, prompts)
    assert not pred.batches and errors == [None, None]
    assert all(same(g, alone(pred, p)) for g, p in zip(got, prompts, strict=True))



NATIVE = pytest.mark.skipif(w8a8_pass.native_with("w8a8_rope") is None, reason="the native extension is not built")


def _rope_case(T: int, col0: int, heads: int, D: int, seed: int, scale: float):
    g = torch.Generator().manual_seed(seed)
    y = torch.randn(T, col0 + heads * D + 16, generator=g) * scale
    y[0, col0:col0 + 6] = torch.tensor([0.0, -0.0, 1e-45, -1e-40, 1e37, -2.5])  # signed zeros, subnormals, large
    cos, sin = (torch.randn(1, T, D, generator=g).to(torch.bfloat16) for _ in range(2))
    return y, cos, sin


def _spied_rope(monkeypatch, *args) -> tuple[torch.Tensor, torch.Tensor, list[int]]:
    """``_rope(*args)`` through the kernel (what each native call returned) and through torch."""
    calls: list[int] = []
    nat = w8a8_pass.native_with("w8a8_rope")

    class Spy:
        def w8a8_rope(self, *a):
            calls.append(nat.w8a8_rope(*a))
            return calls[-1]

    monkeypatch.setattr(w8a8_pass, "native_with", lambda name: Spy())
    got = w8a8_pass._rope(*args)
    monkeypatch.setattr(w8a8_pass, "NATIVE_ROPE", False)
    return got, w8a8_pass._rope(*args), calls


@NATIVE
@pytest.mark.parametrize("scalar", [False, True])
@pytest.mark.parametrize("T, heads, D, col0", [(1, 9, 64, 0), (7, 3, 64, 576), (64, 3, 64, 768), (5, 2, 40, 8)])
@pytest.mark.parametrize("scale", [1.0, 1e4, 1e-20])
def test_native_rope_has_torchs_bits(monkeypatch, scalar, T, heads, D, col0, scale):
    """The fused RoPE (spk_w8a8.h) against torch's BF16 ops, every bit and the memory layout:
    both AVX2 paths (head size 64: intrinsics; 40: the scalar loop) and the scalar one, each
    computing the whole call itself (the kernel reports nothing non-finite)."""
    monkeypatch.setattr(w8a8_pass.stages, "NATIVE_SCALAR", scalar)
    y, cos, sin = _rope_case(T, col0, heads, D, T * heads + D, scale)
    got, ref, calls = _spied_rope(monkeypatch, y, col0, heads, cos, sin)
    assert calls == [0]
    assert got.shape == ref.shape == (1, heads, T, D) and (T == 1 or got.stride() == ref.stride())
    assert torch.equal(got.view(torch.int16), ref.view(torch.int16))


@NATIVE
@pytest.mark.parametrize("scalar", [False, True])
@pytest.mark.parametrize("bad", ["overflow", "nan"])
def test_native_rope_hands_non_finite_to_torch(monkeypatch, scalar, bad):
    """An output past BF16's range, or a NaN input whose payload would round to a zero: the kernel
    says so and torch computes the call (its NaN bits)."""
    monkeypatch.setattr(w8a8_pass.stages, "NATIVE_SCALAR", scalar)
    y, cos, sin = _rope_case(4, 0, 9, 64, 1, 1.0)
    if bad == "overflow":
        y[2, 40] = -3.4e38  # rounds to -inf in BF16, then -inf * 0 -> NaN
        sin[0, 2, 8] = 0.0
    else:
        y.view(torch.int32)[2, 70] = 0x7FFFFFFF  # NOTE: + 0x7FFF wraps: a careless rounding gives -0
    got, ref, calls = _spied_rope(monkeypatch, y, 0, 9, cos, sin)
    assert calls == [1] and torch.isnan(ref.float()).any()
    assert torch.equal(got.view(torch.int16), ref.view(torch.int16))


@NATIVE
@pytest.mark.parametrize("col0, heads, D", [(2**62, 1, 64), (0, 2**61, 4), (0, 4, 2**62 + 2), (0, 1, 3), (40, 1, 64)])
def test_native_rope_refuses_shapes_that_do_not_fit(col0, heads, D):
    nat = w8a8_pass.native_with("w8a8_rope")
    y, cs, out = np.zeros((4, 96), np.float32), np.zeros((4, 64), np.int16), np.zeros((4, 64), np.int16)
    with pytest.raises(ValueError, match="do not fit"):
        nat.w8a8_rope(y, col0, heads, D, cs, cs, out, 1)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
def test_a_w8a8i_rung_on_a_gpu_attends_there(tiny_pred, monkeypatch):
    """On a GPU a w8a8i rung runs torch's attention on the device, not the host's int8 kernel (8.2x
    a prefill on an H200): deterministic, near the CPU's mu; with HOST_INT8_ON_DEVICE, the host's."""
    if not tiny_pred.model.int_attention:
        pytest.skip("a rung with torch's attention everywhere")
    ids = prompts_of(tiny_pred.model.config.vocab_size, [300], 6)[0]
    cpu = tiny_pred.mu(ids)
    calls: list[int] = []
    real = w8a8_pass.int8_attention.attention
    monkeypatch.setattr(w8a8_pass.int8_attention, "attention", lambda *a, **k: calls.append(1) or real(*a, **k))
    tiny_pred.to("cuda")
    try:
        a, b = tiny_pred.mu(ids), tiny_pred.mu(ids)
        assert not calls and torch.equal(a.view(torch.int16), b.view(torch.int16))
        assert (a.float() - cpu.float()).abs().max() < 0.1 * cpu.float().abs().max()
        monkeypatch.setattr(w8a8_pass, "HOST_INT8_ON_DEVICE", True)
        tiny_pred.mu(ids)
        assert calls
    finally:
        tiny_pred.to("cpu")
