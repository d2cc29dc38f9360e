"""The target's weights read one tensor at a time from its safetensors files, no model built.

A sidecar needs the target only to derive its predictor's weights (a
``--derive-weights`` checkpoint). ``load_target`` builds the whole target to run
it: its BF16 tensors plus an FP32 copy of every linear (``target.py`` runs BF16
GEMMs as FP32 products), about 3x the BF16 size, while a rung keeps a fraction of
it (``w8a8:4``: int8 later layers, four BF16 layers, the embeddings). Reading the
tensors lazily keeps the sidecar's peak near the rung's own size.

Lifecycle: ``target_weights(spec)`` resolves the target's directory as
``load_target`` does and returns ``TargetWeights``, a read-only mapping from the
names of the model's ``state_dict`` (tied ones included) to fresh BF16 tensors,
each read on access; ``weights_sha256`` streams ``store.state_digest`` over it,
so it equals ``Target.weights_sha256`` for the same files. A directory without
safetensors files gives None: the caller loads the whole target instead.
"""

from __future__ import annotations

import functools
import json
import math
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from speckv.errors import ModelLoadError

from .llama import load_config
from .mapped import map_tensor
from .store import state_digest
from .target import DEFAULT_TARGET, EMBEDDED_NAME, Target, load_target, target_dir

if TYPE_CHECKING:  # pragma: no cover
    import torch

SINGLE = "model.safetensors"
INDEX = "model.safetensors.index.json"  # sharded checkpoints: {"weight_map": {name: shard file}}
EMBED, LM_HEAD = "model.embed_tokens.weight", "lm_head.weight"


class TargetWeights(Mapping):
    """A target's BF16 tensors by state-dict name, each read from disk when asked for."""

    def __init__(self, path: Path, name: str, config: Any, files: dict[str, Path],
                 spec: str | Path = DEFAULT_TARGET) -> None:
        self.path, self.name, self.config, self.spec = path, name, config, spec  # spec: as load_target takes it
        self._files = files  # tensor name -> the file holding it
        self._tied = {LM_HEAD: EMBED} if getattr(config, "tie_word_embeddings", False) and \
            LM_HEAD not in files and EMBED in files else {}  # NOTE: state_dict() lists a tied lm_head too

    def __getitem__(self, name: str) -> "torch.Tensor":
        import torch
        from safetensors import safe_open

        stored = self._tied.get(name, name)
        if stored not in self._files:
            raise KeyError(name)
        with safe_open(str(self._files[stored]), "pt") as f:
            t = f.get_tensor(stored)
        return t if t.dtype == torch.bfloat16 else t.to(torch.bfloat16)  # as load_hf(dtype=bfloat16) casts

    def mapped(self, name: str) -> "torch.Tensor | None":
        """``name`` as a read-only tensor over the file's pages (``mapped.map_tensor``: resident only
        where read), or None when the file does not store it as BF16."""
        stored = self._tied.get(name, name)
        if stored not in self._files:
            raise KeyError(name)
        return map_tensor(self._files[stored], stored)

    def __iter__(self) -> Iterator[str]:
        return iter([*self._files, *self._tied])

    def __len__(self) -> int:
        return len(self._files) + len(self._tied)

    @property
    def state(self) -> "TargetWeights":
        """The mapping itself (``Target.state``'s role: the original BF16 parameters)."""
        return self

    @functools.cached_property
    def bf16_bytes(self) -> int:
        """The size of the stored tensors in BF16 (a tied tensor once), from their shapes alone."""
        from safetensors import safe_open

        total = 0
        for file in sorted(set(self._files.values())):
            with safe_open(str(file), "pt") as f:
                total += sum(2 * math.prod(f.get_slice(n).get_shape()) for n in f.keys() if n in self._files)
        return total

    @functools.cached_property
    def weights_sha256(self) -> str:
        """``state_digest`` of the tensors, read one at a time (mapped where stored as BF16: no copy)."""
        return state_digest(_PreferMapped(self))


class _PreferMapped(Mapping):
    """A TargetWeights whose tensors are mapped where they can be (digests read no copies)."""

    def __init__(self, weights: TargetWeights) -> None:
        self.weights = weights

    def __getitem__(self, name: str) -> "torch.Tensor":
        t = self.weights.mapped(name)
        return self.weights[name] if t is None else t

    def __iter__(self) -> Iterator[str]:
        return iter(self.weights)

    def __len__(self) -> int:
        return len(self.weights)


def shard_files(path: Path) -> dict[str, Path] | None:
    """Tensor name -> safetensors file of a Hugging Face directory; None when it has none."""
    from safetensors import safe_open

    if (path / INDEX).is_file():
        try:
            weight_map = json.loads((path / INDEX).read_text())["weight_map"]
        except (OSError, ValueError, KeyError) as e:
            raise ModelLoadError(f"cannot read {path / INDEX}: {e}") from e
        return {name: path / shard for name, shard in weight_map.items()}
    if not (path / SINGLE).is_file():
        return None
    with safe_open(str(path / SINGLE), "pt") as f:
        return {name: path / SINGLE for name in f.keys()}


def target_weights(spec: str | Path = DEFAULT_TARGET) -> TargetWeights | None:
    """The target's weights, read lazily (see the module docstring); None without safetensors."""
    path = target_dir(spec)
    if not (path / "config.json").is_file():
        raise ModelLoadError(f"not a Hugging Face model directory (no config.json): {path}")
    files = shard_files(path)
    if files is None:
        return None
    config = load_config(path)  # NOTE: plain attributes for a Llama: no transformers config classes
    name = EMBEDDED_NAME if str(spec) == DEFAULT_TARGET else Path(spec).name
    return TargetWeights(path, name, config, files, spec)


def derivation_source(spec: str | Path = DEFAULT_TARGET) -> "TargetWeights | Target":
    """What a derived checkpoint's weights come from: the lazy weights, else the whole target."""
    return target_weights(spec) or load_target(spec)
