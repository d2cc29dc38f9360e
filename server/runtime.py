"""What a sidecar loads once and shares between its transfers: the pinned
predictor, the codec built from it, and the served model's geometry.

Lifecycle: ``Runtime.load(config)`` verifies the checkpoint against the pin
(PinMismatchError otherwise) and builds the predictor; ``await runtime.mu(ids)``
runs it off the event loop. Tests and the demo load one runtime and hand it to
both sidecars of a process (``create_server(config, runtime=...)``).
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

import grpc
import numpy as np

from speckv.coder.codec import Codec, CodecConfig, bf16_bits
from speckv.errors import PinMismatchError, RpcError

if TYPE_CHECKING:  # pragma: no cover
    from speckv.predictor.predict import Predictor

    from .config import ServerConfig

logger = logging.getLogger(__name__)


@dataclass
class Runtime:
    codec: Codec
    predictor: "Predictor"
    model_id: str

    @classmethod
    def load(cls, config: "ServerConfig") -> "Runtime":
        from speckv.predictor.checkpoint import default_checkpoint_dir, load_checkpoint
        from speckv.predictor.predict import Predictor
        from speckv.predictor.target import load_target

        ckpt = load_checkpoint(config.predictor or default_checkpoint_dir(), config.pin)
        target = load_target(config.target) if ckpt.derived_weights else None
        predictor = Predictor.from_checkpoint(ckpt, target).to(config.predictor_device)
        runtime = cls.from_predictor(predictor, config)
        runtime.codec.bf16_contexts  # noqa: B018 -- build the BF16 context table before serving
        logger.info("loaded predictor %s for model %s", ckpt.pin, runtime.model_id)
        return runtime

    @classmethod
    def from_predictor(cls, predictor: "Predictor", config: "ServerConfig") -> "Runtime":
        """A runtime around an already loaded predictor (tests, the demo)."""
        if config.pin is not None and config.pin != predictor.pin:
            raise PinMismatchError(f"predictor pin mismatch: expected {config.pin}, loaded {predictor.pin}")
        codec = Codec.from_predictor(predictor, CodecConfig(layers_per_chunk=config.layers_per_chunk,
                                                            threads=config.threads, coder=config.coder))
        return cls(codec, predictor, config.model_id or predictor.checkpoint.manifest["target"]["name"])

    @property
    def pin(self) -> str:
        return self.codec.pin

    @property
    def geometry(self) -> tuple[int, int, int]:
        """(layers, kv_heads, head_dim) of the served model."""
        L, _, H, D = self.codec.log2_sigma.shape
        return int(L), int(H), int(D)

    def check(self, model_id: str, shape: tuple[int, ...], ids: np.ndarray, max_tokens: int) -> None:
        """A request's model, shape and prompt against what this sidecar serves."""
        if model_id != self.model_id:
            raise RpcError(grpc.StatusCode.FAILED_PRECONDITION,
                           f"model {model_id!r} is not served here (this sidecar serves {self.model_id!r})",
                           reason="MODEL_MISMATCH")
        L, H, D = self.geometry
        if (shape[0], shape[2], shape[4]) != (L, H, D):
            raise RpcError(grpc.StatusCode.INVALID_ARGUMENT,
                           f"shape {shape} does not fit {self.model_id} (layers {L}, kv_heads {H}, head_dim {D})")
        if shape[3] != len(ids):
            raise RpcError(grpc.StatusCode.INVALID_ARGUMENT,
                           f"shape has {shape[3]} tokens but {len(ids)} prompt token ids were sent")
        if not 1 <= len(ids) <= max_tokens:
            raise RpcError(grpc.StatusCode.RESOURCE_EXHAUSTED,
                           f"{len(ids)} tokens: this sidecar takes 1 to {max_tokens}")
        if len(ids) and (int(ids.min()) < 0 or int(ids.max()) >= self.vocab_size):
            raise RpcError(grpc.StatusCode.INVALID_ARGUMENT,
                           f"prompt token ids must lie in [0, {self.vocab_size})")

    @property
    def vocab_size(self) -> int:
        return int(self.predictor.model.config.vocab_size)

    async def mu(self, ids: np.ndarray) -> tuple[np.ndarray, float]:
        """The predictor's mu bit patterns for ``ids`` and the seconds it took."""
        def run() -> tuple[np.ndarray, float]:
            t0 = time.perf_counter()
            mu = bf16_bits(self.predictor.mu(ids))
            return mu, time.perf_counter() - t0
        return await asyncio.to_thread(run)
