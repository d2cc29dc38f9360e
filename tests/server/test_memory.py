"""A sidecar's memory: it derives its predictor without building the target, builds the
numpy reference's context table only when that is its coder, reads its peak from the
kernel, and the memory probe ``speckv bench`` runs decodes what it is given."""
from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys

import numpy as np
import pytest
import torch

from speckv.coder import native
from speckv.coder.codec import Codec, CodecConfig
from speckv.predictor import target as tgt
from speckv.predictor.calibrate import build_checkpoint
from speckv.predictor.checkpoint import load_checkpoint
from speckv.server import memory, memprobe
from speckv.server.config import ServerConfig
from speckv.server.runtime import Runtime


@pytest.fixture(scope="module")
def derived(tiny_target, tiny_text, tmp_path_factory):
    d = tmp_path_factory.mktemp("derived")
    build_checkpoint(tiny_target, tiny_text, d, tokens=64, segment=32, rung="w8a8:1", derive_weights=True)
    return d


def test_runtime_derives_its_predictor_without_building_the_target(derived, tiny_model_dir, monkeypatch):
    def no(*_a, **_k):
        raise AssertionError("the sidecar built the whole target")

    monkeypatch.setattr(tgt, "load_target", no)
    monkeypatch.setattr("speckv.predictor.weights.load_target", no)
    rt = Runtime.load(ServerConfig(role="decoder", predictor=str(derived), target=str(tiny_model_dir)))
    assert rt.predictor.checkpoint.derived_weights and rt.numeric_ok


@pytest.mark.parametrize("coder", ["numpy", "native"])
def test_warm_builds_the_context_table_only_for_the_reference(derived, coder):
    if coder == "native" and not native.available():
        pytest.skip("the native extension is not built (CI requires it: SPECKV_REQUIRE_NATIVE)")
    codec = Codec.from_checkpoint(load_checkpoint(derived), CodecConfig(coder=coder))
    codec.warm()
    assert bool(codec._bf16_tables) is (coder == "numpy")


PEAK_CHILD = """
import numpy as np
from speckv.server.memory import peak_rss_bytes, rss_bytes
before = rss_bytes()
block = np.ones(64 << 20, np.uint8)  # 64 MiB, touched
during = rss_bytes()
del block
print(before, during, rss_bytes(), peak_rss_bytes())
"""


def test_peak_and_current_rss_come_from_the_kernel():
    """In a fresh process (this one's heap has a history): a touched 64 MiB block shows in VmRSS
    while it lives, and in VmHWM after it is gone."""
    out = subprocess.run([sys.executable, "-c", PEAK_CHILD], capture_output=True, text=True, timeout=60, check=True)
    before, during, after, peak = map(int, out.stdout.split())
    # NOTE: the kernel's RSS counters are per-CPU and read approximately (a few hundred KiB off)
    assert during >= before + (60 << 20) and after < during - (60 << 20) and peak >= during - (1 << 20)
    assert 0 < memory.rss_bytes() <= memory.peak_rss_bytes()
    assert memory.rss_bytes(2**31 - 1) == 0 and memory.peak_rss_bytes(2**31 - 1) == 0  # no such process


ARENA_CHILD = """
import contextlib, sys
import numpy as np
from speckv.server.memory import loading_arena, rss_bytes
prime = np.ones(30 << 20, np.uint8)
del prime  # glibc's dynamic mmap threshold rises to 30 MiB: smaller blocks now come from its heap
with loading_arena() if sys.argv[1] == "arena" else contextlib.nullcontext():
    before = rss_bytes()
    blocks, kept = [], []
    for _ in range(8):  # a loader's pattern: garbage between the tensors it keeps
        blocks.append(np.ones(8 << 20, np.uint8))
        kept.append(np.ones(1 << 20, np.uint8))
    during = rss_bytes()
    del blocks
    after = rss_bytes()
print(before, during, after)
"""


def arena_child(mode: str) -> tuple[int, int, int]:
    out = subprocess.run([sys.executable, "-c", ARENA_CHILD, mode], capture_output=True, text=True, timeout=60,
                         check=True)
    before, during, after = map(int, out.stdout.split())
    assert during >= before + (68 << 20)
    return before, during, after


def test_loading_arena_gives_freed_blocks_back():
    """In fresh processes (glibc), a loader's freed blocks between kept ones: 64 MiB stay resident
    without the arena, none with it; the body's exceptions pass through."""
    if memory.glibc() is None:
        pytest.skip("not glibc: loading_arena does nothing here")
    before, _, after = arena_child("plain")
    assert after > before + (60 << 20)
    before, _, after = arena_child("arena")
    assert after < before + (16 << 20)  # the 8 MiB kept, and nothing else
    with pytest.raises(ValueError), memory.loading_arena():
        raise ValueError("passes through")


def test_runtime_floor_is_a_fresh_process_importing_the_runtime():
    floor = memory.runtime_floor_bytes()
    assert 100 << 20 < floor < 2 << 30  # torch alone is over 100 MiB


def test_memprobe_decodes_a_stream_and_reports_its_peak(derived, tiny_model_dir, tiny_target, tmp_path):
    ids = tiny_target.tokenize("Every bit the coder spends is the mismatch between model and data.")
    kv = tiny_target.kv(ids)
    rt = Runtime.load(ServerConfig(role="decoder", predictor=str(derived), target=str(tiny_model_dir)))
    records = list(rt.codec.encode(kv, ids))
    memprobe.write_records(str(tmp_path / "s.bin"), records)
    assert memprobe.read_records(str(tmp_path / "s.bin")) == [bytes(r) for r in records]
    np.save(tmp_path / "ids.npy", ids)
    want = hashlib.sha256(kv.contiguous().view(torch.int16).numpy().data).hexdigest()
    args = [sys.executable, "-m", "speckv.server.memprobe", "--ids", str(tmp_path / "ids.npy"), "--stream",
            str(tmp_path / "s.bin"), "--predictor", str(derived), "--target", str(tiny_model_dir)]
    for expect, lossless in ((want, True), ("0" * 64, False)):
        out = subprocess.run([*args, "--expect", expect], capture_output=True, text=True, timeout=300, check=True)
        r = json.loads(out.stdout.strip().splitlines()[-1])
        assert r["lossless"] is lossless and r["role"] == "decoder"
        assert 0 < r["runtime_floor_bytes"] < r["loaded_peak_bytes"] <= r["peak_bytes"]
    # the encoder's work: it codes the KV; its stream decodes here to the same bits
    np.save(tmp_path / "kv.npy", kv.contiguous().view(torch.int16).numpy().view(np.uint16))
    enc = [sys.executable, "-m", "speckv.server.memprobe", "--role", "encoder", "--ids", str(tmp_path / "ids.npy"),
           "--kv", str(tmp_path / "kv.npy"), "--out", str(tmp_path / "e.bin"), "--predictor", str(derived),
           "--target", str(tiny_model_dir)]
    r = json.loads(subprocess.run(enc, capture_output=True, text=True, timeout=300, check=True).stdout.splitlines()[-1])
    assert r["role"] == "encoder" and 0 < r["loaded_peak_bytes"] <= r["peak_bytes"]
    back = rt.codec.decode(memprobe.read_records(str(tmp_path / "e.bin")), ids)
    assert np.array_equal(back, kv.contiguous().view(torch.int16).numpy().view(np.uint16))
    bad = subprocess.run(enc[:-6], capture_output=True, text=True, timeout=300)  # no --out
    assert bad.returncode == 2 and "needs --kv and --out" in bad.stderr


ARENAS_CHILD = """
import contextlib, ctypes, sys, tempfile, threading
import numpy as np
from speckv.server.memory import loading_arena
libc = ctypes.CDLL("libc.so.6")
libc.fopen.restype = ctypes.c_void_p
with loading_arena() if sys.argv[1] == "arena" else contextlib.nullcontext():
    pass
together = threading.Barrier(4)
def work():  # four threads allocating at once, as a sidecar's predictor, coder and gRPC threads do
    block = np.ones(1 << 20, np.uint8)
    together.wait()
    del block
threads = [threading.Thread(target=work) for _ in range(4)]
for t in threads:
    t.start()
for t in threads:
    t.join()
with tempfile.NamedTemporaryFile() as f:  # glibc's own account: one <heap> element per arena
    fp = ctypes.c_void_p(libc.fopen(f.name.encode(), b"w"))
    libc.malloc_info(0, fp)
    libc.fclose(fp)
    print(open(f.name).read().count("<heap nr="))
"""


def arenas_in_child(mode: str, env: dict[str, str] | None = None) -> int:
    out = subprocess.run([sys.executable, "-c", ARENAS_CHILD, mode], capture_output=True, text=True, timeout=60,
                         check=True, env=None if env is None else {**os.environ, **env})
    return int(out.stdout)


def test_serving_threads_share_one_arena_unless_the_environment_says(monkeypatch):
    """After ``loading_arena`` (a sidecar's load), threads allocating at once share glibc's one arena
    (each kept its own, resident, before); an arena count in the environment is left as it is."""
    if memory.glibc() is None:
        pytest.skip("not glibc: loading_arena does nothing here")
    monkeypatch.delenv("MALLOC_ARENA_MAX", raising=False)
    monkeypatch.delenv("GLIBC_TUNABLES", raising=False)
    assert memory.arenas_from_environment() is False
    assert arenas_in_child("plain") >= 3
    assert arenas_in_child("arena") == memory.SERVING_ARENAS == 1
    assert arenas_in_child("arena", {"MALLOC_ARENA_MAX": "2"}) == 2
    assert arenas_in_child("arena", {"GLIBC_TUNABLES": "glibc.malloc.arena_max=3"}) == 3
    monkeypatch.setenv("GLIBC_TUNABLES", "glibc.malloc.arena_max=3")
    assert memory.arenas_from_environment() is True
