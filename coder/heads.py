"""A codec of some heads: what one tensor-parallel rank's KV is coded with.

A rank holds heads ``start .. start + count - 1`` of every layer, so its stream is a
stream of shape ``(layers, 2, count, tokens, head_dim)`` coded under the checkpoint's
per-channel parameters of those heads (sigma, the tuned model's mu correction) and the
predictor's mu of those heads. Nothing else differs: the tables are shared, the format
is unchanged, and the stream header's shape says ``count`` heads. The head range itself
travels beside the stream (``TransferHeader.heads``); a decoder told the wrong range
rejects the first coded chunk (its mu fingerprint differs) and the stored chunks' raw
digests still hold.

    sub = head_codec(codec, HeadRange(1, 1, 3))     # cached on ``codec``
    records = list(sub.encode(kv_of_head_1, ids, mu=mu[:, :, 1:2]))
"""

from __future__ import annotations

import copy
import dataclasses
from typing import TYPE_CHECKING, Any

import numpy as np

from speckv.kv import HeadRange, some_heads

from .residual import ResidualModel

if TYPE_CHECKING:  # pragma: no cover
    from .codec import Codec


class HeadMu:
    """A predictor's mu, sliced to some heads (``MuSource``)."""

    def __init__(self, predictor: Any, heads: HeadRange) -> None:
        self.predictor, self.heads = predictor, heads
        self.checkpoint = predictor.checkpoint

    def mu(self, ids: np.ndarray) -> Any:
        return slice_heads(self.predictor.mu(ids), self.heads)


def slice_heads(x: Any, heads: HeadRange | None) -> Any:
    """``x[:, :, start:stop]`` of a ``(layers, 2, heads, ...)`` array or tensor (a view)."""
    heads = some_heads(heads)
    return x if heads is None else x[:, :, heads.start:heads.stop]


def _model(m: ResidualModel, sl: slice) -> ResidualModel:
    def cut(a: np.ndarray | None) -> np.ndarray | None:
        return None if a is None else np.ascontiguousarray(a[:, :, sl])

    return dataclasses.replace(m, log2_sigma=np.ascontiguousarray(m.log2_sigma[:, :, sl]), mu_scale=cut(m.mu_scale),
                               mu_shift=cut(m.mu_shift))


def head_codec(codec: "Codec", heads: HeadRange | None) -> "Codec":
    """``codec`` restricted to ``heads`` (``codec`` itself for None or all heads); built once
    per range and kept on ``codec``. ValueError when ``heads.total`` is not the checkpoint's."""
    total = codec.log2_sigma.shape[2]
    if heads is not None and heads.total != total:
        raise ValueError(f"{heads}: this checkpoint's model has {total} KV heads")
    if heads is None or heads.whole:
        return codec
    cache: dict[HeadRange, Codec] = codec.__dict__.setdefault("_head_codecs", {})
    if heads not in cache:
        sl = slice(heads.start, heads.stop)
        sub = copy.copy(codec)  # NOTE: shares the backend (its threads) and config; the rest is replaced
        sub.__dict__.pop("_head_codecs", None)
        sub.log2_sigma = np.ascontiguousarray(codec.log2_sigma[:, :, sl])
        sub.models = {k: _model(m, sl) for k, m in codec.models.items()}
        sub._bf16_tables = {}
        sub.predictor = None if codec.predictor is None else HeadMu(codec.predictor, heads)
        cache[heads] = sub
    return cache[heads]
