"""What an engine whose attention reads its FP8 KV cache (vLLM with ``kv_cache_dtype=fp8``) costs
speckv, and what ``fp8_attention`` (the predictor's attention reading K/V rounded the same way) wins
back, on KV stored as vLLM's CPU backend stores it: e4m3 codes at scale 1.0, rounded toward zero
(benchmarks/research/vllm_fp8_rounding.py).

    .venv/bin/python benchmarks/research/fp8_attention.py [--tokens 512]

Prints the shipped checkpoint's bits per FP8 element (format 5) on (1) the sidecars' own KV
rounded so (a BF16-cache engine), (2) the FP8-cache engine's KV under plain mu, (3) the same KV
under ``Predictor.mu(..., fp8_attention=)``.
"""
from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np

from speckv.coder.codec import Codec, CodecConfig, Fp8KV
from speckv.kv import Fp8Attention
from speckv.predictor import engines
from speckv.predictor.calibrate import read_text
from speckv.predictor.session import Session

TEXT = Path(__file__).resolve().parents[2].parent / "shared" / "corpus" / "tinyshakespeare.txt"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=int, default=512)
    args = ap.parse_args()
    s = Session.open("default", None, None)
    ids = s.target.tokenize(read_text(TEXT, chars=args.tokens * 32), args.tokens)
    pre = s.prefill(ids)
    layers = s.target.config.num_hidden_layers
    fa = Fp8Attention((1.0,) * layers, (1.0,) * layers, toward_zero=True)  # vLLM's CPU backend, default scales
    codec = Codec.from_predictor(s.predictor, CodecConfig())

    def bits(x: Fp8KV, mu: object) -> float:
        recs = list(codec.encode(x, ids, mu))
        assert np.array_equal(codec.decode(recs, ids, mu).codes, x.codes)
        return 8 * sum(map(len, recs)) / x.codes.size

    import torch

    bf16_cache = torch.stack([torch.stack([fa.round(pre.kv[i, j], i, j) for j in (0, 1)]) for i in range(layers)])
    engine = engines.fp8_cache_kv(s.target, ids, fa)
    print(f"{len(ids)} tokens, bits per FP8 element (scale 1.0, rounded toward zero):")
    print(f"  BF16-cache engine's KV, plain mu:       {bits(engines.fp8_cache_codes(bf16_cache, fa), pre.mu):.3f}")
    print(f"  FP8-cache engine's KV, plain mu:        {bits(engines.fp8_cache_codes(engine, fa), pre.mu):.3f}")
    mu = s.predictor.mu(ids, fp8_attention=fa)
    print(f"  FP8-cache engine's KV, fp8_attention:   {bits(engines.fp8_cache_codes(engine, fa), mu):.3f}")


if __name__ == "__main__":
    main()
