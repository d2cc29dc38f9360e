"""Crafted malicious codec streams, one kind at a time: symbols an encoder may emit
decode bit for bit, and symbols no encoder emits (non-escapes of non-finite mu, bins
past the largest finite value, zero-bin exponents below 0) or raw sections of the
wrong size are rejected by the symbol or raw-section check each test names.

The crafting machinery (``_craft`` and the cases built on it): ``codec_errors_helpers.py``."""

from __future__ import annotations

import pytest
from codec_errors_helpers import (
    FINITE_MU,
    INF_MU,
    NAN_MU,
    NO_FINITE,
    NOT_ESCAPED,
    SHORT,
    TAMPER,
    UNARY_COUNT,
    ZERO_EXP,
    _bf16_case,
    _decodes_to,
    _fp8_case,
    _one_too_far,
    _rejected_by,
)

# NaN / Inf / overflowing inputs are the point here: numpy's warnings are noise
pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning")


# ------------------------------------------------------ legit crafted streams

LEGIT_BF16 = ([(m, "escape") for m in NAN_MU + INF_MU + FINITE_MU]
              + [(m, "centre") for m in FINITE_MU]
              + [(0x7F7F, "low_edge"), (0xFF7F, "high_edge")])


@pytest.mark.parametrize("mu_value,choice", LEGIT_BF16)
def test_crafted_legit_streams_decode(make_codec, mu_value, choice):
    """Symbols an encoder may emit (escapes, mu's own bin, bins towards zero from the
    largest finite value), raw sections that fit: the stream decodes to exactly what
    the lenient decoder says, so ``_craft``'s digests, fingerprints and crcs are right."""
    _decodes_to(_bf16_case(make_codec, mu_value, choice))


@pytest.mark.parametrize("mu_value,scale,choice", [(0.0, 1.0, "centre"), (1.0, 1.0, "centre"),
                                                   (-3.0, 0.01, "centre"), (1e6, 1e30, "centre"),
                                                   (float("nan"), 1.0, "escape"), (1e6, 1.0, "escape"),
                                                   (float("inf"), 1e-6, "escape")])
def test_crafted_legit_streams_decode_fp8(make_codec, mu_value, scale, choice):
    _decodes_to(_fp8_case(make_codec, mu_value, scale, choice))


@pytest.mark.parametrize("mu_value,choice", [(0x7F7F, "centre"), (0x7F7F, "low_edge"), (0xFF7F, "centre"),
                                             (0xFF7F, "high_edge")])
def test_crafted_streams_without_raw_bits_can_be_legit(make_codec, mu_value, choice):
    """Near the largest finite value every bin holds one value (no low bits): an empty
    raw section is then what an encoder writes, and the stream decodes."""
    case = _bf16_case(make_codec, mu_value, choice, bits=b"")
    assert case[2] is not None
    _decodes_to(case)


# ------------------------------------------- symbols no encoder emits

NON_ESCAPES = ["centre", "low_edge", "high_edge", "random"]


@pytest.mark.parametrize("choice", NON_ESCAPES)
@pytest.mark.parametrize("mu_value", NAN_MU)
def test_non_escaped_element_of_nan_mu(make_codec, mu_value, choice):
    _rejected_by(_bf16_case(make_codec, mu_value, choice), NOT_ESCAPED)


@pytest.mark.parametrize("scale,choice", [(s, c) for s in (1.0, 1e30) for c in NON_ESCAPES] + [(1e-6, "centre")])
def test_non_escaped_element_of_nan_mu_fp8(make_codec, scale, choice):
    """(At scale 1e-6 the window's edges lie past e4m3's largest value, which the
    bin check catches first: see test_bin_past_the_largest_finite_value_fp8.)"""
    _rejected_by(_fp8_case(make_codec, float("nan"), scale, choice), NOT_ESCAPED)


@pytest.mark.parametrize("mu_value,choice", [(m, c) for m in INF_MU for c in NON_ESCAPES]
                         + [(0x7F7F, "high_edge"), (0x7F7F, "random"), (0xFF7F, "low_edge"),
                            (0xFF7F, "random")])
def test_bin_past_the_largest_finite_value(make_codec, mu_value, choice):
    """+-Inf mu sits in bin +-MAX_BIN; bins beyond +-max finite hold no BF16 value."""
    _rejected_by(_bf16_case(make_codec, mu_value, choice), NO_FINITE)


@pytest.mark.parametrize("mu_value,scale,choice", [
    (1e6, 1.0, "centre"), (-1e6, 1.0, "centre"), (3.0e38, 1e30, "centre"), (1.0, 1e-6, "centre"),
    (float("inf"), 1.0, "centre"), (float("-inf"), 1e30, "centre"), (3.0e38, 1e-6, "centre"),
    (float("nan"), 1e-6, "low_edge"), (float("nan"), 1e-6, "high_edge"), (float("nan"), 1e-6, "random")])
def test_bin_past_the_largest_finite_value_fp8(make_codec, mu_value, scale, choice):
    """mu / scale beyond e4m3's 448 (or overflowing to Inf): mu's own bin holds no e4m3
    value; at scale 1e-6 sigma spans far more than e4m3's range, so for NaN mu (bin 0
    on the coarsest grid) the window's edges lie past 448 too."""
    _rejected_by(_fp8_case(make_codec, mu_value, scale, choice), NO_FINITE)


def test_zero_bin_exponent_below_zero(make_codec):
    _rejected_by(_bf16_case(make_codec, 0x0000, "centre", delta=_one_too_far), ZERO_EXP)


def test_zero_bin_exponent_below_zero_fp8(make_codec):
    """Scale 1e-6: a coarse grid, so the zero bin spans many binades and one extra
    unary bit stays within what the unary-length bound allows."""
    _rejected_by(_fp8_case(make_codec, 0.0, 1e-6, "centre", delta=_one_too_far), ZERO_EXP)


# ---------------------------------------------------- raw sections of the wrong size



@pytest.mark.parametrize("name", list(TAMPER))
def test_raw_sections_of_the_wrong_size(make_codec, name):
    mu_value, choice, tamper, check = TAMPER[name]
    _rejected_by(_bf16_case(make_codec, mu_value, choice, tamper=tamper), check)


@pytest.mark.parametrize("bits,check", [(b"", SHORT), (b"\xff" * 64, SHORT), (bytes(range(256)) * 40, SHORT)])
@pytest.mark.parametrize("mu_value", [0x7FC0, 0x3F80, 0x0000])
def test_arbitrary_raw_bytes_for_escapes(make_codec, mu_value, bits, check):
    """Every element escaped needs 16 raw bits each; a few bytes are too few."""
    _rejected_by(_bf16_case(make_codec, mu_value, "escape", bits=bits), check)


@pytest.mark.parametrize("bits,check", [(b"\xff" * 64, SHORT), (bytes(range(256)) * 40, UNARY_COUNT),
                                        ])
def test_arbitrary_raw_bytes_for_zero_bins(make_codec, bits, check):
    """mu = 0, every element in mu's own (zero) bin: 7 mantissa bits each, then unary codes."""
    _rejected_by(_bf16_case(make_codec, 0x0000, "centre", bits=bits), check)
