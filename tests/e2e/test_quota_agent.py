"""Admission control with the real tenant agent: a CPU burner in a tenant's cgroup gets it 429s.

Needs root (the agent creates cgroups); it uses eBPF when BCC loads, else the agent's polling
fallback. 429s must start within two of the agent's windows of the tenant going over its quota, and
stop within two windows (and a half) of it recovering, while another tenant is unaffected. Windows
are counted in the agent's own publications (a snapshot every `interval`, `window / interval` of them
per window), not in seconds: on a busy machine the agent and the gateway slow down together.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time

import httpx
import pytest

from tests.promtext import wait_samples

pytestmark = pytest.mark.e2e
MARKER = f"agw-burner-{os.getpid()}"  # the burner's command line names it; the config's pattern finds it

if os.geteuid() != 0:
    pytest.skip("the tenant agent creates cgroups: needs root", allow_module_level=True)


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    from tests.e2e.conftest import make_stack

    base = tmp_path_factory.mktemp("quota")
    cfg = base / "gateway.yaml"
    cfg.write_text(f"""
apiVersion: adapter.ai/v1
kind: AdapterGateway
metadata: {{name: quota-e2e}}
spec:
  modelRef: qwen2.5-finance
  tenancy: {{snapshot: {base / "agent.snap"}, staleAfter: 3s}}
  tenants:
    - {{id: busy, cpu: {{limit: 0.2}}, processes: ["*{MARKER}*"]}}
    - {{id: calm, cpu: {{limit: 1}}}}
  backends: [{{name: llm, endpoints: ["llm.invalid:8000"]}}]
  routes: [{{path: /v1/completions, kind: openai, policy: {{tenantHeader: x-team}}}}]
""")
    st = make_stack(cfg, simulate=True, agent=True, agent_name=f"agw-e2e-{os.getpid()}")
    st.start()
    yield st
    st.stop()


ANSWERS: dict[tuple[str, int], int] = {}  # (tenant, status) -> responses seen, for the admission counters


def ask(stack, team: str) -> httpx.Response:
    r = httpx.post(f"{stack.url}/v1/completions", headers={"x-team": team}, timeout=10,
                   json={"model": "qwen2.5-finance", "prompt": "q", "max_tokens": 1})
    ANSWERS[team, r.status_code] = ANSWERS.get((team, r.status_code), 0) + 1
    return r


def wait_for(stack, reader, team: str, status: int, limit: int) -> int:
    """Ask until the answer is `status`; returns how many snapshots the agent published from the call
    until the request that got it was sent. Fails past `limit` publications (or, should the agent
    stop publishing, after 60 s)."""
    start = reader.current().generation
    hang = time.monotonic() + 60
    while True:
        sent_at = reader.current().generation
        if ask(stack, team).status_code == status:
            return sent_at - start
        assert sent_at - start <= limit and time.monotonic() < hang, \
            f"tenant {team} did not get {status} within {limit} agent publications"
        time.sleep(0.05)


def test_over_quota_tenant_is_refused_and_recovers(stack):
    from ebpf.cgroups import CgroupManager
    from ebpf.snapshot import SnapshotReader

    reader = SnapshotReader(stack.snapshot.tenancy.snapshot, recheck_s=0)
    per_window = reader.current().window_ns // reader.current().interval_ns  # 10: 1 s windows, 100 ms apart
    assert ask(stack, "busy").status_code == 200 and ask(stack, "calm").status_code == 200
    burner = subprocess.Popen([sys.executable, "-c", "while True: pass", MARKER])
    try:
        # the agent places the process named in the config (tenants[].processes) in the cgroup
        cgroups = CgroupManager(stack.agent_name)
        deadline = time.monotonic() + 5
        while burner.pid not in cgroups.procs("busy"):
            assert time.monotonic() < deadline, "the agent did not place the tenant's process"
            time.sleep(0.02)
        wait_for(stack, reader, "busy", 429, 2 * per_window)  # within two windows of going over
        r = ask(stack, "busy")
        assert r.status_code == 429 and r.json()["error"]["tenant"] == "busy" and "retry-after" in r.headers
        assert ask(stack, "calm").status_code == 200  # the other tenant is unaffected
    finally:
        burner.kill()
        burner.wait()
    wait_for(stack, reader, "busy", 200, 2 * per_window + per_window // 2)  # 429s end within 2.5 windows
    # every answer counted once, by tenant and result: a 429 is `rejected`, a 200 `admitted` (or `stale`
    # had the agent's snapshot aged past staleAfter, which it must not here)
    assert set(ANSWERS) <= {(t, c) for t in ("busy", "calm") for c in (200, 429)}, ANSWERS
    want = {(("result", "rejected" if c == 429 else "admitted"), ("tenant", t)): float(n) for (t, c), n in ANSWERS.items()}
    url = f"{stack.processor_admin_url}/metrics"
    got = wait_samples(url, lambda s: s.series("adapter_processor_admission_total") == want)
    assert got.series("adapter_processor_admission_total") == want
    assert ANSWERS["busy", 429] >= 1 and ANSWERS.get(("calm", 429), 0) == 0
