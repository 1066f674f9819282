"""Adapter bundles and rolling restarts through the real Envoy, processor workers and an OpenAI-API
simulator (issue 11 item 3):

- `adapterctl bundle load` of a bundle that passes its sandboxed preload changes a route's mapping
  (the transform's constant `v`) while a small load runs, with no failed request; a bundle whose golden
  case fails is refused and changes nothing: the requests still see the old mapping; a newer version
  and then the first one again (loaded anew: the way back) follow, still with no failed request.
- A rollout whose arms are two versions of one bundle splits by the sticky key: each user always gets
  the arm its hash says, the arm's mapping and `x-adapter-variant: <rollout>/<arm>`.
- `adapterctl restart --rolling` replaces both workers under load with 0 failed requests.
"""

from __future__ import annotations

import json
import threading
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

from canary.assign import arm_at, bucket
from extproc.cli import main
from tests.canary.adapter_bundles import make_bundle

pytestmark = pytest.mark.e2e

BODY = {"query": "hello"}


def write(path: Path) -> Path:
    make_bundle(path.parent, "1", name="split", route="split", tag="s1")
    make_bundle(path.parent, "2", name="split", route="split", tag="s2")
    doc = {
        "apiVersion": "adapter.ai/v1", "kind": "AdapterGateway", "metadata": {"name": "bundles-e2e"},
        "spec": {
            "processor": {"stateDir": "state"},
            "backends": [{"name": "llm", "models": ["m"], "endpoints": ["llm:8000"]}],
            "routes": [
                {"path": "/summarize", "name": "summarize", "kind": "llm", "target": "llm",
                 "transform": '{"summary": $.output.text, "v": "file"}'},
                {"path": "/split", "name": "split", "kind": "llm", "target": "llm",
                 "transform": '{"summary": $.output.text, "v": "file"}'},
            ],
            "bundles": [{"name": "summ"}, {"path": "split-1.zip"}, {"path": "split-2.zip"}],
            "rollouts": [{"name": "ro", "route": "split",
                          "arms": [{"name": "v1", "bundle": "split@1"}, {"name": "v2", "bundle": "split@2",
                                                                         "weight": 50}],
                          "key": {"sources": [{"header": "x-user-id"}], "trustedHeaders": ["x-user-id"]}}],
        },
    }
    path.write_text(json.dumps(doc, indent=1))
    return path


class Load:
    """Requests from a few threads until stopped: status codes and the mapping version (`v`) counted."""

    def __init__(self, url: str, path: str, threads: int = 3):
        self.url, self.path = url, path
        self.codes: Counter = Counter()
        self.versions: list[str] = []
        self._stop = threading.Event()
        self._pool = ThreadPoolExecutor(threads)
        self._futures = [self._pool.submit(self._run, i) for i in range(threads)]

    def _run(self, i: int) -> None:
        with httpx.Client(timeout=20) as client:
            n = 0
            while not self._stop.is_set():
                n += 1
                try:
                    r = client.post(f"{self.url}{self.path}", json=BODY, headers={"x-user-id": f"t{i}-{n % 50}"})
                    self.codes[r.status_code] += 1
                    if r.status_code == 200:
                        self.versions.append(r.json().get("v"))
                except httpx.HTTPError as e:
                    self.codes[type(e).__name__] += 1

    def stop(self) -> None:
        self._stop.set()
        for f in self._futures:
            f.result()
        self._pool.shutdown()


def v(st, path: str = "/summarize", **headers) -> tuple[str, str | None]:
    r = httpx.post(f"{st.url}{path}", json=BODY, headers=headers, timeout=20)
    assert r.status_code == 200, r.text
    return r.json()["v"], r.headers.get("x-adapter-variant")


def test_a_loaded_bundle_changes_the_mapping_under_load_and_a_refused_one_changes_nothing(
        tmp_path, stack_factory, capsys):
    cfg = write(tmp_path / "gw.yaml")
    st = stack_factory(cfg, workers=2, simulate=True, run_dir=str(tmp_path / "run"))
    admin = st.processor_admin_url
    assert v(st) == ("file", None)
    load = Load(st.url, "/summarize")
    try:
        code = main(["bundle", "load", str(make_bundle(tmp_path, "1", tag="one")), "--admin", admin])
        out = capsys.readouterr()
        assert code == 0, out.err
        assert v(st)[0] == "one"  # the load answers once every worker and Envoy have the generation
        generation = st.supervisor.snapshot.generation
        code = main(["bundle", "load", str(make_bundle(tmp_path, "2", tag="two", golden_v="one")), "--admin", admin])
        err = capsys.readouterr().err
        assert code == 1 and "failed at response" in err and '+  "v": "two"' in err
        assert st.supervisor.snapshot.generation == generation
        assert v(st)[0] == "one"
        refused_at = len(load.versions)
        # a newer version, then back to the first by loading it again (there is no unload)
        for bundle, want in ((make_bundle(tmp_path, "3", tag="three"), "three"), (tmp_path / "summ-1.zip", "one")):
            code = main(["bundle", "load", str(bundle), "--admin", admin])
            assert code == 0, capsys.readouterr().err
            assert v(st)[0] == want
        assert st.supervisor.snapshot.generation == generation + 2
    finally:
        load.stop()
    print(f"bundle loads under load: {dict(load.codes)}")
    assert dict(load.codes) == {200: sum(load.codes.values())}, load.codes  # 0 failed requests
    seen = load.versions
    assert set(seen[:refused_at]) <= {"file", "one"} and "one" in seen  # never the refused mapping
    assert "two" not in seen and "three" in seen


def test_bundle_arms_split_by_the_sticky_key_and_a_rolling_restart_fails_no_request(tmp_path, stack_factory, capsys):
    cfg = write(tmp_path / "gw.yaml")
    st = stack_factory(cfg, workers=2, simulate=True, run_dir=str(tmp_path / "run"))
    rollout = st.supervisor.snapshot.rollouts["ro"].rollout
    arms = Counter()
    for i in range(40):
        user = f"user-{i}"
        want = arm_at(rollout, bucket(rollout.hash_salt, user))
        got = {v(st, "/split", **{"x-user-id": user}) for _ in range(2)}
        assert got == {({"v1": "s1", "v2": "s2"}[want], f"ro/{want}")}, (user, got)  # sticky, the arm's mapping
        arms[want] += 1
    assert arms["v1"] > 0 and arms["v2"] > 0

    load = Load(st.url, "/split")
    try:
        pids = st.supervisor.pids
        code = main(["restart", "--rolling", "--admin", st.processor_admin_url])
        out = capsys.readouterr().out
        assert code == 0 and out.count("drained in") == 2, out
        assert not set(st.supervisor.pids) & set(pids)
    finally:
        load.stop()
    print(f"rolling restart under load: {dict(load.codes)}; {out.strip()}")
    assert dict(load.codes) == {200: sum(load.codes.values())}, load.codes  # 0 failed requests
    assert sum(load.codes.values()) > 0 and set(load.versions) == {"s1", "s2"}
