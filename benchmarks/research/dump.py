"""Step 1: dump kv/mu bit patterns (uint16) + checkpoint log2_sigma and tables to /tmp/speckv_research.
Run: cd /work/main && .venv/bin/python benchmarks/research/dump.py
"""
import time
from pathlib import Path

import numpy as np

from speckv.coder.codec import Codec, bf16_bits
from speckv.predictor.calibrate import DEFAULT_CALIB_TOKENS, read_text
from speckv.predictor.fp8 import kv_to_fp8
from speckv.predictor.session import Session

OUT = Path("/tmp/speckv_research")
OUT.mkdir(exist_ok=True)
sess = Session.open("default")
codec = Codec.from_predictor(sess.predictor)
np.save(OUT / "log2_sigma.npy", codec.log2_sigma)
np.save(OUT / "sigma2.npy", sess.predictor.checkpoint.calib.sigma2)
g = codec.tables.gauss
print("calib tokens", DEFAULT_CALIB_TOKENS, "mixture", sess.predictor.checkpoint.calib.mixture)

shake = read_text("/work/shared/corpus/tinyshakespeare.txt")
wiki = read_text("/work/shared/corpus/wikitext2-valid.txt")
wids = sess.target.tokenize(wiki)
print("wikitext tokens", len(wids))
# the checkpoint tokenised read_text(chars=tokens*16) -> check same prefix
wids_c = sess.target.tokenize(read_text("/work/shared/corpus/wikitext2-valid.txt", chars=DEFAULT_CALIB_TOKENS * 16),
                              DEFAULT_CALIB_TOKENS)
print("calib prefix equal:", np.array_equal(wids_c[:4000], wids[:4000]))
sets = {"shake": sess.target.tokenize(shake, 2048), "wcal0": wids_c[0:2048], "wcal1": wids_c[2048:4096],
        "wheld": wids[6144:8192]}
for name, ids in sets.items():
    t0 = time.time()
    pre = sess.prefill(ids)
    kv, mu = bf16_bits(pre.kv), bf16_bits(pre.mu)
    q, scale = kv_to_fp8(pre.kv)
    np.save(OUT / f"{name}_ids.npy", ids)
    np.save(OUT / f"{name}_kv.npy", kv)
    np.save(OUT / f"{name}_mu.npy", mu)
    np.save(OUT / f"{name}_q8.npy", q.numpy())
    np.save(OUT / f"{name}_scale.npy", scale.numpy())
    print(name, kv.shape, f"{time.time()-t0:.1f}s", flush=True)
