"""A real vLLM prefill/decode pair through speckv (``make test-vllm``; ``make test``
leaves it out: it needs vLLM's own environment, which ``make test-vllm`` builds).

benchmarks/vllm_pair.py starts both sidecars (``speckv serve``), a single vLLM instance,
and a kv_producer and a kv_consumer running ``speckv.client.vllm.SpeckvConnector`` (vLLM's
CPU backend, the embedded SmolLM2 from local files, each engine pinned to its own core).
Run with the model's BF16 KV cache and with an FP8 e4m3 one (codes and per-layer scales);
the BF16 run goes through both sidecars' local sockets (``speckv_local_socket``: the KV
handed to the encoder and fetched from the decoder as sealed memfds; every byte counted in
both sidecars' ``speckv_local_bytes_total``), the FP8 run as bytes on gRPC.
Checked, with 256 tokens per engine step (so the longer prompts' prefills span two and
four steps: chunked prefill): greedy tokens through the pair equal the single instance's
token for token on three prompts (one, three and seven blocks; each alone, as vLLM's
CPU kernels round differently with a batch's shape); the consumer received and verified every
transfer (whole-transfer digest) and recomputed nothing; the producer's Submits all
succeeded; the encoder sidecar's counters show the bytes saved on vLLM's own KV; the
connector's counters reach vLLM's own metrics; a decode request whose transfer was never
sent fails its fetch and is recomputed by vLLM (kv_load_failure_policy: recompute), with
the same tokens.

It never skips silently: without ``SPECKV_VLLM_PYTHON`` it skips on a developer's machine
and fails where ``SPECKV_REQUIRE_VLLM`` is set (``make test-vllm`` sets both).
"""
from __future__ import annotations

import os
import warnings
from pathlib import Path

import pytest
from require import missing

pytestmark = pytest.mark.vllm
PROMPTS = 3
# speckv's ratio on vLLM's CPU-backend KV (this test, printed before the assertion: `make test-vllm
# PYTEST_ARGS=-s`, 2026-12-01, shipped w8a8i:4): BF16 2.7469; FP8 e4m3 3.0167 (w8a8:4: 2.7629 and 3.0229; format 5 with
# SubmitHeader.fp8_attention: the connector sends its layers' scales and its cache writer's rounding, so
# both predictors' attention reads K/V rounded as vLLM's does; 2.3388 with format 5's rounding byte alone,
# 2.1644 in format 4, w8a8:4). hybrid:4 gave 2.742 and 2.181 (format 4), format 3 2.27 and 1.82. The sidecars'
# predictor is calibrated on transformers' KV, and vLLM's kernels round differently; the sigma shifts absorb
# most of it. Floors 2% under the figures.
# NOTE: on a CPU with AMX, vLLM's CPU attention runs its "amx" kernel instead of "vec" (cpu_attn.py
# _get_attn_isa). There (2-core Intel Xeon, the same command) BF16 gives 2.7477; FP8 e4m3 gave 2.1573 while
# the predictors modelled only the "vec" kernel's FP32 attention, and 2.9576 (2026-12-04) since the connector
# sends Fp8Attention.amx_tiles and the predictors replay that kernel on AMX tiles (speckv/predictor/amx_fp8.py).
# With the shipped checkpoint's K/V projections on 14-bit activations (2026-12-05, the AMX Xeon): BF16 2.8182,
# FP8 3.0085; the "vec" floors stay those of the 8-bit checkpoint (no Zen 4 here to measure them again).
MIN_RATIO = {("auto", "vec"): 2.69, ("fp8_e4m3", "vec"): 2.96, ("auto", "amx"): 2.76, ("fp8_e4m3", "amx"): 2.95}


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "fp8_e4m3"])
def test_vllm_pair_matches_a_single_instance_token_for_token(load_script, tmp_path, kv_cache_dtype):
    python = os.environ.get("SPECKV_VLLM_PYTHON")
    if not python or not Path(python).exists():
        missing("VLLM", "needs vLLM's environment: SPECKV_VLLM_PYTHON (make test-vllm builds it and sets it)")
    flags = open("/proc/cpuinfo").read()  # as tests/predictor/test_int8_attention.py reads them
    if kv_cache_dtype == "fp8_e4m3" and "avx512f" not in flags and "amx_tile" not in flags:
        # NOTE: hardware, not a missing tool: vLLM's CPU worker refuses to start ("FP8 KV cache on CPU
        # requires x86 with AVX-512 or AMX."), as the CUDA-only tests need a GPU
        pytest.skip("vLLM's CPU backend keeps FP8 KV caches only on x86 CPUs with AVX-512 or AMX; this CPU "
                    "has neither (the BF16 pair runs)")
    bench = load_script("vllm_pair")
    # NOTE: the BF16 pair goes through both sidecars' local sockets (memfds both ways), the FP8 pair as bytes
    local = kv_cache_dtype == "auto"
    args = bench.parse_args(["--vllm-python", python, "--max-tokens", "16", "--chunk", "256",
                             "--kv-cache-dtype", kv_cache_dtype, *(["--local"] if local else [])])
    r = bench.measure(args, tmp_path)
    assert r["prompt_tokens"][0] < 128 < r["prompt_tokens"][1] < 3 * 128 < r["prompt_tokens"][2]
    assert r["tokens_equal"], (r["single_tokens"], r["pair_tokens"])
    assert all(len(t) == 16 for t in r["pair_tokens"])
    assert (r["received_verified"], r["fetch_failed"], r["submit_failed"]) == (PROMPTS, 0, 0)
    enc = r["encoder"]
    assert enc["transfers_ok"] == PROMPTS
    # both sidecars computed the same mu for every chunk (else those chunks went stored, and the
    # sidecars' logs say which layers disagree: each side's per-layer digests and the prompt's)
    disagree = [line for side in ("encoder", "decoder") for line in (tmp_path / f"{side}.log").read_text().splitlines()
                if "disagree" in line or "another mu" in line]
    assert enc["stored_chunks"]["mu_mismatch"] == 0, (enc, disagree)
    # NOTE: a first pass the encoder's second pass recovered (server/mu_recheck.py) is the open defect of
    # benchmarks/RESULTS.md "A first pass that computed another mu": reported (its log line kept), not failed;
    # a pass that differed again, or a decoder that disagreed after it, fails above or here
    rechecks = enc["mu_rechecks"]
    assert rechecks["same"] == rechecks["unstable"] == rechecks["error"] == 0, (rechecks, disagree)
    if rechecks["recovered"]:
        wrong = [line for line in (tmp_path / "encoder.log").read_text().splitlines() if "two different mu" in line]
        warnings.warn(f"the encoder's first pass computed another mu and a second pass recovered it: {wrong}",
                      stacklevel=1)
    # every prompt's whole KV went through the encoder: (30 layers, 2, 3 heads, tokens, 64 dims), 2 or 1 bytes each
    assert enc["raw_bytes"] == sum(r["kv_bytes"]) == sum(30 * 2 * 3 * n * 64 for n in r["prompt_tokens"]) * (
        1 if kv_cache_dtype == "fp8_e4m3" else 2)
    # every byte went through the sockets both ways (--local), or none did
    want_local = enc["raw_bytes"] if local else 0
    assert (enc["local_bytes"], r["decoder"]["local_bytes"]) == (want_local, want_local), (enc, r["decoder"])
    print(f"\nvLLM's KV ({kv_cache_dtype}): speckv ratio {enc['ratio']!r}")
    isa = "amx" if "amx_tile" in flags.split() else "vec"  # vLLM's CPU attention kernel here (BF16, block 128)
    assert enc["ratio"] >= MIN_RATIO[kv_cache_dtype, isa], enc
    # the connector's own counters, read back from vLLM's metrics (llm.get_metrics()) after each engine's job
    consumer, producer = r["connector_metrics"]["consumer"], r["connector_metrics"]["producer"]
    assert consumer["vllm:speckv_transfers_received"] == PROMPTS
    assert consumer["vllm:speckv_transfers_receive_failed"] == 0
    assert consumer["vllm:speckv_raw_bytes_received"] == enc["raw_bytes"]
    # NOTE: the producer's engine returns once its prefills ran; the last submits may still be streaming then
    assert producer["vllm:speckv_transfers_send_failed"] == 0 and producer["vllm:speckv_transfers_sent"] <= PROMPTS
    # a decode request naming a transfer never sent: the fetch fails, vLLM recomputes, the tokens are still right
    lost = r["lost_transfer"]
    assert (lost["tokens_equal"], lost["fetch_failed"]) == (True, 1), lost
    assert lost["connector_metrics"]["vllm:speckv_transfers_receive_failed"] == 1
