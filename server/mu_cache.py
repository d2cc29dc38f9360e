"""Recent prompts' mu, so a prompt seen again (a retried transfer, a repeated
prompt) costs no second predictor pass, and transfers of the same prompt in
flight together share one pass.

Lifecycle: ``cache.take(runtime, ids)`` returns a :class:`LayerMu` (the cached
one, finished or still computing, or a new pass) and whether it was a hit;
``cache.give_back(mu)`` when the transfer no longer needs it. A pass that no
transfer uses any more and that has not finished is stopped at its next layer
and dropped; finished passes stay, least recently used first out, while their
bytes fit ``max_bytes`` (0 disables the cache: every transfer runs its own pass).
Running passes count toward ``max_bytes`` too: a new pass evicts finished ones
until both fit, so a budget below two prompts' mu (the default, 64 MiB: one
2,048-token prompt of the embedded model) keeps the last prompt for a retry but
never beside the next prompt's pass, which would stack two prompts' mu.

NOTE: keyed by the exact prompt token ids (sha256 of their int64 bytes). mu of a
prompt's prefix is NOT reused for a longer prompt: another sequence length may
change the GEMM shapes and with them mu's last bits, and both sidecars must
compute the same bits.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from typing import TYPE_CHECKING

import numpy as np

from .layer_mu import LayerMu

if TYPE_CHECKING:  # pragma: no cover
    from speckv.kv import Fp8Attention

    from .runtime import Runtime


def prompt_key(ids: np.ndarray) -> bytes:
    return hashlib.sha256(np.ascontiguousarray(ids, "<i8").tobytes()).digest()


class MuCache:
    """LayerMu passes by prompt, shared while in use, kept (LRU) when finished."""

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self._entries: OrderedDict[bytes, LayerMu] = OrderedDict()
        self._users: dict[int, int] = {}  # id(LayerMu) -> transfers using it

    def take(self, runtime: "Runtime", ids: np.ndarray,
             fp8_attention: "Fp8Attention | None" = None) -> tuple[LayerMu, bool]:
        """mu of ``ids`` (and the engine's FP8 attention: another mu) (hit: a cached or shared
        pass) for one transfer; give it back after."""
        key = prompt_key(ids) + (b"" if fp8_attention is None else fp8_attention.key)
        mu = self._entries.get(key)
        hit = mu is not None and mu.error is None
        if mu is not None and hit:
            self._entries.move_to_end(key)
        else:
            self._entries.pop(key, None)
            mu = runtime.mu_layers(ids, fp8_attention)
            if self.max_bytes and mu.bits.nbytes <= self.max_bytes:
                self._entries[key] = mu
        self._users[id(mu)] = self._users.get(id(mu), 0) + 1
        self._evict()
        return mu, hit

    def discard(self, mu: LayerMu) -> None:
        """No later ``take`` gets ``mu`` (a pass found wrong); its users keep it until they give it back."""
        for key, cached in list(self._entries.items()):
            if cached is mu:
                del self._entries[key]

    def give_back(self, mu: LayerMu) -> None:
        n = self._users.get(id(mu), 0) - 1
        if n > 0:
            self._users[id(mu)] = n
            return
        self._users.pop(id(mu), None)
        if mu.count < mu.bits.shape[0] or mu.error is not None:
            mu.stop()  # NOTE: nobody waits for it any more: the pass ends at its next layer
            self.discard(mu)
        self._evict()

    @property
    def nbytes(self) -> int:
        return sum(mu.bits.nbytes for mu in self._entries.values())

    def __len__(self) -> int:
        return len(self._entries)

    def _evict(self) -> None:
        """Drop least recently used entries no transfer is using until the rest fit."""
        for key in list(self._entries):
            if self.nbytes <= self.max_bytes:
                return
            if id(self._entries[key]) not in self._users:
                del self._entries[key]
