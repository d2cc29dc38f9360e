"""Integer arithmetic of the portable rung: every step exact, so any correct kernel gives the same bits.

Numbers: hidden states, projections and attention outputs are int64 fixed point
with ``FRAC`` fractional bits. Each matrix product is int8 x int8 with exact
int32 accumulation (``torch._int_mm``; integer sums are associative, so thread
count, ISA and library do not matter). Scales are applied with single IEEE
float64 operations on exact inputs (a product, a quotient, a square root: each
correctly rounded by IEEE 754 on every CPU and GPU) in a fixed order, then
rounded half to even. No libm call, no FMA contraction and no floating-point
reduction enters a result: sums run over integers, and the transcendental
functions (exp, SiLU, cos/sin) are integer tables stored in the checkpoint
(``tables``).

    quantise   q = round(x * (8192 / amax_row)) = hi * 128 + lo    two int8s per value, per row (token)
    product    acc = (w8 @ hi^T) * 128 + w8 @ lo^T                 int32 products, exact
    dequantise y = round((acc * (amax_row / 8192)) * ws)           int64, ws per output channel
    RMSNorm    folded into the quantisation: q of x * w_norm, and 1 / rms (from an
               exact integer sum of squares) joins the row's dequantisation factor

NOTE: torch's eager CPU and CUDA kernels do not contract ``a * b + c`` (each op is
its own kernel); keep every float64 step a separate operation.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from .products import int_mm, native_with  # noqa: F401 -- re-exported: the rungs' int8 product

if TYPE_CHECKING:  # pragma: no cover
    import torch

FRAC = 16  # fractional bits of the int64 fixed-point activations
Q_MAX = 127.0  # symmetric int8 range of the first operand (weights)
# NOTE: the second operand of every int8 product stays within +-B_MAX. oneDNN without VNNI
# (AVX2, AVX-512 without VNNI, SSE4.1) multiplies u8 x s8 pairs with vpmaddubsw, whose int16
# pair sums saturate: (a + 128) * b summed over two pairs fits int16 only for |b| <= 64.
B_MAX = 64
WIDE_SPLIT = 7  # activations q = hi * 2^7 + lo, hi and lo in -64..64: 14 bits from two products
WIDE_MAX = float(B_MAX << WIDE_SPLIT)
# softmax: exp(-z) for z >= 0 in steps of 2^-EXP_STEP_BITS, scaled to EXP_ONE, zero from EXP_LEN on
EXP_STEP_BITS = 8
EXP_LEN = 12 << EXP_STEP_BITS  # exp(-12) * EXP_ONE < 0.1: rounds to 0
EXP_SPLIT = 6  # numerators e = hi * 2^6 + lo, hi and lo in 0..63: second operands of P @ V
EXP_ONE = (1 << (2 * EXP_SPLIT)) - 1
SCORE_SHIFT = 2 * FRAC  # scores: q (FRAC) * k (FRAC); / sqrt(head_dim) is one more float64 division
MAX_TOKENS = 1 << 17  # int32 P @ V sums: 127 * 63 * tokens < 2^31
# SiLU: silu(x) for x in [-SILU_RANGE, SILU_RANGE) in steps of 2^-SILU_STEP_BITS; x outside: x or 0
SILU_STEP_BITS = 10
SILU_RANGE = 16
SILU_LEN = 2 * SILU_RANGE << SILU_STEP_BITS
ROPE_FRAC = 16  # cos/sin tables' fixed point
NATIVE = True  # the native extension's stages where it is built (same integers either way)
NATIVE_THREADS = 1
# NOTE: the fused kernels run tens of ms a call at 2048 tokens, long enough for 2 threads to pay
# (torch runs on one thread meanwhile); the short per-block stages above, between torch calls
# whose OpenMP workers spin for a while after each, do not scale and stay on 1
FUSED_THREADS = 2
FUSED = True  # the fused linear where it runs (tests: off, to compare the paths)
FUSED_SCALAR = False  # the fused kernel's scalar loops instead of its VNNI ones (tests: the same bits)
WIDE_FUSED_MAX_K = 2048  # the fused kernel's int32 sums: 127 * 2^13 * K < 2^31


class IntegerRangeError(ValueError):
    """An activation left the range where the integer engine is exact (not expected for real text)."""


def div(x: "torch.Tensor", d: float) -> "torch.Tensor":
    """x / d as one correctly rounded division per element.

    NOTE: on CUDA, ``tensor / python_scalar`` runs as ``tensor * (1 / d)``: two roundings (and on
    the CPU ``d / tensor`` is ``reciprocal * d``); dividing by a tensor is one IEEE division everywhere."""
    import torch

    return x / torch.full_like(x, d)


def quantise(x: "torch.Tensor", qmax: float = Q_MAX) -> tuple["torch.Tensor", "torch.Tensor"]:
    """float64 or int64 rows ``x`` -> (int8 q, float64 amax per row); q = round(x * qmax / amax)."""
    import torch

    xf = x.double()
    amax = xf.abs().amax(dim=-1)  # NOTE: max is exact in any order
    # NOTE: ``127.0 / t`` would be t.reciprocal() * 127 in torch: two roundings; divide explicitly
    inv = torch.where(amax > 0, torch.full_like(amax, qmax) / amax, torch.zeros_like(amax))
    return torch.round(xf * inv.unsqueeze(-1)).to(torch.int8), amax


def quantise_wide(x: "torch.Tensor") -> tuple["torch.Tensor", "torch.Tensor", "torch.Tensor"]:
    """Rows -> (int8 hi, int8 lo, float64 amax): q = round(x * 64 * 2^7 / amax) = hi * 2^7 + lo,
    hi = round(q / 2^7) and lo both in -64..64, so both may be second operands."""
    import torch

    xf = x.double()
    amax = xf.abs().amax(dim=-1)
    inv = torch.where(amax > 0, torch.full_like(amax, WIDE_MAX) / amax, torch.zeros_like(amax))
    q = torch.round(xf * inv.unsqueeze(-1)).to(torch.int64)
    hi = round_shift(q, WIDE_SPLIT)
    return hi.to(torch.int8), (q - (hi << WIDE_SPLIT)).to(torch.int8), amax


def wide_linear_acc(x: "torch.Tensor", w8: "torch.Tensor",
                    exact: bool = False) -> tuple["torch.Tensor", "torch.Tensor"]:
    """(int64 acc (rows, out) of 14-bit rows @ w8^T, float64 per-row dequantisation factor);
    the weights are the first operand: (w8 @ x^T)^T."""
    hi, lo, amax = quantise_wide(x)
    acc = (int_mm(w8, hi, exact).long() << WIDE_SPLIT) + int_mm(w8, lo, exact)
    return acc.t(), div(amax, WIDE_MAX)


def dequantise(acc: "torch.Tensor", row: "torch.Tensor", ws: "torch.Tensor") -> "torch.Tensor":
    """int64 round((acc * row) * ws): ``row`` a float64 factor per row, ``ws`` per column."""
    import torch

    return torch.round((acc.double() * row.unsqueeze(-1)) * ws).to(torch.int64)


def linear(x: "torch.Tensor", w8: "torch.Tensor | None", ws: "torch.Tensor", exact: bool = False,
           add: "torch.Tensor | None" = None, packed: "torch.Tensor | None" = None,
           out: "torch.Tensor | None" = None) -> "torch.Tensor":
    """int64 fixed-point rows -> int64 fixed-point ``x @ W^T`` (+ ``add``) with W = w8 * ws (per output row)."""
    return wide_linear(x, w8, ws, None, None, add, exact, packed, out)


def fused_hardware() -> bool:
    """Whether the fused linear's fast path runs here: the extension built, the CPU with AVX-512 VNNI."""
    nat = native_with("wide_linear")
    return nat is not None and bool(nat.wide_vnni())


def wide_pack(w8: "torch.Tensor") -> "torch.Tensor":
    """int8 ``w8`` (N, K) in the fused kernel's layout (``_native.wide_pack``): (N / 16, K / 2, 16, 2),
    N padded to 64 and K to 2 with zeros."""
    import torch

    nat = native_with("wide_pack")
    if nat is None:
        raise RuntimeError("wide_pack needs the native extension (speckv.coder._native)")
    N, K = w8.shape
    out = torch.empty(-(-N // 64) * 64 * -(-K // 2) * 2, dtype=torch.int8)
    nat.wide_pack(w8.contiguous().cpu().numpy(), N, K, out.numpy())
    return out


def wide_interleave(w: "torch.Tensor", inverse: bool = False) -> "torch.Tensor":
    """Rows (2 inter, ...) = [gate | up] -> 32 gate rows, then the same 32 channels' up rows, and so
    on (``inverse``: back): the fused kernel's SiLU layout, each tile of 64 rows one gate/up pair."""
    n = w.shape[0]
    if n % 64:
        raise ValueError(f"SiLU interleaving needs 2 inter rows in multiples of 64, not {n}")
    if inverse:
        return w.reshape(n // 64, 2, 32, *w.shape[1:]).transpose(0, 1).reshape(w.shape).contiguous()
    return w.reshape(2, n // 64, 32, *w.shape[1:]).transpose(0, 1).reshape(w.shape).contiguous()


def wide_unpack(packed: "torch.Tensor", n: int, k: int) -> "torch.Tensor":
    """The inverse of ``wide_pack``: int8 (n, k)."""
    np_, kp = -(-n // 64) * 64, -(-k // 2) * 2
    return packed.view(np_ // 16, kp // 2, 16, 2).permute(0, 2, 1, 3).reshape(np_, kp)[:n, :k].contiguous()


def wide_linear(x: "torch.Tensor", w8: "torch.Tensor | None", ws: "torch.Tensor", norm_w: "torch.Tensor | None",
                rms: "torch.Tensor | float | None", add: "torch.Tensor | None", exact: bool,
                packed: "torch.Tensor | None" = None, out: "torch.Tensor | None" = None,
                silu: "torch.Tensor | None" = None) -> "torch.Tensor":
    """``linear`` with the norm weights and 1 / rms folded in.

    ``packed`` (``wide_pack`` of ``w8``): the fused native kernel (``_native.wide_linear``:
    quantisation, one int16 x int8 product per pair of terms with exact int32 sums,
    dequantisation; ``benchmarks/portable_kernels.py`` times it against the rest); else the native stages
    where built (``wide_quantise`` / ``wide_dequant``); all give the same bits as the torch
    reference (``exact``). ``rms``: per row, or (fused kernel only) the norm's eps, each row's
    ``rms_inv_factor`` then computed natively. ``out``: the fused kernel's int64 destination,
    reused by the caller (fresh large buffers page-fault on every call); it may be ``add``
    itself (each element is read, then written, by one thread). ``silu`` (the SiLU table; fused
    kernel only, ``packed`` then of ``wide_interleave(w8)``): ``silu_mul`` of the result,
    (rows, out / 2)."""
    import torch

    nat = _native()
    native_only = packed is not None or silu is not None or isinstance(rms, float)
    if native_only and (exact or nat is None or x.device.type != "cpu" or packed is None):
        raise ValueError("packed weights, the SiLU epilogue and an eps for rms are for the fused native kernel only")
    if exact or nat is None or x.device.type != "cpu":
        assert w8 is not None
        acc, row = wide_linear_acc(x.double() * norm_w.double() if norm_w is not None else x, w8, exact)
        y = dequantise(acc, row if rms is None else row / rms, ws)
        return y if add is None else add + y
    if x.dtype != torch.int64:
        raise TypeError(f"wide_linear takes int64 fixed-point rows, not {x.dtype}")
    x = x.contiguous()
    M, K = x.shape
    threads = NATIVE_THREADS
    w = norm_w.double().contiguous().numpy() if norm_w is not None else None
    N = ws.shape[0]
    if packed is not None:
        if out is None:
            out = torch.empty((M, N // 2 if silu is not None else N), dtype=torch.int64)
        rms_arr = rms.double().contiguous().numpy() if isinstance(rms, torch.Tensor) else None
        eps = float(rms) if isinstance(rms, float) else -1.0  # a float: the row's rms computed natively
        nat.wide_linear(x.numpy(), w, rms_arr, eps, FRAC, WIDE_MAX,
                        packed.numpy(), N, ws.contiguous().numpy(),
                        None if add is None else add.contiguous().numpy(), out.numpy(), FUSED_THREADS, FUSED_SCALAR,
                        None if silu is None else silu.contiguous().numpy(), SILU_STEP_BITS, SILU_RANGE)
        return out
    assert w8 is not None
    hl = torch.empty((2 * M, K), dtype=torch.int8)
    amax = torch.empty(M, dtype=torch.float64)
    nat.wide_quantise(x.numpy(), w, WIDE_MAX, WIDE_SPLIT, hl[:M].numpy(), hl[M:].numpy(), amax.numpy(), threads)
    row = div(amax, WIDE_MAX)
    row = row if rms is None else row / rms
    prod = int_mm(w8, hl)  # (out, 2 rows): hi rows, then lo rows
    out = torch.empty((M, N), dtype=torch.int64)
    nat.wide_dequant(prod.numpy(), WIDE_SPLIT, row.numpy(), ws.contiguous().numpy(),
                     add.contiguous().numpy() if add is not None else None, out.numpy(), threads)
    return out


def _native() -> Any:
    return native_with("wide_quantise") if NATIVE else None


def rms_inv_factor(x: "torch.Tensor", eps: float) -> "torch.Tensor":
    """float64 rms of each row of int64 fixed-point ``x`` (real units), from an exact integer sum
    of squares of ``x >> shift``, with a per-row shift that keeps the sum inside int64."""
    import torch

    n = x.shape[-1]
    ss_bits = (62 - max(n - 1, 1).bit_length()) // 2  # n squares below 2^(2 ss_bits) sum below 2^62
    amax = x.abs().amax(dim=-1)
    _, bits = torch.frexp(amax.double())  # exact: amax < 2^53
    shift = (bits.long() - ss_bits).clamp(min=0)
    xs = x >> shift.unsqueeze(-1)
    ss = (xs * xs).sum(dim=-1)  # exact: each square < 2^(2 ss_bits), n of them
    up = (torch.ones_like(shift) << (2 * shift)).double()  # 2^(2 shift), exact
    mean = div(ss.double() * up, float(n << (2 * FRAC)))  # * 2^k: exact; one rounded division
    return torch.sqrt(mean + eps)


def norm_linear(x: "torch.Tensor", norm_w: "torch.Tensor", eps: float, w8: "torch.Tensor | None",
                ws: "torch.Tensor", exact: bool = False, packed: "torch.Tensor | None" = None,
                out: "torch.Tensor | None" = None, silu: "torch.Tensor | None" = None) -> "torch.Tensor":
    """``linear(rmsnorm(x) * norm_w)``: the norm folds into the row quantisation (the fused kernel
    computes ``rms_inv_factor`` itself, from ``eps``); ``silu``: as ``wide_linear``."""
    rms = eps if packed is not None and not exact else rms_inv_factor(x, eps)
    return wide_linear(x, w8, ws, norm_w, rms, None, exact, packed, out, silu)


def round_shift(x: "torch.Tensor", bits: int) -> "torch.Tensor":
    """round(x / 2^bits), halves up, on int64."""
    return (x + (1 << (bits - 1))) >> bits


def rope(x: "torch.Tensor", cos: "torch.Tensor", sin: "torch.Tensor") -> "torch.Tensor":
    """Rotary embedding on int64 ``x`` (tokens, heads, dim) with int tables (tokens, dim / 2)."""
    import torch

    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    c, s = cos[:, None, :].long(), sin[:, None, :].long()
    return torch.cat([round_shift(x1 * c - x2 * s, ROPE_FRAC), round_shift(x2 * c + x1 * s, ROPE_FRAC)], dim=-1)


def split_qkv(qkv: "torch.Tensor", cos: "torch.Tensor", sin: "torch.Tensor", heads: int, kv_heads: int, dim: int,
              exact: bool = False) -> tuple["torch.Tensor | None", "torch.Tensor", "torch.Tensor", "torch.Tensor"]:
    """A layer's fused projection rows (tokens, (heads + 2 kv_heads) dim) -> (q roped (tokens, heads, dim)
    or None when ``heads`` is 0, k roped, v (tokens, kv_heads, dim), mu BF16 (2, kv_heads, tokens, dim));
    one native call where built (``_native.split_qkv``), the same integers as ``rope`` and ``to_bf16``."""
    import torch

    T, H, Hk, D = qkv.shape[0], heads, kv_heads, dim
    nat = native_with("split_qkv") if NATIVE and FUSED else None
    if exact or nat is None or qkv.device.type != "cpu":
        q = rope(qkv[:, : H * D].reshape(T, H, D), cos, sin) if H else None
        k = rope(qkv[:, H * D:(H + Hk) * D].reshape(T, Hk, D), cos, sin)
        v = qkv[:, (H + Hk) * D:].reshape(T, Hk, D)
        return q, k, v, torch.stack([to_bf16(k).transpose(0, 1), to_bf16(v).transpose(0, 1)]).contiguous()
    q = torch.empty((T, H, D), dtype=torch.int64) if H else None
    k, v = torch.empty((T, Hk, D), dtype=torch.int64), torch.empty((T, Hk, D), dtype=torch.int64)
    mu = torch.empty((2, Hk, T, D), dtype=torch.bfloat16)
    nat.split_qkv(qkv.contiguous().numpy(), cos.contiguous().numpy(), sin.contiguous().numpy(), H, Hk, D, ROPE_FRAC,
                  FRAC, None if q is None else q.numpy(), k.numpy(), v.numpy(), mu.view(torch.int16).numpy(),
                  FUSED_THREADS)
    return q, k, v, mu


def silu(x: "torch.Tensor", table: "torch.Tensor") -> "torch.Tensor":
    """SiLU of int64 fixed-point ``x`` from the table; x itself above the range, 0 below."""
    import torch

    step = FRAC - SILU_STEP_BITS
    idx = round_shift(x, step) + (SILU_RANGE << SILU_STEP_BITS)
    inside = table[idx.clamp(0, SILU_LEN - 1)]
    return torch.where(idx >= SILU_LEN, x, torch.where(idx < 0, torch.zeros_like(x), inside))


def silu_mul(gu: "torch.Tensor", table: "torch.Tensor", exact: bool = False,
             out: "torch.Tensor | None" = None) -> "torch.Tensor":
    """round_shift(silu(gate) * up, FRAC) of int64 ``gu`` (rows, 2 inter) = [gate | up]; the native
    stage writes into ``out`` where given."""
    import torch

    inter = gu.shape[1] // 2
    nat = _native()
    if exact or nat is None or gu.device.type != "cpu":
        return round_shift(silu(gu[:, :inter], table) * gu[:, inter:], FRAC)
    if out is None:
        out = torch.empty((gu.shape[0], inter), dtype=torch.int64)
    nat.silu_mul(gu.contiguous().numpy(), table.contiguous().numpy(), FRAC, SILU_STEP_BITS, SILU_RANGE, out.numpy(),
                 FUSED_THREADS if FUSED else NATIVE_THREADS)
    return out


def to_bf16(x: "torch.Tensor", frac: int = FRAC) -> "torch.Tensor":
    """BF16 of int64 fixed-point ``x``, rounded once (to nearest, ties to even) in integers."""
    import torch

    a = x.abs()
    _, exp = torch.frexp(a.double())  # exact: |x| < 2^53; a = m * 2^exp with m in [0.5, 1)
    shift = (exp.long() - 8).clamp(min=0)  # keep 8 significant bits
    q = a >> shift
    rem = a - (q << shift)
    half = torch.where(shift > 0, 1 << (shift - 1).clamp(min=0), torch.zeros_like(shift))
    up = (rem > half) | ((rem == half) & (shift > 0) & ((q & 1) == 1))
    r = (q + up.long()) << shift  # exactly representable in BF16 (<= 8 significant bits)
    val = torch.where(x < 0, -r, r).double() * (2.0 ** -frac)
    return val.to(torch.bfloat16)


TABLE_NAMES = ("portable.rope_cos", "portable.rope_sin", "portable.exp", "portable.silu", "portable.check")


def tables(config: Any) -> dict[str, "torch.Tensor"]:
    """The integer tables (built once, with libm, then pinned by the checkpoint's weight digest)."""
    import math

    import torch

    dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    rp = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
    theta = float(rp.get("rope_theta") or getattr(config, "rope_theta", None) or 10000.0)
    if rp.get("rope_type", "default") != "default":
        raise ValueError(f"portable rung: rope type {rp.get('rope_type')!r} is not supported yet")
    pos = torch.arange(config.max_position_embeddings, dtype=torch.float64)[:, None]
    inv = theta ** (-torch.arange(0, dim, 2, dtype=torch.float64) / dim)
    ang = pos * inv[None, :]
    z = (torch.arange(EXP_LEN, dtype=torch.float64) + 0.5) / (1 << EXP_STEP_BITS)
    xs = (torch.arange(SILU_LEN, dtype=torch.float64) - (SILU_RANGE << SILU_STEP_BITS)) / (1 << SILU_STEP_BITS)
    scale = float(1 << ROPE_FRAC)
    return {
        "portable.rope_cos": torch.round(torch.cos(ang) * scale).to(torch.int32),
        "portable.rope_sin": torch.round(torch.sin(ang) * scale).to(torch.int32),
        "portable.exp": torch.round(torch.exp(-z) * EXP_ONE).to(torch.int32),
        "portable.silu": torch.round(xs / (1 + torch.exp(-xs)) * float(1 << FRAC)).to(torch.int64),
        "portable.check": torch.tensor([FRAC, EXP_STEP_BITS, EXP_ONE, SILU_STEP_BITS, SILU_RANGE, ROPE_FRAC,
                                        int(math.isfinite(theta))], dtype=torch.int64),
    }
