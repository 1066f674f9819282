"""`lowLatency` socket options: the kernel probe, the plan, the config and Envoy's acceptance of the render."""

from __future__ import annotations

import json
import logging
import socket
import subprocess

import pytest

from extproc import socket_options as so
from extproc.config.loader import ConfigError, load_file
from extproc.envoy_bin import find_envoy
from extproc.envoy_render import render, render_yaml

ALLOWED = so.KernelSupport()


def _config(tmp_path, backend_ll=None, listener_ll=None):
    backend = {"name": "ort", "kind": "onnxruntime", "endpoints": ["127.0.0.1:18000"]}
    if backend_ll is not None:
        backend["lowLatency"] = backend_ll
    spec = {"backends": [backend], "routes": [{"path": "/v2", "match": "prefix", "kind": "kserve", "target": "ort"}]}
    if listener_ll is not None:
        spec["listener"] = {"lowLatency": listener_ll}
    path = tmp_path / "gw.yaml"
    path.write_text(json.dumps({"apiVersion": "adapter.ai/v1", "kind": "AdapterGateway",
                                "metadata": {"name": "ll"}, "spec": spec}, indent=1))
    return path


def test_upstream_plan_has_the_linux_numbers() -> None:
    p = so.plan(so.LowLatency(), ALLOWED, "upstream")
    assert [(o.level, o.name, o.int_value) for o in p.options] == [(6, 1, 1), (1, 46, 50), (6, 30, 1)]
    assert p.skipped == () and p.tfo_queue_length == 0
    assert so.cluster_fields(p)["upstream_bind_config"]["socket_options"][1] == {
        "description": "SO_BUSY_POLL 50us", "level": 1, "name": 46, "int_value": 50, "state": "STATE_PREBIND"}


def test_listener_plan_uses_the_fast_open_queue() -> None:
    p = so.plan(so.LowLatency(busy_poll_us=20), ALLOWED, "listener")
    assert [(o.level, o.name, o.int_value) for o in p.options] == [(6, 1, 1), (1, 46, 20)]
    assert so.listener_fields(p)["tcp_fast_open_queue_length"] == so.DEFAULT_TFO_QUEUE


def test_refused_options_are_left_out_with_the_reason() -> None:
    support = so.KernelSupport(busy_poll="no CAP_NET_ADMIN", fast_open_connect="sysctl off",
                               fast_open_listen="server side off")
    up = so.plan(so.LowLatency(), support, "upstream")
    assert [o.name for o in up.options] == [so.TCP_NODELAY]
    assert up.skipped == (("SO_BUSY_POLL", "no CAP_NET_ADMIN"), ("TCP_FASTOPEN_CONNECT", "sysctl off"))
    down = so.plan(so.LowLatency(), support, "listener")
    assert down.tfo_queue_length == 0 and ("TCP_FASTOPEN", "server side off") in down.skipped
    assert so.plan(so.LowLatency(tcp_no_delay=False, busy_poll_us=0, tcp_fast_open=False), ALLOWED,
                   "upstream") == so.Plan()


@pytest.mark.parametrize("value, client, server", [(0, False, False), (1, True, False), (2, False, True),
                                                   (3, True, True)])
def test_probe_reads_the_fast_open_sysctl(tmp_path, value, client, server) -> None:
    sysctl = tmp_path / "tcp_fastopen"
    sysctl.write_text(f"{value}\n")
    support = so.KernelSupport.probe(sysctl)
    assert (support.fast_open_connect is None) == client, support
    assert (support.fast_open_listen is None) == server, support
    if not client:
        assert f"is {value}" in support.fast_open_connect


def test_probe_agrees_with_setsockopt_on_this_host() -> None:
    with socket.socket() as s:
        try:
            s.setsockopt(so.SOL_SOCKET, so.SO_BUSY_POLL, so.DEFAULT_BUSY_POLL_US)
            allowed = True
        except OSError:
            allowed = False
    assert (so.KernelSupport.probe().busy_poll is None) == allowed


def test_config_true_false_and_fields(tmp_path) -> None:
    snap = load_file(_config(tmp_path, backend_ll=True))
    assert snap.backends["ort"].socket_plan == so.plan(so.LowLatency(), so.KernelSupport.probe(), "upstream")
    assert load_file(_config(tmp_path, backend_ll=False)).backends["ort"].socket_plan is None
    assert load_file(_config(tmp_path)).backends["ort"].socket_plan is None
    snap = load_file(_config(tmp_path, backend_ll={"busyPollUs": 0, "tcpFastOpen": False}))
    assert [o.name for o in snap.backends["ort"].socket_plan.options] == [so.TCP_NODELAY]


def test_bad_value_names_file_field_and_reason(tmp_path) -> None:
    path = _config(tmp_path, backend_ll={"busyPollUs": -5})
    with pytest.raises(ConfigError) as e:
        load_file(path)
    text = str(e.value)
    assert str(path) in text and "spec.backends[0].lowLatency.busyPollUs" in text and "greater than or equal" in text
    with pytest.raises(ConfigError, match=r"lowLatency\.tcpNoDelays"):
        load_file(_config(tmp_path, backend_ll={"tcpNoDelays": True}))


def test_skipped_options_are_logged(tmp_path, caplog) -> None:
    support = so.KernelSupport.probe()
    with caplog.at_level(logging.WARNING, logger="extproc.config.compile"):
        load_file(_config(tmp_path, backend_ll=True, listener_ll=True))
    logged = caplog.text
    for reason in (support.busy_poll, support.fast_open_connect, support.fast_open_listen):
        if reason is not None:
            assert reason in logged
    if support.fast_open_listen is None and support.busy_poll is None and support.fast_open_connect is None:
        assert "left out" not in logged


def test_render_puts_options_on_the_cluster_and_listener_and_envoy_accepts_it(tmp_path) -> None:
    snap = load_file(_config(tmp_path, backend_ll=True, listener_ll=True))
    doc = render(snap, workers=1)
    [cluster] = [c for c in doc["static_resources"]["clusters"] if c["name"] == snap.backends["ort"].cluster]
    rendered = cluster["upstream_bind_config"]["socket_options"]
    assert rendered == [o.envoy() for o in snap.backends["ort"].socket_plan.options] and rendered
    listener = doc["static_resources"]["listeners"][0]
    assert listener["socket_options"] == [o.envoy() for o in snap.listener_socket_plan.options]
    assert ("tcp_fast_open_queue_length" in listener) == (snap.listener_socket_plan.tfo_queue_length > 0)
    out = tmp_path / "envoy.yaml"
    out.write_text(render_yaml(snap, workers=1))
    check = subprocess.run([find_envoy(), "--mode", "validate", "-c", str(out)], capture_output=True, text=True,
                           timeout=60)
    assert check.returncode == 0, check.stdout + check.stderr


def test_without_low_latency_nothing_is_rendered(tmp_path) -> None:
    doc = render(load_file(_config(tmp_path)), workers=1)
    assert not any("upstream_bind_config" in c for c in doc["static_resources"]["clusters"])
    assert "socket_options" not in doc["static_resources"]["listeners"][0]
