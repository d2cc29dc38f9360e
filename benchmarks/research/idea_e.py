"""Idea E: per-channel affine mu' = bf16(a*mu + b) (least squares on wcal0), sigma re-fit on wcal0.
Compares against sigma re-fit on wcal0 with the plain mu (same estimator). Exact BF16 bits.
Run: ../../.venv/bin/python idea_e.py"""
import numpy as np
import torch
from cost import Evaluator, load, seed_tables

torch.set_num_threads(1)
ev = Evaluator()
tab = seed_tables()
kv, mu = load("wcal0")


def f32(a):
    return (a.astype(np.uint32) << 16).view(np.float32).astype(np.float64)


x, m = f32(kv), f32(mu)
mx, mm = x.mean(3, keepdims=True), m.mean(3, keepdims=True)
a = ((x - mx) * (m - mm)).mean(3, keepdims=True) / np.maximum(((m - mm) ** 2).mean(3, keepdims=True), 1e-30)
b = mx - a * mm
print("a: median %.4f p5 %.4f p95 %.4f" % tuple(np.percentile(a, [50, 5, 95])))


def bf16(v):  # round-to-nearest-even float64 -> bf16 bits
    return torch.from_numpy(v.astype(np.float32)).to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)


def Lfit(x, m):
    s2 = np.maximum(((x - m) ** 2).mean(3), 1e-12)
    return np.round(np.log2(s2) * 4).astype(np.int64)[:, :, :, None, :]

L_plain = Lfit(x, m)
mu2 = bf16(a * m + b)
L_aff = Lfit(x, f32(mu2))
for ds in ("wcal0", "shake", "wheld"):
    kv, mu = load(ds)
    mu2 = bf16(a * f32(mu) + b)
    for name, mm_, L in (("plain mu, sigma wcal0", mu, L_plain), ("affine mu, sigma wcal0", mu2, L_aff)):
        pe = ev.bf16_bits(kv, mm_, L, tab, per_elem=True)
        print(f"{ds} {name:24s} T {pe.mean():.4f} K {pe[:,0].mean():.4f} V {pe[:,1].mean():.4f}", flush=True)
