"""What an engine whose attention reads its FP8 KV cache (vLLM with ``kv_cache_dtype=fp8``) costs
speckv, and what a predictor whose attention reads the same rounded K/V would win back:

    .venv/bin/python benchmarks/research/fp8_attention.py [--tokens 512]

The engine is emulated as vLLM's CPU backend stores FP8: e4m3 codes at scale 1.0, rounded toward
zero (benchmarks/research/vllm_fp8_rounding.py), and attention reads them (every later layer's K/V
then derive from FP8-rounded K/V). Prints the shipped checkpoint's bits per FP8 element (format 5)
on (1) the sidecars' own KV truncated to FP8 (a BF16-cache engine), (2) the FP8-cache engine's KV
under today's mu, (3) the same KV under a mu whose predictor attention reads FP8-rounded K/V too
(``w8a8._block_rest`` and the exact layers' cache patched here: an experiment, not a product path).
"""
from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np
import torch
from transformers import cache_utils

from speckv.coder.codec import Codec, CodecConfig, Fp8KV
from speckv.predictor import w8a8
from speckv.predictor.calibrate import read_text
from speckv.predictor.session import Session

TEXT = Path(__file__).resolve().parents[2].parent / "shared" / "corpus" / "tinyshakespeare.txt"


def truncated(x: torch.Tensor) -> torch.Tensor:
    """uint8 e4m3 codes of x (scale 1.0) rounded toward zero."""
    y = x.float()
    q = y.to(torch.float8_e4m3fn)
    c = q.view(torch.uint8).clone()
    c[(q.float().abs() > y.abs()) & ((c & 0x7F) > 0)] -= 1
    return c


def rounded(x: torch.Tensor) -> torch.Tensor:
    return truncated(x).view(torch.float8_e4m3fn).to(x.dtype)


class FP8Attention:
    """Within the block, attention reads FP8-rounded K/V (the exact layers' cache and w8a8's layers)."""

    def __enter__(self) -> None:
        self.update, self.rest = cache_utils.DynamicLayer.update, w8a8._block_rest
        update, rest = self.update, self.rest
        cache_utils.DynamicLayer.update = lambda s, k, v, *a, **kw: update(s, rounded(k), rounded(v), *a, **kw)
        w8a8._block_rest = lambda h, t, q, k, v, eps, sc: rest(h, t, q, rounded(k), rounded(v), eps, sc)

    def __exit__(self, *exc: object) -> None:
        cache_utils.DynamicLayer.update, w8a8._block_rest = self.update, self.rest


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=int, default=512)
    args = ap.parse_args()
    s = Session.open("default", None, None)
    ids = s.target.tokenize(read_text(TEXT, chars=args.tokens * 32), args.tokens)
    pre = s.prefill(ids)
    codec = Codec.from_predictor(s.predictor, CodecConfig())

    def bits(codes: torch.Tensor, mu: torch.Tensor) -> float:
        x = Fp8KV(codes.numpy(), np.ones((codes.shape[0], 2), np.float32))
        recs = list(codec.encode(x, ids, mu))
        assert np.array_equal(codec.decode(recs, ids, mu).codes, x.codes)
        return 8 * sum(map(len, recs)) / codes.numel()

    with FP8Attention():
        engine = s.target.kv(ids).float().to(torch.float8_e4m3fn).view(torch.uint8)  # exact: already rounded
        mu8 = s.predictor.mu(ids)
    print(f"{len(ids)} tokens, bits per FP8 element (scale 1.0, rounded toward zero):")
    print(f"  BF16-cache engine's KV, today's mu:          {bits(truncated(pre.kv), pre.mu):.3f}")
    print(f"  FP8-cache engine's KV, today's mu:           {bits(engine, pre.mu):.3f}")
    print(f"  FP8-cache engine's KV, FP8-attention mu:     {bits(engine, mu8):.3f}")


if __name__ == "__main__":
    main()
