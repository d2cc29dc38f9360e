"""Lookahead (coder/lookahead.py): results in order and equal to the series, the next item
prepared while the caller holds the current one, errors at their item, nothing left running
after an early exit; every core held for a helper's step given back (done, failed or
cancelled); and a whole-stream encode on two threads prepares on the helper, holding a core."""

from __future__ import annotations

import threading

import pytest
from codec_helpers import bf16_tensor, ids_for
from native_helpers import assert_same_records, realistic_pair
from require import missing

from speckv.coder import codec as codec_mod
from speckv.coder import native
from speckv.coder.codec import Codec
from speckv.coder.lookahead import Lookahead

WAIT_S = 30.0  # NOTE: a bound on a hang, never a timing: every wait below ends on an event


@pytest.fixture
def built():
    if not native.available():
        missing("NATIVE", f"the native coder is not built ({native.IMPORT_ERROR})")


@pytest.mark.parametrize("ahead", [False, True])
def test_results_in_order(ahead):
    with Lookahead(lambda i: i * i, range(7), ahead) as out:
        assert list(out) == [i * i for i in range(7)]
    with Lookahead(lambda i: i, [], ahead) as out:
        assert list(out) == []


def test_next_item_is_prepared_while_the_caller_holds_this_one():
    started = threading.Event()

    def fn(i: int) -> int:
        if i == 1:
            started.set()
        return i

    with Lookahead(fn, range(3), True) as out:
        it = iter(out)
        assert next(it) == 0
        assert started.wait(WAIT_S), "item 1 was not prepared while item 0 was held"
        assert list(it) == [1, 2]


def test_item_0_runs_on_the_caller_while_the_helper_starts_item_1():
    names: dict[int, str] = {}
    started = threading.Event()

    def fn(i: int) -> int:
        names[i] = threading.current_thread().name
        if i == 1:
            started.set()
        if i == 0:
            assert started.wait(WAIT_S), "item 1 did not start while item 0 ran"
        return i

    with Lookahead(fn, range(3), True) as out:
        assert list(out) == [0, 1, 2]
    assert names[0] == threading.current_thread().name
    assert names[1].startswith("speckv-lookahead") and names[2].startswith("speckv-lookahead"), names


def on_the_helper(seen: list[tuple[str, int]]) -> bool:
    """A whole stream of 15 groups on two threads: group 0 prepared on the caller, the other 14 on
    the helper, every one with a one-thread coder."""
    names = sorted(name for name, _ in seen)
    return (len(seen) == 15 and all(t == 1 for _, t in seen) and names.count(threading.main_thread().name) == 1
            and sum(n.startswith("speckv-lookahead") for n in names) == 14)


def test_in_series_nothing_runs_ahead():
    calls: list[int] = []
    with Lookahead(lambda i: calls.append(i) or i, range(3), False) as out:
        it = iter(out)
        assert next(it) == 0 and calls == [0]


@pytest.mark.parametrize("ahead", [False, True])
def test_an_error_is_raised_at_its_item(ahead):
    def fn(i: int) -> int:
        if i == 2:
            raise ValueError("item 2")
        return i

    got: list[int] = []
    with pytest.raises(ValueError, match="item 2"), Lookahead(fn, range(5), ahead) as out:
        for r in out:
            got.append(r)
    assert got == [0, 1]


def test_an_early_exit_leaves_nothing_running():
    calls: list[int] = []
    finished: list[int] = []
    started, release = threading.Event(), threading.Event()

    def fn(i: int) -> int:
        calls.append(i)
        if i == 1:
            started.set()
            release.wait(WAIT_S)  # item 1 is running when the caller leaves
        finished.append(i)
        return i

    la = Lookahead(fn, range(10), True)
    with la as out:
        for r in out:
            assert r == 0
            assert started.wait(WAIT_S)  # NOTE: item 1 has begun on the helper (not a timing)
            threading.Timer(0.05, release.set).start()
            break
    assert sorted(calls) == [0, 1] and sorted(finished) == [0, 1]  # the exit waited for item 1; item 2 never ran
    assert la._pool is not None and la._pool._shutdown  # noqa: SLF001 -- the helper is gone


class Holds:
    """A ``hold`` that logs each call and the thread it came from."""

    def __init__(self) -> None:
        self.calls: list[int] = []
        self.lock = threading.Lock()

    def __call__(self, delta: int) -> None:
        with self.lock:
            self.calls.append(delta)

    @property
    def held(self) -> int:
        return sum(self.calls)


def test_each_step_on_the_helper_holds_a_core_until_it_ends():
    holds = Holds()
    inside: dict[int, int] = {}
    with Lookahead(lambda i: inside.setdefault(i, holds.held) and i, range(4), True, holds) as out:
        assert list(out) == [0, 1, 2, 3]
    assert holds.calls.count(1) == 3 and holds.held == 0, holds.calls  # items 1-3: item 0 runs on the caller
    assert all(inside[i] >= 1 for i in (1, 2, 3)), inside  # each step on the helper ran with its core held
    with Lookahead(lambda i: i, range(3), False, holds) as out:  # in series: nothing held
        assert list(out) == [0, 1, 2]
    assert len(holds.calls) == 6


def test_failed_and_cancelled_steps_give_their_core_back():
    holds = Holds()

    def fn(i: int) -> int:
        if i == 1:
            raise ValueError("item 1")
        return i

    with pytest.raises(ValueError, match="item 1"), Lookahead(fn, range(5), True, holds) as out:
        list(out)
    assert holds.held == 0 and holds.calls.count(1) == 1, holds.calls  # item 1's step, which failed
    holds = Holds()
    with Lookahead(lambda i: i, range(10), True, holds) as out:
        for _ in out:
            break  # the consumer stops: item 1's step ends or is cancelled
    assert holds.held == 0 and holds.calls.count(1) <= 2, holds.calls


def test_whole_stream_encode_prepares_on_the_helper(ckpt, monkeypatch, built):
    """Two threads on the native coder: later groups prepared on the helper with a one-thread
    coder sharing the codec's tables, the same records as one thread in series."""
    x, mu = realistic_pair(40, 7)
    kv, mu, ids = bf16_tensor(x), bf16_tensor(mu), ids_for(40)
    monkeypatch.setattr(codec_mod, "GROUP_ELEMENTS", 1)  # every chunk its own group
    seen: list[tuple[str, int]] = []
    prepare = Codec._prepare

    def spy(self, *a, backend=None, **k):
        seen.append((threading.current_thread().name, (backend or self.backend).threads))
        return prepare(self, *a, backend=backend, **k)

    monkeypatch.setattr(Codec, "_prepare", spy)
    cfg = codec_mod.CodecConfig(elems_per_lane=64, layers_per_chunk=2, coder="native")
    two = Codec.from_checkpoint(ckpt, cfg)
    one = Codec.from_checkpoint(ckpt, codec_mod.CodecConfig(elems_per_lane=64, layers_per_chunk=2,
                                                            coder="native", threads=1))
    assert two.config.threads == 2
    held, jobs, short = native._native.pool_stats()[:3]
    records = list(two.encode(kv, ids, mu))
    assert on_the_helper(seen), seen
    after = native._native.pool_stats()
    assert after[0] == held and after[1] > jobs, (held, jobs, after)  # every core it held given back
    seen.clear()
    assert_same_records(records, list(one.encode(kv, ids, mu)))
    assert len(seen) == 15 and all(name == threading.main_thread().name and t == 1 for name, t in seen), seen
    stream = two.encode(kv, ids, mu)
    next(stream), next(stream)
    stream.close()  # a consumer that stops reading: the helper's step ends or is cancelled
    assert native._native.pool_stats()[0] == held


def test_with_threads_shares_the_flattened_tables(built):
    c = native.NativeCoder(2, "lookup")
    one = c.with_threads(1)
    assert (one.threads, one.path, one._flat is c._flat) == (1, "lookup", True)  # noqa: SLF001


def test_whole_stream_decode_prepares_on_the_helper(ckpt, monkeypatch, built):
    """Two threads: later groups' plans (prepare_mu, their mu check) built on the helper with a
    one-thread coder, the same KV as one thread; with a corrupt chunk before a chunk whose mu
    differs, the corrupt chunk's error is raised, as in series."""
    import dataclasses

    from speckv.coder import container as ct
    from speckv.coder.codec import bf16_bits
    from speckv.errors import IntegrityError, MuMismatchError

    x, mu = realistic_pair(40, 7)
    kv, mu, ids = bf16_tensor(x), bf16_tensor(mu), ids_for(40)
    monkeypatch.setattr(codec_mod, "GROUP_ELEMENTS", 1)  # every chunk its own group
    seen: list[tuple[str, int]] = []
    prepare = Codec._decode_prepare

    def spy(self, h, chunks, mu, backend, serial):
        seen.append((threading.current_thread().name, backend.threads))
        return prepare(self, h, chunks, mu, backend, serial)

    monkeypatch.setattr(Codec, "_decode_prepare", spy)
    cfg = dict(elems_per_lane=64, layers_per_chunk=2, coder="native")
    two = Codec.from_checkpoint(ckpt, codec_mod.CodecConfig(**cfg))
    one = Codec.from_checkpoint(ckpt, codec_mod.CodecConfig(**cfg, threads=1))
    records = list(two.encode(kv, ids, mu))
    held = native._native.pool_stats()[0]
    want = bf16_bits(kv).tobytes()
    assert two.decode(records, ids, mu).tobytes() == want
    assert on_the_helper(seen), seen
    seen.clear()
    assert one.decode(records, ids, mu).tobytes() == want
    assert len(seen) == 15 and all(name == threading.main_thread().name for name, _ in seen), seen

    h = ct.unpack_header(records[0])[0]
    c3 = ct.unpack_chunk(records[4], h)[0]
    bad = ct.pack_chunk(dataclasses.replace(c3, raw_digest=bytes(len(c3.raw_digest))))  # decodes, then fails
    other = bf16_bits(mu).copy()
    other[h.chunk_layers(5)[0]] ^= 1  # chunk 5's mu: another value in its first layer
    corrupt = records[:4] + [bad] + records[5:]
    with pytest.raises(MuMismatchError, match="chunk 5"):
        two.decode(records, ids, bf16_tensor(other))
    for codec in (one, two):
        with pytest.raises(IntegrityError, match="chunk 3: decoded KV fails its checksum"):
            codec.decode(corrupt, ids, bf16_tensor(other))
    assert native._native.pool_stats()[0] == held  # the helper's cores given back, after errors too
