"""The native int8 product (spk_igemm.h) that ``products.int_mm`` runs on CPUs without VNNI: exact int32
sums, equal to the int64 reference bit for bit for every shape class (k, m and n tails of the AVX2
micro-kernel and its panels, empty operands), the whole int8 range, every thread count, its AVX2 and
scalar loops; ``int_mm`` gives the same integers through either route; bad operands are a typed error."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from speckv.predictor import products as ix

nat = ix.native_with("igemm")
pytestmark = pytest.mark.skipif(nat is None, reason="the native extension is not built")

SHAPES = [(1, 1, 1), (5, 7, 33), (4, 2, 16), (9, 97, 15), (64, 96, 576), (67, 193, 1536), (130, 3, 17),
          (0, 4, 8), (3, 0, 8), (2, 3, 0)]


def igemm(a: torch.Tensor, b: torch.Tensor, threads: int, scalar: bool) -> torch.Tensor:
    out = torch.full((a.shape[0], b.shape[0]), -7, dtype=torch.int32)
    nat.igemm(a.numpy(), b.numpy(), out.numpy(), a.shape[0], b.shape[0], a.shape[1], threads, scalar)
    return out


def reference(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return torch.mm(a.long(), b.long().t()).to(torch.int32)


@pytest.mark.parametrize("scalar", [False, True])
@pytest.mark.parametrize(("m", "n", "k"), SHAPES)
def test_product_is_the_exact_integer_sum(m, n, k, scalar):
    g = torch.Generator().manual_seed(m * 1000 + n * 10 + k)
    a = torch.randint(-128, 128, (m, k), dtype=torch.int8, generator=g)
    b = torch.randint(-128, 128, (n, k), dtype=torch.int8, generator=g)
    want = reference(a, b)
    for threads in (1, 2, 3):
        assert torch.equal(igemm(a, b, threads, scalar), want)


@pytest.mark.parametrize("value", [-128, 127])
def test_largest_products_do_not_saturate(value):
    """|a b| = 2^14 in every pair: vpmaddwd's int32 pair sums hold it (vpmaddubsw's int16 would not)."""
    a = torch.full((6, 1536), value, dtype=torch.int8)
    b = torch.full((5, 1536), -128, dtype=torch.int8)
    assert torch.equal(igemm(a, b, 2, False), reference(a, b))
    assert int(reference(a, b)[0, 0]) == value * -128 * 1536


@pytest.mark.parametrize("native", [True, False])
def test_int_mm_routes_give_the_same_integers(monkeypatch, native):
    monkeypatch.setattr(ix, "INT_MM_NATIVE", native)
    g = torch.Generator().manual_seed(3)
    a = torch.randint(-127, 128, (37, 200), dtype=torch.int8, generator=g)
    b = torch.randint(-127, 128, (50, 200), dtype=torch.int8, generator=g)
    want = reference(a, b)
    assert torch.equal(ix.int_mm(a, b), want)
    out = torch.empty((37, 50), dtype=torch.int32)
    assert ix.int_mm(a, b, out=out).data_ptr() == out.data_ptr() and torch.equal(out, want)
    assert torch.equal(ix.int_mm(a[:, :1], b[:, :1]), reference(a[:, :1], b[:, :1]))  # k == 1


def test_bad_operands_are_a_typed_error(monkeypatch):
    monkeypatch.setattr(ix, "INT_MM_NATIVE", True)
    a, b = torch.zeros((4, 8), dtype=torch.int8), torch.zeros((3, 8), dtype=torch.int8)
    with pytest.raises(ValueError, match="int_mm"):
        ix.int_mm(a, torch.zeros((3, 9), dtype=torch.int8))
    with pytest.raises(ValueError, match="int_mm"):
        ix.int_mm(a, b, out=torch.empty((3, 4), dtype=torch.int32))
    with pytest.raises(ValueError, match="bytes"):
        nat.igemm(a.numpy(), b.numpy(), np.empty((4, 2), np.int32), 4, 3, 8, 1, False)


def test_the_route_follows_the_cpu():
    """Auto: the native product exactly where the CPU has no VNNI/AMX int8 (flags from /proc/cpuinfo)."""
    flags = ix._cpu_flags()
    assert ix.int8_vnni() == bool(flags & {"avx512_vnni", "avx_vnni", "amx_int8"})
    assert (ix._native_int_mm() is not None) == (ix.INT_MM_NATIVE is None and not ix.int8_vnni())
