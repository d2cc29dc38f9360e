"""The gRPC API definitions (proto/speckv/v1/*.proto) and their committed stubs.

- the committed stubs under proto/gen are exactly what proto/generate.py writes;
- every message kind can be built, serialised and parsed; the services have the
  designed methods and work over a real in-process gRPC channel;
- every message, field, enum, enum value, oneof, service and rpc has a comment;
- ``buf lint`` (STANDARD + COMMENTS, proto/buf.yaml) and ``buf format`` pass when the ``buf``
  executable (PyPI ``buf-bin``) is installed in the venv.
"""

from __future__ import annotations

import filecmp
import importlib
import importlib.util
import shutil
import subprocess
import sys
from concurrent import futures
from pathlib import Path

import pytest
from require import missing

REPO_ROOT = Path(__file__).resolve().parents[1]
PROTO_ROOT = REPO_ROOT / "proto"
GEN_ROOT = PROTO_ROOT / "gen"
GEN_PKG = GEN_ROOT / "speckv" / "v1"
GENERATE = PROTO_ROOT / "generate.py"
BUF = Path(sys.executable).parent / "buf"
REGENERATE_HINT = "run `.venv/bin/python proto/generate.py` and commit proto/gen"


def _load_generate():
    spec = importlib.util.spec_from_file_location("_speckv_proto_generate", GENERATE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def pb():
    """The generated modules, as installed: pyproject maps ``speckv.v1`` onto proto/gen/speckv/v1."""
    mods = {}
    for name in ("common_pb2", "decoder_pb2", "decoder_pb2_grpc", "encoder_pb2", "encoder_pb2_grpc"):
        mods[name] = importlib.import_module(f"speckv.v1.{name}")
    return mods


def test_committed_stubs_are_up_to_date(tmp_path):
    gen = _load_generate()
    installed = gen.grpcio_tools_version()
    if installed != gen.GRPCIO_TOOLS_VERSION:
        missing("BUF", f"grpcio-tools {installed} installed, stubs are generated with {gen.GRPCIO_TOOLS_VERSION}")
    subprocess.run([sys.executable, str(GENERATE), "--out", str(tmp_path)], check=True,
                   capture_output=True, text=True)
    fresh = tmp_path / "speckv" / "v1"
    fresh_files = sorted(p.name for p in fresh.iterdir() if p.is_file())
    committed_files = sorted(p.name for p in GEN_PKG.iterdir() if p.is_file() and p.suffix in (".py", ".pyi"))
    assert committed_files == fresh_files, f"proto/gen has other files than generated: {REGENERATE_HINT}"
    for name in fresh_files:
        assert filecmp.cmp(fresh / name, GEN_PKG / name, shallow=False), (
            f"proto/gen/speckv/v1/{name} is stale: {REGENERATE_HINT}")
    assert not (tmp_path / "speckv" / "__init__.py").exists()  # never shadows the project's speckv


def _shape(c):
    return c.KVShape(layers=2, kv=2, kv_heads=3, tokens=4, head_dim=64)


def _layer(c, layer=0, part=0, parts=1):
    return c.KVLayer(layer=layer, dtype=c.DTYPE_FP8_E4M3, shape=_shape(c), part_index=part, part_count=parts,
                     byte_offset=0, layer_bytes=2 * 3 * 4 * 64, data=b"\x01" * (2 * 3 * 4 * 64),
                     fp8_scales=[0.5, 0.25])


def _roundtrip(msg):
    again = type(msg).FromString(msg.SerializeToString())
    assert again == msg
    return again


def test_every_message_kind_builds(pb):
    c, d, e = pb["common_pb2"], pb["decoder_pb2"], pb["encoder_pb2"]
    assert c.DESCRIPTOR.package == "speckv.v1"
    assert c.DTYPE_UNSPECIFIED == 0 and c.STATUS_CODE_UNSPECIFIED == 0 and d.TRANSFER_STATE_UNSPECIFIED == 0
    header = d.TransferHeader(request_id="r1", predictor_pin=bytes(32), model_id="smollm2", dtype=c.DTYPE_BF16,
                              shape=_shape(c), prompt_token_ids=[1, 2, 2**40], header_record=b"SPKV" + bytes(106))
    for req in (d.TransferRequest(header=header), d.TransferRequest(chunk=d.Chunk(index=3, record=b"SPKC"))):
        assert _roundtrip(req).WhichOneof("kind") in ("header", "chunk")
    assert _roundtrip(d.TransferRequest(header=header)).header.prompt_token_ids == [1, 2, 2**40]
    ok = c.Status(code=c.STATUS_CODE_OK)
    assert _roundtrip(d.TransferResponse(chunk_ack=d.ChunkAck(index=0, bytes_received=2**33))).WhichOneof(
        "kind") == "chunk_ack"
    result = d.TransferResult(status=ok, raw_bytes=10, wire_bytes=4, chunks=1, predictor_seconds=0.1,
                              decode_seconds=0.2, total_seconds=0.3)
    assert _roundtrip(d.TransferResponse(result=result)).WhichOneof("kind") == "result"
    _roundtrip(d.FetchKVRequest(request_id="r1", wait_timeout_ms=5000))
    fetched = _roundtrip(d.FetchKVResponse(layer=_layer(c)))
    assert list(fetched.layer.fp8_scales) == [0.5, 0.25]  # fp32 values survive exactly
    status = d.TransferStatus(request_id="r1", state=d.TRANSFER_STATE_READY, status=ok, chunks_received=2,
                              chunks_total=2, chunks_decoded=2, wire_bytes=4, raw_bytes=10)
    _roundtrip(d.GetTransferStatusRequest(request_id="r1"))
    _roundtrip(d.GetTransferStatusResponse(status=status))
    _roundtrip(d.CancelTransferRequest(request_id="r1"))
    _roundtrip(d.CancelTransferResponse(status=status))
    sub_header = e.SubmitHeader(request_id="r1", decoder_address="decoder:50051", model_id="smollm2",
                                dtype=c.DTYPE_FP8_E4M3, shape=_shape(c), prompt_token_ids=[1, 2],
                                fp8_scales=[1.0] * 4, expected_predictor_pin=bytes(32))
    assert _roundtrip(e.SubmitRequest(header=sub_header)).WhichOneof("kind") == "header"
    assert _roundtrip(e.SubmitRequest(layer=_layer(c, 1, 0, 2))).WhichOneof("kind") == "layer"
    _roundtrip(e.SubmitResponse(status=ok, raw_bytes=10, wire_bytes=4, chunks=1, predictor_seconds=0.1,
                                encode_seconds=0.2, transfer_seconds=0.3, total_seconds=0.6))


def test_services_have_the_designed_methods(pb):
    d, e = pb["decoder_pb2"], pb["encoder_pb2"]
    methods = {m.name: (m.client_streaming, m.server_streaming, m.input_type.name, m.output_type.name)
               for m in d.DESCRIPTOR.services_by_name["DecoderService"].methods}
    assert methods == {
        "Transfer": (True, True, "TransferRequest", "TransferResponse"),
        "FetchKV": (False, True, "FetchKVRequest", "FetchKVResponse"),
        "GetTransferStatus": (False, False, "GetTransferStatusRequest", "GetTransferStatusResponse"),
        "CancelTransfer": (False, False, "CancelTransferRequest", "CancelTransferResponse"),
    }
    methods = {m.name: (m.client_streaming, m.server_streaming, m.input_type.name, m.output_type.name)
               for m in e.DESCRIPTOR.services_by_name["EncoderService"].methods}
    assert methods == {"Submit": (True, False, "SubmitRequest", "SubmitResponse")}


def test_stubs_work_over_a_real_channel(pb):
    grpc = pytest.importorskip("grpc")
    c, d, dg = pb["common_pb2"], pb["decoder_pb2"], pb["decoder_pb2_grpc"]

    class Decoder(dg.DecoderServiceServicer):
        def Transfer(self, request_iterator, context):
            received = 0
            for req in request_iterator:
                if req.WhichOneof("kind") == "header":
                    received += len(req.header.header_record)
                else:
                    received += len(req.chunk.record)
                    yield d.TransferResponse(chunk_ack=d.ChunkAck(index=req.chunk.index, bytes_received=received))
            yield d.TransferResponse(result=d.TransferResult(status=c.Status(code=c.STATUS_CODE_OK),
                                                             wire_bytes=received))

        def GetTransferStatus(self, request, context):
            context.abort(grpc.StatusCode.NOT_FOUND, f"unknown request id {request.request_id!r}")

    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    dg.add_DecoderServiceServicer_to_server(Decoder(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    if port == 0:
        pytest.skip("cannot bind a localhost port")
    server.start()
    try:
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            stub = dg.DecoderServiceStub(channel)
            msgs = [d.TransferRequest(header=d.TransferHeader(request_id="r", header_record=bytes(110)))]
            msgs += [d.TransferRequest(chunk=d.Chunk(index=i, record=bytes(100))) for i in range(3)]
            replies = list(stub.Transfer(iter(msgs), timeout=10))
            assert [r.chunk_ack.index for r in replies[:-1]] == [0, 1, 2]
            assert replies[-1].result.status.code == c.STATUS_CODE_OK and replies[-1].result.wire_bytes == 410
            with pytest.raises(grpc.RpcError) as err:
                stub.GetTransferStatus(d.GetTransferStatusRequest(request_id="nope"), timeout=10)
            assert err.value.code() == grpc.StatusCode.NOT_FOUND
            with pytest.raises(grpc.RpcError) as err:  # unimplemented methods answer UNIMPLEMENTED
                stub.CancelTransfer(d.CancelTransferRequest(request_id="r"), timeout=10)
            assert err.value.code() == grpc.StatusCode.UNIMPLEMENTED
    finally:
        server.stop(None)


def _source_info(tmp_path):
    """FileDescriptorSet of the .proto files with comments (protoc --include_source_info)."""
    from google.protobuf import descriptor_pb2

    out = tmp_path / "api.binpb"
    files = sorted(p.relative_to(PROTO_ROOT).as_posix() for p in (PROTO_ROOT / "speckv" / "v1").glob("*.proto"))
    subprocess.run([sys.executable, "-m", "grpc_tools.protoc", "-I.", "--include_source_info",
                    f"--descriptor_set_out={out}", *files], cwd=PROTO_ROOT, check=True)
    return descriptor_pb2.FileDescriptorSet.FromString(out.read_bytes())


def test_everything_is_documented(tmp_path):
    """Every message, field, oneof, enum, enum value, service and rpc has a leading comment."""
    fds = _source_info(tmp_path)
    missing = []
    for f in fds.file:
        comments = {tuple(loc.path): loc.leading_comments.strip() for loc in f.source_code_info.location}

        def need(path, what, comments=comments, f=f):
            if not comments.get(tuple(path)):
                missing.append(f"{f.name}: {what}")

        def message(msg, path, prefix):
            need(path, f"message {prefix}{msg.name}")
            for i, field in enumerate(msg.field):
                need(path + [2, i], f"field {prefix}{msg.name}.{field.name}")
            for i, oneof in enumerate(msg.oneof_decl):
                need(path + [8, i], f"oneof {prefix}{msg.name}.{oneof.name}")
            for i, nested in enumerate(msg.nested_type):
                message(nested, path + [3, i], f"{prefix}{msg.name}.")
            for i, enum in enumerate(msg.enum_type):
                enum_(enum, path + [4, i], f"{prefix}{msg.name}.")

        def enum_(enum, path, prefix):
            need(path, f"enum {prefix}{enum.name}")
            assert enum.value[0].number == 0 and enum.value[0].name.endswith("_UNSPECIFIED"), enum.name
            for i, value in enumerate(enum.value):
                need(path + [2, i], f"enum value {value.name}")

        assert f.package == "speckv.v1" and f.syntax == "proto3", f.name
        for i, msg in enumerate(f.message_type):
            message(msg, [4, i], "")
        for i, enum in enumerate(f.enum_type):
            enum_(enum, [5, i], "")
        for i, svc in enumerate(f.service):
            need([6, i], f"service {svc.name}")
            for j, method in enumerate(svc.method):
                need([6, i, 2, j], f"rpc {svc.name}.{method.name}")
    assert not missing, "undocumented:\n" + "\n".join(missing)


def test_buf_lint():
    if not BUF.is_file():
        missing("BUF", f"buf not installed at {BUF} (pip install buf-bin)")
    res = subprocess.run([str(BUF), "lint"], cwd=PROTO_ROOT, capture_output=True, text=True, timeout=60)
    assert res.returncode == 0, f"buf lint failed:\n{res.stdout}{res.stderr}"


def test_buf_format():
    if not BUF.is_file():
        missing("BUF", f"buf not installed at {BUF} (pip install buf-bin)")
    res = subprocess.run([str(BUF), "format", "--diff", "--exit-code"], cwd=PROTO_ROOT, capture_output=True,
                         text=True, timeout=60)
    assert res.returncode == 0, f"run `buf format -w` in proto/:\n{res.stdout}{res.stderr}"


RELEASED = PROTO_ROOT / "v1-released.binpb"  # buf image of speckv.v1 as released (e54560b)


def _breaking(root: Path) -> subprocess.CompletedProcess:
    return subprocess.run([str(BUF), "breaking", "--against", str(RELEASED)], cwd=root, capture_output=True,
                          text=True, timeout=120)


def test_buf_breaking_against_the_released_v1():
    """Changes to speckv.v1 are additive: `buf breaking` against the released image passes."""
    if not BUF.is_file():
        missing("BUF", f"buf not installed at {BUF} (pip install buf-bin)")
    res = _breaking(PROTO_ROOT)
    assert res.returncode == 0, f"buf breaking:\n{res.stdout}{res.stderr}"


def test_buf_breaking_can_fail(tmp_path):
    """A renumbered field, planted in a copy of the protos, is reported."""
    if not BUF.is_file():
        missing("BUF", f"buf not installed at {BUF} (pip install buf-bin)")
    root = tmp_path / "proto"
    shutil.copytree(PROTO_ROOT, root, ignore=shutil.ignore_patterns("gen", "*.binpb"))
    common = root / "speckv" / "v1" / "common.proto"
    text = common.read_text()
    assert "  string message = 2;\n" in text
    common.write_text(text.replace("  string message = 2;\n", "  string message = 20;\n", 1))
    res = _breaking(root)
    assert res.returncode != 0 and "message" in res.stdout + res.stderr, res.stdout + res.stderr
