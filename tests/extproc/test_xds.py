"""Envoy's dynamic resources as files: layout, make-before-break order, skipped rewrites, Envoy's validation."""

from __future__ import annotations

import json

import pytest
import yaml

from extproc.config.loader import load_file
from extproc.envoy_render import ALS_CLUSTER_PREFIX, PROCESSOR_CLUSTER, ROUTE_CONFIG_NAME
from extproc.xds import (CDS_FILE, LDS_FILE, RDS_FILE, XdsError, XdsStep, XdsWriter, envoy_validate, inline_files,
                         render_bootstrap, render_resources, subscription_stat)
from tests.conftest import BRIEF_EXAMPLE
from tests.extproc.test_envoy_render import EXAMPLES

GATEWAY = """
    apiVersion: adapter.ai/v1
    kind: AdapterGateway
    metadata: {{name: t}}
    spec:
      backends:
{backends}
      routes:
{routes}
    """


def snap_of(write_config, backends: dict[str, list[str]], routes: dict[str, str]):
    b = "\n".join(f"        - {{name: {n}, endpoints: {json.dumps(eps)}}}" for n, eps in backends.items())
    r = "\n".join(f"        - {{path: {p}, target: {t}}}" for p, t in routes.items())
    return load_file(write_config(GATEWAY.format(backends=b, routes=r)))


def cluster_names(path) -> list[str]:
    return [c["name"] for c in yaml.safe_load(path.read_text())["resources"]]


def route_clusters(path) -> set[str]:
    routes = yaml.safe_load(path.read_text())["resources"][0]["virtual_hosts"][0]["routes"]
    return {r["route"]["cluster"] for r in routes if "route" in r}


def test_ip_backends_use_eds_host_names_stay_inline_and_routes_come_from_rds(write_config, tmp_path):
    snap = snap_of(write_config, {"ips": ["10.0.0.1:80", "10.0.0.2:80"], "named": ["model-server:80"]},
                   {"/i": "ips", "/n": "named"})
    res = render_resources(snap, 2, tmp_path)
    assert list(res.files()) == ["eds-ips.yaml", CDS_FILE, RDS_FILE, LDS_FILE]
    clusters = {c["name"]: c for c in res.clusters}
    eds = clusters["ips"]["eds_cluster_config"]["eds_config"]
    assert clusters["ips"]["type"] == "EDS" and "load_assignment" not in clusters["ips"]
    assert eds["path_config_source"] == {"path": f"{tmp_path}/eds-ips.yaml", "watched_directory": {"path": str(tmp_path)}}
    assert clusters["named"]["type"] == "STRICT_DNS" and clusters["named"]["load_assignment"]["endpoints"]
    assert set(res.endpoints) == {"ips"} and len(res.endpoints["ips"]["endpoints"][0]["lb_endpoints"]) == 2
    hcm = res.listeners[0]["filter_chains"][0]["filters"][0]["typed_config"]
    assert "route_config" not in hcm
    assert hcm["rds"]["route_config_name"] == ROUTE_CONFIG_NAME == res.route_configs[0]["name"]
    assert hcm["rds"]["config_source"]["path_config_source"]["path"] == f"{tmp_path}/rds.yaml"
    assert hcm["rds"]["config_source"]["resource_api_version"] == "V3"


def test_bootstrap_has_processor_side_clusters_static_and_the_rest_from_files(tmp_path):
    boot = render_bootstrap(load_file(BRIEF_EXAMPLE), 3, tmp_path)
    assert [c["name"] for c in boot["static_resources"]["clusters"]] == [
        PROCESSOR_CLUSTER, *(f"{ALS_CLUSTER_PREFIX}{i}" for i in range(3))]
    assert "listeners" not in boot["static_resources"]
    dyn = boot["dynamic_resources"]
    for key, name in (("lds_config", "lds.yaml"), ("cds_config", "cds.yaml")):
        assert dyn[key] == {"path_config_source": {"path": f"{tmp_path}/{name}",
                                                   "watched_directory": {"path": str(tmp_path)}},
                            "resource_api_version": "V3"}
    assert {"node", "admin", "overload_manager"} <= set(boot)


class Recorder:
    """An ack that records, at each step, what Envoy would read from the directory then."""

    def __init__(self, d, fail_at: str | None = None):
        self.dir, self.fail_at, self.seen = d, fail_at, []

    def __call__(self, step):
        self.seen.append((str(step), dict(step.files), cluster_names(self.dir / CDS_FILE),
                          route_clusters(self.dir / RDS_FILE),
                          sorted(p.name for p in self.dir.glob("eds-*.yaml"))))
        if step == self.fail_at:
            raise XdsError(f"refused in {step}")


def test_make_before_break_clusters_then_routes_then_prune(write_config, tmp_path):
    d = tmp_path / "xds"
    old = snap_of(write_config, {"a": ["10.0.0.1:80"]}, {"/x": "a"})
    new = snap_of(write_config, {"c": ["10.0.0.3:80"]}, {"/x": "c"})  # a renamed c: a cluster swap
    writer = XdsWriter(d)
    first = writer.write(old, 1, wait=False)
    assert first.steps == ("clusters", "routes") and not first.removed
    writer.ack = ack = Recorder(d)
    result = writer.write(new, 1)
    assert [s[0] for s in ack.seen] == ["clusters", "routes", "prune"] == list(result.steps)
    clusters, routes, prune = ack.seen
    assert set(clusters[1]) == {"eds-c.yaml", CDS_FILE}
    assert clusters[2] == ["c", "a"] and clusters[3] == {"a"}  # both clusters, routes still on the old
    assert routes[2] == ["c", "a"] and routes[3] == {"c"}  # routes moved while the old cluster still exists
    assert prune[2] == ["c"] and set(prune[1]) == {CDS_FILE}
    assert result.removed == ("eds-a.yaml",) and not (d / "eds-a.yaml").exists()


def test_unchanged_files_are_not_rewritten_and_an_endpoint_change_is_one_file(write_config, tmp_path):
    d = tmp_path / "xds"
    snap = snap_of(write_config, {"a": ["10.0.0.1:80"]}, {"/x": "a"})
    writer = XdsWriter(d)
    writer.write(snap, 1, wait=False)
    mtimes = {p.name: p.stat().st_mtime_ns for p in d.iterdir()}
    writer.ack = ack = Recorder(d)
    again = writer.write(snap, 1)
    assert not again and again.changed == () and ack.seen == []
    assert {p.name: p.stat().st_mtime_ns for p in d.iterdir()} == mtimes
    moved = writer.write(snap.with_endpoints({"a": (("10.0.0.1", 80), ("10.0.0.2", 80))}), 1)
    assert moved.changed == ("eds-a.yaml",) and [s[0] for s in ack.seen] == ["clusters"]
    version = json.loads((d / "eds-a.yaml").read_text())["version_info"]
    assert ack.seen[0][1] == {"eds-a.yaml": version}  # the ack learns the version it must see
    assert sorted(p.name for p in d.iterdir()) == ["cds.yaml", "eds-a.yaml", "lds.yaml", "rds.yaml"]  # no temp files


def test_a_refused_step_puts_its_files_back_and_raises(write_config, tmp_path):
    d = tmp_path / "xds"
    old = snap_of(write_config, {"a": ["10.0.0.1:80"]}, {"/x": "a"})
    new = snap_of(write_config, {"a": ["10.0.0.1:80"], "b": ["10.0.0.2:80"]}, {"/x": "a", "/y": "b"})
    writer = XdsWriter(d, ack=None)
    writer.write(old, 1, wait=False)
    before = {p.name: p.read_bytes() for p in d.iterdir()}
    writer.ack = Recorder(d, fail_at="clusters")
    with pytest.raises(XdsError, match="refused in clusters"):
        writer.write(new, 1)
    assert {p.name: p.read_bytes() for p in d.iterdir()} == before  # eds-b.yaml gone again, cds.yaml as it was


def test_worker_count_is_fixed_by_the_bootstrap(write_config, tmp_path):
    snap = snap_of(write_config, {"a": ["10.0.0.1:80"]}, {"/x": "a"})
    writer = XdsWriter(tmp_path / "xds")
    writer.write(snap, 2, wait=False)
    with pytest.raises(XdsError, match="worker count changed from 2 to 3.*restart"):
        writer.write(snap, 3, wait=False)


def test_step_is_its_name_and_subscription_stats_name_the_file(tmp_path):
    step = XdsStep("routes", {RDS_FILE: "v1"}, tmp_path)
    assert step == "routes" and step.files == {RDS_FILE: "v1"}
    assert subscription_stat(LDS_FILE) == "listener_manager.lds"
    assert subscription_stat(CDS_FILE) == "cluster_manager.cds"
    assert subscription_stat(RDS_FILE) == "http.adapter.rds.adapter_routes"
    assert subscription_stat("eds-llm-a.yaml") == "cluster.llm-a"


def test_files_are_json_so_envoy_cannot_misread_a_route_named_n(write_config, tmp_path):
    """PyYAML writes the string `n` plain; Envoy's YAML reader takes it for `false` (seen on 1.40)."""
    snap = snap_of(write_config, {"a": ["10.0.0.1:80"]}, {"/n": "a", "/y": "a"})
    writer = XdsWriter(tmp_path / "xds")
    writer.write(snap, 1, wait=False)
    text = (writer.dir / RDS_FILE).read_text()
    assert '"name": "n"' in text and json.loads(text) == yaml.safe_load(text)
    ok, out = envoy_validate(writer.bootstrap(snap, 1), writer.dir)
    assert ok, out


@pytest.mark.parametrize("path", EXAMPLES)
def test_dynamic_bootstrap_and_its_files_pass_envoy_validate(path, tmp_path):
    snap = load_file(path)
    ips = {n: (("127.0.0.1", 8000 + i),) for i, n in enumerate(snap.backends) if i % 2 == 0}  # some EDS, some DNS
    snap = snap.with_endpoints(ips)
    writer = XdsWriter(tmp_path / "xds")
    writer.write(snap, 2, wait=False)
    boot = writer.bootstrap(snap, 2)
    ok, out = envoy_validate(boot)  # the bootstrap alone: Envoy's validate mode does not read the files
    assert ok, out
    inlined = inline_files(boot, writer.dir)  # so the files are checked inlined as static resources
    assert "dynamic_resources" not in inlined and inlined["static_resources"]["listeners"]
    ok, out = envoy_validate(boot, writer.dir)
    assert ok, out


def test_validate_with_files_catches_what_envoy_would_reject(write_config, tmp_path):
    snap = snap_of(write_config, {"a": ["10.0.0.1:80"]}, {"/x": "a"})
    writer = XdsWriter(tmp_path / "xds")
    writer.write(snap, 1, wait=False)
    cds = json.loads((writer.dir / CDS_FILE).read_text())
    cds["resources"][0]["connect_timeout"] = "-1s"
    (writer.dir / CDS_FILE).write_text(json.dumps(cds))
    assert envoy_validate(writer.bootstrap(snap, 1))[0]  # the bootstrap alone still passes
    ok, out = envoy_validate(writer.bootstrap(snap, 1), writer.dir)
    assert not ok and "Expected positive duration" in out
