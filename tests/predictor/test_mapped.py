"""Tensors mapped from a safetensors file (``mapped.py``): the same bits as a copy; hashing one
gives ``state_digest``'s digest and leaves its pages unmapped; a row lookup returns the rows and
drops the pages again; tensors not stored as BF16 are not mapped; the shipped rung's embeddings,
derived from the target's files, are mapped (in head and model alike) and its mu is unchanged."""
from __future__ import annotations

import hashlib

import numpy as np
import pytest
import torch
from safetensors.torch import save_file

from speckv.predictor import mapped
from speckv.predictor import weights as wt
from speckv.predictor.store import state_digest

EMBED = "model.embed_tokens.weight"


def resident_kib(path) -> int:
    """Resident KiB of this process's mappings of ``path`` (smaps)."""
    lines, total = open("/proc/self/smaps").read().splitlines(), 0
    for i, line in enumerate(lines):
        if line.endswith(str(path)):
            total += next(int(x.split()[1]) for x in lines[i + 1:i + 8] if x.startswith("Rss:"))
    return total


@pytest.fixture
def table(tmp_path):
    g = torch.Generator().manual_seed(0)
    emb = torch.randn(4096, 576, generator=g).bfloat16()  # 4.5 MiB: more than one hash window
    f = tmp_path / "model.safetensors"
    save_file({EMBED: emb, "norm": torch.ones(576), "other": torch.randn(8, 8).bfloat16()}, str(f))
    return f, emb


def test_a_mapped_tensor_is_the_copy_and_hashes_as_one(table):
    f, emb = table
    t = mapped.map_tensor(f, EMBED)
    assert t is not None and mapped.is_mapped(t) and t.dtype == torch.bfloat16
    assert torch.equal(t.view(torch.int16), emb.view(torch.int16))
    assert mapped.map_tensor(f, "norm") is None  # float32: read as a copy
    assert state_digest({EMBED: t, "x": emb[:3]}) == state_digest({EMBED: emb.clone(), "x": emb[:3]})
    h = hashlib.sha256()
    assert not mapped.hash_into(h, emb) and not mapped.hash_into(h, t[1:])  # not mapped, or not whole


def test_hashing_and_lookups_leave_no_pages_resident(table):
    f, emb = table
    t = mapped.map_tensor(f, EMBED)
    t.view(torch.int16).sum()  # every page in
    assert resident_kib(f) >= 4000
    state_digest({EMBED: t})
    assert resident_kib(f) <= 8
    ids = torch.tensor([5, 4000, 5, 17])
    assert torch.equal(mapped.take_rows(t, ids).view(torch.int16), emb[ids].view(torch.int16))
    assert resident_kib(f) <= 8


def test_the_shipped_rung_maps_its_embeddings(embedded_session):
    """The sidecar path (derived from the target's files, read lazily) maps the embeddings; the mu
    of a prompt is the predictor's as loaded from the whole target (the same weights, copied)."""
    from speckv.predictor.checkpoint import load_checkpoint
    from speckv.predictor.predict import Predictor
    from speckv.predictor.store import default_checkpoint_dir

    ckpt = load_checkpoint(default_checkpoint_dir())
    pred = Predictor.from_checkpoint(ckpt, wt.derivation_source())
    model = pred.model
    assert mapped.is_mapped(model.embed) and model.head.embed.data_ptr() == model.embed.data_ptr()
    ids = np.arange(100, 400)
    want = embedded_session.predictor.mu(ids)
    assert torch.equal(pred.mu(ids).view(torch.int16), want.view(torch.int16))
