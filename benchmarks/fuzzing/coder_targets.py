"""The coder targets: the container parser (``unpack_header``, ``unpack_chunk``,
``unpack_stream``) and ``Codec.decode``.

The parser may raise ``FormatError`` (and its subclasses) and nothing else, and
whatever it accepts must re-pack to the very same bytes. The codec may raise a
``SpeckvError`` and nothing else, a decode that succeeds must return exactly the
original bits, and an unmutated stream must decode.
"""

from __future__ import annotations

import random
from typing import Any, Callable

from speckv.coder import container as ct
from speckv.errors import SpeckvError

from .coder_env import CoderEnv, same_kv
from .findings import Finding, guarded
from .mutate import HEADER_FIELDS, as_buffer, fields_of, flip_bit, mutate_record, mutate_record_list, random_record

CONTAINER_LIMIT_S = 2.0  # one parse may take this long at most
CODEC_LIMIT_S = 10.0  # one decode of a ~50 KB stream (legitimately ~10 ms)


def _check_parse(rng: random.Random, what: str, parse: Callable[[Any], Any], buf: bytes,
                 repack: Callable[[Any], tuple[bytes, int]], must_accept: bool) -> str:
    """Parse ``buf`` (as a random buffer type) under the time limit. What is accepted
    must re-pack to the bytes it consumed (``repack(result)``: bytes, bytes consumed);
    ``must_accept``: the input holds a whole valid record or stream."""
    outcome, res = guarded(lambda: parse(as_buffer(rng, buf)), (ct.FormatError,), CONTAINER_LIMIT_S)
    if res is not None:
        packed, used = repack(res)
        if packed != buf[:used]:
            raise Finding("crash", f"accepted a non-canonical {what} ({used} bytes): {buf[:used][:120].hex()}")
    elif must_accept:
        raise Finding("crash", f"rejected a valid {what}: {outcome}")
    return outcome


def t_container_header(env: CoderEnv, rng: random.Random) -> str:
    """Mutated, truncated and random header records to ``unpack_header``."""
    h, recs = rng.choice(env.streams)
    valid = recs[0]
    r = rng.random()
    if r < 0.05:
        buf = valid
    elif r < 0.65:
        buf = mutate_record(rng, valid, env.donors, HEADER_FIELDS, 0.6)
    elif r < 0.85:
        buf = valid[:rng.randrange(len(valid) + 1)]
        if rng.random() < 0.3:
            buf += rng.randbytes(rng.randint(1, 200))  # extra bytes after a cut (or a whole) header
    else:
        buf = random_record(rng, (b"", ct.MAGIC, ct.MAGIC[:rng.randrange(4)], ct.CHUNK_MAGIC), 300)
    return _check_parse(rng, "header", ct.unpack_header, buf, lambda res: (ct.pack_header(res[0]), res[1]),
                        buf[:len(valid)] == valid)


def t_container_chunk(env: CoderEnv, rng: random.Random) -> str:
    """Mutated, truncated, foreign and random chunk records to ``unpack_chunk``."""
    h, recs = rng.choice(env.streams)
    valid = recs[1 + rng.randrange(h.n_chunks)]
    r = rng.random()
    if r < 0.05:
        buf = valid + (rng.randbytes(rng.randint(1, 50)) if rng.random() < 0.5 else b"")
    elif r < 0.7:
        buf = mutate_record(rng, valid, env.donors, fields_of(h, valid), 0.7)
    elif r < 0.8:
        buf = valid[:rng.randrange(len(valid))]
    elif r < 0.9:
        buf = rng.choice(env.donors)  # another record: wrong index, other header, or a header
    else:
        buf = random_record(rng, (b"", ct.CHUNK_MAGIC, ct.CHUNK_MAGIC[:rng.randrange(4)]), 400)
    return _check_parse(rng, "chunk record", lambda b: ct.unpack_chunk(b, h), buf,
                        lambda res: (ct.pack_chunk(res[0]), res[1]), buf[:len(valid)] == valid)


def t_container_stream(env: CoderEnv, rng: random.Random) -> str:
    """Mutated (bytes or record list), truncated and random streams to ``unpack_stream``."""
    h, recs = rng.choice(env.streams)
    valid = b"".join(recs)
    r = rng.random()
    if r < 0.05:
        buf = valid
    elif r < 0.55:
        buf = mutate_record(rng, valid, env.donors, HEADER_FIELDS if rng.random() < 0.3 else (), 0.6)
    elif r < 0.8:
        fields = [HEADER_FIELDS] + [fields_of(h, x) for x in recs[1:]]
        buf = b"".join(mutate_record_list(rng, recs, env.donors, fields, 0.7))
    elif r < 0.9:
        buf = valid[:rng.randrange(len(valid))]
    else:
        buf = random_record(rng, (b"", recs[0]), 500)
    return _check_parse(rng, "stream", ct.unpack_stream, buf, lambda res: (ct.pack_stream(*res), len(buf)),
                        buf == valid)


def _codec_case(env: CoderEnv, rng: random.Random, names: tuple[str, ...]) -> str:
    """A stream of ``names`` with its records mutated, or decoded under another prompt
    or another predictor (mu), or unmutated (5 %)."""
    base = env.bases[rng.choice(names)]
    recs, ids, mu = base.records, base.ids, base.mu
    if rng.random() >= 0.05:
        r = rng.random()
        if r < 0.85 or (r >= 0.92 and mu is None):
            recs = mutate_record_list(rng, recs, env.donors, base.fields, 0.75)
        elif r < 0.92:
            ids = flip_bit(rng, ids)  # another prompt
        else:
            mu = flip_bit(rng, mu)  # another predictor
    records = [as_buffer(rng, r) for r in recs]
    outcome, out = guarded(lambda: env.codec.decode(records, ids, mu), (SpeckvError,), CODEC_LIMIT_S)
    if outcome == "ok" and not same_kv(out, base.bits, base.scales):
        raise Finding("corrupt", f"{base.name}: a mutated stream decoded to other bits")
    unchanged = recs == base.records and ids is base.ids and mu is base.mu
    if unchanged and outcome != "ok":
        raise Finding("crash", f"{base.name}: the unmutated stream failed: {outcome}")
    return outcome


def t_codec_speckv(env: CoderEnv, rng: random.Random) -> str:
    """Mutated BF16/FP8 speckv streams to ``Codec.decode``: all chunks coded (version 2), or
    some stored (version 3, ``mixed-*``)."""
    return _codec_case(env, rng, ("speckv-bf16", "speckv-fp8", "mixed-bf16", "mixed-fp8"))


def t_codec_stored(env: CoderEnv, rng: random.Random) -> str:
    """Mutated BF16/FP8 stored streams to ``Codec.decode``."""
    return _codec_case(env, rng, ("stored-bf16", "stored-fp8"))


CODER_TARGETS: dict[str, Callable[[CoderEnv, random.Random], str]] = {
    "container.header": t_container_header, "container.chunk": t_container_chunk,
    "container.stream": t_container_stream, "codec.speckv": t_codec_speckv, "codec.stored": t_codec_stored,
}
