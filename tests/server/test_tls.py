"""TLS and mutual TLS on real sidecars (certificates made by the openssl CLI for
this test): an allowed client transfers bit-exact over encoder -> decoder mTLS;
clients without a certificate, with one from another CA, or in plaintext are
refused; the plaintext health-only port answers probes (``speckv health``)."""
from __future__ import annotations

import shutil
import subprocess
from concurrent.futures import ThreadPoolExecutor

import grpc
import numpy as np
import pytest
from require import missing

from speckv.cli.main import main
from speckv.client.client import DecoderClient, EncoderClient, RpcFailed, tls_credentials
from speckv.coder.codec import bf16_bits
from speckv.server.config import ServerConfig

MODEL = "SmolLM2-135M-Instruct"
EXT = "subjectAltName=IP:127.0.0.1,DNS:localhost\nextendedKeyUsage=serverAuth,clientAuth\n"


def _openssl(*args, cwd):
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True, timeout=60)


def _ca_and_node(d, name):
    ec = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"]
    _openssl("req", "-x509", *ec, "-keyout", f"{name}-ca.key", "-out", f"{name}-ca.crt", "-days", "2",
             "-subj", f"/CN={name}-ca", cwd=d)
    _openssl("req", *ec, "-keyout", f"{name}.key", "-out", f"{name}.csr", "-subj", f"/CN={name}", cwd=d)
    (d / "ext.cnf").write_text(EXT)
    _openssl("x509", "-req", "-in", f"{name}.csr", "-CA", f"{name}-ca.crt", "-CAkey", f"{name}-ca.key",
             "-CAcreateserial", "-out", f"{name}.crt", "-days", "2", "-extfile", "ext.cnf", cwd=d)
    return {k: str(d / f"{name}{s}") for k, s in (("ca", "-ca.crt"), ("cert", ".crt"), ("key", ".key"))}


@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    if shutil.which("openssl") is None:
        missing("OPENSSL", "openssl CLI not found")
    d = tmp_path_factory.mktemp("pki")
    good = _ca_and_node(d, "node")
    # a second identity under the same CA: the decode engine
    ec = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"]
    _openssl("req", *ec, "-keyout", "engine.key", "-out", "engine.csr", "-subj", "/CN=engine", cwd=d)
    _openssl("x509", "-req", "-in", "engine.csr", "-CA", "node-ca.crt", "-CAkey", "node-ca.key",
             "-CAcreateserial", "-out", "engine.crt", "-days", "2", "-extfile", "ext.cnf", cwd=d)
    engine = {"ca": good["ca"], "cert": str(d / "engine.crt"), "key": str(d / "engine.key")}
    return {"good": good, "rogue": _ca_and_node(d, "rogue"), "engine": engine}


@pytest.fixture(scope="module")
def mtls_pair(sidecars, pki):
    g = pki["good"]
    tls = dict(tls_cert=g["cert"], tls_key=g["key"], tls_ca=g["ca"], health_listen="127.0.0.1:0")
    dec, daddr = sidecars.start("decoder", **tls)
    enc, eaddr = sidecars.start("encoder", **tls)
    yield dec, daddr, enc, eaddr
    sidecars.stop(enc, 0.1)
    sidecars.stop(dec, 0.1)


@pytest.fixture(scope="module")
def small_kv(embedded_session):
    ids = embedded_session.target.tokenize("Mutual TLS between the sidecars.")
    return ids, embedded_session.target.kv(ids)


def test_allowed_client_transfers_bit_exact_over_mtls(mtls_pair, pki, small_kv):
    _, daddr, _, eaddr = mtls_pair
    g = pki["good"]
    creds = tls_credentials(g["ca"], g["cert"], g["key"])
    ids, kv = small_kv
    with EncoderClient(eaddr, credentials=creds) as enc, DecoderClient(daddr, credentials=creds) as dec:
        with ThreadPoolExecutor(1) as pool:
            fut = pool.submit(dec.fetch, "tls-1", 30, 60)
            res = enc.submit("tls-1", kv, ids, daddr, MODEL, timeout=60)
            back = fut.result(timeout=60)
    assert np.array_equal(back, bf16_bits(kv)) and res.raw_bytes == kv.numel() * 2


@pytest.mark.parametrize("who", ["no-cert", "rogue-cert", "plaintext"])
def test_clients_without_a_valid_certificate_are_refused(mtls_pair, pki, who):
    _, daddr, _, _ = mtls_pair
    g, r = pki["good"], pki["rogue"]
    creds = {"no-cert": tls_credentials(g["ca"]),
             "rogue-cert": tls_credentials(g["ca"], r["cert"], r["key"]),
             "plaintext": None}[who]
    with DecoderClient(daddr, credentials=creds, timeout=10) as dec:
        with pytest.raises(RpcFailed) as e:
            dec.status("anything")
    assert e.value.code == grpc.StatusCode.UNAVAILABLE  # the handshake fails; no handler runs


def test_plaintext_health_port_answers_probes(mtls_pair, capsys):
    dec, _, enc, _ = mtls_pair
    for sidecar, name in ((dec, "speckv.v1.DecoderService"), (enc, "speckv.v1.EncoderService")):
        assert sidecar.health_port
        assert main(["health", f"127.0.0.1:{sidecar.health_port}", "--service", name]) == 0
        assert capsys.readouterr().out.strip() == "SERVING"


def test_health_cli_over_mtls_and_unknown_service(mtls_pair, pki, capsys):
    _, daddr, _, _ = mtls_pair
    g = pki["good"]
    assert main(["health", daddr, "--tls-ca", g["ca"], "--tls-cert", g["cert"], "--tls-key", g["key"]]) == 0
    assert main(["health", daddr, "--timeout", "3"]) == 2  # plaintext against the mTLS port
    assert main(["health", daddr, "--service", "nope", "--tls-ca", g["ca"], "--tls-cert", g["cert"],
                 "--tls-key", g["key"]]) == 2  # NOT_FOUND for an unknown service name


def test_tls_config_validation(pki):
    g = pki["good"]
    with pytest.raises(ValueError, match="together"):
        ServerConfig(role="decoder", tls_cert=g["cert"])
    with pytest.raises(ValueError, match="mTLS"):
        ServerConfig(role="decoder", tls_ca=g["ca"])
    with pytest.raises(ValueError, match="health_listen"):
        ServerConfig(role="decoder", health_listen="8081")


def test_allow_list_per_rpc(sidecars, pki):
    g, eng = pki["good"], pki["engine"]
    dec, daddr = sidecars.start("decoder", tls_cert=g["cert"], tls_key=g["key"], tls_ca=g["ca"],
                                allow="FetchKV=engine;CancelTransfer=engine;*=node")
    try:
        node_creds = tls_credentials(g["ca"], g["cert"], g["key"])
        engine_creds = tls_credentials(eng["ca"], eng["cert"], eng["key"])
        with DecoderClient(daddr, credentials=node_creds, timeout=10) as node, \
                DecoderClient(daddr, credentials=engine_creds, timeout=10) as engine:
            with pytest.raises(RpcFailed) as e:
                node.fetch("x", wait=0.1)  # the encoder's identity may not fetch
            assert e.value.code == grpc.StatusCode.PERMISSION_DENIED and "node" in e.value.details
            with pytest.raises(RpcFailed) as e:
                engine.fetch("x", wait=0.1)  # allowed: gets as far as the lookup
            assert e.value.code == grpc.StatusCode.NOT_FOUND
            with pytest.raises(RpcFailed) as e:
                engine.status("x")  # GetTransferStatus falls under *=node
            assert e.value.code == grpc.StatusCode.PERMISSION_DENIED
            with pytest.raises(RpcFailed) as e:
                node.status("x")
            assert e.value.code == grpc.StatusCode.NOT_FOUND
    finally:
        sidecars.stop(dec, 0.1)


@pytest.mark.parametrize("spec,match", [("FetchKV", "RPC=ID"), ("Nope=a", "RPC=ID"), ("FetchKV=", "RPC=ID"),
                                        ("FetchKV=a;FetchKV=b", "twice")])
def test_allow_list_validation(pki, spec, match):
    g = pki["good"]
    with pytest.raises(ValueError, match=match):
        ServerConfig(role="decoder", tls_cert=g["cert"], tls_key=g["key"], tls_ca=g["ca"], allow=spec)
    with pytest.raises(ValueError, match="mutual TLS"):
        ServerConfig(role="decoder", allow="FetchKV=engine")
