"""A codec of some heads (coder/heads.py): one tensor-parallel rank's KV, coded under the
checkpoint's parameters of its heads. Its records equal those of a codec built by hand from
the sliced checkpoint arrays, on both CPU coders; it decodes its KV bit for bit; a decoder
told another range rejects the stream with a typed error."""

from __future__ import annotations

import numpy as np
import pytest
from codec_helpers import ALL_CODES, SCALES, bf16_tensor, fp8_mu, ids_for, tile
from native_helpers import assert_same_kv, assert_same_records, realistic_pair

from speckv.coder.codec import Codec, Fp8KV
from speckv.coder.heads import head_codec
from speckv.coder.residual import ResidualModel
from speckv.errors import CodecError
from speckv.kv import HeadRange

T = 24
RANGES = [HeadRange(0, 1, 3), HeadRange(1, 1, 3), HeadRange(2, 1, 3), HeadRange(1, 2, 3)]


@pytest.fixture(params=["bf16", "fp8"])
def stream(request):
    if request.param == "bf16":
        x, mu = realistic_pair(T, 5)
        return x, mu
    codes = tile(ALL_CODES, T, seed=4)
    return Fp8KV(codes, SCALES["mixed"]), fp8_mu(codes, SCALES["mixed"], "near")


def _part(kv, h: HeadRange):
    if isinstance(kv, Fp8KV):
        return Fp8KV(np.ascontiguousarray(kv.codes[:, :, h.start:h.stop]), kv.scales)
    return np.ascontiguousarray(kv[:, :, h.start:h.stop])


def _by_hand(codec: Codec, h: HeadRange) -> Codec:
    """The oracle: a Codec constructed from each model's arrays cut to heads ``h``."""
    def cut(a):
        return None if a is None else a[:, :, h.start:h.stop].copy()

    models = {k: ResidualModel(m.model_id, m.tables, cut(m.log2_sigma), cut(m.mu_scale), cut(m.mu_shift))
              for k, m in codec.models.items()}
    return Codec(codec.tables, cut(codec.log2_sigma), codec.pin, config=codec.config, models=models)


@pytest.mark.parametrize("h", RANGES, ids=str)
def test_head_codec_writes_the_oracle_bytes_and_decodes(make_codec, stream, h):
    kv, mu = stream
    ids = ids_for(T)
    codec = make_codec(epl=64, lpc=4)
    sub = head_codec(codec, h)
    part, mu_part = _part(kv, h), bf16_tensor(np.ascontiguousarray(mu[:, :, h.start:h.stop]))
    records = list(sub.encode(part, ids, mu_part))
    assert_same_records(list(_by_hand(codec, h).encode(part, ids, mu_part)), records)
    assert_same_kv(head_codec(codec, h).decode(records, ids, mu_part), part)
    assert sub.backend is codec.backend and head_codec(codec, h) is sub  # shared threads, built once


def test_numpy_and_native_agree_on_a_range(make_codec, stream):
    kv, mu = stream
    ids, h = ids_for(T), HeadRange(1, 2, 3)
    part, mu_part = _part(kv, h), bf16_tensor(np.ascontiguousarray(mu[:, :, 1:3]))
    a = list(head_codec(make_codec(epl=64, lpc=4, coder="numpy"), h).encode(part, ids, mu_part))
    b = list(head_codec(make_codec(epl=64, lpc=4, coder="native"), h).encode(part, ids, mu_part))
    assert_same_records(a, b)


def test_mu_as_a_view_of_the_whole(make_codec, stream):
    """The sidecars pass a rank's mu as a view of the stream's (heads sliced, not contiguous):
    the same records as a contiguous copy, decoded from the view too."""
    kv, mu = stream
    ids, h = ids_for(T), HeadRange(1, 1, 3)
    view = np.asarray(mu, np.uint16)[:, :, 1:2]
    assert not view.flags.c_contiguous
    sub = head_codec(make_codec(epl=64, lpc=4), h)
    records = list(sub.encode(_part(kv, h), ids, view))
    assert_same_records(list(sub.encode(_part(kv, h), ids, view.copy())), records)
    assert_same_kv(sub.decode(records, ids, view), _part(kv, h))


def test_another_range_is_rejected(make_codec):
    x, mu = realistic_pair(T, 6)
    ids = ids_for(T)
    codec = make_codec(epl=64, lpc=4)
    one, zero = HeadRange(1, 1, 3), HeadRange(0, 1, 3)
    records = list(head_codec(codec, one).encode(_part(x, one), ids, bf16_tensor(mu[:, :, 1:2].copy())))
    with pytest.raises(CodecError):  # the other head's mu: its fingerprint differs
        head_codec(codec, zero).decode(records, ids, bf16_tensor(mu[:, :, 0:1].copy()))
    with pytest.raises(CodecError):  # the right mu, the other head's sigma: the chunk digests fail
        head_codec(codec, zero).decode(records, ids, bf16_tensor(mu[:, :, 1:2].copy()))


def test_whole_and_foreign_ranges(make_codec):
    codec = make_codec(epl=64, lpc=4)
    assert head_codec(codec, None) is codec and head_codec(codec, HeadRange(0, 3, 3)) is codec
    with pytest.raises(ValueError, match="3 KV heads"):
        head_codec(codec, HeadRange(0, 1, 4))
    for bad in ((0, 0, 3), (2, 2, 3), (-1, 1, 3)):
        with pytest.raises(ValueError):
            HeadRange(*bad)
    assert HeadRange.of_rank(2, 3, 3) == HeadRange(2, 1, 3)
    with pytest.raises(ValueError):
        HeadRange.of_rank(0, 2, 3)  # 3 heads do not split over 2 ranks
