"""What a test does when something it needs is missing: skip on a developer's machine,
fail in CI. ``.ci/run`` sets ``SPECKV_REQUIRE_<NAME>=1`` for everything CI provides
(the shared corpus, openssl, promtool, buf, the native coder, root with network
namespaces and tc; nvcc where the machine has a GPU), so a
missing tool there is a failure, never a silent skip."""

from __future__ import annotations

import os
from typing import NoReturn

import pytest

# NOTE: the prefix of every skip for a numeric environment other than the shipped
# checkpoint's; tests/conftest.py counts them in the terminal summary.
NUMERIC_ENV_SKIP = "numeric environment differs from the shipped checkpoint's"


def required(name: str) -> bool:
    return os.environ.get(f"SPECKV_REQUIRE_{name}", "") not in ("", "0")


def missing(name: str, reason: str) -> NoReturn:
    """Skip the test for ``reason``, or fail it when ``SPECKV_REQUIRE_<name>`` is set."""
    if required(name):
        pytest.fail(f"{reason}, but SPECKV_REQUIRE_{name} is set (.ci/run provides it)")
    pytest.skip(reason)
