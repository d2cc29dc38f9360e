"""Paged gather/scatter (speckv.client.paged): the block interior learned from a cache
writer (a stand-in for vLLM's CPU kernel, keys dim-major and values token-major, and
a plain token-major one), refused when the writer is no permutation; gather of what the
writer stored and scatter back, bit for bit, over block boundaries and partial token
ranges, into any block ids; wrong shapes, dtypes and block counts refused."""
from __future__ import annotations

import functools

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from speckv.client.paged import PagedLayout


def vllm_cpu_writer(key, value, key_cache, value_cache, slots):
    """vLLM's CPU ``reshape_and_cache`` (vec kernels): per (block, head), the keys at
    ``d * block_size + t``, then the values at ``block_size * head_dim + t * head_dim + d``.
    ``key_cache`` is shaped (blocks, heads, block_size, head_dim), but the kernel treats each
    (block, head) of it as (head_dim, block_size): written through a strided view of its memory."""
    nb, heads, bs, dim = key_cache.shape
    s_block, s_head = key_cache.stride()[:2]
    keys_t = key_cache.as_strided((nb, heads, dim, bs), (s_block, s_head, bs, 1))  # same storage offset
    for i, slot in enumerate(slots.tolist()):
        block, t = divmod(slot, bs)
        keys_t[block, :, :, t] = key[i]
        value_cache[block, :, t, :] = value[i]


def token_major_writer(key, value, key_cache, value_cache, slots):
    bs = key_cache.shape[2]
    for i, slot in enumerate(slots.tolist()):
        block, t = divmod(slot, bs)
        key_cache[block, :, t, :] = key[i]
        value_cache[block, :, t, :] = value[i]


def duplicating_writer(key, value, key_cache, value_cache, slots):
    """Token 0's key lands in token 1's place too; token 1's key is lost."""
    token_major_writer(key, value, key_cache, value_cache, slots)
    key_cache[0, :, 1, :] = key[0]


def dropping_writer(key, value, key_cache, value_cache, slots):
    """The last token's value is never written (its key is)."""
    bs = key_cache.shape[2]
    for i, slot in enumerate(slots.tolist()):
        block, t = divmod(slot, bs)
        key_cache[block, :, t, :] = key[i]
        if i < len(slots) - 1:
            value_cache[block, :, t, :] = value[i]


WRITERS = {"vllm_cpu": vllm_cpu_writer, "token_major": token_major_writer}


@functools.cache
def layout(writer: str, bs: int, dim: int) -> PagedLayout:
    return PagedLayout.learn(WRITERS[writer], bs, dim)


def random_bf16(*shape: int, seed: int = 0) -> torch.Tensor:
    """Random bit patterns (NaN and inf ones too): any value must move unchanged."""
    g = torch.Generator().manual_seed(seed)
    codes = torch.randint(-(1 << 15), 1 << 15, shape, generator=g, dtype=torch.int32)
    return codes.to(torch.int16).view(torch.bfloat16)


def paged_layer(nb: int, heads: int, bs: int, dim: int, seed: int = 1) -> torch.Tensor:
    """A layer as vLLM's CPU backend allocates it, already full of other requests' bits."""
    return random_bf16(nb, heads, bs, 2 * dim, seed=seed)


def write(writer, layer: torch.Tensor, block_ids: list[int], start: int, kv: torch.Tensor) -> None:
    """Store ``kv`` (2, heads, tokens, dim) at tokens [start, ...) with the engine's writer."""
    nb, heads, bs, width = layer.shape
    kc, vc = layer.view(nb, heads, 2 * bs, width // 2).chunk(2, dim=2)
    t = torch.arange(start, start + kv.shape[2])
    slots = torch.tensor(block_ids, dtype=torch.int64)[t // bs] * bs + t % bs
    writer(kv[0].transpose(0, 1), kv[1].transpose(0, 1), kc, vc, slots)


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int16)


# -- learn -------------------------------------------------------------------------

def test_learns_vllm_cpu_interior():
    bs, dim = 32, 16
    lay = layout("vllm_cpu", bs, dim)
    t, d = torch.meshgrid(torch.arange(bs), torch.arange(dim), indexing="ij")
    assert (lay.block_size, lay.head_dim) == (bs, dim)
    assert lay.k_pos.dtype == lay.v_pos.dtype == torch.int64
    assert torch.equal(lay.k_pos, d * bs + t)
    assert torch.equal(lay.v_pos, bs * dim + t * dim + d)


def test_learns_token_major_interior():
    bs, dim = 16, 32
    lay = layout("token_major", bs, dim)
    t, d = torch.meshgrid(torch.arange(bs), torch.arange(dim), indexing="ij")
    assert torch.equal(lay.k_pos, t * dim + d)
    assert torch.equal(lay.v_pos, bs * dim + t * dim + d)


@pytest.mark.parametrize("writer", [duplicating_writer, dropping_writer], ids=["duplicates", "drops"])
def test_learn_refuses_a_writer_that_is_no_permutation(writer):
    with pytest.raises(ValueError, match="permutation"):
        PagedLayout.learn(writer, 16, 16)


def test_learn_probes_large_blocks_in_two_digit_passes():
    # 128 x 256 = 32768 codes: more than one BF16 probe pass can tell apart, so two passes of digits
    lay = PagedLayout.learn(vllm_cpu_writer, 128, 256)
    assert torch.equal(lay.k_pos, torch.arange(256)[None, :] * 128 + torch.arange(128)[:, None])
    assert torch.equal(lay.v_pos, 128 * 256 + torch.arange(128 * 256).reshape(128, 256))
    with pytest.raises(ValueError, match="too large"):
        PagedLayout.learn(token_major_writer, 4097, 4096)  # past 4096**2 codes: refused before any write


# -- gather / scatter --------------------------------------------------------------

def test_gather_returns_what_the_writer_stored():
    bs, heads, dim, tokens = 32, 2, 16, 75  # three blocks, the last one partly filled
    layer = paged_layer(9, heads, bs, dim)
    blocks = [6, 2, 8]
    kv = random_bf16(2, heads, tokens, dim, seed=2)
    write(vllm_cpu_writer, layer, blocks, 0, kv)
    got = layout("vllm_cpu", bs, dim).gather(layer, blocks, 0, tokens)
    assert got.dtype == torch.bfloat16 and got.shape == (2, heads, tokens, dim) and got.is_contiguous()
    assert torch.equal(bits(got), bits(kv))


def test_gather_with_the_wrong_layout_does_not_match():
    bs, heads, dim = 32, 1, 16
    layer = paged_layer(2, heads, bs, dim)
    kv = random_bf16(2, heads, bs, dim, seed=3)
    write(vllm_cpu_writer, layer, [1], 0, kv)
    assert not torch.equal(bits(layout("token_major", bs, dim).gather(layer, [1], 0, bs)), bits(kv))


@pytest.mark.parametrize("start, stop", [(0, 1), (31, 33), (5, 64), (32, 64), (40, 90), (95, 96), (50, 50)])
def test_gather_token_ranges(start, stop):
    bs, heads, dim = 32, 3, 16
    layer = paged_layer(5, heads, bs, dim)
    blocks = [4, 0, 3]
    kv = random_bf16(2, heads, 96, dim, seed=4)
    write(vllm_cpu_writer, layer, blocks, 0, kv)
    got = layout("vllm_cpu", bs, dim).gather(layer, blocks, start, stop)
    assert got.shape == (2, heads, stop - start, dim)
    assert torch.equal(bits(got), bits(kv[:, :, start:stop]))


@pytest.mark.parametrize("writer", sorted(WRITERS))
def test_scatter_stores_what_the_writer_would(writer):
    bs, heads, dim, start, tokens = 32, 2, 16, 20, 50  # tokens [20, 70): three blocks, two partly
    lay = layout(writer, bs, dim)
    blocks = [7, 1, 4]
    kv = random_bf16(2, heads, tokens, dim, seed=5)
    ours, engines = paged_layer(8, heads, bs, dim), paged_layer(8, heads, bs, dim)
    lay.scatter(ours, blocks, start, kv)
    write(WRITERS[writer], engines, blocks, start, kv)
    assert torch.equal(bits(ours), bits(engines))  # every other byte (other blocks, tokens) untouched
    assert torch.equal(bits(lay.gather(ours, blocks, start, start + tokens)), bits(kv))


def test_scatter_of_nothing_changes_nothing():
    layer = paged_layer(2, 1, 32, 16)
    before = layer.clone()
    layout("vllm_cpu", 32, 16).scatter(layer, [1], 10, torch.empty(2, 1, 0, 16, dtype=torch.bfloat16))
    assert torch.equal(bits(layer), bits(before))


def test_too_few_blocks():
    lay = layout("vllm_cpu", 32, 16)
    layer = paged_layer(4, 1, 32, 16)
    assert lay.gather(layer, [3, 2], 0, 64).shape == (2, 1, 64, 16)  # exactly two blocks' worth
    with pytest.raises(ValueError, match="need 3 blocks, the request has 2"):
        lay.gather(layer, [3, 2], 0, 65)
    with pytest.raises(ValueError, match="blocks"):
        lay.gather(layer, [], 0, 1)
    with pytest.raises(ValueError, match="need 3 blocks, the request has 2"):
        lay.scatter(layer, [3, 2], 60, random_bf16(2, 1, 5, 16))
    assert lay.gather(layer, [], 0, 0).shape == (2, 1, 0, 16)


def test_scatter_refuses_another_dtype():
    lay = layout("vllm_cpu", 32, 16)
    layer = paged_layer(2, 1, 32, 16)
    before = layer.clone()
    for dtype in (torch.float16, torch.float32, torch.int16):
        with pytest.raises(TypeError, match="dtype"):
            lay.scatter(layer, [0], 0, torch.zeros(2, 1, 4, 16, dtype=dtype))
    assert torch.equal(bits(layer), bits(before))


@pytest.mark.parametrize("shape", [(1, 4, 16), (1, 1, 4, 16), (3, 1, 4, 16), (2, 2, 4, 16), (2, 1, 4, 32),
                                   (2, 1, 4, 8), (1, 2, 1, 4, 16)])
def test_scatter_refuses_a_kv_of_another_shape(shape):
    lay = layout("vllm_cpu", 32, 16)
    layer = paged_layer(2, 1, 32, 16)
    with pytest.raises(ValueError, match="does not fit"):
        lay.scatter(layer, [0], 0, torch.zeros(shape, dtype=torch.bfloat16))


@pytest.mark.parametrize("layer_shape", [(2, 1, 16, 32), (2, 1, 32, 16), (2, 1, 32, 64), (2, 1, 64, 32), (2, 32, 32)])
def test_refuses_a_layer_of_another_shape(layer_shape):
    lay = layout("vllm_cpu", 32, 16)  # (blocks, heads, 32, 32) layers
    layer = torch.zeros(layer_shape, dtype=torch.bfloat16)
    with pytest.raises(ValueError):
        lay.gather(layer, [0], 0, 4)


def test_refuses_a_non_contiguous_layer():
    lay = layout("vllm_cpu", 32, 16)
    layer = paged_layer(4, 1, 32, 16)[::2]  # every other block: the right shape, not one buffer
    assert layer.shape == (2, 1, 32, 32)
    with pytest.raises(ValueError, match="contiguous"):
        lay.gather(layer, [0], 0, 4)
    with pytest.raises(ValueError, match="contiguous"):
        lay.scatter(layer, [0], 0, random_bf16(2, 1, 4, 16))


@st.composite
def cases(draw):
    bs = draw(st.sampled_from([32, 64]))
    dim = draw(st.sampled_from([16, 32]))
    heads = draw(st.integers(1, 3))
    start = draw(st.integers(0, 3 * bs))
    stop = draw(st.integers(start, start + 3 * bs))
    need = (stop - 1) // bs + 1 if stop > start else 0
    nb = need + draw(st.integers(0, 2))
    blocks = draw(st.permutations(range(nb)))[:max(need, draw(st.integers(0, nb)))]
    return draw(st.sampled_from(sorted(WRITERS))), bs, dim, heads, start, stop, nb, blocks, draw(st.integers(0, 99))


@settings(max_examples=30, deadline=None)
@given(cases())
def test_round_trips(case):
    writer, bs, dim, heads, start, stop, nb, blocks, seed = case
    lay = layout(writer, bs, dim)
    kv = random_bf16(2, heads, stop - start, dim, seed=seed)
    ours, engines = paged_layer(nb, heads, bs, dim, seed=seed + 1), paged_layer(nb, heads, bs, dim, seed=seed + 1)
    lay.scatter(ours, blocks, start, kv)
    write(WRITERS[writer], engines, blocks, start, kv)
    assert torch.equal(bits(ours), bits(engines))
    assert torch.equal(bits(lay.gather(engines, blocks, start, stop)), bits(kv))


# -- FP8 e4m3 caches (uint8 codes) -------------------------------------------------------

def vllm_cpu_fp8_writer(key, value, key_cache, value_cache, slots):
    """vLLM's CPU writer for an FP8 e4m3 cache (uint8): BF16 values quantized (scale 1),
    stored in the same interior as the BF16 one."""
    def codes(x: torch.Tensor) -> torch.Tensor:
        return x.to(torch.float32).to(torch.float8_e4m3fn).view(torch.uint8)

    nb, heads, bs, dim = key_cache.shape
    s_block, s_head = key_cache.stride()[:2]
    keys_t = key_cache.as_strided((nb, heads, dim, bs), (s_block, s_head, bs, 1))
    for i, slot in enumerate(slots.tolist()):
        block, t = divmod(slot, bs)
        keys_t[block, :, :, t] = codes(key[i])
        value_cache[block, :, t, :] = codes(value[i])


def test_learn_an_fp8_cache_through_its_quantizing_writer():
    bs, dim = 32, 16
    fp8 = PagedLayout.learn(vllm_cpu_fp8_writer, bs, dim, torch.uint8)
    bf16 = layout("vllm_cpu", bs, dim)
    assert torch.equal(fp8.k_pos, bf16.k_pos) and torch.equal(fp8.v_pos, bf16.v_pos)


def test_fp8_codes_gather_and_scatter_bit_for_bit():
    bs, heads, dim, tokens = 32, 2, 16, 70
    lay = PagedLayout.learn(vllm_cpu_fp8_writer, bs, dim, torch.uint8)
    g = torch.Generator().manual_seed(5)
    layer = torch.randint(0, 256, (6, heads, bs, 2 * dim), generator=g, dtype=torch.uint8)
    kv = torch.randint(0, 256, (2, heads, tokens, dim), generator=g, dtype=torch.uint8)  # any code, NaN ones too
    before = layer.clone()
    lay.scatter(layer, [4, 0, 5], 0, kv)
    assert torch.equal(lay.gather(layer, [4, 0, 5], 0, tokens), kv)
    assert torch.equal(layer[[1, 2, 3]], before[[1, 2, 3]])  # no other block touched
    with pytest.raises(TypeError):
        lay.scatter(layer, [4, 0, 5], 0, kv.view(torch.int8))


def test_learn_refuses_a_cache_dtype_it_cannot_probe():
    with pytest.raises(ValueError, match="no probe"):
        PagedLayout.learn(token_major_writer, 16, 16, torch.float16)


def _rounding_writer(toward_zero: bool | None):
    """An FP8 cache writer (uint8 e4m3 codes at scale 1.0) rounding to nearest, toward zero, or (None)
    one code above nearest (no rounding at all)."""
    def write(key, value, key_cache, value_cache, slots):
        for src, cache in ((key, key_cache), (value, value_cache)):
            y = src.float()
            q = y.to(torch.float8_e4m3fn).view(torch.uint8).clone()
            dec = q.view(torch.float8_e4m3fn).float()
            if toward_zero:
                q[(dec.abs() > y.abs()) & ((q & 0x7F) > 0)] -= 1
            elif toward_zero is None:
                q += 1
            for i, slot in enumerate(slots.tolist()):
                cache[0, :, slot, :] = q[i]
    return write


@pytest.mark.parametrize("toward_zero", [True, False])
def test_fp8_rounding_probe(toward_zero):
    from speckv.client.paged import fp8_rounds_toward_zero

    assert fp8_rounds_toward_zero(_rounding_writer(toward_zero), 16, 32) is toward_zero


def test_fp8_rounding_probe_refuses_other_roundings():
    from speckv.client.paged import fp8_rounds_toward_zero

    with pytest.raises(ValueError, match="neither rounding to nearest nor toward zero"):
        fp8_rounds_toward_zero(_rounding_writer(None), 16, 32)
