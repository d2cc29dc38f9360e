"""Backend selection (``speckv.coder.backends``): the native coder when it is built,
numpy on request, unknown names rejected, a missing extension falling back to numpy
with one warning (or an error under SPECKV_REQUIRE_NATIVE), and ``--coder cuda``
without a device falling back to the native coder.
"""

from __future__ import annotations

import logging

import numpy as np
import pytest
from codec_helpers import ids_for
from native_helpers import need_native, realistic_pair

from speckv.coder import backends, native
from speckv.coder.codec import Codec, CodecConfig
from speckv.coder.native import NativeCoder, NativeUnavailable

# NaN / Inf / overflowing inputs are the point here: numpy's warnings are noise
pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning")


# ------------------------------------------------------------ selection


def test_select_native_when_built():
    need_native()
    b = backends.select_backend("native", 2)
    assert isinstance(b, NativeCoder) and b.threads == 2 and b.name == "native"
    assert backends.backend_name(b) == "native"
    assert backends.select_backend("numpy", 1) is None
    assert backends.backend_name(None) == "numpy"


def test_select_numpy_and_unknown():
    assert backends.select_backend("numpy", 1) is None
    assert backends.select_backend("numpy", 7) is None
    for bad in ("", "NATIVE", "gpu", "c++", None):
        with pytest.raises(ValueError, match="coder must be one of"):
            backends.select_backend(bad, 1)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="coder must be one of"):
        CodecConfig(coder="native2")
    assert CodecConfig().coder == "auto"
    assert backends.CODERS == ("auto", "native", "numpy", "cuda")


def test_missing_extension_falls_back_with_one_warning(monkeypatch, caplog):
    monkeypatch.setattr(native, "_native", None)
    monkeypatch.setattr(native, "IMPORT_ERROR", "No module named 'speckv.coder._native'")
    monkeypatch.setattr(backends, "_warned", set())
    monkeypatch.delenv("SPECKV_REQUIRE_NATIVE", raising=False)
    monkeypatch.setattr(backends, "cuda_available", lambda: False)
    assert not native.available()
    with caplog.at_level(logging.WARNING, logger=backends.__name__):
        assert backends.select_backend("native", 1) is None
        assert backends.select_backend("native", 2) is None  # warned once, not per call
        assert backends.select_backend("auto", 1) is None
    warnings = [r for r in caplog.records if r.name == backends.__name__ and r.levelno == logging.WARNING]
    assert len(warnings) == 1, [r.getMessage() for r in warnings]
    assert "native coder was not built" in warnings[0].getMessage()
    assert "No module named" in warnings[0].getMessage()
    with pytest.raises(NativeUnavailable):
        NativeCoder(1)
    with pytest.raises(NativeUnavailable):
        native.constants()


def test_missing_extension_codec_is_numpy(monkeypatch, ckpt):
    """A codec asked for the native coder without the extension encodes with numpy."""
    monkeypatch.setattr(native, "_native", None)
    monkeypatch.setattr(backends, "_warned", {"native"})  # no log line needed here
    monkeypatch.delenv("SPECKV_REQUIRE_NATIVE", raising=False)
    codec = Codec.from_checkpoint(ckpt, CodecConfig(coder="native", elems_per_lane=7, layers_per_chunk=4))
    assert codec.backend is None
    x, mu = realistic_pair(1, 1)
    out = codec.decode(list(codec.encode(x, ids_for(1), mu)), ids_for(1), mu)
    assert np.array_equal(out, x)


@pytest.mark.parametrize("coder", ["native", "auto"])
def test_required_extension_missing_is_an_error(monkeypatch, coder):
    monkeypatch.setattr(native, "_native", None)
    monkeypatch.setattr(backends, "cuda_available", lambda: False)
    monkeypatch.setattr(backends, "_warned", set())
    monkeypatch.setenv("SPECKV_REQUIRE_NATIVE", "1")
    with pytest.raises(NativeUnavailable, match="SPECKV_REQUIRE_NATIVE"):
        backends.select_backend(coder, 1)
    assert backends.select_backend("numpy", 1) is None  # the reference is always there


def test_cuda_without_a_device_falls_back_to_native(monkeypatch, caplog):
    need_native()
    monkeypatch.setattr(backends, "cuda_available", lambda: False)
    monkeypatch.setattr(backends, "_warned", set())
    with caplog.at_level(logging.WARNING, logger=backends.__name__):
        b = backends.select_backend("cuda", 3)
        backends.select_backend("cuda", 3)
    assert isinstance(b, NativeCoder) and b.threads == 3
    msgs = [r.getMessage() for r in caplog.records if r.name == backends.__name__]
    assert len(msgs) == 1 and "--coder cuda" in msgs[0]
    auto = backends.select_backend("auto", 2)  # no device: the native coder, silently
    assert isinstance(auto, NativeCoder) and auto.threads == 2
    assert len([r for r in caplog.records if r.name == backends.__name__]) == 1
