"""Shared values of the predictor tests."""

from __future__ import annotations

TOKENS, SEGMENT = 64, 32  # the tiny checkpoints' calibration: tokens, and tokens per segment (conftest.py)


def every_path_digest(model, ids, monkeypatch) -> dict[str, str]:
    """The portable rungs' mu digest of ``ids`` on each of their paths (the same bits, or a defect)."""
    from speckv.predictor import integer
    from speckv.predictor import target as target_mod
    from speckv.predictor.check import mu_digest
    from speckv.predictor.portable import portable_kv

    out = {"default": mu_digest(portable_kv(model, ids)),
           "int64 reference": mu_digest(portable_kv(model, ids, exact=True))}
    monkeypatch.setattr(integer, "FUSED_SCALAR", True)
    out["fused linear, scalar loops"] = mu_digest(portable_kv(model, ids))
    monkeypatch.setattr(integer, "FUSED_SCALAR", False)
    monkeypatch.setattr(integer, "FUSED", False)
    out["native stages, unfused"] = mu_digest(portable_kv(model, ids))
    monkeypatch.setattr(integer, "FUSED", True)
    monkeypatch.setattr(integer, "NATIVE", False)
    out["torch stages"] = mu_digest(portable_kv(model, ids))
    monkeypatch.setattr(integer, "NATIVE", True)
    monkeypatch.setattr(target_mod, "COMPUTE_THREADS", 1)
    out["1 thread"] = mu_digest(portable_kv(model, ids))
    return out


def w8a8_three_ways(monkeypatch, run):
    """``run()`` as it runs here (AMX where granted), with the native stages but no AMX, and in torch
    (``w8a8.NATIVE`` off): three results that must be the same bits."""
    from speckv.predictor import w8a8

    native, amx = w8a8.NATIVE, w8a8.NATIVE_AMX
    got = run()
    monkeypatch.setattr(w8a8, "NATIVE_AMX", False)
    composed = run()
    monkeypatch.setattr(w8a8, "NATIVE", False)
    ref = run()
    monkeypatch.setattr(w8a8, "NATIVE", native)  # NOTE: as they were (False where nothing is built)
    monkeypatch.setattr(w8a8, "NATIVE_AMX", amx)
    return got, composed, ref
