"""The digests follow the stream's format version (FORMAT.md): a version 2 stream's
mu_fingerprint and raw_digest are blake2b-128, a version 3 stream's XXH3-128. Both
versions decode; one corrupted KV byte (its record's crc32 made right again) fails
either's checksum; and each version's digests are exactly the reference
implementations' (hashlib, xxhash), not just speckv.digests agreeing with itself."""
from __future__ import annotations

import dataclasses
import hashlib

import numpy as np
import pytest
import xxhash
from codec_helpers import bf16_from_float, bf16_tensor, chunk_areas, ids_for, recrc, shape

from speckv.coder import container as ct
from speckv.digests import ALGORITHMS, BLAKE2B_128, XXH3_128, KVDigest, algorithm_of, digest
from speckv.errors import IntegrityError
from speckv.v1 import common_pb2 as pb

T = 3
REFERENCE = {2: lambda b: hashlib.blake2b(b, digest_size=16).digest(), 3: lambda b: xxhash.xxh3_128(b).digest()}


def _kv() -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(5)
    mu = (0.5 * rng.standard_normal(shape(T))).astype(np.float32)
    return bf16_from_float(mu + 0.01 * rng.standard_normal(shape(T)).astype(np.float32)), bf16_from_float(mu)


def _stream(codec, version: int, stored: bool) -> tuple[ct.StreamHeader, list[bytes], np.ndarray, np.ndarray]:
    x, mu = _kv()
    h = dataclasses.replace(codec.stream_header(True, x.shape, ids_for(T), stored=stored), version=version)
    chunks = codec.encode_chunks(h, range(h.n_chunks), x, None if stored else mu)
    return h, [ct.pack_header(h)] + [ct.pack_chunk(c) for c in chunks], x, mu


def test_algorithm_ids_are_the_protos():
    assert (BLAKE2B_128, XXH3_128) == (pb.DIGEST_ALGORITHM_BLAKE2B_128, pb.DIGEST_ALGORITHM_XXH3_128)
    assert set(ALGORITHMS) == {BLAKE2B_128, XXH3_128}
    assert [algorithm_of(v) for v in ct.READ_VERSIONS] == [BLAKE2B_128, XXH3_128, XXH3_128, XXH3_128]


@pytest.mark.parametrize("version", [2, 3])
def test_digests_are_the_reference_implementations(version):
    data = np.arange(1000, dtype=np.uint16)
    algo = algorithm_of(version)
    assert digest(b"ab", data, algorithm=algo) == REFERENCE[version](b"ab" + data.tobytes())
    d = KVDigest(algo)
    d.update_layer(data[:600], np.array([1.5, -2.0], np.float32))
    d.update_layer(data[600:])
    want = np.array([1.5, -2.0], "<f4").tobytes() + data.tobytes()
    assert (d.digest(), d.raw_bytes) == (REFERENCE[version](want), data.nbytes)
    with pytest.raises(ValueError):
        digest(b"", algorithm=7)


@pytest.mark.parametrize("stored", [False, True], ids=["coded", "stored"])
@pytest.mark.parametrize("version", [2, 3])
def test_each_version_decodes_with_its_own_digests(make_codec, version, stored):
    codec = make_codec(64, 4)
    h, records, x, mu = _stream(codec, version, stored)
    assert h.version == version
    flags = [ct.is_stored_chunk(h, ct.unpack_chunk(r, h)[0]) for r in records[1:]]
    assert all(flags) if stored else not all(flags)
    for i, rec in enumerate(records[1:]):
        c, _ = ct.unpack_chunk(rec, h)
        s, n = h.chunk_layers(i)
        assert c.raw_digest == REFERENCE[version](x[s:s + n].tobytes())
        if not ct.is_stored_chunk(h, c):  # (the size guard may store a version 3 chunk)
            assert c.mu_fingerprint == REFERENCE[version](codec.models[h.model].correct(mu[s:s + n], slice(s, s + n))
                                                          .tobytes())
    assert np.array_equal(codec.decode(records, ids_for(T), bf16_tensor(mu)), x)


@pytest.mark.parametrize("version", [2, 3])
def test_a_corrupted_kv_byte_fails_its_checksum(make_codec, version):
    """A stored stream (its records' bits are the raw KV): one flipped bit, the crc32 made
    right again, is caught by the chunk's raw_digest under either version's algorithm."""
    codec = make_codec(64, 4)
    h, records, x, mu = _stream(codec, version, stored=True)
    lo, hi = chunk_areas(records[0], records[2])["bits"]
    for pos in (lo, (lo + hi) // 2, hi - 1):
        bad = bytearray(records[2])
        bad[pos] ^= 0x04
        with pytest.raises(IntegrityError, match="checksum"):
            codec.decode([records[0], records[1], recrc(bad), *records[3:]], ids_for(T), bf16_tensor(mu))


def test_a_version_3_stream_read_as_version_2_fails_its_checksums(make_codec):
    """The version decides the algorithm: the same chunks under a version 2 header fail."""
    codec = make_codec(64, 4)
    h, records, x, mu = _stream(codec, 3, stored=True)
    v2 = ct.pack_header(dataclasses.replace(h, version=2))
    with pytest.raises(IntegrityError, match="checksum"):
        codec.decode([v2, *records[1:]], ids_for(T), bf16_tensor(mu))
