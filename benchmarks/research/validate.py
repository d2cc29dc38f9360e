"""Step 2 check: evaluator vs the real codec's coded size (shake, BF16 and FP8), baseline L.
Run: cd /work/main/benchmarks/research && ../../.venv/bin/python validate.py"""
import time

import numpy as np
import torch
from cost import D, Evaluator, fp8_bits, fp8_inputs, load

from speckv.coder.codec import Codec, CodecConfig, Fp8KV
from speckv.predictor.checkpoint import load_checkpoint
from speckv.predictor.store import default_checkpoint_dir

torch.set_num_threads(1)

ck = load_checkpoint(default_checkpoint_dir())
codec = Codec(ck.tables, ck.calib.sigma_log2_q, ck.pin, None, CodecConfig(coder="numpy", threads=1))
Ls = np.load(f"{D}/log2_sigma.npy")
tab = ck.tables
kv, mu = load("shake")
ids = np.load(f"{D}/shake_ids.npy")
ev = Evaluator()
n = kv.size
t0 = time.time()
pe = ev.bf16_bits(kv, mu, Ls[:, :, :, None, :], tab, per_elem=True)
print(f"eval {time.time()-t0:.1f}s  BF16 est {pe.sum()/n:.4f}  K {pe[:,0].mean():.4f} V {pe[:,1].mean():.4f}",
      flush=True)
t0 = time.time()
recs = list(codec.encode(kv, ids, torch.from_numpy(mu.view(np.int16)).view(torch.bfloat16)))
cb = sum(len(r) for r in recs)
print(f"codec BF16 {8*cb/n:.4f}  ({time.time()-t0:.1f}s)  rel diff {(8*cb-pe.sum())/pe.sum():.5f}", flush=True)
q, y, L8, scale = fp8_inputs("shake", Ls)
pe8 = fp8_bits(q, y, L8, tab, per_elem=True)
print(f"FP8 est {pe8.sum()/n:.4f} K {pe8[:,0].mean():.4f} V {pe8[:,1].mean():.4f}", flush=True)
recs = list(codec.encode(Fp8KV(q, scale), ids, torch.from_numpy(mu.view(np.int16)).view(torch.bfloat16)))
cb = sum(len(r) for r in recs)
print(f"codec FP8 {8*cb/n:.4f} rel diff {(8*cb-pe8.sum())/pe8.sum():.5f}")
