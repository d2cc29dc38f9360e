"""The rANS kernels (coder/kernels) without a GPU: their host build (the same
per-lane source, g++, warp emulated) must write the numpy coder's streams byte
for byte and decode them, on random, adversarial and golden inputs, and reject
corrupt streams as the numpy decoder does; every .cu compiles with nvcc for
sm_90 with no register spills. Tests marked ``gpu`` run the CuPy build on a
CUDA device and skip cleanly without one."""
from __future__ import annotations

import hashlib
import re
import shutil
import subprocess

import numpy as np
import pytest
from codec_helpers import PROPERTY, bf16_tensor
from hypothesis import given
from hypothesis import strategies as st
from require import missing
from test_codec import GOLDEN

from speckv.coder.codec import Codec, CodecConfig, Fp8KV
from speckv.coder.rans import LANES, PROB_SCALE, RansBlocks, RansDecodeError, RansDecoder, rans_encode
from speckv.coder.rans_kernels import CODERS, CudaKernels, HostKernels, cuda_available, select_kernels, source_dir
from speckv.coder.tables import NOOP_TABLE


@pytest.fixture(scope="module")
def host():
    if shutil.which("g++") is None:
        pytest.fail("g++ is needed to build the kernels' host library")
    return HostKernels.load()


@pytest.fixture(scope="module")
def gauss(ckpt):
    return ckpt.tables.gauss


def _random_ops(gauss, rng, nb, steps, mode="random"):
    """Table ids, symbols and their (start, freq) ops, (blocks, steps, LANES)."""
    n_tables = len(gauss.offset)
    size = np.diff(np.append(gauss.offset, len(gauss.cum)))
    if mode == "noop":
        t = np.full((nb, steps, LANES), NOOP_TABLE, np.int32)
    elif mode == "widest":  # the largest alphabet only, uniform symbols: many renorms
        t = np.full((nb, steps, LANES), int(np.argmax(size)), np.int32)
    else:
        t = rng.integers(0, n_tables, (nb, steps, LANES)).astype(np.int32)
    if mode == "rarest":  # always the least probable symbol of each table
        j = np.array([np.argmin(gauss.freq[o:o + n]) for o, n in zip(gauss.offset, size, strict=True)])[t]
    else:
        j = (rng.random((nb, steps, LANES)) * size[t]).astype(np.int64)
    idx = gauss.offset[t] + j
    return t, j, gauss.cum[idx], gauss.freq[idx]


def _same(a: RansBlocks, b: RansBlocks) -> bool:
    return all(np.array_equal(x, y) and x.dtype == y.dtype for x, y in
               ((a.states, b.states), (a.word_counts, b.word_counts), (a.words, b.words)))


@pytest.mark.parametrize("mode", ["random", "noop", "widest", "rarest"])
def test_host_encode_equals_numpy(host, gauss, mode):
    t, j, start, freq = _random_ops(gauss, np.random.default_rng(1), 9, 200, mode)
    ref = rans_encode(start, freq)
    assert _same(host.encode(start, freq), ref)
    assert np.array_equal(host.decode(ref, 200, t, gauss), j)


@PROPERTY
@given(nb=st.integers(0, 6), steps=st.integers(0, 70), seed=st.integers(0, 2**32 - 1))
def test_host_matches_numpy_on_any_geometry(host, gauss, nb, steps, seed):
    t, j, start, freq = _random_ops(gauss, np.random.default_rng(seed), nb, steps)
    ref = rans_encode(start, freq)
    assert _same(host.encode(start, freq), ref)
    assert np.array_equal(host.decode(ref, steps, t, gauss), j)


def test_extreme_frequencies(host):
    """freq 1 (a renorm on almost every op) and PROB_SCALE (never), mixed per lane."""
    rng = np.random.default_rng(5)
    freq = np.where(rng.random((4, 300, LANES)) < 0.5, 1, PROB_SCALE).astype(np.uint32)
    start = np.where(freq == 1, rng.integers(0, PROB_SCALE, freq.shape), 0).astype(np.uint32)
    assert _same(host.encode(start, freq), rans_encode(start, freq))


def _numpy_decode_error(blocks, steps, t, gauss):
    try:
        d = RansDecoder(blocks, steps)
        for s in range(steps):
            tt = t[:, s, :]
            jj = gauss.lookup[tt * PROB_SCALE + d.dec_get().astype(np.int64)]
            idx = gauss.offset[tt] + jj
            d.dec_advance(gauss.cum[idx], gauss.freq[idx])
        d.finish()
    except RansDecodeError:
        return True
    return False


@pytest.mark.parametrize("damage", ["word", "state", "drop_word", "extra_word"])
def test_corrupt_streams_raise_like_numpy(host, gauss, damage):
    t, _, start, freq = _random_ops(gauss, np.random.default_rng(3), 3, 120)
    b = rans_encode(start, freq)
    words, states, counts = b.words.copy(), b.states.copy(), b.word_counts.copy()
    if damage == "word":
        words[len(words) // 2] ^= 0x0100
    elif damage == "state":
        states[1, 7] ^= 0x40000
    elif damage == "drop_word":
        words, counts = words[1:], counts - np.eye(len(counts), dtype=np.uint32)[0]
    else:
        words, counts = np.append(words, np.uint16(7)), counts + np.eye(len(counts), dtype=np.uint32)[-1]
    bad = RansBlocks(states=states, word_counts=counts, words=words)
    assert _numpy_decode_error(bad, 120, t, gauss)
    with pytest.raises(RansDecodeError):
        host.decode(bad, 120, t, gauss)


@pytest.mark.parametrize("name,build,cfg,sha,length", GOLDEN, ids=[g[0] for g in GOLDEN])
def test_golden_streams_through_the_host_kernels(make_codec, name, build, cfg, sha, length):
    kv, mu, T = build()
    codec = make_codec(*cfg, coder="host")
    assert isinstance(codec.kernels, HostKernels)
    ids = np.arange(100, 100 + T, dtype=np.int64)
    records = list(codec.encode(kv, ids, bf16_tensor(mu)))
    stream = b"".join(records)
    assert (hashlib.sha256(stream).hexdigest(), len(stream)) == (sha, length)
    out = codec.decode(records, ids, bf16_tensor(mu))
    want = kv.codes if isinstance(kv, Fp8KV) else kv
    assert np.array_equal(out.codes if isinstance(out, Fp8KV) else out, want)


def test_backend_selection(caplog):
    assert select_kernels("cpu") is None
    assert isinstance(select_kernels("host"), HostKernels)
    if not cuda_available():
        assert select_kernels("auto") is None
        with caplog.at_level("WARNING"):
            assert select_kernels("cuda") is None
        assert "no CUDA device" in caplog.text
    with pytest.raises(ValueError):
        select_kernels("tpu")
    with pytest.raises(ValueError):
        CodecConfig(coder="tpu")
    assert set(CODERS) == {"cpu", "cuda", "auto", "host"}


def _ptxas(path):
    nvcc = shutil.which("nvcc")
    if nvcc is None:
        missing("NVCC", "nvcc not found (the CUDA toolkit is not installed on this machine)")
    proc = subprocess.run([nvcc, "-arch=sm_90", "-Xptxas", "-v", "-std=c++17", f"-I{source_dir()}", "-c",
                           "-o", "/dev/null", str(path)], capture_output=True, text=True, timeout=300)
    return proc.returncode, proc.stdout + proc.stderr


@pytest.mark.parametrize("path", sorted(source_dir().glob("*.cu")), ids=lambda p: p.name)
def test_nvcc_compiles_for_sm90_without_spills(path, capsys):
    rc, out = _ptxas(path)
    assert rc == 0, out
    funcs = re.findall(r"Compiling entry function '(\w+)' for 'sm_90'", out)
    assert {"spk_rans_encode", "spk_rans_gather", "spk_rans_decode"} <= set(funcs)
    spills = re.findall(r"(\d+) bytes spill stores, (\d+) bytes spill loads", out)
    assert spills and all(s == ("0", "0") for s in spills), out
    regs = re.findall(r"Used (\d+) registers", out)
    with capsys.disabled():
        print(f"\n{path.name}: " + ", ".join(f"{f} {r} regs" for f, r in zip(funcs, regs, strict=True)) + ", 0 spills")


# -- on a CUDA device (skipped cleanly without one) ------------------------------

gpu = pytest.mark.skipif(not cuda_available(), reason="no CUDA device or CuPy")


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("mode", ["random", "widest", "rarest", "noop"])
def test_cuda_matches_numpy(gauss, mode):
    k = CudaKernels.load()
    t, j, start, freq = _random_ops(gauss, np.random.default_rng(11), 37, 256, mode)
    ref = rans_encode(start, freq)
    assert _same(k.encode(start, freq), ref)
    assert np.array_equal(k.decode(ref, 256, t, gauss), j)


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("name,build,cfg,sha,length", GOLDEN, ids=[g[0] for g in GOLDEN])
def test_golden_streams_on_cuda(ckpt, name, build, cfg, sha, length):
    kv, mu, T = build()
    codec = Codec.from_checkpoint(ckpt, CodecConfig(elems_per_lane=cfg[0], layers_per_chunk=cfg[1], coder="cuda"))
    ids = np.arange(100, 100 + T, dtype=np.int64)
    stream = b"".join(codec.encode(kv, ids, bf16_tensor(mu)))
    assert (hashlib.sha256(stream).hexdigest(), len(stream)) == (sha, length)
