"""Fixtures of the deploy tests: the chart helm/speckv loaded by the real Helm engine
(helm_python binds Helm's Go SDK) and every values set of ``helm_helpers.CASES`` rendered
once per module; the Grafana dashboard and a fresh local sidecar pair for its live checks."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import helm_python
import pytest
from dashboard_helpers import DASHBOARD
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


@pytest.fixture(scope="module")
def dashboard() -> dict:
    return json.loads(DASHBOARD.read_text())


@pytest.fixture
def local_pair(embedded_session):
    """A fresh encoder + decoder pair (counters at 0) with metrics on ephemeral ports."""
    from speckv.server.local import LocalPair

    with LocalPair(embedded_session.predictor) as pair:
        yield pair
