"""Crafted malicious codec streams in every combination (symbol choice x mu x raw
bits, BF16 and FP8): each decodes to exactly the KV it spells or is rejected by a
symbol or raw-section check; and each named check alone rejects the stream it is
named for (with it switched off, only the later checks it also fails do).

The crafting machinery (``_craft`` and the cases built on it): ``codec_errors_helpers.py``."""

from __future__ import annotations

import functools
import re

import numpy as np
import pytest
from codec_errors_helpers import (
    CHOICES,
    FINITE_MU,
    INF_MU,
    NAN_MU,
    NO_FINITE,
    NOT_ESCAPED,
    PADDING,
    SHORT,
    TAMPER,
    UNARY_COUNT,
    UNARY_LONG,
    UNARY_TAIL,
    ZERO_EXP,
    _bf16_case,
    _decodes_to,
    _fp8_case,
    _one_escape,
    _one_too_far,
    _rejected_by,
    _set_padding_bit,
    _switched_off,
)

from speckv.errors import IntegrityError

# NaN / Inf / overflowing inputs are the point here: numpy's warnings are noise
pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning")


# ------------------------------------------------------------ every combination

SYMBOL_CHECKS = "|".join([NOT_ESCAPED, NO_FINITE, ZERO_EXP, SHORT, UNARY_LONG, PADDING, UNARY_COUNT, UNARY_TAIL])


def _decoded_or_rejected(case) -> str:
    """The stream decodes to exactly the KV its symbols and raw bits spell, or a symbol
    or raw-section check rejects it (never the checksum: its digest is right)."""
    codec, records, kv, ids, mu = case
    try:
        out = codec.decode(records, ids, mu)
    except IntegrityError as e:
        assert re.search(SYMBOL_CHECKS, str(e)), str(e)
        return str(e)
    assert kv is not None, "raw bits that do not parse were accepted"
    assert np.array_equal(out if isinstance(out, np.ndarray) else out.codes, kv)
    return "decoded"


BITS = {"fitting": None, "empty": b"", "ff64": b"\xff" * 64, "ramp": bytes(range(256)) * 40}


@pytest.mark.parametrize("bits", list(BITS))
@pytest.mark.parametrize("mu_value", INF_MU + NAN_MU[:2] + FINITE_MU)
@pytest.mark.parametrize("choice", list(CHOICES))
def test_crafted_symbols_bf16(make_codec, choice, mu_value, bits):
    """Symbols no encoder emits (non-escapes for non-finite mu, bins past the largest
    finite value, raw sections of the wrong size) are typed errors of the symbol checks;
    the rest decode to what they spell."""
    _decoded_or_rejected(_bf16_case(make_codec, mu_value, choice, bits=BITS[bits]))


@pytest.mark.parametrize("bits", ["fitting", "empty", "x55"])
@pytest.mark.parametrize("scale", [1e-6, 1.0, 1e30])
@pytest.mark.parametrize("mu_value", [1e6, -1e6, 0.0, 3.0e38, float("inf"), float("nan")])
@pytest.mark.parametrize("choice", list(CHOICES))
def test_crafted_symbols_fp8(make_codec, choice, mu_value, scale, bits):
    raw = {"fitting": None, "empty": b"", "x55": b"\x55" * 3000}[bits]
    _decoded_or_rejected(_fp8_case(make_codec, mu_value, scale, choice, bits=raw))


# ------------------------------------------- the named check alone rejects

ALONE = {  # a crafted stream, the check that rejects it, the later checks it also fails
    "nan_mu_not_escaped": (lambda mc: _bf16_case(mc, 0x7FC0, "random"), NOT_ESCAPED, ()),
    "nan_mu_not_escaped_fp8": (lambda mc: _fp8_case(mc, float("nan"), 1.0, "centre"), NOT_ESCAPED, ()),
    "inf_mu_bin": (lambda mc: _bf16_case(mc, 0x7F80, "centre"), NO_FINITE, (NOT_ESCAPED,)),
    "past_max_finite": (lambda mc: _bf16_case(mc, 0x7F7F, "high_edge"), NO_FINITE, ()),
    "past_e4m3_max": (lambda mc: _fp8_case(mc, 1e6, 1.0, "centre"), NO_FINITE, ()),
    "zero_bin_exponent": (lambda mc: _bf16_case(mc, 0x0000, "centre", delta=_one_too_far), ZERO_EXP, ()),
    "zero_bin_exponent_fp8": (lambda mc: _fp8_case(mc, 0.0, 1e-6, "centre", delta=_one_too_far), ZERO_EXP, ()),
    "padding_bit": (lambda mc: _bf16_case(mc, 0x0000, _one_escape, tamper=_set_padding_bit), PADDING, ()),
    "zero_byte_after_unary": (lambda mc: _bf16_case(mc, 0x0000, "centre", tamper=TAMPER["zero_byte_after_unary"][2]),
                              UNARY_TAIL, ()),
}


@pytest.mark.parametrize("name", list(ALONE))
def test_the_named_check_alone_rejects(make_codec, name):
    """With the named check switched off (every other check on) the same stream is
    rejected only by the later checks it also fails, and with those off too it
    decodes, to the KV its symbols and raw bits spell: nothing else, the final
    checksum included, would have caught it."""
    build, check, later = ALONE[name]
    _rejected_by(build(make_codec), check)  # numpy and native alike
    # NOTE: switching checks off patches the numpy decoder, so the rest runs on it
    case = build(functools.partial(make_codec, coder="numpy"))
    off = (check,)
    for nxt in later:
        with _switched_off(*off):
            _rejected_by(case, nxt)
        off += (nxt,)
    with _switched_off(*off):
        _decodes_to(case)
