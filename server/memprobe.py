"""A decoder sidecar's work on one stream, alone in a fresh process, for its peak memory.

``speckv bench`` runs the target, both codecs and the peers in one process, so its
own peak says nothing of a sidecar's. It writes the stream it coded and the prompt
to files and runs this module in a child interpreter, which does what a decoder
sidecar does with them, in the same order: ``Runtime.load`` (the checkpoint, its
derived weights read lazily, the canary), the predictor's pass through LayerMu
(layer by layer, nothing kept but its bits), the decode with its checksum. It
prints one JSON object: the kernel's peak RSS (VmHWM) after loading and after the
transfer, whether the decoded bytes equal the expected digest, and the runtime
floor (``memory.runtime_floor_bytes``).

Usage (what bench runs)::

    python -m speckv.server.memprobe --ids IDS.npy --stream STREAM.bin --expect SHA256 \\
        [--predictor DIR] [--pin PIN] [--target default]
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
    import torch

    rt = Runtime.load(ServerConfig(role="decoder", predictor=args.predictor, pin=args.pin, target=args.target))
    loaded = peak_rss_bytes()
    ids = np.load(args.ids)
    bits = asyncio.run(_mu(rt, ids))
    mu = torch.from_numpy(bits.view(np.int16)).view(torch.bfloat16)
    back = rt.codec.decode(read_records(args.stream), ids, mu)
    return {"loaded_peak_bytes": loaded, "peak_bytes": peak_rss_bytes(),
            "lossless": decoded_sha256(back) == args.expect, "runtime_floor_bytes": runtime_floor_bytes()}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ids", required=True)
    ap.add_argument("--stream", required=True)
    ap.add_argument("--expect", required=True, help="sha256 of the decoded KV")
    ap.add_argument("--predictor", default=None)
    ap.add_argument("--pin", default=None)
    ap.add_argument("--target", default="default")
    print(json.dumps(probe(ap.parse_args(argv))))
    return 0


if __name__ == "__main__":
    sys.exit(main())
