"""The integer-only probability model: KV symbols <-> one rANS op + raw bits.

Every scalar x is coded relative to its prediction mu on a power-of-two value
grid of width ``w = 2^k`` (integer arithmetic on the float bit patterns only):

- ``k = max(floor(log2 sigma) - GRID_BELOW_SIGMA, ulp_exp(mu) [+1])``: bins at
  most sigma/16 wide and never finer than the ULP of the values near mu (one
  binade up when mu sits within ~3 sigma of its binade's top), so values near
  mu own whole bins. ``log2 sigma`` is a fixed-point integer ``L`` (1/8 octave)
  from the checkpoint, so the Gaussian table index ``t = L - 8k`` is an integer.
- Bins tile the line symmetrically: ``c = floor(|x| / w)`` for +x, ``-1 - c``
  for -x (-0 lives in bin -1). Bins are aligned to powers of two, so each bin
  away from 0 lies in one binade and holds ``2^nb`` equally wide values.

Per element, one rANS op codes ``d = c_x - c_mu`` under Gaussian table ``t``
(or ESC). Everything else is exactly uniform or exactly geometric(1/2) and
goes to raw bit sections (``bitpack``), in chunk element order:

- LOW: the ``nb`` low significand bits of each normal element;
- ZMAN: the mantissa of each zero-bin element (|x| < w);
- ESC: the raw bit pattern of each escaped element (NaN/Inf x, non-finite mu,
  ``|d| > R``);
- UNARY: the exponent distance ``delta`` below ``w`` of each zero-bin element.

For FP8 KV, mu is the predictor's value divided by the KV scale in FP32 (its
bin is exact on the e4m3 grid), and x is the e4m3 code.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from speckv.errors import IntegrityError

from .bitpack import pack_fields, pack_unary, split_sections, unpack_fields, unpack_unary
from .tables import GRID_BELOW_SIGMA, OFFSETS, SIGMA_FRAC_BITS, CodingTables, table_row

MAX_BIN = 4095  # bins beyond this are far outside any window (escape anyway)
FLOG2 = np.array([max(n.bit_length() - 1, 0) for n in range(MAX_BIN + 1)], np.int32)  # floor(log2 n)
# round(8 * log2(1 + m/8)) for the top 3 mantissa bits of an fp32 scale (1/8 octave)
LOG2_FRAC8 = np.array([0, 1, 3, 4, 5, 6, 6, 7], np.int64)
# floor(8 * log2 n) in exact integers: the largest j with 2^j <= n^8
LOG2Q8 = np.array([0] + [(n ** 8).bit_length() - 1 for n in range(1, 257)], np.int32)
NEAR_TOP_Q8 = 13  # 8 * log2(3): "within 3 sigma of the binade top"


@dataclass(frozen=True)
class FloatFormat:
    """A sign-magnitude float format coded by this model."""

    name: str
    bits: int
    mant: int  # explicit mantissa bits
    bias: int
    max_field: int  # largest exponent field holding finite values

    @property
    def exp_mask(self) -> int:
        return (1 << (self.bits - 1 - self.mant)) - 1

    @property
    def k_min(self) -> int:  # the zero bin then holds exactly zeros and subnormals
        return 1 - self.bias

    @property
    def k_max(self) -> int:  # coarser bins would skip values of the top binade
        return self.max_field - self.bias - self.mant

    def finite(self, x: np.ndarray) -> np.ndarray:
        if self.name == "fp8":
            return (x & 0x7F) != 0x7F  # e4m3fn: only NaN is non-finite
        return ((x >> self.mant) & self.exp_mask) != self.exp_mask


BF16 = FloatFormat("bf16", 16, 7, 127, 254)
E4M3 = FloatFormat("fp8", 8, 3, 7, 15)
FP32 = FloatFormat("fp32", 32, 23, 127, 254)  # mu of the FP8 path: predictor / scale
E4M3_F32 = np.array([0.0] * 256, np.float32)  # filled below from the format's definition


def split(fmt: FloatFormat, x: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Bit patterns -> (sign, exponent field, mantissa) as int32 (int64 for 32-bit formats)."""
    x = x.astype(np.int32 if fmt.bits <= 16 else np.int64)
    return x >> (fmt.bits - 1), (x >> fmt.mant) & fmt.exp_mask, x & ((1 << fmt.mant) - 1)


def as_float32(fmt: FloatFormat, x: np.ndarray) -> np.ndarray:
    """Exact float32 values of bit patterns (BF16: the top half; e4m3: a 256-entry table)."""
    if fmt.bits == 32:
        return x.astype(np.uint32).view(np.float32)
    if fmt.bits == 16:
        return (x.astype(np.uint32) << 16).view(np.float32)
    return E4M3_F32[x]


def bin_index(fmt: FloatFormat, x: np.ndarray, k: np.ndarray, offsets: bool = False,
              shift: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray | None]:
    """Signed bin of each value on the grid 2^k (clamped to +-MAX_BIN), and (if asked)
    the value's position inside its bin in 1/OFFSETS steps from the bin's lower end.

    NOTE: |x| * 2^-k is a power-of-two scaling (exact unless it underflows, where the
    floor is 0 anyway) and floor is exact. Adding mu's ``shift`` (a power of two) is
    one IEEE float32 round-to-nearest addition: exact for BF16 mu, correctly rounded
    (so still identical on every IEEE backend) for fp32 mu; a port must do it in
    float32 without fast-math. 2^-k is built from its bits (k in [-126, 120])."""
    with np.errstate(all="ignore"):  # overflow to inf, underflow to 0: both handled below
        scale = ((127 - k).astype(np.int32) << 23).view(np.float32)
        v = np.abs(as_float32(fmt, x)) * scale  # NaN/Inf stay non-finite
        v = np.minimum(v, np.float32(MAX_BIN))  # NaN propagates; escaped by the caller
        v = np.where(np.isnan(v), np.float32(0), v)
        if shift is not None:  # mu only: bins as the union of their values' buckets
            v = np.minimum(v + shift, np.float32(MAX_BIN))
        mag = np.floor(v)
    neg = (x >> (fmt.bits - 1)) != 0  # sign bit (x holds unsigned bit patterns)
    mi = mag.astype(np.int32)
    c = np.where(neg, ~mi, mi)  # -1 - mag
    if not offsets:
        return c, None
    frac = ((v - mag) * np.float32(OFFSETS)).astype(np.int32)  # truncation = floor (>= 0)
    return c, np.where(neg, OFFSETS - 1 - frac, frac)


def _e4m3_table() -> np.ndarray:
    codes = np.arange(256)
    e, man = (codes >> 3) & 0xF, codes & 0x7
    mag = np.where(e > 0, (8 + man) * 2.0 ** (e - 10), man * 2.0 ** -9)
    v = np.where(codes & 0x80, -mag, mag)
    v[(codes & 0x7F) == 0x7F] = np.nan
    return v.astype(np.float32)


E4M3_F32[:] = _e4m3_table()


@dataclass
class Context:
    """Everything both sides derive from mu and sigma before coding (per element)."""

    k: np.ndarray  # grid exponent
    t: np.ndarray  # Gaussian table row (sigma in bins, and mu's offset in its bin)
    c_mu: np.ndarray  # mu's bin
    mu_ok: np.ndarray  # mu is finite


def near_top(fx: FloatFormat, fm: FloatFormat, mu: np.ndarray, e_unb: np.ndarray,
             L: np.ndarray) -> np.ndarray:
    """mu within ~NEAR_TOP sigma of its binade's top (in x's ULPs): use the next binade's grid."""
    _, _, man = split(fm, mu)
    top = (1 << fx.mant) - (man >> (fm.mant - fx.mant))  # ULPs of x to the binade top
    return LOG2Q8[top] + ((e_unb - fx.mant) << SIGMA_FRAC_BITS) < L + NEAR_TOP_Q8


def context(fx: FloatFormat, fm: FloatFormat, mu: np.ndarray, log2_sigma: np.ndarray) -> Context:
    """Grid, table and mu's bin per element. ``log2_sigma``: fixed-point L (1/8 octave),
    mu in format ``fm`` (same units as x), x in format ``fx``."""
    _, e_mu, _ = split(fm, mu)
    L = log2_sigma.astype(np.int32)
    e_unb = np.maximum(np.maximum(e_mu, 1) - fm.bias, 1 - fx.bias)  # mu's binade on x's scale
    k_mu = e_unb - fx.mant + near_top(fx, fm, mu, e_unb, L)
    k_s = (L >> SIGMA_FRAC_BITS) - GRID_BELOW_SIGMA  # NOTE: >> floors negatives, like CUDA
    k = np.clip(np.maximum(k_s, k_mu), fx.k_min, fx.k_max)
    # NOTE: a value's rounding bucket is centred on it, half an ULP either side, so a bin
    # holding 2^nb values spans [c - 2^-(nb+1), c + 1 - 2^-(nb+1)) grid units: place mu
    # on that shifted grid (nb of mu's own binade; 2^-(nb+1) is exact in float32).
    nb_mu = np.minimum(k - (e_unb - fx.mant), 24)
    half = np.where(nb_mu >= 0, ((126 - nb_mu) << 23).astype(np.int32).view(np.float32), np.float32(0))
    c_mu, off = bin_index(fm, mu, k, offsets=True, shift=half)
    assert off is not None  # offsets=True
    t = table_row(L - (k << SIGMA_FRAC_BITS), off)
    return Context(k=k, t=t, c_mu=c_mu, mu_ok=fm.finite(mu))


class ContextTable:
    """``context`` of every 16-bit mu pattern for each distinct sigma level, precomputed.

    Both sides of a BF16 stream then derive an element's context with one
    gather instead of ~45 array passes; the entries come from ``context`` itself,
    so the result is identical by construction. One uint32 per entry: table row
    (bits 0-9), k + 128 (bits 10-17), c_mu + 4096 (bits 18-30), mu finite (bit 31).
    """

    def __init__(self, fx: FloatFormat, fm: FloatFormat, log2_sigma: np.ndarray) -> None:
        assert fm.bits == 16, "only 16-bit mu formats are tabulated"
        self.fx, self.fm = fx, fm
        self.levels, inverse = np.unique(log2_sigma, return_inverse=True)
        self.level_index = inverse.reshape(log2_sigma.shape).astype(np.int32)
        mu = np.tile(np.arange(1 << 16, dtype=np.uint16), len(self.levels))
        ctx = context(fx, fm, mu, np.repeat(self.levels, 1 << 16))
        assert ctx.t.max() < 1 << 10 and -4096 <= ctx.c_mu.min() and ctx.c_mu.max() < 4096 and np.abs(ctx.k).max() < 128
        self.packed = (ctx.t.astype(np.uint32) | ((ctx.k + 128).astype(np.uint32) << 10)
                       | ((ctx.c_mu + 4096).astype(np.uint32) << 18) | (ctx.mu_ok.astype(np.uint32) << 31))

    def lookup(self, mu: np.ndarray, level_index: np.ndarray) -> Context:
        """Contexts of ``mu`` patterns whose channels have ``level_index`` (broadcastable)."""
        p = self.packed[(level_index << 16) | mu.astype(np.int32)].ravel().view(np.int32)
        return Context(k=((p >> 10) & 0xFF) - 128, t=p & 0x3FF, c_mu=((p >> 18) & 0x1FFF) - 4096,
                       mu_ok=p < 0)


def fp8_log2_sigma(log2_sigma: np.ndarray, scale_bits: np.ndarray) -> np.ndarray:
    """L of sigma / scale: subtract log2 of an fp32 scale (from its bits) in 1/8 octaves."""
    sb = scale_bits.astype(np.int64)
    lg = (((sb >> 23) & 0xFF) - 127) * 8 + LOG2_FRAC8[(sb >> 20) & 0x7]
    return log2_sigma.astype(np.int64) - lg


@dataclass
class Symbols:
    """What the rANS op of each element says, plus the raw bit sections."""

    j: np.ndarray  # symbol index in Gaussian table t (2R+1 = ESC)
    bits: bytes  # raw sections LOW | ZMAN | ESC | UNARY, each byte-padded


def magnitude(c: np.ndarray) -> np.ndarray:
    """|bin| in the symmetric tiling: c for c >= 0, -1 - c for c < 0 (int32 sign trick)."""
    return c ^ (c >> 31)


def low_bits(fx: FloatFormat, mag: np.ndarray) -> np.ndarray:
    """Raw low significand bits of a value in bin ``mag`` (>= 1): 2^nb values per bin;
    negative when a value spans 2^-nb bins (top binades)."""
    return fx.mant - FLOG2[np.minimum(mag, MAX_BIN)]


def classify(fx: FloatFormat, tab: CodingTables, ctx: Context,
             x: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """(bin c, d = c - c_mu, radius, |bin|, escaped, zero-bin) of every element: the one
    decision ``symbolize`` codes and ``adapt.element_costs`` prices."""
    c, _ = bin_index(fx, x, ctx.k)
    d = c - ctx.c_mu
    radius = tab.radius[ctx.t]
    mag = magnitude(c)
    esc = ~fx.finite(x) | ~ctx.mu_ok | (np.abs(d) > radius) | (mag >= MAX_BIN)
    zero = (mag == 0) & ~esc
    return c, d, radius, mag, esc, zero


def symbolize(fx: FloatFormat, tab: CodingTables, ctx: Context, x: np.ndarray) -> Symbols:
    """Encoder side: bins, escapes and raw bits of every element (chunk order)."""
    c, d, radius, mag, esc, zero = classify(fx, tab, ctx, x)
    normal = ~(esc | zero)
    width = np.where(normal, np.maximum(low_bits(fx, mag), 0), 0)
    # NOTE: normal values are normal floats, so their low nb <= mant bits are the
    # pattern's own low bits (the implicit leading 1 is never among them)
    xi = x.astype(np.int32)
    zi, ei = np.flatnonzero(zero), np.flatnonzero(esc)
    _, e_zero, man_zero = split(fx, x[zi])
    sections = [
        pack_fields(xi & ((1 << width) - 1), width),
        pack_fields(man_zero, np.full(len(zi), fx.mant)),
        pack_fields(xi[ei], np.full(len(ei), fx.bits)),
        pack_unary(ctx.k[zi] + fx.bias - 1 - e_zero),
    ]
    return Symbols(j=np.where(esc, 2 * radius + 1, d + radius), bits=b"".join(sections))


def desymbolize(fx: FloatFormat, tab: CodingTables, ctx: Context, j: np.ndarray,
                raw: bytes) -> np.ndarray:
    """Decoder side: bit patterns from decoded symbol indices and the raw sections.

    Raises IntegrityError on symbols no encoder emits (a corrupt stream)."""
    radius = tab.radius[ctx.t]
    esc = j == 2 * radius + 1
    c = ctx.c_mu + (j - radius)
    mag = magnitude(c)
    zero = (mag == 0) & ~esc
    normal = ~(esc | zero)
    nb = low_bits(fx, mag)
    width = np.where(normal, np.maximum(nb, 0), 0)
    zi, ei = np.flatnonzero(zero), np.flatnonzero(esc)
    sizes = [(int(width.sum()) + 7) // 8, (len(zi) * fx.mant + 7) // 8, (len(ei) * fx.bits + 7) // 8, None]
    s_low, s_zman, s_esc, s_unary = split_sections(raw, sizes)
    # NOTE: bound the open-ended section before expanding it (8 bits per byte):
    # each unary code is at most k + bias bits long
    if 8 * len(s_unary) > int((ctx.k[zi].astype(np.int64) + fx.bias).sum()) + 7:
        raise IntegrityError("unary section longer than any encoder writes")
    out = _normal_bits(fx, ctx.k, c, mag, nb, unpack_fields(s_low, width), normal)
    out[zi] = _zero_bits(fx, ctx.k[zi], c[zi], unpack_fields(s_zman, np.full(len(zi), fx.mant)),
                         unpack_unary(s_unary, len(zi)))
    out[ei] = unpack_fields(s_esc, np.full(len(ei), fx.bits))
    if (~ctx.mu_ok & ~esc).any():
        raise IntegrityError("an element with a non-finite mu was not escaped")
    return out


def _normal_bits(fx: FloatFormat, k, c, mag, nb, low, normal) -> np.ndarray:
    """Bit patterns of normal elements (garbage elsewhere; the caller overwrites those)."""
    e = k + (fx.mant - nb) + fx.bias  # exponent field of the bin's binade (nb = mant - log2 mag)
    down = np.minimum(np.maximum(-nb, 0), 30)
    sig = np.where(nb >= 0, (mag << np.maximum(nb, 0)) | low, mag >> down)
    bad = (e < 1) | (e > fx.max_field) | (mag >= MAX_BIN)
    bad |= (mag & ((1 << down) - 1)) != 0  # a bin strictly inside a wider value's bucket
    if fx.name == "fp8":  # e4m3fn's only non-finite pattern sits in the top binade
        bad |= (e == fx.max_field) & ((sig & 7) == 7)
    if (normal & bad).any():
        raise IntegrityError("decoded a bin that holds no finite value of this format")
    return ((c >> 31) & 1) << (fx.bits - 1) | (e << fx.mant) | (sig & ((1 << fx.mant) - 1))


def _zero_bits(fx: FloatFormat, k, c, man, delta) -> np.ndarray:
    e = k + fx.bias - 1 - delta
    if (e < 0).any():
        raise IntegrityError("zero-bin exponent distance out of range")
    return ((c >> 31) & 1) << (fx.bits - 1) | (e << fx.mant) | man
