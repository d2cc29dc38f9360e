"""The operator's side of the ``speckv`` command, run as a process: ``--version``, the
defaults every ``--help`` shows, the logging options before or after the subcommand
(and their variables), and sizes as Kubernetes quantities or a clear refusal."""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys

import pytest

from speckv.cli.main import _parser
from speckv.server.config import FIELDS, default_text

SPECKV = [sys.executable, "-m", "speckv.cli.main"]


def run(*args: str, env: dict[str, str] | None = None, timeout: float = 120) -> subprocess.CompletedProcess:
    base = {k: v for k, v in os.environ.items() if not k.startswith("SPECKV_")}
    return subprocess.run([*SPECKV, *args], capture_output=True, text=True, timeout=timeout,
                          env={**base, **(env or {}), "COLUMNS": "200"})


def test_version():
    import speckv
    from speckv.coder import container as ct
    from speckv.predictor.checkpoint import load_checkpoint
    from speckv.predictor.store import default_checkpoint_dir

    proc = run("--version")
    assert proc.returncode == 0 and proc.stderr == "", proc.stderr
    pin = load_checkpoint(default_checkpoint_dir()).pin
    assert proc.stdout.splitlines() == [f"speckv {speckv.__version__}", f"stream format version {ct.FORMAT_VERSION}",
                                        f"shipped predictor pin {pin} (w8a8x:4)"]


def _commands(parser: argparse.ArgumentParser, prefix: tuple[str, ...] = ()):
    """(argv prefix, parser) of the top level and every subcommand."""
    yield prefix, parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield from _commands(sub, (*prefix, name))


def _expected_defaults(argv: tuple[str, ...], parser: argparse.ArgumentParser) -> dict[str, str]:
    """{option: the default its help must show}, from the parser (and ServerConfig for serve)."""
    want = {}
    for action in parser._actions:
        if not action.option_strings or action.default in (None, argparse.SUPPRESS) or \
                isinstance(action.default, bool):
            continue
        want[action.option_strings[-1]] = str(action.default)
    if argv == ("serve",):
        want.update({f.flag: default_text(f) for f in FIELDS if default_text(f) is not None})
    want["--log-level"] = "info" if argv == ("serve",) else "warning"
    want["--log-format"] = "text"
    return want


COMMANDS = [argv for argv, _ in _commands(_parser())]


@pytest.mark.parametrize("argv", COMMANDS, ids=lambda a: " ".join(a) or "speckv")
def test_help_shows_every_default(argv):
    parser = dict(_commands(_parser()))[argv]
    proc = run(*argv, "--help")
    assert proc.returncode == 0, proc.stderr
    text = re.sub(r"\s+", " ", proc.stdout)
    blocks = dict(re.findall(r"(?:^| )(--[\w-]+)(?: [A-Z_{][^ ]*)? (.*?)(?= -{1,2}[a-zA-Z][\w-]*[ ,]| [a-z]+:$|$)",
                             text))
    for option, default in _expected_defaults(argv, parser).items():
        assert f"(default: {default})" in blocks.get(option, ""), (option, default, blocks.get(option))
    assert "(default: None)" not in text and "(default: False)" not in text


def test_serve_help_sizes_as_quantities():
    text = re.sub(r"\s+", " ", run("serve", "--help").stdout)
    assert "[SPECKV_MAX_INFLIGHT_BYTES] (default: 1Gi)" in text
    assert "[SPECKV_MU_CACHE_BYTES] (default: 64Mi)" in text
    assert "[SPECKV_LISTEN] (default: 127.0.0.1:0)" in text
    assert "[SPECKV_LOG_LEVEL] (default: info)" in text


@pytest.mark.parametrize("args,env,words", [
    (("serve", "decoder", "--max-inflight-bytes", "2GB"), {},
     "speckv serve: error: argument --max-inflight-bytes: '2GB' is not a size: use bytes or a Kubernetes "
     "quantity such as 512Mi, 2Gi, 1.5Gi, 2G"),
    (("serve", "decoder", "--mu-cache-bytes", "0.1Ki"), {},
     "argument --mu-cache-bytes: '0.1Ki' is not a whole number of bytes (102.4)"),
    (("serve", "decoder", "--log-level", "loud"), {}, "argument --log-level: invalid choice: 'loud'"),
    (("serve", "decoder", "--log-format", "xml"), {}, "argument --log-format: invalid choice: 'xml'"),
    (("health", "127.0.0.1:1"), {"SPECKV_LOG_FORMAT": "yaml"},
     "speckv: error: SPECKV_LOG_FORMAT: log format must be one of text, json, not 'yaml'"),
    (("health", "127.0.0.1:1"), {"SPECKV_LOG_LEVEL": "loud"},
     "speckv: error: SPECKV_LOG_LEVEL: log level must be one of debug, info, warning, error, critical, not 'loud'"),
    (("serve", "decoder"), {"SPECKV_MAX_INFLIGHT_BYTES": "2 Gi"},
     "speckv: error: SPECKV_MAX_INFLIGHT_BYTES='2 Gi': '2 Gi' is not a size"),
])
def test_bad_values_exit_2_with_a_clear_error(args, env, words):
    proc = run(*args, env=env)
    assert proc.returncode == 2 and words in proc.stderr, proc.stderr


@pytest.mark.parametrize("argv,level,fmt,verbose", [
    (["serve", "encoder", "--log-level", "debug", "--log-format", "json"], "debug", "json", None),
    (["--log-level", "error", "serve", "encoder"], "error", None, None),
    (["-v", "health", "x:1"], None, None, True),
    (["health", "x:1", "-v", "--log-format", "JSON"], None, "json", True),
])
def test_logging_options_before_or_after_the_subcommand(argv, level, fmt, verbose):
    ns = _parser().parse_args(argv)
    assert (getattr(ns, "log_level", None), getattr(ns, "log_format", None), getattr(ns, "verbose", None)) == \
        (level, fmt, verbose)


def test_size_flags_take_quantities():
    ns = _parser().parse_args(["serve", "decoder", "--max-inflight-bytes", "2G", "--mu-cache-bytes", "1.5Gi",
                               "--message-bytes", "512Ki"])
    assert (ns.max_inflight_bytes, ns.mu_cache_bytes, ns.message_bytes) == (2 * 10**9, 3 << 29, 512 << 10)
