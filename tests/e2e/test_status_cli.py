"""`adapterctl status` against a running stack: every worker's generation, each backend's endpoints with
the gateway-wide in-flight numbers and the engine's live signals (scraped from the OpenAI API simulators),
an endpoint that does not answer shown as unreachable, rollouts; `--json` for scripts; exit 3 when the
supervisor cannot be reached."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.conftest import REPO

pytestmark = pytest.mark.e2e
CONFIG = REPO / "examples" / "canary.yaml"


def status(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "extproc", "status", *args], cwd=REPO, capture_output=True,
                          text=True, timeout=60)


def test_status_reports_workers_endpoints_signals_and_rollouts(stack_factory):
    st = stack_factory(CONFIG, simulate=True)
    r = status("--json", "--admin", st.processor_admin_url)
    assert r.returncode == 0, r.stderr
    doc = json.loads(r.stdout)
    workers = doc["config"]["workers"]
    assert len(workers) == 2 and all(w["ready"] and w["generation"] == doc["config"]["generation"] for w in workers)
    backends = {b["name"]: b for b in doc["backends"]}
    assert set(backends) == {"llama-stable", "llama-canary"}
    for b in backends.values():
        (ep,) = b["endpoints"]
        assert ep["in_flight"] == {"requests": 0, "tokens": 0, "prefill_tokens": 0}
        assert ep["engine"] == "vllm" and ep["signals"]["queue"] == 0 and "kv_usage" in ep["signals"]
    ro = doc["rollouts"]["llama-v2"]
    assert ro["arms"]["canary"]["weight_percent"] == 10 and ro["manual"] is True
    text = status("--admin", st.processor_admin_url)
    assert text.returncode == 0 and "worker 1:" in text.stdout and "llama-v2:" in text.stdout
    assert "queue=0" in text.stdout


def test_status_of_a_supervisor_that_is_not_there_exits_3():
    r = status("--admin", "http://127.0.0.1:1")
    assert r.returncode == 3 and "cannot be reached" in r.stderr
