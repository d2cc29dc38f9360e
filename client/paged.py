"""Gather a request's KV out of vLLM's paged cache, and scatter it back in.

speckv's layer is ``(2, kv_heads, tokens, head_dim)``; vLLM keeps each attention layer
in fixed-size blocks, a request's tokens spread over the blocks of its block table:
token ``t`` lives in block ``block_ids[t // block_size]`` at offset ``t % block_size``.

Where a (token offset, dim) sits *inside* a block depends on the attention kernel, and
is not part of vLLM's API: the CPU backend keeps ``(num_blocks, kv_heads, block_size,
2 * head_dim)``, each (block, head) holding its keys then its values, and with its
``vec`` kernels the keys are stored transposed (dim-major) while the values are not.
Rather than hard-code one kernel's interior, ``PagedLayout.learn`` asks the engine's own
cache writer: it writes index-coded keys and values into a scratch block and reads back
where each landed. The result must be a bijection, else it refuses (ValueError).

A layer is BF16, or FP8 e4m3 codes (uint8: vLLM's CPU backend stores FP8 caches so),
whose scales travel beside it; gather and scatter move its elements as they are.

Imported only inside vLLM's process (it needs torch).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

import torch

# NOTE: index-coded BF16 bit patterns start here so every probe value is a normal,
# finite number: a kernel that flushes denormals or canonicalises NaNs still copies it
PROBE_BASE = 0x3C00
# (digit base, passes) per cache dtype: BF16 bit patterns PROBE_BASE + digit stay finite below 4096;
# an FP8 e4m3 cache (uint8) holds the integers 0..16 exactly, so base 16
PROBE_DIGITS = {torch.bfloat16: (4096, 2), torch.uint8: (16, 4)}
# (key, value, key_cache, value_cache, slot_mapping): the engine's cache writer
Writer = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], None]


# between e4m3 codes 1.0 and 1.125, nearer 1.125 (exact in BF16): where it lands tells the rounding
ROUNDING_PROBE = 1.09375


def fp8_rounds_toward_zero(write: Writer, block_size: int, head_dim: int) -> bool:
    """Whether the engine's FP8 cache writer (scale 1.0) rounds toward zero (True) or to nearest
    (False), asked by writing +-ROUNDING_PROBE; ValueError for any other result."""
    cache = torch.zeros(1, 1, block_size, 2 * head_dim, dtype=torch.uint8)
    kc, vc = cache.view(1, 1, 2 * block_size, head_dim).chunk(2, dim=2)
    probe = torch.full((block_size, 1, head_dim), ROUNDING_PROBE, dtype=torch.bfloat16)
    probe[::2] = -ROUNDING_PROBE
    write(probe, probe.clone(), kc, vc, torch.arange(block_size, dtype=torch.int64))
    got = set(cache.view(torch.float8_e4m3fn).float().abs().reshape(-1).tolist())
    if got in ({1.0}, {1.125}):
        return got == {1.0}
    raise ValueError(f"the engine's FP8 cache writer stored {sorted(got)} for +-{ROUNDING_PROBE}: "
                     "neither rounding to nearest nor toward zero")


@dataclass(frozen=True)
class PagedLayout:
    """Offsets of (token offset, dim) of K and of V inside one (block, head) of a layer
    whose tensor is ``(num_blocks, heads, block_size, 2 * head_dim)``."""

    block_size: int
    head_dim: int
    k_pos: torch.Tensor  # (block_size, head_dim) int64, in [0, block_size * head_dim)
    v_pos: torch.Tensor  # (block_size, head_dim) int64, in [block_size * head_dim, 2 * ...)

    @classmethod
    def learn(cls, write: Writer, block_size: int, head_dim: int, dtype: torch.dtype = torch.bfloat16) -> "PagedLayout":
        """Probe ``write`` (the kernel that stores K/V into a paged cache of ``dtype``: BF16,
        or uint8 FP8 e4m3 codes): each (token, dim) gets a code ``t * head_dim + d``,
        written as digits (one pass each) and read back where it landed."""
        if dtype not in PROBE_DIGITS:
            raise ValueError(f"no probe for a {dtype} paged cache (BF16, or uint8 FP8 e4m3 codes)")
        base, passes = PROBE_DIGITS[dtype]
        n = block_size * head_dim
        if n > base ** passes:
            raise ValueError(f"a block of {block_size} x {head_dim} is too large to probe")
        got = sum(cls._probe(write, block_size, head_dim, dtype, base, base ** i) * base ** i for i in range(passes))
        k_pos, v_pos = torch.empty(n, dtype=torch.int64), torch.empty(n, dtype=torch.int64)
        for pos, part, off in ((k_pos, got[:n], 0), (v_pos, got[n:], n)):
            if not torch.equal(part.sort().values, torch.arange(n)):
                raise ValueError("the engine's cache writer does not store a block as a permutation of its tokens "
                                 "and dims; speckv cannot read this paged layout")
            pos[part] = torch.arange(n) + off
        return cls(block_size, head_dim, k_pos.reshape(block_size, head_dim), v_pos.reshape(block_size, head_dim))

    @staticmethod
    def _probe(write: Writer, block_size: int, head_dim: int, dtype: torch.dtype, base: int,
               place: int) -> torch.Tensor:
        """One pass: the digit ``(code // place) % base`` found at each offset of K then V."""
        n = block_size * head_dim
        cache = torch.zeros(1, 1, block_size, 2 * head_dim, dtype=dtype)
        kc, vc = cache.view(1, 1, 2 * block_size, head_dim).chunk(2, dim=2)
        digit = torch.arange(n, dtype=torch.int32).reshape(block_size, 1, head_dim) // place % base
        if dtype == torch.uint8:  # NOTE: the writer quantizes BF16 values to e4m3: integers 0..16 are exact
            probe = digit.to(torch.bfloat16)
        else:  # BF16 bit patterns, copied as they are
            probe = (digit + PROBE_BASE).to(torch.int16).view(torch.bfloat16)
        write(probe, probe.clone(), kc, vc, torch.arange(block_size, dtype=torch.int64))  # probe: (tokens, heads, dim)
        flat = cache.reshape(-1)
        if dtype == torch.uint8:
            return flat.view(torch.float8_e4m3fn).to(torch.float32).to(torch.int64)  # (2n,)
        return flat.view(torch.int16).to(torch.int64) - PROBE_BASE

    def _index(self, layer: torch.Tensor, block_ids: Sequence[int], start: int, stop: int) -> torch.Tensor:
        """Flat offsets into ``layer`` of tokens [start, stop): (2, heads, tokens, head_dim)."""
        nb, heads, bs, width = layer.shape
        if (bs, width) != (self.block_size, 2 * self.head_dim) or not layer.is_contiguous():
            raise ValueError(f"a contiguous (blocks, heads, {self.block_size}, {2 * self.head_dim}) layer expected, "
                             f"not {tuple(layer.shape)}")
        need = (stop - 1) // bs + 1 if stop > start else 0
        if need > len(block_ids):
            raise ValueError(f"tokens up to {stop} need {need} blocks, the request has {len(block_ids)}")
        t = torch.arange(start, stop)
        blocks = torch.tensor(list(block_ids), dtype=torch.int64)[t // bs]  # (tokens,)
        per = bs * width  # one (block, head)
        base = (blocks[None, :] * heads + torch.arange(heads)[:, None]) * per  # (heads, tokens)
        off = torch.stack((self.k_pos[t % bs], self.v_pos[t % bs]))  # (2, tokens, head_dim)
        return base[None, :, :, None] + off[:, None, :, :]

    def gather(self, layer: torch.Tensor, block_ids: Sequence[int], start: int, stop: int) -> torch.Tensor:
        """Tokens [start, stop) of one layer as a contiguous (2, heads, tokens, head_dim) copy."""
        return layer.reshape(-1)[self._index(layer, block_ids, start, stop)]

    def scatter(self, layer: torch.Tensor, block_ids: Sequence[int], start: int, kv: torch.Tensor) -> None:
        """Write ``kv`` (2, heads, tokens, head_dim) into tokens [start, start + tokens) of one layer."""
        if kv.dim() != 4 or kv.shape[0] != 2 or kv.shape[1] != layer.shape[1] or kv.shape[3] != self.head_dim:
            raise ValueError(f"KV of shape {tuple(kv.shape)} does not fit a layer of {layer.shape[1]} heads of "
                             f"dimension {self.head_dim}")
        if kv.dtype != layer.dtype:
            raise TypeError(f"KV of dtype {kv.dtype} into a {layer.dtype} cache")
        idx = self._index(layer, block_ids, start, start + kv.shape[2])
        layer.view(-1)[idx.reshape(-1)] = kv.reshape(-1)
