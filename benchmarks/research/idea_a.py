"""Idea A: table family shape at fixed (checkpoint) L plus a global offset delta.
Histogram of flat symbol indices (seed radius => same layout for all families) + raw bits.
Run: ../../.venv/bin/python idea_a.py"""
import families
import numpy as np
from cost import LMAX, LMIN, D, Evaluator, load, seed_tables, sym_cost

Ls = np.load(f"{D}/log2_sigma.npy")[:, :, :, None, :]
ev = Evaluator()
base = seed_tables()
_, off, rad = sym_cost(base)
nsym = len(base.gauss.freq)


def hist(ds, dl):
    kv, mu = load(ds)
    out = []
    for kvi in (0, 1):
        x = kv[:, kvi]
        m = mu[:, kvi]
        L = np.broadcast_to(Ls[:, kvi] + dl, x.shape).ravel()
        li = np.clip(L.astype(np.int64), LMIN, LMAX) - LMIN
        idx = li * 65536 + m.ravel().astype(np.int64)
        b = ev.bf
        t = b.t.ravel()[idx].astype(np.int64)
        k = b.k.ravel()[idx]
        cmu = b.cmu.ravel()[idx].astype(np.int64)
        ok = b.ok.ravel()[idx]
        ki = k.astype(np.int64) - b.kmin
        xi = x.ravel().astype(np.int64)
        d = b.cx[ki, xi] - cmu
        rb = b.raw[ki, xi]
        R = rad[t]
        esc = (~ok) | (np.abs(d) > R) | (rb < 0)
        j = np.where(esc, 2 * R + 1, d + R)
        out.append((np.bincount(off[t] + j, minlength=nsym), float(np.where(esc, 16, rb).sum())))
    return out


def evalfam(H, fam, n):
    cost = sym_cost(families.get(fam))[0]
    return [(h @ cost + raw) / n for h, raw in H]


res = {}
names = list(families.SPECS) + ["tnu2.5", "tnu5"]
deltas = list(range(-8, 9, 2))
n = 30 * 3 * 2048 * 64
H = {dl: hist("wcal0", dl) for dl in deltas}
print("hists done", flush=True)
best = {}
for fam in names:
    tot = {dl: sum(evalfam(H[dl], fam, n)) / 2 for dl in deltas}
    dl = min(tot, key=tot.get)
    best[fam] = dl
    print(f"{fam:14s} calib@0 {tot[0]:.4f}  best delta {dl:+d} -> {tot[dl]:.4f}", flush=True)
for ds in ("shake", "wheld"):
    Hs = {dl: hist(ds, dl) for dl in set(best.values()) | {0}}
    for fam in names:
        k0, v0 = evalfam(Hs[0], fam, n)
        k1, v1 = evalfam(Hs[best[fam]], fam, n)
        res[(ds, fam)] = (k1, v1)
        print(f"{ds} {fam:14s} d=0: K {k0:.4f} V {v0:.4f} T {(k0+v0)/2:.4f}"
              f" | d={best[fam]:+d}: K {k1:.4f} V {v1:.4f} T {(k1+v1)/2:.4f}", flush=True)
