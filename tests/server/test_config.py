"""ServerConfig: validation at construction, and ``from_env``: keywords over
``SPECKV_*`` variables over defaults, byte suffixes, errors naming the variable."""

from __future__ import annotations

from dataclasses import fields

import pytest

from speckv.server.config import FIELDS, ServerConfig, _bytes

MIB = 1 << 20

PIN = "ab" * 32


def test_defaults():
    c = ServerConfig(role="decoder")
    assert (c.listen, c.metrics_port, c.max_inflight_bytes, c.message_bytes) == ("127.0.0.1:0", -1, 1 << 30,
                                                                                 4 * MIB - 64 * 1024)
    assert (c.max_transfers, c.layers_per_chunk, c.pin, c.predictor) == (64, 2, None, None)


def test_fields_table_covers_every_setting():
    assert {f.name for f in FIELDS} == {f.name for f in fields(ServerConfig)} - {"role"}
    for f in FIELDS:
        assert f.env == "SPECKV_" + f.name.upper()
        assert f.flag == "--" + f.name.replace("_", "-")
        assert f.help


def test_from_env_reads_speckv_variables():
    env = {"SPECKV_LISTEN": "0.0.0.0:50052", "SPECKV_METRICS_PORT": "9090", "SPECKV_MAX_INFLIGHT_BYTES": "512Mi",
           "SPECKV_MESSAGE_BYTES": "1Mi", "SPECKV_MAX_TRANSFERS": "8", "SPECKV_GRACE_S": "2.5",
           "SPECKV_PIN": PIN, "SPECKV_MODEL_ID": "my-model", "SPECKV_LAYERS_PER_CHUNK": "4",
           "OTHER_VAR": "ignored"}
    c = ServerConfig.from_env("decoder", env)
    assert c.role == "decoder"
    assert (c.listen, c.metrics_port, c.max_inflight_bytes, c.message_bytes) == ("0.0.0.0:50052", 9090, 512 * MIB, MIB)
    assert (c.max_transfers, c.grace_s, c.pin, c.model_id, c.layers_per_chunk) == (8, 2.5, PIN, "my-model", 4)


def test_from_env_uses_os_environ_by_default(monkeypatch):
    monkeypatch.setenv("SPECKV_MAX_TOKENS", "4096")
    monkeypatch.setenv("SPECKV_FETCH_WAIT_S", "0.5")
    c = ServerConfig.from_env("encoder")
    assert (c.role, c.max_tokens, c.fetch_wait_s) == ("encoder", 4096, 0.5)


def test_keywords_override_env_and_none_means_not_given():
    env = {"SPECKV_LISTEN": "0.0.0.0:1", "SPECKV_MAX_TRANSFERS": "8", "SPECKV_THREADS": "3"}
    c = ServerConfig.from_env("encoder", env, listen="127.0.0.1:7", max_transfers=None, threads=1)
    assert (c.listen, c.max_transfers, c.threads) == ("127.0.0.1:7", 8, 1)


def test_empty_variable_means_not_given():
    c = ServerConfig.from_env("decoder", {"SPECKV_LISTEN": "", "SPECKV_PIN": "", "SPECKV_MAX_TRANSFERS": ""})
    assert (c.listen, c.pin, c.max_transfers) == ("127.0.0.1:0", None, 64)


@pytest.mark.parametrize("text,n", [("0", 0), ("65536", 65536), ("64Ki", 64 << 10), ("512Mi", 512 << 20),
                                    ("2Gi", 2 << 30), ("1Ti", 1 << 40), (" 3Mi ", 3 << 20),
                                    # Kubernetes quantities: decimal suffixes, fractions, exponents
                                    ("2G", 2_000_000_000), ("500M", 500_000_000), ("64k", 64_000),
                                    ("1.5Gi", 3 << 29), (".5Ki", 512), ("1e9", 10**9), ("2E", 2 * 10**18)])
def test_byte_sizes(text, n):
    assert _bytes(text) == n


@pytest.mark.parametrize("text,words", [("2GB", "not a size"), ("2K", "not a size"), ("-1", "not a size"),
                                        ("1m", "not a size"), ("", "not a size"), ("Gi", "not a size"),
                                        ("0.1Ki", "not a whole number of bytes (102.4)"),
                                        ("1.5", "not a whole number of bytes")])
def test_bad_byte_sizes_say_what_is_accepted(text, words):
    with pytest.raises(ValueError) as ei:
        _bytes(text)
    assert words in str(ei.value) and repr(text) in str(ei.value)
    if words == "not a size":
        assert "512Mi, 2Gi, 1.5Gi, 2G" in str(ei.value)


def test_quantities_from_the_environment():
    c = ServerConfig.from_env("decoder", {"SPECKV_MAX_INFLIGHT_BYTES": "2G", "SPECKV_MU_CACHE_BYTES": "1.5Gi"})
    assert (c.max_inflight_bytes, c.mu_cache_bytes) == (2_000_000_000, 3 << 29)


@pytest.mark.parametrize("var,text", [
    ("SPECKV_MAX_INFLIGHT_BYTES", "512MB"),
    ("SPECKV_MAX_INFLIGHT_BYTES", "1.5"),
    ("SPECKV_MESSAGE_BYTES", "lots"),
    ("SPECKV_MAX_TRANSFERS", "eight"),
    ("SPECKV_METRICS_PORT", "9090.0"),
    ("SPECKV_GRACE_S", "soon"),
])
def test_unparsable_values_name_the_variable(var, text):
    with pytest.raises(ValueError) as ei:
        ServerConfig.from_env("decoder", {var: text})
    assert var in str(ei.value) and repr(text) in str(ei.value)


@pytest.mark.parametrize("env,words", [
    ({"SPECKV_MAX_TRANSFERS": "0"}, "max_transfers"),
    ({"SPECKV_GRACE_S": "0"}, "grace_s"),
    ({"SPECKV_MESSAGE_BYTES": "1Ki"}, "message_bytes"),
    ({"SPECKV_MAX_INFLIGHT_BYTES": "1Ki"}, "max_inflight_bytes"),
    ({"SPECKV_LISTEN": "50051"}, "listen"),
    ({"SPECKV_METRICS_PORT": "70000"}, "metrics_port"),
    ({"SPECKV_PIN": "abc"}, "pin"),
])
def test_invalid_values_name_the_setting(env, words):
    """Parsable but invalid values fail the dataclass's validation, naming the setting."""
    with pytest.raises(ValueError, match=words):
        ServerConfig.from_env("decoder", env)


@pytest.mark.parametrize("kw,words", [
    ({"role": "proxy"}, "role"),
    ({"pin": "zz" * 32}, "pin"),
    ({"pin": PIN[:-2]}, "pin"),
    ({"listen": "localhost"}, "listen"),
    ({"metrics_port": -2}, "metrics_port"),
    ({"message_bytes": 64 * 1024 - 1}, "message_bytes"),
    ({"message_bytes": 4 * MIB - 64 * 1024 + 1}, "message_bytes"),
    ({"max_inflight_bytes": 2 * MIB - 1, "message_bytes": 2 * MIB}, "max_inflight_bytes"),
    ({"layers_per_chunk": 0}, "layers_per_chunk"),
    ({"threads": 0}, "threads"),
    ({"lease_s": -1.0}, "lease_s"),
    ({"transfer_timeout_s": 0.0}, "transfer_timeout_s"),
])
def test_validation(kw, words):
    kw = {"role": "decoder", **kw}
    with pytest.raises(ValueError, match=words):
        ServerConfig(**kw)


def test_smallest_valid_limits():
    c = ServerConfig(role="encoder", message_bytes=64 * 1024, max_inflight_bytes=64 * 1024,
                     max_receive_bytes=128 * 1024)
    assert c.max_inflight_bytes == c.message_bytes == 64 * 1024


@pytest.mark.parametrize("kw,want", [
    ({}, 4 * MIB - 64 * 1024),  # a 3 MiB stored record fits one message
    ({"max_receive_bytes": 3 * MIB}, 3 * MIB - 64 * 1024),
    ({"max_inflight_bytes": MIB}, MIB),
    ({"max_receive_bytes": 128 * 1024, "max_inflight_bytes": 64 * 1024}, 64 * 1024),
    ({"message_bytes": MIB, "max_receive_bytes": 3 * MIB}, MIB),  # given: kept
])
def test_message_bytes_default_fits_the_other_limits(kw, want):
    """Unset (0), message_bytes is the sidecar's default where the other limits allow it, else the
    most they allow: lowering max_receive_bytes or max_inflight_bytes alone stays a valid config."""
    assert ServerConfig(role="decoder", **kw).message_bytes == want
