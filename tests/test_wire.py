"""wire: KV layers and chunk records split into parts and put back together;
every inconsistency is an RpcError(INVALID_ARGUMENT) before anything is copied."""

from __future__ import annotations

import grpc
import numpy as np
import pytest

from speckv.errors import RpcError
from speckv.v1 import common_pb2 as pb
from speckv.v1 import decoder_pb2 as dpb
from speckv.wire import (
    LayerAssembler,
    RecordAssembler,
    dtype_of,
    kv_shape,
    layer_bytes,
    layer_messages,
    parts,
    shape_of,
)

SHAPE = (3, 2, 2, 5, 8)  # layers, kv, heads, tokens, dim: 160 elements per layer
BF16, FP8 = pb.DTYPE_BF16, pb.DTYPE_FP8_E4M3


def _kv(dtype=BF16, shape=SHAPE, seed=0):
    rng = np.random.default_rng(seed)
    return rng.integers(0, 1 << (16 if dtype == BF16 else 8), size=shape,
                        dtype=np.uint16 if dtype == BF16 else np.uint8)


def _msgs(kv, dtype=BF16, part_bytes=100, scales=None):
    """All KVLayer parts of ``kv``, layer by layer."""
    shape = kv_shape(kv.shape)
    return [m for k in range(kv.shape[0])
            for m in layer_messages(k, kv[k], dtype, shape, part_bytes, None if scales is None else scales[k])]


def _invalid(fn, *words):
    with pytest.raises(RpcError) as ei:
        fn()
    assert ei.value.code == grpc.StatusCode.INVALID_ARGUMENT
    for w in words:
        assert w in str(ei.value), (w, str(ei.value))


# -- helpers ------------------------------------------------------------------------------

def test_parts():
    assert list(parts(0, 4)) == [(0, 0)]
    assert list(parts(10, 4)) == [(0, 4), (4, 4), (8, 2)]
    assert list(parts(8, 4)) == [(0, 4), (4, 4)]


def test_shapes_and_dtypes():
    assert shape_of(kv_shape(SHAPE)) == SHAPE
    assert layer_bytes(SHAPE, 2) == 2 * 2 * 5 * 8 * 2
    assert dtype_of(BF16) == ("bf16", np.dtype("<u2")) and dtype_of(FP8)[0] == "fp8"
    _invalid(lambda: dtype_of(pb.DTYPE_UNSPECIFIED), "dtype 0")
    for bad in [(3, 3, 2, 5, 8), (0, 2, 2, 5, 8), (3, 2, 0, 5, 8), (3, 2, 2, 5, 0), (3, 2, 2, 1 << 25, 8)]:
        _invalid(lambda bad=bad: shape_of(pb.KVShape(layers=bad[0], kv=bad[1], kv_heads=bad[2], tokens=bad[3],
                                             head_dim=bad[4])), "not a KV shape")


# -- LayerAssembler -------------------------------------------------------------------------

@pytest.mark.parametrize("part_bytes", [1, 7, 100, 320, 10_000])
def test_layers_round_trip_bf16(part_bytes):
    kv = _kv()
    asm = LayerAssembler(BF16, SHAPE)
    assert asm.layer_size == 320 and asm.starting
    out = [r for m in _msgs(kv, part_bytes=part_bytes) if (r := asm.add(m)) is not None]
    assert asm.done and [k for k, _, _ in out] == [0, 1, 2]
    for k, arr, scales in out:
        assert scales is None and arr.dtype == np.uint16 and np.array_equal(arr, kv[k])


def test_layers_round_trip_fp8_with_scales():
    kv = _kv(FP8)
    scales = np.array([[0.5, 2.0], [1e-3, 3.0], [np.float32(1 / 3), 7.25]], np.float32)
    asm = LayerAssembler(FP8, SHAPE)
    out = [r for m in _msgs(kv, FP8, 50, scales) if (r := asm.add(m)) is not None]
    assert asm.done and len(out) == 3
    for k, arr, sc in out:
        assert np.array_equal(arr, kv[k])
        assert np.array_equal(sc.view(np.uint32), scales[k].view(np.uint32))


def test_layers_of_zero_tokens():
    shape = (2, 2, 2, 0, 8)
    kv = np.zeros(shape, np.uint16)
    asm = LayerAssembler(BF16, shape)
    out = [r for m in _msgs(kv) if (r := asm.add(m)) is not None]
    assert asm.done and len(out) == 2 and out[0][1].shape == (2, 2, 0, 8)


def test_layer_parts_out_of_order():
    ms = _msgs(_kv(), part_bytes=100)  # 4 parts per layer
    asm = LayerAssembler(BF16, SHAPE)
    _invalid(lambda: asm.add(ms[1]), "first part has index 1")
    asm = LayerAssembler(BF16, SHAPE)
    asm.add(ms[0])
    _invalid(lambda: asm.add(ms[2]), "part 2/4, expected 1/4")


def test_layers_out_of_order():
    ms = _msgs(_kv(), part_bytes=1000)  # one part per layer
    asm = LayerAssembler(BF16, SHAPE)
    _invalid(lambda: asm.add(ms[1]), "got layer 1, expected layer 0")
    asm.add(ms[0])
    _invalid(lambda: asm.add(ms[0]), "got layer 0, expected layer 1")


def test_layer_part_overrun():
    ms = _msgs(_kv(), part_bytes=100)
    asm = LayerAssembler(BF16, SHAPE)
    asm.add(ms[0])
    ms[1].data += b"\x00" * 300
    _invalid(lambda: asm.add(ms[1]), "does not continue the layer")


def test_layer_part_at_wrong_offset():
    ms = _msgs(_kv(), part_bytes=100)
    asm = LayerAssembler(BF16, SHAPE)
    asm.add(ms[0])
    ms[1].byte_offset = 102
    _invalid(lambda: asm.add(ms[1]), "offset 102", "does not continue")


def test_layer_short_of_its_bytes():
    ms = _msgs(_kv(), part_bytes=100)
    asm = LayerAssembler(BF16, SHAPE)
    for m in ms[:3]:
        asm.add(m)
    ms[3].data = ms[3].data[:-2]  # the last part ends 2 bytes early
    _invalid(lambda: asm.add(ms[3]), "parts cover 318 of 320 bytes")


def test_layer_bytes_part_count_dtype_and_shape_checked():
    for mutate, words in [
        (lambda m: setattr(m, "layer_bytes", 322), ("layer_bytes 322 != 320",)),
        (lambda m: setattr(m, "part_count", 0), ("first part has index 0 of 0",)),
        (lambda m: setattr(m, "part_count", 321), ("first part has index 0 of 321",)),
        (lambda m: setattr(m, "dtype", FP8), ("dtype/shape differ",)),
        (lambda m: setattr(m.shape, "tokens", 6), ("dtype/shape differ",)),
        (lambda m: setattr(m.shape, "kv", 1), ("not a KV shape",)),
    ]:
        m = _msgs(_kv(), part_bytes=100)[0]
        mutate(m)
        _invalid(lambda m=m: LayerAssembler(BF16, SHAPE).add(m), *words)


def test_fp8_scales_checked():
    kv = _kv(FP8)
    scales = np.ones((3, 2), np.float32)
    ms = _msgs(kv, FP8, 1000)  # no scales
    _invalid(lambda: LayerAssembler(FP8, SHAPE).add(ms[0]), "FP8 layers need 2 fp8_scales, got 0")
    ms = _msgs(kv, FP8, 50, scales)
    asm = LayerAssembler(FP8, SHAPE)
    asm.add(ms[0])
    ms[1].fp8_scales[1] = 2.0
    _invalid(lambda: asm.add(ms[1]), "fp8_scales differ between parts")
    m = _msgs(_kv(), BF16, 1000)[0]
    m.fp8_scales.extend([1.0, 1.0])
    _invalid(lambda: LayerAssembler(BF16, SHAPE).add(m), "BF16 layers carry no fp8_scales")


# -- RecordAssembler ------------------------------------------------------------------------

def _chunks(recs, part_bytes):
    out = []
    for i, rec in enumerate(recs):
        for off, ln in parts(len(rec), part_bytes):
            out.append(dpb.Chunk(index=i, record=rec[off:off + ln], byte_offset=off, record_bytes=len(rec)))
    return out


RECS = [bytes(range(256)) * 2, b"\x07" * 100, b"xyz"]


@pytest.mark.parametrize("part_bytes", [1, 3, 64, 512, 4096])
def test_records_round_trip(part_bytes):
    asm = RecordAssembler(len(RECS), 1024)
    got = []
    for c in _chunks(RECS, part_bytes):
        size = asm.first_part_size(c)
        assert (size is not None) == (c.byte_offset == 0)
        assert size is None or size == c.record_bytes
        rec = asm.add(c)
        assert asm.pending == (0 if rec is not None else c.record_bytes)
        if rec is not None:
            got.append(bytes(rec))
    assert got == RECS and asm.next_index == 3 and asm.pending == 0


def test_record_parts_out_of_order():
    cs = _chunks(RECS, 100)  # record 0 in 6 parts
    asm = RecordAssembler(3, 1024)
    _invalid(lambda: asm.first_part_size(cs[1]), "first part at offset 100")
    asm.first_part_size(cs[0])
    asm.add(cs[0])
    _invalid(lambda: asm.add(cs[2]), "part at offset 200 does not continue record 0 (100 of 512 bytes)")


def test_records_out_of_order():
    cs = _chunks(RECS, 4096)
    asm = RecordAssembler(3, 1024)
    _invalid(lambda: asm.first_part_size(cs[1]), "got chunk 1, expected chunk 0 of 3")
    asm.first_part_size(cs[0])
    asm.add(cs[0])
    _invalid(lambda: asm.first_part_size(cs[0]), "got chunk 0, expected chunk 1")


def test_more_records_than_announced():
    cs = _chunks(RECS, 4096)
    asm = RecordAssembler(1, 1024)
    asm.first_part_size(cs[0])
    asm.add(cs[0])
    extra = dpb.Chunk(index=1, record=b"x", byte_offset=0, record_bytes=1)
    _invalid(lambda: asm.first_part_size(extra), "expected chunk 1 of 1")


def test_record_overrun_and_empty_part():
    cs = _chunks(RECS, 100)
    asm = RecordAssembler(3, 1024)
    asm.first_part_size(cs[0])
    asm.add(cs[0])
    long = dpb.Chunk(index=0, record=b"\x00" * 500, byte_offset=100, record_bytes=512)
    _invalid(lambda: asm.add(long), "overruns its 512-byte record")
    empty = dpb.Chunk(index=0, record=b"", byte_offset=100, record_bytes=512)
    _invalid(lambda: asm.add(empty), "or is empty")


def test_record_size_changes_between_parts():
    cs = _chunks(RECS, 100)
    asm = RecordAssembler(3, 1024)
    asm.first_part_size(cs[0])
    asm.add(cs[0])
    cs[1].record_bytes = 600
    _invalid(lambda: asm.add(cs[1]), "does not continue record 0")


@pytest.mark.parametrize("record_bytes", [0, 1025])
def test_record_size_limits(record_bytes):
    c = dpb.Chunk(index=0, record=b"x", byte_offset=0, record_bytes=record_bytes)
    _invalid(lambda: RecordAssembler(3, 1024).first_part_size(c), f"{record_bytes}-byte record (limit 1024)")


# -- where the bytes go: borrowed, in place, from a payload view ---------------------------

def test_borrow_keeps_a_one_part_layer_in_its_message():
    kv = _kv()
    asm = LayerAssembler(BF16, SHAPE, borrow=True)
    for m in _msgs(kv, part_bytes=320):  # one part per layer: borrowed, read-only
        k, arr, _ = asm.add(m, memoryview(m.data))
        assert np.array_equal(arr, kv[k]) and not arr.flags.writeable
    asm = LayerAssembler(BF16, SHAPE, borrow=True)
    out = [r for m in _msgs(kv, part_bytes=100) if (r := asm.add(m)) is not None]  # several parts: copied
    assert all(np.array_equal(arr, kv[k]) and arr.flags.writeable for k, arr, _ in out)


def test_layers_land_in_out():
    kv = _kv()
    whole = np.zeros(SHAPE, np.dtype("<u2"))
    asm = LayerAssembler(BF16, SHAPE, out=whole)
    out = [r for m in _msgs(kv, part_bytes=70) if (r := asm.add(m)) is not None]
    assert np.array_equal(whole, kv) and all(np.shares_memory(arr, whole) for _, arr, _ in out)
    with pytest.raises(ValueError):
        LayerAssembler(BF16, SHAPE, out=np.zeros(SHAPE, np.uint8))


def test_a_payload_stands_for_the_data_field():
    kv = _kv()
    asm = LayerAssembler(BF16, SHAPE)
    for m in _msgs(kv, part_bytes=320):
        payload = memoryview(m.data)
        m.data = b""  # as frames.split parses it: the field left out
        k, arr, _ = asm.add(m, payload)
        assert np.array_equal(arr, kv[k])
    asm = RecordAssembler(1, 1024)
    c = dpb.Chunk(index=0, record=b"", byte_offset=0, record_bytes=3)
    assert asm.first_part_size(c) == 3 and bytes(asm.add(c, memoryview(b"xyz"))) == b"xyz"


def test_a_one_part_record_is_its_own_bytes():
    asm = RecordAssembler(1, 1024)
    c = dpb.Chunk(index=0, record=b"abcd", byte_offset=0, record_bytes=4)
    asm.first_part_size(c)
    view = memoryview(b"abcd")
    assert asm.add(c, view) is view and asm.next_index == 1 and asm.pending == 0


def test_layer_frames_are_layer_messages_serialised():
    from speckv import frames
    from speckv.v1 import encoder_pb2 as epb
    from speckv.wire import layer_frames

    kv = _kv(FP8)
    scales = np.array([[0.5, 2.0], [1e-3, 3.0], [np.float32(1 / 3), 7.25]], np.float32)
    for part_bytes in (1, 100, 320, 10_000):
        for k in range(SHAPE[0]):
            msgs = list(layer_messages(k, kv[k], FP8, kv_shape(SHAPE), part_bytes, scales[k]))
            got = [frames.join(frames.submessage(2, p)) for p in layer_frames(k, kv[k], FP8, kv_shape(SHAPE),
                                                                             part_bytes, scales[k])]
            assert got == [epb.SubmitRequest(layer=m).SerializeToString() for m in msgs]
