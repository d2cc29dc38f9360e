"""The sidecars as separate OS processes (``speckv serve encoder|decoder``, each loading
its own predictor), as they are deployed, on loopback:

- a real KV (BF16 and FP8) moves encoder process -> decoder process bit for bit, coded
  (encoding "speckv", no fallback: the two processes' predictors computed the same mu);
- a decoder killed with SIGKILL mid-transfer: the submit fails with UNAVAILABLE (never a
  hang, never OK), and once the decoder is restarted cold on the same port, a retry under
  the same request id delivers the KV bit for bit;
- SIGTERM with a transfer longer than ``--grace-s`` (server/app.py ``serve``): calls
  started after the signal are refused (UNAVAILABLE) while the process still drains, the
  in-flight Submit and FetchKV end with UNAVAILABLE once the grace is spent (not before),
  and the process exits (status 0) soon after, its log free of errors.

"Mid-transfer" is made certain, not timed: the engine's request stream (a ``Gate``) sends
the header and part of the layers, then waits until the decoder holds chunks of it.

Starting a sidecar process costs ~10-30 s (its predictor), so one encoder and one decoder
process serve the whole file: the kill test leaves a restarted decoder behind, the
SIGTERM test (the last) ends it, and any test finding a sidecar gone starts a new one.
Every wait is bounded; every process started here is killed at teardown.
"""
from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import numpy as np
import pytest
from server_helpers import (
    MODEL,
    WAIT,
    Gate,
    assert_same_kv,
    assert_timeline,
    kv_nbytes,
    raw_submit_future,
    rid,
    submit_list,
    wait_until,
)

from speckv.client.client import DecoderClient, EncoderClient, RpcFailed
from speckv.kv import Fp8KV, bf16_bits
from speckv.v1 import decoder_pb2 as dpb

S = dpb.TransferState
START_S = 240.0  # a cold sidecar process loads its predictor: ~10-30 s, more on a loaded 2-core machine
GRACE_S = 1.0  # --grace-s of the decoder process (the SIGTERM test needs a transfer longer than this)
EXIT_MARGIN_S = 10.0  # SIGTERM: the process exits within grace + this (interpreter and thread teardown)
TEXT = "Hello world, this is a test of the sidecars."  # ~12 tokens
GATE_AFTER = 1 + 12  # a gated submit sends the header and 12 of the 30 layers, then waits
SPECKV = Path(sys.executable).with_name("speckv")


class ServeProc:
    """One ``speckv serve ROLE`` process on loopback: its port (read from its stdout) and
    its log (stderr), killed by ``kill()``."""

    def __init__(self, role: str, logdir: Path, port: int = 0, grace_s: float = GRACE_S,
                 args: tuple[str, ...] = (), env: dict[str, str] | None = None) -> None:
        self.role = role
        cmd = [str(SPECKV)] if SPECKV.exists() else [sys.executable, "-m", "speckv.cli.main"]
        cmd += ["serve", role, "--listen", f"127.0.0.1:{port}", "--metrics-port", "-1", "--grace-s", str(grace_s),
                *args]
        # flags only, and the variables given
        env = {**{k: v for k, v in os.environ.items() if not k.startswith("SPECKV_")}, **(env or {})}
        self.logpath = logdir / f"{role}-{time.monotonic_ns()}.log"
        self.log = open(self.logpath, "w")
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=self.log, stdin=subprocess.DEVNULL,
                                     text=True, env=env)
        self.port: int | None = None
        self._ready = threading.Event()
        threading.Thread(target=self._read_stdout, daemon=True, name=f"{role}-stdout").start()

    def _read_stdout(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:  # drained to the end, so the child never blocks on a full pipe
            m = re.search(r"speckv \w+ listening on port (\d+)", line)
            if m and self.port is None:
                self.port = int(m.group(1))
                self._ready.set()
        self._ready.set()  # exited before (or after) saying where it listens

    def wait_ready(self, timeout: float = START_S) -> str:
        """The ``127.0.0.1:PORT`` address once the process listens (fails the test otherwise)."""
        if not self._ready.wait(timeout) or self.port is None:
            self.kill()
            pytest.fail(f"{self.role} process did not start within {timeout:.0f} s "
                        f"(exit {self.proc.poll()}); log:\n{self.log_tail()}")
        return self.address

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def alive(self) -> bool:
        return self.proc.poll() is None

    def log_tail(self, n: int = 4000) -> str:
        if not self.log.closed:
            self.log.flush()
        return self.logpath.read_text(errors="replace")[-n:]

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        try:
            self.proc.wait(30)
        finally:
            self.log.close()


class Processes:
    """The file's encoder and decoder processes (started at once, concurrently)."""

    def __init__(self, logdir: Path) -> None:
        self.logdir = logdir
        self.started: list[ServeProc] = []
        self.encoder = self.start("encoder")
        self.decoder = self.start("decoder")

    def start(self, role: str, port: int = 0) -> ServeProc:
        p = ServeProc(role, self.logdir, port)
        self.started.append(p)
        return p

    def live(self) -> tuple[ServeProc, ServeProc]:
        """(encoder, decoder), both listening; one found gone is started again."""
        if not self.encoder.alive():
            self.encoder = self.start("encoder")
        if not self.decoder.alive():
            self.decoder = self.start("decoder")
        self.encoder.wait_ready()
        self.decoder.wait_ready()
        return self.encoder, self.decoder

    def close(self) -> None:
        for p in self.started:
            p.kill()


@pytest.fixture(scope="module")
def processes(tmp_path_factory):
    procs = Processes(tmp_path_factory.mktemp("sidecar-logs"))
    yield procs
    procs.close()
    assert all(p.proc.poll() is not None for p in procs.started)


@pytest.fixture(scope="module")
def kvs(processes, embedded_target):
    """``{"bf16": (ids, uint16 bits), "fp8": (ids, Fp8KV)}`` of TEXT's real KV (computed
    here while the sidecar processes load their predictors)."""
    import torch

    from speckv.predictor.fp8 import kv_to_fp8

    ids = embedded_target.tokenize(TEXT)
    kv = embedded_target.kv(ids)
    q, scales = kv_to_fp8(kv)
    codes = q.view(torch.uint8).numpy() if q.dtype != torch.uint8 else q.numpy()
    fp8 = Fp8KV(np.ascontiguousarray(codes), np.asarray(scales, np.float32).reshape(-1, 2))
    return {"bf16": (ids, bf16_bits(kv).copy()), "fp8": (ids, fp8)}


@pytest.fixture
def live(processes, kvs):
    return processes.live()


def _fetch_and_submit(eaddr: str, daddr: str, r: str, kv, ids, **submit_kw):
    """Submit ``kv`` to the encoder while a FetchKV drains it from the decoder: (SubmitResult, KV)."""
    with EncoderClient(eaddr, timeout=WAIT) as enc, DecoderClient(daddr, timeout=WAIT) as dec, \
            ThreadPoolExecutor(1) as pool:
        fetched = pool.submit(dec.fetch, r, 30.0, WAIT)
        try:
            res = enc.submit(r, kv, ids, daddr, MODEL, timeout=WAIT, **submit_kw)
        except BaseException:
            try:
                dec.cancel(r, timeout=5)  # end the fetch now rather than after its wait
            except RpcFailed:
                pass
            raise
        return res, fetched.result(WAIT)


def _status(daddr: str, r: str):
    try:
        with DecoderClient(daddr, timeout=5) as d:
            return d.status(r)
    except RpcFailed:
        return None


def _mid_transfer(daddr: str, r: str) -> dpb.TransferStatus:
    """Wait until the decoder holds part of transfer ``r`` (a chunk in, not all of them)."""
    st = wait_until(lambda: (s := _status(daddr, r)) is not None and s.chunks_received >= 1 and s, WAIT,
                    interval=0.05, what=f"a chunk of {r} at the decoder")
    assert st.state == S.TRANSFER_STATE_RECEIVING and st.chunks_received < st.chunks_total, st
    return st


# -- the main path ---------------------------------------------------------------------

def _both_unavailable(fut, fetch) -> None:
    """The engine's Submit and the decode side's FetchKV both end UNAVAILABLE (retryable
    elsewhere), the Submit naming the decoder: never OK, never a hang."""
    with pytest.raises(grpc.RpcError) as e:
        fut.result(timeout=WAIT)
    assert e.value.code() == grpc.StatusCode.UNAVAILABLE, (e.value.code(), e.value.details())
    assert e.value.details().startswith("decoder: "), e.value.details()
    with pytest.raises(RpcFailed) as fe:
        fetch.result(WAIT)
    assert fe.value.code == grpc.StatusCode.UNAVAILABLE, fe.value


@pytest.mark.parametrize("dtype", ["bf16", "fp8"])
def test_two_processes_move_a_real_kv_bit_exact_and_coded(live, kvs, dtype):
    enc, dec = live
    ids, kv = kvs[dtype]
    res, got = _fetch_and_submit(enc.address, dec.address, rid(f"proc-{dtype}"), kv, ids, encoding="speckv")
    assert_same_kv(got, kv)  # np.array_equal of the uint16 BF16 patterns / FP8 codes and scale bits
    assert res.raw_bytes == kv_nbytes(kv)
    # coded, without a fallback to a stored stream: the two processes' mu digests agreed
    assert (res.encoding, res.fallback) == ("speckv", False), res
    assert res.ratio > 1, res
    assert_timeline(res)


# -- SIGKILL mid-transfer, cold restart, retry -------------------------------------------

def test_decoder_sigkilled_mid_transfer_then_restarted_cold(live, processes, kvs):
    enc, dec = live
    ids, kv = kvs["bf16"]
    r = rid("sigkill")
    gate = Gate(submit_list(r, kv, ids, dec.address), after=GATE_AFTER)
    fut, ch = raw_submit_future(enc.address, gate)
    pool = ThreadPoolExecutor(1)
    with DecoderClient(dec.address, timeout=WAIT) as dclient:
        fetch = pool.submit(dclient.fetch, r, 30.0, WAIT)  # the decode engine waits for the layers
        try:
            _mid_transfer(dec.address, r)
            dec.proc.send_signal(signal.SIGKILL)
            assert dec.proc.wait(10) == -signal.SIGKILL
            gate.open()  # the engine goes on sending; the decoder is gone
            # the encoder reports the lost decoder as UNAVAILABLE (retryable), never OK, never a hang
            _both_unavailable(fut, fetch)
        finally:
            gate.open()
            ch.close()
            pool.shutdown(wait=False, cancel_futures=True)
    new = processes.start("decoder", dec.port)  # cold: a new process, its own predictor, no state
    processes.decoder = new
    assert new.wait_ready() == dec.address and new.proc.pid != dec.proc.pid
    assert _status(new.address, r) is None  # nothing of the killed transfer survived
    # the same request id again; the encoder's channel reconnects (a first attempt may meet it
    # still backing off: UNAVAILABLE, retried)
    res, got = _fetch_and_submit(enc.address, new.address, r, kv, ids, retries=4, backoff_s=0.2)
    assert_same_kv(got, kv)
    assert (res.raw_bytes, res.encoding, res.fallback) == (kv.nbytes, "speckv", False), res


# -- SIGTERM with a transfer longer than the grace -----------------------------------------

def _refused_while_draining(dec: ServeProc, eaddr: str, ids, kv, t0: float) -> None:
    """Calls started after SIGTERM are refused (UNAVAILABLE) while the process is still
    alive, draining its in-flight transfer."""
    deadline = t0 + GRACE_S
    while True:
        try:
            with DecoderClient(dec.address, timeout=5) as d:
                d.status("no-such-transfer")
        except RpcFailed as e:
            # NOT_FOUND: the sidecar has not begun stopping yet; CANCELLED: a call racing the
            # start of the stop (connected just before the port closed, ~1 ms wide)
            if e.code == grpc.StatusCode.UNAVAILABLE:
                break
            assert e.code in (grpc.StatusCode.NOT_FOUND, grpc.StatusCode.CANCELLED), e
        assert time.monotonic() < deadline, "calls still accepted after SIGTERM"
        time.sleep(0.02)
    assert dec.alive(), "the process exited before the in-flight transfer's grace was spent"
    # a new transfer, through the encoder, is refused too
    with EncoderClient(eaddr, timeout=WAIT) as enc, pytest.raises(RpcFailed) as e:
        enc.submit(rid("after-sigterm"), kv, ids, dec.address, MODEL, timeout=WAIT)
    assert e.value.code == grpc.StatusCode.UNAVAILABLE and e.value.details.startswith("decoder: "), e.value


def test_sigterm_refuses_new_calls_and_cancels_a_transfer_past_grace(live, kvs):
    enc, dec = live
    ids, kv = kvs["bf16"]
    r = rid("sigterm")
    ended: dict[str, float] = {}
    gate = Gate(submit_list(r, kv, ids, dec.address), after=GATE_AFTER)  # never opened before the grace ends
    fut, ch = raw_submit_future(enc.address, gate)
    fut.add_done_callback(lambda _: ended.setdefault("submit", time.monotonic()))
    pool = ThreadPoolExecutor(1)
    with DecoderClient(dec.address, timeout=WAIT) as dclient:
        fetch = pool.submit(dclient.fetch, r, 30.0, WAIT)
        fetch.add_done_callback(lambda _: ended.setdefault("fetch", time.monotonic()))
        try:
            _mid_transfer(dec.address, r)
            t0 = time.monotonic()
            dec.proc.send_signal(signal.SIGTERM)
            _refused_while_draining(dec, enc.address, ids, kv, t0)
            try:
                rc = dec.proc.wait(GRACE_S + EXIT_MARGIN_S)
            except subprocess.TimeoutExpired:
                pytest.fail(f"still running {GRACE_S + EXIT_MARGIN_S:.0f} s after SIGTERM (--grace-s {GRACE_S})")
            exited = time.monotonic() - t0
            assert rc == 0, dec.log_tail()
            assert GRACE_S <= exited <= GRACE_S + EXIT_MARGIN_S
            # the in-flight calls: cancelled once the grace was spent, not before, with a precise
            # status (UNAVAILABLE: retryable elsewhere), and no data handed out as if complete
            _both_unavailable(fut, fetch)
            for call in ("submit", "fetch"):
                assert GRACE_S - 0.05 <= ended[call] - t0 <= GRACE_S + EXIT_MARGIN_S, (call, ended[call] - t0)
        finally:
            gate.open()
            ch.close()
            pool.shutdown(wait=False, cancel_futures=True)
    log = dec.log_tail(1 << 20)
    assert f"stopping: health NOT_SERVING, {GRACE_S:.1f} s grace" in log, log
    assert "Traceback" not in log and not re.search(r"^\S+Z (ERROR|CRITICAL) ", log, re.M), log
    assert re.search(r"^\S+Z INFO speckv.server.app: decoder stopping", log, re.M), log  # the pattern above bites
