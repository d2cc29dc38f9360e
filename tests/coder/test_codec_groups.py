"""A whole stream is coded and decoded GROUP_ELEMENTS at a time (a bounded peak): the same
records and the same KV as one pass over it, on both CPU coders, BF16 and FP8, stored chunks
and a corrupt chunk in a later group included."""

from __future__ import annotations

import pytest
from codec_helpers import (
    ALL_CODES,
    SCALES,
    assert_rejected,
    bf16_tensor,
    chunk_areas,
    flip,
    fp8_mu,
    ids_for,
    recrc,
    tile,
)
from native_helpers import assert_same_kv, assert_same_records, realistic_pair

from speckv.coder import codec as codec_mod
from speckv.coder import container as ct
from speckv.coder.codec import Fp8KV, bf16_bits
from speckv.coder.plan import element_groups

T = 40  # 30 layers x 2 x 3 heads x 40 tokens x 64 = 15,360 elements a layer


def _header(layers: int, lpc: int) -> ct.StreamHeader:
    return ct.StreamHeader(dtype=ct.DTYPE_BF16, model=1, pin=bytes(32), shape=(layers, 2, 3, T, 64),
                           prompt_digest=bytes(32), elems_per_lane=64, layers_per_chunk=lpc)


def test_element_groups():
    h = _header(30, 4)  # 8 chunks: seven of 4 layers (61,440 elements), the last of 2
    every = list(range(h.n_chunks))
    per = 4 * 15360
    assert element_groups(h, every, per) == [slice(i, i + 1) for i in range(8)]
    assert element_groups(h, every, 2 * per) == [slice(0, 2), slice(2, 4), slice(4, 6), slice(6, 8)]
    assert element_groups(h, every, 3 * per) == [slice(0, 3), slice(3, 6), slice(6, 8)]
    assert element_groups(h, every, 1) == [slice(i, i + 1) for i in range(8)]  # a larger chunk alone
    assert element_groups(h, every, 1 << 30) == [slice(0, 8)]
    assert element_groups(h, [3, 4, 5], 2 * per) == [slice(0, 2), slice(2, 3)]
    assert element_groups(h, [], per) == []


@pytest.fixture(params=["bf16", "fp8"])
def stream(request):
    if request.param == "bf16":
        x, mu = realistic_pair(T, 7)
        return bf16_tensor(x), bf16_tensor(mu)
    codes = tile(ALL_CODES, T, seed=3)
    return Fp8KV(codes, SCALES["mixed"]), bf16_tensor(fp8_mu(codes, SCALES["mixed"], "near"))


@pytest.mark.parametrize("limit", [1, 3 * 2 * 15360])  # every chunk alone; groups of three 2-layer chunks
def test_grouped_equals_one_pass(make_codec, stream, monkeypatch, limit):
    kv, mu = stream
    ids = ids_for(T)
    c = make_codec(epl=64, lpc=2)
    whole = list(c.encode(kv, ids, mu))
    back = c.decode(whole, ids, mu)
    h = ct.unpack_header(whole[0])[0]
    x, scales = (kv.codes, kv.scales) if isinstance(kv, Fp8KV) else (bf16_bits(kv), None)
    mixed = [whole[0]] + [ct.pack_chunk(r) for r in c.encode_chunks(h, range(h.n_chunks), x, mu, scales,
                                                                     stored={1, 6})]
    monkeypatch.setattr(codec_mod, "GROUP_ELEMENTS", limit)
    assert_same_records(whole, list(c.encode(kv, ids, mu)))
    assert_same_kv(back, c.decode(whole, ids, mu))
    assert_same_kv(back, c.decode(mixed, ids, mu))  # stored chunks amid coded groups
    last = max(i for i, r in enumerate(whole[1:], 1) if ct.unpack_chunk(r, h)[0].words.size)
    words = chunk_areas(whole[0], whole[last])["words"][0]
    bad = whole[:last] + [recrc(flip(whole[last], words + 1, 0x40))] + whole[last + 1:]
    assert_rejected(c, bad, ids, mu)  # a corrupt chunk in a later group: a typed error, never the KV
