"""Exact coded-size evaluator for speckv's integer model (research; reads coder/ read-only).

bits = sum over elements of  -log2(freq[t][j] / PROB_SCALE)  (the rANS op)
       + raw bits (LOW / ZMAN / ESC / UNARY, unpadded)
with t, j exactly as coder.model.context + symbolize produce them, for a per-ELEMENT
fixed-point L (1/8 octave log2 sigma, same units as log2_sigma) and any table family.
"""
from __future__ import annotations

import math

import numpy as np
from scipy.special import ndtr

from speckv.coder import model as M
from speckv.coder.model import BF16, E4M3, FP32, context
from speckv.coder.rans import PROB_BITS
from speckv.coder.tables import (
    SIGMA_ONE,
    TAIL_SIGMAS,
    CodingTables,
    build_tables,
    quantize_freqs,
    table_params,
)

D = "/tmp/speckv_research"
LMIN, LMAX = -150, 30  # range of L the BF16 context table covers (clip outside)


def load(name):
    kv = np.load(f"{D}/{name}_kv.npy")
    mu = np.load(f"{D}/{name}_mu.npy")
    return kv, mu


def sym_cost(tab: CodingTables):
    """cost (bits) of each symbol of each table, flat like tab.gauss.freq; offsets; radius."""
    g = tab.gauss
    return PROB_BITS - np.log2(g.freq.astype(np.float64)), g.offset.astype(np.int64), tab.radius.astype(np.int64)


class BF16Ctx:
    """context() of every (L, mu pattern) for L in [LMIN, LMAX], and bin/raw-bit tables of x per k."""

    def __init__(self):
        import os
        p = f"{D}/ctx_bf16_{LMIN}_{LMAX}.npz"
        if os.path.exists(p):
            z = np.load(p)
            self.t, self.k, self.cmu, self.ok = z["t"], z["k"], z["cmu"], z["ok"]
        else:
            n = LMAX - LMIN + 1
            t = np.empty((n, 65536), np.int16)
            k = np.empty((n, 65536), np.int16)
            cmu = np.empty((n, 65536), np.int16)
            ok = np.empty((n, 65536), bool)
            mu = np.arange(65536, dtype=np.uint16)
            for i, L in enumerate(range(LMIN, LMAX + 1)):
                c = context(BF16, BF16, mu, np.full(65536, L))
                t[i], k[i], cmu[i], ok[i] = c.t, c.k, c.c_mu, c.mu_ok
            np.savez(p, t=t, k=k, cmu=cmu, ok=ok)
            self.t, self.k, self.cmu, self.ok = t, k, cmu, ok
        self.kmin, self.kmax = int(self.k.min()), int(self.k.max())
        self.cx, self.raw = xtables(BF16, self.kmin, self.kmax)


def xtables(fx, kmin, kmax):
    """bin c of every x pattern for each k, and its raw bits when not escaped."""
    nx = 1 << fx.bits
    x = np.arange(nx, dtype=np.uint16 if fx.bits == 16 else np.uint8)
    ks = np.arange(kmin, kmax + 1)
    cx = np.empty((len(ks), nx), np.int32)
    raw = np.empty((len(ks), nx), np.int32)
    _, e_x, _ = M.split(fx, x)
    for i, kk in enumerate(ks):
        c, _ = M.bin_index(fx, x, np.full(nx, kk, np.int32))
        mag = M.magnitude(c)
        width = np.maximum(M.low_bits(fx, np.maximum(mag, 1)), 0)
        zero_bits = fx.mant + (kk + fx.bias - 1 - e_x) + 1
        cx[i] = c
        r = np.where(mag == 0, zero_bits, width)
        r = np.where((mag >= M.MAX_BIN) | ~fx.finite(x), -1, r)  # -1: always escape
        raw[i] = r
    return cx, raw


def cost_from_ctx(fx, t, k, cmu, ok, x, tabc, kmin, cx, raw, per_elem=False):
    """exact bits per element (float64) given context arrays (flat) and x (flat)."""
    cost, off, rad = tabc
    ki = (k.astype(np.int64) - kmin)
    xi = x.astype(np.int64)
    c = cx[ki, xi]
    rb = raw[ki, xi]
    d = c - cmu
    R = rad[t]
    esc = (~ok) | (np.abs(d) > R) | (rb < 0)
    j = np.where(esc, 2 * R + 1, d + R)
    b = cost[off[t] + j] + np.where(esc, fx.bits, rb)
    return b


class Evaluator:
    def __init__(self):
        self.bf = BF16Ctx()

    def bf16_bits(self, x, mu, L, tab, tabc=None, per_elem=False):
        """x, mu uint16 arrays (any shape), L int array broadcastable. Returns total bits or per element."""
        tabc = tabc or sym_cost(tab)
        L = np.broadcast_to(L, x.shape).ravel()
        li = np.clip(L.astype(np.int64), LMIN, LMAX) - LMIN
        m = mu.ravel().astype(np.int64)
        b = self.bf
        idx = li * 65536 + m
        t = b.t.ravel()[idx].astype(np.int64)
        k = b.k.ravel()[idx]
        cmu = b.cmu.ravel()[idx].astype(np.int64)
        ok = b.ok.ravel()[idx]
        e = cost_from_ctx(BF16, t, k, cmu, ok, x.ravel(), tabc, b.kmin, b.cx, b.raw)
        return e.reshape(x.shape) if per_elem else e.sum()


_FP8X = None


def fp8_bits(q, mu32, L, tab, tabc=None, per_elem=False):
    """q: e4m3 codes uint8; mu32: uint32 FP32 patterns (mu/scale); L per element (fp8 units)."""
    global _FP8X
    tabc = tabc or sym_cost(tab)
    L = np.broadcast_to(L, q.shape).ravel()
    ctx = context(E4M3, FP32, mu32.ravel(), L)
    if _FP8X is None:
        _FP8X = xtables(E4M3, E4M3.k_min, E4M3.k_max)
    cx, raw = _FP8X
    e = cost_from_ctx(E4M3, ctx.t.astype(np.int64), ctx.k, ctx.c_mu.astype(np.int64), ctx.mu_ok,
                      q.ravel(), tabc, E4M3.k_min, cx, raw)
    return e.reshape(q.shape) if per_elem else e.sum()


def fp8_inputs(name, log2_sigma):
    """(q, mu32 patterns, L per (layer,kv,head,1,dim)) of the FP8 path, as codec._plan builds them."""
    q = np.load(f"{D}/{name}_q8.npy")
    scale = np.load(f"{D}/{name}_scale.npy").astype(np.float32)
    mu = np.load(f"{D}/{name}_mu.npy")
    with np.errstate(all="ignore"):
        y = ((mu.astype(np.uint32) << 16).view(np.float32)) / scale[:, :, None, None, None]
    L8 = M.fp8_log2_sigma(log2_sigma, scale.view(np.uint32)[:, :, None, None])
    return q, y.astype(np.float32).view(np.uint32), L8[:, :, :, None, :], scale


# ---------------- table families ----------------
def family(cdf_fn, radius_fn=None, esc=0.02):
    """A table family like build_tables: for each row (lam, f): sigma_b = 2^(lam/8) bins,
    p(d) = esc-free mass of cdf_fn(z) over [d - f, d + 1 - f] / sigma_b, tails -> ESC,
    plus esc on ESC. cdf_fn(z) vectorised standard cdf (unit scale)."""
    rows, lens = [], []
    for lam, f in table_params():
        sb = 2.0 ** (lam / SIGMA_ONE)
        R = radius_fn(lam) if radius_fn else int(math.ceil(TAIL_SIGMAS * 3.0 * sb)) + 1
        v = np.arange(-R, R + 2, dtype=np.float64)
        cdf = cdf_fn((v - f) / sb)
        p = np.empty(2 * R + 2)
        p[:-1] = np.diff(cdf)
        p[-1] = cdf[0] + (1 - cdf[-1]) + esc
        rows.append(quantize_freqs(p))
        lens.append(len(p))
    return CodingTables.from_arrays({"gauss_freq": np.concatenate(rows), "gauss_len": np.array(lens, np.int64)})


def mix_cdf(ws, scales):
    def f(z):
        return sum(w * ndtr(z / s) for w, s in zip(ws, scales, strict=True))
    return f


def seed_tables(mixture=(0.95, 0.03, 0.02), wide=3.0):
    return CodingTables.from_arrays(build_tables(mixture, wide))
