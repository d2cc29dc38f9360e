"""Fixtures of the Helm chart tests: the chart helm/speckv loaded by the real Helm engine
(helm_python binds Helm's Go SDK) and every values set of ``helm_helpers.CASES`` rendered
once per module."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import helm_python
import pytest
from helm_helpers import CASES, CHART_DIR, objects, render


@pytest.fixture(scope="module")
def chart() -> Iterator[helm_python.Chart]:
    c = helm_python.Chart.load(CHART_DIR)
    yield c
    c.close()


@pytest.fixture(scope="module")
def rendered(chart: helm_python.Chart) -> dict[str, tuple[dict[str, Any], list[dict[str, Any]], dict[str, str]]]:
    """case -> (merged values, objects, manifests); every case rendered once."""
    out = {}
    for name, values in CASES.items():
        manifests = render(chart, values)
        out[name] = (chart.merge_values(values), objects(manifests), manifests)
    return out
