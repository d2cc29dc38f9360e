"""Residual models: which tables, sigma and mu correction code a stream.

A stream header's ``model`` id names one (FORMAT.md); both sides take every
parameter from the pinned checkpoint, so nothing here is computed at run time
except the mu correction, which is two IEEE float32 operations per scalar.

- ``MODEL_SEED`` (1): the published method: static sigma per (layer, kv, head,
  channel), mixture 0.95 N(s) + 0.03 N(3s) + 0.02 escape, mu as predicted.
  Kept selectable (``--model seed``) so every report compares against it.
- ``MODEL_TUNED`` (2): mu corrected per channel, ``mu' = bf16(a * mu + b)``
  (least squares on the calibration text), sigma refit on ``x - mu'``, and the
  escape weight cut to 1e-4 (escapes are ~1e-7 of real KV scalars, so the
  seed's 0.02 cost -log2(0.98) = 0.03 bits on every scalar).

Lifecycle: ``AffineFit`` accumulates sums during calibration and ``solve``s
(a, b); the checkpoint stores them; ``models_of(checkpoint)`` returns the
``ResidualModel`` of every id the checkpoint supports; the codec picks one per
stream (encode: ``CodecConfig.model``; decode: the header's id).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .interfaces import CheckpointLike
from .tables import CodingTables

MODEL_SEED = 1
MODEL_TUNED = 2
MODEL_NAMES = {"seed": MODEL_SEED, "tuned": MODEL_TUNED}
TUNED_MIXTURE = (0.9699, 0.03, 1e-4)  # N(s), N(WIDE s), escape
MIN_GAIN = 1e-3  # the affine fit must cut a channel's residual variance by this fraction, else identity
MIN_VAR_MU = 1e-9  # relative to E[mu^2]: below it mu is constant (rung none) and only shifted, never scaled


@dataclass(frozen=True)
class ResidualModel:
    """Everything one model id needs to code a stream under a checkpoint."""

    model_id: int
    tables: CodingTables
    log2_sigma: np.ndarray  # (layers, 2, kv_heads, head_dim) int64 fixed point
    mu_scale: np.ndarray | None = None  # same shape, float32 a (None: mu as predicted)
    mu_shift: np.ndarray | None = None  # same shape, float32 b

    def correct(self, mu: np.ndarray, layers: slice) -> np.ndarray:
        """BF16 mu bit patterns ``(n, 2, heads, tokens, dim)`` of ``layers`` -> corrected ones."""
        if self.mu_scale is None:
            return mu
        assert self.mu_shift is not None  # set together with mu_scale
        a = self.mu_scale[layers][:, :, :, None, :]
        b = self.mu_shift[layers][:, :, :, None, :]
        return affine_bf16(mu, a, b)


def affine_bf16(mu: np.ndarray, a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """``bf16(a * mu + b)`` on BF16 bit patterns, round to nearest even.

    NOTE: one float32 multiply, then one float32 add, each correctly rounded (numpy
    never fuses them into an FMA); a port must do the same (no fast-math, no FMA).
    Identity channels (a == 1 and b == 0 exactly) keep mu bit for bit: the arithmetic
    would turn -0.0 into +0.0 (and an exact rung's mu must stay the target's KV)."""
    a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
    y = mu.astype(np.uint32)
    y <<= 16
    y = y.view(np.float32)
    with np.errstate(all="ignore"):  # inf/NaN mu stay non-finite and escape
        y *= a
        y += b
    out = f32_to_bf16(y)
    ident = (a == 1) & (b == 0)
    if ident.any():
        np.copyto(out, mu, where=np.broadcast_to(ident, out.shape))
    return out


def f32_to_bf16(y: np.ndarray) -> np.ndarray:
    """float32 -> BF16 bit patterns, round to nearest even; NaN -> the quiet NaN 0x7FC0."""
    u = np.ascontiguousarray(y, np.float32).view(np.uint32)
    r = (u >> 16) & 1
    r += u
    r += np.uint32(0x7FFF)  # NOTE: a NaN's payload may carry into the sign here; fixed below
    r >>= 16
    out = r.astype(np.uint16)
    nan = (u & np.uint32(0x7FFFFFFF)) > np.uint32(0x7F800000)
    if nan.any():
        out[nan] = 0x7FC0
    return out


@dataclass
class AffineFit:
    """Running sums per channel over finite pairs, in float64, of mu and the residual
    r = x - mu (r, not x: an exact channel's sum of r^2 stays exactly 0)."""

    n: np.ndarray
    sm: np.ndarray
    sr: np.ndarray
    smm: np.ndarray
    smr: np.ndarray
    srr: np.ndarray

    @classmethod
    def empty(cls, shape: tuple[int, ...]) -> "AffineFit":
        return cls(*(np.zeros(shape) for _ in range(6)))

    def add(self, x: np.ndarray, mu: np.ndarray) -> None:
        """x, mu: float64 ``(layers, 2, heads, tokens, dim)``; sums over tokens."""
        r = x - mu
        ok = np.isfinite(r)
        r, mu = np.where(ok, r, 0.0), np.where(ok, mu, 0.0)
        self.n += ok.sum(axis=3)
        self.sm += mu.sum(axis=3)
        self.sr += r.sum(axis=3)
        self.smm += (mu * mu).sum(axis=3)
        self.smr += (mu * r).sum(axis=3)
        self.srr += (r * r).sum(axis=3)

    def solve(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(a, b) as float32 and the residual variance of x - (a mu + b) per channel.

        Channels where the fit does not pay (constant mu, or less than MIN_GAIN of the
        identity's residual variance saved) keep a = 1, b = 0: exact rungs stay exact."""
        n = np.maximum(self.n, 1)
        m, rm = self.sm / n, self.sr / n
        var_mu = self.smm / n - m * m
        with np.errstate(all="ignore"):
            c = np.where(var_mu > MIN_VAR_MU * self.smm / n, (self.smr / n - m * rm) / var_mu, 0.0)  # a - 1
        a32 = (1.0 + c).astype(np.float32).astype(np.float64)
        b32 = (rm - c * m).astype(np.float32).astype(np.float64)
        fit = self._residual_var(a32 - 1.0, b32)
        ident = self.srr / n
        use = np.isfinite(fit) & (fit < ident * (1.0 - MIN_GAIN))
        a32, b32 = np.where(use, a32, 1.0), np.where(use, b32, 0.0)
        return a32.astype(np.float32), b32.astype(np.float32), np.where(use, fit, ident)

    def _residual_var(self, c: np.ndarray, b: np.ndarray) -> np.ndarray:
        """mean of (r - c mu - b)^2 from the sums (c = a - 1)."""
        n = np.maximum(self.n, 1)
        s = (self.srr - 2 * c * self.smr - 2 * b * self.sr + c * c * self.smm + 2 * c * b * self.sm
             + b * b * self.n)
        return np.maximum(s / n, 0.0)


def models_of(ck: CheckpointLike) -> dict[int, ResidualModel]:
    """The residual models a checkpoint supports (the seed's always)."""
    calib = ck.calib
    out = {MODEL_SEED: ResidualModel(MODEL_SEED, ck.seed_tables, calib.sigma_log2_q.astype(np.int64))}
    if calib.tuned_sigma_log2_q is not None and ck.tuned_tables is not None:
        out[MODEL_TUNED] = ResidualModel(MODEL_TUNED, ck.tuned_tables, calib.tuned_sigma_log2_q.astype(np.int64),
                                         calib.mu_scale, calib.mu_shift)
    assert all(isinstance(m.tables, CodingTables) for m in out.values())
    return out
