"""`spec.bundles`, a route's `bundle:` and rollout bundle arms: a route takes its templates and schema from
a verified adapter bundle's bundle.yaml; every refusal names file, field and reason."""

from __future__ import annotations

import pytest

from extproc.config.loader import ConfigError, load_text
from tests.canary.adapter_bundles import make_bundle, transform
from tests.canary.test_bundle import write_keypair

HEAD = """\
apiVersion: adapter.ai/v1
kind: AdapterGateway
metadata: {{name: bundles}}
spec:
  backends:
    - {{name: llm, endpoints: ["127.0.0.1:9001"], models: [m]}}
  routes:
    - {{path: /summarize, name: summarize, kind: llm, target: llm, transform: '{{"summary": $.output.text}}'{route}}}
    - {{path: /p, name: p, kind: passthrough, target: llm}}
  bundles:
{bundles}
"""


def cfg(tmp_path, bundles: str, route: str = "", tail: str = "") -> str:
    return HEAD.format(bundles=bundles, route=route) + tail


def load(tmp_path, text: str, loaded=()):
    path = tmp_path / "gw.yaml"
    path.write_text(text)
    return load_text(text, str(path), loaded=tuple(str(p) for p in loaded))


def render(route, output):
    return route.transform.render_json({"output": output, "input": {}})


def test_a_declared_bundle_gives_the_route_its_templates_and_the_schema_derived_from_them(tmp_path):
    make_bundle(tmp_path, "1", tag="one")
    snap = load(tmp_path, cfg(tmp_path, "    - {path: summ-1.zip}"))
    r = snap.routes["summarize"]
    assert r.bundle == "summ@1" and snap.active_bundles == {"summ": "summ@1"}
    assert render(r, {"text": "hi"}) == b'{"summary":"hi","v":"one"}'
    assert r.response_schema["required"] == ["text"]
    b = snap.bundles["summ@1"]
    assert (b.name, b.version, b.loaded, b.signed, b.golden, tuple(b.parts)) == ("summ", "1", False, False, 1,
                                                                                ("summarize",))
    assert snap.routes["p"].bundle is None


def test_a_loaded_bundle_is_the_active_version_and_a_pinned_route_keeps_its_own(tmp_path):
    make_bundle(tmp_path, "1", tag="one")
    two = make_bundle(tmp_path, "2", tag="two")
    snap = load(tmp_path, cfg(tmp_path, "    - {name: summ, path: summ-1.zip}"), loaded=[two])
    assert snap.routes["summarize"].bundle == "summ@2" and snap.bundles["summ@2"].loaded
    assert render(snap.routes["summarize"], {"text": "x"}) == b'{"summary":"x","v":"two"}'
    pinned = load(tmp_path, cfg(tmp_path, "    - {name: summ, path: summ-1.zip}", route=", bundle: summ@1"),
                  loaded=[two])
    assert pinned.routes["summarize"].bundle == "summ@1"


def test_rollout_bundle_arms_hang_each_arms_route_on_the_route(tmp_path):
    make_bundle(tmp_path, "1", tag="one")
    make_bundle(tmp_path, "2", tag="two")
    snap = load(tmp_path, cfg(tmp_path, "    - {path: summ-1.zip}\n    - {path: summ-2.zip}", tail="""\
  rollouts:
    - name: ro
      route: summarize
      arms: [{name: v1, bundle: summ@1}, {name: v2, bundle: summ@2, weight: 50}]
      key: {sources: [{header: x-user-id}], trustedHeaders: [x-user-id]}
"""))
    r = snap.routes["summarize"]
    assert r.bundle is None  # the arms are the bundles: the route's own transform stays for no arm
    assert dict(snap.rollouts["ro"].arm_backends) == {"v1": "llm", "v2": "llm"}
    assert render(r.variants["v1"], {"text": "a"}) == b'{"summary":"a","v":"one"}'
    assert render(r.variants["v2"], {"text": "a"}) == b'{"summary":"a","v":"two"}'
    assert r.variants["v2"].bundle == "summ@2"


@pytest.mark.parametrize("bundles, route, tail, where, reason", [
    ("    - {}", "", "", "spec.bundles[0].name", "needs a path"),
    ("    - {path: nope.zip}", "", "", "spec.bundles[0].path", "cannot be read"),
    ("    - {name: other, path: summ-1.zip}", "", "", "spec.bundles[0].name", "named 'summ' in its manifest"),
    ("    - {path: summ-1.zip}", ", bundle: summ@9", "", "spec.routes[0].bundle", "no adapter bundle 'summ@9'"),
    ("    - {path: summ-1.zip}", "", """\
  rollouts:
    - {name: ro, route: summarize, arms: [{name: a, bundle: summ@1}, {name: b, bundle: summ@3, weight: 5}]}
""", "spec.rollouts[0].arms[1].bundle", "no adapter bundle 'summ@3'"),
    ("    - {path: summ-1.zip}", "", """\
  rollouts:
    - {name: ro, route: summarize, arms: [{name: a, bundle: summ}, {name: b, bundle: summ@1, weight: 5}]}
""", "spec.rollouts[0].arms[0].bundle", "names no version"),
    ("    - {path: summ-1.zip}", "", """\
  rollouts:
    - {name: ro, route: summarize, arms: [{name: a, bundle: summ@1, backend: llm}, {name: b, bundle: summ@1, weight: 5}]}
""", "spec.rollouts[0].arms[0].backend", "not both"),
])
def test_refusals_name_the_line_the_field_and_why(tmp_path, bundles, route, tail, where, reason):
    make_bundle(tmp_path, "1")
    with pytest.raises(ConfigError) as e:
        load(tmp_path, cfg(tmp_path, bundles, route, tail))
    issues = [(i.path, i.reason) for i in e.value.issues]
    assert any(p == where and reason in r for p, r in issues), issues
    assert all(i.where.startswith(str(tmp_path / "gw.yaml") + ":") for i in e.value.issues)


def test_a_bundle_yaml_template_error_names_the_bundle_file_and_line(tmp_path):
    make_bundle(tmp_path, "1", doc="routes:\n  summarize:\n    transform: |\n      {\"a\": $.output.x,,}\n")
    with pytest.raises(ConfigError) as e:
        load(tmp_path, cfg(tmp_path, "    - {path: summ-1.zip}"))
    (issue,) = e.value.issues
    assert issue.path == "spec.bundles[0].path"
    assert "bundle summ-1.zip: bundle.yaml:4: routes.summarize.transform: template error" in issue.reason


def test_an_unknown_field_in_bundle_yaml_is_refused_with_its_line(tmp_path):
    make_bundle(tmp_path, "1", doc="routes:\n  summarize:\n    transfrom: x\n")
    with pytest.raises(ConfigError) as e:
        load(tmp_path, cfg(tmp_path, "    - {path: summ-1.zip}"))
    assert "bundle.yaml:3: routes.summarize.transfrom: unknown field" in str(e.value)


def test_a_tampered_bundle_and_an_unsigned_one_where_a_key_is_required_are_refused(tmp_path):
    import zipfile

    good = make_bundle(tmp_path, "1")
    bad = tmp_path / "summ-x.zip"
    with zipfile.ZipFile(good) as zin, zipfile.ZipFile(bad, "w") as zout:
        for info in zin.infolist():
            data = zin.read(info)
            zout.writestr(info, data.replace(b'"v": "one"', b'"v": "evil"') if info.filename == "bundle.yaml" else data)
    with pytest.raises(ConfigError, match=r"bundle\.yaml: sha256: content hashes to"):
        load(tmp_path, cfg(tmp_path, "    - {path: summ-x.zip}"))
    _, pub = write_keypair(tmp_path, "k")
    with pytest.raises(ConfigError, match=r"manifest\.sig: signature: is missing"):
        load(tmp_path, cfg(tmp_path, f"    - {{path: summ-1.zip, publicKey: {pub}}}"))
    priv, _ = write_keypair(tmp_path, "other")
    make_bundle(tmp_path, "2", sign_key=priv)
    with pytest.raises(ConfigError, match=r"does not verify with the given public key"):
        load(tmp_path, cfg(tmp_path, f"    - {{path: summ-2.zip, publicKey: {pub}}}"))


def test_a_loaded_bundle_needs_its_name_declared_and_takes_that_entrys_key(tmp_path):
    two = make_bundle(tmp_path, "2")
    with pytest.raises(ConfigError, match=r"named 'summ', which spec.bundles does not declare"):
        load(tmp_path, cfg(tmp_path, "    - {name: other}"), loaded=[two])
    _, pub = write_keypair(tmp_path, "k")
    with pytest.raises(ConfigError, match=r"signature: is missing"):
        load(tmp_path, cfg(tmp_path, f"    - {{name: summ, publicKey: {pub}}}"), loaded=[two])


def test_the_transform_helper_is_what_the_bundle_holds():
    assert transform("one") == '{"summary": $.output.text, "v": "one"}'


PLUGINS = """\
  plugins:
    - {name: prefix, type: prefix-cache-scorer, parameters: {blockSize: 64}}
    - {name: pin, type: pinned-endpoint, parameters: {endpoint: "127.0.0.1:9001"}}
  schedulingProfiles:
    - {name: prof, plugins: [{pluginRef: prefix}]}
"""


def plugin_cfg(tmp_path, route_plugins: str, bundle: str = "    - {path: summ-1.zip}", tail: str = "") -> str:
    text = cfg(tmp_path, bundle, route=f", plugins: [{route_plugins}]") + PLUGINS + tail
    return text


def test_a_bundle_sets_the_parameters_of_the_routes_plugins_as_instances_of_its_own(tmp_path):
    make_bundle(tmp_path, "1", doc="routes:\n  summarize:\n    transform: '{\"s\": $.output.text}'\n"
                                   "    plugins: {prefix: {maxPrefixBlocksToMatch: 8}}\n")
    snap = load(tmp_path, plugin_cfg(tmp_path, "prof"))
    picker = snap.routes["summarize"].picker
    assert picker.name == "prof@summ@1" and snap.profiles[picker.name] is picker
    (scorer, weight), = picker.scorers
    assert scorer.name == "prefix@summ@1" and scorer.params.block_size == 64  # the declared, kept
    assert scorer.params.max_prefix_blocks_to_match == 8 and weight == 1.0  # the bundle's, merged over
    assert snap.profiles["prof"].scorers[0][0].params.max_prefix_blocks_to_match != 8  # the declared one unchanged
    make_bundle(tmp_path, "2", doc="routes:\n  summarize:\n    transform: '{\"s\": $.output.text}'\n"
                                   "    plugins: {pin: {endpoint: \"127.0.0.1:9001\"}}\n")
    snap = load(tmp_path, plugin_cfg(tmp_path, "pin", bundle="    - {path: summ-2.zip}"))
    assert snap.routes["summarize"].picker.name == "pin@summ@2" and "pin@summ@2" in snap.plugins


@pytest.mark.parametrize("params, reason", [
    ("{other: {a: 1}}", "routes.summarize.plugins.other: the route's scheduler uses no plugin 'other' (it uses: prefix"),
    ("{prefix: {nope: 1}}", "routes.summarize.plugins.prefix.nope: unknown parameter"),
    ("{prefix: {blockSize: -3}}", "routes.summarize.plugins.prefix.blockSize:"),
])
def test_plugin_parameter_refusals_name_the_bundle_route_plugin_and_parameter(tmp_path, params, reason):
    make_bundle(tmp_path, "1", doc=f"routes:\n  summarize:\n    plugins: {params}\n")
    with pytest.raises(ConfigError) as e:
        load(tmp_path, plugin_cfg(tmp_path, "prof"))
    assert any(i.path == "spec.routes[0].bundle" and reason in i.reason for i in e.value.issues), e.value.issues


def test_a_bundle_arm_cannot_carry_plugin_parameters(tmp_path):
    make_bundle(tmp_path, "1", doc="routes:\n  summarize:\n    plugins: {prefix: {blockSize: 32}}\n")
    make_bundle(tmp_path, "2")
    with pytest.raises(ConfigError, match="a bundle arm cannot"):
        load(tmp_path, plugin_cfg(tmp_path, "prof", bundle="    - {path: summ-1.zip}\n    - {path: summ-2.zip}",
                                  tail="""\
  rollouts:
    - {name: ro, route: summarize, arms: [{name: a, bundle: summ@2}, {name: b, bundle: summ@1, weight: 5}]}
"""))


def test_a_worker_runtime_builds_and_keeps_the_bundles_plugin_instances(tmp_path):
    from extproc.runtime import Runtime

    make_bundle(tmp_path, "1", doc="routes:\n  summarize:\n    plugins: {prefix: {maxPrefixBlocksToMatch: 8}}\n")
    snap = load(tmp_path, plugin_cfg(tmp_path, "prof"))
    rt = Runtime()
    rt.install(snap)
    prof = rt.plugin(snap.routes["summarize"].picker)
    (name, inst, _, _), = prof.scorers
    assert name == "prefix@summ@1" and inst.params.max_prefix_blocks_to_match == 8
    assert rt.plugin(snap.plugins["prefix"]) is not inst  # the declared plugin is another instance
    rt.install(load(tmp_path, plugin_cfg(tmp_path, "prof")))  # a reload of the same: the instance is kept
    assert rt.plugin(snap.routes["summarize"].picker).scorers[0][1] is inst


def test_bundle_arms_take_a_step_plan_like_backend_arms(tmp_path):
    make_bundle(tmp_path, "1")
    make_bundle(tmp_path, "2", tag="two")
    snap = load(tmp_path, cfg(tmp_path, "    - {path: summ-1.zip}\n    - {path: summ-2.zip}", tail="""\
  rollouts:
    - name: ro
      route: summarize
      arms: [{name: v1, bundle: summ@1}, {name: v2, bundle: summ@2, weight: 0}]
      plan: {steps: [5, 50, 100], minSamples: 100}
"""))
    ref = snap.rollouts["ro"]
    assert ref.control.plan.steps == (5, 50, 100) and ref.arms == ("v1", "v2")
    assert set(snap.routes["summarize"].variants) == {"v1", "v2"}
