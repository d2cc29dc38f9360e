"""A codec's configuration: stream geometry, threads, coder and residual model,
validated at construction (``CodecConfig``; the sidecars build it from ServerConfig)."""

from __future__ import annotations

import os
from dataclasses import dataclass, field

from .backends import CODERS
from .residual import MODEL_NAMES

MAX_ELEMS_PER_LANE = 1 << 16  # block geometry cap, for writers and readers


@dataclass(frozen=True)
class CodecConfig:
    """Stream geometry; validated at construction."""

    elems_per_lane: int = 1024  # rANS ops per lane; 32 * this elements per block
    layers_per_chunk: int = 2
    threads: int = field(default_factory=lambda: min(2, os.cpu_count() or 1))  # numpy releases the GIL
    coder: str = "auto"  # per-scalar pipeline: numpy (reference) | native (CPU extension) | cuda | auto
    model: str = "auto"  # residual model to encode with: seed | tuned | auto (the best the checkpoint has)

    def __post_init__(self) -> None:
        if not 1 <= self.elems_per_lane <= MAX_ELEMS_PER_LANE:
            raise ValueError(f"elems_per_lane must be in [1, 65536], not {self.elems_per_lane}")
        if not 1 <= self.layers_per_chunk <= 0xFFFF:
            raise ValueError(f"layers_per_chunk must be in [1, 65535], not {self.layers_per_chunk}")
        if not 1 <= self.threads <= 64:
            raise ValueError(f"threads must be in [1, 64], not {self.threads}")
        if self.coder not in CODERS:
            raise ValueError(f"coder must be one of {CODERS}, not {self.coder!r}")
        if self.model != "auto" and self.model not in MODEL_NAMES:
            raise ValueError(f"model must be auto or one of {sorted(MODEL_NAMES)}, not {self.model!r}")
