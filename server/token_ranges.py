"""Layers sent in token ranges (chunked prefill): the encoder's assembler of them.

An engine that prefills a long prompt in steps produces every layer's K/V for tokens
``[0, 256)``, then for ``[256, 512)``, and so on. Its Submit may send each step's
tokens of every layer at once (``KVLayer.token_start`` / ``token_count``) instead of
holding whole layers back until the last step: each range arrives in its own parts
(the byte rules of a whole layer, within the range), lands in its layer's buffer, and a
layer is complete once its tokens reach the prompt's end. Chunks are still coded
whole layers at a time, so the rules are: a layer's ranges in token order without a
gap; ranges of different layers in any interleaving; layers complete in layer order.

    ranges = TokenRanges(dtype, shape)
    for part in parts:
        for layer, arr, scales in ranges.add(part, payload):   # the layers it completed
            ...
    ranges.done  # every layer complete
"""

from __future__ import annotations

from dataclasses import dataclass, field

import grpc
import numpy as np

from speckv.errors import RpcError
from speckv.v1 import common_pb2 as pb
from speckv.wire import NAN_SCALES, LayerAssembler, bad, dtype_of, layer_bytes, scale_bits, shape_of


@dataclass
class _Layer:
    buf: np.ndarray  # (2, heads, tokens, dim): the layer, filled range by range
    tokens: int = 0  # tokens [0, tokens) are in
    scales: tuple[int, ...] = ()  # fp32 bit patterns, the same on every range


@dataclass
class _Range:
    """The token range whose parts are arriving."""

    layer: int
    start: int
    count: int
    size: int  # its raw bytes
    parts: int
    data: bytearray
    scales: tuple[int, ...]  # fp32 bit patterns of its first part's fp8_scales
    part: int = 0


@dataclass
class TokenRanges:
    """Rebuilds layers from KVLayer parts of token ranges (see the module docstring)."""

    dtype: int
    shape: tuple[int, int, int, int, int]
    next_layer: int = 0  # the next layer to complete
    _layers: dict[int, _Layer] = field(default_factory=dict)
    _range: _Range | None = None

    @staticmethod
    def need(whole_layers: LayerAssembler, limit: int) -> int:
        """The bytes a Submit switching to token ranges (before its first layer only) reserves:
        its whole KV, as ranges of every layer may arrive before any layer is complete.
        NOTE: at once, not layer by layer: two such Submits each holding part of the cap while
        waiting for more would never complete. RESOURCE_EXHAUSTED above ``limit``."""
        if whole_layers.next_layer or not whole_layers.starting:
            raise bad("a Submit sends all of its layers whole or all in token ranges")
        whole = whole_layers.shape[0] * whole_layers.layer_size
        if whole > limit:
            raise RpcError(grpc.StatusCode.RESOURCE_EXHAUSTED, f"token ranges need the whole KV ({whole} bytes) "
                           f"within the in-flight cap ({limit}); send whole layers")
        return whole

    @property
    def done(self) -> bool:
        return self.next_layer == self.shape[0] and self._range is None

    @property
    def starting(self) -> bool:
        """True when the next part must begin a new range."""
        return self._range is None

    def add(self, m: pb.KVLayer, payload: memoryview | None = None) -> list[tuple[int, np.ndarray, np.ndarray | None]]:
        """Take one part; the layers it completed (in layer order; none, or one)."""
        if m.dtype != self.dtype or shape_of(m.shape) != self.shape:
            raise bad(f"layer {m.layer}: dtype/shape differ from the header's")
        if m.token_count == 0:
            raise bad(f"layer {m.layer}: a whole layer among token ranges (send every layer in token ranges)")
        data = m.data if payload is None else payload  # NOTE: read once: upb copies a bytes field on every access
        r = self._range if self._range is not None else self._begin(m)
        if (m.layer, m.token_start, m.token_count) != (r.layer, r.start, r.count):
            raise bad(f"layer {m.layer} tokens {m.token_start}+{m.token_count}: the range of layer {r.layer} "
                      f"tokens {r.start}+{r.count} is not complete")
        if (m.part_index, m.part_count, m.layer_bytes) != (r.part, r.parts, r.size):
            raise bad(f"layer {m.layer}: part {m.part_index}/{m.part_count} of {m.layer_bytes} bytes, expected "
                      f"{r.part}/{r.parts} of {r.size}")
        if m.byte_offset != len(r.data) or len(r.data) + len(data) > r.size:
            raise bad(f"layer {m.layer}: part at offset {m.byte_offset} (+{len(data)}) does not continue the range")
        if scale_bits(m.fp8_scales) != r.scales:
            raise bad(f"layer {m.layer}: fp8_scales differ between its parts")
        r.data += data
        r.part += 1
        if r.part < r.parts:
            return []
        if len(r.data) != r.size:
            raise bad(f"layer {m.layer}: parts cover {len(r.data)} of {r.size} bytes")
        self._range = None
        return self._land(r)

    def _begin(self, m: pb.KVLayer) -> _Range:
        L, _, H, T, D = self.shape
        if not self.next_layer <= m.layer < L:
            raise bad(f"layer {m.layer}: not a layer still being sent ({self.next_layer} to {L - 1})")
        have = self._layers[m.layer].tokens if m.layer in self._layers else 0
        if m.token_start != have or not 1 <= m.token_count <= T - have:
            raise bad(f"layer {m.layer}: tokens {m.token_start}+{m.token_count} do not continue its tokens "
                      f"[0, {have}) of {T}")
        size = layer_bytes((L, 2, H, m.token_count, D), dtype_of(self.dtype)[1].itemsize)
        if m.part_index != 0 or not 1 <= m.part_count <= max(1, size):
            raise bad(f"layer {m.layer}: the range's first part has index {m.part_index} of {m.part_count}")
        if any(v != v for v in m.fp8_scales):
            raise bad(f"layer {m.layer}: {NAN_SCALES}")
        scales = scale_bits(m.fp8_scales)
        fp8 = dtype_of(self.dtype)[0] == "fp8"
        if len(scales) != (2 if fp8 else 0):
            raise bad(f"layer {m.layer}: " + (f"FP8 layers need 2 fp8_scales, got {len(scales)}" if fp8
                                               else "BF16 layers carry no fp8_scales"))
        if m.layer in self._layers and self._layers[m.layer].scales != scales:
            raise bad(f"layer {m.layer}: fp8_scales differ between its token ranges")
        self._range = _Range(m.layer, m.token_start, m.token_count, size, m.part_count, bytearray(), scales)
        return self._range

    def _land(self, r: _Range) -> list[tuple[int, np.ndarray, np.ndarray | None]]:
        """Copy a complete range into its layer; the layer, when that completed it."""
        _, _, H, T, D = self.shape
        dt = dtype_of(self.dtype)[1]
        ly = self._layers.get(r.layer)
        if ly is None:
            ly = self._layers[r.layer] = _Layer(np.empty((2, H, T, D), dt.newbyteorder("=")), scales=r.scales)
        ly.buf[:, :, r.start:r.start + r.count] = np.frombuffer(r.data, dt).reshape(2, H, r.count, D)
        ly.tokens += r.count
        if ly.tokens < T:
            return []
        if r.layer != self.next_layer:
            raise bad(f"layer {r.layer} completed before layer {self.next_layer} (layers complete in order)")
        del self._layers[r.layer]
        self.next_layer += 1
        scales = None if not ly.scales else np.array(ly.scales, np.uint32).view(np.float32)
        return [(r.layer, ly.buf, scales)]
