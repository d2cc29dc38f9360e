"""The native extension's own input validation and error reporting: wrong buffers
(shapes, dtypes, counts, tables, geometry, read-only output) are plain ValueErrors
(TypeErrors for wrong argument kinds), never a crash or a SpeckvError; corrupt streams
handed to ``NativeCoder.decode`` directly raise RansDecodeError / IntegrityError with
the numpy decoder's messages; and ``prepare_mu`` matches the numpy reference's mu'.

A missing extension skips these tests on a developer's machine and fails them in
CI (SPECKV_REQUIRE_NATIVE, tests/require.py).
"""

from __future__ import annotations

import numpy as np
import pytest
from codec_helpers import LAYERS
from native_helpers import need_native, realistic_pair

from speckv.coder import native, rans
from speckv.coder.native import NativeCoder
from speckv.coder.residual import models_of
from speckv.errors import IntegrityError, RansDecodeError, SpeckvError

# NaN / Inf / overflowing inputs are the point here: numpy's warnings are noise
pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning")


# ------------------------------------------------------ input validation


def _all_value_errors(calls) -> None:
    """Each call raises a plain ValueError (a wrong buffer, not a corrupt stream)."""
    for name, call in calls.items():
        with pytest.raises(ValueError) as ei:
            call()
            pytest.fail(f"{name}: accepted")
        assert not isinstance(ei.value, SpeckvError), f"{name}: {type(ei.value).__name__}: {ei.value}"


@pytest.fixture(scope="module")
def nat_case(ckpt):
    """(NativeCoder, CodingTables, log2_sigma, x, prepared mu) of a 1-token BF16 stream."""
    need_native()
    nat = NativeCoder(2)
    m = models_of(ckpt)[1]  # the seed model: mu as predicted
    x, mu = realistic_pair(1, 6)
    mu2 = nat.prepare_mu(mu, None, None, None)
    assert np.array_equal(mu2, mu)  # the seed model leaves BF16 mu as it is
    return nat, m.tables, m.log2_sigma, x, mu2


def test_encode_rejects_wrong_buffers(nat_case):
    nat, tab, lg, x, mu = nat_case
    counts = [4] * 7 + [2]
    parts = nat.encode(x, mu, lg, counts, 7, tab)
    assert len(parts) == 8
    bad_calls = {
        "mu one token short": lambda: nat.encode(x, mu[:, :, :, :0], lg, counts, 7, tab),
        "mu one layer short": lambda: nat.encode(x, mu[:-1], lg, counts, 7, tab),
        "mu as uint32": lambda: nat.encode(x, mu.astype(np.uint32), lg, counts, 7, tab),
        "mu as uint8": lambda: nat.encode(x, mu.astype(np.uint8), lg, counts, 7, tab),
        "x as float32": lambda: nat.encode(x.astype(np.float32), mu, lg, counts, 7, tab),
        "x as uint8 (fp8 needs u32 mu)": lambda: nat.encode(x.astype(np.uint8), mu, lg, counts, 7, tab),
        "sigma one layer short": lambda: nat.encode(x, mu, lg[:-1], counts, 7, tab),
        "layers past x": lambda: nat.encode(x, mu, lg, counts + [1], 7, tab),
        "layers short of x": lambda: nat.encode(x, mu, lg, counts[:-1], 7, tab),
        "a zero layer count": lambda: nat.encode(x, mu, lg, [0] + counts, 7, tab),
        "a negative layer count": lambda: nat.encode(x, mu, lg, [-1, 31], 7, tab),
        "elems_per_lane 0": lambda: nat.encode(x, mu, lg, counts, 0, tab),
        "elems_per_lane 65537": lambda: nat.encode(x, mu, lg, counts, 65537, tab),
    }
    _all_value_errors(bad_calls)
    with pytest.raises(ValueError, match="log2 sigma out of range"):
        nat.encode(x, mu, np.full(lg.shape, 1 << 40, np.int64), counts, 7, tab)
    # the coder still works after every rejected call
    again = nat.encode(x, mu, lg, counts, 7, tab)
    assert [(p.bits, p.blocks.words.tobytes(), p.blocks.states.tobytes()) for p in again] == \
        [(p.bits, p.blocks.words.tobytes(), p.blocks.states.tobytes()) for p in parts]


def test_extension_rejects_bad_tables_and_geometry(nat_case):
    nat, tab, lg, x, mu = nat_case
    from speckv.coder import _native  # type: ignore[attr-defined]

    flat = nat.flat(tab)
    L = np.ascontiguousarray(lg, np.int32)
    ok = (False, x, mu, L, 3, 1, 64, 7, [30])
    assert len(_native.encode(*ok, *flat.args(), 1)) == 1
    short_rows = (flat.cum, flat.freq, flat.offset[:-1], flat.size[:-1], flat.radius[:-1])
    with pytest.raises(ValueError, match="tables"):
        _native.encode(*ok, *short_rows, 1)
    with pytest.raises(ValueError, match="freq"):
        _native.encode(*ok, flat.cum, flat.freq[:-1], *flat.args()[2:], 1)
    with pytest.raises(ValueError, match="radius"):
        _native.encode(*ok, *flat.args()[:4], flat.radius[:-1], 1)
    for heads, tokens, dim in ((0, 1, 64), (3, -1, 64), (3, 1, 0)):
        with pytest.raises(ValueError):
            _native.encode(False, x, mu, L, heads, tokens, dim, 7, [30], *flat.args(), 1)
    with pytest.raises(TypeError):
        _native.encode(False, x, mu, L, 3, 1, 64, 7, 30, *flat.args(), 1)  # counts not a sequence
    with pytest.raises(TypeError):
        _native.encode(False, x, mu, L, 3, 1, 64, 7, [30], *flat.args())  # argument missing
    with pytest.raises(TypeError):
        _native.encode(False, [1, 2], mu, L, 3, 1, 64, 7, [30], *flat.args(), 1)  # not a buffer


def test_prepare_mu_rejects_wrong_buffers(nat_case, ckpt):
    nat, _, _, _, mu = nat_case
    tuned = models_of(ckpt)[2]
    a, b = tuned.mu_scale, tuned.mu_shift
    assert a is not None and b is not None
    good = nat.prepare_mu(mu, a, b, None)
    assert good.dtype == np.uint16 and good.shape == mu.shape
    assert np.array_equal(good, tuned.correct(mu, slice(0, LAYERS)))  # the numpy reference's mu'
    with pytest.raises(ValueError):
        nat.prepare_mu(mu, a[:-1], b[:-1], None)
    with pytest.raises(ValueError):
        nat.prepare_mu(mu, a, b[:, :, :, :-1], None)
    with pytest.raises(ValueError):
        nat.prepare_mu(mu, None, None, np.ones((LAYERS - 1, 2), np.float32))
    with pytest.raises(ValueError):
        nat.prepare_mu(mu, None, None, np.ones((LAYERS, 3), np.float32))
    fp8 = nat.prepare_mu(mu, None, None, np.ones((LAYERS, 2), np.float32))
    assert fp8.dtype == np.uint32
    assert np.array_equal(fp8, mu.astype(np.uint32) << 16)  # bf16 / 1.0 in fp32, exactly


def _decode_args(nat_case):
    nat, tab, lg, x, mu = nat_case
    parts = nat.encode(x, mu, lg, [30], 7, tab)
    return nat, tab, lg, x, mu, [(p.blocks, p.bits) for p in parts]


def test_decode_rejects_wrong_buffers(nat_case):
    nat, tab, lg, x, mu, streams = _decode_args(nat_case)
    out = np.empty_like(x)
    nat.decode(mu, lg, [30], 7, streams, tab, out)
    assert np.array_equal(out, x)
    blocks, bits = streams[0]
    bad_calls = {
        "out too small": lambda: nat.decode(mu, lg, [30], 7, streams, tab, np.empty_like(x[:-1])),
        "out as uint32": lambda: nat.decode(mu, lg, [30], 7, streams, tab, np.empty(x.shape, np.uint32)),
        "mu one layer short": lambda: nat.decode(mu[:-1], lg, [30], 7, streams, tab, np.empty_like(x)),
        "sigma wrong shape": lambda: nat.decode(mu, lg[:, :1], [30], 7, streams, tab, np.empty_like(x)),
        "two chunks, one stream": lambda: nat.decode(mu, lg, [15, 15], 7, streams, tab, np.empty_like(x)),
        "one chunk, two streams": lambda: nat.decode(mu, lg, [30], 7, streams * 2, tab, np.empty_like(x)),
        "other elems_per_lane": lambda: nat.decode(mu, lg, [30], 8, streams, tab, np.empty_like(x)),
        "a block too few": lambda: nat.decode(
            mu, lg, [30], 7, [(rans.RansBlocks(blocks.states[:-1], blocks.word_counts[:-1],
                                               blocks.words[:int(blocks.word_counts[:-1].sum())]), bits)],
            tab, np.empty_like(x)),
    }
    _all_value_errors(bad_calls)
    ro = np.empty_like(x)
    ro.flags.writeable = False
    with pytest.raises((ValueError, BufferError)):
        nat.decode(mu, lg, [30], 7, streams, tab, ro)


def test_decode_rejects_states_below_rans_l(nat_case):
    nat, tab, lg, x, mu, streams = _decode_args(nat_case)
    blocks, bits = streams[0]
    for value in (0, 1, rans.RANS_L - 1):
        states = blocks.states.copy()
        states[len(states) // 2, 5] = value
        with pytest.raises(RansDecodeError, match="below RANS_L"):
            nat.decode(mu, lg, [30], 7, [(rans.RansBlocks(states, blocks.word_counts, blocks.words), bits)],
                       tab, np.empty_like(x))
    # counts that do not add up to the words, and arrays of the wrong dtype: typed errors too
    counts = blocks.word_counts.copy()
    counts[0] += 1
    with pytest.raises(RansDecodeError, match="sum"):
        nat.decode(mu, lg, [30], 7, [(rans.RansBlocks(blocks.states, counts, blocks.words), bits)],
                   tab, np.empty_like(x))
    with pytest.raises(RansDecodeError, match="uint16"):
        nat.decode(mu, lg, [30], 7, [(rans.RansBlocks(blocks.states, blocks.word_counts,
                                                      blocks.words.astype(np.uint32)), bits)],
                   tab, np.empty_like(x))


def test_decode_reports_corruption_as_typed_errors(nat_case):
    """A state at RANS_L or above but wrong, a word flipped, bits cut: RansDecodeError or
    IntegrityError from the status codes, never a crash or a silent success that returns
    the original."""
    nat, tab, lg, x, mu, streams = _decode_args(nat_case)
    blocks, bits = streams[0]
    states = blocks.states.copy()
    states[0, 0] ^= 0x40
    with pytest.raises(RansDecodeError, match="chunk 0, block 0"):
        nat.decode(mu, lg, [30], 7, [(rans.RansBlocks(states, blocks.word_counts, blocks.words), bits)],
                   tab, np.empty_like(x))
    with pytest.raises(IntegrityError, match="chunk 0: bit sections need more than"):
        nat.decode(mu, lg, [30], 7, [(blocks, b"")], tab, np.empty_like(x))
    out = np.empty_like(x)
    try:
        nat.decode(mu, lg, [30], 7, [(blocks, bits[:-1] + bytes([bits[-1] ^ 0x01]))], tab, out)
    except IntegrityError:
        pass
    else:
        assert not np.array_equal(out, x)


def test_decode_status_messages():
    """Every status code of spk_consts.h maps to the numpy decoder's message and type."""
    for status in (1, 2, 3):
        with pytest.raises(RansDecodeError, match=r"^chunk 2, block 5: "):
            native._raise(status, 2, 5, 0, 0)
    expect = {4: "bit sections need more than the 9 bytes present", 8: "expected 9 unary codes, found 4",
              9: "unary codes: 9 bytes for 4 bits", 11: "an element with a non-finite mu was not escaped",
              99: "native decoder status 99"}
    for status, msg in expect.items():
        with pytest.raises(IntegrityError) as ei:
            native._raise(status, 1, 0, 9, 4)
        assert str(ei.value) == f"chunk 1: {msg}"
