"""benchmarks/loopback_profile.py's bookkeeping, without running a transfer: perf symbols
fall into the right function groups, and the report sums and prints what it measured."""
from __future__ import annotations

import os

import pytest


@pytest.fixture(scope="module")
def lp(load_script):
    return load_script("loopback_profile")


@pytest.mark.parametrize("key,group", [
    ("_blake2.cpython-311-x86_64-linux-gnu.so PyBlake2_blake2b_compress.isra.0", "hashing"),
    ("_xxhash.cpython-311-x86_64-linux-gnu.so XXH3_update_avx512", "hashing"),
    ("libz.so.1.2.13 crc32_z", "crc"),
    ("libc.so.6 __memmove_avx512_unaligned_erms", "copies"),
    ("[kernel.kallsyms] clear_page_erms", "copies"),
    ("[kernel.kallsyms] _copy_from_iter", "kernel net"),
    ("cygrpc.cpython-311-x86_64-linux-gnu.so 0x00000000005664f8", "grpc"),
    ("_native.cpython-311-x86_64-linux-gnu.so spk::decode_blocks_rans<...>", "coding"),
    ("libpython3.11.so.1.0 _PyEval_EvalFrameDefault", "python"),
    ("[kernel.kallsyms] finish_task_switch.isra.0", "kernel other"),
])
def test_groups(lp, key, group):
    import re

    assert next(g for g, pat in lp.GROUPS if re.search(pat, key)) == group


def test_summary_and_table(lp):
    run = {"cpu": {"encoder": 0.1, "decoder": 0.2, "submit": 0.05, "fetch": 0.05}, "wall_s": 0.5,
           "raw": 50_000_000, "wire": 50_000_100, "ok": True, "predictor_s": 0.0, "encode_s": 0.01,
           "stored_chunks": 0}
    s = lp.summarize([run, {**run, "wall_s": 0.3}, {**run, "wall_s": 0.4}])
    assert s["lossless"] and s["wall_s"] == 0.4 and s["raw_MB_per_cpu_s"]["decoder"] == pytest.approx(250)
    rep = {"tokens": 8, "pinned": False, "load_before": 0.0, "load_after": 0.0, "stored": s,
           "speckv_warm": {**s, "perf_groups_cpu_s": {"decoder": {"coding": 0.15, "crc": 0.0001}}}}
    text = lp.table(rep)
    assert "stored | 0.100 (500)" in text and "perf speckv_warm decoder: coding 0.150" in text
    assert "crc" not in text  # under a millisecond: left out


def test_cpu_seconds_of_this_process(lp):
    t0 = lp.cpu_seconds(os.getpid())
    x = 0
    for i in range(3_000_000):
        x += i
    assert lp.cpu_seconds(os.getpid()) >= t0
