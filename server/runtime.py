"""What a sidecar loads once and shares between its transfers: the pinned
predictor, the codec built from it, and the served model's geometry.

Lifecycle: ``Runtime.load(config)`` verifies the checkpoint against the pin
(PinMismatchError otherwise) and builds the predictor; ``runtime.mu_layers(ids)``
runs it off the event loop, its mu arriving layer by layer. Tests and the demo
load one runtime and hand it to both sidecars of a process
(``create_server(config, runtime=...)``).
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import grpc
import numpy as np

from speckv.coder.codec import Codec, CodecConfig
from speckv.errors import PinMismatchError, RpcError
from speckv.kv import Fp8Attention, HeadRange

from .batcher import PredictorBatcher
from .config import FALLBACK_MAX_TOKENS
from .layer_mu import LayerMu
from .memory import loading_arena, rss_bytes
from .replies import MODEL_MISMATCH

if TYPE_CHECKING:  # pragma: no cover
    from speckv.predictor.predict import Predictor

    from .config import ServerConfig

logger = logging.getLogger(__name__)
FOREIGN_VOCAB = 1 << 31  # token ids of a stored stream of another model: any non-negative int32


@dataclass
class Runtime:
    codec: Codec
    predictor: "Predictor"
    model_id: str
    numeric_ok: bool = True  # False: the predictor's canary mu differs here; health stays NOT_SERVING
    self_check_ok: bool | None = None  # two passes of one prompt at load agreed (None: not run)
    batcher: PredictorBatcher | None = None  # concurrent transfers' predictor passes batched; None: one by one

    @classmethod
    def load(cls, config: "ServerConfig") -> "Runtime":
        from speckv.predictor.checkpoint import load_checkpoint
        from speckv.predictor.predict import Predictor
        from speckv.predictor.store import CONFIG, default_checkpoint_dir
        from speckv.predictor.weights import derivation_source

        ckpt = load_checkpoint(config.predictor or default_checkpoint_dir(), config.pin)
        # NOTE: a max_tokens past the context is refused before the models load (config.json is pinned)
        check_max_tokens(config, model_context(json.loads((ckpt.path / CONFIG).read_bytes())),
                         config.model_id or ckpt.manifest["target"]["name"])
        with loading_arena():  # NOTE: the loader's garbage goes back to the kernel (server/memory.py)
            target = derivation_source(config.target) if ckpt.derived_weights else None  # read lazily
            predictor = Predictor.from_checkpoint(ckpt, target).to(config.predictor_device)
            del target
            runtime = cls.from_predictor(predictor, config)
            if predictor.canary_ok() is False:
                runtime.numeric_ok = False
                logger.error("refusing to serve: this machine computes a different mu for predictor %s than the "
                             "machine that built it (run `speckv predictor check`); health stays NOT_SERVING",
                             ckpt.pin[:12])
            runtime.codec.warm()  # the reference's context table, if it is the path
            if runtime.numeric_ok:
                runtime.self_check_ok = predictor.self_check()  # NOTE: the first passes' set-up, before serving
        logger.info("loaded predictor %s for model %s (resident %d MiB)", ckpt.pin, runtime.model_id,
                    rss_bytes() >> 20)
        return runtime

    @classmethod
    def from_predictor(cls, predictor: "Predictor", config: "ServerConfig") -> "Runtime":
        """A runtime around an already loaded predictor (tests, the demo)."""
        if config.pin is not None and config.pin != predictor.pin:
            raise PinMismatchError(f"predictor pin mismatch: expected {config.pin}, loaded {predictor.pin}")
        codec = Codec.from_predictor(predictor, CodecConfig(layers_per_chunk=config.layers_per_chunk,
                                                            threads=config.threads, coder=config.coder))
        batcher = PredictorBatcher(predictor, config.predictor_batch_tokens) \
            if config.predictor_batch_tokens and getattr(predictor, "batches", False) else None
        model_id = config.model_id or predictor.checkpoint.manifest["target"]["name"]
        runtime = cls(codec, predictor, model_id, batcher=batcher)
        check_max_tokens(config, runtime.context, runtime.model_id)
        return runtime

    @property
    def pin(self) -> str:
        return self.codec.pin

    @property
    def geometry(self) -> tuple[int, int, int]:
        """(layers, kv_heads, head_dim) of the served model."""
        L, _, H, D = self.codec.log2_sigma.shape
        return int(L), int(H), int(D)

    @property
    def context(self) -> int | None:
        """The served model's context in tokens (its config's max_position_embeddings)."""
        return model_context(self.predictor.model.config)

    def max_tokens(self, configured: int | None) -> int:
        """The prompt length limit: ``configured`` (config.max_tokens), else the context."""
        if configured is not None:
            return configured
        return self.context or FALLBACK_MAX_TOKENS

    def check(self, model_id: str, shape: tuple[int, ...], ids: np.ndarray, max_tokens: int | None,
              stored: bool = False, heads: HeadRange | None = None) -> None:
        """A request's model, shape and prompt against what this sidecar serves
        (``max_tokens``: config.max_tokens; None for the model's context). A ``stored`` stream
        of another model passes with its token count checked alone: it needs no predictor,
        and refusing it would fail a transfer between sidecars serving different models (a
        rolling upgrade); FetchKV checks the model its engine names (server/fetch.py). Another
        model's prompt is bounded by config.max_tokens alone (this model's context says nothing
        of it), else FALLBACK_MAX_TOKENS. ``heads``: the KV holds only those heads (one
        tensor-parallel rank's; ``shape`` then counts them alone)."""
        if not self.numeric_ok:
            raise RpcError(grpc.StatusCode.FAILED_PRECONDITION,
                           f"this sidecar computes another mu than predictor {self.pin[:12]} records (its canary "
                           "differs here; `speckv predictor check`): it serves nothing", reason="NUMERIC_ENV")
        foreign = model_id != self.model_id
        if foreign and not stored:
            raise RpcError(grpc.StatusCode.FAILED_PRECONDITION,
                           f"model {model_id!r} is not served here (this sidecar serves {self.model_id!r})",
                           reason=MODEL_MISMATCH)
        L, H, D = self.geometry
        if not foreign and heads is not None and heads.total != H:
            raise RpcError(grpc.StatusCode.INVALID_ARGUMENT,
                           f"{heads}: {self.model_id} has {H} KV heads")
        if not foreign and (shape[0], shape[2], shape[4]) != (L, H if heads is None else heads.count, D):
            raise RpcError(grpc.StatusCode.INVALID_ARGUMENT,
                           f"shape {shape} does not fit {self.model_id} (layers {L}, kv_heads {H}, head_dim {D})")
        if shape[3] != len(ids):
            raise RpcError(grpc.StatusCode.INVALID_ARGUMENT,
                           f"shape has {shape[3]} tokens but {len(ids)} prompt token ids were sent")
        context = self.context
        if not foreign and context is not None and len(ids) > context:
            raise RpcError(grpc.StatusCode.INVALID_ARGUMENT,
                           f"{len(ids)} tokens exceed the context of {self.model_id} ({context} tokens)")
        limit = (max_tokens or FALLBACK_MAX_TOKENS) if foreign else self.max_tokens(max_tokens)
        if not 1 <= len(ids) <= limit:
            raise RpcError(grpc.StatusCode.RESOURCE_EXHAUSTED,
                           f"{len(ids)} tokens: this sidecar takes 1 to {limit}")
        vocab = FOREIGN_VOCAB if foreign else self.vocab_size  # another model's vocabulary is its own
        if len(ids) and (int(ids.min()) < 0 or int(ids.max()) >= vocab):
            raise RpcError(grpc.StatusCode.INVALID_ARGUMENT, f"prompt token ids must lie in [0, {vocab})")

    @property
    def vocab_size(self) -> int:
        return int(self.predictor.model.config.vocab_size)

    def mu_layers(self, ids: np.ndarray, fp8_attention: Fp8Attention | None = None) -> LayerMu:
        """Start the predictor on ``ids``; its mu arrives layer by layer (see LayerMu)."""
        L, H, D = self.geometry
        return LayerMu.start(self.predictor, ids, (L, 2, H, len(ids), D), fp8_attention, self.batcher)


def model_context(config: Any) -> int | None:
    """``max_position_embeddings`` of a model config (object or dict); None when it names none."""
    n = config.get("max_position_embeddings") if isinstance(config, dict) else \
        getattr(config, "max_position_embeddings", None)
    return int(n) if n else None


def check_max_tokens(config: "ServerConfig", context: int | None, model: str) -> None:
    """Refuse at startup (ValueError, as every bad setting) a max_tokens past the model's context."""
    if config.max_tokens is not None and context is not None and config.max_tokens > context:
        raise ValueError(f"max_tokens {config.max_tokens} (--max-tokens / SPECKV_MAX_TOKENS) exceeds the context "
                         f"of {model}: {context} tokens (max_position_embeddings); leave it unset to take the "
                         "context")

