"""The speckv containers the Helm chart renders, for each values set (helm_helpers.py:
CASES): the restricted security context and writable /tmp, the serve env parsed by the
sidecar's own ServerConfig, gRPC probes on the health service, the termination grace
above the sidecar's, and the values the chart refuses (grace, clashing ports).
"""

from __future__ import annotations

import helm_python
import pytest
from helm_helpers import (
    CASES,
    HEALTH_SERVICE,
    RESTRICTED_CONTAINER_SC,
    all_containers,
    env_map,
    expected_roles,
    mounts,
    pod_specs,
    port_of,
    render,
    serve_containers,
    volumes,
)

from speckv.server.config import FIELDS, ServerConfig

# --- security ---------------------------------------------------------------------------

@pytest.mark.parametrize("case", list(CASES))
def test_security_context_on_every_container(rendered, case):
    _, objs, _ = rendered[case]
    n = 0
    for _, spec in pod_specs(objs):
        assert spec["securityContext"]["runAsNonRoot"] is True
        assert spec["securityContext"]["runAsUser"] == 10001
        assert spec["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
        assert spec["automountServiceAccountToken"] is False
        for c in all_containers(spec):
            sc = c.get("securityContext") or {}
            assert {k: sc.get(k) for k in RESTRICTED_CONTAINER_SC} == RESTRICTED_CONTAINER_SC, c["name"]
            # a read-only root filesystem needs a writable /tmp
            tmp = mounts(c).get("/tmp")
            assert tmp is not None and not tmp.get("readOnly"), c["name"]
            assert "emptyDir" in volumes(spec)[tmp["name"]]
            n += 1
    assert n > 0


@pytest.mark.parametrize("case", list(CASES))
def test_serve_env_is_a_valid_sidecar_config(rendered, case):
    """The env the chart sets parses into the sidecar's own ServerConfig, with
    the addresses, files and limits the chart means, and names only variables
    speckv reads (a typo such as SPECKV_GRACE_SECONDS would be silently ignored)."""
    values, objs, _ = rendered[case]
    known = {f.env for f in FIELDS} | {"SPECKV_CACHE"}
    n = 0
    for _, spec in pod_specs(objs):
        for role, c in serve_containers(spec):
            env = env_map(c)
            unknown = {k for k in env if k.startswith("SPECKV_")} - known
            assert not unknown, unknown
            cfg = ServerConfig.from_env(role, env=env)
            assert cfg.listen == f"0.0.0.0:{port_of(c, 'grpc')}"
            assert (cfg.metrics_host, cfg.metrics_port) == ("0.0.0.0", port_of(c, "metrics"))
            assert cfg.grace_s == float(values["config"]["graceSeconds"])
            assert cfg.predictor_batch_tokens == int(values["config"]["predictorBatchTokens"])
            assert cfg.pin == (values["predictor"]["pin"] or None)
            assert env["SPECKV_CACHE"] == "/cache" and not mounts(c)["/cache"].get("readOnly")
            assert "emptyDir" in volumes(spec)[mounts(c)["/cache"]["name"]]
            if values["predictor"]["source"] == "image":
                assert cfg.predictor is None
                assert "speckv-predictor" not in volumes(spec)
            else:
                assert cfg.predictor == values["predictor"]["mountPath"]
                assert mounts(c)[cfg.predictor]["readOnly"] is True
            if values["tls"]["enabled"]:
                for path in (cfg.tls_cert, cfg.tls_key, cfg.tls_ca):
                    assert path is not None and path.startswith("/etc/speckv/tls/")
                assert mounts(c)["/etc/speckv/tls"]["readOnly"] is True
                secret = volumes(spec)[mounts(c)["/etc/speckv/tls"]["name"]]["secret"]
                assert secret["secretName"] == values["tls"]["secretName"]
                assert cfg.health_listen == f"0.0.0.0:{values['ports']['health']}"
            else:
                assert (cfg.tls_cert, cfg.tls_key, cfg.tls_ca, cfg.health_listen) == (None,) * 4
            n += 1
    assert n == len(expected_roles(values))


@pytest.mark.parametrize("case", list(CASES))
def test_grpc_probes(rendered, case):
    values, objs, _ = rendered[case]
    tls = values["tls"]["enabled"]
    for _, spec in pod_specs(objs):
        for role, c in serve_containers(spec):
            want_port = port_of(c, "health") if tls else port_of(c, "grpc")
            assert want_port == (values["ports"]["health"] if tls else values["ports"]["grpc"])
            if tls:
                assert env_map(c)["SPECKV_HEALTH_LISTEN"].endswith(f":{want_port}")
                assert want_port != port_of(c, "grpc")
            probes = {k: c[k] for k in ("startupProbe", "livenessProbe", "readinessProbe")}
            for kind, probe in probes.items():
                assert set(probe) & {"grpc", "httpGet", "exec", "tcpSocket"} == {"grpc"}, kind
                assert probe["grpc"]["port"] == want_port, kind
            assert probes["startupProbe"]["grpc"]["service"] == HEALTH_SERVICE[role]
            assert probes["readinessProbe"]["grpc"]["service"] == HEALTH_SERVICE[role]
            assert probes["livenessProbe"]["grpc"]["service"] == ""


@pytest.mark.parametrize("case", list(CASES))
def test_termination_grace_exceeds_sidecar_grace(rendered, case):
    values, objs, _ = rendered[case]
    for _, spec in pod_specs(objs):
        for _, c in serve_containers(spec):
            assert spec["terminationGracePeriodSeconds"] > float(env_map(c)["SPECKV_GRACE_S"])
            assert spec["terminationGracePeriodSeconds"] == values["terminationGracePeriodSeconds"]


def test_termination_grace_not_above_sidecar_grace_refused(chart):
    with pytest.raises(helm_python.HelmError, match="terminationGracePeriodSeconds"):
        render(chart, {"config": {"graceSeconds": 30}, "terminationGracePeriodSeconds": 30})
    render(chart, {"config": {"graceSeconds": 30}, "terminationGracePeriodSeconds": 31})


def test_port_clash_refused(chart):
    with pytest.raises(helm_python.HelmError, match="ports must differ"):
        render(chart, {"ports": {"metrics": 50051}})
    with pytest.raises(helm_python.HelmError, match="ports must differ"):
        render(chart, {"mode": "sidecar", "vllm": {"kvConnector": "X", "port": 9100}})
    render(chart, {"ports": {"metrics": 9200}})
