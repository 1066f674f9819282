"""A (re)started worker holds the bundles published before the current one (issue 12: a worker
restarted during a reload refused Envoy's streams of the previous digest with config_mismatch).
Real bundles in a real bundle root (extproc/config/bundle.py), the worker's own loading code
(extproc/server.py) and ConfigRef (extproc/stream.py); tests/e2e/test_restart_reload.py runs the
race itself through Envoy."""

from __future__ import annotations

import shutil

import pytest

from extproc.config.bundle import KEEP, current_bundle, previous_bundles, publish
from extproc.server import WorkerSettings, _previous_snapshots
from extproc.stream import KEEP_SNAPSHOTS, ConfigRef
from tests.e2e.test_reliability import Topology, write_config

pytestmark = pytest.mark.integration


def generations(tmp_path, n: int):
    cfg = tmp_path / "gw.yaml"
    root = tmp_path / "bundles"
    bundles = []
    for g in range(1, n + 1):  # every generation another digest (its route timeout)
        write_config(cfg, Topology(["127.0.0.1:9"], ["127.0.0.1:10"], timeout=f"{10 + g}s"))
        bundles.append(publish(root, cfg, g))
    return root, bundles


def test_previous_bundles_are_the_newest_before_the_current_one(tmp_path):
    root, bundles = generations(tmp_path, KEEP + 1)  # the oldest is pruned
    assert current_bundle(root) == bundles[-1].path
    assert previous_bundles(root, KEEP_SNAPSHOTS - 1) == [b.path for b in reversed(bundles[-KEEP_SNAPSHOTS:-1])]
    assert previous_bundles(root, 100) == [b.path for b in reversed(bundles[-KEEP:-1])]  # what prune left
    assert previous_bundles(root, 0) == []


def test_a_starting_worker_knows_the_previous_digests_and_skips_a_broken_bundle(tmp_path):
    root, bundles = generations(tmp_path, 4)
    shutil.rmtree(bundles[1].path / "files", ignore_errors=True)
    (bundles[1].path / "config.yaml").unlink()  # generation 2 cannot be loaded any more
    settings = WorkerSettings(config_path="", address="127.0.0.1", port=0, bundle_root=str(root))
    current = bundles[-1].snapshot
    older = _previous_snapshots(settings, current)
    assert [s.generation for s in older] == [3, 1]
    ref = ConfigRef(current, older)
    assert ref.digests == (current.digest, bundles[2].digest, bundles[0].digest)
    assert ref.current is current and ref.resolve(None) is current
    assert ref.resolve(bundles[2].digest).generation == 3 and ref.resolve(bundles[1].digest) is None
    # later swaps keep at most KEEP_SNAPSHOTS, as in a worker that never restarted
    d = [b.digest for b in bundles]
    ref.swap(bundles[1].snapshot)
    assert ref.digests == (d[1], d[3], d[2], d[0])
    ref.swap(bundles[0].snapshot)  # already held: becomes current again
    assert ref.digests == (d[0], d[1], d[3], d[2]) and ref.current.generation == 1


def test_without_a_bundle_root_nothing_else_is_loaded(tmp_path):
    _root, bundles = generations(tmp_path, 2)
    settings = WorkerSettings(config_path=str(tmp_path / "gw.yaml"), address="127.0.0.1", port=0)
    assert _previous_snapshots(settings, bundles[-1].snapshot) == []
    assert ConfigRef(bundles[-1].snapshot).digests == (bundles[-1].digest,)
