"""Forward-adaptive sigma (format version 4, coder/adapt.py): sigma shifts per (layer, kv,
head) in a coded chunk's aux. Round trips bit for bit on both CPU coders, byte identity of
the numpy reference and the native coder with non-zero shifts, shift 0 reproducing the
version 3 chunk bytes, version 3 streams decoding, and malformed aux rejected as an
IntegrityError.

The synthetic KV mimics what the shipped hybrid:4 checkpoint meets on another engine:
its exact layers 0..3 (sigma calibrated to a residual of ~0) see rounding-level
differences (the last mantissa bit of half the scalars flipped); the other layers are
mu plus noise far below their calibrated sigma (the coarse search leaves them at shift 0;
the fine steps narrow them).
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from codec_helpers import bf16_from_float, bf16_tensor, ids_for, shape, versioned_records, with_aux

from speckv.coder import adapt
from speckv.coder import container as ct
from speckv.coder.codec import Fp8KV
from speckv.coder.model import BF16
from speckv.coder.plan import chunk_aux
from speckv.coder.residual import MODEL_TUNED, models_of
from speckv.coder.tables import SHIFT_MAX
from speckv.errors import IntegrityError, SpeckvError
from speckv.predictor.fp8 import kv_to_fp8

pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning")

T = 48
EPL, LPC = 256, 2
EXACT = 4  # the shipped checkpoint's exact (hybrid) layers


def _kv(flip: bool, seed: int = 5, bit: int = 1) -> tuple[np.ndarray, np.ndarray]:
    """(x, mu) BF16 patterns: layers < EXACT have x == mu, but for ``flip`` the last mantissa bit
    of every other scalar differs (another engine's rounding; ``bit`` 16: e4m3's last bit, so
    that FP8 codes differ too); later layers x = mu + noise."""
    rng = np.random.default_rng(seed)
    mu_f = rng.standard_normal(shape(T)).astype(np.float32)
    mu = bf16_from_float(mu_f)
    x = bf16_from_float(mu_f + 0.002 * rng.standard_normal(shape(T)).astype(np.float32))
    x[:EXACT] = mu[:EXACT]
    if flip:
        x[:EXACT].reshape(-1)[::2] ^= bit
    return x, mu


def _shifts(h: ct.StreamHeader, records: list[bytes]) -> np.ndarray:
    """The shifts of every layer's groups, (layers, 2, heads) (zero where a chunk carries none)."""
    out = []
    for r in records[1:]:
        c = ct.unpack_chunk(r, h)[0]
        s = chunk_aux(h, c)[1]
        out.append(np.zeros((c.layer_count, 2, h.shape[2]), np.int8) if s is None else s)
    return np.concatenate(out)


def test_symbol_cost_is_exact():
    c = adapt.symbol_cost()
    assert c[1 << 15] == 0 and c[1 << 14] == 256 and c[1] == 15 * 256 and c[3] == 15 * 256 - 405
    assert (np.diff(c[1:]) <= 0).all()


def test_other_engine_kv_gets_shifts_and_codes_smaller(make_codec, monkeypatch):
    monkeypatch.setattr(adapt, "FINE_STEP", 0)  # the coarse search alone (the fine steps: below)
    codec = make_codec(EPL, LPC)
    x, mu = _kv(flip=True)
    ids = ids_for(T)
    v4 = list(codec.encode(x, ids, bf16_tensor(mu)))
    v3 = versioned_records(codec, x, ids, bf16_tensor(mu), 3)
    h = ct.unpack_header(v4[0])[0]
    assert h.version == ct.FORMAT_VERSION
    shifts = _shifts(h, v4)
    assert (shifts[:EXACT] >= 64).all() and not shifts[EXACT:].any()  # the exact layers' sigma widened
    # the exact layers' chunks: ~15 bits a flipped scalar at shift 0 (stored by the guard in v3)
    head = sum(len(r) for r in v4[1:1 + EXACT // LPC])
    assert head < 0.45 * sum(len(r) for r in v3[1:1 + EXACT // LPC])
    assert v4[1 + EXACT // LPC:] == v3[1 + EXACT // LPC:]  # shift 0: the version 3 chunk bytes
    assert np.array_equal(codec.decode(v4, ids, bf16_tensor(mu)), x)
    assert np.array_equal(codec.decode(v3, ids, bf16_tensor(mu)), x)  # version 3 still decodes


def test_same_kernel_kv_keeps_version_3_bytes(make_codec, monkeypatch):
    """KV bit-equal to mu in the exact layers: every shift 0, so every chunk is its version 3 record
    (without the fine steps, which would narrow the later layers' sigma: the next test)."""
    monkeypatch.setattr(adapt, "FINE_STEP", 0)  # NOTE: no fine steps: a step of 0 never saves
    codec = make_codec(EPL, LPC)
    x, mu = _kv(flip=False)
    ids = ids_for(T)
    v4 = list(codec.encode(x, ids, bf16_tensor(mu)))
    v3 = versioned_records(codec, x, ids, bf16_tensor(mu), 3)
    assert v4[0][4:6] == bytes([ct.FORMAT_VERSION, 0]) and v4[1:] == v3[1:]
    assert np.array_equal(codec.decode(v4, ids, bf16_tensor(mu)), x)


def test_fine_steps_narrow_a_residual_below_its_sigma(make_codec, monkeypatch):
    """The later layers' residual (0.002) is far below their calibrated sigma: every group takes
    fine steps down as far as they go and those chunks code smaller than at shift 0; the exact
    layers keep their coarse shift within as many steps. Round trips bit for bit."""
    codec = make_codec(EPL, LPC)
    x, mu = _kv(flip=True)
    ids = ids_for(T)
    fine = list(codec.encode(x, ids, bf16_tensor(mu)))
    reach = adapt.FINE_STEP * max(adapt.FINE_FURTHER)
    monkeypatch.setattr(adapt, "FINE_STEP", 0)
    coarse = list(codec.encode(x, ids, bf16_tensor(mu)))
    h = ct.unpack_header(fine[0])[0]
    a, b = _shifts(h, fine), _shifts(h, coarse)
    assert ((a[EXACT:] < 0) & (a[EXACT:] >= -reach)).all() and not b[EXACT:].any()
    assert (a[EXACT:] == -reach).mean() > 0.9  # most as far as the steps go
    assert (np.abs(a[:EXACT].astype(int) - b[:EXACT]) <= reach).all()
    later = slice(1 + EXACT // LPC, None)
    assert sum(map(len, fine[later])) < 0.97 * sum(map(len, coarse[later]))
    assert np.array_equal(codec.decode(fine, ids, bf16_tensor(mu)), x)


def test_a_fine_step_must_save_its_margin(ckpt, monkeypatch):
    """A fine step replaces a shift only where it saves more than FINE_MARGIN of the group's
    sampled cost: with a margin of 100% none is ever taken."""
    x, mu = _kv(flip=True)
    m = models_of(ckpt)[MODEL_TUNED]
    mu2 = m.correct(mu, slice(0, mu.shape[0]))
    taken = adapt.choose_shifts(BF16, BF16, m.tables, x, mu2, m.log2_sigma)
    monkeypatch.setattr(adapt, "FINE_MARGIN", (1, 1))
    kept = adapt.choose_shifts(BF16, BF16, m.tables, x, mu2, m.log2_sigma)
    monkeypatch.setattr(adapt, "FINE_STEP", 0)
    assert np.array_equal(kept, adapt.choose_shifts(BF16, BF16, m.tables, x, mu2, m.log2_sigma))
    assert (taken[EXACT:] < 0).all() and not kept[EXACT:].any()


@pytest.mark.parametrize("dtype", ["bf16", "fp8"])
def test_native_and_numpy_write_the_same_shifted_bytes(make_codec, dtype):
    nat, ref = make_codec(EPL, LPC, coder="native"), make_codec(EPL, LPC, coder="numpy")
    x, mu = _kv(flip=True, seed=9, bit=16 if dtype == "fp8" else 1)
    ids = ids_for(T)
    if dtype == "fp8":
        import torch

        q, s = kv_to_fp8(torch.from_numpy(x.view(np.int16)).view(torch.bfloat16))
        kv: object = Fp8KV(q.numpy(), s.numpy())
    else:
        kv = x
    a = list(ref.encode(kv, ids, bf16_tensor(mu)))
    b = list(nat.encode(kv, ids, bf16_tensor(mu)))
    assert a == b
    h = ct.unpack_header(a[0])[0]
    assert _shifts(h, a).any()
    for codec in (ref, nat):  # each decodes the other's stream
        out = codec.decode(b if codec is ref else a, ids, bf16_tensor(mu))
        if dtype == "fp8":
            assert np.array_equal(out.codes, kv.codes) and np.array_equal(out.scales, kv.scales)
        else:
            assert np.array_equal(out, x)
    # streaming: chunk by chunk, the same records
    xs, sc = (kv.codes, kv.scales) if dtype == "fp8" else (x, None)
    for i in range(h.n_chunks):
        s0, n = h.chunk_layers(i)
        c = nat.encode_chunk(h, i, xs[s0:s0 + n], mu, None if sc is None else sc[s0:s0 + n])
        assert ct.pack_chunk(c) == a[1 + i]


def test_chooser_is_deterministic_and_bounded(ckpt):
    x, mu = _kv(flip=True)
    m = models_of(ckpt)[MODEL_TUNED]
    mu2 = m.correct(mu, slice(0, mu.shape[0]))
    a = adapt.choose_shifts(BF16, BF16, m.tables, x, mu2, m.log2_sigma)
    b = adapt.choose_shifts(BF16, BF16, m.tables, x.copy(), mu2.copy(), m.log2_sigma.copy())
    assert a.dtype == np.int8 and a.shape == x.shape[:3] and np.array_equal(a, b)
    assert np.abs(a.astype(int)).max() <= SHIFT_MAX
    # layer by layer, the same choice (groups are independent: batching cannot change it)
    part = adapt.choose_shifts(BF16, BF16, m.tables, x[2:6], mu2[2:6], m.log2_sigma[2:6])
    assert np.array_equal(part, a[2:6])


def _coded_with_shifts(make_codec, dtype: str = "bf16"):
    codec = make_codec(EPL, LPC)
    x, mu = _kv(flip=True, bit=16 if dtype == "fp8" else 1)
    ids = ids_for(T)
    kv: object = x
    if dtype == "fp8":
        import torch

        q, s = kv_to_fp8(torch.from_numpy(x.view(np.int16)).view(torch.bfloat16))
        kv = Fp8KV(q.numpy(), s.numpy())
    records = list(codec.encode(kv, ids, bf16_tensor(mu)))
    h = ct.unpack_header(records[0])[0]
    return codec, h, records, ids, mu


@pytest.mark.parametrize("dtype", ["bf16", "fp8"])
@pytest.mark.parametrize("how", ["short", "long", "minus_128", "v3_header", "changed"])
def test_corrupt_aux_is_an_integrity_error(make_codec, dtype, how):
    codec, h, records, ids, mu = _coded_with_shifts(make_codec, dtype)
    c = ct.unpack_chunk(records[1], h)[0]
    n_scales = 8 * c.layer_count if dtype == "fp8" else 0
    assert len(c.aux) == n_scales + c.layer_count * 2 * h.shape[2]  # chunk 0 carries shifts
    aux = bytearray(c.aux)
    bad = list(records)
    match: str | None = "aux"
    if how == "short":
        bad[1] = with_aux(h, records[1], bytes(aux[:-1]))
    elif how == "long":
        bad[1] = with_aux(h, records[1], bytes(aux) + b"\x00")
    elif how == "minus_128":
        aux[n_scales] = 0x80
        bad[1], match = with_aux(h, records[1], bytes(aux)), "sigma shift"
    elif how == "v3_header":  # version 3 has no shifts: this aux is too long there
        h3 = dataclasses.replace(h, version=3)
        bad = [ct.pack_header(h3)] + records[1:]
    else:  # in range, but not what the encoder chose: the decode differs and must not pass
        aux[n_scales] ^= 0x10
        bad[1], match = with_aux(h, records[1], bytes(aux)), None
    with pytest.raises(SpeckvError, match=match) as info:
        codec.decode(bad, ids, bf16_tensor(mu))
    if how != "changed":
        assert isinstance(info.value, IntegrityError)


def test_shifts_never_in_stored_chunks(make_codec):
    """A stored chunk (here: the guard stores random KV) has no shifts; one added is rejected."""
    codec = make_codec(EPL, LPC)
    rng = np.random.default_rng(3)
    x = rng.integers(0, 1 << 16, shape(T)).astype(np.uint16)
    mu = np.full(shape(T), 0x3F80, np.uint16)
    ids = ids_for(T)
    records = list(codec.encode(x, ids, bf16_tensor(mu)))
    h = ct.unpack_header(records[0])[0]
    c = ct.unpack_chunk(records[1], h)[0]
    assert ct.is_stored_chunk(h, c) and c.aux == b""
    bad = [records[0], with_aux(h, records[1], bytes(2 * h.shape[2] * c.layer_count))] + records[2:]
    with pytest.raises(IntegrityError):
        codec.decode(bad, ids, bf16_tensor(mu))
