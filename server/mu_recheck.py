"""The encoder's per-chunk mu check, and a second predictor pass when the decoder disagrees.

Both sidecars run the pinned predictor on the same prompt, so their mu of a chunk's
layers agree unless one side computes another mu: another machine's numerics (every
pass there differs, the same way each time), or one pass that went wrong. The
per-chunk check cannot tell which; a disagreeing chunk goes stored either way
(lossless, uncompressed). The encoder tells them apart by running its pass again:

- ``same``: the second pass repeats the first: the decoder computes another mu. The
  chunks go stored, and this peer gets no second pass again until a whole transfer with it
  agrees (a peer whose numerics differ costs one second pass, not one per transfer).
- ``recovered``: the second pass differs from the first and agrees with the decoder on
  every disagreeing chunk: the first pass here was wrong. The transfer goes on, coded,
  with the second, and the first leaves the mu cache (no other transfer is handed it).
- ``unstable``: the second pass differs from the first and from the decoder: stored.
- ``error``: the second pass failed: stored.

At most one second pass per transfer. Every outcome is counted
(``speckv_mu_rechecks_total``); a first pass found wrong is logged as an error, since a
predictor that computes two mu for one prompt is a defect to find, not a state to live
with. NOTE: one such defect is open: in 3 of about 12 fresh-clone CI runs, the vLLM
pair's first transfer found the encoder's mu of layers 0-1 unlike the decoder's and
unlike every standalone pass of that prompt (benchmarks/RESULTS.md, "A first pass
that computed another mu").
"""

from __future__ import annotations

import asyncio
import logging
from typing import TYPE_CHECKING

import numpy as np

from speckv.digests import algorithm_of

from .encoder_job import mismatched_chunks
from .metrics import RECHECK_OUTCOMES

if TYPE_CHECKING:  # pragma: no cover
    from .encoder_job import Job
    from .layer_mu import LayerMu
    from .metrics import Metrics
    from .mu_cache import MuCache
    from .replies import Checks
    from .runtime import Runtime

logger = logging.getLogger("speckv.server.encoder")

SAME, RECOVERED, UNSTABLE, ERROR = RECHECK_OUTCOMES


async def compare(first: "LayerMu", second: "LayerMu", job: "Job", batch: list[int], bad: set[int],
                  checks: "Checks") -> str:
    """The outcome of a second pass over ``batch``, whose chunks ``bad`` disagree (module docstring).
    NOTE: recovered needs the decoder's agreement on every chunk of the batch, not only on ``bad``:
    the whole batch is coded under the pass the transfer goes on with."""
    algorithm = algorithm_of(job.h.version)
    same, agree = True, set()
    for i in batch:
        start, count = job.h.chunk_layers(i)
        again = await second.digest_of(start, start + count, algorithm)
        if i in bad:
            same = same and again == await first.digest_of(start, start + count, algorithm)
        if again == await checks.get(i):
            agree.add(i)
    return SAME if same else RECOVERED if agree == set(batch) else UNSTABLE


def differences(a: np.ndarray, b: np.ndarray, start: int) -> str:
    """Where two passes' mu ``(layers, 2, heads, tokens, dim)`` differ, layer by layer (layer ``start``
    first): what tells a wrong input (some tokens' rows) from a wrong computation (everywhere)."""
    out = []
    for i in range(a.shape[0]):
        ne = a[i] != b[i]
        if ne.any():
            kv, head, tok, _ = np.nonzero(ne)
            out.append(f"layer {start + i}: {int(ne.sum())} of {ne.size} scalars differ (kv {sorted(set(kv.tolist()))},"
                       f" heads {sorted(set(head.tolist()))}, {len(np.unique(tok))} tokens in {tok.min()}-{tok.max()})")
    return "; ".join(out) or "no scalar of these layers differs"


class Rechecker:
    """The encoder's second passes: which transfers get one, and what follows from it."""

    def __init__(self, runtime: "Runtime", mu_cache: "MuCache", metrics: "Metrics") -> None:
        self.rt, self.mu_cache, self.metrics = runtime, mu_cache, metrics
        self._settled: set[str] = set()  # peers a second pass found computing another mu
        self._logged: set[str] = set()  # (outcome, peer) already logged
        self._warned: set[str] = set()  # peers whose stored chunks were logged

    async def mismatched(self, job: "Job", batch: list[int], checks: "Checks") -> set[int]:
        """The chunks of ``batch`` whose mu still disagrees with the decoder's after a second pass
        where one is due (``job.fallback`` then set); logged once per peer (counted every time)."""
        assert job.mu is not None
        bad = await mismatched_chunks(job, job.mu, batch, checks)
        peer = job.header.decoder_address
        if bad and not job.rechecked and peer not in self._settled:
            bad = await self.run(job, batch, bad, checks)
        job.fallback = job.fallback or bool(bad)
        if bad and peer not in self._warned:
            self._warned.add(peer)
            start, count = job.h.chunk_layers(min(bad))
            logger.warning("decoder %s computes another mu than this encoder (predictor %s) on chunks %s: "
                           "they go stored; here %s", peer, self.rt.pin[:12], sorted(bad),
                           job.mu.describe(start, start + count))
        return bad

    def agreed(self, peer: str) -> None:
        """A transfer with ``peer`` agreed on every chunk: a later disagreement is worth a second pass again."""
        self._settled.discard(peer)

    async def run(self, job: "Job", batch: list[int], bad: set[int], checks: "Checks") -> set[int]:
        """A second pass for ``job``, whose chunks ``bad`` of ``batch`` disagree: the chunks of the batch
        that still do. ``job.mu`` becomes the second pass where it recovered."""
        assert job.mu is not None
        job.rechecked = True
        first = job.mu
        self.mu_cache.discard(first)  # NOTE: so that take() starts a new pass
        second, hit = self.mu_cache.take(self.rt, job.ids, job.fp8_attention)
        try:
            outcome = await compare(first, second, job, batch, bad, checks)
        except asyncio.CancelledError:  # NOTE: the transfer ended; its own give_back is first's (job.mu)
            self.mu_cache.give_back(second)
            raise
        except Exception as e:  # noqa: BLE001 -- the second pass's own failure: the chunks go stored
            logger.warning("a second predictor pass for %s failed: %s", job.header.request_id, e)
            outcome = ERROR
        keep, drop = (second, first) if outcome == RECOVERED else (first, second)
        if outcome in (UNSTABLE, ERROR):
            self.mu_cache.discard(second)  # NOTE: first left the cache above, before take()
        self.mu_cache.give_back(drop)  # NOTE: its pass stops at its next layer unless another transfer uses it
        job.mu = keep
        if outcome == RECOVERED:
            job.mu_hit = hit  # the predictor time this transfer reports is the second pass's
        self.metrics.mu_recheck(outcome)
        self._log(job, outcome, bad, first, second)
        return set() if outcome == RECOVERED else bad

    def _log(self, job: "Job", outcome: str, bad: set[int], first: "LayerMu", second: "LayerMu") -> None:
        peer = job.header.decoder_address
        if outcome == SAME:
            self._settled.add(peer)
        elif outcome != ERROR and f"{outcome} {peer}" not in self._logged:
            self._logged.add(f"{outcome} {peer}")
            start, count = job.h.chunk_layers(min(bad))
            logger.error("this encoder's predictor computed two different mu for one prompt (chunks %s, with decoder "
                         "%s): first %s; second %s; %s; %s", sorted(bad), peer, first.describe(start, start + count),
                         second.describe(start, start + count),
                         differences(first.bits[start:start + count], second.bits[start:start + count], start),
                         "the second agrees with the decoder: the transfer goes on coded" if outcome == RECOVERED
                         else "the chunks go stored")
