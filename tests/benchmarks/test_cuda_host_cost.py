"""benchmarks/cuda_host_cost.py: the host's share of CUDA coder calls, on the CPU's warp emulator.
Its figures are timings (not checked); what is: each call splits into kernels, device-array
operations and the host's rest, its launches and waits are counted as coder/cuda.py makes them,
and the KV round-trips."""
from __future__ import annotations

import numpy as np
import pytest
from require import missing

from speckv.coder import native


@pytest.fixture(scope="module")
def host_cost(load_script):
    if not native.available():
        missing("NATIVE", f"the native coder is not built ({native.IMPORT_ERROR})")
    return load_script("cuda_host_cost", "cuda_host_cost")


def test_calls_are_split_and_counted(host_cost, emu_work):
    cp = host_cost.cuda_emu.emulated_cupy(emu_work)
    cu = host_cost.CudaCoder(cp, empty_pinned=np.empty)
    rep = host_cost.case(cu, host_cost.Meter(cp), 2, 1, tokens=64)
    assert rep["decode_correct"] and rep["raw_mb"] == 2 * 2 * 3 * 64 * 64 * 2 / 1e6
    # four kernels each way; waits: the encode's counts (an event), then to_host's two (word counts, states
    # and bits, then the words, whose size is the counts' sum); a decode's
    # three copies of its figures at the end (statuses, chunk records, flags); nothing else
    assert {c: (rep[c]["launches"], rep[c]["waits"]) for c in ("encode", "encode_kept", "decode", "decode_kept")} == {
        "encode": (4, 3), "encode_kept": (4, 1), "decode": (4, 3), "decode_kept": (4, 3)}
    for c in ("encode", "encode_kept", "decode", "decode_kept"):
        assert rep[c]["host_ms"] > 0 and rep[c]["device_ops_ms"] > 0
    # mid-call: only the encode's wait for the bit counts (the rANS pass queued before it); a decode none
    assert [rep[c]["waits_mid_call"] for c in ("encode", "encode_kept", "decode", "decode_kept")] == [1, 1, 0, 0]
    assert rep["unary_words"] > 0 and rep["section_sweeps"] >= 1


def test_prompts_in_one_call_wait_as_one_prompt(host_cost, emu_work):
    """Four prompts in one call each way: one call's launches and waits, where a call a prompt makes four
    times as many; their KV round-trips."""
    cp = host_cost.cuda_emu.emulated_cupy(emu_work)
    cu = host_cost.CudaCoder(cp, empty_pinned=np.empty)
    rep = host_cost.prompts_case(cu, host_cost.Meter(cp), 1, tokens=(5, 40, 1, 17))
    assert rep["decode_correct"]
    counted = {c: (v["launches"], v["waits"]) for c, v in rep.items() if isinstance(v, dict)}
    assert counted == {"encode_kept, one call": (4, 1), "encode_kept, a call a prompt": (16, 4),
                       "decode_kept, one call": (4, 3), "decode_kept, a call a prompt": (16, 12)}
