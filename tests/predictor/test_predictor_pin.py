"""Pin verification of predictor checkpoints: any flipped byte in a pinned file or in the
manifest, a wrong expected pin, a missing file or directory, a non-canonical, unknown or
incomplete manifest: each a typed CheckpointError (PinMismatchError where the pin or a
digest disagrees). The tiny Llama's checkpoints come from conftest.py; tests tamper with copies.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from speckv.errors import CheckpointError, PinMismatchError
from speckv.predictor.checkpoint import load_checkpoint
from speckv.predictor.store import (
    CALIB,
    CONFIG,
    MANIFEST,
    WEIGHTS,
    canonical_json,
    default_checkpoint_dir,
    write_manifest,
)


def flip_byte(path: Path, pos: int) -> None:
    data = bytearray(path.read_bytes())
    data[pos % len(data)] ^= 0x01
    path.write_bytes(bytes(data))


def fresh_copy(tiny_ckpts, tmp_path: Path, tag: str) -> tuple[Path, str]:
    src, pin = tiny_ckpts["weights"]
    dst = tmp_path / tag
    shutil.copytree(src, dst)
    return dst, pin


def test_flipped_byte_in_any_file_is_pin_mismatch(tiny_ckpts, tmp_path):
    """One flipped byte (first, middle, last) in every file the manifest lists."""
    names = sorted(load_checkpoint(tiny_ckpts["weights"][0]).manifest["files"])
    assert {CALIB, CONFIG, WEIGHTS} <= set(names)
    for name in names:
        for where in ("first", "middle", "last"):
            path, pin = fresh_copy(tiny_ckpts, tmp_path, f"{name}-{where}")
            size = (path / name).stat().st_size
            flip_byte(path / name, {"first": 0, "middle": size // 2, "last": size - 1}[where])
            with pytest.raises(PinMismatchError) as ei:
                load_checkpoint(path)
            assert type(ei.value) is PinMismatchError and name in str(ei.value), (name, where)
            with pytest.raises(PinMismatchError):
                load_checkpoint(path, pin=pin)


@settings(max_examples=40, deadline=None, database=None)
@given(pos=st.integers(0, 10**6))
def test_flipped_byte_in_manifest_is_pin_mismatch(tiny_ckpts, tmp_path_factory, pos):
    src, pin = tiny_ckpts["weights"]
    path = tmp_path_factory.mktemp("m") / "ckpt"
    shutil.copytree(src, path)
    flip_byte(path / MANIFEST, pos)
    with pytest.raises(PinMismatchError) as ei:
        load_checkpoint(path, pin=pin)
    assert type(ei.value) is PinMismatchError


def test_flipped_manifest_without_expected_pin(ckpt_copy):
    path, pin = ckpt_copy
    raw = (path / MANIFEST).read_bytes()
    # breaking the JSON: a typed checkpoint error (the class observed is PinMismatchError)
    flip_byte(path / MANIFEST, 0)  # '{' -> 'z'
    with pytest.raises(CheckpointError) as ei:
        load_checkpoint(path)
    assert issubclass(type(ei.value), CheckpointError)
    assert type(ei.value) is PinMismatchError
    # a digest of a listed file: the file no longer matches
    (path / MANIFEST).write_bytes(raw)
    digest = load_checkpoint(path).manifest["files"][CALIB]
    flip_byte(path / MANIFEST, raw.index(digest.encode()) + 5)
    with pytest.raises(PinMismatchError):
        load_checkpoint(path)
    # a free-text field: still valid and canonical, so only the pin tells
    (path / MANIFEST).write_bytes(raw.replace(b'"fp8-copy"', b'"fp8-copx"'))
    assert load_checkpoint(path).pin != pin
    with pytest.raises(PinMismatchError):
        load_checkpoint(path, pin=pin)


def test_wrong_expected_pin(tiny_ckpts):
    path, pin = tiny_ckpts["weights"]
    other = tiny_ckpts["derived"][1]
    for wrong in (other, "0" * 64, pin[:-1] + ("0" if pin[-1] != "0" else "1"), "", "not-a-pin"):
        with pytest.raises(PinMismatchError):
            load_checkpoint(path, pin=wrong)


def test_missing_file_is_checkpoint_error(tiny_ckpts, tmp_path):
    names = sorted(load_checkpoint(tiny_ckpts["weights"][0]).manifest["files"]) + [MANIFEST]
    for name in names:
        path, _ = fresh_copy(tiny_ckpts, tmp_path, name)
        (path / name).unlink()
        with pytest.raises(CheckpointError) as ei:
            load_checkpoint(path)
        assert type(ei.value) is CheckpointError, name


def test_missing_dir_is_checkpoint_error(tmp_path):
    with pytest.raises(CheckpointError):
        load_checkpoint(tmp_path / "nope")


def test_non_canonical_or_unknown_manifest(ckpt_copy):
    path, _ = ckpt_copy
    manifest = json.loads((path / MANIFEST).read_bytes())
    (path / MANIFEST).write_text(json.dumps(manifest, indent=2))
    with pytest.raises(PinMismatchError, match="canonical"):
        load_checkpoint(path)
    write_manifest(path, {**manifest, "format_version": 99})
    with pytest.raises(CheckpointError, match="unsupported format") as ei:
        load_checkpoint(path)
    assert type(ei.value) is CheckpointError


@pytest.mark.parametrize("drop", ["calib.npz", "tables.npz", "config.json"])
def test_manifest_must_list_every_checkpoint_file(tmp_path, drop):
    """Re-signing a manifest that no longer covers a file must not pass verification."""
    d = tmp_path / "ck"
    shutil.copytree(default_checkpoint_dir(), d)
    manifest = json.loads((d / MANIFEST).read_bytes())
    del manifest["files"][drop]
    (d / MANIFEST).write_bytes(canonical_json(manifest))
    with pytest.raises(PinMismatchError, match="must list"):
        load_checkpoint(d)
