"""The ``speckv`` command line.

Subcommands: ``demo`` (the main job on the embedded model), ``serve
encoder|decoder`` (a sidecar), ``entropy`` (ideal
code length of a text's KV), ``predictor build|info|check`` (pinned checkpoints),
``bench`` (coder figures against peers). Results go to stdout (a table or
``--json``); progress and logs go to stderr.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from pathlib import Path
from typing import Any, Callable, Sequence

from speckv import logs
from speckv.coder.backends import CODERS
from speckv.predictor.engines import ENGINES, SAME
from speckv.predictor.ladder import KV_ACTIVATION_BITS, KV_BITS_SPLIT

logger = logging.getLogger(__name__)
DEFAULT_LEVEL = {"serve": "info"}  # other commands: warning (their progress goes to stderr)


class _Formatter(argparse.ArgumentDefaultsHelpFormatter):
    """Shows each option's default, except where there is none to show (None, a switch) or
    the help already names it."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        text = action.help or ""
        if action.default is None or isinstance(action.default, bool) or "(default" in text:
            return text
        return super()._get_help_string(action)


class _Version(argparse.Action):
    """``--version``: the package, its stream format and the shipped predictor's pin."""

    def __init__(self, option_strings: Sequence[str], dest: str = argparse.SUPPRESS, **kw: Any) -> None:
        super().__init__(option_strings, dest, nargs=0, default=argparse.SUPPRESS, **kw)

    def __call__(self, parser: argparse.ArgumentParser, *_: Any) -> None:
        print(version_text())
        parser.exit()


def version_text() -> str:
    from speckv import __version__
    from speckv.coder import container as ct
    from speckv.predictor.store import MANIFEST, SHIPPED_RUNG, default_checkpoint_dir, sha256_file

    pin = sha256_file(default_checkpoint_dir() / MANIFEST)  # NOTE: the pin is the manifest's sha256
    return (f"speckv {__version__}\nstream format version {ct.FORMAT_VERSION}\n"
            f"shipped predictor pin {pin} ({SHIPPED_RUNG})")


def _add_log_args(p: argparse.ArgumentParser, level: str = "warning") -> None:
    """-v, --log-format, --log-level; SUPPRESS defaults: given before the subcommand or after, both count."""
    g = p.add_argument_group("logging")
    g.add_argument("-v", "--verbose", action="store_true", default=argparse.SUPPRESS,
                   help="debug logging on stderr, every library's too")
    g.add_argument("--log-format", type=str.lower, choices=logs.FORMATS, default=argparse.SUPPRESS,
                   help=f"log lines as text or JSON objects [{logs.FORMAT_ENV}] (default: text)")
    g.add_argument("--log-level", type=str.lower, choices=logs.LEVELS, default=argparse.SUPPRESS,
                   help=f"level of speckv's own log lines; other libraries log warning and up "
                        f"[{logs.LEVEL_ENV}] (default: {level})")


def _positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, not {text}")
    return value


def _add_model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--target", default="default",
                   help="'default' (embedded SmolLM2-135M-Instruct) or a local Hugging Face model directory")
    p.add_argument("--predictor", default=None, help="predictor checkpoint directory (default: the embedded one)")
    p.add_argument("--pin", default=None, help="expected sha256 pin of the predictor checkpoint")
    p.add_argument("--coder", choices=CODERS, default="auto",
                   help="per-scalar coder: numpy (the reference), native (the CPU extension), cuda (CuPy "
                        "kernels, opt-in), or auto: native, else numpy (default: %(default)s)")


def _arg_type(parse: Callable[[str], Any]) -> Callable[[str], Any]:
    """``parse`` whose ValueError argparse shows as is (not "invalid _bytes value")."""
    def typed(text: str) -> Any:
        try:
            return parse(text)
        except ValueError as e:
            raise argparse.ArgumentTypeError(str(e)) from None
    return typed


def _add_server_args(p: argparse.ArgumentParser) -> None:
    from speckv.server.config import FIELDS, default_text

    for f in FIELDS:
        default = default_text(f)
        shown = f" (default: {default})" if default is not None and "(default" not in f.help else ""
        p.add_argument(f.flag, dest=f.name, type=_arg_type(f.parse), default=None,
                       help=f"{f.help} [{f.env}]{shown}")


def _with_formatter(add_parser: Callable[..., argparse.ArgumentParser]) -> Callable[..., argparse.ArgumentParser]:
    """A subcommand's parser shows defaults and takes the logging options too."""
    def add(name: str, **kw: Any) -> argparse.ArgumentParser:
        p = add_parser(name, formatter_class=_Formatter, **kw)
        _add_log_args(p, DEFAULT_LEVEL.get(name, "warning"))
        return p
    return add


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="speckv", description="Lossless compressed KV-cache transfer.",
                                 formatter_class=_Formatter)
    ap.add_argument("--version", action=_Version, help="print the version, stream format version and the "
                    "shipped predictor's pin, and exit")
    _add_log_args(ap)
    sub = ap.add_subparsers(dest="cmd", required=True)
    sub.add_parser = _with_formatter(sub.add_parser)  # type: ignore[method-assign]

    demo = sub.add_parser("demo", help="run speckv on a built-in prompt with the embedded model")
    demo.add_argument("--json", action="store_true", help="print the summary as JSON")
    _add_model_args(demo)

    ent = sub.add_parser("entropy", help="ideal bits/scalar of a text's KV under the predictor")
    ent.add_argument("--text", required=True, help="UTF-8 text file")
    ent.add_argument("--tokens", type=_positive, default=2048, help="prompt length in tokens")
    ent.add_argument("--dtype", choices=("bf16", "fp8"), default="bf16", help="KV dtype")
    ent.add_argument("--json", action="store_true", help="print the figures as JSON")
    _add_model_args(ent)

    bench = sub.add_parser("bench", help="coder figures on a real KV, against zstd/lz4/byte-split peers")
    bench.add_argument("--text", default=None, help="text file (default: ../shared/corpus/tinyshakespeare.txt "
                       "if present, else a built-in text)")
    bench.add_argument("--tokens", type=_positive, default=2048, help="prompt length in tokens")
    bench.add_argument("--dtype", choices=("bf16", "fp8"), default="bf16", help="KV dtype")
    bench.add_argument("--engine", choices=ENGINES, default=SAME,
                       help="where the coded KV comes from: sdpa (the sidecars' own kernels) or another "
                            "engine configuration (eager attention, fp32 compute, transformers' BF16 GEMMs, 1 "
                            "thread, the AVX2 kernel path, a padded batch of two: KV differing in its last "
                            "bits, as another engine's would; fp8cache: attention reads an FP8 cache; "
                            "speckv.predictor.engines); the predictor stays as shipped")
    bench.add_argument("--fp8-toward-zero", action="store_true",
                       help="FP8 KV only: round its e4m3 codes toward zero, as vLLM's CPU cache "
                            "writer does (format 5 codes them with its rounding byte), not to nearest")
    bench.add_argument("--json", action="store_true", help="print the report as JSON")
    bench.add_argument("--no-memory", dest="memory", action="store_false",
                       help="skip the sidecars' peak-RSS probes (child processes)")
    bench.add_argument("--model", choices=("auto", "seed", "tuned"), default="auto",
                       help="residual model: seed (the published static mixture), tuned (affine mu "
                            "correction, refit sigma, escape 1e-4), auto (the best the checkpoint has)")
    bench.add_argument("--threads", type=_positive, default=None,
                       help="coder threads (default: the codec's, min(2, CPUs))")
    bench.add_argument("--timing-runs", type=_positive, default=3,
                       help="target and predictor prefills timed alternately; predictor_cost uses the medians")
    _add_model_args(bench)

    serve = sub.add_parser("serve", help="run an encoder or decoder sidecar (gRPC) until SIGTERM",
                           description="Every flag can also be set by its SPECKV_* environment variable "
                                       "(e.g. --listen / SPECKV_LISTEN); flags win.")
    serve.add_argument("role", choices=("encoder", "decoder"), help="which sidecar")
    _add_server_args(serve)

    hc = sub.add_parser("health", help="gRPC health check of a sidecar (exit 0 SERVING, 1 not, 2 error)")
    hc.add_argument("address", help="HOST:PORT (the main port, or the plaintext --health-listen port)")
    hc.add_argument("--service", default="", help="service name ('' = the whole sidecar)")
    hc.add_argument("--timeout", type=float, default=5.0, help="seconds")
    hc.add_argument("--tls-ca", default=None, help="verify the sidecar with this CA (TLS)")
    hc.add_argument("--tls-cert", default=None, help="client certificate (mTLS)")
    hc.add_argument("--tls-key", default=None, help="client key (mTLS)")

    pred = sub.add_parser("predictor", help="build or inspect a pinned predictor checkpoint")
    psub = pred.add_subparsers(dest="pcmd", required=True)
    psub.add_parser = _with_formatter(psub.add_parser)  # type: ignore[method-assign]
    build = psub.add_parser("build", help="predictor (FP8 copy by default) + calibration -> checkpoint dir")
    build.add_argument("--target", default="default",
                       help="'default' (embedded SmolLM2-135M-Instruct) or a local Hugging Face model directory")
    build.add_argument("--calib", required=True, help="calibration text file")
    build.add_argument("--out", required=True, help="output directory")
    build.add_argument("--tokens", type=_positive, default=None, help="calibration tokens (default 4096)")
    build.add_argument("--derive-weights", action="store_true",
                       help="do not write the FP8 weights; derive them from the target at load time")
    build.add_argument("--rung", default="fp8",
                       help="predictor ladder rung: fp8 (FP8 copy, default), hybrid:K (the target's first K "
                            "layers in BF16, then the FP8 copy), w8a8[:K], w8a8i[:K] and "
                            "w8a8x[:K] (int8 products after the first K layers; i: int8 attention; x: and "
                            "speckv's SiLU), portable (the target's shape in "
                            "integers only: the same mu on every CPU and GPU), portable:K (its first K "
                            "layers, then each later layer's K/V projected from layer K's input, in the "
                            "same integers) or none (per-channel "
                            "calibration means)")
    build.add_argument("--kv-activation-bits", type=int, choices=KV_ACTIVATION_BITS, default=KV_BITS_SPLIT,
                       help="w8a8 rungs: the K/V projections' activations, 14 bits as two int8 products or 8 "
                            "(one product, as checkpoints built before 2026-12-05)")
    info = psub.add_parser("info", help="verify a checkpoint and print its pin")
    info.add_argument("dir", help="checkpoint directory")
    info.add_argument("--pin", default=None, help="expected sha256 pin")
    info.add_argument("--json", action="store_true", help="print the description as JSON")
    chk = psub.add_parser("check", help="compute mu in every numeric environment here; exit 1 if they differ")
    chk.add_argument("dir", help="checkpoint directory")
    chk.add_argument("--text", required=True, help="text whose mu is compared")
    chk.add_argument("--tokens", type=_positive, default=512, help="tokens of the text")
    chk.add_argument("--target", default="default", help="the target the checkpoint was built for")
    chk.add_argument("--jobs", type=_positive, default=None,
                     help="environments run at a time (default: one per two CPUs)")
    chk.add_argument("--json", action="store_true", help="print the report as JSON")
    return ap


def _print_table(title: str, rows: Sequence[tuple[str, Any]]) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title=title)
    table.add_column("figure")
    table.add_column("value", justify="right")
    for k, v in rows:
        table.add_row(k, f"{v:.4f}" if isinstance(v, float) else str(v))
    Console().print(table)


def cmd_entropy(args: argparse.Namespace) -> int:
    from speckv.predictor.calibrate import read_text
    from speckv.predictor.session import Session

    from .progress import steps

    with steps(4, quiet=args.json) as step:
        step("loading target and predictor")
        sess = Session.open(args.target, args.predictor, args.pin)
        step("tokenizing")
        ids = sess.target.tokenize(read_text(args.text, chars=args.tokens * 32), args.tokens)
        step(f"prefill of {len(ids)} tokens (target + predictor)")
        pre = sess.prefill(ids)
        step("ideal code length")
        rep = sess.entropy(pre, args.dtype)
    if args.json:
        print(json.dumps(rep))
    else:
        _print_table(f"speckv entropy ({args.dtype})", list(rep.items()))
    return 0


def cmd_predictor(args: argparse.Namespace) -> int:
    from speckv.predictor.checkpoint import load_checkpoint

    if args.pcmd == "info":
        ck = load_checkpoint(args.dir, args.pin)
        desc = ck.describe()
        print(json.dumps(desc, indent=1) if args.json else f"pin {ck.pin}\n{json.dumps(desc, indent=1)}")
        return 0
    if args.pcmd == "check":
        from speckv.predictor.check import check

        rep = check(Path(args.dir), Path(args.text), args.tokens, args.target, jobs=args.jobs)
        if args.json:
            print(json.dumps(rep))
        else:
            rows = [(f"{e['name']} ({e.get('tokens', '-')} tokens)",
                     e.get("mu_sha256", e.get("error", f"not run: {e.get('unavailable')}")))
                    for e in rep["environments"]]
            _print_table(f"speckv predictor check ({rep['rung']})", rows + [("agree", str(rep["agree"]))])
        return 0 if rep["agree"] else 1
    from speckv.predictor.calibrate import DEFAULT_CALIB_TOKENS, build_checkpoint
    from speckv.predictor.target import DEFAULT_TARGET, load_target

    from .progress import steps

    tokens = args.tokens or DEFAULT_CALIB_TOKENS
    with steps(2) as step:
        step("loading target")
        target = load_target(args.target)
        step(f"calibrating on {tokens} tokens of {args.calib}")
        source = "embedded" if args.target == DEFAULT_TARGET else "path"
        pin = build_checkpoint(target, Path(args.calib), Path(args.out), tokens=tokens,
                               derive_weights=args.derive_weights, source=source, rung=args.rung,
                               kv_activation_bits=args.kv_activation_bits)
    print(pin)
    return 0


def cmd_demo(args: argparse.Namespace) -> int:
    from .demo import run_demo

    summary = run_demo(args.target, args.predictor, args.pin, quiet=args.json, coder=args.coder)
    if args.json:
        print(json.dumps(summary))
    else:
        rows = [(f"{k}.{k2}" if isinstance(v, dict) else k, v2)
                for k, v in summary.items() for k2, v2 in (v.items() if isinstance(v, dict) else [(k, v)])]
        _print_table("speckv demo (encoder -> decoder over gRPC on loopback)", rows)
        print("the sidecars stop when the demo ends; metrics.* were served there and "
              "metrics_scraped.* read from them before they stopped")
    return 0 if summary["lossless"] else 1


def cmd_serve(args: argparse.Namespace) -> int:
    import asyncio

    from .wait_policy import use_sidecar_policy

    use_sidecar_policy()  # NOTE: before the server's imports load torch (and libgomp)
    from speckv.server.app import serve
    from speckv.server.config import FIELDS, ServerConfig

    config = ServerConfig.from_env(args.role, **{f.name: getattr(args, f.name) for f in FIELDS})
    asyncio.run(serve(config))
    return 0


def cmd_bench(args: argparse.Namespace) -> int:
    from .bench import print_report, run_bench
    from .wait_policy import use_sidecar_policy

    use_sidecar_policy()  # the predictor runs as in a sidecar; the target's prefill is timed under the engine's

    rep = run_bench(args.text, args.tokens, args.dtype, args.target, args.predictor, args.pin, quiet=args.json,
                    coder=args.coder, model=args.model, timing_runs=args.timing_runs, threads=args.threads,
                    engine=args.engine, fp8_toward_zero=args.fp8_toward_zero, memory=args.memory)
    if args.json:
        print(json.dumps(rep))
    else:
        print_report(rep)
    return 0 if rep["lossless"] else 1


def cmd_health(args: argparse.Namespace) -> int:
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    from speckv.client.core import _channel, tls_credentials

    creds = tls_credentials(args.tls_ca, args.tls_cert, args.tls_key) if args.tls_ca else None
    with _channel(args.address, creds) as channel:
        try:
            resp = health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(service=args.service), timeout=args.timeout)
        except grpc.RpcError as e:
            print(f"speckv: health check of {args.address} failed: {e.code().name} {e.details()}", file=sys.stderr)
            return 2
    status = health_pb2.HealthCheckResponse.ServingStatus.Name(resp.status)
    print(status)
    return 0 if resp.status == health_pb2.HealthCheckResponse.SERVING else 1


COMMANDS: dict[str, Callable[[argparse.Namespace], int]] = {
    "demo": cmd_demo, "serve": cmd_serve, "health": cmd_health, "entropy": cmd_entropy,
    "predictor": cmd_predictor, "bench": cmd_bench,
}


# what `pip install speckv` (the thin client) lacks and speckv[server] brings
SERVER_EXTRA_MODULES = frozenset({"torch", "transformers", "safetensors", "gguf", "accelerate", "grpc_health",
                                  "grpc_reflection", "prometheus_client", "rich"})


def main(argv: Sequence[str] | None = None) -> int:
    from speckv.errors import SpeckvError

    args = _parser().parse_args(argv)
    try:
        fmt = logs.resolve(getattr(args, "log_format", None), logs.FORMAT_ENV, "text", logs.FORMATS)
        level = logs.resolve(getattr(args, "log_level", None), logs.LEVEL_ENV, DEFAULT_LEVEL.get(args.cmd, "warning"),
                             logs.LEVELS)
    except ValueError as e:
        print(f"speckv: error: {e}", file=sys.stderr)
        return 2
    logs.configure(fmt, level, verbose=getattr(args, "verbose", False))
    try:
        return COMMANDS[args.cmd](args)
    except ModuleNotFoundError as e:
        if (e.name or "").split(".")[0] not in SERVER_EXTRA_MODULES:
            raise
        print(f"speckv {args.cmd}: needs the server extra (no module {e.name!r}): pip install 'speckv[server]'",
              file=sys.stderr)
        return 2
    except (SpeckvError, FileNotFoundError, ValueError) as e:
        print(f"speckv: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
