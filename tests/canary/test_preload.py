"""canary/preload.py: the sandbox (time, CPU, memory and network limits, each killing or refusing what
breaks it) and the preload (the bundle compiled with the config, its golden cases run through the
route's stages; a mismatch refused with a diff, a good bundle passing)."""

from __future__ import annotations

import socket

import pytest

from canary.preload import SandboxLimits, network_prefix, preload, run_sandboxed
from tests.canary.adapter_bundles import make_bundle
from tests.conftest import REPO

T = "tests.canary.sandbox_targets:"

CONFIG = """\
apiVersion: adapter.ai/v1
kind: AdapterGateway
metadata: {name: preload}
spec:
  backends:
    - {name: llm, endpoints: ["127.0.0.1:9001"], models: [m]}
  routes:
    - {path: /summarize, name: summarize, kind: llm, target: llm, transform: '{"summary": $.output.text}'}
  bundles:
    - {name: summ}
"""


@pytest.fixture
def config(tmp_path):
    p = tmp_path / "gw.yaml"
    p.write_text(CONFIG)
    return p


def test_a_target_runs_and_answers_json():
    r = run_sandboxed(T + "echo", {"a": 1})
    assert r.ok and r.value == {"echo": {"a": 1}}, r


def test_a_target_that_never_ends_is_killed_at_the_wall_clock_limit():
    r = run_sandboxed(T + "sleep_forever", None, SandboxLimits(wall_seconds=1.0))
    assert (r.ok, r.kind) == (False, "timeout") and "wall-clock limit of 1 s" in r.error, r


def test_a_busy_loop_is_killed_at_the_cpu_limit():
    r = run_sandboxed(T + "loop", None, SandboxLimits(cpu_seconds=1, wall_seconds=30))
    assert (r.ok, r.kind) == (False, "cpu") and "CPU limit of 1 s" in r.error, r


def test_allocating_past_the_address_space_limit_fails():
    r = run_sandboxed(T + "allocate", None, SandboxLimits(address_space=256 << 20))
    assert (r.ok, r.kind) == (False, "memory"), r


def test_an_exception_is_reported_with_its_message():
    r = run_sandboxed(T + "raises", None)
    assert (r.ok, r.kind, r.error) == (False, "error", "ValueError: bad template")


@pytest.fixture
def listener():
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    s.listen(8)
    yield s.getsockname()[1]
    s.close()


def test_a_socket_reaches_nothing_from_the_network_namespace(listener):
    prefix, what = network_prefix("auto")
    if not prefix:
        print(f"SKIP reason: no network namespace can be made here ({what} only); the guard test covers the fallback")
        pytest.skip("no network namespace here (needs root or unprivileged user namespaces)")
    assert run_sandboxed(T + "connect", {"port": listener}, SandboxLimits(network="guard")).ok is False
    r = run_sandboxed(T + "connect", {"port": listener})
    assert (r.ok, r.kind) == (False, "error") and r.network.startswith("namespace"), r
    assert "unreachable" in r.error or "refused" in r.error, r
    # the same connect outside the sandbox succeeds: it is the namespace that refuses it
    socket.create_connection(("127.0.0.1", listener), timeout=2).close()


def test_the_audit_hook_refuses_sockets_where_no_namespace_is_made(listener):
    r = run_sandboxed(T + "connect", {"port": listener}, SandboxLimits(network="guard"))
    assert (r.ok, r.kind, r.network) == (False, "error", "audit hook"), r
    assert "network refused in the preload sandbox" in r.error


def test_a_good_bundle_passes_its_golden_cases(tmp_path, config):
    r = preload(str(config), str(make_bundle(tmp_path, "1", tag="one")))
    assert r.ok, r.reason
    assert (r.bundle, r.routes, [g.ok for g in r.golden]) == ("summ@1", ("summarize",), [True])


def test_a_golden_mismatch_is_refused_with_a_diff(tmp_path, config):
    r = preload(str(config), str(make_bundle(tmp_path, "2", tag="two", golden_v="one")))
    assert not r.ok
    (g,) = r.golden
    assert (g.case, g.stage) == ("golden/basic.yaml", "response")
    assert '-  "v": "one"' in g.diff and '+  "v": "two"' in g.diff
    assert "golden case golden/basic.yaml (route summarize) failed at response" in r.reason


def test_a_missing_output_path_is_a_status_mismatch(tmp_path, config):
    zip_ = make_bundle(tmp_path, "3", doc="routes:\n  summarize:\n    transform: '{\"s\": $.output.missing}'\n")
    r = preload(str(config), str(zip_))
    assert not r.ok and r.golden[0].stage == "status" and "expected status 200, got 502" in r.golden[0].diff


def test_a_bundle_for_a_route_the_config_lacks_or_without_golden_cases_is_refused(tmp_path, config):
    r = preload(str(config), str(make_bundle(tmp_path, "4", route="nope")))
    assert not r.ok and any("the config has no route 'nope'" in p for p in r.problems), r
    r = preload(str(config), str(make_bundle(tmp_path, "5", golden=False)))
    assert not r.ok and any("no golden case for this route" in p for p in r.problems), r


def test_a_bundle_the_config_does_not_declare_is_refused_by_its_compile(tmp_path, config):
    r = preload(str(config), str(make_bundle(tmp_path, "1", name="other")))
    assert not r.ok and any("which spec.bundles does not declare" in p for p in r.problems), r


def test_a_bundle_over_the_time_limit_is_refused_and_names_the_sandbox(tmp_path, config):
    r = preload(str(config), str(make_bundle(tmp_path, "1")), limits=SandboxLimits(wall_seconds=0.01))
    assert not r.ok and r.sandbox.startswith("timeout:") and "preload sandbox: timeout" in r.reason


@pytest.mark.parametrize("example", sorted(p.name for p in (REPO / "examples").glob("*.yaml")))
def test_the_default_limits_hold_the_compile_of_every_example(example):
    """The address-space limit (1 GiB) is far above what a compile needs (about 60 MB here)."""
    r = run_sandboxed(T + "compile_peak", {"config": str(REPO / "examples" / example)})
    assert r.ok, r
    print(f"{example}: compile peak {r.value['vm_peak_kb'] // 1024} MiB of virtual memory in the sandbox")
    assert r.value["vm_peak_kb"] * 1024 < SandboxLimits().address_space
