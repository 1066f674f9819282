"""Config bundles: publish once, load the same everywhere, from copies; one digest; pruning; clear failures."""

from __future__ import annotations

import json
import os
import shutil

import pytest

from extproc.config.bundle import (CURRENT, BundleError, current_bundle, load_bundle, prune, publish,
                                   read_manifest)
from extproc.config.loader import ConfigError, config_digest, load_file
from tests.conftest import DATA

CONFIG = """\
apiVersion: adapter.ai/v1
kind: AdapterGateway
metadata: {name: tools}
spec:
  backends:
    - {name: petstore, kind: rest, endpoints: ["127.0.0.1:18999"]}
    - {name: llm, endpoints: ["127.0.0.1:18998"]}
  routes:
    - {path: /tools/petstore, kind: tool, target: petstore, openapi: pets.yaml}
    - {path: /orders, kind: rest, target: petstore, mapping: sub/orders-mapping.yaml}
    - {path: /v1/chat/completions, target: llm}
"""
OVERRIDES = {"llm": (("127.0.0.1", 4242),)}


@pytest.fixture
def cfg(tmp_path):
    shutil.copy(DATA / "openapi" / "petstore.yaml", tmp_path / "pets.yaml")
    (tmp_path / "sub").mkdir()
    shutil.copy(DATA / "contract" / "rest-mapping.yaml", tmp_path / "sub" / "orders-mapping.yaml")
    p = tmp_path / "gateway.yaml"
    p.write_text(CONFIG)
    return p


def tools(snap) -> list[str]:
    return [t.name for t in snap.routes["tools-petstore"].tools.tools]


def test_publish_writes_an_immutable_bundle_and_points_current_at_it(cfg, tmp_path):
    root = tmp_path / "bundles"
    b = publish(root, cfg, 1, OVERRIDES)
    assert b.path == root / f"1-{b.digest}" and os.readlink(root / CURRENT) == b.path.name
    assert current_bundle(root) == b.path
    m = read_manifest(b.path)
    assert m["generation"] == 1 and m["digest"] == b.digest and m["source"] == str(cfg)
    assert m["endpoints"] == {"llm": [["127.0.0.1", 4242]]}
    assert m["files"] == {"pets.yaml": "files/0-pets.yaml", "sub/orders-mapping.yaml": "files/1-orders-mapping.yaml"}
    assert (b.path / "config.yaml").read_text() == CONFIG
    assert (b.path / "files/0-pets.yaml").read_bytes() == (tmp_path / "pets.yaml").read_bytes()
    # one digest, however the config is loaded: from the file, from the bundle, by the function
    snap = load_bundle(b.path)
    assert snap.digest == b.digest == load_file(cfg, endpoints=OVERRIDES).digest == b.snapshot.digest
    files = {"pets.yaml": (tmp_path / "pets.yaml").read_bytes(),
             "sub/orders-mapping.yaml": (tmp_path / "sub/orders-mapping.yaml").read_bytes()}
    assert b.digest == config_digest(CONFIG, files, OVERRIDES)
    assert snap.generation == 1 and snap.source == str(cfg)  # messages name the original file
    assert snap.backends["llm"].endpoints == (("127.0.0.1", 4242),)


def test_the_digest_covers_referenced_files_and_overrides(cfg, tmp_path):
    base = load_file(cfg).digest
    assert load_file(cfg, endpoints=OVERRIDES).digest != base
    pets = tmp_path / "pets.yaml"
    pets.write_text(pets.read_text().replace("listPets", "listAnimals"))
    assert load_file(cfg).digest != base


def test_a_bundle_serves_its_copies_not_the_edited_originals(cfg, tmp_path):
    root = tmp_path / "bundles"
    b = publish(root, cfg, 1)
    pets = tmp_path / "pets.yaml"
    pets.write_text(pets.read_text().replace("listPets", "listAnimals"))
    assert "listAnimals" in tools(load_file(cfg))
    again = load_bundle(current_bundle(root))
    assert "listPets" in tools(again) and "listAnimals" not in tools(again)
    assert again.digest == b.digest


def test_a_refused_config_publishes_nothing(cfg, tmp_path):
    root = tmp_path / "bundles"
    first = publish(root, cfg, 1)
    cfg.write_text(CONFIG.replace("  routes:\n", "  nonsense: 1\n  routes:\n"))
    with pytest.raises(ConfigError) as e:
        publish(root, cfg, 2)
    assert f"{cfg}:8: spec.nonsense: unknown field" in str(e.value)
    cfg.write_text(CONFIG.replace("pets.yaml", "missing.yaml"))  # compiles only after copying: still nothing
    with pytest.raises(ConfigError) as e:
        publish(root, cfg, 2)
    assert f"{cfg}:9: spec.routes[0].openapi: missing.yaml" in str(e.value)
    assert sorted(p.name for p in root.iterdir()) == [first.path.name, CURRENT]
    assert current_bundle(root) == first.path


def test_unchanged_content_is_not_published_again(cfg, tmp_path):
    root = tmp_path / "bundles"
    first = publish(root, cfg, 1)
    assert publish(root, cfg, 2, unchanged=first.digest) is None
    assert current_bundle(root) == first.path


def test_pruning_keeps_the_last_five_and_the_current_one(cfg, tmp_path):
    root = tmp_path / "bundles"
    published = []
    for g in range(1, 8):
        cfg.write_text(CONFIG + f"# edit {g}\n")
        published.append(publish(root, cfg, g))
        os.utime(published[-1].path, (g, g))  # publication order, whatever the clock's resolution
    kept = sorted(p.name for p in root.iterdir() if p.name != CURRENT)
    assert kept == sorted(b.path.name for b in published[2:])
    assert current_bundle(root) == published[-1].path
    os.utime(published[-1].path, (0, 0))  # the current bundle is never pruned, even when oldest
    prune(root, keep=1)
    assert sorted(p.name for p in root.iterdir() if p.name != CURRENT) == sorted(
        {published[-1].path.name, published[-2].path.name})


def test_loading_a_bundle_whose_files_are_missing_fails_clearly(cfg, tmp_path):
    b = publish(tmp_path / "bundles", cfg, 1)
    (b.path / "files/0-pets.yaml").unlink()
    with pytest.raises(BundleError) as e:
        load_bundle(b.path)
    assert "copied file(s) missing: files/0-pets.yaml (for 'pets.yaml')" in str(e.value)
    assert str(b.path) in str(e.value)
    (b.path / "manifest.json").write_text("{not json")
    with pytest.raises(BundleError, match="manifest.json is not JSON"):
        load_bundle(b.path)
    (b.path / "manifest.json").unlink()
    with pytest.raises(BundleError, match="cannot read manifest.json"):
        load_bundle(b.path)


def test_a_tampered_bundle_does_not_match_its_digest(cfg, tmp_path):
    b = publish(tmp_path / "bundles", cfg, 1)
    m = read_manifest(b.path)
    m["endpoints"] = {"llm": [["127.0.0.1", 1]]}
    (b.path / "manifest.json").write_text(json.dumps(m))
    with pytest.raises(BundleError, match="the manifest says"):
        load_bundle(b.path)
