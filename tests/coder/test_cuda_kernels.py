"""The fused CUDA coder (coder/cuda.py driving coder/kernels/spk_fused.cu) against the native coder,
byte for byte: on the CPU's warp emulator (tests/cuda_emu.py) everywhere, and on a CUDA
device where there is one (the ``device`` half skips without one; CI has none).

The emulator runs the kernels' own source, warp scans, ballots and early exits included, through
coder/cuda.py's host code unchanged (CuPy replaced by numpy): so every kernel change is checked
here without a GPU. It cannot say anything about speed (benchmarks/gpu_check.py on a device)."""
from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from cuda_emu import _Module, build
from cuda_helpers import assert_same_streams, decode_outcome, kv_case

from speckv.coder.cuda_tuning import Tuning
from speckv.coder.model import fp8_log2_sigma
from speckv.coder.residual import models_of


@pytest.mark.gpu
@pytest.mark.parametrize("fp8", [False, True])
@pytest.mark.parametrize("tokens,epl,lpc", [(17, 1, 3), (64, 7, 4), (37, 1024, 5), (0, 64, 2)])
def test_cuda_equals_native(coders, ckpt, fp8, tokens, epl, lpc):
    cu, nat, layers = coders
    for mid, model in models_of(ckpt).items():
        x, mu, a, b, scales, L = kv_case(model, fp8, layers, tokens, mid + tokens)
        m_c, m_n = cu.prepare_mu(mu, a, b, scales), nat.prepare_mu(mu, a, b, scales)
        assert np.array_equal(m_c, m_n)
        counts = [min(lpc, layers - i) for i in range(0, layers, lpc)]
        pc, pn = cu.encode(x, m_c, L, counts, epl, model.tables), nat.encode(x, m_n, L, counts, epl, model.tables)
        assert_same_streams(pc, pn)
        out = np.empty_like(x)
        cu.decode(m_c, L, counts, epl, [(p.blocks, p.bits) for p in pn], model.tables, out)
        assert np.array_equal(out, x)


@pytest.mark.gpu
@pytest.mark.parametrize("fp8", [False, True])
@pytest.mark.parametrize("heads,tokens,dim,epl", [(1, 1, 1, 1), (2, 5, 40, 3), (1, 33, 97, 16), (3, 3, 300, 64)])
def test_cuda_equals_native_at_odd_geometries(coders, ckpt, fp8, heads, tokens, dim, epl):
    """Channels other than the checkpoint's 64 (sigma levels drawn at random): a thread's cursor steps
    256 elements at a time across rows of 1 to 300, blocks end mid-row, one-token prompts."""
    cu, nat, _ = coders
    model = models_of(ckpt)[2]
    rng = np.random.default_rng(heads * 1000 + tokens * 10 + dim)
    shape = (3, 2, heads, tokens, dim)
    mu = rng.integers(0, 1 << 16, shape, dtype=np.uint16)
    x = rng.integers(0, 256, shape, dtype=np.uint8) if fp8 else (mu ^ rng.integers(0, 64, shape)).astype(np.uint16)
    scales = rng.uniform(1e-3, 4, (3, 2)).astype(np.float32) if fp8 else None
    L = rng.integers(-400, 120, (3, 2, heads, dim)).astype(np.int32)
    if fp8:
        L = fp8_log2_sigma(L, scales.view(np.uint32)[:, :, None, None]).astype(np.int32)
    m = nat.prepare_mu(mu, None, None, scales)
    assert np.array_equal(cu.prepare_mu(mu, None, None, scales), m)
    pc, pn = cu.encode(x, m, L, [2, 1], epl, model.tables), nat.encode(x, m, L, [2, 1], epl, model.tables)
    assert_same_streams(pc, pn)
    out = np.empty_like(x)
    cu.decode(m, L, [2, 1], epl, [(p.blocks, p.bits) for p in pn], model.tables, out)
    assert np.array_equal(out, x)


@pytest.mark.gpu
@pytest.mark.parametrize("fp8", [False, True])
def test_cuda_decodes_streams_kept_on_the_device(coders, ckpt, fp8):
    """encode_streams -> decode_streams, nothing through the host: the KV back bit for bit; the same
    streams, copied out, are the native coder's; streams of another chunking are refused."""
    cu, nat, layers = coders
    model = models_of(ckpt)[2]
    x, mu, a, b, scales, L = kv_case(model, fp8, layers, 37, 4)
    counts = [min(5, layers - i) for i in range(0, layers, 5)]
    m = cu.prepare_mu_device(cu.cp.asarray(mu), a, b, scales)
    kept = cu.encode_streams(cu.cp.asarray(x), m, L, counts, 64, model.tables)
    out = cu.cp.empty(x.shape, x.dtype)
    cu.decode_streams(kept, m, L, counts, 64, model.tables, out)
    assert np.array_equal(cu.cp.asnumpy(out), x)
    m_n = nat.prepare_mu(mu, a, b, scales)
    assert_same_streams(cu.to_host(kept), nat.encode(x, m_n, L, counts, 64, model.tables))
    with pytest.raises(ValueError, match="another geometry"):
        cu.decode_streams(kept, m, L, [layers], 64, model.tables, out)
    with pytest.raises(ValueError, match="4-byte aligned"):  # a misaligned u32 load would end the CUDA context
        cu.decode_streams(dataclasses.replace(kept, bits=kept.bits[1:]), m, L, counts, 64, model.tables, out)


@pytest.mark.gpu
def test_copy_out_writes_any_host_array(coders):
    """A decode's device KV into the host array the native signature gives: straight into a contiguous
    one, and through a copy into a strided view (only its elements written)."""
    cu = coders[0]
    want = np.arange(2 * 2 * 3 * 5 * 4, dtype=np.uint16).reshape(2, 2, 3, 5, 4)
    dev = cu.cp.asarray(want)
    out = np.zeros_like(want)
    cu.copy_out(dev, out)
    assert np.array_equal(out, want)
    wide = np.zeros(want.shape[:-1] + (8,), np.uint16)
    cu.copy_out(dev, wide[..., ::2])
    assert np.array_equal(wide[..., ::2], want) and not wide[..., 1::2].any()
    frozen = np.zeros_like(want)
    frozen.flags.writeable = False  # refused, as the native coder refuses it (CuPy's get would write it)
    with pytest.raises(ValueError, match="read-only"):
        cu.copy_out(dev, frozen)
    assert not frozen.any()


def test_sections_sum_unary_bounds_in_64_bits(emu_work):
    """spk_decode_sections sums the blocks' unary bounds in 64 bits: 32 blocks of 2^28 bits each
    (lanes of ~2^16 elements can have such bounds) total 2^33, which a 32-bit warp sum wraps to 0,
    rejecting a valid unary section as too long. Here: one zero-bin element a block, each code a lone
    one at a byte's top bit (deltas 0, 7, 7, ...)."""
    from speckv.coder.cuda import source

    k = _Module(build(source(), emu_work, Tuning().defines())).get_function("spk_decode_sections")
    nb = 32
    tally = np.zeros((nb, 5), np.uint64)
    tally[:, 1], tally[:, 3] = 1, 1 << 28  # a zero-bin element, a bound of 2^28 bits
    mant, width = 7, 16
    s_zman = (nb * mant + 7) // 8
    length = s_zman + nb
    bits = np.zeros(length + 8, np.uint8)
    bits[s_zman:length] = 0x80
    sec, skip, deltas, rec = (np.zeros((nb, 4), np.uint64), np.zeros(nb, np.uint8), np.zeros(nb, np.uint32),
                              np.zeros((1, 8), np.uint64))
    i64, u64 = (lambda *v: np.array(v, np.int64)), (lambda *v: np.array(v, np.uint64))
    k((1,), (256,), (i64(0), i64(nb), i64(0), u64(0), u64(length), np.int32(1), np.int32(mant), np.int32(width),
                     tally, np.zeros(nb, np.int32), bits, sec, skip, deltas, rec))
    assert rec[0].tolist() == [0, 0, 0, 0, nb, nb, nb, 8 * nb - 7]  # OK; 32 codes in 32 bytes, the last at bit 249
    assert deltas.tolist() == [0] + [7] * (nb - 1) and not skip.any()
    assert sec[:, 3].tolist() == list(range(nb)) and sec[:, 1].tolist() == [8 * 0 + mant * b for b in range(nb)]


@pytest.mark.gpu
def test_cuda_never_codes_with_another_objects_cached_tables(coders, ckpt):
    """The device copy of a tables object is cached under its id: an entry left by a freed object whose
    id another now has (as CPython reuses ids) must not be used. Simulated: the seed model's entry filed
    under the tuned model's id."""
    cu, nat, _ = coders
    seed, tuned = models_of(ckpt)[1], models_of(ckpt)[2]
    x, mu, a, b, scales, L = kv_case(tuned, False, 2, 16, 1)
    m = nat.prepare_mu(mu, a, b, scales)
    cu.encode(x, m, L, [2], 16, seed.tables)
    cu.args._tables[id(tuned.tables)] = cu.args._tables[id(seed.tables)]
    assert_same_streams(cu.encode(x, m, L, [2], 16, tuned.tables), nat.encode(x, m, L, [2], 16, tuned.tables))


@pytest.mark.gpu
def test_cuda_refuses_levels_as_native(coders, ckpt):
    """L out of range or of the wrong size: the native coder's ValueError, L on the host or the device."""
    cu, nat, _ = coders
    model = models_of(ckpt)[2]
    x, mu, a, b, scales, L = kv_case(model, False, 2, 8, 1)
    m = nat.prepare_mu(mu, a, b, scales)
    parts = nat.encode(x, m, L, [2], 4, model.tables)
    streams = [(p.blocks, p.bits) for p in parts]
    for where in (np.asarray, cu.cp.asarray):
        for bad, why in ((L.reshape(-1)[1:], "L: "), (np.where(L == L.flat[0], 1 << 30, L), "out of range"),
                         (np.where(L == L.flat[0], -(1 << 30) - 1, L), "out of range")):
            for coder in (cu, nat) if where is np.asarray else (cu,):  # NOTE: the native coder takes host arrays
                with pytest.raises(ValueError, match=why):
                    coder.encode(x, m, where(bad.astype(np.int32)), [2], 4, model.tables)
                with pytest.raises(ValueError, match=why):
                    coder.decode(m, where(bad.astype(np.int32)), [2], 4, streams, model.tables, np.empty_like(x))


def _swap_unary_bits(bits: bytes) -> bytes:
    """A "10" in the unary section (the chunk's last bytes, not its last) made "01": the same number of
    codes, other deltas."""
    b = bytearray(bits)
    for i in range(len(b) - 2, len(b) // 2, -1):
        for k in range(7):
            if (b[i] >> (7 - k)) & 1 and not (b[i] >> (6 - k)) & 1:
                b[i] ^= (1 << (7 - k)) | (1 << (6 - k))
                return bytes(b)
    raise AssertionError("no 10 in the unary codes")


@pytest.mark.gpu
@pytest.mark.parametrize("fp8", [False, True])
def test_cuda_checks_sections_as_native(coders, ckpt, fp8):
    """The section checks (spk_decode_sections): bytes cut, added, unary codes moved; each gives the
    native coder's error and message, or the same values where the checks pass."""
    cu, nat, _ = coders
    model = models_of(ckpt)[2]
    x, mu, a, b, scales, L = kv_case(model, fp8, 4, 40, 3)
    m = nat.prepare_mu(mu, a, b, scales)
    parts = nat.encode(x, m, L, [2, 2], 16, model.tables)
    bits = parts[1].bits
    tampered = {"cut a byte": bits[:-1], "cut half": bits[:len(bits) // 2], "no bytes": b"", "a zero byte more":
                bits + b"\0", "0xFF more": bits + b"\xff", "far too long": bits + bytes(8 * len(bits)),
                "last bit set": bits[:-1] + bytes([bits[-1] | 1]), "a code moved": _swap_unary_bits(bits)}
    seen = {}
    for name, v in tampered.items():
        streams = [(p.blocks, p.bits) for p in parts]
        streams[1] = (parts[1].blocks, v)
        want = decode_outcome(nat, m, L, [2, 2], 16, streams, model.tables, x)
        assert decode_outcome(cu, m, L, [2, 2], 16, streams, model.tables, x) == want, name
        seen[name] = want
    assert seen["a code moved"].startswith("ok") and seen["a code moved"] != decode_outcome(
        nat, m, L, [2, 2], 16, [(p.blocks, p.bits) for p in parts], model.tables, x)
    # NOTE: FP8's unary bound is tight (k + bias <= 12 bits a code): a byte more is already too long
    kinds = {"unary codes, found", "bytes present", "unary section"} | (set() if fp8 else {"bytes for"})
    assert {k for k in kinds if any(k in w for w in seen.values())} == kinds, seen


@pytest.mark.gpu
@pytest.mark.parametrize("part", ["bits", "words", "states"])
def test_cuda_rejects_corrupt_streams_as_native(coders, ckpt, part):
    """A flipped bit anywhere gives the native coder's outcome: the same error, message and all."""
    cu, nat, _ = coders
    model = models_of(ckpt)[2]
    x, mu, a, b, scales, L = kv_case(model, False, 4, 40, 9)
    m = nat.prepare_mu(mu, a, b, scales)
    parts = nat.encode(x, m, L, [2, 2], 16, model.tables)
    rng = np.random.default_rng({"bits": 1, "words": 2, "states": 3}[part])
    outcomes = set()
    for _ in range(30):
        c = int(rng.integers(0, 2))
        blocks, bits = parts[c].blocks, bytearray(parts[c].bits)
        words, states = blocks.words.copy(), blocks.states.copy()
        target = {"bits": np.frombuffer(bits, np.uint8), "words": words.view(np.uint8),
                  "states": states.view(np.uint8).reshape(-1)}[part]
        target[int(rng.integers(0, target.size))] ^= np.uint8(1 << int(rng.integers(0, 8)))
        streams = [(p.blocks, p.bits) for p in parts]
        streams[c] = (type(blocks)(states, blocks.word_counts, words), bytes(bits))
        want = decode_outcome(nat, m, L, [2, 2], 16, streams, model.tables, x)
        assert decode_outcome(cu, m, L, [2, 2], 16, streams, model.tables, x) == want
        outcomes.add(want.split(":")[0])
    assert outcomes - {"ok"}, "no corruption was caught: the case checks nothing"


@pytest.mark.gpu
@pytest.mark.parametrize("kind", ["bf16", "fp8"])
def test_codec_on_the_cuda_coder_writes_the_native_records(coders, ckpt, kind):
    """Codec (``--coder cuda``: plan, sigma shifts, stored chunks, records, digests) with the CUDA coder
    as its backend: the native codec's records byte for byte, and each decodes the other's."""
    from codec_helpers import SCALES, _sample_bf16, bf16_tensor, fp8_mu, ids_for

    from speckv.coder.codec import Codec, CodecConfig, Fp8KV

    cu = coders[0]
    cfg = CodecConfig(elems_per_lane=64, layers_per_chunk=4, threads=2, coder="native")
    nat, on_cuda = Codec.from_checkpoint(ckpt, cfg), Codec.from_checkpoint(ckpt, cfg)
    on_cuda.backend = cu
    T = 24
    if kind == "bf16":
        x, mu_bits = _sample_bf16(T, seed=5)
        kv: object = x
    else:
        rng = np.random.default_rng(6)
        codes = rng.integers(0, 256, (30, 2, 3, T, 64), dtype=np.uint8)
        kv = Fp8KV(codes, SCALES["mixed"])
        mu_bits = fp8_mu(codes, SCALES["mixed"], "near")
    ids, mu = ids_for(T), bf16_tensor(mu_bits)
    rec_n, rec_c = list(nat.encode(kv, ids, mu)), list(on_cuda.encode(kv, ids, mu))
    assert rec_c == rec_n
    for dec in (nat, on_cuda):
        out = dec.decode(rec_c, ids, mu)
        got = out if kind == "bf16" else out.codes
        assert np.array_equal(got, x if kind == "bf16" else codes)


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["cut_short", "empty", "junk_after", "padding_bit", "unary_code_missing",
                                  "zero_byte_after_unary"])
def test_codec_on_the_cuda_coder_rejects_crafted_sections(coders, ckpt, name):
    """The codec tests' crafted raw sections (codec_errors_helpers.TAMPER: a padding bit set, codes
    missing, bytes after them, ...) through a codec whose backend is the CUDA coder: the same check
    rejects each (spk_decode_sections and the host's order of checks)."""
    from codec_errors_helpers import TAMPER, _bf16_case, _rejected_by

    from speckv.coder.codec import Codec, CodecConfig

    def make(epl, lpc):
        codec = Codec.from_checkpoint(ckpt, CodecConfig(elems_per_lane=epl, layers_per_chunk=lpc, threads=2,
                                                        coder="native"))
        codec.backend = coders[0]
        return codec

    mu_value, choice, tamper, check = TAMPER[name]
    _rejected_by(_bf16_case(make, mu_value, choice, tamper=tamper), check)
