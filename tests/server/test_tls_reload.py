"""Certificate rotation without a restart (issue 20, item 7), on real sidecars with
certificates made by the openssl CLI here: the decoder's certificate files are
replaced under it (a new certificate from a new CA, the client CA bundle switched to
the new CA) and a fresh connection gets the new certificate, read off the TLS
handshake and checked by a client that trusts only the new CA; a broken replacement
keeps the previous certificate serving (one WARNING) until good files arrive; the
encoder's channel to a decoder picks up rotated client files for new transfers."""
from __future__ import annotations

import hashlib
import logging
import os
import shutil
import socket
import ssl
import subprocess
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import numpy as np
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from require import missing

from speckv.client.client import DecoderClient, EncoderClient, tls_credentials
from speckv.coder.codec import bf16_bits
from speckv.server.tls import fingerprint

MODEL = "SmolLM2-135M-Instruct"
EXT = "subjectAltName=IP:127.0.0.1,DNS:localhost\nextendedKeyUsage=serverAuth,clientAuth\n"
EC = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"]
LOGGER = "speckv.server.tls"


def _openssl(d: Path, *args: str) -> None:
    subprocess.run(["openssl", *args], cwd=d, check=True, capture_output=True, timeout=60)


def _ca(d: Path, name: str) -> None:
    _openssl(d, "req", "-x509", *EC, "-keyout", f"{name}.key", "-out", f"{name}.crt", "-days", "2",
             "-subj", f"/CN={name}")


def _leaf(d: Path, name: str, ca: str) -> dict[str, Path]:
    _openssl(d, "req", *EC, "-keyout", f"{name}.key", "-out", f"{name}.csr", "-subj", f"/CN={name}")
    (d / "ext.cnf").write_text(EXT)
    _openssl(d, "x509", "-req", "-in", f"{name}.csr", "-CA", f"{ca}.crt", "-CAkey", f"{ca}.key",
             "-CAcreateserial", "-out", f"{name}.crt", "-days", "2", "-extfile", "ext.cnf")
    return {"cert": d / f"{name}.crt", "key": d / f"{name}.key", "ca": d / f"{ca}.crt"}


@pytest.fixture(scope="module")
def pki(tmp_path_factory) -> dict[str, dict[str, Path]]:
    """Two CAs (old, new) and leaves under each: the sidecars' and a client's."""
    if shutil.which("openssl") is None:
        missing("OPENSSL", "openssl CLI not found")
    d = tmp_path_factory.mktemp("pki")
    _ca(d, "old-ca")
    _ca(d, "new-ca")
    return {name: _leaf(d, name, ca) for name, ca in (
        ("node-old", "old-ca"), ("node-new", "new-ca"), ("client-old", "old-ca"), ("client-new", "new-ca"))}


def install(files: dict[str, Path], into: Path) -> dict[str, str]:
    """Put a certificate, key and CA into ``into`` as a kubelet Secret volume does: new
    files beside the old, then one rename each (the sidecar never sees half a file)."""
    into.mkdir(exist_ok=True)
    out = {}
    for kind in ("cert", "key", "ca"):
        tmp = into / f".{kind}.tmp"
        shutil.copyfile(files[kind], tmp)
        os.replace(tmp, into / f"tls.{kind}")
        out[kind] = str(into / f"tls.{kind}")
    return out


def served_fingerprint(addr: str, client: dict[str, Path], trust: Path) -> str:
    """SHA-256 of the certificate the server presents on a new TLS connection, verified
    against ``trust`` only (raises ssl.SSLCertVerificationError otherwise)."""
    ctx = ssl.create_default_context(cafile=str(trust))
    ctx.load_cert_chain(str(client["cert"]), str(client["key"]))
    ctx.set_alpn_protocols(["h2"])
    host, port = addr.rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=10) as raw, \
            ctx.wrap_socket(raw, server_hostname="localhost") as tls:
        der = tls.getpeercert(binary_form=True)
    assert der is not None
    return hashlib.sha256(der).hexdigest().upper()


def health(addr: str, client: dict[str, Path], trust: Path) -> int:
    """A fresh gRPC channel's health check; the status, or the gRPC code's value negated."""
    creds = tls_credentials(str(trust), str(client["cert"]), str(client["key"]))
    with grpc.secure_channel(addr, creds) as ch:
        try:
            return int(health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=5).status)
        except grpc.RpcError as e:
            return -int(e.code().value[0])


SERVING = health_pb2.HealthCheckResponse.SERVING
UNAVAILABLE = -grpc.StatusCode.UNAVAILABLE.value[0]


def test_rotated_certificate_served_to_new_connections(sidecars, pki, tmp_path, caplog):
    caplog.set_level(logging.INFO, logger=LOGGER)
    paths = install(pki["node-old"], tmp_path / "tls")
    dec, addr = sidecars.start("decoder", tls_cert=paths["cert"], tls_key=paths["key"], tls_ca=paths["ca"])
    old, new = pki["node-old"], pki["node-new"]
    try:
        assert served_fingerprint(addr, pki["client-old"], old["ca"]) == fingerprint(old["cert"].read_bytes())
        assert health(addr, pki["client-old"], old["ca"]) == SERVING
        assert health(addr, pki["client-new"], new["ca"]) == UNAVAILABLE  # not yet: other CA, both ways
        with grpc.secure_channel(addr, tls_credentials(str(old["ca"]), str(pki["client-old"]["cert"]),
                                                       str(pki["client-old"]["key"]))) as before:
            stub = health_pb2_grpc.HealthStub(before)
            assert stub.Check(health_pb2.HealthCheckRequest(), timeout=5).status == SERVING

            install(new, tmp_path / "tls")  # cert-manager renews the Secret: new CA, new leaf

            assert served_fingerprint(addr, pki["client-new"], new["ca"]) == fingerprint(new["cert"].read_bytes())
            assert health(addr, pki["client-new"], new["ca"]) == SERVING
            # the client CA bundle was rotated too: old client certificates are refused now
            assert health(addr, pki["client-old"], old["ca"]) == UNAVAILABLE
            # a connection made before the rotation lives on
            assert stub.Check(health_pb2.HealthCheckRequest(), timeout=5).status == SERVING
        loaded = [r for r in caplog.records if "new TLS certificate loaded" in r.getMessage()]
        assert len(loaded) == 1 and loaded[0].levelno == logging.INFO
        assert fingerprint(new["cert"].read_bytes()) in loaded[0].getMessage()
    finally:
        sidecars.stop(dec, 0.1)


@pytest.mark.parametrize("breakage", ["garbage", "key of another certificate", "missing key"])
def test_broken_replacement_keeps_the_old_certificate(sidecars, pki, tmp_path, caplog, breakage):
    caplog.set_level(logging.INFO, logger=LOGGER)
    d = tmp_path / "tls"
    paths = install(pki["node-old"], d)
    dec, addr = sidecars.start("decoder", tls_cert=paths["cert"], tls_key=paths["key"], tls_ca=paths["ca"])
    old, new = pki["node-old"], pki["node-new"]
    try:
        if breakage == "garbage":
            (d / "tls.cert").write_text("-----BEGIN CERTIFICATE-----\nnot base64\n-----END CERTIFICATE-----\n")
        elif breakage == "key of another certificate":
            shutil.copyfile(new["cert"], d / "tls.cert")  # the new leaf, the old key
        else:
            (d / "tls.key").unlink()
        for _ in range(3):  # every new handshake still gets the old certificate; one warning
            assert served_fingerprint(addr, pki["client-old"], old["ca"]) == fingerprint(old["cert"].read_bytes())
            assert health(addr, pki["client-old"], old["ca"]) == SERVING
        warnings = [r for r in caplog.records if r.levelno == logging.WARNING and r.name == LOGGER]
        assert len(warnings) == 1 and "keeping the previous certificate" in warnings[0].getMessage()
        assert not [r for r in caplog.records if "new TLS certificate loaded" in r.getMessage()]

        install(new, d)  # good files at last: taken at the next handshake
        assert served_fingerprint(addr, pki["client-new"], new["ca"]) == fingerprint(new["cert"].read_bytes())
    finally:
        sidecars.stop(dec, 0.1)


@pytest.fixture(scope="module")
def small_kv(embedded_session):
    ids = embedded_session.target.tokenize("Certificates rotate under a running sidecar.")
    return ids, embedded_session.target.kv(ids)


def transfer(eaddr: str, daddr: str, client: dict[str, Path], rid: str, small_kv) -> None:
    creds = tls_credentials(str(client["ca"]), str(client["cert"]), str(client["key"]))
    ids, kv = small_kv
    with EncoderClient(eaddr, credentials=creds) as enc, DecoderClient(daddr, credentials=creds) as dec:
        with ThreadPoolExecutor(1) as pool:
            fut = pool.submit(dec.fetch, rid, 30, 60)
            enc.submit(rid, kv, ids, daddr, MODEL, timeout=60)
            assert np.array_equal(fut.result(timeout=60), bf16_bits(kv))


def test_encoder_channel_follows_rotated_client_files(sidecars, pki, tmp_path, small_kv):
    """After a rotation to a new CA, a decoder restarted with only the new CA accepts the
    encoder's next transfer: the encoder dialled it with the new files, not the old ones
    its first channel was made with."""
    dpaths = install(pki["node-old"], tmp_path / "dec")
    epaths = install(pki["node-old"], tmp_path / "enc")
    dec, daddr = sidecars.start("decoder", tls_cert=dpaths["cert"], tls_key=dpaths["key"], tls_ca=dpaths["ca"])
    enc, eaddr = sidecars.start("encoder", tls_cert=epaths["cert"], tls_key=epaths["key"], tls_ca=epaths["ca"])
    try:
        transfer(eaddr, daddr, pki["client-old"], "rot-1", small_kv)
        channels = enc.service._channels
        assert len(channels) == 1 and channels.tls is not None and channels.tls.loads == 1

        install(pki["node-new"], tmp_path / "enc")
        install(pki["node-new"], tmp_path / "dec")
        sidecars.stop(dec, 0.1)  # NOTE: a new handshake is needed: the old connection would live on
        port = daddr.rsplit(":", 1)[1]
        dec, daddr2 = sidecars.start("decoder", listen=f"127.0.0.1:{port}", tls_cert=dpaths["cert"],
                                     tls_key=dpaths["key"], tls_ca=dpaths["ca"])
        assert daddr2 == daddr
        transfer(eaddr, daddr, pki["client-new"], "rot-2", small_kv)
        assert len(channels) == 1 and channels.tls.loads == 2
    finally:
        sidecars.stop(enc, 0.1)
        sidecars.stop(dec, 0.1)
