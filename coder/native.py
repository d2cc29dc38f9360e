"""The native CPU coder: the extension ``speckv.coder._native``, built from
``coder/kernels/spk_native.cpp`` when the package is installed (setup.py).

It runs the whole per-scalar pipeline of a batch of consecutive chunks - mu
correction, contexts, symbols, bit sections and the rANS lanes - in the
per-element code the CUDA kernels share (``spk_model.cuh``), on threads with the
GIL released, and writes the numpy reference's streams byte for byte.

Paths (``path``): on a CPU with AVX2 the per-element stages run a block at a time in
branch-free loops the compiler vectorises (``spk_simd.h``: contexts, symbols and table
ops; the decoder's classification and value composition; the mu correction), built twice,
for AVX2 and for AVX-512 ("vector512", taken where the CPU has it), chosen at run time;
elsewhere the scalar code of ``spk_model.cuh``, with BF16 contexts from one 256 KB
scale-invariant table. Every path writes the same bytes (tests run them all).

Lifecycle::

    nat = NativeCoder(threads=2)                       # raises NativeUnavailable when not built
    mu2 = nat.prepare_mu(mu, a, b, scales)             # corrected mu (BF16) or mu'/scale (fp32 bits)
    parts = nat.encode(x, mu2, L, layer_counts, epl, tables)   # per chunk: RansBlocks, bits
    nat.decode(mu2, L, layer_counts, epl, streams, tables, out)  # out: bit patterns, checked
    cost, hits = nat.group_costs(x, mu2, levels, tables)  # adapt's cost sample, natively
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cache
from typing import Any, Sequence

import numpy as np

from speckv.errors import IntegrityError, RansDecodeError

from .rans import LANES, RansBlocks, _check_blocks
from .tables import NOOP_TABLE, CodingTables

try:
    from . import _native  # type: ignore[attr-defined]

    IMPORT_ERROR = ""
except ImportError as exc:  # not built: no compiler at install time, or a source checkout
    _native = None
    IMPORT_ERROR = str(exc)

# status codes of coder/kernels/spk_consts.h -> the numpy decoder's messages (model.py, bitpack.py)
_RANS_STATUS = {1: "read past the start of its words", 2: "words left unread", 3: "final state is not RANS_L (corrupt)"}
_VALUE_STATUS = {4: "bit sections need more than the {0} bytes present",
                 5: "unary section longer than any encoder writes",
                 6: "non-zero padding after bit fields",
                 7: "decoded a bin that holds no finite value of this format",
                 8: "expected {0} unary codes, found {1}",
                 9: "unary codes: {0} bytes for {1} bits",
                 10: "zero-bin exponent distance out of range",
                 11: "an element with a non-finite mu was not escaped"}


PATHS = {"auto": -1, "computed": 0, "lookup": 1, "vector": 2, "vector512": 3}  # spk_native.cpp's PATH_*
# NOTE: a call on fewer elements runs on one thread: waking a worker costs more than such a
# call's work (the encoder's cost samples: 12 groups of 2,048 elements a call)
PARALLEL_MIN_ELEMENTS = 1 << 17


def vector_path() -> bool:
    """Whether the extension runs its AVX2 stages on this CPU (path "vector")."""
    return _native is not None and bool(_native.AVX2)


def wide_path() -> bool:
    """Whether it also runs their AVX-512 builds (path "vector512", which "auto" then picks)."""
    return _native is not None and bool(getattr(_native, "AVX512", 0))


def vector_paths() -> list[str]:
    """The vector paths this CPU runs, each writing the scalar paths' bytes (tests run them all)."""
    return (["vector"] if vector_path() else []) + (["vector512"] if wide_path() else [])


class NativeUnavailable(RuntimeError):
    """The extension was not built with this installation."""


def available() -> bool:
    return _native is not None


def constants() -> dict[str, int]:
    """The pipeline constants the extension was compiled with (spk_consts.h)."""
    if _native is None:
        raise NativeUnavailable(IMPORT_ERROR)
    names = ("PROB_BITS", "LANES", "WORD_BITS", "RANS_L", "X_MAX_SHIFT", "SIGMA_FRAC_BITS", "GRID_BELOW_SIGMA",
             "LAMBDA_MIN", "LAMBDA_MAX", "OFFSET_BITS", "LAMBDA_OFFSET", "N_GAUSS", "NOOP_TABLE", "MAX_BIN",
             "NEAR_TOP_Q8", "SHIFT_MAX")
    return {n: int(getattr(_native, n)) for n in names}


@dataclass(frozen=True)
class FlatTables:
    """A residual model's Gaussian rows as the native code takes them."""

    cum: np.ndarray  # (symbols,) u16
    freq: np.ndarray  # (symbols,) u16
    offset: np.ndarray  # (rows,) i32
    size: np.ndarray  # (rows,) i32
    radius: np.ndarray  # (rows,) i32

    @classmethod
    def of(cls, tables: CodingTables) -> "FlatTables":
        g = tables.gauss
        size = np.diff(np.append(g.offset.astype(np.int64), len(g.cum))).astype(np.int32)
        assert len(size) == NOOP_TABLE + 1 and int(g.freq.max()) <= 0xFFFF
        return cls(cum=np.ascontiguousarray(g.cum, np.uint16), freq=np.ascontiguousarray(g.freq, np.uint16),
                   offset=np.ascontiguousarray(g.offset, np.int32), size=size,
                   radius=np.ascontiguousarray(tables.radius, np.int32))

    def args(self) -> tuple[np.ndarray, ...]:
        return self.cum, self.freq, self.offset, self.size, self.radius


@dataclass(frozen=True)
class EncodedChunk:
    blocks: RansBlocks
    bits: bytes


class NativeCoder:
    """The extension with a thread count; arrays in canonical (layers, 2, heads, tokens, dim) order."""

    name = "native"

    def __init__(self, threads: int = 1, path: str = "auto") -> None:
        """``path`` of the per-element stages, all writing the same bytes: "vector" (AVX2,
        spk_simd.h), "vector512" (the same loops built for AVX-512), "lookup" (scalar, contexts
        from a table), "computed" (scalar), or "auto" (the widest vector path here, else lookup)."""
        if _native is None:
            raise NativeUnavailable(IMPORT_ERROR)
        self.threads = threads
        if path not in PATHS:
            raise ValueError(f"unknown native path {path!r}; choose from {sorted(PATHS)}")
        if path == "vector" and not vector_path():
            raise NativeUnavailable("the vector path needs a CPU with AVX2")
        if path == "vector512" and not wide_path():
            raise NativeUnavailable("the vector512 path needs a CPU with AVX-512")
        self.path = path
        self._flat: dict[int, FlatTables] = {}

    def with_threads(self, threads: int) -> "NativeCoder":
        """This coder on ``threads`` threads, sharing its flattened tables."""
        other = NativeCoder(threads, self.path)
        other._flat = self._flat  # NOTE: one dict: a table flattened by either is the other's too
        return other

    @staticmethod
    def hold_core(delta: int) -> None:
        """A thread beside the pool takes (1) or gives back (-1) a core: the rANS pass starts that
        many threads fewer meanwhile (``lookahead.Lookahead``'s ``hold``)."""
        _native.hold_core(delta)

    @property
    def simd(self) -> str:
        """The instruction set of the per-element stages this coder runs: "avx512", "avx2" or "none"."""
        path = self.path if self.path != "auto" else "vector512" if wide_path() else "vector" if vector_path() else ""
        return {"vector": "avx2", "vector512": "avx512"}.get(path, "none")

    def flat(self, tables: CodingTables) -> FlatTables:
        key = id(tables)  # NOTE: CodingTables live as long as their checkpoint's codecs
        if key not in self._flat:
            self._flat[key] = FlatTables.of(tables)
        return self._flat[key]

    def prepare_mu(self, mu: np.ndarray, a: np.ndarray | None, b: np.ndarray | None,
                   scales: np.ndarray | None) -> np.ndarray:
        """mu' = bf16(a mu + b) per channel (a, b: ``(layers, 2, heads, dim)`` or None), then for
        FP8 KV mu' / scale in fp32 (``scales``: ``(layers, 2)``), as u16 / u32 bit patterns."""
        mu = np.ascontiguousarray(mu, np.uint16)
        layers, _, heads, tokens, dim = mu.shape
        out = np.empty(mu.shape, np.uint32 if scales is not None else np.uint16)
        if a is not None:
            a, b = np.ascontiguousarray(a, np.float32), np.ascontiguousarray(b, np.float32)
        if scales is not None:
            scales = np.ascontiguousarray(scales, np.float32)
        _native.prepare_mu(scales is not None, mu, a, b, scales, layers, heads, tokens, dim, out, self.threads,
                           PATHS[self.path])
        return out

    def encode(self, x: np.ndarray, mu: np.ndarray, log2_sigma: np.ndarray, layer_counts: Sequence[int],
               elems_per_lane: int, tables: CodingTables) -> list[EncodedChunk]:
        """Code consecutive chunks of ``layer_counts`` layers: x u16 (BF16) or u8 (e4m3) bit
        patterns, mu from ``prepare_mu``, log2_sigma ``(layers, 2, heads, dim)`` per channel."""
        fp8 = x.dtype == np.uint8
        _, _, heads, tokens, dim = x.shape
        parts = _native.encode(fp8, np.ascontiguousarray(x), np.ascontiguousarray(mu), _levels(log2_sigma), heads,
                               tokens, dim, elems_per_lane, list(layer_counts), *self.flat(tables).args(),
                               self.threads, PATHS[self.path])
        return [EncodedChunk(RansBlocks(np.frombuffer(s, np.uint32).reshape(-1, LANES), np.frombuffer(c, np.uint32),
                                        np.frombuffer(w, np.uint16)), bits) for s, c, w, bits in parts]

    def group_costs(self, x: np.ndarray, mu: np.ndarray, levels: np.ndarray,
                    tables: CodingTables) -> tuple[np.ndarray, np.ndarray]:
        """``adapt``'s exact coded cost (1/256 bits) and surprises of each group: rows of x
        ``(groups, ...)`` (u16 BF16 / u8 e4m3 patterns), mu as coded and per-element levels
        alike; the numbers ``adapt.element_costs`` sums, computed natively."""
        from .adapt import COST_FRAC_BITS, SURPRISE_BITS

        groups = len(x)
        cost, hits = np.zeros(groups, np.int64), np.zeros(groups, np.int64)
        if x.size == 0:
            return cost, hits
        _native.group_costs(x.dtype == np.uint8, np.ascontiguousarray(x), np.ascontiguousarray(mu),
                            np.ascontiguousarray(levels, np.int32), x.size // groups, _symbol_cost32(),
                            SURPRISE_BITS << COST_FRAC_BITS, *self.flat(tables).args(), cost, hits,
                            self.threads if x.size >= PARALLEL_MIN_ELEMENTS else 1, PATHS[self.path])
        return cost, hits

    def decode(self, mu: np.ndarray, log2_sigma: np.ndarray, layer_counts: Sequence[int], elems_per_lane: int,
               streams: Sequence[tuple[RansBlocks, bytes]], tables: CodingTables, out: np.ndarray) -> None:
        """Decode consecutive chunks into ``out`` (their layers' bit patterns, u16 or u8).

        Raises RansDecodeError or IntegrityError, as the numpy decoder does, on a corrupt stream."""
        fp8 = out.dtype == np.uint8
        _, _, heads, tokens, dim = out.shape
        args = []
        for blocks, bits in streams:
            states, counts, words = _check_blocks(blocks)
            args.append((np.ascontiguousarray(states), np.ascontiguousarray(counts), np.ascontiguousarray(words),
                         bytes(bits)))
        err = _native.decode(fp8, np.ascontiguousarray(mu), _levels(log2_sigma), heads, tokens, dim, elems_per_lane,
                             list(layer_counts), args, *self.flat(tables).args(), out, self.threads, PATHS[self.path])
        if err is not None:
            _raise(*err)




@cache
def _symbol_cost32() -> np.ndarray:
    from .adapt import symbol_cost

    return np.ascontiguousarray(symbol_cost(), np.int32)


def _levels(log2_sigma: np.ndarray) -> np.ndarray:
    """log2 sigma per channel as int32 (the model's fixed point)."""
    lg = np.asarray(log2_sigma)
    if lg.size and (lg.min() < -(1 << 30) or lg.max() >= 1 << 30):
        raise ValueError("log2 sigma out of range")
    return np.ascontiguousarray(lg, np.int32)


def _error(status: int, chunk: int, block: int, a: int, b: int) -> Exception:
    """The typed error of a decoder status (chunk and block: where it was found)."""
    if status in _RANS_STATUS:
        return RansDecodeError(f"chunk {chunk}, block {block}: {_RANS_STATUS[status]}")
    msg = _VALUE_STATUS.get(status, "native decoder status {2}").format(a, b, status)
    return IntegrityError(f"chunk {chunk}: {msg}")


def _raise(status: int, chunk: int, block: int, a: int, b: int) -> Any:
    raise _error(status, chunk, block, a, b)
