"""Per-element exact BF16 cost for L = L0 + delta, delta in [-DM, DM] (1/8 octave), saved as
a float32 memmap C_{fam}_{ds}.npy of shape (2DM+1, layers, 2, heads, tokens, dim).
Run: ../../.venv/bin/python matrix.py FAM DS [DS...]   (FAM: seed | name of a family in families.py)"""
import sys
import time

import numpy as np
from cost import D, Evaluator, load, seed_tables, sym_cost

DM = 20
fam = sys.argv[1]
if fam == "seed":
    tab = seed_tables()
else:
    import families

    tab = families.get(fam)
tabc = sym_cost(tab)
Ls = np.load(f"{D}/log2_sigma.npy")[:, :, :, None, :]
ev = Evaluator()
for ds in sys.argv[2:]:
    kv, mu = load(ds)
    C = np.lib.format.open_memmap(f"{D}/C_{fam}_{ds}.npy", "w+", np.float32, (2 * DM + 1,) + kv.shape)
    t0 = time.time()
    for i, dl in enumerate(range(-DM, DM + 1)):
        C[i] = ev.bf16_bits(kv, mu, Ls + dl, tab, tabc, per_elem=True)
    C.flush()
    del C
    print(ds, f"{time.time()-t0:.0f}s", flush=True)
