"""A sidecar's work on one transfer, alone in a fresh process, for its peak memory.

``speckv bench`` runs the target, both codecs and the peers in one process, so its
own peak says nothing of a sidecar's. It writes the prompt, the KV and the stream it
coded to files and runs this module in child interpreters, each doing what a
sidecar does with them, in the same order: ``Runtime.load`` (the checkpoint, its
derived weights read lazily, the canary), the predictor's pass through LayerMu
(layer by layer, nothing kept but its bits), then the decode with its checksum
(decoder) or the encode (encoder, whose stream bench decodes and compares). Each
prints one JSON object: the kernel's peak RSS (VmHWM) after loading and after the
transfer, the decoder whether its bytes equal the expected digest, and the runtime
floor (``memory.runtime_floor_bytes``).

Usage (what bench runs)::

    python -m speckv.server.memprobe --ids IDS.npy --stream STREAM.bin --expect SHA256 \\
        [--predictor DIR] [--pin PIN] [--target default]
    python -m speckv.server.memprobe --role encoder --ids IDS.npy --kv KV.npy [--scales S.npy] \\
        --out STREAM.bin [--predictor DIR] [--pin PIN] [--target default]
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import struct
import sys

import numpy as np

from .config import ServerConfig
from .memory import peak_rss_bytes, runtime_floor_bytes
from .runtime import Runtime

LEN = struct.Struct("<Q")  # each record of the stream file: its length, then its bytes


def write_records(path: str, records: list[bytes]) -> None:
    with open(path, "wb") as f:
        for r in records:
            f.write(LEN.pack(len(r)) + bytes(r))


def read_records(path: str) -> list[bytes]:
    data, out, at = open(path, "rb").read(), [], 0
    while at < len(data):
        (n,), at = LEN.unpack_from(data, at), at + LEN.size
        out.append(data[at:at + n])
        at += n
    return out


def decoded_sha256(back: object) -> str:
    """sha256 of decoded KV: BF16 bit patterns, or an Fp8KV's codes then scales."""
    h = hashlib.sha256()
    for part in (back,) if isinstance(back, np.ndarray) else (back.codes, back.scales):  # type: ignore[attr-defined]
        h.update(np.ascontiguousarray(part).data)
    return h.hexdigest()


async def _mu(rt: Runtime, ids: np.ndarray) -> np.ndarray:
    mu = rt.mu_layers(ids)
    await mu.done()
    return mu.bits


def probe(args: argparse.Namespace) -> dict:
    """Load as a sidecar of ``args.role`` does, run its predictor, then decode the stream
    (decoder) or encode the KV into ``args.out`` (encoder); the peaks, in bytes."""
    import torch

    rt = Runtime.load(ServerConfig(role=args.role, predictor=args.predictor, pin=args.pin, target=args.target))
    loaded = peak_rss_bytes()
    ids = np.load(args.ids)
    bits = asyncio.run(_mu(rt, ids))
    mu = torch.from_numpy(bits.view(np.int16)).view(torch.bfloat16)
    out: dict = {"role": args.role, "loaded_peak_bytes": loaded}
    if args.role == "decoder":
        back = rt.codec.decode(read_records(args.stream), ids, mu)
        out["lossless"] = decoded_sha256(back) == args.expect
    else:
        write_records(args.out, list(rt.codec.encode(read_kv(args.kv, args.scales), ids, mu)))
    return {**out, "peak_bytes": peak_rss_bytes(), "runtime_floor_bytes": runtime_floor_bytes()}


def read_kv(path: str, scales: str | None) -> object:
    """BF16 KV bit patterns (uint16 .npy) as a tensor, or FP8 codes with their scales (Fp8KV)."""
    import torch

    from speckv.coder.codec import Fp8KV

    data = np.load(path)
    if scales is not None:
        return Fp8KV(data, np.load(scales))
    return torch.from_numpy(data.view(np.int16)).view(torch.bfloat16)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--role", choices=("decoder", "encoder"), default="decoder")
    ap.add_argument("--ids", required=True)
    ap.add_argument("--stream", help="decoder: the stream to decode")
    ap.add_argument("--expect", help="decoder: sha256 of the decoded KV")
    ap.add_argument("--kv", help="encoder: the KV (.npy: BF16 bit patterns, or FP8 codes with --scales)")
    ap.add_argument("--scales", default=None, help="encoder: FP8 scales (.npy)")
    ap.add_argument("--out", help="encoder: where the stream goes")
    ap.add_argument("--predictor", default=None)
    ap.add_argument("--pin", default=None)
    ap.add_argument("--target", default="default")
    args = ap.parse_args(argv)
    need = ("stream", "expect") if args.role == "decoder" else ("kv", "out")
    if any(getattr(args, n) is None for n in need):
        ap.error(f"--role {args.role} needs --{' and --'.join(need)}")
    print(json.dumps(probe(args)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
