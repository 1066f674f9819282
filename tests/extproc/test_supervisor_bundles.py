"""Loading adapter bundles into a real supervisor (real workers, no Envoy): `adapterctl bundle load`
publishes a bundle that passes the sandboxed preload as the next generation every worker serves; a
refused one (golden mismatch, tampered, unsigned where a key is required) changes nothing; loaded
bundles survive a supervisor restart (state dir); `adapterctl restart --rolling` replaces every worker."""

from __future__ import annotations

import json
import zipfile

import httpx
import pytest

from extproc.cli import main
from extproc.stack import free_port, free_port_block
from extproc.supervisor import Supervisor
from tests.canary.adapter_bundles import make_bundle
from tests.canary.test_bundle import write_keypair

CONFIG = """\
apiVersion: adapter.ai/v1
kind: AdapterGateway
metadata: {{name: bundle-load}}
spec:
  processor: {{adminPort: {admin}, stateDir: {state}}}
  backends:
    - {{name: llm, endpoints: ["127.0.0.1:9"], models: [m]}}
  routes:
    - {{path: /summarize, name: summarize, kind: llm, target: llm, transform: '{{"summary": $.output.text}}'}}
  bundles:
    - {{name: summ{key}}}
"""


@pytest.fixture
def gateway(tmp_path):
    admin = free_port()
    cfg = tmp_path / "gw.yaml"
    started: list[Supervisor] = []

    def start(key: str = "") -> Supervisor:
        cfg.write_text(CONFIG.format(admin=admin, state=tmp_path / "state", key=key))
        sup = Supervisor(str(cfg), "127.0.0.1", free_port_block(2), 2, admin, shutdown_grace=1.0)
        started.append(sup)
        sup.start()
        return sup

    yield tmp_path, f"http://127.0.0.1:{admin}", start
    for sup in started:
        sup.stop()


def summary(sup: Supervisor) -> bytes:
    return sup.snapshot.routes["summarize"].transform.render_json({"output": {"text": "hi"}, "input": {}})


def load(capsys, url: str, path) -> tuple[int, str, str]:
    code = main(["bundle", "load", str(path), "--admin", url])
    out = capsys.readouterr()
    return code, out.out, out.err


def test_load_refuse_restart_and_rolling_restart(gateway, capsys):
    tmp, url, start = gateway
    sup = start()
    assert summary(sup) == b'{"summary":"hi"}' and sup.snapshot.generation == 1

    code, out, err = load(capsys, url, make_bundle(tmp, "1", tag="one"))
    assert code == 0, err
    assert "loaded summ@1" in out and "1 golden cases passed in the sandbox" in out and "generation 2" in out
    assert summary(sup) == b'{"summary":"hi","v":"one"}'
    assert set(sup.worker_generations().values()) == {2}  # every worker acknowledged it
    assert json.loads((tmp / "state" / "bundles" / "loaded.json").read_text())[0].startswith("summ@1-")

    # a golden mismatch: refused with the diff, nothing changes
    code, _, err = load(capsys, url, make_bundle(tmp, "2", tag="two", golden_v="one"))
    assert code == 1
    assert "refused" in err and "at preload" in err and "keeping generation 2" in err
    assert "golden case golden/basic.yaml (route summarize) failed at response" in err and '+  "v": "two"' in err
    assert sup.snapshot.generation == 2 and summary(sup) == b'{"summary":"hi","v":"one"}'

    # tampered after build: refused at verify
    good = make_bundle(tmp, "3", tag="three")
    bad = tmp / "tampered.zip"
    with zipfile.ZipFile(good) as zin, zipfile.ZipFile(bad, "w") as zout:
        for info in zin.infolist():
            data = zin.read(info)
            zout.writestr(info, data.replace(b"three", b"evil!") if info.filename == "bundle.yaml" else data)
    code, _, err = load(capsys, url, bad)
    assert code == 1 and "at verify" in err and "bundle.yaml: sha256: content hashes to" in err
    assert sup.snapshot.generation == 2

    # a new good version replaces the active one
    code, _, err = load(capsys, url, good)
    assert code == 0, err
    assert summary(sup) == b'{"summary":"hi","v":"three"}' and sup.snapshot.generation == 3
    doc = httpx.get(url + "/bundles").json()
    assert doc["active"] == {"summ": "summ@3"} and doc["routes"] == {"summarize": "summ@3"}
    assert sorted(doc["bundles"]) == ["summ@1", "summ@3"]

    # rolling restart: new processes, the same generation
    pids = sup.pids
    code = main(["restart", "--rolling", "--admin", url])
    out = capsys.readouterr().out
    assert code == 0 and out.count("drained in") == 2
    assert not set(sup.pids) & set(pids) and set(sup.worker_generations().values()) == {3}
    assert all(w.restarts == 0 for w in sup.workers)  # planned, not counted as crashes

    # a restarted supervisor serves the loaded bundles again (from the state dir)
    sup.stop()
    sup2 = start()
    assert summary(sup2) == b'{"summary":"hi","v":"three"}'
    assert sup2.snapshot.active_bundles == {"summ": "summ@3"}


def test_a_key_in_the_config_refuses_unsigned_and_foreign_bundles(gateway, capsys):
    tmp, url, start = gateway
    priv, pub = write_keypair(tmp, "ops")
    other, _ = write_keypair(tmp, "other")
    sup = start(key=f", publicKey: {pub}")
    code, _, err = load(capsys, url, make_bundle(tmp, "1"))
    assert code == 1 and "manifest.sig: signature: is missing" in err
    code, _, err = load(capsys, url, make_bundle(tmp, "2", sign_key=other))
    assert code == 1 and "does not verify with the given public key" in err
    assert sup.snapshot.generation == 1 and sup.snapshot.bundles == {}
    code, _, err = load(capsys, url, make_bundle(tmp, "3", sign_key=priv, tag="signed"))
    assert code == 0, err
    assert summary(sup) == b'{"summary":"hi","v":"signed"}' and sup.snapshot.bundles["summ@3"].signed


def test_an_unreachable_supervisor_is_exit_4(capsys, tmp_path):
    code, _, err = load(capsys, f"http://127.0.0.1:{free_port()}", make_bundle(tmp_path, "1"))
    assert code == 4 and "unreachable" in err


def test_a_config_file_that_no_longer_compiles_refuses_the_load_at_publish(gateway, capsys):
    tmp, url, start = gateway
    sup = start()
    cfg = tmp / "gw.yaml"
    good = cfg.read_text()
    cfg.write_text(good.replace("routes:", "routez:"))  # an edit saved, not reloaded: a bundle load publishes it
    code, _, err = load(capsys, url, make_bundle(tmp, "1", tag="one"))
    assert code == 1 and ("at preload" in err or "at publish" in err) and "routez" in err, err
    assert sup.snapshot.generation == 1 and sup.snapshot.bundles == {}
    assert not (tmp / "state" / "bundles" / "loaded.json").exists() or \
        json.loads((tmp / "state" / "bundles" / "loaded.json").read_text()) == []
    cfg.write_text(good)
    code, _, err = load(capsys, url, make_bundle(tmp, "1", tag="one"))
    assert code == 0, err


def test_bundles_the_config_file_names_pass_their_golden_cases_before_they_are_published(gateway, capsys):
    tmp, url, start = gateway
    make_bundle(tmp, "1", tag="one", golden_v="wrong")
    with pytest.raises(Exception) as e:  # generation 1 does not start with a failing bundle
        start(key=", path: summ-1.zip")
    assert "spec.bundles: refused by the preload sandbox" in str(e.value)
    assert "golden case summ-1.zip: golden/basic.yaml (route summarize) failed at response" in str(e.value)
    make_bundle(tmp, "1", tag="one")  # fixed in place
    sup = start(key=", path: summ-1.zip")
    assert summary(sup) == b'{"summary":"hi","v":"one"}'
    make_bundle(tmp, "1", tag="two", golden_v="one")  # the same file replaced by a failing build: reload refused
    r = sup.reload()
    assert not r.accepted and "failed at response" in r.errors and '+  "v": "two"' in r.errors
    assert summary(sup) == b'{"summary":"hi","v":"one"}'
    make_bundle(tmp, "1", tag="two")
    assert sup.reload().accepted and summary(sup) == b'{"summary":"hi","v":"two"}'
